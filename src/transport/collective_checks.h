// SPDX-License-Identifier: Apache-2.0
// Argument checks every backend makes, with the same messages: a collective's group
// (transport.h's contract) and payloads, and read()'s peer, destination and byte range. Pure
// functions of their arguments; thread-safe.
#pragma once

#include <cstddef>
#include <string>
#include <vector>

#include "flexpert/status.h"
#include "transport/transport.h"

namespace flexpert {

// InvalidArgument unless `group.ranks` is ascending, unique and in [0, options.max_ranks);
// FailedPrecondition when a member other than options.rank is not connected (`is_connected(r)`
// false) or options.rank is not a member. Ranks are checked in order: the first fault is named.
template <typename IsConnected>
Status validate_group(const Group& group, const char* op, const TransportOptions& options,
                      IsConnected is_connected) {
  bool is_member = false;
  int prev = -1;
  for (int r : group.ranks) {
    if (r <= prev || r >= options.max_ranks) {
      return invalid_argument(
          std::string(op) + ": group ranks must be ascending, unique and in [0, " +
          std::to_string(options.max_ranks) + "), got rank " + std::to_string(r));
    }
    prev = r;
    if (r == options.rank) {
      is_member = true;
    } else if (!is_connected(r)) {
      return failed_precondition(std::string(op) + ": group member rank " + std::to_string(r) +
                                 " is not connected");
    }
  }
  if (!is_member) {
    return failed_precondition(std::string(op) + ": rank " + std::to_string(options.rank) +
                               " is not a member of the group of epoch " +
                               std::to_string(group.epoch));
  }
  return Status();
}

// The payloads of a collective over a valid group: `sends[r * stride]` for rank r (stride 0:
// one payload for all, as all_gather and barrier). InvalidArgument for a payload above the
// capacity (max_exchange_bytes when `is_exchange`, else max_gather_bytes), null data with
// bytes, or bytes for a rank outside the group.
Status validate_sends(const Group& group, const char* op, bool is_exchange, const ByteSpan* sends,
                      size_t stride, const TransportOptions& options);

// exchange(): one span per rank in [0, options.max_ranks).
Status validate_send_count(const std::vector<ByteSpan>& send, const TransportOptions& options);

// read(): InvalidArgument for a peer outside [0, options.max_ranks) or a null destination.
Status validate_read(int peer, const void* dst, size_t num_bytes, const TransportOptions& options);
// read(): InvalidArgument "<what>: bytes [offset, +num_bytes) outside its N bytes" unless the
// range lies within a region of `region_bytes`.
Status check_read_range(const std::string& what, size_t offset, size_t num_bytes,
                        size_t region_bytes);

}  // namespace flexpert
