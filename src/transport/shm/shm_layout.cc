// SPDX-License-Identifier: Apache-2.0
#include "transport/shm/shm_layout.h"

#include <sys/mman.h>

#include <limits>

#include "flexpert/logging.h"
#include "transport/shm/shm_segment.h"

namespace flexpert::shm {

namespace {

constexpr size_t kMaxPayloadBytes = size_t{1} << 40;

size_t round_up(size_t n, size_t align) { return (n + align - 1) / align * align; }

// Consumes "<prefix><digits>" from the front of `s`.
bool consume_number(std::string_view& s, char prefix) {
  if (s.size() < 2 || s[0] != prefix) return false;
  size_t i = 1;
  while (i < s.size() && s[i] >= '0' && s[i] <= '9') ++i;
  if (i == 1) return false;
  s.remove_prefix(i);
  return true;
}

}  // namespace

const char* op_kind_name(OpKind kind) {
  switch (kind) {
    case OpKind::kNone:
      return "none";
    case OpKind::kAllGather:
      return "all_gather";
    case OpKind::kBarrier:
      return "barrier";
    case OpKind::kExchange:
      return "exchange";
  }
  return "unknown";
}

Result<Layout> Layout::compute(int max_ranks, size_t max_gather_bytes, size_t max_exchange_bytes) {
  if (max_ranks < 1 || max_ranks > kMaxRanksLimit) {
    return invalid_argument("max_ranks " + std::to_string(max_ranks) + " not in [1, " +
                            std::to_string(kMaxRanksLimit) + "]");
  }
  if (max_gather_bytes > kMaxPayloadBytes || max_exchange_bytes > kMaxPayloadBytes) {
    return invalid_argument("max_gather_bytes / max_exchange_bytes above 2^40");
  }
  Layout l;
  l.max_ranks = max_ranks;
  l.max_gather_bytes = max_gather_bytes;
  l.max_exchange_bytes = max_exchange_bytes;
  l.gather_stride = sizeof(MailboxHeader) + round_up(max_gather_bytes, kCacheLineBytes);
  l.exchange_stride = sizeof(MailboxHeader) + round_up(max_exchange_bytes, kCacheLineBytes);
  l.gather_offset = round_up(sizeof(SegmentHeader), kCacheLineBytes);
  const size_t num_mailboxes = static_cast<size_t>(max_ranks) * 2;
  // Strides are < 2^41 and num_mailboxes <= 2^13: the products fit in 64 bits.
  l.exchange_offset = l.gather_offset + num_mailboxes * l.gather_stride;
  const size_t end = l.exchange_offset + num_mailboxes * l.exchange_stride;
  if (end > static_cast<size_t>(std::numeric_limits<int64_t>::max() / 2)) {
    return invalid_argument("shm control segment would be " + std::to_string(end) + " bytes");
  }
  l.total_bytes = round_up(end, 4096);
  return l;
}

bool message_is_live(const MailboxHeader& mailbox, const SegmentHeader& reader) {
  const uint64_t message_epoch = mailbox.epoch.load(std::memory_order_relaxed);
  const uint64_t message_op = mailbox.op_idx.load(std::memory_order_relaxed);
  // Epoch first: the reader zeroes ops_started before it publishes a newer epoch, so a stale
  // pair errs towards "live" (the writer waits a little), never towards "dead".
  const uint64_t reader_epoch = reader.epoch.load(std::memory_order_acquire);
  const uint64_t reader_started = reader.ops_started.load(std::memory_order_acquire);
  if (message_epoch != reader_epoch) return message_epoch > reader_epoch;
  return reader_started <= message_op + 1;
}

void ring_doorbell(SegmentHeader* header) {
  if (header->sleeping.load(std::memory_order_seq_cst) != 0) {
    header->doorbell.fetch_add(1, std::memory_order_seq_cst);
    futex_wake_shared(&header->doorbell);
  }
}

Status remove_if_stale(const std::string& name, uint64_t magic) {
  auto existing = ShmMapping::open(name, /*writable=*/false, /*populate=*/false);
  if (!existing.ok()) return Status();  // Vanished meanwhile: just retry the create.
  const auto& m = *existing.value();
  if (m.num_bytes() < sizeof(SegmentHeader)) {
    return failed_precondition("shm segment " + name + " exists and is not a flexpert segment");
  }
  const auto* h = reinterpret_cast<const SegmentHeader*>(m.data());
  if (h->magic.load(std::memory_order_acquire) != magic) {
    return failed_precondition("shm segment " + name +
                               " exists and is not (yet) a flexpert segment: remove it");
  }
  const ProcessWatch watch = ProcessWatch::watch(h->pid, h->pid_start_time);
  const bool gone = !watch.watching() || watch.exited() || h->closed.load() != 0;
  if (!gone) {
    return failed_precondition("shm segment " + name + " is in use by live pid " +
                               std::to_string(h->pid) +
                               " (two ranks with the same session, rank and incarnation?)");
  }
  FLEX_LOG(WARN) << "removing stale " << name << " of exited pid " << h->pid;
  ::shm_unlink(name.c_str());
  return Status();
}

Status validate_session(std::string_view session) {
  if (session.empty() || session.size() > kMaxSessionChars) {
    return invalid_argument("session must have 1.." + std::to_string(kMaxSessionChars) +
                            " characters, got '" + std::string(session) + "'");
  }
  for (char c : session) {
    const bool ok = (c >= 'a' && c <= 'z') || (c >= 'A' && c <= 'Z') || (c >= '0' && c <= '9') ||
                    c == '.' || c == '_' || c == '-';
    if (!ok) {
      return invalid_argument("session '" + std::string(session) +
                              "' may only use [A-Za-z0-9._-] (it names /dev/shm files)");
    }
  }
  return Status();
}

std::string control_segment_name(std::string_view session, int rank, uint64_t incarnation) {
  return "/flexpert-" + std::string(session) + "-r" + std::to_string(rank) + "-i" +
         std::to_string(incarnation);
}

std::string region_segment_name(std::string_view address, int region_id) {
  return std::string(address) + "-g" + std::to_string(region_id);
}

bool is_session_segment(std::string_view file_name, std::string_view session) {
  const std::string prefix = "flexpert-" + std::string(session) + "-";
  if (file_name.substr(0, prefix.size()) != prefix) return false;
  std::string_view rest = file_name.substr(prefix.size());
  if (!consume_number(rest, 'r')) return false;
  if (rest.substr(0, 1) != "-") return false;
  rest.remove_prefix(1);
  if (!consume_number(rest, 'i')) return false;
  if (rest.empty()) return true;
  if (rest.substr(0, 1) != "-") return false;
  rest.remove_prefix(1);
  return consume_number(rest, 'g') && rest.empty();
}

}  // namespace flexpert::shm
