// SPDX-License-Identifier: Apache-2.0
// ShmTransport collectives: one protocol for all_gather, barrier and exchange.
//
// Op k of epoch e on rank me:
//   1. free the mailboxes the previous collective returned (their spans expire now);
//   2. for each member r: claim mailbox [me][k & 1] in r's segment (Writing), write kind,
//      epoch, size and payload, publish Full(k) (release) and ring r if it sleeps;
//   3. claim Full(k) with epoch e in every member's mailbox of this rank's own segment (Held).
// See shm_layout.h for the state machine and why a writer never waits within an epoch.
#include <sched.h>
#include <time.h>

#include <algorithm>
#include <cstring>

#include "flexpert/logging.h"
#include "transport/shm/shm_transport.h"

namespace flexpert {

using shm::MailboxHeader;
using shm::MailboxState;
using shm::OpKind;

namespace {

void sleep_ns(int64_t ns) {
  timespec ts{static_cast<time_t>(ns / 1'000'000'000), static_cast<long>(ns % 1'000'000'000)};
  ::nanosleep(&ts, nullptr);
}

}  // namespace

std::string ShmTransport::op_label(OpKind kind) const {
  return std::string(shm::op_kind_name(kind)) + " (epoch " + std::to_string(epoch_) + ", op " +
         std::to_string(cur_op_) + ")";
}

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
  if (send.size() != static_cast<size_t>(options_.max_ranks)) {
    return invalid_argument("exchange: send has " + std::to_string(send.size()) +
                            " spans, expected max_ranks=" + std::to_string(options_.max_ranks));
  }
  std::vector<ByteSpan> out(static_cast<size_t>(options_.max_ranks));
  FLEX_RETURN_IF_ERROR(run_collective(OpKind::kExchange, group, send.data(), 1, &out));
  return out;
}

Status ShmTransport::validate_group(const Group& group, const char* op) const {
  bool is_member = false;
  int prev = -1;
  for (int r : group.ranks) {
    if (r <= prev || r >= options_.max_ranks) {
      return invalid_argument(std::string(op) +
                              ": group ranks must be ascending, unique and in "
                              "[0, " +
                              std::to_string(options_.max_ranks) + "), got rank " +
                              std::to_string(r));
    }
    prev = r;
    if (r == options_.rank) {
      is_member = true;
    } else if (peers_[r] == nullptr) {
      return failed_precondition(std::string(op) + ": group member rank " + std::to_string(r) +
                                 " is not connected");
    }
  }
  if (!is_member) {
    return failed_precondition(std::string(op) + ": rank " + std::to_string(options_.rank) +
                               " is not a member of the group of epoch " +
                               std::to_string(group.epoch));
  }
  return Status();
}

Status ShmTransport::enter_epoch(uint64_t epoch, const char* op) {
  if (has_epoch_ && epoch == epoch_) return Status();
  if (has_epoch_ && epoch < epoch_) {
    return aborted(std::string(op) + ": group epoch " + std::to_string(epoch) +
                   " is older than this rank's epoch " + std::to_string(epoch_));
  }
  has_epoch_ = true;
  epoch_ = epoch;
  op_idx_ = 0;
  header_->ops_started.store(0, std::memory_order_release);  // Before the epoch: see shm_layout.
  // Peers still waiting on us in an older epoch see this and abort instead of timing out.
  header_->epoch.store(epoch, std::memory_order_seq_cst);
  ring_all_peers();
  return Status();
}

void ShmTransport::release_held() {
  for (MailboxHeader* mb : held_) {
    mb->state.store(shm::pack_state(0, MailboxState::kFree), std::memory_order_release);
  }
  held_.clear();
}

Status ShmTransport::run_collective(OpKind kind, const Group& group, const ByteSpan* sends,
                                    size_t stride, std::vector<ByteSpan>* out) {
  const char* op = shm::op_kind_name(kind);
  if (shut_down_) return failed_precondition(std::string(op) + " after shutdown");
  FLEX_RETURN_IF_ERROR(validate_group(group, op));
  const bool is_exchange = kind == OpKind::kExchange;
  const size_t capacity = is_exchange ? options_.max_exchange_bytes : options_.max_gather_bytes;
  size_t next_member = 0;
  for (int r = 0; r < (stride == 0 ? 1 : options_.max_ranks); ++r) {
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

  release_held();  // The previous collective's spans expire now (the contract).
  FLEX_RETURN_IF_ERROR(enter_epoch(group.epoch, op));
  const int64_t start_ns = shm::now_ns();
  const int64_t deadline_ns = start_ns + int64_t{options_.timeout_ms} * 1'000'000;
  // From here on the op consumes its index whatever happens: peers may have our message.
  cur_op_ = op_idx_++;
  header_->ops_started.store(op_idx_, std::memory_order_release);

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

  pending_.clear();
  for (int r : group.ranks) {
    pending_.push_back({r, layout_.mailbox(base_, is_exchange, r, cur_op_), peers_[r].get()});
  }
  std::vector<ByteSpan> scratch;
  std::vector<ByteSpan>* spans = out;
  if (spans == nullptr) {
    scratch.resize(static_cast<size_t>(options_.max_ranks));
    spans = &scratch;
  }
  return wait_for(pending_, kind, mine, start_ns, spans);
}

Status ShmTransport::send_to(const Peer& peer, OpKind kind, ByteSpan payload, int64_t deadline_ns) {
  MailboxHeader* mb =
      layout_.mailbox(peer.control->data(), kind == OpKind::kExchange, options_.rank, cur_op_);
  uint32_t cur = mb->state.load(std::memory_order_acquire);
  int64_t backoff_ns = 20'000;
  for (;;) {
    const MailboxState state = shm::state_of(cur);
    const bool busy = state == MailboxState::kHeld ||
                      (state == MailboxState::kFull && shm::message_is_live(*mb, *peer.header));
    if (!busy) {
      // Acquire: the reader's payload reads (before its release of Held) precede our writes.
      if (mb->state.compare_exchange_weak(cur, shm::pack_state(cur_op_, MailboxState::kWriting),
                                          std::memory_order_acquire, std::memory_order_acquire)) {
        break;
      }
      continue;
    }
    // Busy: the peer still exposes our previous message on this parity as a span, or may still
    // take it. Only happens when we entered a newer epoch before the peer finished the old one.
    FLEX_RETURN_IF_ERROR(check_peer(peer, kind, /*check_pid=*/true));
    if (shm::now_ns() >= deadline_ns) {
      return deadline_exceeded(op_label(kind) + " timed out after " +
                               std::to_string(options_.timeout_ms) + " ms: rank " +
                               std::to_string(peer.rank) +
                               " has not finished with our previous message (it is still in an "
                               "older epoch)");
    }
    sleep_ns(backoff_ns);
    backoff_ns = std::min<int64_t>(backoff_ns * 2, 1'000'000);
    cur = mb->state.load(std::memory_order_acquire);
  }
  mb->kind.store(static_cast<uint32_t>(kind), std::memory_order_relaxed);
  mb->epoch.store(epoch_, std::memory_order_relaxed);
  mb->op_idx.store(cur_op_, std::memory_order_relaxed);
  mb->num_bytes.store(payload.num_bytes, std::memory_order_relaxed);
  if (payload.num_bytes > 0) std::memcpy(mb->payload(), payload.data, payload.num_bytes);
  mb->state.store(shm::pack_state(cur_op_, MailboxState::kFull), std::memory_order_seq_cst);
  if (peer.rank != options_.rank) shm::ring_doorbell(peer.header);
  return Status();
}

int ShmTransport::try_take(const Awaited& a, OpKind kind, ByteSpan mine, std::vector<ByteSpan>* out,
                           Status* status) {
  MailboxHeader* mb = a.mailbox;
  // seq_cst loads: they pair with the `sleeping` store before a futex wait (ring_doorbell).
  uint32_t cur = mb->state.load(std::memory_order_seq_cst);
  const uint32_t want = shm::pack_state(cur_op_, MailboxState::kFull);
  uint64_t epoch = 0;
  if (cur == want) {
    epoch = mb->epoch.load(std::memory_order_relaxed);
    if (epoch == epoch_) {
      if (!mb->state.compare_exchange_strong(cur, shm::pack_state(cur_op_, MailboxState::kHeld),
                                             std::memory_order_acq_rel)) {
        return 0;  // Changed under us; look again.
      }
      // Held: the writer cannot touch it now. Re-read the epoch: between our two looks the
      // mailbox may have been rewritten by a newer epoch with the same op bits. The full op
      // index rules out a message 2^30 ops old with the same low bits.
      epoch = mb->epoch.load(std::memory_order_relaxed);
      if (epoch == epoch_ && mb->op_idx.load(std::memory_order_relaxed) == cur_op_) {
        held_.push_back(mb);
        const auto got_kind = static_cast<OpKind>(mb->kind.load(std::memory_order_relaxed));
        const uint64_t num_bytes = mb->num_bytes.load(std::memory_order_relaxed);
        const size_t capacity =
            kind == OpKind::kExchange ? options_.max_exchange_bytes : options_.max_gather_bytes;
        if (got_kind != kind) {
          *status = failed_precondition("collectives out of step: rank " + std::to_string(a.rank) +
                                        " ran " + shm::op_kind_name(got_kind) +
                                        " as this rank ran " + op_label(kind));
          return -1;
        }
        if (num_bytes > capacity) {
          *status = data_loss(op_label(kind) + ": rank " + std::to_string(a.rank) + " sent " +
                              std::to_string(num_bytes) + " bytes, above capacity");
          return -1;
        }
        if (kind == OpKind::kAllGather && num_bytes != mine.num_bytes) {
          *status = invalid_argument(op_label(kind) + ": rank " + std::to_string(a.rank) +
                                     " contributed " + std::to_string(num_bytes) +
                                     " bytes, this rank " + std::to_string(mine.num_bytes));
          return -1;
        }
        (*out)[static_cast<size_t>(a.rank)] = ByteSpan{mb->payload(), num_bytes};
        return 1;
      }
      mb->state.store(cur, std::memory_order_release);  // Not ours after all: give it back.
    }
  } else if (shm::state_of(cur) == MailboxState::kFull) {
    epoch = mb->epoch.load(std::memory_order_relaxed);
  }
  if (epoch > epoch_) {
    *status = aborted(op_label(kind) + ": rank " + std::to_string(a.rank) +
                      " sent a message of newer epoch " + std::to_string(epoch));
    return -1;
  }
  return 0;
}

Status ShmTransport::lost_status(Peer& peer) {
  if (!peer.lost.load(std::memory_order_acquire)) return Status();
  std::lock_guard<std::mutex> lock(peer.lost_mu);
  return unavailable("rank " + std::to_string(peer.rank) + " (pid " + std::to_string(peer.pid) +
                     ") lost: " + peer.lost_why);
}

Status ShmTransport::check_peer(const Peer& peer, OpKind kind, bool check_pid) const {
  if (Status s = lost_status(const_cast<Peer&>(peer)); !s.ok()) {
    return unavailable(s.message() + " during " + op_label(kind));
  }
  const shm::SegmentHeader* h = peer.header;
  if (h->closed.load(std::memory_order_seq_cst) != 0) {
    return unavailable("rank " + std::to_string(peer.rank) + " (pid " + std::to_string(peer.pid) +
                       ") shut down during " + op_label(kind));
  }
  const uint64_t peer_epoch = h->epoch.load(std::memory_order_seq_cst);
  if (peer_epoch > epoch_) {
    return aborted(op_label(kind) + ": rank " + std::to_string(peer.rank) +
                   " has moved to newer epoch " + std::to_string(peer_epoch));
  }
  if (check_pid && peer.watch.ended()) {
    return unavailable("rank " + std::to_string(peer.rank) + " (pid " + std::to_string(peer.pid) +
                       ") died during " + op_label(kind))
        .with_dead_rank(peer.rank);
  }
  return Status();
}

Status ShmTransport::wait_for(std::vector<Awaited>& pending, OpKind kind, ByteSpan mine,
                              int64_t start_ns, std::vector<ByteSpan>* out) {
  const int64_t deadline_ns = start_ns + int64_t{options_.timeout_ms} * 1'000'000;
  Status status;
  // Takes what has arrived; false with *status set on an error.
  auto poll = [&]() {
    for (size_t i = 0; i < pending.size();) {
      const int taken = try_take(pending[i], kind, mine, out, &status);
      if (taken < 0) return false;
      if (taken > 0) {
        pending[i] = pending.back();
        pending.pop_back();
      } else {
        ++i;
      }
    }
    return true;
  };
  // Per-peer checks of the awaited: closed and newer epoch on every look (two loads), pid
  // liveness once per slice (a syscall).
  auto check = [&](bool check_pid) {
    for (size_t i = 0; i < pending.size(); ++i) {
      Status s = check_peer(*pending[i].peer, kind, check_pid);
      if (s.ok()) continue;
      // The peer may have delivered just before it closed, died or moved on: look once more.
      const int rank = pending[i].rank;
      if (!poll()) return false;
      if (std::any_of(pending.begin(), pending.end(),
                      [&](const Awaited& p) { return p.rank == rank; })) {
        status = s;
        return false;
      }
      i = static_cast<size_t>(-1);  // It had delivered after all; rescan what is left.
    }
    return true;
  };

  int64_t now = start_ns;
  int64_t spin_until = now + spin_ns_;
  int64_t yield_until = spin_until + yield_ns_;
  int64_t next_liveness_ns = now + shm::kFirstLivenessNs;
  for (;;) {
    if (!poll()) return status;
    if (pending.empty()) return Status();
    now = shm::now_ns();
    const bool liveness_due = now >= next_liveness_ns || now >= deadline_ns;
    if (liveness_due) next_liveness_ns = now + shm::kLivenessSliceNs;
    if (!check(liveness_due)) return status;
    if (pending.empty()) return Status();
    if (now >= deadline_ns) {
      std::string ranks;
      for (const Awaited& a : pending)
        ranks += (ranks.empty() ? "" : ", ") + std::to_string(a.rank);
      return deadline_exceeded(op_label(kind) + " timed out after " +
                               std::to_string(options_.timeout_ms) + " ms; no message from rank" +
                               (pending.size() > 1 ? "s " : " ") + ranks);
    }
    if (now < spin_until) {
      for (int i = 0; i < 32; ++i) shm::cpu_relax();
      continue;
    }
    if (now < yield_until) {
      ::sched_yield();
      continue;
    }
    // Sleep until a writer rings (it rings only while `sleeping` is set) or the slice ends.
    header_->sleeping.store(1, std::memory_order_seq_cst);
    const uint32_t bell = header_->doorbell.load(std::memory_order_seq_cst);
    if (!poll()) {
      header_->sleeping.store(0, std::memory_order_relaxed);
      return status;
    }
    if (!pending.empty()) {
      const int64_t wait_ns =
          std::min({shm::kLivenessSliceNs, deadline_ns - now, next_liveness_ns - now});
      shm::futex_wait_shared(&header_->doorbell, bell, std::max<int64_t>(wait_ns, 1000));
    }
    header_->sleeping.store(0, std::memory_order_relaxed);
    // Woken: more messages usually follow closely, so spin briefly again.
    now = shm::now_ns();
    spin_until = now + spin_ns_;
    yield_until = spin_until + yield_ns_;
  }
}

Status ShmTransport::peer_status(int peer) const {
  if (peer < 0 || peer >= options_.max_ranks) {
    return invalid_argument("rank " + std::to_string(peer) + " out of range");
  }
  Peer* p = peers_[peer].get();
  if (p == nullptr || peer == options_.rank) return Status();
  FLEX_RETURN_IF_ERROR(lost_status(*p));
  return shm::peer_liveness(peer, p->pid, *p->header, p->watch);
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
