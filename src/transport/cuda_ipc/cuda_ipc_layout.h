// SPDX-License-Identifier: Apache-2.0
// Layout of a cuda_ipc rank: its control segment in host shared memory and its receive
// buffer in device memory.
//
//   control segment "/flexpert-<session>-r<rank>-i<incarnation>" (host, POSIX shm):
//     [shm::SegmentHeader][gather mailbox headers [src][parity]][exchange mailbox headers]
//     [DeviceInfo][RegionEntry x kMaxRegions]
//   receive buffer (device, one cudaMalloc at creation, exported through DeviceInfo):
//     [gather slots [src][parity]][exchange slots [src][parity]]
//
// The first part is the shm backend's layout with empty payloads (shm::Layout::compute with
// zero capacities), so mailbox states, epochs, doorbells and liveness are the shm backend's
// protocol (shm_layout.h) unchanged. Only the payload moved: mailbox [src][p] of rank R's
// segment announces the bytes in slot [src][p] of R's receive buffer, which rank src wrote
// with a device-to-device copy that completed before it published the mailbox Full.
// Everything but the atomics is written by the owner before it publishes `magic` (release)
// and is constant afterwards; a RegionEntry is written before its `published` flag.
#pragma once

#include <cuda_runtime_api.h>

#include <atomic>
#include <cstddef>
#include <cstdint>

#include "flexpert/status.h"
#include "transport/shm/shm_layout.h"

namespace flexpert::cuda_ipc {

inline constexpr uint64_t kMagic = 0x3150494355435846ULL;  // "FXCUCIP1", little-endian.
inline constexpr uint32_t kLayoutVersion = 2;
inline constexpr int kMaxRegions = 1024;          // Regions one rank may allocate.
inline constexpr size_t kDeviceAlignBytes = 256;  // Of every receive slot.
inline constexpr size_t kIpcHandleBytes = sizeof(cudaIpcMemHandle_t);

struct DeviceInfo {
  int32_t device;  // The owner's ordinal (in its own process; for messages).
  // Tells the owner's process apart from every other on the host (a pid does not across PID
  // namespaces): a rank of the same process uses the addresses, never the IPC handles.
  uint64_t process_token;
  char pci_bus_id[32];    // Names the GPU across processes.
  uint64_t recv_bytes;    // Size of the receive buffer.
  uint64_t recv_address;  // Its address in the owner's process (used by the same process).
  unsigned char recv_handle[kIpcHandleBytes];
};

struct alignas(shm::kCacheLineBytes) RegionEntry {
  std::atomic<uint32_t> published;  // 1 once the fields below are valid (release).
  int32_t region_id;
  uint64_t num_bytes;
  uint64_t address;  // In the owner's process.
  unsigned char handle[kIpcHandleBytes];
};

static_assert(std::atomic<uint32_t>::is_always_lock_free);

struct Layout {
  shm::Layout mailboxes;  // Header-only mailboxes.
  size_t info_offset = 0;
  size_t regions_offset = 0;
  size_t total_bytes = 0;  // Of the control segment.
  // The receive buffer.
  size_t gather_stride = 0;
  size_t exchange_stride = 0;
  size_t exchange_offset = 0;
  size_t recv_bytes = 0;

  // InvalidArgument for zero ranks or absurd sizes (shm::Layout's limits).
  static Result<Layout> compute(int max_ranks, size_t max_gather_bytes, size_t max_exchange_bytes);

  // Offset in the receive buffer of the slot that `src_rank` fills in op `op_idx`.
  size_t slot_offset(bool exchange, int src_rank, uint64_t op_idx) const {
    const size_t slot = static_cast<size_t>(src_rank) * 2 + (op_idx & 1);
    return exchange ? exchange_offset + slot * exchange_stride : slot * gather_stride;
  }
  DeviceInfo* info(std::byte* base) const {
    return reinterpret_cast<DeviceInfo*>(base + info_offset);
  }
  RegionEntry* region(std::byte* base, int idx) const {
    return reinterpret_cast<RegionEntry*>(base + regions_offset) + idx;
  }
};

}  // namespace flexpert::cuda_ipc
