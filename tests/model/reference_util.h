// SPDX-License-Identifier: Apache-2.0
// Helpers shared by the model tests: a checkpoint's Hugging Face float64 reference
// (testdata/*/reference.json), the model loaded with a placement, and the check of
// last-position logits (relative L2) and greedy continuations (batched through the
// Generator) against it; plus rewriting a checkpoint tensor by tensor.
#pragma once

#include <gtest/gtest.h>

#include <cmath>
#include <cstdio>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <functional>
#include <nlohmann/json.hpp>
#include <string>
#include <vector>

#include "flexpert/checkpoint.h"
#include "flexpert/generate.h"
#include "flexpert/model.h"

namespace flexpert::model_test {

struct RefPrompt {
  std::vector<int32_t> input_ids;
  std::vector<double> logits;
  std::vector<int32_t> greedy;
};

inline std::vector<RefPrompt> load_reference(const std::string& dir) {
  std::ifstream in(dir + "/reference.json");
  auto j = nlohmann::json::parse(in);
  std::vector<RefPrompt> out;
  for (const auto& p : j["prompts"]) {
    out.push_back({p["input_ids"].get<std::vector<int32_t>>(),
                   p["last_logits_f64"].get<std::vector<double>>(),
                   p["greedy"].get<std::vector<int32_t>>()});
  }
  return out;
}

inline double rel_l2(const float* got, const std::vector<double>& want) {
  double num = 0, den = 0;
  for (size_t i = 0; i < want.size(); ++i) {
    num += (got[i] - want[i]) * (got[i] - want[i]);
    den += want[i] * want[i];
  }
  return std::sqrt(num / den);
}

// The model on `device` ("cpu", "cuda[:N]"; device_dtype on a GPU) with a placement.
inline std::unique_ptr<Model> load_on(const std::string& dir, const std::string& device,
                                      DType device_dtype, const std::string& placement,
                                      int max_seqs = 8) {
  ModelOptions options;
  options.device = device;
  options.device_dtype = device_dtype;
  options.placement = placement;
  options.max_sequences = max_seqs;
  // A GPU dequantizes every weight here, as the CPU does: FP8 experts (the GPU's default for
  // a block-FP8 DeepSeek checkpoint) are asked for by the tests of them.
  if (device != "cpu") options.quantization = "bf16";
  auto model = Model::load(dir, options);
  EXPECT_TRUE(model.ok()) << model.status().to_string();
  return model.ok() ? std::move(model).value() : nullptr;
}

inline std::unique_ptr<Model> load(const std::string& dir, const std::string& placement,
                                   int max_seqs = 8) {
  return load_on(dir, "cpu", DType::kBF16, placement, max_seqs);
}

// Every logits row of one step.
inline std::vector<float> step_logits(Model& model, const std::vector<SequenceChunk>& batch) {
  Tensor logits;
  Status s = model.forward(batch, &logits);
  EXPECT_TRUE(s.ok()) << s.to_string();
  if (!s.ok()) return {};
  return std::vector<float>(logits.data<float>(), logits.data<float>() + logits.numel());
}

// Greedy continuations of every prompt (all batched through the Generator, at most
// `step_budget` tokens per step, so a small budget chunks the prefills).
inline std::vector<std::vector<int32_t>> greedy_tokens(Model& model,
                                                       const std::vector<RefPrompt>& ref,
                                                       int step_budget = 2048) {
  std::vector<GenerationRequest> requests;
  for (const auto& r : ref) {
    SamplingParams params;
    params.max_tokens = static_cast<int>(r.greedy.size());
    params.ignore_eos = true;
    requests.push_back({r.input_ids, params});
  }
  GeneratorOptions gen_options;
  gen_options.max_tokens_per_step = step_budget;
  Generator generator(model, gen_options);
  auto results = generator.run(requests);
  EXPECT_TRUE(results.ok()) << results.status().to_string();
  std::vector<std::vector<int32_t>> out;
  if (results.ok()) {
    for (const auto& r : results.value()) out.push_back(r.tokens);
  }
  return out;
}

// Last-position logits of one prompt, run as a single prefill step in KV slot 0.
inline std::vector<float> prompt_logits(Model& model, const std::vector<int32_t>& ids) {
  Tensor logits;
  Status s = model.forward({{0, 0, ids}}, &logits);
  EXPECT_TRUE(s.ok()) << s.to_string();
  if (!s.ok()) return {};
  return std::vector<float>(logits.data<float>(), logits.data<float>() + logits.size(1));
}

// Logits of every prompt (one step each) and greedy continuations (all prompts batched,
// at most `step_budget` tokens per step, so a small budget chunks the prefills).
inline void check_against_reference(Model& model, const std::vector<RefPrompt>& ref,
                                    double logit_tol, bool check_tokens, int step_budget = 2048) {
  for (size_t i = 0; i < ref.size(); ++i) {
    SCOPED_TRACE("prompt " + std::to_string(i));
    const std::vector<float> logits = prompt_logits(model, ref[i].input_ids);
    ASSERT_EQ(logits.size(), ref[i].logits.size());
    const double err = rel_l2(logits.data(), ref[i].logits);
    EXPECT_LT(err, logit_tol);
    ::testing::Test::RecordProperty("rel_l2_prompt_" + std::to_string(i), std::to_string(err));
    std::printf("  prompt %zu: last-logit relative L2 vs float64 = %.3g\n", i, err);
  }
  if (!check_tokens) return;
  const auto tokens = greedy_tokens(model, ref, step_budget);
  ASSERT_EQ(tokens.size(), ref.size());
  for (size_t i = 0; i < ref.size(); ++i) EXPECT_EQ(tokens[i], ref[i].greedy) << "prompt " << i;
}

// Copies checkpoint `src_dir` (config.json + tensors) to `dst_dir` as one
// model.safetensors, each tensor passed through `rewrite` (which may change its
// dtype); `extra` adds tensors after them.
using TensorRewrite = std::function<Tensor(const std::string& name, const Tensor& t)>;
inline void rewrite_checkpoint(const std::string& src_dir, const std::string& dst_dir,
                               const TensorRewrite& rewrite,
                               const std::vector<std::pair<std::string, Tensor>>& extra = {}) {
  auto ckpt = Checkpoint::open(src_dir);
  ASSERT_TRUE(ckpt.ok()) << ckpt.status().to_string();
  std::filesystem::create_directories(dst_dir);
  std::filesystem::copy_file(src_dir + "/config.json", dst_dir + "/config.json",
                             std::filesystem::copy_options::overwrite_existing);
  SafetensorsWriter writer;
  std::vector<Tensor> keep;
  keep.reserve(ckpt.value()->names().size());
  auto add = [&](const std::string& name, Tensor t) {
    keep.push_back(std::move(t));
    const Tensor& kept = keep.back();
    const char* data = static_cast<const char*>(kept.raw());  // Stable across keep's growth.
    writer.add(name, kept.dtype(), kept.shape(),
               [data](uint64_t off, void* dst, uint64_t n) { std::memcpy(dst, data + off, n); });
  };
  for (const std::string& name : ckpt.value()->names()) {
    auto t = ckpt.value()->get(name);
    ASSERT_TRUE(t.ok()) << t.status().to_string();
    add(name, rewrite(name, t.value()));
  }
  for (const auto& [name, t] : extra) add(name, t.to(t.dtype()));
  ASSERT_TRUE(writer.write(dst_dir + "/model.safetensors").ok());
}

}  // namespace flexpert::model_test
