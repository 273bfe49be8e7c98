// SPDX-License-Identifier: Apache-2.0
// Transport: the one interface every data-plane backend implements.
//
// A transport connects this rank to the peers of a group of at most max_ranks
// ranks. It offers memory regions peers can read one-sidedly (expert weights for
// the EPLB mover and scale-up), and collectives over an explicit Group (epoch +
// member ranks): a small all-gather for step headers, a barrier, and exchange,
// the all-to-all of token rows that EP dispatch and combine use.
//
// Contract shared by every backend (tests/transport/conformance_test.cc checks it):
// - Every member calls the same collectives in the same order for a given epoch;
//   collective k of epoch e on one rank pairs with collective k of epoch e on the
//   others. Non-members are never waited on.
// - Every wait has a timeout (options.timeout_ms): a dead or silent peer yields
//   Unavailable (peer known dead) or DeadlineExceeded, never a hang. A peer found
//   in a newer epoch yields Aborted: the caller redoes the step in that epoch.
// - Buffers returned by a collective stay valid until this rank's next collective call.
// - Regions are allocated once (capacity) and stay valid and at the same address until shutdown.
// - Mapped peer buffers (capabilities().mapped_peer_buffers, device backends): a rank registers
//   device buffers it allocated, once, at capacity; a peer maps them and gets pointers its own
//   kernels and copies use directly, valid for the owner's incarnation (see map_peer_buffer).
// Thread safety: one thread drives collectives; read() and map_peer_buffer() may run
// concurrently on another thread (the weight mover). shutdown() is explicit and collective-free.
#pragma once

#include <cstddef>
#include <cstdint>
#include <functional>
#include <memory>
#include <string>
#include <vector>

#include "flexpert/status.h"

namespace flexpert {

// The ranks taking part in a collective: the membership epoch and its members.
struct Group {
  uint64_t epoch = 0;
  std::vector<int> ranks;  // Ascending; includes the calling rank.

  bool contains(int rank) const;
};

struct TransportCapabilities {
  bool one_sided_read = false;       // read() is supported.
  bool device_memory = false;        // Regions and buffers live in GPU memory.
  bool cross_host = false;           // Peers may live on other hosts.
  size_t max_gather_bytes = 0;       // Largest all_gather contribution.
  size_t max_exchange_bytes = 0;     // Largest exchange payload to one peer.
  bool mapped_peer_buffers = false;  // register_buffer() / map_peer_buffer() are supported.
  // register_buffer() takes device memory that peers read() (into device memory too) without
  // staging it through host memory: ucx where the UCX loaded supports CUDA memory, and hier
  // for its peers on other hosts. Peers on another host read it; none maps it.
  bool device_buffer_reads = false;
};

struct TransportOptions {
  std::string session;  // Unique per serving group: names shared resources.
  int rank = 0;
  uint64_t incarnation = 0;  // Bumped each time a rank id is reused.
  int max_ranks = 1;
  size_t max_gather_bytes = 4096;
  size_t max_exchange_bytes = 1 << 20;
  int timeout_ms = 10000;
  int device = 0;  // CUDA device ordinal of device-memory backends (cuda_ipc); shm ignores it.
  // ucx: when set (or FLEXPERT_UCX_LISTEN_HOST is), the rank listens on this IP and peers connect
  // to that socket (UCX's client-server wireup, which needs tcp in UCX_TLS); when empty, peers
  // connect by the rank's UCP worker address (any UCX_TLS). Host-local backends ignore it.
  std::string listen_host;
  // cuda_ipc: collectives and regions in host shared memory (the shm backend's, run inside it)
  // and device memory only for mapped peer buffers: for callers whose collectives and regions
  // carry host data (the worker: step headers, the host exchange, host mirrors of the slots).
  // hier: its backend within a host is cuda_ipc so set (GPU ranks) instead of shm. Other
  // backends ignore it.
  bool host_collectives = false;
};

// A block of memory this rank owns that peers may read(). Backend-allocated.
struct Region {
  int id = -1;
  void* data = nullptr;
  size_t num_bytes = 0;
};

// A peer's registered buffer (or region) mapped into this process: map_peer_buffer().
struct PeerBuffer {
  void* data = nullptr;  // Device pointer usable by this process's kernels and copies.
  size_t num_bytes = 0;
  uint64_t incarnation = 0;  // The owner's (TransportOptions::incarnation) the mapping is of.
  // Keeps the mapping open. The backend drops its own reference when connect() attaches another
  // incarnation of the owner or disconnect() detaches it; the mapping is closed when the last
  // holder lets go (a caller that still runs work on it holds it until that work is done).
  std::shared_ptr<const void> mapping;
  // Whether the owner's process has exited, for a caller that closes a mapping only once its
  // owner is gone (docs/cuda.md says why the device exchange does); it keeps answering after
  // the backend let go of the owner. Null where the owner is not watched (this process, or one
  // this process cannot see): such a mapping may be closed at any time. Any thread; a few us.
  std::function<bool()> owner_exited;
  // Whether the owner's process is on its way out (in the kernel's exit path) or gone: a
  // mapping of a living owner (one that left the group) may be closed at once, before its
  // teardown begins. Null exactly where owner_exited is. Any thread; a few us.
  std::function<bool()> owner_ending;
};

// What map_peer_buffer() may do to get a buffer not mapped yet.
enum class MapMode {
  kMap,     // Map it (milliseconds a GB, on one GPU too; it holds the process's CUDA context).
  kLookup,  // Never map: a buffer not mapped yet comes back with data == nullptr.
};

// A contiguous byte range; what a collective sends or received.
struct ByteSpan {
  const void* data = nullptr;
  size_t num_bytes = 0;
};

class Transport {
 public:
  virtual ~Transport() = default;

  virtual TransportCapabilities capabilities() const = 0;
  virtual int rank() const = 0;
  virtual int max_ranks() const = 0;
  // What peers pass to connect() to reach this rank (e.g. a shm name prefix).
  virtual std::string address() const = 0;

  // Attaches to a peer (idempotent for the same address; a new address, i.e. a new
  // incarnation of that rank id, replaces the old attachment).
  virtual Status connect(int peer, const std::string& address) = 0;
  // Detaches from a peer and releases what was mapped for it.
  virtual Status disconnect(int peer) = 0;

  // Allocates region `region_id` (unique per rank) of `num_bytes`, zeroed.
  virtual Result<Region> allocate_region(int region_id, size_t num_bytes) = 0;
  // Copies bytes [offset, offset + num_bytes) of a connected peer's region into dst.
  virtual Status read(int peer, int region_id, size_t offset, void* dst, size_t num_bytes) = 0;

  // Every member contributes `in`; returns one span per rank in [0, max_ranks)
  // (empty for non-members), all of in.num_bytes.
  virtual Result<std::vector<ByteSpan>> all_gather(const Group& group, ByteSpan in) = 0;
  virtual Status barrier(const Group& group) = 0;
  // send[r] goes to member r (empty for non-members and allowed to be empty for
  // members); returns what each member sent to this rank, indexed by rank.
  virtual Result<std::vector<ByteSpan>> exchange(const Group& group,
                                                 const std::vector<ByteSpan>& send) = 0;

  // Releases everything this rank created (segments, mappings). No peer is waited on.
  virtual Status shutdown() = 0;

  // Lets a backend without a progress thread serve its peers between collectives: over TCP a
  // UCX read() of this rank is messages that this rank must answer, so a rank that is not
  // stepping (a joiner being attached, a halted survivor) calls this while it waits for
  // commands. Driving thread; cheap; a no-op where reads are one-sided.
  virtual void progress() {}
  // Liveness of a connected peer without a collective (for waits that happen elsewhere, e.g.
  // in device kernels): Unavailable "rank R (pid P) died" / "... shut down" once it is gone,
  // as the collectives report it; OK otherwise. Driving thread. Backends that cannot tell
  // answer OK (their waits still time out).
  virtual Status peer_status(int peer) const { return Status(); }
  // Declares a connected peer lost on the word of something outside the transport (the front
  // end's heartbeat: a stopped process or a dropped link, which a network backend does not see
  // for minutes). From then on waits on it and peer_status() answer Unavailable naming it and
  // `why`, until connect() attaches a new incarnation. Any thread. Backends without it answer
  // Unimplemented (their waits still time out).
  virtual Status mark_peer_lost(int peer, const std::string& why) {
    return unimplemented("mark_peer_lost: not supported by this transport backend");
  }
  // Mapped peer buffers; backends without them (capabilities().mapped_peer_buffers false) answer
  // Unimplemented, except that capabilities().device_buffer_reads lets register_buffer() make
  // the buffer a region that peers read() (ucx with CUDA: no mapping, map_peer_buffer() still
  // answers Unimplemented).
  // Publishes `num_bytes` of device memory at `data` under `buffer_id` for peers to map. `data`
  // is the start of an allocation of this rank's device (cudaMalloc) that the caller keeps
  // until shutdown(). Use ids no region uses: a backend may keep both in one table (cuda_ipc
  // with device collectives does, and there a registered buffer is also a region peers may
  // read()). Once per id; nothing is ever unregistered. Driving thread.
  virtual Status register_buffer(int buffer_id, void* data, size_t num_bytes) {
    return unimplemented("register_buffer: not supported by this transport backend");
  }
  // A connected peer's buffer (or region) `buffer_id`, mapped into this process once per
  // incarnation of the peer (later calls return the same mapping); this rank's own for
  // peer == rank(). Unavailable when the peer is not connected, has shut down or died (a dead
  // incarnation's buffers are never handed out, even if mapped before); NotFound when it
  // registered no such buffer (yet). Any thread.
  virtual Result<PeerBuffer> map_peer_buffer(int peer, int buffer_id, MapMode mode) {
    return unimplemented("map_peer_buffer: not supported by this transport backend");
  }
  // options.timeout_ms: how long any wait on a peer may take.
  virtual int timeout_ms() const = 0;
};

// Creates a backend by name: "shm" (POSIX shared memory, CPU, one host), "cuda_ipc"
// (GPU memory shared through CUDA IPC, one host; only in builds with FLEXPERT_WITH_CUDA,
// Unavailable on a machine without a usable GPU), or "ucx" (UCX's UCP over TCP, shared memory
// or RDMA, ranks on any hosts; only in builds where CMake found UCX, Unimplemented otherwise),
// or "hier" (ranks on any hosts: shm between CPU ranks of one host, or cuda_ipc between GPU
// ranks with options.host_collectives, ucx between hosts; built with ucx).
Result<std::unique_ptr<Transport>> create_transport(const std::string& backend,
                                                    const TransportOptions& options);

}  // namespace flexpert
