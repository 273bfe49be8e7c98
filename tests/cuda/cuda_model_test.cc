// SPDX-License-Identifier: Apache-2.0
// The CUDA Qwen3-MoE model on testdata/qwen3moe-tiny: against Hugging Face's
// float64 reference (f32: greedy tokens identical, last logits within 1e-4
// relative L2; bf16: within 2e-2), against the CPU model on the same inputs,
// with replicated placements, chunked prefill, and decode graphs that survive
// set_placement without being captured again (and warm_up capturing them up front).
#include <gtest/gtest.h>

#include <cstdio>
#include <random>

#include "cuda_model_util.h"
#include "flexpert/model.h"
#include "kernels/cpu_ops.h"

namespace flexpert {
namespace {

const std::string kModelDir = std::string(FLEXPERT_TESTDATA_DIR) + "/qwen3moe-tiny";

using cuda_test::greedy_tokens;
using cuda_test::step_logits;

std::unique_ptr<Model> load(const std::string& device, DType dtype, const std::string& placement,
                            int max_seqs = 8) {
  return cuda_test::load_on(kModelDir, device, dtype, placement, max_seqs);
}

std::vector<cuda_test::RefPrompt> load_reference() { return cuda_test::load_reference(kModelDir); }

void check_reference(Model& model, double tol, bool tokens, int step_budget = 2048) {
  cuda_test::check_reference(model, kModelDir, tol, tokens, step_budget);
}

TEST(CudaModelTest, F32MatchesReference) {
  FLEX_SKIP_WITHOUT_GPU();
  auto model = load("cuda", DType::kF32, "identity");
  ASSERT_NE(model, nullptr);
  check_reference(*model, 1e-4, true);
  EXPECT_GT(model->num_graph_captures(), 0) << "decode steps should replay graphs";
}

TEST(CudaModelTest, F32ChunkedPrefillMatchesReference) {
  FLEX_SKIP_WITHOUT_GPU();
  auto model = load("cuda:0", DType::kF32, "identity");
  ASSERT_NE(model, nullptr);
  check_reference(*model, 1e-4, true, 3);
}

TEST(CudaModelTest, F32ReplicatedPlacementMatchesReference) {
  FLEX_SKIP_WITHOUT_GPU();
  for (const char* spec : {"replicate:8:1", "replicate:23:99"}) {
    SCOPED_TRACE(spec);
    auto model = load("cuda", DType::kF32, spec);
    ASSERT_NE(model, nullptr);
    EXPECT_GT(model->placement().num_slots(), model->config().num_experts);
    check_reference(*model, 1e-4, true);
  }
}

TEST(CudaModelTest, Bf16WithinTolerance) {
  FLEX_SKIP_WITHOUT_GPU();
  auto model = load("cuda", DType::kBF16, "replicate:4:7");
  ASSERT_NE(model, nullptr);
  check_reference(*model, 2e-2, false);
  // Greedy decoding runs (tokens may differ from the f64 reference in bf16).
  const auto ref = load_reference();
  const auto got = greedy_tokens(*model, ref);
  ASSERT_EQ(got.size(), ref.size());
  int same = 0, total = 0;
  for (size_t i = 0; i < ref.size(); ++i) {
    for (size_t t = 0; t < ref[i].greedy.size() && t < got[i].size(); ++t) {
      same += got[i][t] == ref[i].greedy[t];
      ++total;
    }
  }
  std::printf("  bf16 greedy tokens equal to the reference: %d / %d\n", same, total);
}

TEST(CudaModelTest, AgreesWithCpuOnTheSameBatches) {
  FLEX_SKIP_WITHOUT_GPU();
  cuda_test::compare_with_cpu(kModelDir, "replicate:6:3", /*bf16_tol=*/3e-2, /*check_counts=*/true);
}

TEST(CudaModelTest, LongPrefillAgreesWithCpu) {
  // 600 tokens: 2400 (token, expert) rows over 16 experts use the large GEMM tiles.
  FLEX_SKIP_WITHOUT_GPU();
  auto cpu = load("cpu", DType::kF32, "replicate:3:2", 2);
  auto gpu = load("cuda", DType::kBF16, "replicate:3:2", 2);
  auto gpu32 = load("cuda", DType::kF32, "replicate:3:2", 2);
  ASSERT_NE(cpu, nullptr);
  ASSERT_NE(gpu, nullptr);
  ASSERT_NE(gpu32, nullptr);
  std::mt19937 rng(11);
  std::vector<SequenceChunk> batch = {{0, 0, {}}, {1, 0, {}}};
  for (int i = 0; i < 600; ++i) batch[0].tokens.push_back(static_cast<int32_t>(rng() % 512));
  for (int i = 0; i < 37; ++i) batch[1].tokens.push_back(static_cast<int32_t>(rng() % 512));
  const auto want = step_logits(*cpu, batch);
  const double err = cuda_test::rel_l2(step_logits(*gpu, batch), want);
  const double err32 = cuda_test::rel_l2(step_logits(*gpu32, batch), want);
  std::printf("  600-token prefill: GPU bf16 vs CPU %.3g, GPU f32 vs CPU %.3g\n", err, err32);
  EXPECT_LT(err, 3e-2);
  EXPECT_LT(err32, 1e-4);
}

TEST(CudaModelTest, SetPlacementKeepsCapturedGraphs) {
  FLEX_SKIP_WITHOUT_GPU();
  auto model = load("cuda", DType::kF32, "replicate:16:5");
  ASSERT_NE(model, nullptr);
  const auto ref = load_reference();
  const auto first = greedy_tokens(*model, ref);
  const int64_t captures = model->num_graph_captures();
  EXPECT_GT(captures, 0);
  // Free the first replica of every expert that has two: outputs must not change.
  std::vector<std::vector<int>> maps;
  std::vector<int> freed;
  const ExpertPlacement& p = model->placement();
  for (int l = 0; l < p.num_layers(); ++l) {
    std::vector<int> map = p.slot_map(l);
    for (int e = 0; e < p.num_experts(); ++e) {
      const auto& reps = p.replicas(l, e);
      if (reps.size() >= 2) {
        map[reps[0]] = ExpertPlacement::kFreeSlot;
        if (l == 0) freed.push_back(reps[0]);
      }
    }
    maps.push_back(map);
  }
  ASSERT_FALSE(freed.empty());
  auto next = ExpertPlacement::from_slot_maps(p.num_experts(), maps);
  ASSERT_TRUE(next.ok()) << next.status().to_string();
  ASSERT_TRUE(model->set_placement(std::move(next).value()).ok());
  model->reset_slot_counts();
  const auto second = greedy_tokens(*model, ref);
  EXPECT_EQ(second, first);
  for (size_t i = 0; i < ref.size(); ++i) EXPECT_EQ(second[i], ref[i].greedy);
  EXPECT_EQ(model->num_graph_captures(), captures) << "set_placement must not force a recapture";
  for (int s : freed) EXPECT_EQ(model->slot_counts()[0][s], 0) << "freed slot " << s;
}

TEST(CudaModelTest, WarmUpCapturesEveryBucketAndChangesNothing) {
  FLEX_SKIP_WITHOUT_GPU();
  auto model = load("cuda", DType::kF32, "identity", /*max_seqs=*/8);
  ASSERT_NE(model, nullptr);
  ASSERT_TRUE(model->warm_up().ok());
  EXPECT_EQ(model->num_graph_captures(), 4) << "buckets 1, 2, 4, 8";
  for (const auto& layer : model->slot_counts()) {
    for (int64_t n : layer) EXPECT_EQ(n, 0) << "padding rows must not count";
  }
  ASSERT_TRUE(model->warm_up().ok());  // Idempotent.
  const auto ref = load_reference();
  const auto got = greedy_tokens(*model, ref);
  ASSERT_EQ(got.size(), ref.size());
  for (size_t i = 0; i < ref.size(); ++i) EXPECT_EQ(got[i], ref[i].greedy) << "prompt " << i;
  EXPECT_EQ(model->num_graph_captures(), 4) << "decode after warm_up must not capture";
}

// forward_step: greedy tokens from the device argmax, softmax draws on the device, logits
// rows only where wanted, on a prefill (pieces) and a decode step (graph); all equal
// what the host computes from forward()'s logits.
TEST(CudaModelTest, ForwardStepPicksTokensOnTheDevice) {
  FLEX_SKIP_WITHOUT_GPU();
  auto model = load("cuda", DType::kF32, "identity", 4);
  ASSERT_NE(model, nullptr);
  const auto ref = load_reference();
  ASSERT_GE(ref.size(), 3u);
  const int64_t V = model->config().vocab_size;
  std::vector<SequenceChunk> prefill, decode;
  for (int i = 0; i < 3; ++i) {
    prefill.push_back({i, 0, ref[i].input_ids});
    decode.push_back({i, static_cast<int>(ref[i].input_ids.size()), {ref[i].greedy[0]}});
  }
  std::vector<RowOutput> want(3);
  want[0].kind = RowOutput::kLogits;
  want[2].kind = RowOutput::kSample;
  want[2].temperature = 1.7f;
  for (const auto* batch : {&prefill, &decode}) {
    const std::vector<float> full = step_logits(*model, *batch);
    ASSERT_EQ(full.size(), 3 * static_cast<size_t>(V));
    for (double u : {0.0, 0.3, 0.77, 0.999}) {  // Draws on the device vs the host.
      want[2].u01 = u;
      Tensor logits;
      std::vector<int32_t> tokens;
      ASSERT_TRUE(model->forward_step(*batch, want, &logits, &tokens).ok());
      EXPECT_EQ(tokens[2], kernels::sample_softmax(full.data() + 2 * V, V, 1.7f, u)) << u;
    }
    Tensor logits;
    std::vector<int32_t> greedy;
    ASSERT_TRUE(model->forward_step(*batch, want, &logits, &greedy).ok());
    ASSERT_EQ(greedy.size(), 3u);
    for (int b = 0; b < 3; ++b) {
      const float* row = full.data() + b * V;
      if (b < 2) {
        EXPECT_EQ(greedy[b], kernels::argmax(row, V)) << "row " << b;
      }
      if (want[b].kind == RowOutput::kLogits) {
        const std::vector<float> got(logits.data<float>() + b * V,
                                     logits.data<float>() + (b + 1) * V);
        EXPECT_LT(cuda_test::rel_l2(got, std::vector<float>(row, row + V)), 1e-6) << "row " << b;
      }
    }
    if (batch == &prefill) {
      for (int b = 0; b < 2; ++b) EXPECT_EQ(greedy[b], ref[b].greedy[0]) << "prompt " << b;
    }
  }
  Tensor logits;
  std::vector<int32_t> tokens;
  EXPECT_EQ(model->forward_step(decode, {RowOutput{}}, &logits, &tokens).code(),
            StatusCode::kInvalidArgument);
  want[2].u01 = 1.0;
  EXPECT_EQ(model->forward_step(decode, want, &logits, &tokens).code(),
            StatusCode::kInvalidArgument);
}

TEST(CudaModelTest, RejectsBadInput) {
  FLEX_SKIP_WITHOUT_GPU();
  auto model = load("cuda", DType::kF32, "identity", 2);
  ASSERT_NE(model, nullptr);
  Tensor logits;
  EXPECT_EQ(model->forward({{0, 0, {1, 512}}}, &logits).code(), StatusCode::kInvalidArgument);
  EXPECT_EQ(model->forward({{2, 0, {1}}}, &logits).code(), StatusCode::kInvalidArgument);
  EXPECT_EQ(model->forward({{0, 0, {1}}, {0, 0, {2}}}, &logits).code(),
            StatusCode::kInvalidArgument);
  EXPECT_EQ(model->forward({{0, model->max_seq_len(), {1}}}, &logits).code(),
            StatusCode::kInvalidArgument);
}

TEST(CudaModelTest, BadDeviceIsInvalidArgument) {
  ModelOptions options;
  options.device = "cuda:banana";
  EXPECT_EQ(Model::load(kModelDir, options).status().code(), StatusCode::kInvalidArgument);
  options.device = "tpu";
  EXPECT_EQ(Model::load(kModelDir, options).status().code(), StatusCode::kInvalidArgument);
  if (!cuda::device_available()) {
    options.device = "cuda";
    EXPECT_EQ(Model::load(kModelDir, options).status().code(), StatusCode::kInvalidArgument);
  }
}

}  // namespace
}  // namespace flexpert
