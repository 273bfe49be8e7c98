// SPDX-License-Identifier: Apache-2.0
// DeviceEpMoe::copy_slot: the weight mover's device-to-device slot copies (ep_moe.h).
#include <string>

#include "cuda/ep_moe.h"
#include "cuda/ep_moe_peers.h"

namespace flexpert::cuda {

using ep_moe_detail::kSlotsBuffer;

Status DeviceEpMoe::copy_slot(int layer, int src_rank, size_t offset, void* dst, size_t bytes,
                              cudaStream_t stream) {
  if (!device_exchange_) return unimplemented("no device exchange");
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
