// SPDX-License-Identifier: Apache-2.0
#include "flexpert/generate.h"

#include <algorithm>
#include <chrono>
#include <cmath>

#include "flexpert/logging.h"
#include "flexpert/scheduler.h"
#include "kernels/cpu_ops.h"

namespace flexpert {

Status SamplingParams::validate() const {
  if (!(temperature >= 0.0f) || !std::isfinite(temperature)) {
    return invalid_argument("temperature must be a finite number >= 0");
  }
  if (top_k < 0) return invalid_argument("top_k must be >= 0");
  if (!(top_p > 0.0f && top_p <= 1.0f)) return invalid_argument("top_p must be in (0, 1]");
  if (max_tokens < 1) return invalid_argument("max_tokens must be >= 1");
  return Status();
}

Sampler::Sampler(const SamplingParams& params) : params_(params), rng_(params.seed) {}

int32_t Sampler::sample(const float* logits, int64_t vocab) {
  if (params_.temperature == 0.0f) return static_cast<int32_t>(kernels::argmax(logits, vocab));
  return kernels::sample_truncated(logits, vocab, params_.temperature, params_.top_k, params_.top_p,
                                   next_uniform(), &candidates_);
}

Generator::Generator(Model& model, GeneratorOptions options)
    : model_(model), options_(std::move(options)) {}

Result<std::vector<GenerationResult>> Generator::run(
    const std::vector<GenerationRequest>& requests) {
  const ModelConfig& config = model_.config();
  Scheduler scheduler(SchedulerLimits{config.vocab_size, model_.max_sequences(),
                                      model_.max_seq_len(), options_.max_tokens_per_step,
                                      config.eos_token_ids});
  for (size_t i = 0; i < requests.size(); ++i) {
    FLEX_RETURN_IF_ERROR(scheduler.validate(requests[i].prompt, requests[i].params)
                             .annotate("request " + std::to_string(i)));
  }
  for (size_t i = 0; i < requests.size(); ++i) {
    scheduler.add(i, requests[i].prompt, requests[i].params);
  }
  std::vector<GenerationResult> results(requests.size());
  std::vector<TokenEvent> events;
  Tensor logits;
  std::vector<int32_t> tokens;
  while (!scheduler.idle()) {
    const std::vector<SequenceChunk>& batch = scheduler.build_step();
    int64_t step_tokens = 0;
    for (const auto& chunk : batch) step_tokens += static_cast<int64_t>(chunk.tokens.size());
    const auto t0 = std::chrono::steady_clock::now();
    FLEX_RETURN_IF_ERROR(model_.forward_step(batch, scheduler.row_outputs(), &logits, &tokens));
    events.clear();
    scheduler.complete_step(logits, tokens, &events);
    if (options_.on_step) {
      options_.on_step(
          step_tokens,
          std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count());
    }
    for (const TokenEvent& ev : events) {
      GenerationResult& res = results[ev.request_id];
      res.tokens.push_back(ev.token);
      if (ev.finished) res.finish_reason = ev.finish_reason;
      if (options_.on_token) options_.on_token(ev.request_id, ev.token);
    }
  }
  return results;
}

}  // namespace flexpert
