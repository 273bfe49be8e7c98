// SPDX-License-Identifier: Apache-2.0
// Byte layout of a shm rank's control segment, and the names of its segments.
//
//   [SegmentHeader][gather mailboxes   [src][parity], src in [0, max_ranks), parity 0/1]
//                  [exchange mailboxes [src][parity]]
//
// Mailbox [src][*] of rank R's segment is written only by rank src and read only by R.
// Its state word (the futex-able 32 bits) carries the op index (mod 2^30) of the message
// and one of four states:
//   Free | Writing | dead Full  --writer CAS-->  Writing  --writer, release-->  Full(op)
//   Full(op)  --R claims it (CAS)-->  Held  --R enters its next collective-->  Free
// A writer never touches a Held mailbox (R still exposes it as a span), nor a live Full one:
// a message R may still consume because R has not started a later op of that epoch (R's
// header publishes its epoch and how many ops of it it started). So a peer that races into
// a newer epoch neither corrupts the spans of R's last op nor steals a message R is about to
// take. Within one epoch a writer never waits: it reuses a parity two ops later, which needs
// R's contribution to the op in between, sent after R freed its mailboxes.
// The payload is plain bytes ordered by the state word; fields two processes touch are atomic.
#pragma once

#include <atomic>
#include <cstddef>
#include <cstdint>
#include <string>
#include <string_view>

#include "flexpert/status.h"

namespace flexpert::shm {

inline constexpr uint64_t kMagic = 0x314d485350584546ULL;  // "FEXPSHM1", little-endian.
inline constexpr uint32_t kLayoutVersion = 1;
inline constexpr size_t kCacheLineBytes = 64;
inline constexpr int kMaxRanksLimit = 4096;
inline constexpr size_t kMaxSessionChars = 128;

enum class MailboxState : uint32_t { kFree = 0, kWriting = 1, kFull = 2, kHeld = 3 };

inline uint32_t pack_state(uint64_t op_idx, MailboxState state) {
  return static_cast<uint32_t>(op_idx << 2) | static_cast<uint32_t>(state);
}
inline MailboxState state_of(uint32_t word) { return static_cast<MailboxState>(word & 3u); }
inline uint32_t op_bits_of(uint32_t word) { return word >> 2; }

enum class OpKind : uint32_t { kNone = 0, kAllGather = 1, kBarrier = 2, kExchange = 3 };
const char* op_kind_name(OpKind kind);

struct SegmentHeader {
  // Written by the owner before it stores `magic` (release); constant afterwards.
  std::atomic<uint64_t> magic;
  uint32_t version;
  int32_t pid;
  uint64_t pid_start_time;  // Tells a reused pid apart (see ProcessWatch).
  int32_t rank;
  int32_t max_ranks;
  uint64_t incarnation;
  uint64_t max_gather_bytes;
  uint64_t max_exchange_bytes;
  uint64_t segment_bytes;
  // Written by the owner, read by peers: set at shutdown / on entering a newer epoch.
  alignas(kCacheLineBytes) std::atomic<uint32_t> closed;
  std::atomic<uint64_t> epoch;
  // Ops of `epoch` the owner has started (written each op; read by writers on epoch changes).
  alignas(kCacheLineBytes) std::atomic<uint64_t> ops_started;
  // The owner's futex word and its "asleep on it" flag; writers ring only while it is set.
  alignas(kCacheLineBytes) std::atomic<uint32_t> doorbell;
  std::atomic<uint32_t> sleeping;
};

struct alignas(kCacheLineBytes) MailboxHeader {
  std::atomic<uint32_t> state;
  std::atomic<uint32_t> kind;  // OpKind of the message.
  std::atomic<uint64_t> epoch;
  std::atomic<uint64_t> op_idx;  // Full op index (the state word keeps 30 bits of it).
  std::atomic<uint64_t> num_bytes;

  std::byte* payload() { return reinterpret_cast<std::byte*>(this) + sizeof(MailboxHeader); }
};

static_assert(sizeof(MailboxHeader) == kCacheLineBytes);
static_assert(std::atomic<uint64_t>::is_always_lock_free);

// Where everything sits in a segment of the given capacities.
struct Layout {
  int max_ranks = 0;
  size_t max_gather_bytes = 0;
  size_t max_exchange_bytes = 0;
  size_t gather_stride = 0;  // One mailbox: header + payload, cache-line rounded.
  size_t exchange_stride = 0;
  size_t gather_offset = 0;
  size_t exchange_offset = 0;
  size_t total_bytes = 0;

  // InvalidArgument for zero ranks, absurd sizes or a total that overflows.
  static Result<Layout> compute(int max_ranks, size_t max_gather_bytes, size_t max_exchange_bytes);

  MailboxHeader* mailbox(std::byte* base, bool exchange, int src_rank, uint64_t op_idx) const {
    const size_t stride = exchange ? exchange_stride : gather_stride;
    const size_t slot = static_cast<size_t>(src_rank) * 2 + (op_idx & 1);
    return reinterpret_cast<MailboxHeader*>(base + (exchange ? exchange_offset : gather_offset) +
                                            slot * stride);
  }
};

// Whether a Full mailbox of `reader`'s segment holds a message the reader may still take:
// it has not started a later op of the message's epoch, nor moved past that epoch.
bool message_is_live(const MailboxHeader& mailbox, const SegmentHeader& reader);

// Wakes the owner of `header` if it sleeps on its doorbell. Callers store what they publish
// (seq_cst) before ringing: the owner sets `sleeping` (seq_cst) before its last look, so
// either it sees the publication or we see it asleep.
void ring_doorbell(SegmentHeader* header);

// An existing control segment `name` (of a backend whose header carries `magic`) is stale
// when its owner exited (a crashed predecessor with the same session, rank and incarnation)
// or shut down: then it is unlinked and OK is returned, so that the caller may create it
// anew. FailedPrecondition while its owner lives, or when it is no such segment.
Status remove_if_stale(const std::string& name, uint64_t magic);

// Sessions name shared resources: 1..128 characters of [A-Za-z0-9._-].
Status validate_session(std::string_view session);
// "/flexpert-<session>-r<rank>-i<incarnation>": the control segment, and the address.
std::string control_segment_name(std::string_view session, int rank, uint64_t incarnation);
// "<address>-g<region_id>".
std::string region_segment_name(std::string_view address, int region_id);
// Whether a /dev/shm entry (no leading '/') is a control or region segment of `session`.
// Parsed exactly, so session "a" never matches the segments of session "a-r0-i0".
bool is_session_segment(std::string_view file_name, std::string_view session);

}  // namespace flexpert::shm
