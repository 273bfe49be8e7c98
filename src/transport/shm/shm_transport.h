// SPDX-License-Identifier: Apache-2.0
// ShmTransport: the Transport backend for ranks that are processes of one host.
//
// Each rank creates one control segment "/flexpert-<session>-r<rank>-i<incarnation>" (its
// address) holding, for every possible source rank, double-buffered mailboxes for all_gather
// (max_gather_bytes each) and exchange (max_exchange_bytes each); see shm_layout.h. A
// collective writes this rank's payload straight into each member's mailbox (one memcpy),
// then waits for its own mailboxes: the returned spans point into them (zero copy).
// Regions are separate segments "<address>-g<id>", mapped read-only by peers on first read().
//
// Waiting spins 5 µs, yields for 20 µs (FLEXPERT_SHM_SPIN_US / FLEXPERT_SHM_YIELD_US), then
// sleeps on a futex in 2 ms slices; it checks each awaited peer for shutdown and newer epochs
// on every look and for exit (pidfd) once per slice, and gives up at timeout_ms. Ranks must
// share a PID namespace for exit detection; otherwise only shutdown flags and timeouts notice.
// An op index counts the collectives this rank ran in the current epoch: every member of a
// group must run the same collectives in that epoch (one member set per epoch). An op that
// failed after its input was validated still used its index: recover in a new epoch.
//
// Thread safety: connect, disconnect, allocate_region, the collectives and shutdown are called
// by one driving thread; read() and the const accessors may run on any thread concurrently.
#pragma once

#include <atomic>
#include <memory>
#include <mutex>
#include <string>
#include <unordered_map>
#include <vector>

#include "transport/shm/shm_layout.h"
#include "transport/shm/shm_protocol.h"
#include "transport/shm/shm_segment.h"
#include "transport/transport.h"

namespace flexpert {

class ShmTransport final : public Transport {
 public:
  static Result<std::unique_ptr<ShmTransport>> create(const TransportOptions& options);
  // Unmaps and unlinks what is left and marks this rank closed; never waits on peers.
  ~ShmTransport() override;

  TransportCapabilities capabilities() const override;
  int rank() const override { return options_.rank; }
  int max_ranks() const override { return options_.max_ranks; }
  std::string address() const override { return address_; }

  Status connect(int peer, const std::string& address) override;
  Status disconnect(int peer) override;

  Result<Region> allocate_region(int region_id, size_t num_bytes) override;
  Status read(int peer, int region_id, size_t offset, void* dst, size_t num_bytes) override;

  Result<std::vector<ByteSpan>> all_gather(const Group& group, ByteSpan in) override;
  Status barrier(const Group& group) override;
  Result<std::vector<ByteSpan>> exchange(const Group& group,
                                         const std::vector<ByteSpan>& send) override;

  Status shutdown() override;
  // What shutdown() tells peers first (this rank is closed: their waits on it end at once),
  // with everything still mapped: for the hier backend, whose ucx part serves reads of these
  // regions until it has said goodbye. Driving thread; shutdown() still follows.
  void announce_closing();
  Status peer_status(int peer) const override;
  Status mark_peer_lost(int peer, const std::string& why) override;
  int timeout_ms() const override { return options_.timeout_ms; }

 private:
  // A mapped control segment (a peer's, or this rank's own) and the regions read from it.
  // Shared: peers_ holds one reference, and read() on another thread holds one while it copies.
  // The PeerLink's lost flag is set by mark_peer_lost (any thread).
  struct Peer : shm::PeerLink {
    std::string address;
    std::shared_ptr<shm::ShmMapping> control;  // Also owned by self_ for this rank's own.
    std::mutex regions_mu;
    // GUARDED_BY(regions_mu). Mappings are shared with read() calls in flight.
    std::unordered_map<int, std::shared_ptr<const shm::ShmMapping>> regions;
  };

  ShmTransport(TransportOptions options, shm::Layout layout, std::string address);

  Result<std::shared_ptr<Peer>> attach(int peer, const std::string& address);

  // The collectives in one: `sends[r * stride]` is this rank's payload for member r
  // (stride 0: the same payload for all, as all_gather). Fills out[r] for every member.
  Status run_collective(shm::OpKind kind, const Group& group, const ByteSpan* sends, size_t stride,
                        std::vector<ByteSpan>* out);
  Status send_to(const Peer& peer, shm::OpKind kind, ByteSpan payload, int64_t deadline_ns);
  void ring_all_peers();
  void close_and_release();

  const TransportOptions options_;
  const shm::Layout layout_;
  const std::string address_;
  // The collectives' state (driving thread only); waits spin FLEXPERT_SHM_SPIN_US, then yield
  // for FLEXPERT_SHM_YIELD_US, before they sleep.
  shm::MailboxProtocol protocol_;

  std::shared_ptr<shm::ShmMapping> control_;  // This rank's segment. Shared with self_.
  shm::SegmentHeader* header_ = nullptr;
  std::byte* base_ = nullptr;
  bool shut_down_ = false;

  // Written by the driving thread under peers_mu_; read without the lock by the driving
  // thread (the only writer) and under it by read(). Indexed by rank; null = not connected.
  mutable std::mutex peers_mu_;
  std::vector<std::shared_ptr<Peer>> peers_;

  // Regions this rank allocated. GUARDED_BY(peers_mu_); shared with read() calls in flight.
  std::unordered_map<int, std::shared_ptr<shm::ShmMapping>> own_regions_;
};

// Removes every /dev/shm segment of `session` (control and regions, any rank or incarnation):
// for a supervisor cleaning up after ranks that died without shutdown(). Returns how many.
Result<int> remove_shm_session(const std::string& session);

}  // namespace flexpert
