// SPDX-License-Identifier: Apache-2.0
// gemv_bench: the dense projections of decode steps (gemv_nt and its fused forms, one to
// eight rows) at real model shapes on one GPU: microseconds a call and the weight bytes
// streamed per second, against a device copy's bandwidth measured in the same run.
//
//   gemv_bench [--rows 1,2,4,8] [--json out.json]
//
// Each shape is timed as a CUDA graph of calls chained as a decode step chains them
// (programmatic dependent launch: a call starts while the one before it ends), each call
// on its own copy of the weights so that the calls read from HBM, not L2 (the copies
// together are > 256 MB); replayed for ~50 ms, median of 3 windows. The 8 x 8 "shape" is a
// launch that streams nothing: its time is what each kernel of such a chain costs before
// any bytes (with FLEXPERT_NO_PDL=1: without programmatic dependent launch).
#include <algorithm>
#include <cstdio>
#include <cstdlib>
#include <fstream>
#include <nlohmann/json.hpp>
#include <string>
#include <vector>

#include "cuda/device.h"
#include "cuda/kernels.h"
#include "cuda_bench.h"

namespace flexpert::cuda {
namespace {

// What the call's input is: bf16 rows, f32 rows normalised inside (gemv_norm_nt), or f32
// gate | up rows through SwiGLU inside (gemv_swiglu_nt).
enum class Input { kPlain, kNorm, kSwiglu };
struct Shape {
  const char* name;
  int n, k;
  Input input;
  bool accumulate;
};
const Shape kShapes[] = {
    {"qwen3-30b-a3b qkv (norm)", 5120, 2048, Input::kNorm, false},
    {"qwen3-30b-a3b qkv (plain)", 5120, 2048, Input::kPlain, false},
    {"qwen3-30b-a3b o_proj", 2048, 4096, Input::kPlain, true},
    {"deepseek-v3 q_a + kv_a (norm)", 2112, 7168, Input::kNorm, false},
    {"deepseek-v2-lite mlp gate/up (norm)", 21888, 2048, Input::kNorm, false},
    {"deepseek-v2-lite mlp down (swiglu)", 2048, 10944, Input::kSwiglu, true},
    {"4096 x 4096", 4096, 4096, Input::kPlain, false},
    {"8 x 8 (a launch in the chain)", 8, 8, Input::kPlain, false},
};

int run(int argc, char** argv) {
  std::string rows_arg = "1,2,4,8", json_path;
  for (int i = 1; i < argc; ++i) {
    const std::string a = argv[i];
    if ((a == "--rows" || a == "--json") && i + 1 < argc) {
      (a == "--rows" ? rows_arg : json_path) = argv[++i];
    } else {
      std::fprintf(stderr, "usage: gemv_bench [--rows 1,2,4,8] [--json F]\n");
      return 2;
    }
  }
  std::vector<int> rows;
  for (const std::string& r : split(rows_arg)) rows.push_back(std::atoi(r.c_str()));
  for (int m : rows) {
    if (m < 1 || m > kGemvMaxRows) {
      std::fprintf(stderr, "gemv_bench: --rows takes 1 to %d\n", kGemvMaxRows);
      return 2;
    }
  }
  if (!device_available()) {
    std::fprintf(stderr, "gemv_bench: no CUDA device\n");
    return 1;
  }
  BENCH_CHECK(set_device(0));
  Stream stream = take(Stream::create(), "stream");
  cudaStream_t s = stream.get();
  const double bw = measure_bandwidth(s);
  const char* no_pdl = std::getenv("FLEXPERT_NO_PDL");
  const bool pdl = no_pdl == nullptr || no_pdl[0] == '\0' || no_pdl[0] == '0';
  std::printf("device copy: %.0f GB/s (read + write); programmatic dependent launch %s\n", bw / 1e9,
              pdl ? "on" : "off");
  std::printf("%-38s %4s %9s %9s %7s\n", "shape", "rows", "us", "GB/s", "% copy");
  nlohmann::json out_rows = nlohmann::json::array();
  for (const Shape& sh : kShapes) {
    const size_t w_bytes = static_cast<size_t>(sh.n) * sh.k * 2;
    const int copies =
        static_cast<int>(std::clamp<size_t>(((size_t{256} << 20) / w_bytes) + 1, 4, 64));
    std::vector<DeviceBuffer> w;
    for (int c = 0; c < copies; ++c) {
      w.push_back(take(DeviceBuffer::create(w_bytes), "alloc"));
      BENCH_CHECK(cuda_status(
          fill_uniform(DType::kBF16, w.back().data(), w_bytes / 2, 10 + c, 0.05f, s), "fill"));
    }
    const int in_cols = sh.input == Input::kSwiglu ? 2 * sh.k : sh.k;
    DeviceBuffer x = take(DeviceBuffer::create(size_t{8} * in_cols * 4), "alloc");
    DeviceBuffer norm = take(DeviceBuffer::create(static_cast<size_t>(sh.k) * 4), "alloc");
    DeviceBuffer y = take(DeviceBuffer::create(size_t{8} * sh.n * 4), "alloc");
    BENCH_CHECK(
        cuda_status(fill_uniform(DType::kF32, x.data(), size_t{8} * in_cols, 3, 1.f, s), "fill"));
    BENCH_CHECK(cuda_status(fill_uniform(DType::kF32, norm.data(), sh.k, 4, 1.f, s), "fill"));
    BENCH_CHECK(
        cuda_status(fill_uniform(DType::kF32, y.data(), size_t{8} * sh.n, 5, 1.f, s), "fill"));
    for (int m : rows) {
      const bool fits = sh.input == Input::kNorm     ? gemv_norm_nt_fits(m, sh.k)
                        : sh.input == Input::kSwiglu ? gemv_swiglu_nt_fits(m, sh.k)
                                                     : gemv_nt_fits(DType::kBF16, m, sh.k);
      if (!fits) continue;  // Those rows take cuBLAS.
      auto call = [&](int c) {
        cudaError_t err = cudaSuccess;
        switch (sh.input) {
          case Input::kPlain:  // x's f32 rows read as bf16 rows: any values do.
            err = gemv_nt(x.data(), m, sh.k, w[c].data(), sh.n, y.as<float>(), sh.accumulate, s);
            break;
          case Input::kNorm:
            err = gemv_norm_nt(x.as<float>(), norm.as<float>(), 1e-6f, m, sh.k, w[c].data(), sh.n,
                               y.as<float>(), sh.accumulate, s);
            break;
          case Input::kSwiglu:
            err = gemv_swiglu_nt(x.as<float>(), m, sh.k, w[c].data(), sh.n, y.as<float>(),
                                 sh.accumulate, s);
            break;
        }
        BENCH_CHECK(cuda_status(err, sh.name));
      };
      BENCH_CHECK(GraphExec::begin_capture(s));
      for (int c = 0; c < copies; ++c) call(c);
      GraphExec graph = take(GraphExec::end_capture(s), "capture");
      const double one_ms = median_ms(s, 3, [&] { BENCH_CHECK(graph.launch(s)); });
      const int reps = std::max(1, static_cast<int>(50.0 / std::max(one_ms, 1e-3)));
      const double ms = median_ms(s, 3,
                                  [&] {
                                    for (int r = 0; r < reps; ++r) BENCH_CHECK(graph.launch(s));
                                  }) /
                        (static_cast<double>(reps) * copies);
      const double us = ms * 1e3, gbs = w_bytes / (ms * 1e-3) / 1e9;
      std::printf("%-38s %4d %9.2f %9.0f %6.0f%%\n", sh.name, m, us, gbs, 100.0 * gbs * 1e9 / bw);
      std::fflush(stdout);
      out_rows.push_back({{"shape", sh.name},
                          {"n", sh.n},
                          {"k", sh.k},
                          {"rows", m},
                          {"us", us},
                          {"weight_bytes_per_s", gbs * 1e9}});
    }
  }
  if (!json_path.empty()) {
    nlohmann::json j = {{"benchmark", "gemv"},
                        {"pdl", pdl},
                        {"copy_bandwidth_bytes_per_s", bw},
                        {"rows", out_rows}};
    std::ofstream(json_path) << j.dump(1) << "\n";
  }
  return 0;
}

}  // namespace
}  // namespace flexpert::cuda

int main(int argc, char** argv) { return flexpert::cuda::run(argc, argv); }
