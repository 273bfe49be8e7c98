// SPDX-License-Identifier: Apache-2.0
// ShmTransport collectives: shm::MailboxProtocol (shm_protocol.h) with the payloads in the
// mailboxes. A collective writes this rank's payload straight into each member's mailbox (one
// memcpy) and returns spans into its own (zero copy).
#include <algorithm>
#include <cstring>

#include "transport/collective_checks.h"
#include "transport/shm/shm_peers.h"
#include "transport/shm/shm_transport.h"

namespace flexpert {

using shm::MailboxHeader;
using shm::OpKind;

Result<std::vector<ByteSpan>> ShmTransport::all_gather(const Group& group, ByteSpan in) {
  std::vector<ByteSpan> out(static_cast<size_t>(options_.max_ranks));
  FLEX_RETURN_IF_ERROR(run_collective(OpKind::kAllGather, group, &in, 0, &out));
  return out;
}

Status ShmTransport::barrier(const Group& group) {
  const ByteSpan none;
  return run_collective(OpKind::kBarrier, group, &none, 0, nullptr);
}

Result<std::vector<ByteSpan>> ShmTransport::exchange(const Group& group,
                                                     const std::vector<ByteSpan>& send) {
  FLEX_RETURN_IF_ERROR(validate_send_count(send, options_));
  std::vector<ByteSpan> out(static_cast<size_t>(options_.max_ranks));
  FLEX_RETURN_IF_ERROR(run_collective(OpKind::kExchange, group, send.data(), 1, &out));
  return out;
}

Status ShmTransport::run_collective(OpKind kind, const Group& group, const ByteSpan* sends,
                                    size_t stride, std::vector<ByteSpan>* out) {
  const char* op = shm::op_kind_name(kind);
  if (shut_down_) return failed_precondition(std::string(op) + " after shutdown");
  FLEX_RETURN_IF_ERROR(validate_group(
      group, op, options_, [this](int r) { return peers_[static_cast<size_t>(r)] != nullptr; }));
  const bool is_exchange = kind == OpKind::kExchange;
  FLEX_RETURN_IF_ERROR(validate_sends(group, op, is_exchange, sends, stride, options_));

  FLEX_ASSIGN_OR_RETURN(const int64_t start_ns, protocol_.start_op(group.epoch, op));
  const int64_t deadline_ns = protocol_.deadline_ns(start_ns);

  // Send to the members after us first, wrapping around, so that the ranks do not all copy
  // into rank 0's segment at the same time.
  const int me = options_.rank;
  const size_t num_members = group.ranks.size();
  const size_t my_idx = static_cast<size_t>(
      std::lower_bound(group.ranks.begin(), group.ranks.end(), me) - group.ranks.begin());
  for (size_t i = 1; i < num_members; ++i) {
    const int r = group.ranks[(my_idx + i) % num_members];
    FLEX_RETURN_IF_ERROR(
        send_to(*peers_[r], kind, sends[static_cast<size_t>(r) * stride], deadline_ns));
  }
  const ByteSpan& mine = sends[static_cast<size_t>(me) * stride];
  FLEX_RETURN_IF_ERROR(send_to(*peers_[me], kind, mine, deadline_ns));

  protocol_.clear_awaited();
  for (int r : group.ranks) {
    MailboxHeader* mb = protocol_.own_mailbox(is_exchange, r);
    protocol_.await({r, mb, peers_[r].get(), mb->payload()});
  }
  return protocol_.wait_for(kind, mine, start_ns, out);
}

Status ShmTransport::send_to(const Peer& peer, OpKind kind, ByteSpan payload, int64_t deadline_ns) {
  MailboxHeader* mb = nullptr;
  FLEX_RETURN_IF_ERROR(protocol_.claim(peer, kind, deadline_ns, &mb));
  protocol_.write_header(mb, kind, payload.num_bytes);
  if (payload.num_bytes > 0) std::memcpy(mb->payload(), payload.data, payload.num_bytes);
  protocol_.publish(peer, mb);
  return Status();
}

Status ShmTransport::peer_status(int peer) const {
  return shm::peer_status_of(options_, peers_, peer);
}

Status ShmTransport::mark_peer_lost(int peer, const std::string& why) {
  if (peer < 0 || peer >= options_.max_ranks || peer == options_.rank) {
    return invalid_argument("mark_peer_lost: bad peer rank " + std::to_string(peer));
  }
  std::lock_guard<std::mutex> lock(peers_mu_);
  if (shut_down_) return failed_precondition("mark_peer_lost after shutdown");
  Peer* p = peers_[peer].get();
  if (p == nullptr) return Status();
  {
    std::lock_guard<std::mutex> why_lock(p->lost_mu);
    if (!p->lost.load(std::memory_order_relaxed)) p->lost_why = why;
  }
  p->lost.store(true, std::memory_order_release);
  shm::ring_doorbell(header_);  // A wait of ours asleep on the futex looks again now.
  return Status();
}

}  // namespace flexpert
