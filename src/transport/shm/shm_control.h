// SPDX-License-Identifier: Apache-2.0
// A rank's control segment (shm_layout.h) from creation to a peer's attachment: what the two
// backends that keep one in host shared memory, shm and cuda_ipc, do alike. Each tells its own
// segments apart by a ControlSegmentKind (magic, version, and its words in messages); what
// follows the mailboxes in a segment is the backend's. Pure functions; thread-safe.
#pragma once

#include <cstddef>
#include <cstdint>
#include <memory>
#include <string>

#include "flexpert/status.h"
#include "transport/shm/shm_layout.h"
#include "transport/shm/shm_protocol.h"
#include "transport/shm/shm_segment.h"
#include "transport/transport.h"

namespace flexpert::shm {

struct ControlSegmentKind {
  uint64_t magic = 0;
  uint32_t version = 0;
  const char* backend = "";   // In "'A' is not a <backend> transport address".
  const char* segment = "";   // In "rank R: no <segment> A (not started yet, or gone)".
  const char* not_ours = "";  // Why a segment with another magic is refused.
};

// The options create() checks: the session (validate_session), rank in [0, max_ranks),
// timeout_ms > 0. InvalidArgument otherwise.
Status validate_options(const TransportOptions& options);

// Creates control segment `name` (populated); an existing one of a dead or closed owner of the
// same magic is replaced (remove_if_stale), a live one's is FailedPrecondition.
Result<std::unique_ptr<ShmMapping>> create_control_segment(const std::string& name,
                                                           size_t num_bytes, uint64_t magic);

// Writes a new segment's header and its mailboxes (all Free) at `base`: all but `magic`, which
// the caller stores (release) once the rest of its segment is written, and peers may attach.
SegmentHeader* init_control_segment(std::byte* base, const Layout& mailboxes,
                                    const TransportOptions& options, uint32_t version,
                                    uint64_t segment_bytes);

// Opens rank `peer`'s control segment at `address` and checks that it is one of `kind`, of
// that rank, with this rank's options, of `segment_bytes`: Unavailable when it does not exist,
// InvalidArgument when it is not such a segment. Whether its owner shut down is the caller's.
Result<std::shared_ptr<ShmMapping>> open_control_segment(int peer, const std::string& address,
                                                         const ControlSegmentKind& kind,
                                                         const TransportOptions& options,
                                                         size_t segment_bytes);

// Fills `link` for rank `peer`'s control segment, opened at `base`: its header, its owner's pid
// and a watch of that process (with a warning when its pid is not visible from here).
// Unavailable when the owner has shut down.
Status link_peer(int peer, std::byte* base, PeerLink* link);

}  // namespace flexpert::shm
