// SPDX-License-Identifier: Apache-2.0
// CudaIpcTransport collectives: shm::MailboxProtocol (shm_protocol.h, the shm backend's) with
// the payloads in device memory.
//
// Op k of epoch e on rank me:
//   1. start the op (free the mailboxes the previous collective returned: their spans expire);
//   2. for each member r: claim mailbox [me][k & 1] in r's control segment (Writing), write
//      kind, epoch and size, and queue a copy of the payload into slot [me][k & 1] of r's
//      receive buffer on the copy stream;
//   3. synchronize the copy stream, then publish every claimed mailbox Full(k) and ring;
//   4. claim Full(k) with epoch e in every member's mailbox of this rank's own segment (Held)
//      and return spans into this rank's receive buffer.
#include <algorithm>

#include "transport/collective_checks.h"
#include "transport/cuda_ipc/cuda_ipc_transport.h"
#include "transport/shm/shm_peers.h"

namespace flexpert {

using cuda_ipc::cuda_check;
using shm::MailboxHeader;
using shm::MailboxState;
using shm::OpKind;

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
  FLEX_RETURN_IF_ERROR(validate_send_count(send, options_));
  std::vector<ByteSpan> out(static_cast<size_t>(options_.max_ranks));
  FLEX_RETURN_IF_ERROR(run_collective(OpKind::kExchange, group, send.data(), 1, &out));
  return out;
}

Status CudaIpcTransport::run_collective(OpKind kind, const Group& group, const ByteSpan* sends,
                                        size_t stride, std::vector<ByteSpan>* out) {
  const char* op = shm::op_kind_name(kind);
  if (shut_down_) return failed_precondition(std::string(op) + " after shutdown");
  FLEX_RETURN_IF_ERROR(validate_group(
      group, op, options_, [this](int r) { return peers_[static_cast<size_t>(r)] != nullptr; }));
  const bool is_exchange = kind == OpKind::kExchange;
  FLEX_RETURN_IF_ERROR(validate_sends(group, op, is_exchange, sends, stride, options_));
  cuda_ipc::ScopedDevice scoped(options_.device);
  FLEX_RETURN_IF_ERROR(scoped.status());

  FLEX_ASSIGN_OR_RETURN(const int64_t start_ns, protocol_.start_op(group.epoch, op));
  FLEX_RETURN_IF_ERROR(send_all(kind, group, sends, stride, protocol_.deadline_ns(start_ns)));
  protocol_.clear_awaited();
  for (int r : group.ranks) {
    const std::byte* payload =
        recv_->data() + layout_.slot_offset(is_exchange, r, protocol_.cur_op());
    protocol_.await({r, protocol_.own_mailbox(is_exchange, r), peers_[r].get(), payload});
  }
  return protocol_.wait_for(kind, sends[static_cast<size_t>(options_.rank) * stride], start_ns,
                            out);
}

Status CudaIpcTransport::send_all(OpKind kind, const Group& group, const ByteSpan* sends,
                                  size_t stride, int64_t deadline_ns) {
  const bool is_exchange = kind == OpKind::kExchange;
  const int me = options_.rank;
  const uint64_t cur_op = protocol_.cur_op();
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
    status = protocol_.claim(peer, kind, deadline_ns, &mb);
    if (!status.ok()) break;
    const ByteSpan& payload = sends[static_cast<size_t>(r) * stride];
    protocol_.write_header(mb, kind, payload.num_bytes);
    if (payload.num_bytes > 0) {
      std::byte* dst = peer.recv + layout_.slot_offset(is_exchange, me, cur_op);
      const cudaError_t err = cudaMemcpyAsync(dst, payload.data, payload.num_bytes,
                                              cudaMemcpyDefault, copy_stream_->get());
      if (err != cudaSuccess) {
        mb->state.store(shm::pack_state(0, MailboxState::kFree), std::memory_order_release);
        status = cuda_ipc::cuda_status(err, "cudaMemcpyAsync")
                     .annotate(protocol_.op_label(kind) + ": copy to rank " + std::to_string(r));
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
            .annotate(protocol_.op_label(kind) + ": copies to the members");
    if (!synced.ok()) {
      for (const Claimed& c : claimed_) {
        c.mailbox->state.store(shm::pack_state(0, MailboxState::kFree), std::memory_order_release);
      }
      claimed_.clear();
      return status.ok() ? synced : status;
    }
  }
  for (const Claimed& c : claimed_) protocol_.publish(*c.peer, c.mailbox);
  claimed_.clear();
  return status;
}

Status CudaIpcTransport::peer_status(int peer) const {
  if (host_ != nullptr) return host_->peer_status(peer);
  return shm::peer_status_of(options_, peers_, peer);
}

}  // namespace flexpert
