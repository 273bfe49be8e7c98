// SPDX-License-Identifier: Apache-2.0
// CudaIpcTransport: setup, peers, regions and teardown. The collectives are in
// cuda_ipc_collectives.cc.
#include "transport/cuda_ipc/cuda_ipc_transport.h"

#include <unistd.h>

#include <cstring>
#include <new>
#include <random>

#include "flexpert/logging.h"
#include "transport/collective_checks.h"
#include "transport/shm/shm_control.h"
#include "transport/shm/shm_peers.h"
#include "transport/shm/shm_transport.h"

namespace flexpert {

using cuda_ipc::cuda_check;
using cuda_ipc::ScopedDevice;
using shm::ShmMapping;

namespace {

constexpr int64_t kSpinNs = 5'000;  // Waits busy-wait, then yield, then sleep in futex slices.
constexpr int64_t kYieldNs = 20'000;

constexpr shm::ControlSegmentKind kControlKind{cuda_ipc::kMagic, cuda_ipc::kLayoutVersion,
                                               "cuda_ipc", "control segment",
                                               "not a cuda_ipc control segment (another "
                                               "backend's?)"};

uint64_t process_token() {
  static const uint64_t token = [] {
    std::random_device rd;
    return (uint64_t{rd()} << 32) ^ rd() ^ static_cast<uint64_t>(::getpid());
  }();
  return token;
}

cudaIpcMemHandle_t handle_from(const unsigned char* bytes) {
  cudaIpcMemHandle_t handle;
  std::memcpy(&handle, bytes, sizeof(handle));
  return handle;
}

}  // namespace

CudaIpcTransport::CudaIpcTransport(TransportOptions options, cuda_ipc::Layout layout,
                                   std::string address)
    : options_(std::move(options)),
      layout_(layout),
      address_(std::move(address)),
      protocol_(options_, layout_.mailboxes, kSpinNs, kYieldNs, [this] { ring_all_peers(); }) {}

Result<std::unique_ptr<CudaIpcTransport>> CudaIpcTransport::create(
    const TransportOptions& options) {
  FLEX_RETURN_IF_ERROR(shm::validate_options(options));
  FLEX_ASSIGN_OR_RETURN(cuda_ipc::Layout layout,
                        cuda_ipc::Layout::compute(options.max_ranks, options.max_gather_bytes,
                                                  options.max_exchange_bytes));
  // The device first: without a GPU nothing touches /dev/shm.
  FLEX_RETURN_IF_ERROR(cuda_ipc::check_device(options.device).annotate("cuda_ipc"));
  const int device = options.device;
  ScopedDevice scoped(device);
  FLEX_RETURN_IF_ERROR(scoped.status());
  char bus_id[32] = {};
  FLEX_RETURN_IF_ERROR(
      cuda_check(cudaDeviceGetPCIBusId(bus_id, sizeof(bus_id), device), "cudaDeviceGetPCIBusId"));
  std::unique_ptr<ShmTransport> host;
  std::string address;
  if (options.host_collectives) {
    FLEX_ASSIGN_OR_RETURN(host, ShmTransport::create(options));
    address = host->address();
    layout.recv_bytes = 0;  // The shm backend holds the payloads.
  } else {
    address = shm::control_segment_name(options.session, options.rank, options.incarnation);
  }
  const std::string control_name = table_name(options, address);
  std::unique_ptr<CudaIpcTransport> t(new CudaIpcTransport(options, layout, address));
  t->host_ = std::move(host);
  if (t->host_ == nullptr) {
    FLEX_ASSIGN_OR_RETURN(t->recv_, cuda_ipc::DeviceAllocation::create(device, layout.recv_bytes));
    FLEX_ASSIGN_OR_RETURN(t->copy_stream_,
                          cuda_ipc::Stream::create(device, /*non_blocking=*/false));
    FLEX_ASSIGN_OR_RETURN(t->read_stream_, cuda_ipc::Stream::create(device, /*non_blocking=*/true));
  }

  FLEX_ASSIGN_OR_RETURN(
      std::shared_ptr<ShmMapping> mapping,
      shm::create_control_segment(control_name, layout.total_bytes, cuda_ipc::kMagic));

  std::byte* base = mapping->data();
  shm::SegmentHeader* h = shm::init_control_segment(base, layout.mailboxes, options,
                                                    cuda_ipc::kLayoutVersion, layout.total_bytes);
  cuda_ipc::DeviceInfo* info = layout.info(base);
  info->device = device;
  info->process_token = process_token();
  std::memcpy(info->pci_bus_id, bus_id, sizeof(info->pci_bus_id));
  info->pci_bus_id[sizeof(info->pci_bus_id) - 1] = '\0';
  info->recv_bytes = layout.recv_bytes;
  if (t->recv_ != nullptr) {
    info->recv_address = reinterpret_cast<uint64_t>(t->recv_->data());
    std::memcpy(info->recv_handle, &t->recv_->ipc_handle(), cuda_ipc::kIpcHandleBytes);
  }
  for (int i = 0; i < cuda_ipc::kMaxRegions; ++i)
    new (layout.region(base, i)) cuda_ipc::RegionEntry();
  h->magic.store(cuda_ipc::kMagic, std::memory_order_release);  // Peers may attach from now on.

  t->control_ = std::move(mapping);
  t->header_ = h;
  t->base_ = base;
  t->protocol_.bind(h, base);
  auto self = std::make_shared<Peer>();
  self->rank = options.rank;
  self->address = address;
  self->control = t->control_;
  self->header = h;
  self->info = info;
  self->control_base = base;
  self->pid = h->pid;
  self->same_process = true;
  self->recv = t->recv_ != nullptr ? t->recv_->data() : nullptr;
  t->peers_.assign(options.max_ranks, nullptr);
  t->peers_[options.rank] = std::move(self);
  return t;
}

CudaIpcTransport::~CudaIpcTransport() { close_and_release(); }

std::string CudaIpcTransport::table_name(const TransportOptions& options,
                                         const std::string& address) {
  return options.host_collectives ? shm::region_segment_name(address, kBufferTableId) : address;
}

TransportCapabilities CudaIpcTransport::capabilities() const {
  if (host_ != nullptr) {
    TransportCapabilities c = host_->capabilities();
    c.mapped_peer_buffers = true;
    return c;
  }
  TransportCapabilities c;
  c.one_sided_read = true;
  c.device_memory = true;
  c.cross_host = false;
  c.max_gather_bytes = options_.max_gather_bytes;
  c.max_exchange_bytes = options_.max_exchange_bytes;
  c.mapped_peer_buffers = true;
  return c;
}

Result<std::shared_ptr<CudaIpcTransport::Peer>> CudaIpcTransport::attach(
    int peer, const std::string& address) {
  FLEX_ASSIGN_OR_RETURN(
      std::shared_ptr<ShmMapping> control,
      shm::open_control_segment(peer, address, kControlKind, options_, layout_.total_bytes));
  auto bad = [&](const std::string& why) {
    return invalid_argument("rank " + std::to_string(peer) + " at " + address + ": " + why);
  };
  const cuda_ipc::DeviceInfo* info = layout_.info(control->data());
  if (info->recv_bytes != layout_.recv_bytes) {
    return bad("receive buffer of " + std::to_string(info->recv_bytes) + " bytes, expected " +
               std::to_string(layout_.recv_bytes));
  }
  auto p = std::make_shared<Peer>();
  FLEX_RETURN_IF_ERROR(shm::link_peer(peer, control->data(), p.get()));
  p->address = address;
  p->info = info;
  p->control = std::move(control);
  p->same_process = info->process_token == process_token();
  if (info->recv_bytes == 0) {
    // Host collectives: no receive buffer.
  } else if (p->same_process) {
    // Another transport of this very process: its pointers are valid here, and CUDA refuses
    // to import a handle into the process that exported it.
    p->recv = reinterpret_cast<std::byte*>(info->recv_address);
  } else {
    auto opened = cuda_ipc::IpcMapping::open(options_.device, handle_from(info->recv_handle));
    if (!opened.ok()) {
      return opened.status().annotate(
          "rank " + std::to_string(peer) + ": mapping its receive buffer (GPU " + info->pci_bus_id +
          ") into device " + std::to_string(options_.device) + " (GPU " +
          layout_.info(base_)->pci_bus_id + "); peer access between the GPUs?");
    }
    p->recv_mapping = std::move(opened).value();
    p->recv = p->recv_mapping->data();
  }
  if (!p->same_process) {
    auto owner = std::make_shared<const shm::ProcessWatch>(
        shm::ProcessWatch::watch(p->pid, p->header->pid_start_time));
    if (owner->watching()) p->owner = std::move(owner);
  }
  return p;
}

Status CudaIpcTransport::connect(int peer, const std::string& address) {
  auto attach_both = [&]() -> Result<std::shared_ptr<Peer>> {
    if (host_ != nullptr) FLEX_RETURN_IF_ERROR(host_->connect(peer, address));
    FLEX_ASSIGN_OR_RETURN(std::shared_ptr<Peer> p, attach(peer, table_name(options_, address)));
    p->address = address;
    return p;
  };
  return shm::connect_peer(options_, shut_down_, address_, peers_mu_, peers_, peer, address,
                           attach_both);
}

Status CudaIpcTransport::disconnect(int peer) {
  FLEX_RETURN_IF_ERROR(shm::disconnect_peer(options_, peers_mu_, peers_, peer));
  return host_ != nullptr ? host_->disconnect(peer) : Status();
}

Status CudaIpcTransport::publish_region(int region_id, std::shared_ptr<RegionView> view,
                                        const cudaIpcMemHandle_t& handle) {
  {
    std::lock_guard<std::mutex> lock(peers_mu_);
    if (own_regions_.count(region_id) != 0) {
      return invalid_argument("region " + std::to_string(region_id) + " already allocated");
    }
  }
  if (num_regions_ >= cuda_ipc::kMaxRegions) {
    return resource_exhausted("cuda_ipc: more than " + std::to_string(cuda_ipc::kMaxRegions) +
                              " regions");
  }
  cuda_ipc::RegionEntry* entry = layout_.region(base_, num_regions_++);
  entry->region_id = region_id;
  entry->num_bytes = view->num_bytes;
  entry->address = reinterpret_cast<uint64_t>(view->data);
  std::memcpy(entry->handle, &handle, cuda_ipc::kIpcHandleBytes);
  entry->published.store(1, std::memory_order_release);
  std::lock_guard<std::mutex> lock(peers_mu_);
  own_regions_[region_id] = std::move(view);
  return Status();
}

Result<Region> CudaIpcTransport::allocate_region(int region_id, size_t num_bytes) {
  if (host_ != nullptr) {
    if (region_id == kBufferTableId) {
      return invalid_argument("region id " + std::to_string(region_id) + " is reserved");
    }
    return host_->allocate_region(region_id, num_bytes);
  }
  FLEX_RETURN_IF_ERROR(
      shm::check_new_region(shut_down_, peers_mu_, own_regions_, region_id, num_bytes));
  FLEX_ASSIGN_OR_RETURN(std::shared_ptr<cuda_ipc::DeviceAllocation> memory,
                        cuda_ipc::DeviceAllocation::create(options_.device, num_bytes));
  auto view = std::make_shared<RegionView>();
  view->data = memory->data();
  view->num_bytes = num_bytes;
  const cudaIpcMemHandle_t handle = memory->ipc_handle();
  view->owner = std::move(memory);
  Region region{region_id, view->data, num_bytes};
  FLEX_RETURN_IF_ERROR(publish_region(region_id, std::move(view), handle));
  return region;
}

Status CudaIpcTransport::register_buffer(int buffer_id, void* data, size_t num_bytes) {
  const std::string what = "register_buffer " + std::to_string(buffer_id);
  if (shut_down_) return failed_precondition(what + " after shutdown");
  if (buffer_id < 0) return invalid_argument(what + ": buffer id must be >= 0");
  if (data == nullptr || num_bytes == 0) return invalid_argument(what + ": no memory");
  ScopedDevice scoped(options_.device);
  FLEX_RETURN_IF_ERROR(scoped.status());
  cudaPointerAttributes attr{};
  FLEX_RETURN_IF_ERROR(
      cuda_check(cudaPointerGetAttributes(&attr, data), "cudaPointerGetAttributes").annotate(what));
  if (attr.type != cudaMemoryTypeDevice || attr.device != options_.device) {
    return invalid_argument(what + ": not device memory of device " +
                            std::to_string(options_.device));
  }
  cudaIpcMemHandle_t handle;
  FLEX_RETURN_IF_ERROR(
      cuda_check(cudaIpcGetMemHandle(&handle, data), "cudaIpcGetMemHandle").annotate(what));
  auto view = std::make_shared<RegionView>();  // The caller owns the memory: no owner.
  view->data = static_cast<std::byte*>(data);
  view->num_bytes = num_bytes;
  return publish_region(buffer_id, std::move(view), handle);
}

Result<PeerBuffer> CudaIpcTransport::map_peer_buffer(int peer, int buffer_id, MapMode mode) {
  if (peer < 0 || peer >= options_.max_ranks) {
    return invalid_argument("map_peer_buffer: rank " + std::to_string(peer) + " not in [0, " +
                            std::to_string(options_.max_ranks) + ")");
  }
  const std::string what =
      "buffer " + std::to_string(buffer_id) + " of rank " + std::to_string(peer);
  FLEX_ASSIGN_OR_RETURN(
      auto target, shm::find_target(options_, shut_down_, peers_mu_, peers_, own_regions_, peer,
                                    buffer_id, what, "registered"));
  std::shared_ptr<const RegionView> view = std::move(target.own);
  PeerBuffer out;
  out.incarnation = options_.incarnation;
  if (const std::shared_ptr<Peer>& p = target.peer; p != nullptr) {
    if (p->owner != nullptr) {
      out.owner_exited = [owner = p->owner] { return owner->exited(); };
      out.owner_ending = [owner = p->owner] { return owner->ended(); };
    }
    // A dead or departed incarnation's memory is never handed out, even if mapped before.
    FLEX_RETURN_IF_ERROR(shm::peer_liveness(peer, p->pid, *p->header, p->watch).annotate(what));
    out.incarnation = p->header->incarnation;
    FLEX_ASSIGN_OR_RETURN(view, peer_region(*p, buffer_id, what, mode));
    if (view == nullptr) return out;  // kLookup, not mapped yet.
  }
  out.data = view->data;
  out.num_bytes = view->num_bytes;
  out.mapping = std::move(view);
  return out;
}

Result<std::shared_ptr<const CudaIpcTransport::RegionView>> CudaIpcTransport::peer_region(
    Peer& p, int region_id, const std::string& what, MapMode mode) {
  std::lock_guard<std::mutex> lock(p.regions_mu);
  auto it = p.regions.find(region_id);
  if (it != p.regions.end()) return it->second;
  const bool same_process = p.same_process;
  // The owner publishes entries in order, each after its fields (release).
  for (int i = 0; i < cuda_ipc::kMaxRegions; ++i) {
    const cuda_ipc::RegionEntry* entry = layout_.region(p.control_base, i);
    if (entry->published.load(std::memory_order_acquire) == 0) break;
    if (entry->region_id != region_id) continue;
    if (mode == MapMode::kLookup && !same_process) return std::shared_ptr<const RegionView>();
    auto view = std::make_shared<RegionView>();
    view->num_bytes = entry->num_bytes;
    if (same_process) {
      view->data = reinterpret_cast<std::byte*>(entry->address);
    } else {
      auto opened = cuda_ipc::IpcMapping::open(options_.device, handle_from(entry->handle));
      if (!opened.ok()) return opened.status().annotate(what);
      view->data = opened.value()->data();
      view->owner = std::shared_ptr<cuda_ipc::IpcMapping>(std::move(opened).value());
    }
    std::shared_ptr<const RegionView> shared = std::move(view);
    p.regions.emplace(region_id, shared);
    return shared;
  }
  return not_found(what + ": no such region");
}

Status CudaIpcTransport::read(int peer, int region_id, size_t offset, void* dst, size_t num_bytes) {
  if (host_ != nullptr) return host_->read(peer, region_id, offset, dst, num_bytes);
  FLEX_RETURN_IF_ERROR(validate_read(peer, dst, num_bytes, options_));
  const std::string what =
      "read of rank " + std::to_string(peer) + " region " + std::to_string(region_id);
  FLEX_ASSIGN_OR_RETURN(
      auto target, shm::find_target(options_, shut_down_, peers_mu_, peers_, own_regions_, peer,
                                    region_id, what, "allocated"));
  // Keeps the memory mapped while we copy.
  std::shared_ptr<const RegionView> region = std::move(target.own);
  if (target.peer != nullptr) {
    FLEX_RETURN_IF_ERROR(shm::check_not_closed(*target.peer, what));
    FLEX_ASSIGN_OR_RETURN(region, peer_region(*target.peer, region_id, what, MapMode::kMap));
  }
  FLEX_RETURN_IF_ERROR(check_read_range(what, offset, num_bytes, region->num_bytes));
  if (num_bytes == 0) return Status();
  std::lock_guard<std::mutex> lock(read_mu_);
  if (read_stream_ == nullptr) return failed_precondition(what + " after shutdown");
  ScopedDevice scoped(options_.device);
  FLEX_RETURN_IF_ERROR(scoped.status());
  FLEX_RETURN_IF_ERROR(cuda_check(cudaMemcpyAsync(dst, region->data + offset, num_bytes,
                                                  cudaMemcpyDefault, read_stream_->get()),
                                  "cudaMemcpyAsync")
                           .annotate(what));
  return cuda_check(cudaStreamSynchronize(read_stream_->get()), "cudaStreamSynchronize")
      .annotate(what);
}

void CudaIpcTransport::ring_all_peers() { shm::ring_peers(peers_, options_.rank); }

void CudaIpcTransport::close_and_release() {
  if (shut_down_ || header_ == nullptr) return;
  // Peers waiting on us notice at once instead of at their deadline.
  header_->closed.store(1, std::memory_order_release);
  ring_all_peers();
  std::vector<std::shared_ptr<Peer>> peers;
  std::unordered_map<int, std::shared_ptr<const RegionView>> regions;
  {
    std::lock_guard<std::mutex> lock(peers_mu_);
    shut_down_ = true;
    peers.swap(peers_);
    regions.swap(own_regions_);
  }
  if (Status s = control_->unlink(); !s.ok()) FLEX_LOG(WARN) << s.to_string();
  protocol_.unbind();
  header_ = nullptr;
  base_ = nullptr;
  {
    std::lock_guard<std::mutex> lock(read_mu_);  // Waits for a read() in flight.
    read_stream_.reset();
  }
  copy_stream_.reset();
  peers.clear();    // Closes the IPC mappings of peers (unless a read() still holds one).
  regions.clear();  // Frees this rank's regions (likewise).
  recv_.reset();
  control_.reset();
}

Status CudaIpcTransport::shutdown() {
  if (shut_down_) return Status();
  Status unlinked = control_->unlink();  // Reported (it would leak /dev/shm); teardown goes on.
  close_and_release();
  if (host_ != nullptr) {
    Status host_status = host_->shutdown();
    if (unlinked.ok()) unlinked = std::move(host_status);
  }
  return unlinked;
}

Status CudaIpcTransport::mark_peer_lost(int peer, const std::string& why) {
  if (host_ != nullptr) return host_->mark_peer_lost(peer, why);
  return Transport::mark_peer_lost(peer, why);
}

}  // namespace flexpert
