// SPDX-License-Identifier: Apache-2.0
#include "transport/cuda_ipc/cuda_ipc_layout.h"

#include <algorithm>

namespace flexpert::cuda_ipc {

namespace {

size_t round_up(size_t n, size_t align) { return (n + align - 1) / align * align; }

}  // namespace

Result<Layout> Layout::compute(int max_ranks, size_t max_gather_bytes, size_t max_exchange_bytes) {
  // The payload limits are checked by the same rules as the shm segment's.
  FLEX_RETURN_IF_ERROR(
      shm::Layout::compute(max_ranks, max_gather_bytes, max_exchange_bytes).status());
  Layout l;
  FLEX_ASSIGN_OR_RETURN(l.mailboxes, shm::Layout::compute(max_ranks, 0, 0));
  l.info_offset = l.mailboxes.total_bytes;
  l.regions_offset = round_up(l.info_offset + sizeof(DeviceInfo), shm::kCacheLineBytes);
  l.total_bytes = round_up(l.regions_offset + kMaxRegions * sizeof(RegionEntry), 4096);
  const size_t num_slots = static_cast<size_t>(max_ranks) * 2;
  // Strides are < 2^41 and num_slots <= 2^13: no overflow.
  l.gather_stride = round_up(max_gather_bytes, kDeviceAlignBytes);
  l.exchange_stride = round_up(max_exchange_bytes, kDeviceAlignBytes);
  l.exchange_offset = num_slots * l.gather_stride;
  l.recv_bytes =
      std::max<size_t>(l.exchange_offset + num_slots * l.exchange_stride, kDeviceAlignBytes);
  return l;
}

}  // namespace flexpert::cuda_ipc
