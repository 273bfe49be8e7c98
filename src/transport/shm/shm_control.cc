// SPDX-License-Identifier: Apache-2.0
#include "transport/shm/shm_control.h"

#include <unistd.h>

#include <new>

#include "flexpert/logging.h"

namespace flexpert::shm {

Status validate_options(const TransportOptions& options) {
  FLEX_RETURN_IF_ERROR(validate_session(options.session));
  if (options.rank < 0 || options.rank >= options.max_ranks) {
    return invalid_argument("rank " + std::to_string(options.rank) +
                            " not in [0, max_ranks=" + std::to_string(options.max_ranks) + ")");
  }
  if (options.timeout_ms <= 0) {
    return invalid_argument("timeout_ms must be > 0, got " + std::to_string(options.timeout_ms));
  }
  return Status();
}

Result<std::unique_ptr<ShmMapping>> create_control_segment(const std::string& name,
                                                           size_t num_bytes, uint64_t magic) {
  auto created = ShmMapping::create(name, num_bytes, /*populate=*/true);
  if (created.ok() || created.status().code() != StatusCode::kFailedPrecondition) return created;
  FLEX_RETURN_IF_ERROR(remove_if_stale(name, magic));
  return ShmMapping::create(name, num_bytes, /*populate=*/true);
}

SegmentHeader* init_control_segment(std::byte* base, const Layout& mailboxes,
                                    const TransportOptions& options, uint32_t version,
                                    uint64_t segment_bytes) {
  auto* h = new (base) SegmentHeader();
  h->version = version;
  h->pid = static_cast<int32_t>(::getpid());
  h->pid_start_time = process_start_time(h->pid);
  h->rank = options.rank;
  h->max_ranks = options.max_ranks;
  h->incarnation = options.incarnation;
  h->max_gather_bytes = options.max_gather_bytes;
  h->max_exchange_bytes = options.max_exchange_bytes;
  h->segment_bytes = segment_bytes;
  for (int src = 0; src < options.max_ranks; ++src) {
    for (int parity = 0; parity < 2; ++parity) {
      new (mailboxes.mailbox(base, false, src, parity)) MailboxHeader();
      new (mailboxes.mailbox(base, true, src, parity)) MailboxHeader();
    }
  }
  return h;
}

Result<std::shared_ptr<ShmMapping>> open_control_segment(int peer, const std::string& address,
                                                         const ControlSegmentKind& kind,
                                                         const TransportOptions& options,
                                                         size_t segment_bytes) {
  if (address.rfind("/flexpert-", 0) != 0 || address.find('/', 1) != std::string::npos ||
      address.size() > 240) {
    return invalid_argument("'" + address + "' is not a " + kind.backend + " transport address");
  }
  // Not populated: a peer's segment is mapped while the group serves (a joiner's, on the
  // stepping thread), and page tables for all of its mailboxes (~135 MB with the default
  // step budget and a 2048-wide model) took ~12 ms to build and ~5 ms to tear down at the
  // disconnect; what this rank touches (headers, the mailboxes it writes) faults in once.
  auto mapping = ShmMapping::open(address, /*writable=*/true, /*populate=*/false);
  if (!mapping.ok()) {
    if (mapping.status().code() == StatusCode::kNotFound) {
      return unavailable("rank " + std::to_string(peer) + ": no " + kind.segment + " " + address +
                         " (not started yet, or gone)");
    }
    return mapping.status().annotate("connecting to rank " + std::to_string(peer));
  }
  std::shared_ptr<ShmMapping> control = std::move(mapping).value();
  auto bad = [&](const std::string& why) {
    return invalid_argument("rank " + std::to_string(peer) + " at " + address + ": " + why);
  };
  if (control->num_bytes() < sizeof(SegmentHeader)) return bad("segment too small");
  const auto* h = reinterpret_cast<const SegmentHeader*>(control->data());
  if (h->magic.load(std::memory_order_acquire) != kind.magic) return bad(kind.not_ours);
  if (h->version != kind.version) {
    return bad("layout version " + std::to_string(h->version) + ", this build speaks " +
               std::to_string(kind.version));
  }
  if (h->rank != peer) return bad("the segment belongs to rank " + std::to_string(h->rank));
  if (h->max_ranks != options.max_ranks || h->max_gather_bytes != options.max_gather_bytes ||
      h->max_exchange_bytes != options.max_exchange_bytes) {
    return bad("options differ: peer has max_ranks=" + std::to_string(h->max_ranks) +
               " max_gather_bytes=" + std::to_string(h->max_gather_bytes) +
               " max_exchange_bytes=" + std::to_string(h->max_exchange_bytes) + ", this rank " +
               std::to_string(options.max_ranks) + "/" + std::to_string(options.max_gather_bytes) +
               "/" + std::to_string(options.max_exchange_bytes));
  }
  if (h->segment_bytes != segment_bytes || control->num_bytes() != segment_bytes) {
    return bad("segment size " + std::to_string(control->num_bytes()) + ", expected " +
               std::to_string(segment_bytes));
  }
  return control;
}

Status link_peer(int peer, std::byte* base, PeerLink* link) {
  auto* h = reinterpret_cast<SegmentHeader*>(base);
  if (h->closed.load(std::memory_order_acquire) != 0) {
    return unavailable("rank " + std::to_string(peer) + " (pid " + std::to_string(h->pid) +
                       ") has shut down");
  }
  link->rank = peer;
  link->header = h;
  link->control_base = base;
  link->pid = h->pid;
  link->watch = ProcessWatch::watch(h->pid, h->pid_start_time);
  if (!link->watch.watching()) {
    FLEX_LOG(WARN) << "rank " << peer << ": pid " << h->pid
                   << " not visible from here (other PID namespace?): its death is noticed by "
                      "timeouts only";
  }
  return Status();
}

}  // namespace flexpert::shm
