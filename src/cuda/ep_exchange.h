// SPDX-License-Identifier: Apache-2.0
// The device side of the expert-parallel exchange between GPU ranks of one host: kernels
// that read peers' memory (CUDA IPC mappings, or plain pointers for ranks of one process)
// and signal them through flags in their windows; no host copy, no host synchronisation.
//
// Every rank owns one EpWindow (device memory peers map) and exposes, besides it, its
// routed rows h ([T, H], the model's dtype), its pairs' global slots, and, as the owner of
// slots, its computed rows y and their row_of_pair table. One MoE layer, with v the
// exchange's value ((epoch << 40) | exchange index in that epoch):
//   1. ep_publish (source): pos[p] := place of pair p among this rank's pairs to the owner
//      of its slot, cnt[o] := pairs to owner o; then ready[me] := v in every member's window.
//   2. ep_wait (ready): every member's ready entry in this window reaches v.
//   3. ep_gather (owner): res_first[src] := rows of lower sources, then for every member's
//      pair p on a local slot: row res_first[src] + pos[p] := its h row (copied here) and its
//      local slot; rows past the count to the step's bound get slot -1 (skipped by the
//      permutation). The grouped GEMMs then run over these rows (top_k 1).
//   4. ep_signal (owner, done): done[me] := v in every member's window.
//   5. ep_wait (done), then ep_combine (source): out[t] = sum over k, in k order, of
//      weight * y of the owner of the pair's slot at row_of_pair[res_first[me] + pos[p]].
// A rank reuses nothing a peer may still read before the flags say the peer is past it:
// an owner's y is rewritten only after every source signalled ready for the next layer,
// which each does after its combine; a source's h, slots and pos only after every owner
// signalled done.
//
// No kernel waits (where the device has 64-bit stream memory operations): a rank killed inside a
// kernel that never ends takes every other client of its GPU down under MPS (the server faults the
// kernel once it tears the process down, 5-20 ms after the kill), while one killed with its stream
// held by a stream memory operation leaves them running (docs/benchmarks.md, "Losing a rank"). So
// ep_wait first holds the stream with one wait operation per member (its flag in this rank's window
// >= v, the comparison cyclic), and its kernel only checks what they let through. The host ends the
// waits on dead members (at the transport's timeout: on every member) with ep_release, a kernel on
// another stream that sets kEpReleased (bit 62) in their flags: a flag with it passes every wait
// (cyclic: value | 2^62 - v is positive), and the check counts the member missing when the value
// under it is below v (the exchange fails; a missing member is sent no given-up flags: it may have
// died with its memory). After the step ep_unrelease clears the bit, so the values peers wrote are
// what later waits see. ep_wait's kernel also gives up when *abort (host memory the host sets) is
// non-zero or after timeout_ns (a backstop where stream memory operations are missing). A rank
// whose exchange fails (its own error, e.g. a pair routed to a non-member, or a wait that gave up)
// says so instead of going silent: it writes gave_up[which][me] := v, then the flag its peers wait
// for := v, for ready (publish, also of every later exchange of the step) and done; a wait for v
// that finds gave_up >= v fails at once (status->aborted names the member) rather than at the
// timeout: the failed rank's checks pass at once (its memory operations pass as its peers, failing
// in turn, give up too), and it may already be giving up later exchanges of the step. A gave_up
// below v is an earlier step's.
#pragma once

#include <cuda_runtime_api.h>

#include <cstdint>

#include "flexpert/dtype.h"

namespace flexpert::cuda {

inline constexpr int kEpMaxRanks = 64;                      // Members are a 64-bit mask.
inline constexpr uint64_t kEpReleased = uint64_t{1} << 62;  // Values stay below 2^62.

struct EpWindow {
  uint64_t ready[kEpMaxRanks];     // [src] the value of src's latest published rows.
  uint64_t done[kEpMaxRanks];      // [owner] the value of the owner's latest computed rows.
  int32_t num_pairs;               // This rank's published pairs (real tokens * top_k).
  int32_t cnt[kEpMaxRanks];        // Pairs this rank sends to each owner.
  int32_t res_first[kEpMaxRanks];  // As owner: first row of each source's rows.
  int32_t pad[63];
  uint64_t gave_up[2][kEpMaxRanks];  // [which][r]: the latest value r gave up (ready, done).
  // Followed by pos[max pairs] (int32).
};
static_assert(sizeof(EpWindow) % 256 == 0);

// What a kernel reads of one member (device pointers valid in this process).
struct EpPeer {
  EpWindow* window = nullptr;
  const int32_t* pos = nullptr;          // Right after the window.
  const void* h = nullptr;               // [T, H] routed rows.
  const int32_t* slot = nullptr;         // [T * K] global slots of the pairs.
  const void* y = nullptr;               // [bound, H] rows it computed as owner.
  const int32_t* row_of_pair = nullptr;  // [bound] its permutation.
};

// A step's error state (device memory; the host copies it after the step).
struct EpStatus {
  uint64_t missing;  // Members a wait gave up on.
  uint64_t aborted;  // Members whose flag said they gave up the exchange.
  int32_t failed;    // Non-zero: the exchange is broken for the rest of the step.
  int32_t overflow;  // Rows an owner received past its bound, or -1: a slot of a non-member.
};

struct EpArgs {
  const EpPeer* peers = nullptr;  // [kEpMaxRanks], device memory.
  EpWindow* window = nullptr;     // This rank's (peers[me].window), for the host's waits.
  int me = 0;
  uint64_t members = 0;
  int slots_per_rank = 0;
  int top_k = 0;
  int hidden = 0;
  DType dtype = DType::kBF16;
  uint64_t value = 0;
  EpStatus* status = nullptr;               // Device memory, zero while the step is sound.
  const volatile int32_t* abort = nullptr;  // Pinned host memory the host sets.
  volatile uint64_t* progress = nullptr;    // Pinned host memory: the last wait passed.
  int64_t timeout_ns = 0;
};

// 1. num_pairs of this rank's pairs (slots in peers[me].slot).
cudaError_t ep_publish(const EpArgs& a, int num_pairs, int32_t* pos, cudaStream_t stream);
// 2. / 5. which: 0 ready, 1 done. Stream memory operations where the device has them
// (ep_stream_waits), then the checking kernel.
cudaError_t ep_wait(const EpArgs& a, int which, cudaStream_t stream);
// Whether ep_wait holds the stream with memory operations (else its kernel spins).
bool ep_stream_waits();
// On `side` (a stream other than the waiting one; a one-block kernel that waits for
// nothing): kEpReleased set in both flags of every rank in `ranks` in `window` (this
// rank's), which passes every wait on them while it stays; the value is kept.
cudaError_t ep_release(EpWindow* window, uint64_t ranks, cudaStream_t side);
// On the waiting stream, once the releases have landed: kEpReleased cleared in every flag.
cudaError_t ep_unrelease(EpWindow* window, cudaStream_t stream);
// 3. Rows into `rows` ([bound, H] dtype) and their local slots into `local_slot` ([bound]);
// *num_rows := rows received. More than `bound` rows: failed, with status->overflow.
cudaError_t ep_gather(const EpArgs& a, int bound, void* rows, int32_t* local_slot,
                      int32_t* num_rows, cudaStream_t stream);
// 4.
cudaError_t ep_signal_done(const EpArgs& a, cudaStream_t stream);
// 5. out ([num_tokens, H] f32): rows below num_real combined, the rest (padding) zero.
// weight: [num_real * K] router weights; pos: this rank's window's pos.
cudaError_t ep_combine(const EpArgs& a, const float* weight, const int32_t* pos, int num_real,
                       int num_tokens, float* out, cudaStream_t stream);

}  // namespace flexpert::cuda
