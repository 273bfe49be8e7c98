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
  Transport& transport = ep_->transport();
  const uint8_t* src = nullptr;
  // Held until the copy landed: map_peers releases a departed rank's mappings under it.
  std::lock_guard<std::mutex> lock(slots_mu_);
  if (src_rank == transport.rank()) {
    src = static_cast<const uint8_t*>(config_.layer_slots(layer));
  } else {
    if (src_rank < 0 || src_rank >= static_cast<int>(slot_maps_.size())) {
      return invalid_argument("rank " + std::to_string(src_rank) + " out of range");
    }
    // Mapping a layer's slots of another GPU takes ~19 us per MB of the buffer (H200 x2:
    // 1.2 GB for a Qwen3-30B-A3B layer), and the driver holds this process's stepping
    // thread meanwhile (a 21 ms step in a rebalance): a serving rank takes the host
    // mirrors instead (the transport answers Unimplemented). A joiner, not serving yet, maps
    // them while it prepares. Slots of a rank on another host are never mapped (hier answers
    // Unimplemented): the host mirrors, read over the network.
    const MapMode mode = stepped_.load() ? MapMode::kMapSameDevice : MapMode::kMap;
    Result<PeerBuffer> mapped = transport.map_peer_buffer(src_rank, kSlotsBuffer + layer, mode);
    if (!mapped.ok()) {
      if (mapped.status().code() == StatusCode::kUnimplemented && direct_reads_ &&
          !transport.map_peer_buffer(src_rank, kSlotsBuffer + layer, MapMode::kLookup).ok()) {
        // Never mappable here (kLookup refused too: another host, not a same-host GPU that
        // kMapSameDevice declined): a CUDA-aware UCX gets it into `dst`, returning once it
        // landed, where the caller would read the host mirror and upload it. `dst` is a free
        // slot, so nothing on `stream` is ordered against it.
        return transport.read(src_rank, kSlotsBuffer + layer, offset, dst, bytes)
            .annotate("slots of layer " + std::to_string(layer) + " of rank " +
                      std::to_string(src_rank) + " (device to device over ucx)");
      }
      if (mapped.status().code() == StatusCode::kUnimplemented) {
        return unimplemented("rank " + std::to_string(src_rank) + "'s slots of layer " +
                             std::to_string(layer) + " are not mapped (" +
                             mapped.status().message() + ")");
      }
      return mapped.status().annotate("slot buffers of rank " + std::to_string(src_rank));
    }
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
  if (src + offset == dst) return Status();  // A slot onto itself.
  FLEX_CUDA_TRY(cudaMemcpyAsync(dst, src + offset, bytes, cudaMemcpyDeviceToDevice, stream));
  FLEX_CUDA_TRY(cudaStreamSynchronize(stream));
  return Status();
}
}  // namespace flexpert::cuda
