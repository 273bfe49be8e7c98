// SPDX-License-Identifier: Apache-2.0
#include "transport/collective_checks.h"

namespace flexpert {

Status validate_sends(const Group& group, const char* op, bool is_exchange, const ByteSpan* sends,
                      size_t stride, const TransportOptions& options) {
  const size_t capacity = is_exchange ? options.max_exchange_bytes : options.max_gather_bytes;
  size_t next_member = 0;  // The group is ascending: walk it beside r.
  for (int r = 0; r < (stride == 0 ? 1 : options.max_ranks); ++r) {
    const ByteSpan& s = sends[static_cast<size_t>(r) * stride];
    const bool member =
        stride == 0 || (next_member < group.ranks.size() && group.ranks[next_member] == r);
    if (stride != 0 && member) ++next_member;
    if (s.num_bytes > capacity) {
      return invalid_argument(std::string(op) + ": " + std::to_string(s.num_bytes) +
                              " bytes for rank " + std::to_string(r) + " exceed the capacity of " +
                              std::to_string(capacity) +
                              (is_exchange ? " (max_exchange_bytes)" : " (max_gather_bytes)"));
    }
    if (s.num_bytes > 0 && s.data == nullptr) {
      return invalid_argument(std::string(op) + ": null data for rank " + std::to_string(r));
    }
    if (!member && s.num_bytes > 0) {
      return invalid_argument(std::string(op) + ": " + std::to_string(s.num_bytes) +
                              " bytes for rank " + std::to_string(r) + ", not a group member");
    }
  }
  return Status();
}

Status validate_send_count(const std::vector<ByteSpan>& send, const TransportOptions& options) {
  if (send.size() != static_cast<size_t>(options.max_ranks)) {
    return invalid_argument("exchange: send has " + std::to_string(send.size()) +
                            " spans, expected max_ranks=" + std::to_string(options.max_ranks));
  }
  return Status();
}

Status validate_read(int peer, const void* dst, size_t num_bytes, const TransportOptions& options) {
  if (peer < 0 || peer >= options.max_ranks) {
    return invalid_argument("read: rank " + std::to_string(peer) + " not in [0, " +
                            std::to_string(options.max_ranks) + ")");
  }
  if (dst == nullptr && num_bytes > 0) return invalid_argument("read: null destination");
  return Status();
}

Status check_read_range(const std::string& what, size_t offset, size_t num_bytes,
                        size_t region_bytes) {
  if (offset > region_bytes || num_bytes > region_bytes - offset) {
    return invalid_argument(what + ": bytes [" + std::to_string(offset) + ", +" +
                            std::to_string(num_bytes) + ") outside its " +
                            std::to_string(region_bytes) + " bytes");
  }
  return Status();
}

}  // namespace flexpert
