// SPDX-License-Identifier: Apache-2.0
// The peer lookups of shm and cuda_ipc, the backends that attach each other's control segments
// (shm_control.h). Both keep their connected peers in a vector indexed by rank (null: not
// connected; this rank's entry is its own segment) guarded for other threads by a mutex, and
// this rank's own regions in a map beside it. PeerT derives from PeerLink and has
// `std::string address` (what connect() was given).
//
// Thread safety: as the backends'. The driving thread changes `peers` under the mutex and reads
// it without (it is the only writer); read() and map_peer_buffer() on other threads look up
// under the mutex (find_target).
#pragma once

#include <cstddef>
#include <memory>
#include <mutex>
#include <string>
#include <unordered_map>
#include <utility>
#include <vector>

#include "core/release_later.h"
#include "flexpert/status.h"
#include "transport/shm/shm_protocol.h"
#include "transport/transport.h"

namespace flexpert::shm {

// Transport::connect: checks `peer` and `address`, then attaches it with attach() (returning
// Result<std::shared_ptr<PeerT>>) unless it is this rank at its own address or a peer attached
// at `address` already (idempotent). A new address (another incarnation of that rank id)
// replaces the old attachment, which is released on release_later's thread (or by a read() in
// flight): unmapping a peer's segments whose pages were touched takes milliseconds per 100 MB.
template <typename PeerT, typename Attach>
Status connect_peer(const TransportOptions& options, bool shut_down, const std::string& own_address,
                    std::mutex& mu, std::vector<std::shared_ptr<PeerT>>& peers, int peer,
                    const std::string& address, Attach attach) {
  if (shut_down) return failed_precondition("connect after shutdown");
  if (peer < 0 || peer >= options.max_ranks) {
    return invalid_argument("connect: rank " + std::to_string(peer) + " not in [0, " +
                            std::to_string(options.max_ranks) + ")");
  }
  if (peer == options.rank) {
    return address == own_address ? Status()
                                  : invalid_argument("connect: '" + address +
                                                     "' is not this rank's address " + own_address);
  }
  if (peers[peer] != nullptr && peers[peer]->address == address) return Status();
  FLEX_ASSIGN_OR_RETURN(std::shared_ptr<PeerT> p, attach());
  std::shared_ptr<PeerT> dropped;
  {
    std::lock_guard<std::mutex> lock(mu);
    dropped = std::move(peers[peer]);
    peers[peer] = std::move(p);
  }
  release_later(std::move(dropped));
  return Status();
}

// Transport::disconnect: drops `peer`'s attachment (released on release_later's thread, or
// by a read() in flight). InvalidArgument for this rank or a rank out of range.
template <typename PeerT>
Status disconnect_peer(const TransportOptions& options, std::mutex& mu,
                       std::vector<std::shared_ptr<PeerT>>& peers, int peer) {
  if (peer < 0 || peer >= options.max_ranks || peer == options.rank) {
    return invalid_argument("disconnect: bad peer rank " + std::to_string(peer));
  }
  std::shared_ptr<PeerT> dropped;
  {
    std::lock_guard<std::mutex> lock(mu);
    if (!peers.empty()) dropped = std::move(peers[peer]);  // Empty after shutdown.
  }
  release_later(std::move(dropped));
  return Status();
}

// What read() and map_peer_buffer() act on: this rank's own region, or a connected peer.
template <typename PeerT, typename OwnT>
struct Target {
  OwnT own;  // Set for this rank (`peer` == options.rank).
  std::shared_ptr<PeerT> peer;
};

// Looks `peer` up under `mu` (`what` names the call in messages): this rank's own region
// `region_id`, NotFound "<what>: not <own_verb>" when it has none; or the connected peer,
// Unavailable "<what>: rank not connected" when it is not. FailedPrecondition after shutdown.
// `peer` must be in range (validated by the caller). `shut_down` is read under the lock (it is
// set under it at shutdown, on the driving thread, while this may run on another).
template <typename PeerT, typename OwnT>
Result<Target<PeerT, OwnT>> find_target(const TransportOptions& options, const bool& shut_down,
                                        std::mutex& mu,
                                        const std::vector<std::shared_ptr<PeerT>>& peers,
                                        const std::unordered_map<int, OwnT>& own, int peer,
                                        int region_id, const std::string& what,
                                        const char* own_verb) {
  Target<PeerT, OwnT> target;
  std::lock_guard<std::mutex> lock(mu);
  if (shut_down) return failed_precondition(what + " after shutdown");
  if (peer == options.rank) {
    auto it = own.find(region_id);
    if (it == own.end()) return not_found(what + ": not " + own_verb);
    target.own = it->second;
  } else {
    target.peer = peers[peer];
    if (target.peer == nullptr) return unavailable(what + ": rank not connected");
  }
  return target;
}

// allocate_region's checks: FailedPrecondition after shutdown, InvalidArgument for a negative
// id, no bytes, or an id this rank has allocated already. Driving thread.
template <typename OwnT>
Status check_new_region(bool shut_down, std::mutex& mu, const std::unordered_map<int, OwnT>& own,
                        int region_id, size_t num_bytes) {
  if (shut_down) return failed_precondition("allocate_region after shutdown");
  if (region_id < 0) return invalid_argument("region id must be >= 0");
  if (num_bytes == 0) return invalid_argument("region " + std::to_string(region_id) + ": 0 bytes");
  std::lock_guard<std::mutex> lock(mu);
  if (own.count(region_id) != 0) {
    return invalid_argument("region " + std::to_string(region_id) + " already allocated");
  }
  return Status();
}

// Unavailable "<what>: rank R has shut down" once `peer`'s segment is closed: a read() of its
// memory, which may be gone.
inline Status check_not_closed(const PeerLink& peer, const std::string& what) {
  if (peer.header->closed.load(std::memory_order_acquire) == 0) return Status();
  return unavailable(what + ": rank " + std::to_string(peer.rank) + " has shut down");
}

// Transport::peer_status: marked lost, shut down or dead (shm::peer_liveness); OK for this rank
// and ranks not connected. Driving thread.
template <typename PeerT>
Status peer_status_of(const TransportOptions& options,
                      const std::vector<std::shared_ptr<PeerT>>& peers, int peer) {
  if (peer < 0 || peer >= options.max_ranks) {
    return invalid_argument("rank " + std::to_string(peer) + " out of range");
  }
  const PeerT* p = static_cast<size_t>(peer) < peers.size() ? peers[peer].get() : nullptr;
  if (p == nullptr || peer == options.rank) return Status();  // (No peers after shutdown.)
  FLEX_RETURN_IF_ERROR(lost_status(*p));
  return peer_liveness(peer, p->pid, *p->header, p->watch);
}

// Rings every connected peer's doorbell (not this rank's own).
template <typename PeerT>
void ring_peers(const std::vector<std::shared_ptr<PeerT>>& peers, int rank) {
  for (const auto& p : peers) {
    if (p != nullptr && p->rank != rank) ring_doorbell(p->header);
  }
}

}  // namespace flexpert::shm
