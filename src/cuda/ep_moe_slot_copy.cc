// SPDX-License-Identifier: Apache-2.0
// DeviceEpMoe's slot copies: this rank's slot buffers registered for peers' weight movers,
// and copy_slot, device to device through a mapping or the transport's reads (ep_moe.h).
#include <string>

#include "cuda/ep_moe.h"
#include "cuda/ep_moe_peers.h"

namespace flexpert::cuda {

using ep_moe_detail::kSlotsBuffer;

Status DeviceEpMoe::register_slot_buffers() {
  Transport& transport = ep_->transport();
  for (int layer : config_.moe_layers) {
    FLEX_RETURN_IF_ERROR(transport
                             .register_buffer(kSlotsBuffer + layer,
                                              const_cast<void*>(config_.layer_slots(layer)),
                                              slot_buffer_bytes())
                             .annotate("slot buffer of layer " + std::to_string(layer)));
  }
  slot_maps_.resize(static_cast<size_t>(transport.max_ranks()));
  direct_reads_ = transport.capabilities().device_buffer_reads;
  return Status();
}

Status DeviceEpMoe::copy_slot(int layer, int src_rank, size_t offset, void* dst, size_t bytes,
                              cudaStream_t stream) {
  if (!device_exchange_ && !direct_reads_) {
    return unimplemented("no device exchange, and the transport reads no device buffers");
  }
  const size_t buffer_bytes = slot_buffer_bytes();
  if (offset + bytes > buffer_bytes || offset + bytes < offset) {
    return invalid_argument("slot copy of " + std::to_string(bytes) + " bytes at " +
                            std::to_string(offset) + " past the slot buffer");
  }
  uint64_t generation = 0;
  {
    std::lock_guard<std::mutex> lock(slots_mu_);
    Result<bool> copied = copy_mapped_slot(layer, src_rank, offset, dst, bytes, stream);
    if (!copied.ok() || copied.value()) return copied.status();
    generation = slots_generation_;
  }
  // Never mappable here (another host): a CUDA-aware UCX gets it into `dst`, returning once it
  // landed, where the caller would read the host mirror and upload it (docs/ARCHITECTURE.md,
  // "GPU ranks on different hosts"). `dst` is a free slot, so nothing on `stream` is ordered
  // against it. NOTE: without slots_mu_: the read may wait up to the transport's timeout on a
  // silent peer, and map_peers, on the stepping thread, takes slots_mu_ at an epoch change.
  // The read uses no mapping; what the lock gave it, that no map_peers released the source's
  // slots while it ran, the generation check gives: such a copy fails Aborted (the epoch
  // changed) and its bytes in `dst` are not vouched for.
  Transport& transport = ep_->transport();
  const Status read = transport.read(src_rank, kSlotsBuffer + layer, offset, dst, bytes)
                          .annotate("slots of layer " + std::to_string(layer) + " of rank " +
                                    std::to_string(src_rank) + " (device to device over ucx)");
  std::lock_guard<std::mutex> lock(slots_mu_);
  if (slots_generation_ != generation) {
    return aborted("slots of layer " + std::to_string(layer) + " of rank " +
                   std::to_string(src_rank) + ": the group changed during the read" +
                   (read.ok() ? "" : " (" + read.message() + ")"));
  }
  return read;
}

Result<bool> DeviceEpMoe::copy_mapped_slot(int layer, int src_rank, size_t offset, void* dst,
                                           size_t bytes, cudaStream_t stream) {
  Transport& transport = ep_->transport();
  const uint8_t* src = nullptr;
  if (src_rank == transport.rank()) {
    src = static_cast<const uint8_t*>(config_.layer_slots(layer));
  } else {
    if (src_rank < 0 || src_rank >= static_cast<int>(slot_maps_.size())) {
      return invalid_argument("rank " + std::to_string(src_rank) + " out of range");
    }
    // Mapping a layer's slots of another process takes ~19 us per MB of the buffer across
    // GPUs (H200 x2: 1.2 GB for a Qwen3-30B-A3B layer) and ~8 us on the same GPU under MPS,
    // and the driver holds this process's stepping thread meanwhile (H200, 4 -> 2: a
    // survivor mapping the leavers' slots stalled the group 11-23 ms). A serving rank maps
    // none: it copies from a buffer mapped before (a joiner maps them while it prepares)
    // or answers Unimplemented, and the caller copies through the host mirrors (that stall
    // 1.3-2.3 ms; docs/benchmarks.md, "Losing a rank"). Slots of a rank on another host are
    // never mapped (hier answers Unimplemented): a device read over the transport where it
    // has them, else the host mirrors, read over the network.
    const MapMode mode = stepped_.load() ? MapMode::kLookup : MapMode::kMap;
    Result<PeerBuffer> mapped = transport.map_peer_buffer(src_rank, kSlotsBuffer + layer, mode);
    if (!mapped.ok()) {
      if (mapped.status().code() != StatusCode::kUnimplemented) {
        return mapped.status().annotate("slot buffers of rank " + std::to_string(src_rank));
      }
      if (direct_reads_) return false;  // Another host: read() into `dst`.
      return unimplemented("rank " + std::to_string(src_rank) + "'s slots of layer " +
                           std::to_string(layer) + " are not mappable (" +
                           mapped.status().message() + ")");
    }
    if (mapped->data == nullptr) {  // kLookup: not mapped yet, and this rank serves.
      return unimplemented("rank " + std::to_string(src_rank) + "'s slots of layer " +
                           std::to_string(layer) + " are not mapped, and a serving rank maps " +
                           "none");
    }
    const size_t buffer_bytes = slot_buffer_bytes();
    if (mapped->num_bytes != buffer_bytes) {
      return data_loss("rank " + std::to_string(src_rank) + "'s slot buffer of layer " +
                       std::to_string(layer) + " has " + std::to_string(mapped->num_bytes) +
                       " bytes, expected " + std::to_string(buffer_bytes));
    }
    std::unique_ptr<SlotMapping>& m = slot_maps_[src_rank];
    if (m == nullptr || m->incarnation != mapped->incarnation) {
      m = std::make_unique<SlotMapping>();  // A new rank or incarnation.
      m->incarnation = mapped->incarnation;
    }
    src = static_cast<const uint8_t*>(mapped->data);
    m->layers[layer] = std::move(mapped).value();  // Held until the mapping is released.
  }
  if (src == nullptr) return invalid_argument("layer " + std::to_string(layer) + " has no slots");
  if (src + offset == dst) return true;  // A slot onto itself.
  FLEX_CUDA_TRY(cudaMemcpyAsync(dst, src + offset, bytes, cudaMemcpyDeviceToDevice, stream));
  FLEX_CUDA_TRY(cudaStreamSynchronize(stream));
  return true;
}
}  // namespace flexpert::cuda
