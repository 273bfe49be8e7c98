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
  if (plain_softmax()) {
    return kernels::sample_softmax(logits, vocab, params_.temperature, next_uniform());
  }
  candidates_.resize(static_cast<size_t>(vocab));
  for (int64_t i = 0; i < vocab; ++i) candidates_[i] = {logits[i], static_cast<int32_t>(i)};
  auto by_logit = [](const auto& a, const auto& b) {
    return a.first > b.first || (a.first == b.first && a.second < b.second);
  };
  // The support: the top_k largest logits, sorted (O(vocab log top_k)); without a limit
  // the whole vocabulary, sorted below only as far as the top-p cut reaches (a full
  // sort of 152 k candidates costs ~19 ms per token).
  size_t keep = static_cast<size_t>(vocab);
  size_t sorted = 0;  // candidates_[0, sorted) is in by_logit order.
  if (params_.top_k > 0 && static_cast<size_t>(params_.top_k) < keep) {
    keep = static_cast<size_t>(params_.top_k);
    std::partial_sort(candidates_.begin(), candidates_.begin() + keep, candidates_.end(), by_logit);
    candidates_.resize(keep);
    sorted = keep;
  }
  // Softmax at the temperature, in double for a stable cumulative sum.
  float mx = candidates_[0].first;
  for (const auto& c : candidates_) mx = std::max(mx, c.first);
  const double inv_t = 1.0 / params_.temperature;
  auto weight = [&](size_t i) { return std::exp((candidates_[i].first - mx) * inv_t); };
  prob_.resize(keep);
  double sum = 0.0;
  for (size_t i = 0; i < keep; ++i) sum += prob_[i] = weight(i);
  // top-p: the smallest prefix in logit order whose mass reaches top_p (at least one
  // token). Sorts the first 64, 512, ... candidates until the prefix reaches it.
  size_t cut = keep;
  if (params_.top_p < 1.0f) {
    for (size_t m = std::min<size_t>(keep, 64);; m = std::min(keep, m * 8)) {
      if (m > sorted) {
        std::partial_sort(candidates_.begin() + sorted, candidates_.begin() + m,
                          candidates_.begin() + keep, by_logit);
        sorted = m;
      }
      double acc = 0.0;
      size_t i = 0;
      while (i < m && acc < params_.top_p) acc += weight(i++) / sum;
      if (acc >= params_.top_p || m == keep) {
        cut = std::max<size_t>(i, 1);
        break;
      }
    }
    for (size_t i = 0; i < cut; ++i) prob_[i] = weight(i);  // The prefix was reordered.
  }
  double mass = 0.0;
  for (size_t i = 0; i < cut; ++i) mass += prob_[i];
  const double u = next_uniform() * mass;
  double acc = 0.0;
  for (size_t i = 0; i < cut; ++i) {
    acc += prob_[i];
    if (u < acc) return candidates_[i].second;
  }
  return candidates_[cut - 1].second;
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
