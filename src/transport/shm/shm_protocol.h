// SPDX-License-Identifier: Apache-2.0
// MailboxProtocol: the collectives protocol of shm_layout.h over mapped control segments, for
// the backends whose ranks share a host's memory: shm (the payloads in the mailboxes) and
// cuda_ipc (header-only mailboxes, the payloads in device slots: cuda_ipc_layout.h).
//
// Op k of epoch e on rank me, as a backend drives it:
//   1. start_op: free the mailboxes the previous collective returned (their spans expire now),
//      enter epoch e (publishing it and ringing the peers when it is new), consume index k;
//   2. for each member r: claim mailbox [me][k & 1] in r's segment (Writing), write_header,
//      put the payload where r will read it (the backend's part), publish Full(k) and ring;
//   3. await every member's mailbox of this rank's own segment, then wait_for: claim Full(k)
//      with epoch e (Held) in each and return spans of the payloads.
// Waiting spins, yields, then sleeps on the futex in slices; it checks each awaited peer for
// shutdown, being marked lost and newer epochs on every look and for exit (pidfd) once per
// slice, and gives up at timeout_ms (shm_transport.h).
// An op that failed after start_op still used its index: recover in a new epoch.
//
// Thread safety: one driving thread runs the collectives; lost_status() on any thread.
#pragma once

#include <atomic>
#include <cstddef>
#include <cstdint>
#include <functional>
#include <mutex>
#include <string>
#include <vector>

#include "flexpert/status.h"
#include "transport/shm/shm_layout.h"
#include "transport/shm/shm_segment.h"
#include "transport/transport.h"

namespace flexpert::shm {

// An attached control segment (a peer's, or this rank's own) as the protocol sees it; the
// backends' peer records derive from it.
struct PeerLink {
  int rank = -1;
  SegmentHeader* header = nullptr;
  std::byte* control_base = nullptr;  // The segment's start: mailboxes at the Layout's offsets.
  ProcessWatch watch;
  int32_t pid = 0;
  // Set by Transport::mark_peer_lost (any thread); lost_why is written before, under lost_mu.
  std::atomic<bool> lost{false};
  mutable std::mutex lost_mu;
  std::string lost_why;
};

// Unavailable "rank R (pid P) lost: why" once the peer was marked lost; OK otherwise.
Status lost_status(const PeerLink& peer);

// One member's message a collective waits for.
struct Awaited {
  int rank;
  MailboxHeader* mailbox;  // In this rank's segment.
  const PeerLink* peer;
  const std::byte* payload;  // Where the message's bytes are when it arrived.
};

class MailboxProtocol {
 public:
  // `mailboxes`: where the mailboxes sit in every rank's control segment. spin_ns: busy-wait
  // budget of a wait before it yields; yield_ns: then sched_yield() for this long before it
  // sleeps on the futex. `ring_peers` wakes every connected peer (on entering a new epoch).
  MailboxProtocol(const TransportOptions& options, Layout mailboxes, int64_t spin_ns,
                  int64_t yield_ns, std::function<void()> ring_peers);

  // This rank's own control segment, once created; unbind() at shutdown forgets it.
  void bind(SegmentHeader* header, std::byte* base);
  void unbind();

  uint64_t cur_op() const { return cur_op_; }  // Index of the op in progress.
  // "all_gather (epoch E, op K)": the op in progress, for messages.
  std::string op_label(OpKind kind) const;

  // Step 1. Returns the op's start time; its deadline is deadline_ns(start).
  Result<int64_t> start_op(uint64_t epoch, const char* op);
  int64_t deadline_ns(int64_t start_ns) const {
    return start_ns + int64_t{timeout_ms_} * 1'000'000;
  }

  // Step 2. Claims this rank's mailbox of the op in `peer`'s segment (Writing). Waits only when
  // the peer still holds our previous message on that parity (it is in an older epoch).
  Status claim(const PeerLink& peer, OpKind kind, int64_t deadline_ns, MailboxHeader** out);
  // Writes a claimed mailbox's kind, epoch, op index and payload size.
  void write_header(MailboxHeader* mailbox, OpKind kind, size_t num_bytes) const;
  // Publishes a written mailbox Full (its payload must be in place) and rings its owner.
  void publish(const PeerLink& peer, MailboxHeader* mailbox) const;

  // Step 3. Mailbox [src_rank][op parity] of this rank's own segment.
  MailboxHeader* own_mailbox(bool exchange, int src_rank) const {
    return layout_.mailbox(base_, exchange, src_rank, cur_op_);
  }
  void clear_awaited() { pending_.clear(); }
  void await(const Awaited& awaited) { pending_.push_back(awaited); }
  // Claims every awaited message; out[r] (null for barrier) gets member r's payload. `mine` is
  // this rank's contribution (all_gather contributions must all have its size).
  Status wait_for(OpKind kind, ByteSpan mine, int64_t start_ns, std::vector<ByteSpan>* out);

  // A peer's state as a wait sees it: lost, shut down, in a newer epoch or (check_pid) dead.
  Status check_peer(const PeerLink& peer, OpKind kind, bool check_pid) const;

 private:
  void release_held();
  Status enter_epoch(uint64_t epoch, const char* op);
  // 1: claimed; 0: not there yet; -1: error in *status.
  int try_take(const Awaited& awaited, OpKind kind, ByteSpan mine, std::vector<ByteSpan>* out,
               Status* status);

  const int rank_;
  const size_t max_gather_bytes_;
  const size_t max_exchange_bytes_;
  const int timeout_ms_;
  const Layout layout_;
  const int64_t spin_ns_;
  const int64_t yield_ns_;
  const std::function<void()> ring_peers_;

  SegmentHeader* header_ = nullptr;  // This rank's segment.
  std::byte* base_ = nullptr;

  bool has_epoch_ = false;
  uint64_t epoch_ = 0;
  uint64_t op_idx_ = 0;               // Index of the next op within epoch_.
  uint64_t cur_op_ = 0;               // Index of the op in progress (for messages).
  std::vector<MailboxHeader*> held_;  // Claimed by the last collective.
  std::vector<Awaited> pending_;      // Scratch, reused.
};

}  // namespace flexpert::shm
