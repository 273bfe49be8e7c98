// SPDX-License-Identifier: Apache-2.0
// The decode MoE kernels (decode_moe.h).
#include <cooperative_groups.h>
#include <cuda_bf16.h>
#include <cuda_runtime.h>

#include <algorithm>
#include <array>
#include <atomic>
#include <cstdlib>

#include "cuda/decode_moe.h"
#include "cuda/device_util.cuh"
#include "cuda/grouped_topk.cuh"
#include "cuda/pdl.cuh"
#include "cuda/topk.cuh"

namespace flexpert::cuda {
namespace {

// ---- 1. Router GEMV, then top-k in one block once every logit is in, and replica choice.
// Launched as one cluster (E <= kRouteWarps * kRouteCluster * 2: EPW experts a warp), the
// blocks write their logits into rank 0's shared memory and meet at the cluster barrier;
// else each block stores its logits and the last to take a ticket runs the top-k (a
// fence, an atomic and a load from L2 more on the step's critical path).
constexpr int kRouteWarps = 8, kRouteChunks = 8, kRouteCluster = 8;
// The dynamic shared memory the route kernels may take (RouteLayout::bytes, at most: h
// of kGemvNormSmemBytes, tables of 4096 slots, 8 tokens' logits of 128 experts).
constexpr int kRouteSmemLimit = 96 * 1024;
static_assert(kRouteWarps * 32 == kRmsThreads, "a route block normalises h itself");

// The route kernel's shared memory (byte offsets, 16-aligned): h (T x H bf16, with
// norm_x; the grouped router's score rows, kRouteWarps x 2E f32, over it once h is read),
// the routing tables (num_slots 0: left in global memory) and the bias, and for cluster
// launches the logits (T x E f32, rank 0's receive them).
struct RouteLayout {
  int h = 0, start = 0, count = 0, slots = 0, bias = 0, logits = 0, bytes = 0;
  int num_slots = 0, bias_floats = 0;
};
RouteLayout route_layout(const DecodeMoeArgs& a, bool cluster) {
  const int E = a.topk.num_experts, T = a.num_tokens;
  RouteLayout l;
  int off = 0;
  auto take = [&off](int64_t bytes) {
    const int at = off;
    off += static_cast<int>((bytes + 15) / 16 * 16);
    return at;
  };
  const int64_t h_bytes = a.norm_x != nullptr ? int64_t{T} * a.hidden * 2 : 0;
  const int64_t score_bytes = a.use_grouped ? int64_t{kRouteWarps} * 2 * E * 4 : 0;
  l.h = take(std::max(h_bytes, score_bytes));
  // Tables of up to kRouteMaxTableSlots slots are copied (an EP group's global slot count
  // may be larger: those stay in global memory).
  constexpr int kRouteMaxTableSlots = 4096;
  if (a.num_slots > 0 && a.num_slots <= kRouteMaxTableSlots) {
    l.num_slots = a.num_slots;
    l.start = take(E * 4);
    l.count = take(E * 4);
    l.slots = take(int64_t{a.num_slots} * 4);
    if (a.use_grouped && a.grouped.bias != nullptr) {
      l.bias_floats = E;
      l.bias = take(E * 4);
    }
  }
  l.logits = take(cluster ? int64_t{T} * E * 4 : 0);
  l.bytes = off;
  return l;
}

template <int EPW, bool kCluster, int PER>
__global__ void __launch_bounds__(kRouteWarps * 32)
    decode_route_kernel(DecodeMoeArgs a, RouteLayout lay) {
  extern __shared__ __align__(16) unsigned char route_smem[];
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
  const int E = a.topk.num_experts, H = a.hidden, kc = H / 8, T = a.num_tokens;
  const int e0 = (blockIdx.x * kRouteWarps + warp) * EPW;
  // A block may write into another's shared memory only once that one has started:
  // arrive here, wait before the logits go to rank 0 (every block arrived long before).
  if constexpr (kCluster) asm volatile("barrier.cluster.arrive.relaxed.aligned;\n" ::: "memory");
  const bf16* router = static_cast<const bf16*>(a.router);
  const uint4* wrow[EPW];
#pragma unroll
  for (int j = 0; j < EPW; ++j) {
    wrow[j] = reinterpret_cast<const uint4*>(router + static_cast<int64_t>(min(e0 + j, E - 1)) * H);
  }
  // Constants before the wait: the routing tables (and the grouped router's bias) into
  // shared memory for the block that will run the top-k, the norm weights into L1.
  int32_t* s_start = reinterpret_cast<int32_t*>(route_smem + lay.start);
  int32_t* s_count = reinterpret_cast<int32_t*>(route_smem + lay.count);
  int32_t* s_slots = reinterpret_cast<int32_t*>(route_smem + lay.slots);
  float* s_bias = reinterpret_cast<float*>(route_smem + lay.bias);
  const bool tables = lay.num_slots > 0 && (!kCluster || blockIdx.x == 0);
  if (tables) {
    for (int i = threadIdx.x; i < E; i += blockDim.x) {
      s_start[i] = a.topk.rep_start[i];
      s_count[i] = a.topk.rep_count[i];
      if (lay.bias_floats > 0) s_bias[i] = a.grouped.bias[i];
    }
    for (int i = threadIdx.x; i < lay.num_slots; i += blockDim.x) s_slots[i] = a.topk.rep_slots[i];
  }
  if (a.norm_x != nullptr) block_rms_prefetch(a.norm_weight, H);
  const bf16* h = static_cast<const bf16*>(a.h);
  float acc[EPW][kDecodeMaxTokens];
#pragma unroll
  for (int j = 0; j < EPW; ++j) {
#pragma unroll
    for (int t = 0; t < kDecodeMaxTokens; ++t) acc[j][t] = 0.f;
  }
  for (int c0 = 0; c0 < kc; c0 += 32 * kRouteChunks) {
    uint4 w[EPW][kRouteChunks];
#pragma unroll
    for (int j = 0; j < EPW; ++j) {
#pragma unroll
      for (int u = 0; u < kRouteChunks; ++u) {
        const int c = c0 + u * 32 + lane;
        w[j][u] = c < kc ? ld_stream(wrow[j] + c) : make_uint4(0, 0, 0, 0);
      }
    }
    if (c0 == 0) {  // Router weights are constant: loaded before the wait for h.
      grid_dep_wait();
      grid_dep_launch();
      if (a.norm_x != nullptr) {  // h = rms_norm(norm_x), here; block 0 writes it out.
        bf16* hs = reinterpret_cast<bf16*>(route_smem + lay.h);
        for (int t = 0; t < T; ++t) {
          float4 v[kRmsVec];
          const float inv = block_inv_rms(a.norm_x + static_cast<int64_t>(t) * H, H, a.norm_eps, v);
          block_rms_store(v, inv, a.norm_weight, H, hs + t * H);
          if (blockIdx.x == 0) {
            block_rms_store(v, inv, a.norm_weight, H,
                            static_cast<bf16*>(a.norm_out) + static_cast<int64_t>(t) * H);
          }
        }
        __syncthreads();
        h = hs;
      }
    }
#pragma unroll
    for (int t = 0; t < kDecodeMaxTokens; ++t) {
      if (t >= T) break;
      // All of the pass's loads of token t first (clamped, unpredicated: one round trip).
      const uint4* hrow = reinterpret_cast<const uint4*>(h + static_cast<int64_t>(t) * H);
      uint4 xr[kRouteChunks];
#pragma unroll
      for (int u = 0; u < kRouteChunks; ++u) {
        const int c = min(c0 + u * 32 + lane, kc - 1);
        xr[u] = a.norm_x != nullptr ? hrow[c] : __ldg(hrow + c);  // Shared memory, or global.
      }
#pragma unroll
      for (int u = 0; u < kRouteChunks; ++u) {
        if (c0 + u * 32 + lane < kc) {
          float x[8];
          bf16x8(xr[u], x);
#pragma unroll
          for (int j = 0; j < EPW; ++j) {
            float f[8];
            bf16x8(w[j][u], f);
            acc[j][t] += dot8(f, x);
          }
        }
      }
    }
  }
  TopkArgs topk = a.topk;
  GroupedTopkArgs grouped = a.grouped;
  if (tables) {
    topk.rep_start = grouped.rep_start = s_start;
    topk.rep_count = grouped.rep_count = s_count;
    topk.rep_slots = grouped.rep_slots = s_slots;
    if (lay.bias_floats > 0) grouped.bias = s_bias;
  }
  // This block's logits go to rank 0's shared memory (cluster) or to global memory.
  float* logits_to = const_cast<float*>(a.topk.logits);  // This kernel's output.
  if constexpr (kCluster) {
    logits_to = cooperative_groups::this_cluster().map_shared_rank(
        reinterpret_cast<float*>(route_smem + lay.logits), 0);
    asm volatile("barrier.cluster.wait.aligned;\n" ::: "memory");  // Rank 0 has started.
  }
#pragma unroll
  for (int j = 0; j < EPW; ++j) {
#pragma unroll
    for (int t = 0; t < kDecodeMaxTokens; ++t) {
      if (t < T) {
        const float v = warp_sum(acc[j][t]);
        if (lane == 0 && e0 + j < E) logits_to[static_cast<int64_t>(t) * E + e0 + j] = v;
      }
    }
  }
  if constexpr (kCluster) {
    namespace cg = cooperative_groups;
    const cg::cluster_group cluster = cg::this_cluster();
    cluster.sync();  // Release / acquire: rank 0 sees every logit.
    if (cluster.block_rank() != 0) return;
    // The logits leave through global memory too (the unfused path's output).
    const float* logits = reinterpret_cast<const float*>(route_smem + lay.logits);
    float* out = const_cast<float*>(a.topk.logits);
    for (int i = threadIdx.x; i < T * E; i += blockDim.x) out[i] = logits[i];
    topk.logits = grouped.logits = logits;
  } else {
    // The last block to finish sees every logit (fence, then ticket).
    __shared__ int is_last;
    __threadfence();
    __syncthreads();
    if (threadIdx.x == 0) is_last = atomicAdd(a.ticket, 1) == static_cast<int>(gridDim.x) - 1;
    __syncthreads();
    if (!is_last) return;
    __threadfence();
    if (threadIdx.x == 0) *a.ticket = 0;  // Ready for the next launch (graph replay).
  }
  if (a.use_grouped) {  // Each warp's score and choice rows, over the normalised h's memory.
    float* scores = reinterpret_cast<float*>(route_smem + lay.h) + warp * 2 * E;
    __syncthreads();  // Every warp is done with h.
    for (int t = warp; t < T; t += kRouteWarps) grouped_topk_token(grouped, t, lane, scores);
  } else {
    // Logits in L2 (written by other blocks) or in this block's shared memory.
    for (int t = warp; t < T; t += kRouteWarps) topk_token<PER, !kCluster>(topk, t, lane);
  }
}

// ---- 2. Gate/up per pair: a warp per gate/up row pair (output column j), as kGemv.
constexpr int kGuWarps = 4, kGuChunks = 8;

__global__ void __launch_bounds__(kGuWarps * 32, 1) decode_gate_up_kernel(DecodeMoeArgs a) {
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
  const int p = blockIdx.y;
  const int j = blockIdx.x * kGuWarps + warp;
  const int I = a.inter, H = a.hidden, kc = H / 8, K = a.topk.top_k, T = a.num_tokens;
  grid_dep_wait();    // slot[] from the route kernel.
  grid_dep_launch();  // After the wait: the down kernel may read slot[] before its own.
  // The slot statistics, here rather than in the route kernel (off its critical path).
  if (a.slot_stats != nullptr && blockIdx.x == 0 && threadIdx.x == 0 && p < T * K) {
    const int valid = a.num_valid_tokens != nullptr ? min(*a.num_valid_tokens, T) : T;
    if (p < valid * K) {
      atomicAdd(reinterpret_cast<unsigned long long*>(a.slot_stats + a.topk.slot[p]), 1ull);
    }
  }
  if (j >= I) return;
  // Routed pair p < T K (slot rows interleaved by 8), else a shared-expert piece.
  int token, w_row0, w_row1;
  const bf16* W;
  bf16* out;
  if (p < T * K) {
    token = p / K;
    w_row0 = (j / 8) * 16 + j % 8;
    w_row1 = w_row0 + 8;
    W = static_cast<const bf16*>(a.weights) + a.topk.slot[p] * a.slot_stride;
    out = static_cast<bf16*>(a.act) + static_cast<int64_t>(p) * I + j;
  } else {
    const int S = a.shared_pieces, q = p - T * K;
    token = q / S;
    w_row0 = (q % S) * I + j;
    if (w_row0 >= a.shared_inter) return;
    w_row1 = a.shared_inter + w_row0;
    W = static_cast<const bf16*>(a.shared_gu);
    out = static_cast<bf16*>(a.shared_act) + static_cast<int64_t>(token) * a.shared_inter + w_row0;
  }
  const uint4* w0p = reinterpret_cast<const uint4*>(W + static_cast<int64_t>(w_row0) * H);
  const uint4* w1p = reinterpret_cast<const uint4*>(W + static_cast<int64_t>(w_row1) * H);
  const uint4* arow = reinterpret_cast<const uint4*>(static_cast<const bf16*>(a.h) +
                                                     static_cast<int64_t>(token) * H);
  float acc0 = 0.f, acc1 = 0.f;
  for (int c0 = 0; c0 < kc; c0 += 32 * kGuChunks) {
    uint4 w0[kGuChunks], w1[kGuChunks];
#pragma unroll
    for (int u = 0; u < kGuChunks; ++u) {
      const int c = c0 + u * 32 + lane;
      if (c < kc) {
        w0[u] = ld_stream(w0p + c);
        w1[u] = ld_stream(w1p + c);
      } else {
        w0[u] = w1[u] = make_uint4(0, 0, 0, 0);
      }
    }
#pragma unroll
    for (int u = 0; u < kGuChunks; ++u) {
      const int c = c0 + u * 32 + lane;
      if (c < kc) {
        float f0[8], f1[8], x[8];
        bf16x8(w0[u], f0);
        bf16x8(w1[u], f1);
        bf16x8(__ldg(arow + c), x);
        acc0 += dot8(f0, x);
        acc1 += dot8(f1, x);
      }
    }
  }
  acc0 = warp_sum(acc0);
  acc1 = warp_sum(acc1);
  if (lane == 0) *out = __float2bfloat16_rn(silu(acc0) * acc1);
}

// ---- 3. Down + weighted combine: block (8 output columns, token t), warp k = pair k.
constexpr int kDownCols = 8, kDownChunks = 3, kDownWarps = kDecodeDownWarps, kMaxTopk = 32;

__global__ void __launch_bounds__(kDownWarps * 32, 2) decode_down_combine_kernel(DecodeMoeArgs a) {
  __shared__ float part[kMaxTopk][kDownCols];
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
  const int t = blockIdx.y, col0 = blockIdx.x * kDownCols;
  const int K = a.topk.top_k, I = a.inter, H = a.hidden;
  const int S = a.shared_pieces;
  const bf16* down = static_cast<const bf16*>(a.weights) + 2 * static_cast<int64_t>(I) * H;
  const bf16* act = static_cast<const bf16*>(a.act);
  // The old values of `out` this block adds to, before the wait: `out` (the residual
  // stream) was last written two or more kernels back (the route kernel's predecessor or
  // before). In shared memory: no register held over the loop.
  __shared__ float prev[kDownCols];
  if (a.accumulate && threadIdx.x < kDownCols) {
    prev[threadIdx.x] = a.out[static_cast<int64_t>(t) * H + col0 + threadIdx.x];
  }
  bool waited = false;
  // Warp k: routed pair k < K (its slot's down rows), else shared piece k - K.
  for (int k = warp; k < K + S; k += kDownWarps) {
    const bf16* W;
    const uint4* arow;
    int row_len, kc;
    if (k < K) {
      const int p = t * K + k;
      // Final before this grid started (the gate/up kernel released it after its wait).
      const int slot = __ldcg(a.topk.slot + p);
      W = down + slot * a.slot_stride + static_cast<int64_t>(col0) * I;
      arow = reinterpret_cast<const uint4*>(act + static_cast<int64_t>(p) * I);
      row_len = I;
      kc = I / 8;
    } else {
      const int c_first = (k - K) * I;
      W = static_cast<const bf16*>(a.shared_down) + static_cast<int64_t>(col0) * a.shared_inter +
          c_first;
      arow = reinterpret_cast<const uint4*>(static_cast<const bf16*>(a.shared_act) +
                                            static_cast<int64_t>(t) * a.shared_inter + c_first);
      row_len = a.shared_inter;
      kc = min(I, a.shared_inter - c_first) / 8;
    }
    float acc[kDownCols];
#pragma unroll
    for (int r = 0; r < kDownCols; ++r) acc[r] = 0.f;
    for (int c0 = 0; c0 < kc; c0 += 32 * kDownChunks) {
      uint4 w[kDownCols][kDownChunks];
#pragma unroll
      for (int r = 0; r < kDownCols; ++r) {
        const uint4* wr = reinterpret_cast<const uint4*>(W + static_cast<int64_t>(r) * row_len);
#pragma unroll
        for (int u = 0; u < kDownChunks; ++u) {
          const int c = c0 + u * 32 + lane;
          w[r][u] = c < kc ? ld_stream(wr + c) : make_uint4(0, 0, 0, 0);
        }
      }
      if (!waited) {  // act[] comes from the gate/up kernel.
        grid_dep_wait();
        grid_dep_launch();
        waited = true;
      }
#pragma unroll
      for (int u = 0; u < kDownChunks; ++u) {
        const int c = c0 + u * 32 + lane;
        if (c < kc) {
          float x[8];
          // Loaded where used: hoisting them together spilled more (H200: 7.3 vs 6.9 us).
          bf16x8(__ldg(arow + c), x);
#pragma unroll
          for (int r = 0; r < kDownCols; ++r) {
            float f[8];
            bf16x8(w[r][u], f);
            acc[r] += dot8(f, x);
          }
        }
      }
    }
#pragma unroll
    for (int r = 0; r < kDownCols; ++r) {
      const float v = warp_sum(acc[r]);
      // Routed: rounded as the unfused path's y rows; shared: f32, as the GEMV's sums.
      if (lane == 0) part[k][r] = k < K ? __bfloat162float(__float2bfloat16_rn(v)) : v;
    }
  }
  if (!waited) {
    grid_dep_wait();
    grid_dep_launch();
  }
  __syncthreads();
  if (threadIdx.x < kDownCols) {
    float o = 0.f;
    for (int k = 0; k < K; ++k) o += a.topk.weight[t * K + k] * part[k][threadIdx.x];
    for (int k = K; k < K + S; ++k) o += part[k][threadIdx.x];
    a.out[static_cast<int64_t>(t) * H + col0 + threadIdx.x] =
        a.accumulate ? prev[threadIdx.x] + o : o;
  }
}

}  // namespace

bool decode_moe_supported(int num_tokens, int hidden, int inter, int num_experts, int top_k,
                          int shared_inter) {
  return num_tokens >= 1 && num_tokens <= kDecodeMaxTokens && hidden > 0 && hidden % 8 == 0 &&
         inter > 0 && inter % 8 == 0 && top_k >= 1 && top_k <= num_experts && top_k <= kMaxTopk &&
         num_experts <= 32 * kTopkMaxPerLane && shared_inter >= 0 && shared_inter % 8 == 0 &&
         (shared_inter == 0 || top_k + shared_pieces(shared_inter, inter) <= kDownWarps);
}

namespace {

bool args_supported(const DecodeMoeArgs& a) {
  return decode_moe_supported(a.num_tokens, a.hidden, a.inter, a.topk.num_experts, a.topk.top_k,
                              a.shared_inter) &&
         a.shared_pieces == shared_pieces(a.shared_inter, a.inter) &&
         (a.shared_inter == 0 ||
          (a.shared_gu != nullptr && a.shared_down != nullptr && a.shared_act != nullptr));
}

}  // namespace

bool decode_route_norm_fits(int num_tokens, int hidden) {
  return rms_vec_fits(hidden) &&
         static_cast<int64_t>(num_tokens) * hidden * static_cast<int64_t>(sizeof(bf16)) <=
             kGemvNormSmemBytes;
}

namespace {

// Whether this device runs the route kernel's clusters (8 blocks of the larger variant
// with all the shared memory it may take), asked once per device.
bool route_clusters_ok() {
  static std::array<std::atomic<int>, 64> state{};  // 0 not asked, 1 yes, 2 no.
  int device = 0;
  if (cudaGetDevice(&device) != cudaSuccess) {
    (void)cudaGetLastError();
    return false;
  }
  std::atomic<int>& known = state[static_cast<size_t>(device) & 63];
  int v = known.load(std::memory_order_acquire);
  if (v == 0) {
    constexpr auto kernel = decode_route_kernel<2, true, 4>;
    cudaLaunchConfig_t cfg{};
    cfg.gridDim = dim3(kRouteCluster);
    cfg.blockDim = dim3(kRouteWarps * 32);
    cfg.dynamicSmemBytes = kRouteSmemLimit;
    cudaLaunchAttribute attr{};
    attr.id = cudaLaunchAttributeClusterDimension;
    attr.val.clusterDim.x = kRouteCluster;
    attr.val.clusterDim.y = 1;
    attr.val.clusterDim.z = 1;
    cfg.attrs = &attr;
    cfg.numAttrs = 1;
    int clusters = 0;
    const bool ok = ensure_smem_limit<kernel>(kRouteSmemLimit) == cudaSuccess &&
                    cudaOccupancyMaxActiveClusters(&clusters, kernel, &cfg) == cudaSuccess &&
                    clusters > 0;
    if (!ok) (void)cudaGetLastError();
    v = ok ? 1 : 2;
    known.store(v, std::memory_order_release);
  }
  return v == 1;
}

}  // namespace

int decode_route_cluster_blocks(int num_experts) {
  // FLEXPERT_NO_ROUTE_CLUSTER=1: the ticket instead (comparisons, cuda/knobs.h).
  if (knobs().no_route_cluster || num_experts < 1 ||
      num_experts > 2 * kRouteWarps * kRouteCluster || !route_clusters_ok()) {
    return 0;
  }
  // A power of two of blocks, one expert a warp where that takes at most kRouteCluster
  // blocks, else two (the surplus warps store nothing).
  const int per_block = num_experts <= kRouteWarps * kRouteCluster ? kRouteWarps : 2 * kRouteWarps;
  int blocks = 1;
  while (blocks * per_block < num_experts) blocks *= 2;
  return blocks;
}

cudaError_t decode_route(const DecodeMoeArgs& a, cudaStream_t stream) {
  if (!args_supported(a)) return cudaErrorInvalidValue;
  if (a.norm_x != nullptr && !decode_route_norm_fits(a.num_tokens, a.hidden)) {
    return cudaErrorInvalidValue;
  }
  if (a.use_grouped) {
    // The grouped router writes the arrays the next two kernels read (topk's).
    const GroupedTopkArgs& g = a.grouped;
    if (!grouped_topk_args_ok(g) || g.num_tokens != a.num_tokens ||
        g.num_experts != a.topk.num_experts || g.top_k != a.topk.top_k ||
        g.logits != a.topk.logits || g.expert != a.topk.expert || g.weight != a.topk.weight ||
        g.slot != a.topk.slot) {
      return cudaErrorInvalidValue;
    }
  }
  const int E = a.topk.num_experts;
  if (const int blocks = decode_route_cluster_blocks(E); blocks > 0) {
    static_assert(4 * 32 >= 2 * kRouteWarps * kRouteCluster, "PER 4 covers the cluster's experts");
    const RouteLayout lay = route_layout(a, true);
    if (lay.bytes > kRouteSmemLimit) return cudaErrorInvalidValue;
    const bool one = blocks * kRouteWarps >= E;  // One expert a warp, else two.
    const cudaError_t lim =
        one ? ensure_smem_limit<decode_route_kernel<1, true, 4>>(kRouteSmemLimit)
            : ensure_smem_limit<decode_route_kernel<2, true, 4>>(kRouteSmemLimit);
    if (lim != cudaSuccess) return lim;
    const dim3 grid(blocks), block(kRouteWarps * 32);
    return one ? launch_pdl_cluster(decode_route_kernel<1, true, 4>, grid, block, lay.bytes, stream,
                                    blocks, a, lay)
               : launch_pdl_cluster(decode_route_kernel<2, true, 4>, grid, block, lay.bytes, stream,
                                    blocks, a, lay);
  }
  const RouteLayout lay = route_layout(a, false);
  if (lay.bytes > kRouteSmemLimit) return cudaErrorInvalidValue;
  const unsigned blocks = static_cast<unsigned>((E + kRouteWarps - 1) / kRouteWarps);
  if (const cudaError_t lim =
          ensure_smem_limit<decode_route_kernel<1, false, kTopkMaxPerLane>>(kRouteSmemLimit);
      lim != cudaSuccess) {
    return lim;
  }
  return launch_pdl(decode_route_kernel<1, false, kTopkMaxPerLane>, dim3(blocks),
                    dim3(kRouteWarps * 32), lay.bytes, stream, a, lay);
}

cudaError_t decode_gate_up(const DecodeMoeArgs& a, cudaStream_t stream) {
  if (!args_supported(a)) return cudaErrorInvalidValue;
  const dim3 grid((a.inter + kGuWarps - 1) / kGuWarps,
                  a.num_tokens * (a.topk.top_k + a.shared_pieces));
  return launch_pdl(decode_gate_up_kernel, grid, dim3(kGuWarps * 32), 0, stream, a);
}

cudaError_t decode_down_combine(const DecodeMoeArgs& a, cudaStream_t stream) {
  if (!args_supported(a)) return cudaErrorInvalidValue;
  const dim3 grid(a.hidden / kDownCols, a.num_tokens);
  return launch_pdl(decode_down_combine_kernel, grid, dim3(kDownWarps * 32), 0, stream, a);
}

}  // namespace flexpert::cuda
