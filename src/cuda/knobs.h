// SPDX-License-Identifier: Apache-2.0
// The CUDA path's environment switches, all of them, read once per process (the first
// call) except FLEXPERT_EP_EXCHANGE, which is read whenever a model is built so that one
// test process can run both exchanges.
//
// A switch is on when its variable is set to anything but "" or "0". Each one turns a
// fast path off so that a figure in docs/cuda.md or docs/benchmarks.md can be measured
// against the path it replaced, or lets a test reach a case the default never takes;
// none changes results beyond rounding. Tuning experiments that lost keep no switch:
// their figures and commits are listed under "Ideas that lost" in docs/benchmarks.md.
// Thread-safe (a function-local static).
#pragma once

namespace flexpert::cuda {

struct Knobs {
  // Comparisons (the path a docs/ figure was measured against).
  bool no_pdl = false;            // FLEXPERT_NO_PDL: plain launches, no programmatic serialisation.
  bool no_route_cluster = false;  // FLEXPERT_NO_ROUTE_CLUSTER: the decode router's ticket path.
  bool no_decode_moe = false;     // FLEXPERT_NO_DECODE_MOE: the unfused decode MoE kernels.
  bool no_shared_fusion = false;  // FLEXPERT_NO_SHARED_FUSION: shared experts after the MoE.
  bool no_norm_fusion = false;    // FLEXPERT_NO_NORM_FUSION: RMSNorm as its own kernel.
  bool no_swiglu_fusion = false;  // FLEXPERT_NO_SWIGLU_FUSION: SwiGLU as its own kernel.
  bool no_gemv = false;           // FLEXPERT_NO_GEMV: cuBLAS for every linear().
  bool no_head_gemv = false;      // FLEXPERT_NO_HEAD_GEMV: cuBLAS for MLA's per-head GEMMs.
  bool no_mla_mma = false;        // FLEXPERT_NO_MLA_MMA: MLA attention on the CUDA cores.
  bool no_gqa_attention = false;  // FLEXPERT_NO_GQA_ATTENTION: the per-head attention kernel.
  bool no_attention_tiles = false;  // FLEXPERT_NO_ATTENTION_TILES: a warp per row.
  // FLEXPERT_NO_FP8_WGMMA: FP8 experts' grouped GEMMs on the mma.sync tile instead of
  // FP8 wgmma (docs/cuda.md, "FP8 experts").
  bool no_fp8_wgmma = false;
  // FLEXPERT_FP8_WGMMA_ROWS=64|128: FP8 wgmma's tile rows at every size (fp8_wgmma_rows);
  // 0 (unset): by the rows per slot.
  int fp8_wgmma_rows = 0;
  // FLEXPERT_EP_KERNEL_WAITS: the device exchange's waits spin in a kernel instead of
  // holding the stream with memory operations (src/cuda/ep_exchange.h says why not).
  bool ep_kernel_waits = false;
  // Tests: FLEXPERT_GEMM_MAX_CTAS=N caps the persistent GEMM grid at N CTAs (several
  // units per CTA on a small problem); 0: the SM count.
  int gemm_max_ctas = 0;
  // FLEXPERT_STEP_LOG_MS=N (the worker's slow-step threshold, docs/deployment.md): an
  // expert-parallel step whose device time exceeds N ms logs where it went (CUDA events
  // around each exchange); -1 (unset): none.
  double step_log_ms = -1;
};

const Knobs& knobs();

// FLEXPERT_EP_EXCHANGE=host: expert-parallel rows through host shared memory instead of
// the device exchange (docs/cuda.md). Read at each call.
bool ep_exchange_host();

}  // namespace flexpert::cuda
