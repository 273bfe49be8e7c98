// SPDX-License-Identifier: Apache-2.0
#include "transport/hier/hier_transport.h"

#include <sys/stat.h>
#include <unistd.h>

#include <cstdlib>

#include "flexpert/logging.h"
#include "transport/collective_checks.h"
#ifdef FLEXPERT_WITH_CUDA_IPC
#include "transport/cuda_ipc/cuda_ipc_transport.h"
#endif

namespace flexpert {

namespace {

constexpr char kPrefix[] = "hier:";
constexpr char kSep = '|';

struct Parsed {
  std::string host;
  std::string local;  // The host-local backend's address.
  std::string ucx;
};

Result<Parsed> parse_address(int peer, const std::string& address) {
  const std::string what = "hier address of rank " + std::to_string(peer);
  const size_t prefix = sizeof(kPrefix) - 1;
  if (address.compare(0, prefix, kPrefix) != 0) {
    return invalid_argument(what + ": does not start with '" + kPrefix + "'");
  }
  const size_t a = address.find(kSep, prefix);
  const size_t b = a == std::string::npos ? a : address.find(kSep, a + 1);
  if (b == std::string::npos || a == prefix) {
    return invalid_argument(what + ": expected hier:HOST|LOCAL-ADDRESS|UCX-ADDRESS");
  }
  return Parsed{address.substr(prefix, a - prefix), address.substr(a + 1, b - a - 1),
                address.substr(b + 1)};
}

uint64_t sum_bytes(const std::vector<ByteSpan>& spans, int skip) {
  uint64_t n = 0;
  for (size_t r = 0; r < spans.size(); ++r) {
    if (static_cast<int>(r) != skip) n += spans[r].num_bytes;
  }
  return n;
}

}  // namespace

std::string local_host_id() {
  std::string id;
  if (const char* env = std::getenv("FLEXPERT_HOST_ID"); env != nullptr && *env != '\0') {
    id = env;
  } else {
    char name[256] = {};
    if (::gethostname(name, sizeof(name) - 1) != 0) name[0] = '\0';
    id = name;
    // Two network namespaces are two hosts to us (containers, tests): their ranks cannot
    // count on sharing /dev/shm and a PID namespace.
    struct stat st {};
    if (::stat("/proc/self/ns/net", &st) == 0) id += "/netns:" + std::to_string(st.st_ino);
  }
  for (char& c : id) {
    if (c == kSep) c = '_';
  }
  return id;
}

Result<std::unique_ptr<HierTransport>> HierTransport::create(const TransportOptions& options) {
  std::unique_ptr<Transport> local;
  ShmTransport* host_shm = nullptr;
  const char* local_name = "shm";
  if (options.host_collectives) {
    // GPU ranks: cuda_ipc within the host, for its mapped peer buffers.
#ifdef FLEXPERT_WITH_CUDA_IPC
    FLEX_ASSIGN_OR_RETURN(std::unique_ptr<CudaIpcTransport> cuda,
                          CudaIpcTransport::create(options));
    host_shm = cuda->host_shm();
    FLEX_CHECK(host_shm != nullptr);
    local = std::move(cuda);
    local_name = "cuda_ipc";
#else
    return unimplemented(
        "hier for GPU ranks (host_collectives) needs the cuda_ipc backend, which is not in this "
        "build (configure with -DFLEXPERT_WITH_CUDA=ON)");
#endif
  } else {
    FLEX_ASSIGN_OR_RETURN(std::unique_ptr<ShmTransport> shm, ShmTransport::create(options));
    host_shm = shm.get();
    local = std::move(shm);
  }
  FLEX_ASSIGN_OR_RETURN(std::unique_ptr<UcxTransport> ucx, UcxTransport::create(options));
  return std::unique_ptr<HierTransport>(new HierTransport(
      options, local_host_id(), std::move(local), host_shm, local_name, std::move(ucx)));
}

HierTransport::HierTransport(TransportOptions options, std::string host,
                             std::unique_ptr<Transport> local, ShmTransport* host_shm,
                             const char* local_name, std::unique_ptr<UcxTransport> ucx)
    : options_(std::move(options)),
      host_(std::move(host)),
      local_(std::move(local)),
      host_shm_(host_shm),
      local_name_(local_name),
      ucx_(std::move(ucx)),
      peers_(static_cast<size_t>(options_.max_ranks)),
      where_(static_cast<size_t>(options_.max_ranks), Where::kNone) {
  address_ = kPrefix + host_ + kSep + local_->address() + kSep + ucx_->address();
  peers_[static_cast<size_t>(options_.rank)].host = host_;
  where_[static_cast<size_t>(options_.rank)] = Where::kLocal;
}

HierTransport::~HierTransport() {
  // ucx_ first (its destructor deregisters the regions' memory), then local_.
  ucx_.reset();
  local_.reset();
}

TransportCapabilities HierTransport::capabilities() const {
  const TransportCapabilities s = local_->capabilities();
  const TransportCapabilities u = ucx_->capabilities();
  TransportCapabilities c;
  c.mapped_peer_buffers = s.mapped_peer_buffers;  // Of peers on this host (cuda_ipc).
  c.device_buffer_reads = u.device_buffer_reads;  // Of peers on other hosts (ucx with CUDA).
  c.one_sided_read = s.one_sided_read && u.one_sided_read;
  c.cross_host = true;
  c.max_gather_bytes = std::min(s.max_gather_bytes, u.max_gather_bytes);
  c.max_exchange_bytes = std::min(s.max_exchange_bytes, u.max_exchange_bytes);
  return c;
}

bool HierTransport::same_host(int peer) const {
  if (peer < 0 || peer >= options_.max_ranks) return false;
  MutexLock lock(mu_);
  return peers_[static_cast<size_t>(peer)].host == host_;
}

Status HierTransport::connect_ucx_locked(int peer) {
  PeerState& ps = peers_[static_cast<size_t>(peer)];
  FLEX_RETURN_IF_ERROR(ucx_->connect(peer, ps.ucx_address));
  ps.on_ucx = true;
  if (!ps.lost_why.empty()) (void)ucx_->mark_peer_lost(peer, ps.lost_why);
  return Status();
}

Status HierTransport::connect(int peer, const std::string& address) {
  if (peer < 0 || peer >= options_.max_ranks) {
    return invalid_argument("connect: rank " + std::to_string(peer) + " not in [0, " +
                            std::to_string(options_.max_ranks) + ")");
  }
  if (peer == options_.rank) {
    return address == address_ ? Status()
                               : invalid_argument("connect: '" + address +
                                                  "' is not this rank's address " + address_);
  }
  FLEX_ASSIGN_OR_RETURN(Parsed parsed, parse_address(peer, address));
  const bool local = parsed.host == host_;
  if (local) {
    FLEX_RETURN_IF_ERROR(local_->connect(peer, parsed.local));
  } else if (same_host(peer)) {
    (void)local_->disconnect(peer);  // A new incarnation elsewhere: nothing left to map here.
  }
  MutexLock lock(mu_);
  PeerState& ps = peers_[static_cast<size_t>(peer)];
  const bool changed = ps.host != parsed.host;
  if (ps.ucx_address != parsed.ucx) ps.lost_why.clear();  // Another incarnation.
  ps.host = parsed.host;
  ps.ucx_address = parsed.ucx;
  if (!local && !any_remote_) {
    // The first peer elsewhere: from now on groups may span hosts, and their ucx collectives
    // include this host's ranks too. Until then same-host pairs have no UCX endpoint at all
    // (UCX 1.13 asserts when a worker is destroyed with the wireup to a silent peer unfinished).
    any_remote_ = true;
    for (int r = 0; r < options_.max_ranks; ++r) {
      const PeerState& other = peers_[static_cast<size_t>(r)];
      if (r != options_.rank && r != peer && other.host == host_ && !other.on_ucx) {
        FLEX_RETURN_IF_ERROR(connect_ucx_locked(r));
      }
    }
  }
  if (!local || any_remote_) FLEX_RETURN_IF_ERROR(connect_ucx_locked(peer));
  where_[static_cast<size_t>(peer)] = local ? Where::kLocal : Where::kRemote;
  if (changed) {
    FLEX_LOG(INFO) << "hier rank " << options_.rank << ": rank " << peer << " on "
                   << (local ? std::string("this host (") + local_name_ + ")"
                             : "host " + parsed.host + " (ucx)");
  }
  return Status();
}

Status HierTransport::disconnect(int peer) {
  if (peer < 0 || peer >= options_.max_ranks) {
    return invalid_argument("disconnect: rank " + std::to_string(peer) + " out of range");
  }
  if (peer == options_.rank) return ucx_->disconnect(peer);  // Says what it says of that.
  MutexLock lock(mu_);
  PeerState& ps = peers_[static_cast<size_t>(peer)];
  Status first;
  if (ps.on_ucx) first = ucx_->disconnect(peer);
  if (ps.host == host_) {
    if (Status s = local_->disconnect(peer); first.ok()) first = s;
  }
  ps = PeerState{};
  where_[static_cast<size_t>(peer)] = Where::kNone;
  return first;
}

Result<Region> HierTransport::allocate_region(int region_id, size_t num_bytes) {
  FLEX_ASSIGN_OR_RETURN(Region region, local_->allocate_region(region_id, num_bytes));
  FLEX_RETURN_IF_ERROR(ucx_->register_region(region_id, region.data, num_bytes));
  return region;
}

Status HierTransport::register_buffer(int buffer_id, void* data, size_t num_bytes) {
  // Peers on this host map it (cuda_ipc; shm: Unimplemented); peers on other hosts read it
  // through ucx where UCX registers device memory (capabilities().device_buffer_reads).
  Status local = local_->register_buffer(buffer_id, data, num_bytes);
  if (local.code() != StatusCode::kOk && local.code() != StatusCode::kUnimplemented) return local;
  if (!ucx_->capabilities().device_buffer_reads) return local;
  return ucx_->register_buffer(buffer_id, data, num_bytes);
}

Result<PeerBuffer> HierTransport::map_peer_buffer(int peer, int buffer_id, MapMode mode) {
  if (peer < 0 || peer >= options_.max_ranks || peer == options_.rank) {
    return local_->map_peer_buffer(peer, buffer_id, mode);  // Says what it says of that.
  }
  std::string host;
  {
    MutexLock lock(mu_);
    host = peers_[static_cast<size_t>(peer)].host;
  }
  if (!host.empty() && host != host_) {
    // Not mappable, which callers take as "use the host path" (the device EP exchange, slot
    // copies): another host's device memory is not ours to map.
    buffers_refused_.fetch_add(1, std::memory_order_relaxed);
    return unimplemented("map_peer_buffer: rank " + std::to_string(peer) + " is on host " + host +
                         ", not this one (" + host_ + "): its buffers cannot be mapped here");
  }
  // Not connected: the host-local backend says so in its words.
  Result<PeerBuffer> mapped = local_->map_peer_buffer(peer, buffer_id, mode);
  if (mapped.ok() && mapped->data != nullptr) {
    buffers_mapped_.fetch_add(1, std::memory_order_relaxed);
  }
  return mapped;
}

Status HierTransport::read(int peer, int region_id, size_t offset, void* dst, size_t num_bytes) {
  FLEX_RETURN_IF_ERROR(validate_read(peer, dst, num_bytes, options_));
  std::string host;
  {
    MutexLock lock(mu_);
    host = peers_[static_cast<size_t>(peer)].host;
  }
  if (host.empty() || host != host_) {
    // Not connected: ucx says so in its words.
    FLEX_RETURN_IF_ERROR(ucx_->read(peer, region_id, offset, dst, num_bytes));
    ucx_bytes_.fetch_add(num_bytes, std::memory_order_relaxed);
    return Status();
  }
  FLEX_RETURN_IF_ERROR(local_->read(peer, region_id, offset, dst, num_bytes));
  if (peer != options_.rank) shm_bytes_.fetch_add(num_bytes, std::memory_order_relaxed);
  return Status();
}

Result<HierTransport::Plan> HierTransport::plan(const Group& group, const char* op) const {
  if (shut_down_) return failed_precondition(std::string(op) + " after shutdown");
  FLEX_RETURN_IF_ERROR(validate_group(group, op, options_, [this](int r) {
    return where_[static_cast<size_t>(r)] != Where::kNone;
  }));
  Plan p;
  p.local.epoch = group.epoch;
  for (int r : group.ranks) {
    if (where_[static_cast<size_t>(r)] == Where::kLocal) p.local.ranks.push_back(r);
  }
  p.one_host = p.local.ranks.size() == group.ranks.size();
  return p;
}

Status HierTransport::enter_epoch(Transport& backend, EpochSeen* seen, uint64_t epoch) {
  if (seen->any && epoch <= seen->epoch) return Status();  // Older: the used backend aborts.
  seen->note(epoch);
  return backend.barrier(Group{epoch, {options_.rank}});
}

Result<std::vector<ByteSpan>> HierTransport::all_gather(const Group& group, ByteSpan in) {
  FLEX_ASSIGN_OR_RETURN(Plan p, plan(group, "all_gather"));
  FLEX_RETURN_IF_ERROR(validate_sends(group, "all_gather", false, &in, 0, options_));
  const uint64_t others = group.ranks.size() - 1;
  if (p.one_host) {
    FLEX_RETURN_IF_ERROR(enter_epoch(*ucx_, &ucx_epoch_, group.epoch));
    local_epoch_.note(group.epoch);
    shm_bytes_.fetch_add(in.num_bytes * others, std::memory_order_relaxed);
    ucx_->progress();
    return local_->all_gather(group, in);
  }
  FLEX_RETURN_IF_ERROR(enter_epoch(*local_, &local_epoch_, group.epoch));
  ucx_epoch_.note(group.epoch);
  ucx_bytes_.fetch_add(in.num_bytes * others, std::memory_order_relaxed);
  return ucx_->all_gather(group, in);
}

Status HierTransport::barrier(const Group& group) {
  FLEX_ASSIGN_OR_RETURN(Plan p, plan(group, "barrier"));
  if (p.one_host) {
    FLEX_RETURN_IF_ERROR(enter_epoch(*ucx_, &ucx_epoch_, group.epoch));
    local_epoch_.note(group.epoch);
    ucx_->progress();
    return local_->barrier(group);
  }
  FLEX_RETURN_IF_ERROR(enter_epoch(*local_, &local_epoch_, group.epoch));
  ucx_epoch_.note(group.epoch);
  return ucx_->barrier(group);
}

Result<std::vector<ByteSpan>> HierTransport::exchange(const Group& group,
                                                      const std::vector<ByteSpan>& send) {
  FLEX_RETURN_IF_ERROR(validate_send_count(send, options_));
  FLEX_ASSIGN_OR_RETURN(Plan p, plan(group, "exchange"));
  FLEX_RETURN_IF_ERROR(validate_sends(group, "exchange", true, send.data(), 1, options_));
  if (p.one_host) {
    FLEX_RETURN_IF_ERROR(enter_epoch(*ucx_, &ucx_epoch_, group.epoch));
    local_epoch_.note(group.epoch);
    shm_bytes_.fetch_add(sum_bytes(send, options_.rank), std::memory_order_relaxed);
    ucx_->progress();
    return local_->exchange(group, send);
  }
  if (p.local.ranks.size() == 1) {
    FLEX_RETURN_IF_ERROR(enter_epoch(*local_, &local_epoch_, group.epoch));
    ucx_epoch_.note(group.epoch);
    ucx_bytes_.fetch_add(sum_bytes(send, options_.rank), std::memory_order_relaxed);
    return ucx_->exchange(group, send);
  }
  // Rows between this host's members through shm, the rest through ucx: two collectives, in
  // this order on every member (each backend's members run the same sequence).
  local_send_.assign(send.size(), ByteSpan{});
  ucx_send_ = send;
  for (int r : p.local.ranks) {
    local_send_[static_cast<size_t>(r)] = send[static_cast<size_t>(r)];
    ucx_send_[static_cast<size_t>(r)] = ByteSpan{};
  }
  local_epoch_.note(group.epoch);
  ucx_epoch_.note(group.epoch);
  shm_bytes_.fetch_add(sum_bytes(local_send_, options_.rank), std::memory_order_relaxed);
  ucx_bytes_.fetch_add(sum_bytes(ucx_send_, options_.rank), std::memory_order_relaxed);
  FLEX_ASSIGN_OR_RETURN(std::vector<ByteSpan> local, local_->exchange(p.local, local_send_));
  FLEX_ASSIGN_OR_RETURN(std::vector<ByteSpan> out, ucx_->exchange(group, ucx_send_));
  for (int r : p.local.ranks) out[static_cast<size_t>(r)] = local[static_cast<size_t>(r)];
  return out;
}

Status HierTransport::shutdown() {
  if (shut_down_) return Status();
  shut_down_ = true;
  const Stats st = stats();
  FLEX_LOG(INFO) << "hier rank " << options_.rank << ": " << st.shm_bytes << " bytes over shm, "
                 << st.ucx_bytes << " over ucx (collective payloads sent, regions read)";
  if (capabilities().mapped_peer_buffers) {
    FLEX_LOG(INFO) << "hier rank " << options_.rank << ": " << st.buffers_mapped
                   << " peer buffers mapped over " << local_name_ << ", " << st.buffers_refused
                   << " refused (peers on other hosts)";
  }
  // Same-host peers hear of it at once; then ucx, whose goodbyes wait (up to 1 s) for peers'
  // acknowledgements while still serving gets of the regions, which shm unmaps last.
  host_shm_->announce_closing();
  Status first = ucx_->shutdown();
  if (Status s = local_->shutdown(); first.ok()) first = s;
  return first;
}

Status HierTransport::peer_status(int peer) const {
  if (peer < 0 || peer >= options_.max_ranks || peer == options_.rank) {
    return ucx_->peer_status(peer);
  }
  MutexLock lock(mu_);
  const PeerState& ps = peers_[static_cast<size_t>(peer)];
  if (ps.host == host_) FLEX_RETURN_IF_ERROR(local_->peer_status(peer));
  if (ps.host != host_ || ps.on_ucx) return ucx_->peer_status(peer);
  return Status();
}

Status HierTransport::mark_peer_lost(int peer, const std::string& why) {
  if (peer < 0 || peer >= options_.max_ranks || peer == options_.rank) {
    return ucx_->mark_peer_lost(peer, why);
  }
  MutexLock lock(mu_);
  PeerState& ps = peers_[static_cast<size_t>(peer)];
  if (ps.host != host_) return ucx_->mark_peer_lost(peer, why);  // Elsewhere, or not connected.
  ps.lost_why = why;  // For a UCX endpoint made later (connect_ucx_locked).
  Status first = local_->mark_peer_lost(peer, why);
  if (ps.on_ucx) {
    if (Status s = ucx_->mark_peer_lost(peer, why); first.ok()) first = s;
  }
  return first;
}

HierTransport::Stats HierTransport::stats() const {
  Stats s;
  s.shm_bytes = shm_bytes_.load(std::memory_order_relaxed);
  s.ucx_bytes = ucx_bytes_.load(std::memory_order_relaxed);
  s.buffers_mapped = buffers_mapped_.load(std::memory_order_relaxed);
  s.buffers_refused = buffers_refused_.load(std::memory_order_relaxed);
  return s;
}

}  // namespace flexpert
