// SPDX-License-Identifier: Apache-2.0
// HierTransport: the Transport backend for ranks spread over several hosts, each pair of ranks
// through the backend it shares: within a host shm (CPU ranks) or cuda_ipc (GPU ranks), ucx
// between hosts.
//
// It owns a host-local backend and a UcxTransport with the same options. The host-local backend
// is a ShmTransport, or with TransportOptions::host_collectives (GPU ranks: the worker sets it)
// a CudaIpcTransport in its host-collectives mode, whose collectives, regions and reads are
// its inner ShmTransport's (so everything below that says shm holds for both) and which adds
// the mapped peer buffers. Its address is
// "hier:<host id>|<host-local address>|<ucx address>"; the host id (local_host_id()) is
// FLEXPERT_HOST_ID, or the host name and the network namespace's inode, so that two network
// namespaces of one machine count as two hosts. connect() attaches over shm when the peer's
// host is ours, and over ucx when it is not, or once this rank has any peer on another host
// (the collectives of a group that spans hosts run over the whole group there).
//
// Regions are shm segments, registered with ucx as well (UcxTransport::register_region):
// read() of a same-host peer maps its segment, read() of another host's rank is a UCX get.
// Collectives, all decided from the group and the hosts of its members (the same on every
// member):
// - a group on one host runs on shm alone (with one ucx progress() call: over TCP, peers on
//   other hosts, e.g. joiners copying experts, read this rank's regions only while it
//   progresses, and UCX finishes its wireup with same-host peers), a group whose members are
//   each alone on their host on ucx alone;
// - all_gather and barrier of a group that spans hosts run on ucx (small payloads);
// - exchange of a group that spans hosts runs shm over the members of this host (their rows)
//   and then ucx over the whole group, with empty payloads between same-host members.
// Each backend learns every epoch this rank enters: one that a collective of a new epoch does
// not use runs a barrier of this rank alone in that epoch, so a peer still waiting on it in an
// older epoch hears of the newer one (Aborted) as it does from a plain backend.
// Peer loss seen by either backend is the peer's loss; mark_peer_lost, peer_status, progress
// and shutdown go to both.
// Mapped peer buffers (only over cuda_ipc): register_buffer() goes to cuda_ipc, and
// map_peer_buffer() maps a peer of this host through it; a peer on another host answers
// Unimplemented (its memory cannot be mapped here: the device EP exchange and slot copies
// take their host paths, docs/ARCHITECTURE.md "Mapped peer buffers"). Where ucx registers
// device memory (capabilities().device_buffer_reads), register_buffer() goes to ucx too, and a
// peer on another host read()s such a buffer straight into device memory.
//
// Thread safety: as transport.h: one driving thread; read(), peer_status(), mark_peer_lost()
// and stats() may run on other threads.
#pragma once

#include <atomic>
#include <memory>
#include <string>
#include <vector>

#include "core/mutex.h"
#include "transport/shm/shm_transport.h"
#include "transport/transport.h"
#include "transport/ucx/ucx_transport.h"

namespace flexpert {

// This process's host identity: FLEXPERT_HOST_ID, else "<hostname>/netns:<inode>".
std::string local_host_id();

class HierTransport final : public Transport {
 public:
  // Bytes this rank sent (collective payloads to other ranks) and read, by backend (shm_bytes:
  // the host-local backend's host shm), and map_peer_buffer() answers for other ranks.
  struct Stats {
    uint64_t shm_bytes = 0;
    uint64_t ucx_bytes = 0;
    uint64_t buffers_mapped = 0;   // Peers of this host, a mapping handed out (cuda_ipc).
    uint64_t buffers_refused = 0;  // Peers on other hosts: Unimplemented.
  };

  static Result<std::unique_ptr<HierTransport>> create(const TransportOptions& options);
  ~HierTransport() override;

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

  Status register_buffer(int buffer_id, void* data, size_t num_bytes) override;
  Result<PeerBuffer> map_peer_buffer(int peer, int buffer_id, MapMode mode) override;

  Status shutdown() override;
  void progress() override { ucx_->progress(); }
  Status peer_status(int peer) const override;
  Status mark_peer_lost(int peer, const std::string& why) override;
  int timeout_ms() const override { return options_.timeout_ms; }

  Stats stats() const;
  // Whether a connected peer shares this rank's host (its pairs go through the host-local
  // backend). Any thread.
  bool same_host(int peer) const;
  // The host-local backend's name: "shm", or "cuda_ipc" for GPU ranks.
  const char* local_backend() const { return local_name_; }

 private:
  // Where a collective of `group` runs; decided alike by every member.
  struct Plan {
    Group local;  // The members on this host (this rank included).
    bool one_host = false;
  };

  HierTransport(TransportOptions options, std::string host, std::unique_ptr<Transport> local,
                ShmTransport* local_shm, const char* local_name, std::unique_ptr<UcxTransport> ucx);
  Result<Plan> plan(const Group& group, const char* op) const;
  // The newest epoch a backend was given by this rank (driving thread).
  struct EpochSeen {
    bool any = false;
    uint64_t epoch = 0;
    void note(uint64_t e) {
      if (!any || e > epoch) epoch = e;
      any = true;
    }
  };
  // Tells `backend` of `epoch` (a barrier of this rank alone) unless it has seen it.
  Status enter_epoch(Transport& backend, EpochSeen* seen, uint64_t epoch);

  const TransportOptions options_;
  const std::string host_;
  // The host-local backend (shm, or cuda_ipc with host collectives). local_ outlives ucx_: ucx_
  // registered the memory of its regions.
  std::unique_ptr<Transport> local_;
  // The ShmTransport that holds the collectives and regions: local_ itself or cuda_ipc's inner one.
  ShmTransport* const host_shm_;
  const char* const local_name_;
  std::unique_ptr<UcxTransport> ucx_;
  std::string address_;

  // What this rank knows of a peer. Written by the driving thread.
  struct PeerState {
    std::string host;  // Empty: not connected.
    std::string ucx_address;
    bool on_ucx = false;   // ucx_ is connected to it (same-host peers: once any_remote_).
    std::string lost_why;  // mark_peer_lost of a same-host peer, for a later UCX endpoint.
  };
  Status connect_ucx_locked(int peer) REQUIRES(mu_);

  mutable Mutex mu_;
  std::vector<PeerState> peers_ GUARDED_BY(mu_);  // By rank.
  bool any_remote_ GUARDED_BY(mu_) = false;       // A peer on another host was connected.
  // The same as the collectives need it, without the lock (driving thread only).
  enum class Where : uint8_t { kNone, kLocal, kRemote };
  std::vector<Where> where_;

  bool shut_down_ = false;  // Driving thread.
  EpochSeen local_epoch_;
  EpochSeen ucx_epoch_;
  std::vector<ByteSpan> local_send_;  // Scratch of exchange (driving thread).
  std::vector<ByteSpan> ucx_send_;

  std::atomic<uint64_t> shm_bytes_{0};
  std::atomic<uint64_t> ucx_bytes_{0};
  std::atomic<uint64_t> buffers_mapped_{0};
  std::atomic<uint64_t> buffers_refused_{0};
};

}  // namespace flexpert
