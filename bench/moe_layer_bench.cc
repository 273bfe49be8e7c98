// SPDX-License-Identifier: Apache-2.0
// moe_layer_bench: one MoE layer (router, top-k, permutation, grouped SwiGLU expert
// GEMMs, weighted combine) on one GPU at real model shapes, against its roofline
// floor: max(bytes of weights touched + activations / measured HBM bandwidth,
// FLOPs / measured bf16 GEMM rate). Both ceilings are measured here: a device copy
// kernel (bytes read + written) and an 8192^3 cuBLAS bf16 GEMM.
//
//   moe_layer_bench [--shapes qwen3-30b-a3b,deepseek-v3] [--tokens 1,4,16,...]
//                   [--json out.json] [--torch torch.json] [--sweep] [--profile]
//                   [--tiles wgmma64,ws128,...] [--dense] [--fp8-paths decode,tile,wgmma]
//
// Each configuration is timed as a CUDA graph of 4 layer calls on 4 different
// inputs (so decode-sized calls touch different experts and do not run from L2),
// replayed for ~0.15 s (median of 3); the time per call is reported. With --torch,
// the PyTorch reference's times (bench/moe_layer_torch.py, or this bench's earlier
// --json) are joined in; --sweep also times every GEMM tile (or those named by
// --tiles), --profile every kernel of the layer alone (with --sweep also each swept
// tile's two GEMMs alone; the decode path's three kernels where run_moe takes it:
// tile "decode"). --dense times cuBLAS on the layer's expert FLOPs as two dense GEMMs
// (all tokens x top_k rows against one weight matrix per projection, no routing) where
// the GEMMs are compute-bound: what the GPU's own library reaches on that work, under
// the same sustained timing, and on FP8 GPUs cuBLASLt's e4m3 GEMMs alike (per-tensor
// scales), the FP8 layer's yardstick. Beside each bf16 figure, the same layer over FP8
// experts (e4m3 with 128 x 128 block scales, fp8_experts.h: FP8 wgmma at every size, its
// floor at twice the bf16 rate (Hopper's e4m3 peak), or where it does not run the decode
// kernels up to 8 tokens and the mma.sync tile above), on GPUs of compute
// capability 8.9 or newer; --fp8-paths also times the named paths, forced, at every size.
#include <cublasLt.h>

#include <algorithm>
#include <cstdio>
#include <cstdlib>
#include <fstream>
#include <functional>
#include <map>
#include <nlohmann/json.hpp>
#include <set>
#include <sstream>
#include <string>
#include <vector>

#include "cuda/blas.h"
#include "cuda/decode_moe.h"
#include "cuda/device.h"
#include "cuda/fp8_experts.h"
#include "cuda/kernels.h"
#include "cuda/knobs.h"
#include "cuda/moe_layer.h"
#include "cuda_bench.h"

namespace flexpert::cuda {
namespace {

struct Shape {
  std::string name;
  int hidden, inter, experts, top_k;
};

// D[P, n] (bf16) = X[P, k] W[n, k]^T in e4m3 with per-tensor scales 1 through cuBLASLt
// (its FP8 layout: A = W transposed, B = X, column-major), timed by `time`; -1 with the
// reason printed when cuBLASLt refuses it (the benchmark goes on).
double cublaslt_fp8_us(cublasLtHandle_t lt, const void* x, const void* w, void* y, int64_t P,
                       int64_t n, int64_t k, void* workspace, size_t workspace_bytes,
                       cudaStream_t stream,
                       const std::function<double(const std::function<void(int)>&)>& time) {
  cublasLtMatmulDesc_t desc = nullptr;
  cublasLtMatrixLayout_t a = nullptr, b = nullptr, d = nullptr;
  cublasLtMatmulPreference_t pref = nullptr;
  cublasLtMatmulHeuristicResult_t heuristic{};
  int found = 0;
  const cublasOperation_t ta = CUBLAS_OP_T, tb = CUBLAS_OP_N;
  const float alpha = 1.f, beta = 0.f;
  const char* step = "";
  auto run = [&] {
    return cublasLtMatmul(lt, desc, &alpha, w, a, x, b, &beta, y, d, y, d, &heuristic.algo,
                          workspace, workspace_bytes, stream);
  };
  cublasStatus_t st = CUBLAS_STATUS_SUCCESS;
  auto ok = [&](cublasStatus_t r, const char* what) {
    st = r;
    step = what;
    return r == CUBLAS_STATUS_SUCCESS;
  };
  double us = -1;
  if (ok(cublasLtMatmulDescCreate(&desc, CUBLAS_COMPUTE_32F, CUDA_R_32F), "descriptor") &&
      ok(cublasLtMatmulDescSetAttribute(desc, CUBLASLT_MATMUL_DESC_TRANSA, &ta, sizeof(ta)),
         "transa") &&
      ok(cublasLtMatmulDescSetAttribute(desc, CUBLASLT_MATMUL_DESC_TRANSB, &tb, sizeof(tb)),
         "transb") &&
      ok(cublasLtMatrixLayoutCreate(&a, CUDA_R_8F_E4M3, k, n, k), "layout A") &&
      ok(cublasLtMatrixLayoutCreate(&b, CUDA_R_8F_E4M3, k, P, k), "layout B") &&
      ok(cublasLtMatrixLayoutCreate(&d, CUDA_R_16BF, n, P, n), "layout D") &&
      ok(cublasLtMatmulPreferenceCreate(&pref), "preference") &&
      ok(cublasLtMatmulPreferenceSetAttribute(pref, CUBLASLT_MATMUL_PREF_MAX_WORKSPACE_BYTES,
                                              &workspace_bytes, sizeof(workspace_bytes)),
         "workspace") &&
      ok(cublasLtMatmulAlgoGetHeuristic(lt, desc, a, b, d, d, pref, 1, &heuristic, &found),
         "heuristic") &&
      found > 0 && ok(run(), "matmul")) {
    us = time([&](int) {
      if (run() != CUBLAS_STATUS_SUCCESS) std::exit(1);
    });
  } else {
    std::printf(
        "    cuBLASLt FP8 %s: %s\n", step,
        found == 0 && st == CUBLAS_STATUS_SUCCESS ? "no algorithm" : cublasLtGetStatusString(st));
  }
  if (pref != nullptr) cublasLtMatmulPreferenceDestroy(pref);
  if (d != nullptr) cublasLtMatrixLayoutDestroy(d);
  if (b != nullptr) cublasLtMatrixLayoutDestroy(b);
  if (a != nullptr) cublasLtMatrixLayoutDestroy(a);
  if (desc != nullptr) cublasLtMatmulDescDestroy(desc);
  return us;
}

const char* fp8_path_name(Fp8Path p) {
  return p == Fp8Path::kDecode ? "decode" : p == Fp8Path::kTile ? "tile" : "wgmma";
}

const Shape kShapes[] = {{"qwen3-30b-a3b", 2048, 768, 128, 8}, {"deepseek-v3", 7168, 2048, 256, 8}};
constexpr int kInputs = 4;

// bf16 FLOP/s of an 8192^3 cuBLAS GEMM: with sustain_ms = 0 the median of 10 calls right
// after 3 (a burst: ~15 ms, before the GPU's power limit has lowered its clock); else as
// the layers are timed: a graph of 4 calls replayed for ~sustain_ms after ~sustain_ms of
// the same, median of 3 windows.
double measure_bf16_rate(cudaStream_t stream, Blas& blas, double sustain_ms = 0) {
  const int64_t n = 8192;
  const size_t elems = static_cast<size_t>(n) * n;
  DeviceBuffer a = take(DeviceBuffer::create(elems * 2), "alloc");
  DeviceBuffer b = take(DeviceBuffer::create(elems * 2), "alloc");
  DeviceBuffer c = take(DeviceBuffer::create(elems * 2), "alloc");
  BENCH_CHECK(cuda_status(fill_uniform(DType::kBF16, a.data(), elems, 2, 1.f, stream), "fill"));
  BENCH_CHECK(cuda_status(fill_uniform(DType::kBF16, b.data(), elems, 3, 1.f, stream), "fill"));
  auto run = [&] {
    BENCH_CHECK(blas.gemm_nt(DType::kBF16, a.data(), n, n, b.data(), n, DType::kBF16, c.data()));
  };
  for (int i = 0; i < 3; ++i) run();
  if (sustain_ms <= 0) {
    const double ms = median_ms(stream, 10, run);
    return 2.0 * n * n * n / (ms * 1e-3);
  }
  constexpr int kCalls = 4;
  BENCH_CHECK(GraphExec::begin_capture(stream));
  for (int i = 0; i < kCalls; ++i) run();
  GraphExec graph = take(GraphExec::end_capture(stream), "capture");
  const double one_ms = median_ms(stream, 3, [&] { BENCH_CHECK(graph.launch(stream)); });
  const int reps = std::clamp(static_cast<int>(sustain_ms / std::max(one_ms, 1e-3)), 1, 2000);
  auto window = [&] {
    for (int r = 0; r < reps; ++r) BENCH_CHECK(graph.launch(stream));
  };
  median_ms(stream, 1, window);
  const double ms = median_ms(stream, 3, window);
  return 2.0 * n * n * n * kCalls * reps / (ms * 1e-3);
}

struct Row {
  std::string shape;
  int tokens = 0;
  double us = 0, floor_us = 0, bytes = 0, flops = 0, experts_touched = 0;
  std::string tile;
  std::map<std::string, double> sweep;       // Tile -> us.
  std::map<std::string, double> stages;      // Kernel -> us (one call of that kernel alone).
  double unfused_us = 0;                     // Decode path: the unfused kGemv path, same run.
  double fp8_us = 0, fp8_floor_us = 0;       // The layer over FP8 experts (0: not run).
  std::string fp8_path;                      // "decode", "tile" or "wgmma".
  std::map<std::string, double> fp8_forced;  // --fp8-paths: path -> us.
  // --dense: "cublas:gate_up", "ws128:down", "ws128_gathered:gate_up", "even:gate_up", ...
  // -> us (cuBLAS or ws128 on the same FLOPs as dense GEMMs; ws128 on the layer's weights
  // with even rows per expert).
  std::map<std::string, double> dense;
};

std::vector<Row> bench_shape(const Shape& sh, const std::vector<int>& token_counts, double bw,
                             double rate, bool sweep, bool profile, bool dense,
                             const std::vector<std::string>& fp8_paths,
                             const std::set<std::string>& sweep_tiles, cudaStream_t stream,
                             Blas& blas) {
  MoeDims dims;
  dims.dtype = DType::kBF16;
  dims.hidden = sh.hidden;
  dims.intermediate = sh.inter;
  dims.num_experts = sh.experts;
  dims.top_k = sh.top_k;
  dims.num_slots = sh.experts;
  dims.norm_topk_prob = true;
  const int max_t = *std::max_element(token_counts.begin(), token_counts.end());
  const size_t H = sh.hidden;
  DeviceBuffer router = take(DeviceBuffer::create(sh.experts * H * 2), "router");
  DeviceBuffer slots = take(DeviceBuffer::create(sh.experts * dims.slot_elems() * 2), "slots");
  BENCH_CHECK(cuda_status(
      fill_uniform(DType::kBF16, router.data(), sh.experts * H, 11, 0.05f, stream), "fill"));
  BENCH_CHECK(cuda_status(
      fill_uniform(DType::kBF16, slots.data(), sh.experts * dims.slot_elems(), 12, 0.02f, stream),
      "fill"));
  std::vector<int32_t> map(sh.experts);
  for (int e = 0; e < sh.experts; ++e) map[e] = e;
  const RoutingTables tables = build_routing_tables(map, sh.experts);
  auto upload = [&](const std::vector<int32_t>& v) {
    DeviceBuffer b = take(DeviceBuffer::create(v.size() * 4), "table");
    BENCH_CHECK(cuda_status(cudaMemcpy(b.data(), v.data(), v.size() * 4, cudaMemcpyHostToDevice),
                            "upload"));
    return b;
  };
  DeviceBuffer rep_start = upload(tables.rep_start), rep_count = upload(tables.rep_count),
               rep_slots = upload(tables.rep_slots);
  MoeLayerWeights w;
  w.router = router.data();
  w.slots = slots.data();
  w.rep_start = rep_start.as<int32_t>();
  w.rep_count = rep_count.as<int32_t>();
  w.rep_slots = rep_slots.as<int32_t>();
  std::vector<DeviceBuffer> inputs;
  for (int i = 0; i < kInputs; ++i) {
    inputs.push_back(take(DeviceBuffer::create(max_t * H * 2), "input"));
    BENCH_CHECK(cuda_status(
        fill_uniform(DType::kBF16, inputs.back().data(), max_t * H, 100 + i, 1.f, stream), "fill"));
  }
  DeviceBuffer out = take(DeviceBuffer::create(max_t * H * 4), "out");
  MoeScratch scratch = take(MoeScratch::create(dims, max_t), "scratch");

  // FP8 experts: one random expert (codes of |x| <= 1, scales 0.02 / 448 .. 0.02) packed
  // once and copied into every slot.
  MoeDims dims8 = dims;
  dims8.fp8 = true;
  int device = 0;
  BENCH_CHECK(cuda_status(cudaGetDevice(&device), "device"));
  const bool fp8 = fp8_device_supported(device);
  DeviceBuffer slots8;
  MoeScratch scratch8;
  if (fp8) {
    const size_t slot_bytes = static_cast<size_t>(dims8.slot_bytes());
    const Fp8SlotLayout l = fp8_slot_layout(sh.hidden, sh.inter);
    std::vector<uint8_t> codes(3 * H * sh.inter);
    uint32_t x = 12345;
    for (uint8_t& c : codes) {
      x = x * 1664525u + 1013904223u;
      c = static_cast<uint8_t>((x >> 24) % 0x38) | static_cast<uint8_t>(x & 0x80);  // |v| < 1
    }
    std::vector<float> scales(
        static_cast<size_t>(2 * l.gate_up_scale_rows() * l.gate_up_scale_cols() +
                            l.down_scale_rows() * l.down_scale_cols()));
    for (size_t i = 0; i < scales.size(); ++i) scales[i] = 0.02f * (1 + i % 7) / 7;
    const size_t gu = static_cast<size_t>(l.gate_up_scale_rows() * l.gate_up_scale_cols());
    const size_t IH = static_cast<size_t>(sh.inter) * H;
    std::vector<uint8_t> image(slot_bytes);
    pack_expert_fp8(Fp8Expert{codes.data(), codes.data() + IH, codes.data() + 2 * IH, scales.data(),
                              scales.data() + gu, scales.data() + 2 * gu},
                    sh.hidden, sh.inter, image.data());
    slots8 = take(DeviceBuffer::create(sh.experts * slot_bytes), "fp8 slots");
    for (int e = 0; e < sh.experts; ++e) {
      BENCH_CHECK(cuda_status(cudaMemcpy(static_cast<uint8_t*>(slots8.data()) + e * slot_bytes,
                                         image.data(), slot_bytes, cudaMemcpyHostToDevice),
                              "upload"));
    }
    scratch8 = take(MoeScratch::create(dims8, max_t), "fp8 scratch");
  }
  MoeLayerWeights w8 = w;
  w8.slots = slots8.data();

  // Microseconds per call of fn(input i, ...), as a graph of kInputs calls replayed for
  // ~target_ms (median of 3).
  auto time_calls = [&](const std::function<void(int)>& fn, double target_ms) {
    for (int i = 0; i < kInputs; ++i) fn(i);  // Eager first: attributes, cuBLAS set-up.
    BENCH_CHECK(GraphExec::begin_capture(stream));
    for (int i = 0; i < kInputs; ++i) fn(i);
    GraphExec graph = take(GraphExec::end_capture(stream), "capture");
    BENCH_CHECK(graph.launch(stream));
    const double one_ms = median_ms(stream, 3, [&] { BENCH_CHECK(graph.launch(stream)); });
    const int reps = std::clamp(static_cast<int>(target_ms / std::max(one_ms, 1e-3)), 1, 2000);
    const double ms = median_ms(stream, 3, [&] {
      for (int r = 0; r < reps; ++r) BENCH_CHECK(graph.launch(stream));
    });
    return 1e3 * ms / (reps * kInputs);
  };

  std::vector<Row> rows;
  for (int T : token_counts) {
    Row row;
    row.shape = sh.name;
    row.tokens = T;
    const GemmTile tile = choose_tile(dims.dtype, static_cast<int64_t>(T) * sh.top_k, sh.experts,
                                      sh.hidden, sh.inter);
    const bool decode = uses_decode_path(dims, T);
    row.tile = decode ? "decode" : tile_name(tile);
    auto layer = [&](int i, int force_tile, unsigned stages) {
      BENCH_CHECK(run_moe(dims, w, scratch, inputs[i].data(), T, nullptr, out.as<float>(), false,
                          blas, stream, force_tile, stages));
    };
    // Count the experts each input touches.
    double touched = 0;
    for (int i = 0; i < kInputs; ++i) {
      layer(i, -1, kMoeAllStages);
      std::vector<int32_t> experts;
      BENCH_CHECK(read_routing(scratch, T * sh.top_k, stream, &experts, nullptr));
      touched += static_cast<double>(std::set<int32_t>(experts.begin(), experts.end()).size());
    }
    row.experts_touched = touched / kInputs;
    row.us = time_calls([&](int i) { layer(i, -1, kMoeAllStages); }, 150.0);
    const double expert_bytes = 3.0 * sh.hidden * sh.inter * 2;
    row.bytes = row.experts_touched * expert_bytes + sh.experts * static_cast<double>(H) * 2 +
                T * static_cast<double>(H) * (2 + 4);
    row.flops = 2.0 * T * sh.top_k * 3.0 * sh.hidden * sh.inter + 2.0 * T * sh.experts * sh.hidden;
    row.floor_us = 1e6 * std::max(row.bytes / bw, row.flops / rate);
    std::printf("  %-14s %6d tokens: %10.1f us (floor %9.1f us, %5.1f%%) tile %s\n",
                sh.name.c_str(), T, row.us, row.floor_us, 100.0 * row.floor_us / row.us,
                row.tile.c_str());
    if (fp8) {
      row.fp8_us = time_calls(
          [&](int i) {
            BENCH_CHECK(run_moe(dims8, w8, scratch8, inputs[i].data(), T, nullptr, out.as<float>(),
                                false, blas, stream));
          },
          150.0);
      const Fp8Path path = cuda::fp8_path(dims8, T, true);
      const bool wgmma = path == Fp8Path::kWgmma;
      row.fp8_path = fp8_path_name(path);
      // The same floor with 1-byte weights and their scales; FP8 wgmma at twice the rate.
      const double fp8_bytes =
          row.bytes - row.experts_touched * (expert_bytes - dims8.slot_bytes());
      row.fp8_floor_us = 1e6 * std::max(fp8_bytes / bw, row.flops / (wgmma ? 2 * rate : rate));
      std::printf("    fp8 experts (%s): %.1f us (floor %.1f us, %.1f%%), %.2fx bf16\n",
                  row.fp8_path.c_str(), row.fp8_us, row.fp8_floor_us,
                  100.0 * row.fp8_floor_us / row.fp8_us, row.us / row.fp8_us);
      for (const std::string& name : fp8_paths) {
        const Fp8Path p = name == "decode" ? Fp8Path::kDecode
                          : name == "tile" ? Fp8Path::kTile
                                           : Fp8Path::kWgmma;
        if (p == Fp8Path::kWgmma && !fp8_wgmma_runs(dims8)) continue;
        if (p == Fp8Path::kDecode && T > 256) continue;  // A block per pair and column group.
        const int force = p == Fp8Path::kDecode ? static_cast<int>(GemmTile::kGemv)
                          : p == Fp8Path::kTile ? static_cast<int>(GemmTile::kMma64)
                                                : static_cast<int>(GemmTile::kWgmmaWs64);
        const double us = time_calls(
            [&](int i) {
              BENCH_CHECK(run_moe(dims8, w8, scratch8, inputs[i].data(), T, nullptr,
                                  out.as<float>(), false, blas, stream, force));
            },
            150.0);
        row.fp8_forced[name] = us;
        std::printf("    fp8 experts, %s forced: %.1f us, %.2fx bf16\n", name.c_str(), us,
                    row.us / us);
      }
    }
    if (decode) {
      row.unfused_us = time_calls(
          [&](int i) { layer(i, static_cast<int>(GemmTile::kGemv), kMoeAllStages); }, 150.0);
      std::printf("    unfused path (router GEMM, top-k/permute, gemv tiles, combine): %.1f us\n",
                  row.unfused_us);
    }
    if (dense && row.flops / rate > row.bytes / bw) {
      // x [P, H] @ w_gate_up[2I, H]^T, then [P, I] @ w_down[H, I]^T; P = T * top_k rows.
      const int64_t P = static_cast<int64_t>(T) * sh.top_k, I = sh.inter;
      DeviceBuffer x = take(DeviceBuffer::create(P * H * 2), "dense x");
      DeviceBuffer w1 = take(DeviceBuffer::create(2 * I * H * 2), "dense w1");
      DeviceBuffer w2 = take(DeviceBuffer::create(H * I * 2), "dense w2");
      DeviceBuffer y1 = take(DeviceBuffer::create(P * 2 * I * 2), "dense y1");
      DeviceBuffer y2 = take(DeviceBuffer::create(P * H * 2), "dense y2");
      BENCH_CHECK(
          cuda_status(fill_uniform(DType::kBF16, x.data(), P * H, 21, 1.f, stream), "fill"));
      BENCH_CHECK(
          cuda_status(fill_uniform(DType::kBF16, w1.data(), 2 * I * H, 22, 0.02f, stream), "fill"));
      BENCH_CHECK(
          cuda_status(fill_uniform(DType::kBF16, w2.data(), H * I, 23, 0.02f, stream), "fill"));
      auto cublas = [&](const void* w, int64_t n, int64_t k, void* y) {
        return time_calls(
            [&](int) {
              BENCH_CHECK(blas.gemm_nt(DType::kBF16, x.data(), P, k, w, n, DType::kBF16, y));
            },
            150.0);
      };
      row.dense["cublas:gate_up"] = cublas(w1.data(), 2 * I, H, y1.data());
      row.dense["cublas:down"] = cublas(w2.data(), H, I, y2.data());
      std::printf("    dense cuBLAS, same expert FLOPs: gate_up %.1f down %.1f us (%.0f TFLOP/s)\n",
                  row.dense["cublas:gate_up"], row.dense["cublas:down"],
                  2.0 * P * 3.0 * H * I /
                      ((row.dense["cublas:gate_up"] + row.dense["cublas:down"]) * 1e-6) / 1e12);
      if (fp8) {
        // The yardstick of the FP8 layer: cuBLASLt's e4m3 GEMMs on the same FLOPs as dense
        // GEMMs (per-tensor scales; every code 1.0, timing does not depend on the values).
        DeviceBuffer x8 = take(DeviceBuffer::create(P * H), "fp8 x");
        DeviceBuffer w18 = take(DeviceBuffer::create(2 * I * H), "fp8 w1");
        DeviceBuffer w28 = take(DeviceBuffer::create(H * I), "fp8 w2");
        for (DeviceBuffer* buf : {&x8, &w18, &w28}) {
          BENCH_CHECK(cuda_status(cudaMemsetAsync(buf->data(), 0x38, buf->num_bytes(), stream),
                                  "fill e4m3"));
        }
        const size_t workspace_bytes = size_t{32} << 20;
        DeviceBuffer workspace = take(DeviceBuffer::create(workspace_bytes), "cublasLt workspace");
        cublasLtHandle_t lt = nullptr;
        if (cublasLtCreate(&lt) == CUBLAS_STATUS_SUCCESS) {
          const auto time = [&](const std::function<void(int)>& fn) {
            return time_calls(fn, 150.0);
          };
          const double gu = cublaslt_fp8_us(lt, x8.data(), w18.data(), y1.data(), P, 2 * I, H,
                                            workspace.data(), workspace_bytes, stream, time);
          const double dn = cublaslt_fp8_us(lt, x8.data(), w28.data(), y2.data(), P, H, I,
                                            workspace.data(), workspace_bytes, stream, time);
          cublasLtDestroy(lt);
          if (gu > 0 && dn > 0) {
            row.dense["cublaslt_fp8:gate_up"] = gu;
            row.dense["cublaslt_fp8:down"] = dn;
            std::printf(
                "    dense cuBLASLt FP8, same expert FLOPs: gate_up %.1f down %.1f us (%.0f "
                "TFLOP/s); the FP8 layer %.2fx that\n",
                gu, dn, 2.0 * P * 3.0 * H * I / ((gu + dn) * 1e-6) / 1e12, row.fp8_us / (gu + dn));
          }
        }
      }
      if (wgmma_available() && P % 128 == 0) {
        // The layer's ws128 kernel on the same dense work: one slot of P rows, A read
        // contiguously (by tensor copies) or through an identity gather (by cp.async, as
        // the layer's gate/up reads token rows).
        const int tiles = static_cast<int>(P / 128);
        std::vector<int32_t> row0(tiles), ident(P);
        for (int t = 0; t < tiles; ++t) row0[t] = 128 * t;
        for (int64_t r = 0; r < P; ++r) ident[r] = static_cast<int32_t>(r);
        DeviceBuffer offsets = upload({0, static_cast<int32_t>(P)});
        DeviceBuffer tile_slot = upload(std::vector<int32_t>(tiles, 0));
        DeviceBuffer tile_row0 = upload(row0), gather = upload(ident);
        DeviceBuffer num_tiles = upload({tiles}), sched = upload({0, 0});
        GroupedGemmArgs g;
        g.offsets = offsets.as<int32_t>();
        g.tile_slot = tile_slot.as<int32_t>();
        g.tile_row0 = tile_row0.as<int32_t>();
        g.num_tiles = num_tiles.as<int32_t>();
        g.max_tiles = tiles;
        g.sched = sched.as<int32_t>();
        auto ours = [&](GroupedGemmArgs a, const void* w, int n, int k, bool swiglu,
                        const int32_t* gather_rows, void* y) {
          a.a = x.data();
          a.gather = gather_rows;
          a.weights = w;
          a.n = n;
          a.k = k;
          a.swiglu = swiglu;
          a.out = y;
          return time_calls(
              [&](int) {
                BENCH_CHECK(cuda_status(
                    grouped_gemm(DType::kBF16, GemmTile::kWgmmaWs128, a, stream), "ws128"));
              },
              150.0);
        };
        row.dense["ws128:gate_up"] = ours(g, w1.data(), 2 * I, H, true, nullptr, y1.data());
        row.dense["ws128_gathered:gate_up"] =
            ours(g, w1.data(), 2 * I, H, true, gather.as<int32_t>(), y1.data());
        row.dense["ws128:down"] = ours(g, w2.data(), H, I, false, nullptr, y2.data());
        std::printf("    ws128, same dense work: gate_up %.1f (A gathered: %.1f) down %.1f us\n",
                    row.dense["ws128:gate_up"], row.dense["ws128_gathered:gate_up"],
                    row.dense["ws128:down"]);
        const int64_t R = P / sh.experts;  // Rows per expert when the routing is balanced.
        if (R % 128 == 0) {
          // The layer's weights, every slot with R rows (no tile a slot leaves part-empty),
          // gate/up reading T token rows as the layer does (row r: token r mod T): between
          // the dense work and the layer's, what its many weight matrices cost.
          std::vector<int32_t> offs(sh.experts + 1), slot_of(tiles), tok(P);
          for (int e = 0; e <= sh.experts; ++e) offs[e] = static_cast<int32_t>(e * R);
          for (int t = 0; t < tiles; ++t) slot_of[t] = static_cast<int32_t>(t / (R / 128));
          for (int64_t r = 0; r < P; ++r) tok[r] = static_cast<int32_t>((r % T) * sh.top_k);
          DeviceBuffer b_offsets = upload(offs), b_tile_slot = upload(slot_of), b_tok = upload(tok);
          GroupedGemmArgs b = g;
          b.offsets = b_offsets.as<int32_t>();
          b.tile_slot = b_tile_slot.as<int32_t>();
          b.slot_stride = dims.slot_elems();
          b.gather_div = sh.top_k;
          row.dense["even:gate_up"] =
              ours(b, slots.data(), 2 * I, H, true, b_tok.as<int32_t>(), y1.data());
          b.weight_offset = 2 * I * H;  // The down projection (gather_div unused: no gather).
          row.dense["even:down"] = ours(b, slots.data(), H, I, false, nullptr, y2.data());
          std::printf("    ws128, %lld rows for each expert: gate_up %.1f down %.1f us\n",
                      static_cast<long long>(R), row.dense["even:gate_up"], row.dense["even:down"]);
        }
      }
    }
    if (sweep) {
      std::printf("    tiles:");
      for (int t = 1; t < kNumGemmTiles; ++t) {
        const GemmTile gt = static_cast<GemmTile>(t);
        if (!tile_supports(gt, dims.dtype, 2 * sh.inter, sh.hidden) ||
            !tile_supports(gt, dims.dtype, sh.hidden, sh.inter) ||
            (!sweep_tiles.empty() && sweep_tiles.count(tile_name(gt)) == 0)) {
          continue;
        }
        const double us = time_calls([&](int i) { layer(i, t, kMoeAllStages); }, 40.0);
        row.sweep[tile_name(gt)] = us;
        std::printf(" %s %.1f", tile_name(gt), us);
        if (profile) {  // Both GEMMs of this tile alone, on input 0's routing.
          layer(0, t, kMoeAllStages);
          const double gu = time_calls([&](int) { layer(0, t, kMoeGateUp); }, 20.0);
          const double dn = time_calls([&](int) { layer(0, t, kMoeDown); }, 20.0);
          row.stages[std::string(tile_name(gt)) + ":gate_up"] = gu;
          row.stages[std::string(tile_name(gt)) + ":down"] = dn;
          std::printf(" (gate_up %.1f down %.1f)", gu, dn);
        }
      }
      std::printf("\n");
    }
    if (profile) {
      layer(0, -1, kMoeAllStages);  // Routing data for the single-stage runs.
      std::printf("    stages:");
      const std::vector<std::pair<unsigned, const char*>> stages =
          decode ? std::vector<std::pair<unsigned, const char*>>{{kMoeRouter, "route_topk"},
                                                                 {kMoeGateUp, "gate_up"},
                                                                 {kMoeDown, "down_combine"}}
                 : std::vector<std::pair<unsigned, const char*>>{
                       {kMoeRouter, "router"},  {kMoeTopk, "topk"}, {kMoePermute, "permute"},
                       {kMoeGateUp, "gate_up"}, {kMoeDown, "down"}, {kMoeCombine, "combine"}};
      for (const auto& [bit, name] : stages) {
        // Same input for every call: the single stages reuse input 0's routing.
        const double us = time_calls([&](int) { layer(0, -1, bit); }, 30.0);
        row.stages[name] = us;
        std::printf(" %s %.1f", name, us);
      }
      std::printf("\n");
    }
    rows.push_back(row);
    std::fflush(stdout);
  }
  return rows;
}

int run(int argc, char** argv) {
  std::string shapes = "qwen3-30b-a3b,deepseek-v3";
  std::string tokens = "1,4,16,64,256,1024,4096,16384";
  std::string json_path, torch_path, tiles;
  bool sweep = false, profile = false, dense = false;
  std::vector<std::string> fp8_paths;
  for (int i = 1; i < argc; ++i) {
    const std::string a = argv[i];
    auto next = [&]() -> std::string {
      if (i + 1 >= argc) {
        std::fprintf(stderr, "%s needs a value\n", a.c_str());
        std::exit(2);
      }
      return argv[++i];
    };
    if (a == "--shapes") {
      shapes = next();
    } else if (a == "--tokens") {
      tokens = next();
    } else if (a == "--json") {
      json_path = next();
    } else if (a == "--torch") {
      torch_path = next();
    } else if (a == "--tiles") {
      tiles = next();
    } else if (a == "--sweep") {
      sweep = true;
    } else if (a == "--profile") {
      profile = true;
    } else if (a == "--dense") {
      dense = true;
    } else if (a == "--fp8-paths") {
      fp8_paths = split(next());
      for (const std::string& p : fp8_paths) {
        if (p != "decode" && p != "tile" && p != "wgmma") {
          std::fprintf(stderr, "--fp8-paths takes decode, tile, wgmma (got %s)\n", p.c_str());
          return 2;
        }
      }
    } else {
      std::fprintf(stderr,
                   "usage: moe_layer_bench [--shapes a,b] [--tokens 1,4,...] [--json F] "
                   "[--torch F] [--sweep] [--profile] [--tiles a,b] [--dense] [--fp8-paths "
                   "decode,tile,wgmma]\n");
      return 2;
    }
  }
  if (!device_available()) {
    std::fprintf(stderr, "moe_layer_bench: no CUDA device\n");
    return 1;
  }
  std::vector<int> token_counts;
  for (const auto& t : split(tokens)) token_counts.push_back(std::atoi(t.c_str()));
  BENCH_CHECK(set_device(0));
  Stream stream = take(Stream::create(), "stream");
  Blas blas = take(Blas::create(stream.get()), "blas");
  cudaDeviceProp prop{};
  cudaGetDeviceProperties(&prop, 0);
  const double bw = measure_bandwidth(stream.get());
  const double rate = measure_bf16_rate(stream.get(), blas);
  // What the GPU holds over windows as long as the layers' (150 ms, median of 3): the
  // floors use the burst rate above; the sustained one is printed beside them.
  const double rate_sustained = measure_bf16_rate(stream.get(), blas, 150.0);
  std::printf(
      "device %s: copy bandwidth %.0f GB/s (read + write), bf16 GEMM %.0f TFLOP/s "
      "(burst), %.0f TFLOP/s (sustained)\n",
      prop.name, bw / 1e9, rate / 1e12, rate_sustained / 1e12);
  std::vector<Row> rows;
  for (const auto& name : split(shapes)) {
    const Shape* sh = nullptr;
    for (const Shape& s : kShapes) {
      if (s.name == name) sh = &s;
    }
    if (sh == nullptr) {
      std::fprintf(stderr, "unknown shape %s\n", name.c_str());
      return 2;
    }
    const std::vector<std::string> tile_list = split(tiles);
    const std::set<std::string> sweep_tiles(tile_list.begin(), tile_list.end());
    auto r = bench_shape(*sh, token_counts, bw, rate, sweep, profile, dense, fp8_paths, sweep_tiles,
                         stream.get(), blas);
    rows.insert(rows.end(), r.begin(), r.end());
  }
  nlohmann::json torch = nlohmann::json::object();
  if (!torch_path.empty()) {
    std::ifstream f(torch_path);
    if (f) torch = nlohmann::json::parse(f, nullptr, false);
    if (torch.is_discarded()) torch = nlohmann::json::object();
  }
  auto torch_us = [&](const Row& r) -> double {
    if (!torch.contains("runs")) return 0;
    for (const auto& t : torch["runs"]) {
      if (t.value("shape", "") == r.shape && t.value("tokens", 0) == r.tokens) {
        // moe_layer_torch.py's best_us, or torch_us of an earlier --json of this bench.
        return t.contains("best_us") ? t.value("best_us", 0.0) : t.value("torch_us", 0.0);
      }
    }
    return 0;
  };
  // The floor with the sustained GEMM rate (same bytes, same bandwidth).
  auto floor_sustained_us = [&](const Row& r) {
    return std::max(r.floor_us, 1e6 * r.flops / rate_sustained);
  };
  std::printf("\n%-14s %6s %6s %10s %10s %8s %8s %10s %8s %8s %8s\n", "shape", "tokens", "tile",
              "ours us", "floor us", "%floor", "%sust", "torch us", "speedup", "TFLOP/s", "GB/s");
  nlohmann::json runs = nlohmann::json::array();
  for (const Row& r : rows) {
    const double t = torch_us(r);
    std::printf("%-14s %6d %6s %10.1f %10.1f %7.1f%% %7.1f%% %10.1f %8.2f %8.1f %8.0f\n",
                r.shape.c_str(), r.tokens, r.tile.c_str(), r.us, r.floor_us,
                100.0 * r.floor_us / r.us, 100.0 * floor_sustained_us(r) / r.us, t,
                t > 0 ? t / r.us : 0.0, r.flops / (r.us * 1e-6) / 1e12,
                r.bytes / (r.us * 1e-6) / 1e9);
    runs.push_back({{"shape", r.shape},
                    {"tokens", r.tokens},
                    {"tile", r.tile},
                    {"us", r.us},
                    {"floor_us", r.floor_us},
                    {"fraction_of_floor", r.floor_us / r.us},
                    {"floor_sustained_us", floor_sustained_us(r)},
                    {"torch_us", t},
                    {"speedup_vs_torch", t > 0 ? t / r.us : 0.0},
                    {"bytes", r.bytes},
                    {"flops", r.flops},
                    {"experts_touched", r.experts_touched},
                    {"tile_sweep_us", r.sweep},
                    {"unfused_us", r.unfused_us},
                    {"fp8_us", r.fp8_us},
                    {"fp8_path", r.fp8_path},
                    {"fp8_floor_us", r.fp8_floor_us},
                    {"fp8_forced_us", r.fp8_forced},
                    {"dense_us", r.dense},
                    {"stage_us", r.stages}});
  }
  if (!json_path.empty()) {
    nlohmann::json out = {{"benchmark", "moe_layer"},
                          {"device", prop.name},
                          {"copy_bandwidth_bytes_per_s", bw},
                          {"bf16_gemm_flops_per_s", rate},
                          {"bf16_gemm_flops_per_s_sustained", rate_sustained},
                          {"inputs_rotated", kInputs},
                          {"runs", runs}};
    std::ofstream f(json_path);
    f << out.dump(2) << "\n";
  }
  return 0;
}

}  // namespace
}  // namespace flexpert::cuda

int main(int argc, char** argv) { return flexpert::cuda::run(argc, argv); }
