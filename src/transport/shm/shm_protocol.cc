// SPDX-License-Identifier: Apache-2.0
// MailboxProtocol: see shm_protocol.h; the state machine is shm_layout.h's.
#include "transport/shm/shm_protocol.h"

#include <sched.h>
#include <time.h>

#include <algorithm>
#include <utility>

namespace flexpert::shm {

namespace {

void sleep_ns(int64_t ns) {
  timespec ts{static_cast<time_t>(ns / 1'000'000'000), static_cast<long>(ns % 1'000'000'000)};
  ::nanosleep(&ts, nullptr);
}

}  // namespace

Status lost_status(const PeerLink& peer) {
  if (!peer.lost.load(std::memory_order_acquire)) return Status();
  std::lock_guard<std::mutex> lock(peer.lost_mu);
  return unavailable("rank " + std::to_string(peer.rank) + " (pid " + std::to_string(peer.pid) +
                     ") lost: " + peer.lost_why);
}

MailboxProtocol::MailboxProtocol(const TransportOptions& options, Layout mailboxes, int64_t spin_ns,
                                 int64_t yield_ns, std::function<void()> ring_peers)
    : rank_(options.rank),
      max_gather_bytes_(options.max_gather_bytes),
      max_exchange_bytes_(options.max_exchange_bytes),
      timeout_ms_(options.timeout_ms),
      layout_(mailboxes),
      spin_ns_(spin_ns),
      yield_ns_(yield_ns),
      ring_peers_(std::move(ring_peers)) {}

void MailboxProtocol::bind(SegmentHeader* header, std::byte* base) {
  header_ = header;
  base_ = base;
}

void MailboxProtocol::unbind() {
  held_.clear();
  header_ = nullptr;
  base_ = nullptr;
}

std::string MailboxProtocol::op_label(OpKind kind) const {
  return std::string(op_kind_name(kind)) + " (epoch " + std::to_string(epoch_) + ", op " +
         std::to_string(cur_op_) + ")";
}

void MailboxProtocol::release_held() {
  for (MailboxHeader* mb : held_) {
    mb->state.store(pack_state(0, MailboxState::kFree), std::memory_order_release);
  }
  held_.clear();
}

Status MailboxProtocol::enter_epoch(uint64_t epoch, const char* op) {
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
  ring_peers_();
  return Status();
}

Result<int64_t> MailboxProtocol::start_op(uint64_t epoch, const char* op) {
  release_held();  // The previous collective's spans expire now (the contract).
  FLEX_RETURN_IF_ERROR(enter_epoch(epoch, op));
  const int64_t start_ns = now_ns();
  // From here on the op consumes its index whatever happens: peers may have our message.
  cur_op_ = op_idx_++;
  header_->ops_started.store(op_idx_, std::memory_order_release);
  return start_ns;
}

Status MailboxProtocol::claim(const PeerLink& peer, OpKind kind, int64_t deadline_ns,
                              MailboxHeader** out) {
  MailboxHeader* mb = layout_.mailbox(peer.control_base, kind == OpKind::kExchange, rank_, cur_op_);
  uint32_t cur = mb->state.load(std::memory_order_acquire);
  int64_t backoff_ns = 20'000;
  for (;;) {
    const MailboxState state = state_of(cur);
    const bool busy = state == MailboxState::kHeld ||
                      (state == MailboxState::kFull && message_is_live(*mb, *peer.header));
    if (!busy) {
      // Acquire: the reader's use of the payload (before its release of Held) precedes our
      // writes of the next one.
      if (mb->state.compare_exchange_weak(cur, pack_state(cur_op_, MailboxState::kWriting),
                                          std::memory_order_acquire, std::memory_order_acquire)) {
        *out = mb;
        return Status();
      }
      continue;
    }
    // Busy: the peer still exposes our previous message on this parity as a span, or may still
    // take it. Only happens when we entered a newer epoch before the peer finished the old one.
    FLEX_RETURN_IF_ERROR(check_peer(peer, kind, /*check_pid=*/true));
    if (now_ns() >= deadline_ns) {
      return deadline_exceeded(op_label(kind) + " timed out after " + std::to_string(timeout_ms_) +
                               " ms: rank " + std::to_string(peer.rank) +
                               " has not finished with our previous message (it is still in an "
                               "older epoch)");
    }
    sleep_ns(backoff_ns);
    backoff_ns = std::min<int64_t>(backoff_ns * 2, 1'000'000);
    cur = mb->state.load(std::memory_order_acquire);
  }
}

void MailboxProtocol::write_header(MailboxHeader* mb, OpKind kind, size_t num_bytes) const {
  mb->kind.store(static_cast<uint32_t>(kind), std::memory_order_relaxed);
  mb->epoch.store(epoch_, std::memory_order_relaxed);
  mb->op_idx.store(cur_op_, std::memory_order_relaxed);
  mb->num_bytes.store(num_bytes, std::memory_order_relaxed);
}

void MailboxProtocol::publish(const PeerLink& peer, MailboxHeader* mb) const {
  mb->state.store(pack_state(cur_op_, MailboxState::kFull), std::memory_order_seq_cst);
  if (peer.rank != rank_) ring_doorbell(peer.header);
}

int MailboxProtocol::try_take(const Awaited& a, OpKind kind, ByteSpan mine,
                              std::vector<ByteSpan>* out, Status* status) {
  MailboxHeader* mb = a.mailbox;
  // seq_cst loads: they pair with the `sleeping` store before a futex wait (ring_doorbell).
  uint32_t cur = mb->state.load(std::memory_order_seq_cst);
  const uint32_t want = pack_state(cur_op_, MailboxState::kFull);
  uint64_t epoch = 0;
  if (cur == want) {
    epoch = mb->epoch.load(std::memory_order_relaxed);
    if (epoch == epoch_) {
      if (!mb->state.compare_exchange_strong(cur, pack_state(cur_op_, MailboxState::kHeld),
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
        const size_t capacity = kind == OpKind::kExchange ? max_exchange_bytes_ : max_gather_bytes_;
        if (got_kind != kind) {
          *status = failed_precondition("collectives out of step: rank " + std::to_string(a.rank) +
                                        " ran " + op_kind_name(got_kind) + " as this rank ran " +
                                        op_label(kind));
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
        (*out)[static_cast<size_t>(a.rank)] = ByteSpan{a.payload, num_bytes};
        return 1;
      }
      mb->state.store(cur, std::memory_order_release);  // Not ours after all: give it back.
    }
  } else if (state_of(cur) == MailboxState::kFull) {
    epoch = mb->epoch.load(std::memory_order_relaxed);
  }
  if (epoch > epoch_) {
    *status = aborted(op_label(kind) + ": rank " + std::to_string(a.rank) +
                      " sent a message of newer epoch " + std::to_string(epoch));
    return -1;
  }
  return 0;
}

Status MailboxProtocol::check_peer(const PeerLink& peer, OpKind kind, bool check_pid) const {
  if (Status s = lost_status(peer); !s.ok()) {
    return unavailable(s.message() + " during " + op_label(kind));
  }
  const SegmentHeader* h = peer.header;
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

Status MailboxProtocol::wait_for(OpKind kind, ByteSpan mine, int64_t start_ns,
                                 std::vector<ByteSpan>* out) {
  std::vector<Awaited>& pending = pending_;
  std::vector<ByteSpan> scratch;  // Barrier: the spans are not returned.
  if (out == nullptr) {
    scratch.resize(layout_.max_ranks);
    out = &scratch;
  }
  const int64_t deadline_ns = start_ns + int64_t{timeout_ms_} * 1'000'000;
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
  int64_t next_liveness_ns = now + kFirstLivenessNs;
  for (;;) {
    if (!poll()) return status;
    if (pending.empty()) return Status();
    now = now_ns();
    const bool liveness_due = now >= next_liveness_ns || now >= deadline_ns;
    if (liveness_due) next_liveness_ns = now + kLivenessSliceNs;
    if (!check(liveness_due)) return status;
    if (pending.empty()) return Status();
    if (now >= deadline_ns) {
      std::string ranks;
      for (const Awaited& a : pending) {
        ranks += (ranks.empty() ? "" : ", ") + std::to_string(a.rank);
      }
      return deadline_exceeded(op_label(kind) + " timed out after " + std::to_string(timeout_ms_) +
                               " ms; no message from rank" + (pending.size() > 1 ? "s " : " ") +
                               ranks);
    }
    if (now < spin_until) {
      for (int i = 0; i < 32; ++i) cpu_relax();
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
          std::min({kLivenessSliceNs, deadline_ns - now, next_liveness_ns - now});
      futex_wait_shared(&header_->doorbell, bell, std::max<int64_t>(wait_ns, 1000));
    }
    header_->sleeping.store(0, std::memory_order_relaxed);
    // Woken: more messages usually follow closely, so spin briefly again.
    now = now_ns();
    spin_until = now + spin_ns_;
    yield_until = spin_until + yield_ns_;
  }
}

}  // namespace flexpert::shm
