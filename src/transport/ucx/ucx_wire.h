// SPDX-License-Identifier: Apache-2.0
// What UcxTransport puts on the wire, and its address format. Pure data and parsing: no UCX.
//
// Every active message carries one WireHeader (the AM header; the payload, if any, is the AM
// data). A collective message names its sender (rank, incarnation), its epoch and op index and
// its kind; it also carries the sender's epoch history (the epoch it left and how many ops it
// started there) and how many regions it has announced, so that a receiver can tell "a message
// still on its way" from "a peer that moved on", and "region not announced yet" from "no such
// region". See ucx_transport.h for how the receiver files, takes and rejects messages.
#pragma once

#include <cstddef>
#include <cstdint>
#include <string>
#include <string_view>

#include "flexpert/status.h"

namespace flexpert::ucx {

inline constexpr uint32_t kWireMagic = 0x31584355;  // "UCX1", little-endian.
inline constexpr unsigned kAmId = 7;                // The one AM id this backend registers.

enum class MessageType : uint16_t {
  kCollective = 1,  // Payload of op (epoch, op_idx) of kind `kind`.
  kEpoch = 2,       // The sender entered `epoch` (no payload): peers waiting on it may abort.
  kRegion = 3,      // Region `region_id` at `region_addr`, `region_bytes`; payload: packed rkey.
  kBye = 4,         // The sender shuts down.
  kByeAck = 5,      // The sender took our kBye, and so every message we sent before it.
};

// The op kinds, as shm names them (the numbering is this backend's own).
enum class OpKind : uint16_t { kNone = 0, kAllGather = 1, kBarrier = 2, kExchange = 3 };
const char* op_kind_name(OpKind kind);

struct WireHeader {
  uint32_t magic = kWireMagic;
  MessageType type = MessageType::kCollective;
  OpKind kind = OpKind::kNone;
  int32_t src_rank = -1;
  int32_t src_pid = 0;
  uint64_t src_incarnation = 0;
  uint64_t epoch = 0;   // The sender's current epoch (kCollective, kEpoch).
  uint64_t op_idx = 0;  // kCollective: index of the op within `epoch`.
  uint64_t has_epoch = 0;
  uint64_t prev_epoch = 0;  // The epoch the sender left for `epoch` (when has_prev).
  uint64_t prev_ops = 0;    // How many ops it had started in prev_epoch.
  uint64_t has_prev = 0;
  uint64_t regions_announced = 0;  // kRegion messages the sender has sent to this receiver.
  int64_t region_id = -1;          // kRegion.
  uint64_t region_addr = 0;
  uint64_t region_bytes = 0;
};
static_assert(sizeof(WireHeader) == 104);

// "ucx://HOST:PORT/r<rank>/i<incarnation>/p<pid>/t<start>" (HOST an IPv4 address or [IPv6]): a
// rank listening on a socket (connect by sockaddr); or "ucx:///r<rank>/i<incarnation>/p<pid>/
// t<start>/w<W>" with W the rank's UCP worker address in base64url (connect by worker address).
// <start> is the process start time (/proc/<pid>/stat), telling a reused pid apart.
struct Address {
  std::string host;  // Empty: no listener.
  uint16_t port = 0;
  int rank = -1;
  uint64_t incarnation = 0;
  int32_t pid = 0;
  uint64_t start_time = 0;
  std::string worker;  // Raw UCP worker address bytes; empty with a listener.

  std::string to_string() const;
  static Result<Address> parse(std::string_view text);
};

std::string base64url_encode(std::string_view bytes);
// False on a character outside the alphabet or a bad length.
bool base64url_decode(std::string_view text, std::string* out);

// The client id a rank's worker sends when it connects (UCP_EP_PARAMS_FLAGS_SEND_CLIENT_ID):
// tells the accepting side which rank and incarnation an incoming endpoint belongs to.
inline uint64_t client_id(int rank, uint64_t incarnation) {
  return (incarnation << 16) | static_cast<uint64_t>(rank & 0xffff);
}
inline int client_id_rank(uint64_t id) { return static_cast<int>(id & 0xffff); }
inline uint64_t client_id_incarnation(uint64_t id) { return id >> 16; }

}  // namespace flexpert::ucx
