// SPDX-License-Identifier: Apache-2.0
// UcxTransport messages and collectives: one protocol for all_gather, barrier and exchange.
//
// Op k of epoch e on rank me:
//   1. free the mailboxes the previous collective returned (their spans expire now) and drop
//      filed messages that became stale;
//   2. for each member r: copy the payload into staging slot [kind][r][k & 1] (after its
//      previous send completed) and send it as one active message; to itself, file it directly;
//   3. progress until every member's message (e, k) is filed, then hold those mailboxes.
// See ucx_transport.h for the mailboxes and what is rejected.
#include <time.h>

#include <algorithm>
#include <cstring>

#include "flexpert/logging.h"
#include "transport/collective_checks.h"
#include "transport/ucx/ucx_transport.h"

namespace flexpert {

using ucx::MessageType;
using ucx::WireHeader;

namespace {

int64_t mono_ns() {
  timespec ts{};
  ::clock_gettime(CLOCK_MONOTONIC, &ts);
  return static_cast<int64_t>(ts.tv_sec) * 1'000'000'000 + ts.tv_nsec;
}

int pool_of(ucx::OpKind kind) { return kind == ucx::OpKind::kExchange ? 1 : 0; }

}  // namespace

WireHeader UcxTransport::header_for(MessageType type) const {
  WireHeader h;
  h.type = type;
  h.src_rank = options_.rank;
  h.src_pid = peers_[options_.rank]->parsed.pid;
  h.src_incarnation = options_.incarnation;
  h.has_epoch = has_epoch_ ? 1 : 0;
  h.epoch = epoch_;
  h.has_prev = has_prev_ ? 1 : 0;
  h.prev_epoch = prev_epoch_;
  h.prev_ops = prev_ops_;
  h.regions_announced = own_regions_.size();
  return h;
}

std::byte* UcxTransport::staging(int pool, int dst, uint64_t op_idx) const {
  const size_t ranks = static_cast<size_t>(options_.max_ranks);
  const size_t pool_base = pool == 0 ? 0 : ranks * 2 * pool_bytes_[0];
  return static_cast<std::byte*>(staging_) + pool_base +
         (static_cast<size_t>(dst) * 2 + (op_idx & 1)) * pool_bytes_[pool];
}

void UcxTransport::on_send_done(void* request, ucs_status_t status, void* user_data) {
  auto* op = static_cast<SendOp*>(user_data);
  if (op->pending != nullptr) --*op->pending;
  --op->self->inflight_;
  delete op;
  ucp_request_free(request);
}

Status UcxTransport::post_send(const Peer& peer, const WireHeader& h, const void* payload, size_t n,
                               int* pending) {
  if (peer.conn == nullptr || peer.conn->ep == nullptr) {
    return unavailable("rank " + std::to_string(peer.rank) + ": endpoint closed");
  }
  auto* op = new SendOp{this, h, pending};
  ucp_request_param_t param{};
  param.op_attr_mask = UCP_OP_ATTR_FIELD_CALLBACK | UCP_OP_ATTR_FIELD_USER_DATA;
  param.cb.send = &UcxTransport::on_send_done;
  param.user_data = op;
  if (n > 0 && payload >= staging_ &&
      static_cast<const std::byte*>(payload) < static_cast<std::byte*>(staging_) + staging_bytes_) {
    param.op_attr_mask |= UCP_OP_ATTR_FIELD_MEMH;
    param.memh = staging_memh_;
  }
  void* request = ucp_am_send_nbx(peer.conn->ep, ucx::kAmId, &op->header, sizeof(WireHeader),
                                  payload, n, &param);
  if (request == nullptr) {
    delete op;
    return Status();
  }
  if (UCS_PTR_IS_ERR(request)) {
    delete op;
    return unavailable("sending to rank " + std::to_string(peer.rank) + ": " +
                       ucs_status_string(UCS_PTR_STATUS(request)));
  }
  if (pending != nullptr) ++*pending;
  ++inflight_;
  return Status();
}

void UcxTransport::announce_regions(const Peer& peer, const OwnRegion* only, int only_id) {
  // Each announcement counts itself in regions_announced, so the receiver knows how many to
  // expect once it has seen any later message.
  WireHeader h = header_for(MessageType::kRegion);
  auto send_one = [&](int id, const OwnRegion& r) {
    h.region_id = id;
    h.region_addr = reinterpret_cast<uint64_t>(r.data);
    h.region_bytes = r.num_bytes;
    (void)post_send(peer, h, r.packed_rkey.data(), r.packed_rkey.size(), nullptr);
  };
  if (only != nullptr) {
    send_one(only_id, *only);
    return;
  }
  for (const auto& [id, r] : own_regions_) send_one(id, r);
}

void UcxTransport::reset_inbox(Inbox& in, uint64_t incarnation) {
  for (auto& pool : in.pools) {
    for (Box& b : pool) {
      if (b.state == Box::State::kFilling) {
        b.discard = true;
      } else if (b.state != Box::State::kHeld) {
        b.state = Box::State::kFree;
      }
    }
  }
  in.seen = true;
  in.incarnation = incarnation;
  in.heard = false;
  in.bye = false;
  in.bye_acked = false;
  in.has_epoch = false;
  in.has_prev = false;
  in.regions_claimed = 0;
  in.regions.clear();
}

void UcxTransport::sweep_stale(Inbox& in) {
  for (auto& pool : in.pools) {
    for (Box& b : pool) {
      if (b.state != Box::State::kFull && b.state != Box::State::kFilling) continue;
      const bool stale =
          has_epoch_ && (b.epoch < epoch_ || (b.epoch == epoch_ && b.op_idx + 1 < ops_started_));
      if (!stale) continue;
      if (b.state == Box::State::kFilling) {
        b.discard = true;
      } else {
        b.state = Box::State::kFree;
      }
    }
  }
}

UcxTransport::Box* UcxTransport::file_message(Inbox& in, const WireHeader& h, size_t length) {
  const int pool = pool_of(h.kind);
  if (length > pool_bytes_[pool] ||
      length > (pool == 0 ? options_.max_gather_bytes : options_.max_exchange_bytes)) {
    return nullptr;
  }
  const bool future = !has_epoch_ || h.epoch > epoch_;
  if (!future) {
    if (h.epoch < epoch_) return nullptr;  // An older epoch.
    const uint64_t lowest = in_collective_ ? ops_started_ - 1 : ops_started_;
    if (h.op_idx < lowest || h.op_idx > ops_started_) return nullptr;  // Done, or too far ahead.
  }
  Box* free_box = nullptr;
  for (auto& p : in.pools) {
    for (Box& b : p) {
      const bool filed = b.state == Box::State::kFull || b.state == Box::State::kFilling;
      if (filed && !b.discard && b.epoch == h.epoch && b.op_idx == h.op_idx) return nullptr;
    }
  }
  for (Box& b : in.pools[pool]) {
    if (b.state == Box::State::kFree) {
      free_box = &b;
      continue;
    }
    const bool b_future = b.state == Box::State::kFull && (!has_epoch_ || b.epoch > epoch_);
    if (future && b_future) {
      if (b.epoch >= h.epoch) return nullptr;  // We hold a newer one from this peer.
      b.state = Box::State::kFree;             // Abandoned by its sender: the newest wins.
      free_box = &b;
    }
  }
  return free_box;
}

void UcxTransport::on_recv_done(void* request, ucs_status_t status, size_t length,
                                void* user_data) {
  auto* box = static_cast<Box*>(user_data);
  --box->owner->inflight_;
  if (status != UCS_OK || box->discard) {
    box->state = Box::State::kFree;
  } else {
    box->state = Box::State::kFull;
  }
  box->discard = false;
  ucp_request_free(request);
}

void UcxTransport::deliver(const WireHeader& h, const void* data, size_t length, bool rndv) {
  const int src = h.src_rank;
  if (src < 0 || src >= options_.max_ranks) {
    ++num_rejected_;
    return;
  }
  Inbox& in = inboxes_[src];
  if (in.seen && h.src_incarnation < in.incarnation) {
    ++num_rejected_;  // A message of an incarnation that has been replaced.
    return;
  }
  if (!in.seen || h.src_incarnation > in.incarnation) reset_inbox(in, h.src_incarnation);
  in.heard = true;
  if (h.has_epoch != 0 && (!in.has_epoch || h.epoch >= in.epoch)) {
    in.has_epoch = true;
    in.epoch = h.epoch;
    in.has_prev = h.has_prev != 0;
    in.prev_epoch = h.prev_epoch;
    in.prev_ops = h.prev_ops;
  }
  in.regions_claimed = std::max<uint64_t>(in.regions_claimed, h.regions_announced);
  switch (h.type) {
    case MessageType::kBye:
      in.bye = true;
      acks_due_.push_back(src);  // Answered after progress, outside this callback.
      return;
    case MessageType::kByeAck:
      in.bye_acked = true;
      return;
    case MessageType::kEpoch:
      return;
    case MessageType::kRegion: {
      if (rndv || h.region_id < 0) {
        ++num_rejected_;
        return;
      }
      RemoteRegion& r = in.regions[static_cast<int>(h.region_id)];
      r.addr = h.region_addr;
      r.num_bytes = h.region_bytes;
      const auto* bytes = static_cast<const std::byte*>(data);
      r.packed_rkey.assign(bytes, bytes + length);
      return;
    }
    case MessageType::kCollective:
      break;
    default:
      ++num_rejected_;
      return;
  }
  Box* box = file_message(in, h, length);
  if (box == nullptr) {
    ++num_rejected_;
    return;
  }
  box->kind = h.kind;
  box->epoch = h.epoch;
  box->op_idx = h.op_idx;
  box->num_bytes = length;
  box->discard = false;
  if (!rndv) {
    if (length > 0) std::memcpy(box->data, data, length);
    box->state = Box::State::kFull;
    return;
  }
  box->state = Box::State::kFilling;
  ucp_request_param_t param{};
  param.op_attr_mask =
      UCP_OP_ATTR_FIELD_CALLBACK | UCP_OP_ATTR_FIELD_USER_DATA | UCP_OP_ATTR_FIELD_MEMH;
  param.cb.recv_am = &UcxTransport::on_recv_done;
  param.user_data = box;
  param.memh = mailboxes_memh_;
  void* request = ucp_am_recv_data_nbx(worker_, const_cast<void*>(data), box->data, length, &param);
  if (request == nullptr) {
    box->state = Box::State::kFull;
  } else if (UCS_PTR_IS_ERR(request)) {
    box->state = Box::State::kFree;
    ++num_rejected_;
  } else {
    ++inflight_;
  }
}

ucs_status_t UcxTransport::on_am(void* arg, const void* header, size_t header_length, void* data,
                                 size_t length, const ucp_am_recv_param_t* param) {
  auto* self = static_cast<UcxTransport*>(arg);
  const bool rndv = (param->recv_attr & UCP_AM_RECV_ATTR_FLAG_RNDV) != 0;
  if (header_length != sizeof(WireHeader)) {
    ++self->num_rejected_;
    return UCS_OK;  // Dropped (a rendezvous send completes on the sender).
  }
  WireHeader h;
  std::memcpy(&h, header, sizeof(h));
  if (h.magic != ucx::kWireMagic || self->shut_down_) {
    ++self->num_rejected_;
    return UCS_OK;
  }
  const uint64_t rejected = self->num_rejected_;
  self->deliver(h, data, length, rndv);
  // A rendezvous descriptor we started receiving now belongs to UCX (ucp_am_recv_data_nbx).
  return rndv && self->num_rejected_ == rejected ? UCS_INPROGRESS : UCS_OK;
}

std::string UcxTransport::op_label(OpKind kind) const {
  return std::string(ucx::op_kind_name(kind)) + " (epoch " + std::to_string(epoch_) + ", op " +
         std::to_string(ops_started_ == 0 ? 0 : ops_started_ - 1) + ")";
}

Result<std::vector<ByteSpan>> UcxTransport::all_gather(const Group& group, ByteSpan in) {
  std::vector<ByteSpan> out(static_cast<size_t>(options_.max_ranks));
  FLEX_RETURN_IF_ERROR(run_collective(OpKind::kAllGather, group, &in, 0, &out));
  return out;
}

Status UcxTransport::barrier(const Group& group) {
  const ByteSpan none;
  return run_collective(OpKind::kBarrier, group, &none, 0, nullptr);
}

Result<std::vector<ByteSpan>> UcxTransport::exchange(const Group& group,
                                                     const std::vector<ByteSpan>& send) {
  FLEX_RETURN_IF_ERROR(validate_send_count(send, options_));
  std::vector<ByteSpan> out(static_cast<size_t>(options_.max_ranks));
  FLEX_RETURN_IF_ERROR(run_collective(OpKind::kExchange, group, send.data(), 1, &out));
  return out;
}

Status UcxTransport::enter_epoch(uint64_t epoch, const char* op) {
  if (has_epoch_ && epoch == epoch_) return Status();
  if (has_epoch_ && epoch < epoch_) {
    return aborted(std::string(op) + ": group epoch " + std::to_string(epoch) +
                   " is older than this rank's epoch " + std::to_string(epoch_));
  }
  has_prev_ = has_epoch_;
  prev_epoch_ = epoch_;
  prev_ops_ = ops_started_;
  has_epoch_ = true;
  epoch_ = epoch;
  ops_started_ = 0;
  // Peers still waiting on us in an older epoch hear this and abort instead of timing out.
  const WireHeader h = header_for(MessageType::kEpoch);
  for (const auto& p : peers_) {
    if (p != nullptr && p->conn != nullptr && p->conn->ep != nullptr && !p->lost) {
      (void)post_send(*p, h, nullptr, 0, nullptr);
    }
  }
  return Status();
}

Status UcxTransport::run_collective(OpKind kind, const Group& group, const ByteSpan* sends,
                                    size_t stride, std::vector<ByteSpan>* out) {
  const char* op = ucx::op_kind_name(kind);
  std::unique_lock<std::mutex> lock(mu_);
  if (shut_down_) return failed_precondition(std::string(op) + " after shutdown");
  FLEX_RETURN_IF_ERROR(validate_group(
      group, op, options_, [this](int r) { return peers_[static_cast<size_t>(r)] != nullptr; }));
  const int pool = pool_of(kind);
  FLEX_RETURN_IF_ERROR(
      validate_sends(group, op, kind == OpKind::kExchange, sends, stride, options_));

  for (Box* b : held_) b->state = Box::State::kFree;  // The previous spans expire now.
  held_.clear();
  FLEX_RETURN_IF_ERROR(enter_epoch(group.epoch, op));
  const int64_t start_ns = mono_ns();
  const int64_t deadline_ns = start_ns + int64_t{options_.timeout_ms} * 1'000'000;
  // From here on the op consumes its index whatever happens: peers may have our message.
  const uint64_t cur = ops_started_++;
  in_collective_ = true;
  struct Leave {
    bool* flag;
    ~Leave() { *flag = false; }
  } leave{&in_collective_};
  for (int r : group.ranks) sweep_stale(inboxes_[r]);

  const int me = options_.rank;
  WireHeader h = header_for(MessageType::kCollective);
  h.kind = kind;
  h.op_idx = cur;
  // Send to the members after us first, wrapping around, then file our own.
  const size_t num_members = group.ranks.size();
  const size_t my_idx = static_cast<size_t>(
      std::lower_bound(group.ranks.begin(), group.ranks.end(), me) - group.ranks.begin());
  std::string failure;
  for (size_t i = 1; i < num_members; ++i) {
    const int r = group.ranks[(my_idx + i) % num_members];
    const Peer& peer = *peers_[r];
    if (!peer_error(peer).ok()) continue;  // Reported by the wait below, naming the rank.
    const ByteSpan& s = sends[static_cast<size_t>(r) * stride];
    int* pending =
        &staging_pending_[(static_cast<size_t>(pool) * options_.max_ranks + r) * 2 + (cur & 1)];
    if (*pending > 0 && !progress_until(lock, deadline_ns,
                                        [&] { return *pending == 0 || !peer_error(peer).ok(); })) {
      return deadline_exceeded(op_label(kind) + " timed out after " +
                               std::to_string(options_.timeout_ms) + " ms: rank " +
                               std::to_string(r) + " has not taken our previous message");
    }
    if (!peer_error(peer).ok()) continue;
    std::byte* slot = staging(pool, r, cur);
    if (s.num_bytes > 0) std::memcpy(slot, s.data, s.num_bytes);
    if (Status st = post_send(peer, h, slot, s.num_bytes, pending); !st.ok()) {
      FLEX_LOG(WARN) << op_label(kind) << ": " << st.to_string();
    }
  }
  const ByteSpan& mine = sends[static_cast<size_t>(me) * stride];
  deliver(h, mine.data, mine.num_bytes, /*rndv=*/false);

  std::vector<int> pending(group.ranks.begin(), group.ranks.end());
  std::vector<ByteSpan> scratch;
  std::vector<ByteSpan>* spans = out;
  if (spans == nullptr) {
    scratch.resize(static_cast<size_t>(options_.max_ranks));
    spans = &scratch;
  }
  Status status;
  // Takes what has arrived; true when all is in or on an error (in `status`).
  auto poll = [&]() {
    for (size_t i = 0; i < pending.size();) {
      const int r = pending[i];
      Inbox& in = inboxes_[r];
      const Peer& peer = *peers_[r];
      Box* got = nullptr;
      bool arriving = false;  // Being received: a peer that sent it and left is no error yet.
      if (in.seen && in.incarnation == peer.parsed.incarnation) {
        for (auto& p : in.pools) {
          for (Box& b : p) {
            if (b.epoch != epoch_ || b.op_idx != cur || b.discard) continue;
            if (b.state == Box::State::kFull) got = &b;
            if (b.state == Box::State::kFilling) arriving = true;
          }
        }
      }
      if (got != nullptr) {
        got->state = Box::State::kHeld;
        held_.push_back(got);
        if (got->kind != kind) {
          status = failed_precondition("collectives out of step: rank " + std::to_string(r) +
                                       " ran " + ucx::op_kind_name(got->kind) +
                                       " as this rank ran " + op_label(kind));
          return true;
        }
        if (kind == OpKind::kAllGather && got->num_bytes != mine.num_bytes) {
          status = invalid_argument(op_label(kind) + ": rank " + std::to_string(r) +
                                    " contributed " + std::to_string(got->num_bytes) +
                                    " bytes, this rank " + std::to_string(mine.num_bytes));
          return true;
        }
        (*spans)[static_cast<size_t>(r)] = ByteSpan{got->data, got->num_bytes};
        pending[i] = pending.back();
        pending.pop_back();
        continue;
      }
      if (arriving) {
        ++i;
        continue;
      }
      if (Status s = peer_error(peer); !s.ok()) {
        status =
            unavailable(s.message() + " during " + op_label(kind)).with_dead_rank(s.dead_rank());
        return true;
      }
      // Moved on to a newer epoch without (or before) sending us this op?
      const bool still_coming = in.has_prev && in.prev_epoch == epoch_ && in.prev_ops > cur;
      if (in.seen && in.incarnation == peer.parsed.incarnation && in.has_epoch &&
          in.epoch > epoch_ && !still_coming) {
        status = aborted(op_label(kind) + ": rank " + std::to_string(r) +
                         " has moved to newer epoch " + std::to_string(in.epoch));
        return true;
      }
      ++i;
    }
    return pending.empty();
  };
  if (!progress_until(lock, deadline_ns, poll)) {
    std::sort(pending.begin(), pending.end());
    std::string ranks;
    for (int r : pending) ranks += (ranks.empty() ? "" : ", ") + std::to_string(r);
    return deadline_exceeded(op_label(kind) + " timed out after " +
                             std::to_string(options_.timeout_ms) + " ms; no message from rank" +
                             (pending.size() > 1 ? "s " : " ") + ranks);
  }
  FLEX_RETURN_IF_ERROR(status);
  // Our own messages must have left too: a rank that returns and then dies (or exits) must
  // not take a message still queued in UCX (an endpoint still wiring up, a rendezvous not yet
  // fetched) with it. Live members take theirs within this very op.
  int unsent = -1;
  auto all_sent = [&] {
    for (int r : group.ranks) {
      if (r == me || !peer_error(*peers_[r]).ok()) continue;
      if (staging_pending_[(static_cast<size_t>(pool) * options_.max_ranks + r) * 2 + (cur & 1)] >
          0) {
        unsent = r;
        return false;
      }
    }
    return true;
  };
  if (!progress_until(lock, deadline_ns, all_sent)) {
    return deadline_exceeded(op_label(kind) + " timed out after " +
                             std::to_string(options_.timeout_ms) + " ms: our message to rank " +
                             std::to_string(unsent) + " has not left");
  }
  return Status();
}

}  // namespace flexpert
