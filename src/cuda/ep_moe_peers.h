// SPDX-License-Identifier: Apache-2.0
// DeviceEpMoe's private parts that its files share (ep_moe.cc: a step and the host
// exchange; ep_moe_peers.cc: mapping members' buffers; ep_moe_device.cc: the device exchange
// of a step; ep_moe_slot_copy.cc: slot copies). Included by those files only.
#pragma once

#include <chrono>
#include <cstdint>
#include <functional>
#include <map>
#include <memory>
#include <vector>

#include "core/clock.h"
#include "cuda/ep_moe.h"

namespace flexpert::cuda::ep_moe_detail {

// The buffers a rank registers with its transport (Transport::register_buffer) for peers to
// map: the device exchange's (kWindowBuffer + WindowBuffer), then its slot buffer of each MoE
// layer (kSlotsBuffer + layer). Above the region ids the worker uses (layers).
enum WindowBuffer { kWindow, kRouteH, kRouteSlot, kY, kRowOfPair, kNumWindowBuffers };
constexpr int kWindowBuffer = 1 << 20;
constexpr int kSlotsBuffer = kWindowBuffer + kNumWindowBuffers;

using flexpert::now_ns;

}  // namespace flexpert::cuda::ep_moe_detail

namespace flexpert::cuda {

// A rank's slot buffers as mapped by the weight mover.
struct DeviceEpMoe::SlotMapping {
  uint64_t incarnation = 0;          // Of the owner (a new one is mapped afresh).
  std::map<int, PeerBuffer> layers;  // Layer -> its slot buffer.
};

// A member's buffers as mapped into this process.
struct DeviceEpMoe::PeerMapping {
  int rank = -1;
  uint64_t incarnation = 0;
  std::vector<PeerBuffer> maps;  // The buffers opened so far, in WindowBuffer order.
  void* at[ep_moe_detail::kNumWindowBuffers] = {};  // The buffers opened so far (open_peer).
  int opened = 0;
  int64_t open_ns = 0;  // Spent opening them.
  EpPeer peer;
  std::function<bool()> owner_exited;  // PeerBuffer::owner_exited of its buffers (null: none).
  std::function<bool()> owner_ending;  // PeerBuffer::owner_ending of its buffers (null: none).
};

struct DeviceEpMoe::Retired {
  std::unique_ptr<PeerMapping> peer;
  std::unique_ptr<SlotMapping> slots;
  int64_t since_ns = 0;
  bool living = false;  // The owner lived at the retirement: closed at once.
};

}  // namespace flexpert::cuda
