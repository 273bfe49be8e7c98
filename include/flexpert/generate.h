// SPDX-License-Identifier: Apache-2.0
// Sampling and a continuous-batching generation loop over one Model.
//
// Sampler draws the next token from logits: greedy (temperature 0), or
// temperature with optional top-k / top-p, reproducible from a seed.
// Generator runs requests to completion: up to max_sequences at once, new
// requests join between steps, prompts are prefilled in chunks under a
// per-step token budget, finished requests leave and free their KV slot.
// Single-threaded driver (the Model parallelises inside); not thread-safe.
#pragma once

#include <cstdint>
#include <functional>
#include <random>
#include <string>
#include <vector>

#include "flexpert/model.h"
#include "flexpert/status.h"

namespace flexpert {

struct SamplingParams {
  float temperature = 0.0f;  // 0: greedy.
  int top_k = 0;             // 0: no limit.
  float top_p = 1.0f;
  uint64_t seed = 0;
  int max_tokens = 16;
  std::vector<int32_t> stop_token_ids;  // Besides the model's EOS ids.
  bool ignore_eos = false;
  // Logit processing, applied on the host in this order before temperature/top-k/top-p
  // (a row that needs any of it is computed as RowOutput::kLogits).
  float repetition_penalty = 1.0f;  // > 0; 1: off. Prompt and generated tokens (HF, vLLM).
  float presence_penalty = 0.0f;    // Subtracted once per distinct generated token (OpenAI).
  float frequency_penalty = 0.0f;   // Subtracted per occurrence in the generated tokens (OpenAI).
  std::vector<std::pair<int32_t, float>> logit_bias;  // Added to the token's logit.
  int min_tokens = 0;  // EOS and stop ids cannot be sampled before this many tokens.
  int logprobs = -1;   // -1: none; k >= 0: the sampled token's logprob and the k most likely.

  Status validate() const;
};

// One generated token's log-probabilities (SamplingParams::logprobs >= 0).
struct TokenLogprob {
  int32_t token = 0;
  float logprob = 0.0f;
  std::vector<std::pair<int32_t, float>> top;  // Most likely first; params.logprobs entries.
};

class Sampler {
 public:
  explicit Sampler(const SamplingParams& params);
  int32_t sample(const float* logits, int64_t vocab);
  // Temperature 0: sample() is the argmax of the logits, whatever the rest says.
  bool greedy() const { return params_.temperature == 0.0f; }
  // Temperature > 0: sample() is kernels::sample_truncated(logits, vocab, temperature,
  // top_k, top_p, next_uniform()), which a model can compute where the logits are
  // (RowOutput::kSample).
  float temperature() const { return params_.temperature; }
  int top_k() const { return params_.top_k; }
  float top_p() const { return params_.top_p; }
  // The next uniform draw in [0, 1) (what sample() would consume).
  double next_uniform() { return std::generate_canonical<double, 53>(rng_); }

 private:
  SamplingParams params_;
  std::mt19937_64 rng_;
  std::vector<std::pair<uint32_t, int32_t>> candidates_;  // sample_truncated's scratch.
};

struct GenerationRequest {
  std::vector<int32_t> prompt;
  SamplingParams params;
};

struct GenerationResult {
  std::vector<int32_t> tokens;
  std::string finish_reason;  // "length" or "stop".
};

struct GeneratorOptions {
  int max_tokens_per_step = 2048;  // Prefill chunking budget (decode tokens count too).
  // Called after every step with (tokens in the step, seconds it took).
  std::function<void(int64_t, double)> on_step;
  // Called for each new token of request i.
  std::function<void(size_t, int32_t)> on_token;
};

class Generator {
 public:
  Generator(Model& model, GeneratorOptions options = {});
  // Runs all requests; results are in request order. Fails (InvalidArgument) before
  // any step when a request is invalid.
  Result<std::vector<GenerationResult>> run(const std::vector<GenerationRequest>& requests);

 private:
  Model& model_;
  GeneratorOptions options_;
};

}  // namespace flexpert
