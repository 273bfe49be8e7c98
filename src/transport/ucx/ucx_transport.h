// SPDX-License-Identifier: Apache-2.0
// UcxTransport: the Transport backend on UCX's UCP API, for ranks on any hosts (TCP, shared
// memory or RDMA, as UCX_TLS allows; the Debian build has no CUDA, so host memory only).
//
// Connection, two modes. By default a rank's address carries its UCP worker address
// ("ucx:///r<rank>/i<incarnation>/p<pid>/t<start>/w<base64url>", ~300 characters) and peers
// connect to it with UCX's own wireup, whatever UCX_TLS selects (tcp, shm/self, RDMA). With
// options.listen_host (or FLEXPERT_UCX_LISTEN_HOST) the rank listens on that IP, port chosen by
// the kernel ("ucx://HOST:PORT/r../i../p../t.."), and peers connect to the socket (UCX's
// client-server wireup; UCX 1.13 needs tcp in UCX_TLS for it). Either way connect() creates
// this rank's endpoint to the peer (one per peer, for all it sends there) and does not wait:
// an unreachable peer shows up as an endpoint error, i.e. Unavailable in the next wait on it.
// Endpoints ask for UCP_ERR_HANDLING_MODE_PEER (a dead peer is an endpoint error; UCX's
// keepalive, every 250 ms unless UCX_KEEPALIVE_INTERVAL says otherwise, finds deaths without
// traffic). UCX 1.13's shared-memory transports cannot do that: then the endpoint is created
// without error handling and, the peer being on this host, its process is watched (pid and
// start time from its address), as the shm backend does. A new address for a rank (a new
// incarnation) closes the old endpoint (forced) and drops its remote keys: an endpoint is
// never reused across incarnations, and messages of an older incarnation than the newest seen
// are dropped.
//
// Memory, registered once at capacity (ucp_mem_map): regions (allocated by UCX, zeroed: over
// shared memory that makes them segments peers map, so a get needs nothing from the owner; in
// memory we mmap'd, UCX 1.13 served gets only while the owner progressed), their remote keys
// packed once and announced to every connected peer in a kRegion message, on connect and on
// allocation; the per-source mailboxes and the per-destination send staging (likewise). read() is
// gets (ucp_get_nbx) in chunks of FLEXPERT_UCX_READ_CHUNK_KB (1024), up to 8 in flight: one-sided
// over shared memory and RDMA; over TCP UCX emulates them, so the owner must be progressing.
//
// Device memory (docs/ARCHITECTURE.md "GPU ranks on different hosts"): at creation the rank
// asks UCX which memory types it supports (ucp_context_query). FLEXPERT_UCX_CUDA=auto (the
// default) uses CUDA memory where UCX supports it, off never does, on fails at creation when it
// does not (Debian's and Ubuntu's UCX builds have no CUDA transports; UCX_PROTO_ENABLE=n is
// taken as none: UCX 1.13's old protocols serve gets of host memory only, so with device
// buffers the context runs UCX's new ones unless UCX_PROTO_ENABLE says otherwise). When used,
// capabilities().device_buffer_reads is set and register_buffer() registers the caller's
// device memory (ucp_mem_map, UCS_MEMORY_TYPE_CUDA) as a region that peers read() straight into
// their device memory; otherwise register_buffer() answers Unimplemented, as without it.
//
// Collectives are active messages (ucp_am_send_nbx) of ucx_wire.h's WireHeader plus payload.
// A payload is first copied into this rank's staging slot [kind][destination][op parity] (so
// that no UCX request references the caller's buffer once the call returns, even after an
// error); a slot whose previous send is still in flight is waited for. A collective returns
// once every member's message is in and its own sends to live members completed (a rank that
// returns and exits must not take a queued message with it). The receiver files a
// message into one of three mailboxes of the sender's pool for its kind (gather/barrier or
// exchange): the op being taken, the op after it (a peer runs at most one op ahead within an
// epoch) and one of a newer epoch (the op 0 a peer that moved on sent first; the newest wins).
// Rejected (dropped, counted): older incarnations, older epochs, ops already done, ops more
// than one ahead, oversized payloads. A message of the op in progress from a newer epoch, an
// epoch notice, or a dead or lost peer ends the wait (Aborted / Unavailable), as in shm. The
// epoch notice carries how many ops the sender started in the epoch it left, so a message that
// is merely late (reordered behind the notice) is still waited for.
//
// Progress model: no progress thread. The worker (UCS_THREAD_MODE_SERIALIZED) and everything
// its callbacks touch are guarded by mu_; whichever thread waits (the driving thread in a
// collective, the mover in read(), peer_status()) progresses it, spinning FLEXPERT_UCX_SPIN_US
// (10), yielding FLEXPERT_UCX_YIELD_US (50), then sleeping in slices growing to 200 µs. Why:
// no hand-off latency on the step's critical path and no core burnt between steps on machines
// where ranks share cores. The cost: a rank progresses only while inside a transport call, so
// over TCP a peer's read() of it waits for its next call (a rank that is not stepping calls
// progress() between commands), and its death is noticed by peers
// (endpoint error) only while they are inside one; a silent peer is seen by timeouts or by
// mark_peer_lost() (the front end's heartbeat). Every wait has options.timeout_ms; a read()
// that times out closes the endpoint (so no get writes into the caller's buffer afterwards)
// and marks the peer lost.
//
// Shutdown: a kBye to every live peer, then a wait (up to 1 s) until each has answered with a
// kByeAck or is lost, then forced closes. A completed send has only reached UCX's buffers
// (over TCP, not even the socket), and closing the endpoint drops what is still on its way, so
// a rank that returned from its last collective and closed at once could take its share of
// that op with it (the peer then saw "Endpoint timeout" instead of the message). The
// destructor shuts down the same way.
//
// Thread safety: connect, disconnect, allocate_region, the collectives and shutdown are called
// by one driving thread; read(), peer_status() and mark_peer_lost() may run on other threads.
#pragma once

#include <sched.h>
#include <time.h>
#include <ucp/api/ucp.h>

#include <algorithm>
#include <array>
#include <deque>
#include <memory>
#include <mutex>
#include <string>
#include <unordered_map>
#include <vector>

#include "transport/shm/shm_segment.h"
#include "transport/transport.h"
#include "transport/ucx/ucx_wire.h"

namespace flexpert {

class UcxTransport final : public Transport {
 public:
  static Result<std::unique_ptr<UcxTransport>> create(const TransportOptions& options);
  // Releases what is left (forced endpoint closes; never waits on peers).
  ~UcxTransport() override;

  TransportCapabilities capabilities() const override;
  int rank() const override { return options_.rank; }
  int max_ranks() const override { return options_.max_ranks; }
  std::string address() const override { return address_; }

  Status connect(int peer, const std::string& address) override;
  Status disconnect(int peer) override;

  Result<Region> allocate_region(int region_id, size_t num_bytes) override;
  // Makes `num_bytes` at `data`, memory the caller allocated and keeps until this transport is
  // destroyed, region `region_id` (announced and read like an allocated one). For the hier
  // backend, whose regions are shm segments that same-host peers map and others get through UCX.
  // Gets of such memory over UCX's own shared-memory transports wait for this rank's progress.
  Status register_region(int region_id, void* data, size_t num_bytes);
  // Device memory (cudaMalloc) as region `buffer_id`, when capabilities().device_buffer_reads;
  // Unimplemented otherwise. This rank's own read() of it is Unimplemented (the caller copies).
  Status register_buffer(int buffer_id, void* data, size_t num_bytes) override;
  Status read(int peer, int region_id, size_t offset, void* dst, size_t num_bytes) override;

  Result<std::vector<ByteSpan>> all_gather(const Group& group, ByteSpan in) override;
  Status barrier(const Group& group) override;
  Result<std::vector<ByteSpan>> exchange(const Group& group,
                                         const std::vector<ByteSpan>& send) override;

  Status shutdown() override;
  void progress() override;
  Status peer_status(int peer) const override;
  Status mark_peer_lost(int peer, const std::string& why) override;
  int timeout_ms() const override { return options_.timeout_ms; }

 private:
  using OpKind = ucx::OpKind;
  static constexpr int kNumPools = 2;  // [0] all_gather and barrier, [1] exchange.
  static constexpr int kBoxesPerPool = 3;

  struct Box {
    enum class State { kFree, kFilling, kFull, kHeld };
    State state = State::kFree;
    bool discard = false;  // kFilling, but stale: freed when the receive completes.
    OpKind kind = OpKind::kNone;
    uint64_t epoch = 0;
    uint64_t op_idx = 0;
    size_t num_bytes = 0;
    std::byte* data = nullptr;  // In mailboxes_.
    UcxTransport* owner = nullptr;
  };
  struct RemoteRegion {
    uint64_t addr = 0;
    size_t num_bytes = 0;
    std::vector<std::byte> packed_rkey;
  };
  // What this rank received from rank r, for r's newest incarnation seen. GUARDED_BY(mu_).
  struct Inbox {
    bool seen = false;
    uint64_t incarnation = 0;
    // A message of `incarnation` has arrived (so regions_claimed counts its announcements).
    // False after connect() to a new incarnation: its peer may not have connected back yet.
    bool heard = false;
    bool bye = false;
    bool bye_acked = false;  // It took our kBye (shutdown waits for that before closing).
    bool has_epoch = false;
    uint64_t epoch = 0;
    bool has_prev = false;
    uint64_t prev_epoch = 0;
    uint64_t prev_ops = 0;
    uint64_t regions_claimed = 0;
    std::unordered_map<int, RemoteRegion> regions;
    std::array<std::array<Box, kBoxesPerPool>, kNumPools> pools;
  };
  // What an endpoint's error callback needs. Owned by conns_ until the transport dies.
  struct Conn {
    UcxTransport* self = nullptr;
    int rank = -1;  // -1: an accepted endpoint of a client that sent no id.
    uint64_t incarnation = 0;
    ucp_ep_h ep = nullptr;
    bool peer_errors = true;  // Created with UCP_ERR_HANDLING_MODE_PEER.
  };
  // This rank's connection to one incarnation of a peer. GUARDED_BY(mu_); shared with read()
  // calls in flight, which keep its rkeys alive after connect() replaced it.
  struct Peer {
    int rank = -1;
    std::string address;
    ucx::Address parsed;
    Conn* conn = nullptr;  // Null for this rank itself.
    bool lost = false;
    // Its process ended or its endpoint failed (not a goodbye, not silence): errors carry
    // Status::dead_rank, as shm's do, so that the front end need not wait for a heartbeat.
    bool dead = false;
    std::string lost_why;
    std::unordered_map<int, ucp_rkey_h> rkeys;
    // Watched when the endpoint has no UCX error handling (shared memory only: the peer is on
    // this host), so that its death is still an event.
    shm::ProcessWatch watch;
  };
  struct OwnRegion {
    void* data = nullptr;
    size_t num_bytes = 0;
    ucp_mem_h memh = nullptr;
    bool device = false;  // register_buffer(): CUDA memory, never touched by this process's CPU.
    std::vector<std::byte> packed_rkey;
  };
  // One send in flight: its header must outlive the request.
  struct SendOp {
    UcxTransport* self;
    ucx::WireHeader header;
    int* pending;  // Staging slot counter, or null.
  };

  explicit UcxTransport(TransportOptions options);
  Status init();
  // allocate_region (data null: UCX allocates), register_region and register_buffer (device).
  Result<Region> add_region(int region_id, void* data, size_t num_bytes, bool device);
  // ucp_init into context_ (proto_v2: UCX_PROTO_ENABLE=y, see init()).
  Status create_context(bool proto_v2);
  // Reads FLEXPERT_UCX_CUDA and UCX's memory types into cuda_memory_ (at init).
  Status init_memory_types();

  // UCX callbacks (run inside ucp_worker_progress, i.e. under mu_).
  static ucs_status_t on_am(void* arg, const void* header, size_t header_length, void* data,
                            size_t length, const ucp_am_recv_param_t* param);
  static void on_conn_request(ucp_conn_request_h request, void* arg);
  static void on_ep_error(void* arg, ucp_ep_h ep, ucs_status_t status);
  static void on_send_done(void* request, ucs_status_t status, void* user_data);
  static void on_recv_done(void* request, ucs_status_t status, size_t length, void* user_data);

  // All below: mu_ held.
  void deliver(const ucx::WireHeader& h, const void* data, size_t length, bool rndv);
  Box* file_message(Inbox& in, const ucx::WireHeader& h, size_t length);
  void reset_inbox(Inbox& in, uint64_t incarnation);
  void sweep_stale(Inbox& in);
  Status post_send(const Peer& peer, const ucx::WireHeader& h, const void* payload, size_t n,
                   int* pending);
  void announce_regions(const Peer& peer, const OwnRegion* only, int only_id);
  void send_epoch_notice();
  ucx::WireHeader header_for(ucx::MessageType type) const;
  void close_ep(Conn* conn, bool force);
  Status peer_error(const Peer& peer) const;  // Lost, died, shut down or superseded.
  void progress_locked();
  std::byte* staging(int pool, int dst, uint64_t op_idx) const;

  // Progresses until done() (called under mu_) or the deadline; false on the deadline.
  template <typename Done>
  bool progress_until(std::unique_lock<std::mutex>& lock, int64_t deadline_ns, Done done);

  // Collectives (ucx_collectives.cc).
  Status run_collective(OpKind kind, const Group& group, const ByteSpan* sends, size_t stride,
                        std::vector<ByteSpan>* out);
  Status enter_epoch(uint64_t epoch, const char* op);
  std::string op_label(OpKind kind) const;

  const TransportOptions options_;
  std::string address_;
  int64_t spin_ns_;
  int64_t yield_ns_;
  size_t read_chunk_bytes_;
  size_t pool_bytes_[kNumPools];  // Capacity of one mailbox / staging slot per pool.

  ucp_context_h context_ = nullptr;
  ucp_worker_h worker_ = nullptr;
  ucp_listener_h listener_ = nullptr;
  int64_t next_watch_ns_ = 0;
  bool cuda_memory_ = false;     // Device buffers are registered with UCX (init_memory_types).
  bool no_peer_errors_ = false;  // UCX could not give an endpoint peer-failure handling.  // When
                                 // progress_locked() next looks at watched processes.

  // Guards the worker, every callback's state and everything below.
  mutable std::mutex mu_;
  bool shut_down_ = false;
  std::vector<std::shared_ptr<Peer>> peers_;    // By rank; null: not connected.
  std::vector<std::shared_ptr<Peer>> retired_;  // Replaced, rkeys still to destroy.
  std::vector<Inbox> inboxes_;                  // By rank.
  std::deque<std::unique_ptr<Conn>> conns_;     // Every endpoint's callback state.
  std::vector<Conn*> to_close_;                 // Failed endpoints, closed after progress.
  std::vector<int> acks_due_;                   // Ranks whose kBye we answer after progress.
  std::unordered_map<int, OwnRegion> own_regions_;
  uint64_t num_rejected_ = 0;  // Messages dropped as stale, too far ahead or malformed.
  int inflight_ = 0;           // Sends and receives whose callbacks have not run.

  // Registered once: mailboxes [pool][src][box] and send staging [pool][dst][parity].
  void* mailboxes_ = nullptr;
  size_t mailboxes_bytes_ = 0;
  ucp_mem_h mailboxes_memh_ = nullptr;
  void* staging_ = nullptr;
  size_t staging_bytes_ = 0;
  ucp_mem_h staging_memh_ = nullptr;
  std::vector<int> staging_pending_;  // [pool][dst][parity]: sends from the slot in flight.

  // Collective state, driving thread only (read by callbacks under mu_).
  bool has_epoch_ = false;
  uint64_t epoch_ = 0;
  bool has_prev_ = false;
  uint64_t prev_epoch_ = 0;
  uint64_t prev_ops_ = 0;
  uint64_t ops_started_ = 0;  // Ops of epoch_ started; the one in progress is ops_started_ - 1.
  bool in_collective_ = false;
  std::vector<Box*> held_;  // Taken by the last collective; freed at the next one.
};

template <typename Done>
bool UcxTransport::progress_until(std::unique_lock<std::mutex>& lock, int64_t deadline_ns,
                                  Done done) {
  auto now_ns = [] {
    timespec ts{};
    ::clock_gettime(CLOCK_MONOTONIC, &ts);
    return static_cast<int64_t>(ts.tv_sec) * 1'000'000'000 + ts.tv_nsec;
  };
  const int64_t start = now_ns();
  int64_t sleep_ns = 10'000;
  for (;;) {
    progress_locked();
    if (done()) return true;
    const int64_t now = now_ns();
    if (now >= deadline_ns) return false;
    if (now - start < spin_ns_) continue;
    lock.unlock();  // Lets read() on another thread progress and post meanwhile.
    if (now - start < spin_ns_ + yield_ns_) {
      ::sched_yield();
    } else {
      const int64_t ns = std::min(sleep_ns, deadline_ns - now);
      timespec ts{0, static_cast<long>(ns)};
      ::nanosleep(&ts, nullptr);
      sleep_ns = std::min<int64_t>(sleep_ns * 2, 200'000);
    }
    lock.lock();
  }
}

}  // namespace flexpert
