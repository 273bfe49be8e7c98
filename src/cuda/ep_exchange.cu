// SPDX-License-Identifier: Apache-2.0
#include <algorithm>

#include "cuda/device_util.cuh"
#include "cuda/driver_api.h"
#include "cuda/ep_exchange.h"
#include "cuda/knobs.h"

namespace flexpert::cuda {
namespace {

constexpr int kMaxTopK = 64;

__device__ __forceinline__ uint64_t load_acquire_sys(const uint64_t* p) {
  uint64_t v;
  asm volatile("ld.acquire.sys.global.u64 %0, [%1];" : "=l"(v) : "l"(p) : "memory");
  return v;
}
__device__ __forceinline__ void store_release_sys(uint64_t* p, uint64_t v) {
  asm volatile("st.release.sys.global.u64 [%0], %1;" ::"l"(p), "l"(v) : "memory");
}
__device__ __forceinline__ int64_t global_ns() {
  uint64_t t;
  asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(t));
  return static_cast<int64_t>(t);
}
// Peers' data bypasses L1 (the wait that made it visible ran in an earlier kernel).
__device__ __forceinline__ int load_peer(const int32_t* p) { return __ldcg(p); }
__device__ __forceinline__ bool is_member(uint64_t members, int r) {
  return r >= 0 && r < kEpMaxRanks && ((members >> r) & 1) != 0;
}
__device__ __forceinline__ bool step_failed(const EpStatus* s) {
  return *reinterpret_cast<const volatile int32_t*>(&s->failed) != 0;
}
__device__ __forceinline__ void fail(EpStatus* s) { atomicExch(&s->failed, 1); }

// Sets flag `which` (0 ready, 1 done) of this rank to a.value in every member's window,
// after this block's earlier writes (threads < kEpMaxRanks call it after a barrier); when
// this rank gives the exchange up, gave_up[which][me] := a.value first.
__device__ __forceinline__ void signal_members(const EpArgs& a, int which, bool abort = false) {
  const int r = threadIdx.x;
  if (!is_member(a.members, r)) return;
  // Not into the window of a member this step lost (it may have died with its memory).
  if (abort && ((a.status->missing >> r) & 1) != 0) return;
  __threadfence_system();
  EpWindow* w = a.peers[r].window;
  if (abort) w->gave_up[which][a.me] = a.value;  // Ordered before the flag by its release.
  store_release_sys(which == 0 ? &w->ready[a.me] : &w->done[a.me], a.value);
}

__global__ void __launch_bounds__(1024) ep_publish_kernel(EpArgs a, int num_pairs, int32_t* pos) {
  if (step_failed(a.status)) {  // An earlier exchange of the step failed here.
    signal_members(a, 0, /*abort=*/true);
    return;
  }
  __shared__ int cnt[kEpMaxRanks];
  __shared__ int bad;
  const int tid = threadIdx.x;
  if (tid < kEpMaxRanks) cnt[tid] = 0;
  if (tid == 0) bad = 0;
  __syncthreads();
  const int32_t* slot = a.peers[a.me].slot;
  // A pair's place among this rank's pairs to its owner: any order works, as long as the
  // owner puts the row where pos says (each GEMM row is computed alone).
  for (int p = tid; p < num_pairs; p += blockDim.x) {
    const int s = slot[p];
    const int o = s >= 0 ? s / a.slots_per_rank : -1;
    if (!is_member(a.members, o)) {
      bad = 1;
      continue;
    }
    pos[p] = atomicAdd(&cnt[o], 1);
  }
  __syncthreads();
  if (bad) {
    if (tid == 0) {
      a.status->overflow = -1;
      fail(a.status);
    }
    signal_members(a, 0, /*abort=*/true);  // The owners wait for this rank's rows.
    return;
  }
  EpWindow* w = a.peers[a.me].window;
  if (tid < kEpMaxRanks) w->cnt[tid] = cnt[tid];
  if (tid == 0) w->num_pairs = num_pairs;
  __syncthreads();
  signal_members(a, 0);
}

__global__ void ep_wait_kernel(EpArgs a, int which) {
  const int r = threadIdx.x;
  if (is_member(a.members, r) && !step_failed(a.status)) {
    const EpWindow* w = a.peers[a.me].window;
    const uint64_t* flag = which == 0 ? &w->ready[r] : &w->done[r];
    // Held by ep_wait's memory operations until f >= v (cyclic) where the device has them:
    // this loop then passes at once, or fails on a released flag.
    const int64_t start = global_ns();
    for (;;) {
      const uint64_t f = load_acquire_sys(flag);
      if ((f & ~kEpReleased) >= a.value) {
        // r gave this exchange up, or a later one of the step: a rank whose exchange
        // failed skips its waits and runs ahead through the step's later exchanges,
        // giving each up (a lower given-up value is an earlier step's).
        if (load_acquire_sys(&w->gave_up[which][r]) >= a.value) {
          atomicOr(reinterpret_cast<unsigned long long*>(&a.status->aborted), 1ull << r);
          fail(a.status);
        }
        break;
      }
      if ((f & kEpReleased) != 0) {  // The host gave r up (ep_release).
        atomicOr(reinterpret_cast<unsigned long long*>(&a.status->missing), 1ull << r);
        fail(a.status);
        break;
      }
      if (step_failed(a.status)) break;  // Another member's wait gave up.
      if (*a.abort != 0 || global_ns() - start > a.timeout_ns) {
        atomicOr(reinterpret_cast<unsigned long long*>(&a.status->missing), 1ull << r);
        fail(a.status);
        break;
      }
      __nanosleep(100);
    }
  }
  __syncthreads();
  if (r == 0 && !step_failed(a.status)) *a.progress = 2 * a.value + which;
}

constexpr int kGatherThreads = 256;
constexpr int kGatherInFlight = 8;

__global__ void __launch_bounds__(kGatherThreads)
    ep_gather_kernel(EpArgs a, int bound, char* rows, int32_t* local_slot, int32_t* num_rows) {
  __shared__ int first[kEpMaxRanks + 1];
  if (threadIdx.x == 0) {
    const bool failed = step_failed(a.status);
    int acc = 0;
    for (int src = 0; src < kEpMaxRanks; ++src) {
      first[src] = acc;
      if (!failed && is_member(a.members, src)) acc += load_peer(&a.peers[src].window->cnt[a.me]);
    }
    first[kEpMaxRanks] = failed ? -1 : acc;
  }
  __syncthreads();
  const int received = first[kEpMaxRanks];
  const bool ok = received >= 0 && received <= bound;
  const int total = ok ? received : 0;
  if (blockIdx.x == 0) {
    if (threadIdx.x < kEpMaxRanks)
      a.peers[a.me].window->res_first[threadIdx.x] = first[threadIdx.x];
    if (threadIdx.x == 0) {
      *num_rows = total;
      if (received > bound) {
        a.status->overflow = received;
        fail(a.status);
      }
    }
  }
  const int stride = gridDim.x * blockDim.x;
  for (int r = total + blockIdx.x * blockDim.x + threadIdx.x; r < bound; r += stride) {
    local_slot[r] = -1;  // Skipped by the permutation.
  }
  if (total == 0) return;
  const int num_warps = gridDim.x * (blockDim.x / 32);
  const int warp = blockIdx.x * (blockDim.x / 32) + threadIdx.x / 32, lane = threadIdx.x % 32;
  const int first_slot = a.me * a.slots_per_rank;
  const int row_vecs = a.hidden * (a.dtype == DType::kF32 ? 4 : 2) / 16;
  for (int src = 0; src < kEpMaxRanks; ++src) {
    if (!is_member(a.members, src)) continue;
    const EpPeer& peer = a.peers[src];
    const int np = load_peer(&peer.window->num_pairs);
    const int cnt = first[src + 1] - first[src];  // What src announced for this owner.
    for (int p = warp; p < np; p += num_warps) {
      const int s = load_peer(peer.slot + p);
      if (s < first_slot || s >= first_slot + a.slots_per_rank) continue;
      const int at = load_peer(peer.pos + p);
      if (at < 0 || at >= cnt) {
        // Inconsistent with its counts (a source past a failed wait already rewriting its
        // slots): never write outside this source's rows.
        if (lane == 0) fail(a.status);
        continue;
      }
      const int row = first[src] + at;
      if (lane == 0) local_slot[row] = s - first_slot;
      const uint4* from =
          static_cast<const uint4*>(peer.h) + static_cast<int64_t>(p / a.top_k) * row_vecs;
      uint4* to = reinterpret_cast<uint4*>(rows) + static_cast<int64_t>(row) * row_vecs;
      // kGatherInFlight loads per lane before their stores: a peer's row comes over NVLink,
      // where one 16-byte load at a time per lane left the copy latency-bound (H200 x2,
      // 4096 tokens at DeepSeek-V3 shapes: 261 -> 288-298 GB/s, ep_exchange_bench).
      for (int i = lane; i < row_vecs; i += 32 * kGatherInFlight) {
        uint4 v[kGatherInFlight];
#pragma unroll
        for (int j = 0; j < kGatherInFlight; ++j) {
          if (i + 32 * j < row_vecs) v[j] = __ldcg(from + i + 32 * j);
        }
#pragma unroll
        for (int j = 0; j < kGatherInFlight; ++j) {
          if (i + 32 * j < row_vecs) to[i + 32 * j] = v[j];
        }
      }
    }
  }
}

// Done, or (the exchange failed here) given up: the sources wait for it either way.
__global__ void ep_signal_done_kernel(EpArgs a) { signal_members(a, 1, step_failed(a.status)); }

// Sets (release) or clears (unrelease) kEpReleased in both flags of every rank in `ranks`,
// keeping the value a peer wrote.
__global__ void ep_release_kernel(EpWindow* w, uint64_t ranks, bool set) {
  const int r = threadIdx.x;
  if (((ranks >> r) & 1) == 0) return;
  using ull = unsigned long long;
  for (uint64_t* flag : {&w->ready[r], &w->done[r]}) {
    if (set) {
      atomicOr_system(reinterpret_cast<ull*>(flag), ull{kEpReleased});
    } else {
      atomicAnd_system(reinterpret_cast<ull*>(flag), ~ull{kEpReleased});
    }
  }
}

using BatchMemOpFn = CUresult (*)(CUstream, unsigned int, CUstreamBatchMemOpParams*, unsigned int);
using DeviceAttributeFn = CUresult (*)(int*, CUdevice_attribute, CUdevice);

// cuStreamBatchMemOp where the device takes 64-bit memory operations, else nullptr.
BatchMemOpFn batch_mem_op() {
  static const BatchMemOpFn fn = []() -> BatchMemOpFn {
    if (knobs().ep_kernel_waits) return nullptr;
    const auto attribute = driver_fn<DeviceAttributeFn>("cuDeviceGetAttribute");
    const auto batch = driver_fn<BatchMemOpFn>("cuStreamBatchMemOp");
    int device = 0, ok = 0;
    if (attribute == nullptr || batch == nullptr || cudaGetDevice(&device) != cudaSuccess ||
        attribute(&ok, CU_DEVICE_ATTRIBUTE_CAN_USE_64_BIT_STREAM_MEM_OPS, device) != CUDA_SUCCESS ||
        ok == 0) {
      return nullptr;
    }
    return batch;
  }();
  return fn;
}

CUdeviceptr flag_address(EpWindow* w, int which, int r) {
  return reinterpret_cast<CUdeviceptr>(which == 0 ? &w->ready[r] : &w->done[r]);
}

cudaError_t driver_error(CUresult r) { return r == CUDA_SUCCESS ? cudaSuccess : cudaErrorUnknown; }

__device__ __forceinline__ void load8_peer(const float* p, float (&v)[8]) {
  const float4 x = __ldcg(reinterpret_cast<const float4*>(p));
  const float4 y = __ldcg(reinterpret_cast<const float4*>(p + 4));
  v[0] = x.x, v[1] = x.y, v[2] = x.z, v[3] = x.w;
  v[4] = y.x, v[5] = y.y, v[6] = y.z, v[7] = y.w;
}
__device__ __forceinline__ void load8_peer(const bf16* p, float (&v)[8]) {
  const uint4 raw = __ldcg(reinterpret_cast<const uint4*>(p));
  bf16x8(raw, v);
}

constexpr int kCombineThreads = 256;

template <typename T>
__global__ void __launch_bounds__(kCombineThreads)
    ep_combine_kernel(EpArgs a, const float* weight, const int32_t* pos, int num_real, float* out) {
  __shared__ const T* row[kMaxTopK];
  __shared__ float w[kMaxTopK];
  const int t = blockIdx.x, H = a.hidden, K = a.top_k;
  float* o = out + static_cast<int64_t>(t) * H;
  if (t >= num_real || step_failed(a.status)) {
    for (int c = threadIdx.x; c < H; c += blockDim.x) o[c] = 0.f;
    return;
  }
  if (threadIdx.x < K) {
    const int p = t * K + threadIdx.x;
    const int owner = a.peers[a.me].slot[p] / a.slots_per_rank;
    const EpPeer& peer = a.peers[owner];
    const int r = load_peer(&peer.window->res_first[a.me]) + pos[p];
    row[threadIdx.x] =
        static_cast<const T*>(peer.y) + static_cast<int64_t>(load_peer(peer.row_of_pair + r)) * H;
    w[threadIdx.x] = weight[p];
  }
  __syncthreads();
  for (int c = threadIdx.x * 8; c < H; c += blockDim.x * 8) {
    float acc[8] = {0.f, 0.f, 0.f, 0.f, 0.f, 0.f, 0.f, 0.f};
    for (int k = 0; k < K; ++k) {
      float v[8];
      load8_peer(row[k] + c, v);
#pragma unroll
      for (int i = 0; i < 8; ++i) acc[i] += w[k] * v[i];
    }
#pragma unroll
    for (int i = 0; i < 8; ++i) o[c + i] = acc[i];
  }
}

}  // namespace

cudaError_t ep_publish(const EpArgs& a, int num_pairs, int32_t* pos, cudaStream_t stream) {
  ep_publish_kernel<<<1, 1024, 0, stream>>>(a, num_pairs, pos);
  return cudaGetLastError();
}

bool ep_stream_waits() { return batch_mem_op() != nullptr; }

cudaError_t ep_wait(const EpArgs& a, int which, cudaStream_t stream) {
  if (const BatchMemOpFn batch = batch_mem_op(); batch != nullptr && a.window != nullptr) {
    CUstreamBatchMemOpParams ops[kEpMaxRanks] = {};
    unsigned n = 0;
    for (int r = 0; r < kEpMaxRanks; ++r) {
      if (((a.members >> r) & 1) == 0) continue;
      CUstreamBatchMemOpParams& op = ops[n++];
      op.waitValue.operation = CU_STREAM_MEM_OP_WAIT_VALUE_64;
      op.waitValue.address = flag_address(a.window, which, r);
      op.waitValue.value64 = a.value;
      op.waitValue.flags = CU_STREAM_WAIT_VALUE_GEQ;
    }
    if (n > 0) {
      if (cudaError_t e = driver_error(batch(stream, n, ops, 0)); e != cudaSuccess) return e;
    }
  }
  ep_wait_kernel<<<1, kEpMaxRanks, 0, stream>>>(a, which);
  return cudaGetLastError();
}

cudaError_t ep_release(EpWindow* window, uint64_t ranks, cudaStream_t side) {
  if (ranks == 0) return cudaSuccess;
  ep_release_kernel<<<1, kEpMaxRanks, 0, side>>>(window, ranks, /*set=*/true);
  return cudaGetLastError();
}

cudaError_t ep_unrelease(EpWindow* window, cudaStream_t stream) {
  ep_release_kernel<<<1, kEpMaxRanks, 0, stream>>>(window, ~uint64_t{0}, /*set=*/false);
  return cudaGetLastError();
}

cudaError_t ep_gather(const EpArgs& a, int bound, void* rows, int32_t* local_slot,
                      int32_t* num_rows, cudaStream_t stream) {
  if (a.hidden % 8 != 0) return cudaErrorInvalidValue;  // 16-byte row pieces.
  // A warp per pair; about a block per 8 rows of the bound (padding slots too), <= 4 per SM.
  const int blocks = std::max(1, std::min((bound + 7) / 8, 528));
  ep_gather_kernel<<<blocks, kGatherThreads, 0, stream>>>(a, bound, static_cast<char*>(rows),
                                                          local_slot, num_rows);
  return cudaGetLastError();
}

cudaError_t ep_signal_done(const EpArgs& a, cudaStream_t stream) {
  ep_signal_done_kernel<<<1, kEpMaxRanks, 0, stream>>>(a);
  return cudaGetLastError();
}

cudaError_t ep_combine(const EpArgs& a, const float* weight, const int32_t* pos, int num_real,
                       int num_tokens, float* out, cudaStream_t stream) {
  if (num_tokens == 0) return cudaSuccess;
  if (a.top_k > kMaxTopK || a.hidden % 8 != 0) return cudaErrorInvalidValue;
  if (a.dtype == DType::kF32) {
    ep_combine_kernel<float>
        <<<num_tokens, kCombineThreads, 0, stream>>>(a, weight, pos, num_real, out);
  } else {
    ep_combine_kernel<bf16>
        <<<num_tokens, kCombineThreads, 0, stream>>>(a, weight, pos, num_real, out);
  }
  return cudaGetLastError();
}

}  // namespace flexpert::cuda
