// SPDX-License-Identifier: Apache-2.0
// ShmTransport: setup, peers, regions and teardown. The collectives are in shm_collectives.cc.
#include "transport/shm/shm_transport.h"

#include <dirent.h>
#include <sys/mman.h>
#include <unistd.h>

#include <cerrno>
#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <new>

#include "flexpert/logging.h"
#include "transport/collective_checks.h"
#include "transport/shm/shm_control.h"
#include "transport/shm/shm_peers.h"

namespace flexpert {

using shm::ShmMapping;

namespace {

// Reads of a peer's region this large give their pages back after the copy (read()).
constexpr size_t kDropPagesBytes = size_t{1} << 20;

constexpr shm::ControlSegmentKind kControlKind{shm::kMagic, shm::kLayoutVersion, "shm",
                                               "shm segment", "not a flexpert shm segment"};

int64_t env_us(const char* name, int64_t fallback_us) {
  const char* value = std::getenv(name);
  if (value == nullptr || *value == '\0') return fallback_us;
  char* end = nullptr;
  const long long parsed = std::strtoll(value, &end, 10);
  return (end != nullptr && *end == '\0' && parsed >= 0) ? parsed : fallback_us;
}

// Creates `name`; when it exists, `on_exists` decides whether it may be replaced.
template <typename OnExists>
Result<std::unique_ptr<ShmMapping>> create_segment(const std::string& name, size_t num_bytes,
                                                   bool populate, OnExists on_exists) {
  auto created = ShmMapping::create(name, num_bytes, populate);
  if (created.ok() || created.status().code() != StatusCode::kFailedPrecondition) return created;
  FLEX_RETURN_IF_ERROR(on_exists(name));
  return ShmMapping::create(name, num_bytes, populate);
}

}  // namespace

ShmTransport::ShmTransport(TransportOptions options, shm::Layout layout, std::string address)
    : options_(std::move(options)),
      layout_(layout),
      address_(std::move(address)),
      protocol_(options_, layout_, env_us("FLEXPERT_SHM_SPIN_US", 5) * 1000,
                env_us("FLEXPERT_SHM_YIELD_US", 20) * 1000, [this] { ring_all_peers(); }) {}

Result<std::unique_ptr<ShmTransport>> ShmTransport::create(const TransportOptions& options) {
  FLEX_RETURN_IF_ERROR(shm::validate_options(options));
  FLEX_ASSIGN_OR_RETURN(shm::Layout layout,
                        shm::Layout::compute(options.max_ranks, options.max_gather_bytes,
                                             options.max_exchange_bytes));
  std::string address =
      shm::control_segment_name(options.session, options.rank, options.incarnation);
  FLEX_ASSIGN_OR_RETURN(std::unique_ptr<ShmMapping> mapping,
                        shm::create_control_segment(address, layout.total_bytes, shm::kMagic));

  std::unique_ptr<ShmTransport> t(new ShmTransport(options, layout, address));
  std::byte* base = mapping->data();
  shm::SegmentHeader* h =
      shm::init_control_segment(base, layout, options, shm::kLayoutVersion, layout.total_bytes);
  h->magic.store(shm::kMagic, std::memory_order_release);  // Peers may attach from now on.

  t->control_ = std::move(mapping);
  t->header_ = h;
  t->base_ = base;
  t->protocol_.bind(h, base);
  auto self = std::make_shared<Peer>();
  self->rank = options.rank;
  self->address = address;
  self->control = t->control_;
  self->header = h;
  self->control_base = base;
  self->pid = h->pid;
  t->peers_.assign(options.max_ranks, nullptr);
  t->peers_[options.rank] = std::move(self);
  return t;
}

ShmTransport::~ShmTransport() { close_and_release(); }

TransportCapabilities ShmTransport::capabilities() const {
  TransportCapabilities c;
  c.one_sided_read = true;
  c.device_memory = false;
  c.cross_host = false;
  c.max_gather_bytes = options_.max_gather_bytes;
  c.max_exchange_bytes = options_.max_exchange_bytes;
  return c;
}

Result<std::shared_ptr<ShmTransport::Peer>> ShmTransport::attach(int peer,
                                                                 const std::string& address) {
  FLEX_ASSIGN_OR_RETURN(
      std::shared_ptr<ShmMapping> control,
      shm::open_control_segment(peer, address, kControlKind, options_, layout_.total_bytes));
  auto p = std::make_shared<Peer>();
  FLEX_RETURN_IF_ERROR(shm::link_peer(peer, control->data(), p.get()));
  p->address = address;
  p->control = std::move(control);
  return p;
}

Status ShmTransport::connect(int peer, const std::string& address) {
  return shm::connect_peer(options_, shut_down_, address_, peers_mu_, peers_, peer, address,
                           [&] { return attach(peer, address); });
}

Status ShmTransport::disconnect(int peer) {
  return shm::disconnect_peer(options_, peers_mu_, peers_, peer);
}

Result<Region> ShmTransport::allocate_region(int region_id, size_t num_bytes) {
  FLEX_RETURN_IF_ERROR(
      shm::check_new_region(shut_down_, peers_mu_, own_regions_, region_id, num_bytes));
  // We own our address (its control segment was created exclusively), so an existing region
  // segment under it is a leftover of a dead predecessor with this very address.
  FLEX_ASSIGN_OR_RETURN(std::unique_ptr<ShmMapping> mapping,
                        create_segment(shm::region_segment_name(address_, region_id), num_bytes,
                                       /*populate=*/false, [](const std::string& name) {
                                         ::shm_unlink(name.c_str());
                                         return Status();
                                       }));
  Region region{region_id, mapping->data(), num_bytes};
  std::lock_guard<std::mutex> lock(peers_mu_);
  own_regions_[region_id] = std::move(mapping);
  return region;
}

Status ShmTransport::read(int peer, int region_id, size_t offset, void* dst, size_t num_bytes) {
  FLEX_RETURN_IF_ERROR(validate_read(peer, dst, num_bytes, options_));
  const std::string what =
      "read of rank " + std::to_string(peer) + " region " + std::to_string(region_id);
  FLEX_ASSIGN_OR_RETURN(
      auto target, shm::find_target(options_, shut_down_, peers_mu_, peers_, own_regions_, peer,
                                    region_id, what, "allocated"));
  // Keeps the mapping alive while we copy.
  std::shared_ptr<const ShmMapping> region = std::move(target.own);
  if (const std::shared_ptr<Peer>& p = target.peer; p != nullptr) {
    FLEX_RETURN_IF_ERROR(shm::check_not_closed(*p, what));
    std::lock_guard<std::mutex> lock(p->regions_mu);
    auto it = p->regions.find(region_id);
    if (it == p->regions.end()) {
      auto opened = ShmMapping::open(shm::region_segment_name(p->address, region_id),
                                     /*writable=*/false, /*populate=*/false);
      if (!opened.ok()) {
        return opened.status().code() == StatusCode::kNotFound
                   ? not_found(what + ": no such region")
                   : opened.status().annotate(what);
      }
      it = p->regions.emplace(region_id, std::move(opened).value()).first;
    }
    region = it->second;
  }
  FLEX_RETURN_IF_ERROR(check_read_range(what, offset, num_bytes, region->num_bytes()));
  if (num_bytes > 0) std::memcpy(dst, region->data() + offset, num_bytes);
  if (target.peer != nullptr && num_bytes >= kDropPagesBytes) {
    // Drop the page-table entries the copy made (the data stays in the peer's segment): a
    // survivor reading a leaver's slots faulted in gigabytes, and unmapping them at the
    // disconnect held the process's mmap lock, and with it its stepping thread, 20-80 ms.
    const auto page = static_cast<uintptr_t>(sysconf(_SC_PAGESIZE));
    const auto from =
        (reinterpret_cast<uintptr_t>(region->data() + offset) + page - 1) & ~(page - 1);
    const auto to = reinterpret_cast<uintptr_t>(region->data() + offset + num_bytes) & ~(page - 1);
    if (to > from) (void)madvise(reinterpret_cast<void*>(from), to - from, MADV_DONTNEED);
  }
  return Status();
}

void ShmTransport::ring_all_peers() { shm::ring_peers(peers_, options_.rank); }

void ShmTransport::announce_closing() {
  if (shut_down_ || header_ == nullptr) return;
  header_->closed.store(1, std::memory_order_release);
  ring_all_peers();
}

void ShmTransport::close_and_release() {
  if (shut_down_ || header_ == nullptr) return;
  // Peers waiting on us notice at once instead of at their deadline.
  header_->closed.store(1, std::memory_order_release);
  ring_all_peers();
  std::vector<std::shared_ptr<Peer>> peers;
  std::unordered_map<int, std::shared_ptr<ShmMapping>> regions;
  {
    std::lock_guard<std::mutex> lock(peers_mu_);
    shut_down_ = true;
    peers.swap(peers_);
    regions.swap(own_regions_);
  }
  for (auto& [id, region] : regions) {
    if (Status s = region->unlink(); !s.ok()) FLEX_LOG(WARN) << s.to_string();
  }
  if (Status s = control_->unlink(); !s.ok()) FLEX_LOG(WARN) << s.to_string();
  protocol_.unbind();
  header_ = nullptr;
  base_ = nullptr;
  control_.reset();
  // `peers` and `regions` unmap here, or when the last read() in flight drops its reference.
}

Status ShmTransport::shutdown() {
  if (shut_down_) return Status();
  // Unlink errors are reported (they would leak /dev/shm), but teardown always completes.
  Status first_error;
  {
    std::lock_guard<std::mutex> lock(peers_mu_);
    for (auto& [id, region] : own_regions_) {
      Status s = region->unlink();
      if (first_error.ok() && !s.ok()) first_error = s;
    }
  }
  if (Status s = control_->unlink(); first_error.ok() && !s.ok()) first_error = s;
  close_and_release();
  return first_error;
}

Result<int> remove_shm_session(const std::string& session) {
  FLEX_RETURN_IF_ERROR(shm::validate_session(session));
  DIR* dir = ::opendir("/dev/shm");
  if (dir == nullptr) return shm::errno_status(errno, "opendir /dev/shm");
  std::vector<std::string> names;
  while (const dirent* entry = ::readdir(dir)) {
    if (shm::is_session_segment(entry->d_name, session)) names.emplace_back(entry->d_name);
  }
  ::closedir(dir);
  int removed = 0;
  for (const std::string& name : names) {
    if (::shm_unlink(("/" + name).c_str()) == 0) ++removed;
  }
  return removed;
}

}  // namespace flexpert
