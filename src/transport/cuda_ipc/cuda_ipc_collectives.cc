// SPDX-License-Identifier: Apache-2.0
// CudaIpcTransport collectives: the shm backend's protocol (shm_collectives.cc) with the
// payloads in device memory.
//
// Op k of epoch e on rank me:
//   1. free the mailboxes the previous collective returned (their spans expire now);
//   2. for each member r: claim mailbox [me][k & 1] in r's control segment (Writing), write
//      kind, epoch and size, and queue a copy of the payload into slot [me][k & 1] of r's
//      receive buffer on the copy stream;
//   3. synchronize the copy stream, then publish every claimed mailbox Full(k) and ring;
//   4. claim Full(k) with epoch e in every member's mailbox of this rank's own segment (Held)
//      and return spans into this rank's receive buffer.
// NOTE: the wait loop mirrors ShmTransport::wait_for; keep the two in step.
#include <sched.h>
#include <time.h>

#include <algorithm>

#include "transport/cuda_ipc/cuda_ipc_transport.h"

namespace flexpert {

using cuda_ipc::cuda_check;
using shm::MailboxHeader;
using shm::MailboxState;
using shm::OpKind;

namespace {

constexpr int64_t kSpinNs = 5'000;  // Busy-wait, then yield, then futex slices.
constexpr int64_t kYieldNs = 20'000;

void sleep_ns(int64_t ns) {
  timespec ts{static_cast<time_t>(ns / 1'000'000'000), static_cast<long>(ns % 1'000'000'000)};
  ::nanosleep(&ts, nullptr);
}

}  // namespace

std::string CudaIpcTransport::op_label(OpKind kind) const {
  return std::string(shm::op_kind_name(kind)) + " (epoch " + std::to_string(epoch_) + ", op " +
         std::to_string(cur_op_) + ")";
}

Result<std::vector<ByteSpan>> CudaIpcTransport::all_gather(const Group& group, ByteSpan in) {
  if (host_ != nullptr) return host_->all_gather(group, in);
  std::vector<ByteSpan> out(static_cast<size_t>(options_.max_ranks));
  FLEX_RETURN_IF_ERROR(run_collective(OpKind::kAllGather, group, &in, 0, &out));
  return out;
}

Status CudaIpcTransport::barrier(const Group& group) {
  if (host_ != nullptr) return host_->barrier(group);
  const ByteSpan none;
  return run_collective(OpKind::kBarrier, group, &none, 0, nullptr);
}

Result<std::vector<ByteSpan>> CudaIpcTransport::exchange(const Group& group,
                                                         const std::vector<ByteSpan>& send) {
  if (host_ != nullptr) return host_->exchange(group, send);
  if (send.size() != static_cast<size_t>(options_.max_ranks)) {
    return invalid_argument("exchange: send has " + std::to_string(send.size()) +
                            " spans, expected max_ranks=" + std::to_string(options_.max_ranks));
  }
  std::vector<ByteSpan> out(static_cast<size_t>(options_.max_ranks));
  FLEX_RETURN_IF_ERROR(run_collective(OpKind::kExchange, group, send.data(), 1, &out));
  return out;
}

Status CudaIpcTransport::validate_collective(OpKind kind, const Group& group, const ByteSpan* sends,
                                             size_t stride) const {
  const char* op = shm::op_kind_name(kind);
  bool is_member = false;
  int prev = -1;
  for (int r : group.ranks) {
    if (r <= prev || r >= options_.max_ranks) {
      return invalid_argument(
          std::string(op) + ": group ranks must be ascending, unique and in [0, " +
          std::to_string(options_.max_ranks) + "), got rank " + std::to_string(r));
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
  const bool is_exchange = kind == OpKind::kExchange;
  const size_t capacity = is_exchange ? options_.max_exchange_bytes : options_.max_gather_bytes;
  for (int r = 0; r < (stride == 0 ? 1 : options_.max_ranks); ++r) {
    const ByteSpan& s = sends[static_cast<size_t>(r) * stride];
    if (s.num_bytes > capacity) {
      return invalid_argument(std::string(op) + ": " + std::to_string(s.num_bytes) +
                              " bytes for rank " + std::to_string(r) + " exceed the capacity of " +
                              std::to_string(capacity) +
                              (is_exchange ? " (max_exchange_bytes)" : " (max_gather_bytes)"));
    }
    if (s.num_bytes > 0 && s.data == nullptr) {
      return invalid_argument(std::string(op) + ": null data for rank " + std::to_string(r));
    }
    if (stride != 0 && s.num_bytes > 0 && !group.contains(r)) {
      return invalid_argument(std::string(op) + ": " + std::to_string(s.num_bytes) +
                              " bytes for rank " + std::to_string(r) + ", not a group member");
    }
  }
  return Status();
}

Status CudaIpcTransport::enter_epoch(uint64_t epoch, const char* op) {
  if (has_epoch_ && epoch == epoch_) return Status();
  if (has_epoch_ && epoch < epoch_) {
    return aborted(std::string(op) + ": group epoch " + std::to_string(epoch) +
                   " is older than this rank's epoch " + std::to_string(epoch_));
  }
  has_epoch_ = true;
  epoch_ = epoch;
  op_idx_ = 0;
  header_->ops_started.store(0, std::memory_order_release);  // Before the epoch: see shm_layout.
  header_->epoch.store(epoch, std::memory_order_seq_cst);
  ring_all_peers();
  return Status();
}

void CudaIpcTransport::release_held() {
  for (MailboxHeader* mb : held_) {
    mb->state.store(shm::pack_state(0, MailboxState::kFree), std::memory_order_release);
  }
  held_.clear();
}

Status CudaIpcTransport::run_collective(OpKind kind, const Group& group, const ByteSpan* sends,
                                        size_t stride, std::vector<ByteSpan>* out) {
  const char* op = shm::op_kind_name(kind);
  if (shut_down_) return failed_precondition(std::string(op) + " after shutdown");
  FLEX_RETURN_IF_ERROR(validate_collective(kind, group, sends, stride));
  cuda_ipc::ScopedDevice scoped(options_.device);
  FLEX_RETURN_IF_ERROR(scoped.status());

  release_held();  // The previous collective's spans expire now (the contract).
  FLEX_RETURN_IF_ERROR(enter_epoch(group.epoch, op));
  const int64_t start_ns = shm::now_ns();
  const int64_t deadline_ns = start_ns + int64_t{options_.timeout_ms} * 1'000'000;
  // From here on the op consumes its index whatever happens: peers may have our message.
  cur_op_ = op_idx_++;
  header_->ops_started.store(op_idx_, std::memory_order_release);

  FLEX_RETURN_IF_ERROR(send_all(kind, group, sends, stride, deadline_ns));
  const bool is_exchange = kind == OpKind::kExchange;
  pending_.clear();
  for (int r : group.ranks) {
    pending_.push_back(
        {r, layout_.mailboxes.mailbox(base_, is_exchange, r, cur_op_), peers_[r].get()});
  }
  std::vector<ByteSpan> scratch;
  std::vector<ByteSpan>* spans = out;
  if (spans == nullptr) {
    scratch.resize(static_cast<size_t>(options_.max_ranks));
    spans = &scratch;
  }
  return wait_for(kind, sends[static_cast<size_t>(options_.rank) * stride], start_ns, spans);
}

Status CudaIpcTransport::send_all(OpKind kind, const Group& group, const ByteSpan* sends,
                                  size_t stride, int64_t deadline_ns) {
  const bool is_exchange = kind == OpKind::kExchange;
  const int me = options_.rank;
  const size_t num_members = group.ranks.size();
  const size_t my_idx = static_cast<size_t>(
      std::lower_bound(group.ranks.begin(), group.ranks.end(), me) - group.ranks.begin());
  claimed_.clear();
  Status status;
  bool copied = false;
  // The members after us first, wrapping around, this rank last (as the shm backend).
  for (size_t i = 1; i <= num_members && status.ok(); ++i) {
    const int r = group.ranks[(my_idx + i) % num_members];
    const Peer& peer = *peers_[r];
    if (r != me &&
        (peer.header->closed.load(std::memory_order_acquire) != 0 || peer.watch.exited())) {
      continue;  // Dropped: its memory may be gone. The wait reports it if it matters.
    }
    MailboxHeader* mb = nullptr;
    status = claim(peer, kind, deadline_ns, &mb);
    if (!status.ok()) break;
    const ByteSpan& payload = sends[static_cast<size_t>(r) * stride];
    mb->kind.store(static_cast<uint32_t>(kind), std::memory_order_relaxed);
    mb->epoch.store(epoch_, std::memory_order_relaxed);
    mb->op_idx.store(cur_op_, std::memory_order_relaxed);
    mb->num_bytes.store(payload.num_bytes, std::memory_order_relaxed);
    if (payload.num_bytes > 0) {
      std::byte* dst = peer.recv + layout_.slot_offset(is_exchange, me, cur_op_);
      const cudaError_t err = cudaMemcpyAsync(dst, payload.data, payload.num_bytes,
                                              cudaMemcpyDefault, copy_stream_->get());
      if (err != cudaSuccess) {
        mb->state.store(shm::pack_state(0, MailboxState::kFree), std::memory_order_release);
        status = cuda_ipc::cuda_status(err, "cudaMemcpyAsync")
                     .annotate(op_label(kind) + ": copy to rank " + std::to_string(r));
        break;
      }
      copied = true;
    }
    claimed_.push_back({&peer, mb});
  }
  // NOTE: a mailbox goes Full only once its copy has completed: the receiver reads at once.
  if (copied) {
    const Status synced =
        cuda_check(cudaStreamSynchronize(copy_stream_->get()), "cudaStreamSynchronize")
            .annotate(op_label(kind) + ": copies to the members");
    if (!synced.ok()) {
      for (const Claimed& c : claimed_) {
        c.mailbox->state.store(shm::pack_state(0, MailboxState::kFree), std::memory_order_release);
      }
      claimed_.clear();
      return status.ok() ? synced : status;
    }
  }
  for (const Claimed& c : claimed_) {
    c.mailbox->state.store(shm::pack_state(cur_op_, MailboxState::kFull),
                           std::memory_order_seq_cst);
    if (c.peer->rank != me) shm::ring_doorbell(c.peer->header);
  }
  claimed_.clear();
  return status;
}

Status CudaIpcTransport::claim(const Peer& peer, OpKind kind, int64_t deadline_ns,
                               MailboxHeader** out) {
  MailboxHeader* mb = layout_.mailboxes.mailbox(peer.control_base, kind == OpKind::kExchange,
                                                options_.rank, cur_op_);
  uint32_t cur = mb->state.load(std::memory_order_acquire);
  int64_t backoff_ns = 20'000;
  for (;;) {
    const MailboxState state = shm::state_of(cur);
    const bool busy = state == MailboxState::kHeld ||
                      (state == MailboxState::kFull && shm::message_is_live(*mb, *peer.header));
    if (!busy) {
      // Acquire: the reader's use of the slot (before its release of Held) precedes our copy.
      if (mb->state.compare_exchange_weak(cur, shm::pack_state(cur_op_, MailboxState::kWriting),
                                          std::memory_order_acquire, std::memory_order_acquire)) {
        *out = mb;
        return Status();
      }
      continue;
    }
    // Busy: the peer still exposes our previous message on this parity, or may still take
    // it. Only happens when we entered a newer epoch before the peer finished the old one.
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
}

int CudaIpcTransport::try_take(const Awaited& a, OpKind kind, ByteSpan mine,
                               std::vector<ByteSpan>* out, Status* status) {
  MailboxHeader* mb = a.mailbox;
  uint32_t cur = mb->state.load(std::memory_order_seq_cst);
  const uint32_t want = shm::pack_state(cur_op_, MailboxState::kFull);
  uint64_t epoch = 0;
  if (cur == want) {
    epoch = mb->epoch.load(std::memory_order_relaxed);
    if (epoch == epoch_) {
      if (!mb->state.compare_exchange_strong(cur, shm::pack_state(cur_op_, MailboxState::kHeld),
                                             std::memory_order_acq_rel)) {
        return 0;
      }
      epoch = mb->epoch.load(std::memory_order_relaxed);
      if (epoch == epoch_ && mb->op_idx.load(std::memory_order_relaxed) == cur_op_) {
        held_.push_back(mb);
        const auto got_kind = static_cast<OpKind>(mb->kind.load(std::memory_order_relaxed));
        const uint64_t num_bytes = mb->num_bytes.load(std::memory_order_relaxed);
        const bool is_exchange = kind == OpKind::kExchange;
        const size_t capacity =
            is_exchange ? options_.max_exchange_bytes : options_.max_gather_bytes;
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
        const std::byte* data = recv_->data() + layout_.slot_offset(is_exchange, a.rank, cur_op_);
        (*out)[static_cast<size_t>(a.rank)] = ByteSpan{data, num_bytes};
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

Status CudaIpcTransport::check_peer(const Peer& peer, OpKind kind, bool check_pid) const {
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

Status CudaIpcTransport::wait_for(OpKind kind, ByteSpan mine, int64_t start_ns,
                                  std::vector<ByteSpan>* out) {
  std::vector<Awaited>& pending = pending_;
  const int64_t deadline_ns = start_ns + int64_t{options_.timeout_ms} * 1'000'000;
  Status status;
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
      i = static_cast<size_t>(-1);
    }
    return true;
  };

  int64_t now = start_ns;
  int64_t spin_until = now + kSpinNs;
  int64_t yield_until = spin_until + kYieldNs;
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
      for (const Awaited& a : pending) {
        ranks += (ranks.empty() ? "" : ", ") + std::to_string(a.rank);
      }
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
    now = shm::now_ns();
    spin_until = now + kSpinNs;
    yield_until = spin_until + kYieldNs;
  }
}

Status CudaIpcTransport::peer_status(int peer) const {
  if (host_ != nullptr) return host_->peer_status(peer);
  if (peer < 0 || peer >= options_.max_ranks) {
    return invalid_argument("rank " + std::to_string(peer) + " out of range");
  }
  const Peer* p = peers_[peer].get();
  if (p == nullptr || peer == options_.rank) return Status();
  return shm::peer_liveness(peer, p->pid, *p->header, p->watch);
}

}  // namespace flexpert
