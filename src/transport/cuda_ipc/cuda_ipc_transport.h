// SPDX-License-Identifier: Apache-2.0
// CudaIpcTransport: the Transport backend for ranks that are processes of one host whose
// data lives in GPU memory: several ranks on one GPU (under NVIDIA MPS) or one GPU each.
//
// Each rank cudaMallocs, once, on options.device: a receive buffer with double-buffered
// slots for every possible source rank (all_gather and exchange, sized by max_ranks and the
// capacities), and one allocation per region. Peers map them with CUDA IPC: the handles sit
// in the rank's control segment in host shm (its address, named like the shm backend's), next
// to the shm backend's mailbox headers, which carry the op's state flags (cuda_ipc_layout.h).
// A collective copies this rank's payload device-to-device straight into each member's slot
// (its IPC-mapped receive buffer) on a dedicated stream, waits for the copies, then publishes
// the mailboxes Full; then it waits for its own mailboxes exactly as the shm backend does
// (same timeouts and liveness: a dead peer is Unavailable "rank R (pid P) died", a silent one
// DeadlineExceeded, a newer epoch Aborted). read() copies from the peer's IPC-mapped region
// on a second stream (a copy engine) and synchronizes it.
// Mapped peer buffers: register_buffer() publishes a device buffer the caller allocated in the
// region table of the control segment (its IPC handle and, for ranks of the same process, its
// address), so that it is also a region; map_peer_buffer() imports a peer's entry once per
// attachment (Peer::regions, shared with read()), refuses it once the peer shut down or died,
// and drops its reference when connect() attaches a new incarnation or disconnect() detaches
// (the mapping closes when the caller's PeerBuffer::mapping references are gone too), and
// watches the owner's process for PeerBuffer::owner_exited.
//
// Device memory: every ByteSpan returned by a collective, and Region::data, is a device
// pointer of options.device. Inputs may be device or host pointers (cudaMemcpyDefault).
// GPU asynchrony: collectives and read() are synchronous for the host. Work that produced
// the inputs must be complete when a collective is called (the copy stream is a blocking
// stream, so work on the legacy default stream is ordered before it; synchronize other
// streams first). GPU work reading returned spans must be complete before this rank's next
// collective call, when the slots may be rewritten (the contract's span lifetime).
// Region contents this rank writes must be complete (synchronized) before peers read them.
// A message to a member that has shut down or died is dropped (its memory may be gone); the
// wait that follows reports that member unless its message had already arrived.
// NOTE: CUDA documents freeing an exported allocation before its importers close it as
// undefined; shutdown() frees, so shut down at a step boundary (as the engine does).
//
// Host collectives (TransportOptions::host_collectives): the collectives, regions, read() and
// liveness are an inner ShmTransport's (host memory, its address is this rank's address), and
// this backend adds only the mapped peer buffers, in a table segment beside the shm segment
// (named as the shm backend's region kBufferTableId, so session cleanup removes it too); no
// receive buffer is allocated, and registered buffers are not regions.
//
// Thread safety: as ShmTransport. connect, disconnect, allocate_region, the collectives and
// shutdown on one driving thread; read() and the const accessors on any thread. Every call
// selects options.device for its own duration and restores the caller's current device.
#pragma once

#include <memory>
#include <mutex>
#include <string>
#include <unordered_map>
#include <vector>

#include "transport/cuda_ipc/cuda_ipc_layout.h"
#include "transport/cuda_ipc/cuda_ipc_runtime.h"
#include "transport/shm/shm_layout.h"
#include "transport/shm/shm_protocol.h"
#include "transport/shm/shm_segment.h"
#include "transport/shm/shm_transport.h"
#include "transport/transport.h"

namespace flexpert {

class CudaIpcTransport final : public Transport {
 public:
  // Unavailable when no usable GPU is visible; InvalidArgument for a device out of range.
  static Result<std::unique_ptr<CudaIpcTransport>> create(const TransportOptions& options);
  // Releases what is left and marks this rank closed; never waits on peers.
  ~CudaIpcTransport() override;

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
  Status peer_status(int peer) const override;
  Status mark_peer_lost(int peer, const std::string& why) override;
  int timeout_ms() const override { return options_.timeout_ms; }

  // With host_collectives: the inner ShmTransport that runs the collectives and holds the
  // regions (HierTransport announces this rank's closing through it); null otherwise.
  ShmTransport* host_shm() const { return host_.get(); }

 private:
  // Device memory readable by read(): an own allocation or an imported mapping, kept alive
  // by `owner` while a read() copies from it.
  struct RegionView {
    std::shared_ptr<void> owner;
    std::byte* data = nullptr;
    size_t num_bytes = 0;
  };

  // A connected rank (or this rank itself). Shared: peers_ holds one reference, read() on
  // another thread one while it copies.
  // The PeerLink is what the collectives protocol uses (its lost flag is never set here).
  struct Peer : shm::PeerLink {
    std::string address;
    std::shared_ptr<shm::ShmMapping> control;
    const cuda_ipc::DeviceInfo* info = nullptr;
    bool same_process = false;  // A transport of this process: addresses, not IPC handles.
    // The owner's process for PeerBuffer::owner_exited, which outlives this attachment (shared
    // with the PeerBuffers handed out). Null when not watched: this process, or not visible.
    std::shared_ptr<const shm::ProcessWatch> owner;
    std::unique_ptr<cuda_ipc::IpcMapping>
        recv_mapping;           // Null for this rank and same-process peers.
    std::byte* recv = nullptr;  // Its receive buffer, mapped here.
    std::mutex regions_mu;
    // GUARDED_BY(regions_mu). Imported lazily by read().
    std::unordered_map<int, std::shared_ptr<const RegionView>> regions;
  };

  struct Claimed {
    const Peer* peer;
    shm::MailboxHeader* mailbox;  // In the peer's segment, state Writing.
  };

  // host_collectives: the table segment's name is the shm backend's name of this region id.
  static constexpr int kBufferTableId = 2147483647;
  static std::string table_name(const TransportOptions& options, const std::string& address);

  CudaIpcTransport(TransportOptions options, cuda_ipc::Layout layout, std::string address);

  Result<std::shared_ptr<Peer>> attach(int peer, const std::string& address);
  // Null for MapMode::kLookup when the region is not mapped yet.
  Result<std::shared_ptr<const RegionView>> peer_region(Peer& peer, int region_id,
                                                        const std::string& what, MapMode mode);
  // Adds an entry to this rank's region table (driving thread).
  Status publish_region(int region_id, std::shared_ptr<RegionView> view,
                        const cudaIpcMemHandle_t& handle);

  Status run_collective(shm::OpKind kind, const Group& group, const ByteSpan* sends, size_t stride,
                        std::vector<ByteSpan>* out);
  Status send_all(shm::OpKind kind, const Group& group, const ByteSpan* sends, size_t stride,
                  int64_t deadline_ns);
  void ring_all_peers();
  void close_and_release();

  const TransportOptions options_;
  const cuda_ipc::Layout layout_;
  const std::string address_;
  // host_collectives: runs collectives, regions and reads; null otherwise. Driving thread for
  // what it drives, any thread for read() (as ShmTransport).
  std::unique_ptr<ShmTransport> host_;
  // The collectives' state (driving thread only; unused with host_).
  shm::MailboxProtocol protocol_;

  std::shared_ptr<shm::ShmMapping> control_;  // This rank's segment. Shared with self's Peer.
  shm::SegmentHeader* header_ = nullptr;
  std::byte* base_ = nullptr;
  std::unique_ptr<cuda_ipc::DeviceAllocation> recv_;  // Receive buffer.
  std::unique_ptr<cuda_ipc::Stream> copy_stream_;     // Collectives (blocking stream).
  bool shut_down_ = false;

  // read(): its stream (non-blocking: it must not wait for the model's work on the legacy
  // stream) and the mutex that serializes reads on it.
  std::mutex read_mu_;
  std::unique_ptr<cuda_ipc::Stream> read_stream_;  // GUARDED_BY(read_mu_).

  // As in ShmTransport: written by the driving thread under peers_mu_, read without the
  // lock by the driving thread and under it by read(). Indexed by rank; null = not connected.
  mutable std::mutex peers_mu_;
  std::vector<std::shared_ptr<Peer>> peers_;
  // Regions this rank allocated. GUARDED_BY(peers_mu_).
  std::unordered_map<int, std::shared_ptr<const RegionView>> own_regions_;
  int num_regions_ = 0;  // Entries published in the control segment (driving thread).

  // Scratch of the collectives, driving thread only.
  std::vector<Claimed> claimed_;
};

}  // namespace flexpert
