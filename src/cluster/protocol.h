// SPDX-License-Identifier: Apache-2.0
// The control-plane protocol between the front end and its workers.
//
// Transport: a ZeroMQ ROUTER (front end) and one DEALER per worker, whose
// routing id is "<rank>.<incarnation>". Every message is two frames: the type
// name, then a msgpack map of the struct's fields. The front end rejects
// messages from an incarnation it no longer knows. Plain value types.
//
//   worker -> front end: Hello, Ready, TokenBatch, StepReport, WorkerError, PullDone, MapApplied,
//                        Connected, EpochApplied
//   front end -> worker: WorkerConfig, EpochCommand, AddRequest, CancelRequest, Shutdown,
//                        PullCommand, MapCommand, ConnectCommand; PeerLost on the heartbeat
//                        socket
#pragma once

#ifndef MSGPACK_NO_BOOST
#define MSGPACK_NO_BOOST 1
#endif
#include <cstdint>
#include <msgpack.hpp>
#include <string>
#include <vector>

#include "flexpert/generate.h"
#include "flexpert/status.h"

namespace flexpert::proto {

// The msgpack map of a SamplingParams / TokenLogprob: one structure on the wire, named
// fields as MSGPACK_DEFINE_MAP writes them (a missing field keeps its default). `P` is
// the type or its const version (packing).
template <typename P>
auto sampling_params_fields(P& p) {
  return msgpack::type::make_define_map(
      "temperature", p.temperature, "top_k", p.top_k, "top_p", p.top_p, "seed", p.seed,
      "max_tokens", p.max_tokens, "stop_token_ids", p.stop_token_ids, "ignore_eos", p.ignore_eos,
      "repetition_penalty", p.repetition_penalty, "presence_penalty", p.presence_penalty,
      "frequency_penalty", p.frequency_penalty, "logit_bias", p.logit_bias, "min_tokens",
      p.min_tokens, "logprobs", p.logprobs);
}
template <typename L>
auto token_logprob_fields(L& l) {
  return msgpack::type::make_define_map("token", l.token, "logprob", l.logprob, "top", l.top);
}

}  // namespace flexpert::proto

// Adaptors rather than MSGPACK_DEFINE_MAP inside the structs: include/flexpert/generate.h
// is a public header and stays free of msgpack.
namespace msgpack {
MSGPACK_API_VERSION_NAMESPACE(MSGPACK_DEFAULT_API_NS) {
  namespace adaptor {
  template <>
  struct convert<flexpert::SamplingParams> {
    const msgpack::object& operator()(const msgpack::object& o, flexpert::SamplingParams& v) const {
      flexpert::proto::sampling_params_fields(v).msgpack_unpack(o);
      return o;
    }
  };
  template <>
  struct pack<flexpert::SamplingParams> {
    template <typename Stream>
    packer<Stream>& operator()(packer<Stream>& o, const flexpert::SamplingParams& v) const {
      flexpert::proto::sampling_params_fields(v).msgpack_pack(o);
      return o;
    }
  };
  template <>
  struct convert<flexpert::TokenLogprob> {
    const msgpack::object& operator()(const msgpack::object& o, flexpert::TokenLogprob& v) const {
      flexpert::proto::token_logprob_fields(v).msgpack_unpack(o);
      return o;
    }
  };
  template <>
  struct pack<flexpert::TokenLogprob> {
    template <typename Stream>
    packer<Stream>& operator()(packer<Stream>& o, const flexpert::TokenLogprob& v) const {
      flexpert::proto::token_logprob_fields(v).msgpack_pack(o);
      return o;
    }
  };
  }  // namespace adaptor
}
}  // namespace msgpack

namespace flexpert::proto {

struct Hello {
  static constexpr const char* kType = "hello";
  static constexpr int kAnyRank = -1;  // `flexpert worker --rank auto`: WorkerConfig says which.
  int rank = 0;
  uint64_t incarnation = 0;
  int pid = 0;
  // The group's cluster key (docs/ARCHITECTURE.md, "Trust boundaries"): the front
  // end answers a hello only when it matches. Empty when the group has none.
  std::string key;
  MSGPACK_DEFINE_MAP(rank, incarnation, pid, key);
};

// An ExpertPlacement (include/flexpert/placement.h) on the wire: per MoE layer, slot ->
// logical expert, kFreeSlot for a free slot. A plain value here because ExpertPlacement
// belongs to moe, which comes after cluster in the module order; the worker and the front
// end convert (src/engine/placement_wire.h). No layers: no placement.
struct Placement {
  static constexpr int kFreeSlot = -1;  // ExpertPlacement::kFreeSlot.
  int num_experts = 0;
  std::vector<std::vector<int>> slot_to_expert;  // [layer][slot]
  bool empty() const { return slot_to_expert.empty(); }
  int num_slots() const { return empty() ? 0 : static_cast<int>(slot_to_expert[0].size()); }
  // Its shape: num_experts >= 1, every layer as many slots as layer 0, every entry
  // kFreeSlot or a logical expert below num_experts. InvalidArgument naming the first fault.
  // Whether every expert keeps a replica is ExpertPlacement's rule (from_slot_maps).
  Status check() const;
  MSGPACK_DEFINE_MAP(num_experts, slot_to_expert);
};

// Everything a worker needs to build its model and transport.
struct WorkerConfig {
  static constexpr const char* kType = "config";
  int rank = 0;              // The id admitted (the hello's, or the one chosen for -1).
  uint64_t incarnation = 0;  // Assigned by the front end; unique per rank id.
  std::string session;
  std::string model_dir;
  int max_ranks = 1;
  int slots_per_rank = 0;
  Placement placement;  // Over max_ranks * slots_per_rank slots.
  int max_sequences = 32;
  int max_tokens_per_step = 256;
  int max_seq_len = 0;
  int timeout_ms = 10000;
  int threads = 0;                // 0: the worker's default.
  std::string device = "cpu";     // ModelOptions::device ("cuda:N" is relative to the rank's GPUs).
  bool device_f32 = false;        // f32 weights/activations on the GPU (verification); else bf16.
  std::string quantization;       // ModelOptions::quantization: "", "bf16" or "fp8".
  std::string transport = "shm";  // create_transport()'s backend: every pair of ranks uses it.
  bool step_timing = false;       // Time the MoE exchanges (EpMoeExecutor::set_timing; StepReport).
  // decode(): a placement is present, well formed and has max_ranks * slots_per_rank slots.
  Status check() const;
  MSGPACK_DEFINE_MAP(rank, incarnation, session, model_dir, max_ranks, slots_per_rank, placement,
                     max_sequences, max_tokens_per_step, max_seq_len, timeout_ms, threads, device,
                     device_f32, quantization, transport, step_timing);
};

// A worker has loaded its model and created its transport.
struct Ready {
  static constexpr const char* kType = "ready";
  int rank = 0;
  uint64_t incarnation = 0;
  std::string transport_address;
  int vocab_size = 0;
  int max_seq_len = 0;
  MSGPACK_DEFINE_MAP(rank, incarnation, transport_address, vocab_size, max_seq_len);
};

// Membership: from the step whose header shows every member holding this
// command, the members step together in `epoch`.
struct EpochCommand {
  static constexpr const char* kType = "epoch";
  uint64_t epoch = 0;
  std::vector<int> members;
  std::vector<std::string> addresses;  // [max_ranks]; "" for non-members.
  // [max_ranks]: each member's incarnation (0 for non-members; empty from a front end that
  // does not say), so that a PeerLost of an earlier one is told apart
  // (src/engine/peer_incarnations.h).
  std::vector<uint64_t> incarnations;
  // The expert placement of the new epoch (e.g. without a lost rank's slots); empty
  // keeps the current one. Applied together with the membership.
  Placement placement;
  uint64_t map_version = 0;
  Status check() const;  // decode(): the placement, when present, is well formed.
  MSGPACK_DEFINE_MAP(epoch, members, addresses, incarnations, placement, map_version);
};

struct AddRequest {
  static constexpr const char* kType = "add";
  uint64_t id = 0;
  std::vector<int32_t> prompt;
  SamplingParams params;
  // The last num_generated prompt tokens were generated by an earlier run of the request
  // (a re-run after a move; Scheduler::add).
  int num_generated = 0;
  // How many times the front end has moved this request to another rank; echoed in
  // TokenBatch so that tokens of an earlier placement are told apart.
  uint32_t attempt = 0;
  MSGPACK_DEFINE_MAP(id, prompt, params, num_generated, attempt);
};

struct CancelRequest {
  static constexpr const char* kType = "cancel";
  uint64_t id = 0;
  MSGPACK_DEFINE_MAP(id);
};

// New tokens of one step: parallel arrays.
struct TokenBatch {
  static constexpr const char* kType = "tokens";
  std::vector<uint64_t> ids;
  std::vector<int32_t> tokens;
  std::vector<std::string> finish_reasons;  // "" while running.
  std::vector<uint32_t> attempts;           // AddRequest::attempt of each request.
  // Parallel to ids when a request of the batch asked for logprobs (an entry for each
  // request; meaningful only for those that asked), else empty.
  std::vector<TokenLogprob> logprobs;
  MSGPACK_DEFINE_MAP(ids, tokens, finish_reasons, attempts, logprobs);
};

// Sent every kHeartbeatIntervalMs by a thread of its own on a second socket (routing
// id: the worker's + kHeartbeatSuffix), so that a long step is not silence: a rank
// that stops sending (SIGSTOP, a dropped link) is lost after --heartbeat-timeout-ms.
struct Heartbeat {
  static constexpr const char* kType = "heartbeat";
  static constexpr int kHeartbeatIntervalMs = 200;
  static constexpr const char* kHeartbeatSuffix = "/hb";
  int rank = 0;
  uint64_t incarnation = 0;
  MSGPACK_DEFINE_MAP(rank, incarnation);
};

// The front end declared `rank` (incarnation `incarnation`) lost: silent past
// --heartbeat-timeout-ms, its process ended, or fenced. Sent to every other rank that has
// said hello, on its heartbeat socket: that thread answers while the stepping thread waits in
// a collective, and marks the peer lost in the transport (Transport::mark_peer_lost), so a
// wait on a silent host ends at once instead of at the transport timeout. One naming an
// incarnation earlier than the one the worker attached is stale and ignored
// (src/engine/peer_incarnations.h).
struct PeerLost {
  static constexpr const char* kType = "peer-lost";
  int rank = 0;
  uint64_t incarnation = 0;
  std::string why;
  MSGPACK_DEFINE_MAP(rank, incarnation, why);
};

// Sent a few times a second between steps (load statistics).
struct StepReport {
  static constexpr const char* kType = "report";
  uint64_t epoch = 0;
  uint64_t steps = 0;
  double step_ms = 0;      // Mean over busy steps since the last report.
  double max_step_ms = 0;  // Longest busy step since the last report.
  int running = 0;
  int waiting = 0;
  uint64_t map_version = 0;  // Expert map in use.
  // Rows computed per [layer][local slot] since the last report (EPLB load).
  std::vector<int64_t> slot_counts;
  int64_t graph_captures = 0;  // CUDA graphs captured since start (flat across epochs).
  // Sums over the `steps` busy steps since start (the breakdown bench serve prints): the
  // steps' time as step_ms counts it (forward and token output), the step header
  // all-gathers before them, and, with WorkerConfig::step_timing, the MoE exchanges inside
  // them (EpMoeExecutor::exchange_ms; -1 without step timing).
  double total_step_ms = 0;
  double total_header_ms = 0;
  double total_exchange_ms = -1;
  MSGPACK_DEFINE_MAP(epoch, steps, step_ms, max_step_ms, running, waiting, map_version, slot_counts,
                     graph_captures, total_step_ms, total_header_ms, total_exchange_ms);
};

// Copy experts into free local slots: dst_slots[i] <- (src_ranks[i], src_slots[i]),
// local slot indices on both sides, layer `layer`. Runs beside serving (one-sided
// transport reads); answered by PullDone. src_ranks[i] == kFromCheckpoint loads
// logical expert src_slots[i] from the checkpoint instead (no replica is left).
struct PullCommand {
  static constexpr const char* kType = "pull";
  static constexpr int kFromCheckpoint = -1;
  uint64_t id = 0;
  int layer = 0;
  std::vector<int> dst_slots;
  std::vector<int> src_ranks;
  std::vector<int> src_slots;
  MSGPACK_DEFINE_MAP(id, layer, dst_slots, src_ranks, src_slots);
};

struct PullDone {
  static constexpr const char* kType = "pulled";
  uint64_t id = 0;
  uint64_t num_bytes = 0;
  double seconds = 0;
  int code = 0;  // StatusCode; 0 = OK.
  std::string message;
  uint64_t device_copies = 0;  // Slots copied device to device (Model::copy_slot).
  MSGPACK_DEFINE_MAP(id, num_bytes, seconds, code, message, device_copies);
};

// A new expert placement (all layers, all slots). Members switch at the step
// boundary whose header shows every member holding it, then answer MapApplied.
struct MapCommand {
  static constexpr const char* kType = "map";
  uint64_t version = 0;
  Placement placement;
  Status check() const;  // decode(): a placement is present and well formed.
  MSGPACK_DEFINE_MAP(version, placement);
};

struct MapApplied {
  static constexpr const char* kType = "mapped";
  uint64_t version = 0;
  MSGPACK_DEFINE_MAP(version);
};

// Attach to (address non-empty) or detach from (address "") the listed peers
// while serving, then prove each new attachment with a one-sided read of
// `probe_region`. Prepares a membership change so that the commit step maps
// nothing. Answered by Connected.
struct ConnectCommand {
  static constexpr const char* kType = "connect";
  uint64_t id = 0;
  std::vector<int> ranks;
  std::vector<std::string> addresses;  // Parallel to ranks.
  std::vector<uint64_t> incarnations;  // Parallel to ranks (as EpochCommand's).
  int probe_region = -1;               // -1: no probe (a model without MoE layers).
  MSGPACK_DEFINE_MAP(id, ranks, addresses, incarnations, probe_region);
};

struct Connected {
  static constexpr const char* kType = "connected";
  uint64_t id = 0;
  int code = 0;  // StatusCode; 0 = OK.
  std::string message;
  MSGPACK_DEFINE_MAP(id, code, message);
};

// A worker switched to `epoch` (member or not: a rank left out stops stepping).
struct EpochApplied {
  static constexpr const char* kType = "epoch-applied";
  uint64_t epoch = 0;
  bool member = false;
  MSGPACK_DEFINE_MAP(epoch, member);
};

struct WorkerError {
  static constexpr const char* kType = "error";
  uint64_t epoch = 0;
  int code = 0;  // StatusCode.
  std::string message;
  int dead_rank = -1;  // A peer the transport saw die (its pid gone), if any.
  MSGPACK_DEFINE_MAP(epoch, code, message, dead_rank);
};

// kStop: the whole group stops together (announced in the step header).
// kLeave: this rank exits once an epoch without it has been applied; the others go on.
// kFenced: this incarnation was declared lost; exit at once, touching nothing shared.
struct Shutdown {
  static constexpr const char* kType = "shutdown";
  static constexpr int kStop = 0;
  static constexpr int kLeave = 1;
  static constexpr int kFenced = 2;
  int reason = kStop;
  MSGPACK_DEFINE_MAP(reason);
};

// A member asks to be removed (its SIGTERM: a graceful leave). The front end runs a
// live scale-down of `rank` and answers with Shutdown{kLeave} once it has committed.
struct LeaveRequest {
  static constexpr const char* kType = "leave";
  int rank = 0;
  uint64_t incarnation = 0;
  MSGPACK_DEFINE_MAP(rank, incarnation);
};

template <typename T>
std::string encode(const T& msg) {
  msgpack::sbuffer buf;
  msgpack::pack(buf, msg);
  return std::string(buf.data(), buf.size());
}

// Bounds for a control message from a peer: every struct here nests a few levels,
// and an array or map cannot hold more elements than the body has bytes. Without
// them a 10-byte body can claim 2^32 elements and make the unpacker allocate them.
inline msgpack::unpack_limit decode_limits(size_t body_bytes) {
  constexpr size_t kMaxDepth = 16;
  return msgpack::unpack_limit(body_bytes, body_bytes, body_bytes, body_bytes, body_bytes,
                               kMaxDepth);
}

// DataLoss when the body does not hold a T, or holds one its check() refuses (a
// message type with values beyond msgpack's types, such as a Placement, has one).
template <typename T>
Result<T> decode(const std::string& body) {
  T msg;
  try {
    msgpack::object_handle oh =
        msgpack::unpack(body.data(), body.size(), nullptr, nullptr, decode_limits(body.size()));
    oh.get().convert(msg);
  } catch (const std::exception& e) {
    return data_loss(std::string("malformed '") + T::kType + "' message: " + e.what());
  }
  if constexpr (requires { msg.check(); }) {
    if (Status s = msg.check(); !s.ok()) {
      return data_loss(std::string("malformed '") + T::kType + "' message: " + s.message());
    }
  }
  return msg;
}

}  // namespace flexpert::proto
