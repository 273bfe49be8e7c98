// SPDX-License-Identifier: Apache-2.0
// Helpers of the CUDA model tests (Qwen3-MoE, DeepSeek): the reference checks of
// tests/model/reference_util.h on a GPU model, and the CPU model against the GPU model
// on the same steps.
#pragma once

#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <random>
#include <string>
#include <vector>

#include "../model/reference_util.h"
#include "cuda_test_util.h"
#include "flexpert/model.h"

namespace flexpert::cuda_test {

using model_test::greedy_tokens;
using model_test::load_on;
using model_test::load_reference;
using model_test::RefPrompt;
using model_test::step_logits;

// Last logits of every prompt of `dir`'s reference within `tol` (relative L2 to float64)
// and, with `tokens`, greedy continuations identical.
inline void check_reference(Model& model, const std::string& dir, double tol, bool tokens,
                            int step_budget = 2048) {
  model_test::check_against_reference(model, load_reference(dir), tol, tokens, step_budget);
}

// CPU and GPU (f32, and bf16 within bf16_tol when it is > 0) on the same steps: mixed
// prefill chunks in three KV slots, then decode steps of all three; with check_counts,
// both count the same rows per slot (same routing, same replica choice). Returns the
// largest f32 error (each must be < 1e-4).
inline double compare_with_cpu(const std::string& dir, const std::string& placement,
                               double bf16_tol, bool check_counts) {
  auto cpu = load_on(dir, "cpu", DType::kF32, placement);
  auto gpu = load_on(dir, "cuda", DType::kF32, placement);
  auto gpu_bf16 = bf16_tol > 0 ? load_on(dir, "cuda", DType::kBF16, placement) : nullptr;
  EXPECT_TRUE(cpu != nullptr && gpu != nullptr && (bf16_tol <= 0 || gpu_bf16 != nullptr));
  if (cpu == nullptr || gpu == nullptr || (bf16_tol > 0 && gpu_bf16 == nullptr)) return INFINITY;
  const int vocab = cpu->config().vocab_size;
  std::mt19937 rng(5);
  std::vector<SequenceChunk> batch = {{0, 0, {}}, {3, 0, {}}, {5, 0, {}}};
  const int lens[3] = {9, 1, 23};
  for (int b = 0; b < 3; ++b) {
    for (int i = 0; i < lens[b]; ++i) {
      batch[b].tokens.push_back(static_cast<int32_t>(rng() % vocab));
    }
  }
  double worst = 0;
  for (int step = 0; step < 6; ++step) {
    SCOPED_TRACE("step " + std::to_string(step));
    const auto want = step_logits(*cpu, batch);
    const auto got = step_logits(*gpu, batch);
    EXPECT_EQ(got.size(), want.size());
    const double err = rel_l2(got, want);
    worst = std::max(worst, err);
    EXPECT_LT(err, 1e-4);
    if (bf16_tol > 0) {
      const double err_bf16 = rel_l2(step_logits(*gpu_bf16, batch), want);
      std::printf("  step %d: GPU f32 vs CPU %.3g, GPU bf16 vs CPU %.3g\n", step, err, err_bf16);
      EXPECT_LT(err_bf16, bf16_tol);
    } else {
      std::printf("  step %d: GPU f32 vs CPU %.3g\n", step, err);
    }
    for (int b = 0; b < 3; ++b) {
      batch[b].start_pos += static_cast<int>(batch[b].tokens.size());
      batch[b].tokens = {static_cast<int32_t>(rng() % vocab)};
    }
  }
  if (check_counts) {
    EXPECT_EQ(gpu->slot_counts(), cpu->slot_counts());
  }
  return worst;
}

}  // namespace flexpert::cuda_test
