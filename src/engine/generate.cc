// SPDX-License-Identifier: Apache-2.0
#include "flexpert/generate.h"

#include <algorithm>
#include <chrono>
#include <cmath>
#include <limits>

#include "flexpert/logging.h"
#include "flexpert/scheduler.h"
#include "kernels/cpu_ops.h"

namespace flexpert {

void compute_logprobs(const float* logits, int64_t vocab, int32_t token, int k, TokenLogprob* out) {
  float max = -std::numeric_limits<float>::infinity();
  for (int64_t v = 0; v < vocab; ++v) max = logits[v] > max ? logits[v] : max;  // NaN: false.
  // Each term in float (exp of a value <= 0, relative error ~1e-7), summed in double: a
  // float sum over 150k terms would lose more than the terms' own error.
  double sum = 0;
  for (int64_t v = 0; v < vocab; ++v) {
    const float e = std::exp(logits[v] - max);
    sum += std::isnan(e) ? 0.0 : static_cast<double>(e);
  }
  const double log_z = static_cast<double>(max) + std::log(sum);
  auto logprob = [&](int64_t v) -> double {
    return std::isnan(logits[v]) ? -std::numeric_limits<double>::infinity()
                                 : static_cast<double>(logits[v]) - log_z;
  };
  out->token = token;
  out->logprob = static_cast<float>(logprob(token));
  out->top.clear();
  const int64_t n = std::min<int64_t>(std::max(k, 0), vocab);
  if (n == 0) return;
  // A bounded min-heap of (logit, id) ordered so that its top is the worst kept entry.
  auto better = [&](int64_t a, int64_t b) {  // a ranks before b.
    const float la = std::isnan(logits[a]) ? -INFINITY : logits[a];
    const float lb = std::isnan(logits[b]) ? -INFINITY : logits[b];
    return la > lb || (la == lb && a < b);
  };
  std::vector<int64_t> heap;
  heap.reserve(n);
  for (int64_t v = 0; v < vocab; ++v) {
    if (static_cast<int64_t>(heap.size()) < n) {
      heap.push_back(v);
      std::push_heap(heap.begin(), heap.end(), better);
    } else if (better(v, heap.front())) {
      std::pop_heap(heap.begin(), heap.end(), better);
      heap.back() = v;
      std::push_heap(heap.begin(), heap.end(), better);
    }
  }
  std::sort(heap.begin(), heap.end(), better);
  for (int64_t v : heap)
    out->top.emplace_back(static_cast<int32_t>(v), static_cast<float>(logprob(v)));
}

Sampler::Sampler(const SamplingParams& params, std::vector<int32_t> stop_ids)
    : params_(params), stop_ids_(std::move(stop_ids)), rng_(params.seed) {}

void Sampler::add_prompt(const std::vector<int32_t>& prompt, int num_generated) {
  if (params_.repetition_penalty != 1.0f) seen_.insert(prompt.begin(), prompt.end());
  const size_t first = prompt.size() - std::min<size_t>(prompt.size(), std::max(num_generated, 0));
  for (size_t i = first; i < prompt.size(); ++i) ++output_counts_[prompt[i]];
}

void Sampler::process(float* logits, int64_t vocab) const {
  const float rep = params_.repetition_penalty;
  if (rep != 1.0f) {
    for (int32_t id : seen_) {
      if (id < 0 || id >= vocab) continue;
      float& x = logits[id];
      x = x > 0.0f ? x / rep : x * rep;
    }
  }
  if (params_.presence_penalty != 0.0f || params_.frequency_penalty != 0.0f) {
    for (const auto& [id, count] : output_counts_) {
      if (id < 0 || id >= vocab || count <= 0) continue;
      logits[id] -=
          params_.presence_penalty + params_.frequency_penalty * static_cast<float>(count);
    }
  }
  for (const auto& [id, bias] : params_.logit_bias) {
    if (id >= 0 && id < vocab) logits[id] += bias;
  }
  if (num_output_ < params_.min_tokens) {
    for (int32_t id : stop_ids_) {
      if (id >= 0 && id < vocab) logits[id] = -std::numeric_limits<float>::infinity();
    }
  }
}

int32_t Sampler::sample(const float* logits, int64_t vocab, TokenLogprob* logprob) {
  const float* row = logits;
  const bool processing = params_.repetition_penalty != 1.0f || params_.presence_penalty != 0.0f ||
                          params_.frequency_penalty != 0.0f || !params_.logit_bias.empty() ||
                          num_output_ < params_.min_tokens;
  if (processing) {  // Without it the draw sees the raw row (greedy stays bit-identical).
    scratch_.assign(logits, logits + vocab);
    process(scratch_.data(), vocab);
    row = scratch_.data();
  }
  const int32_t token =
      params_.temperature == 0.0f
          ? static_cast<int32_t>(kernels::argmax(row, vocab))
          : kernels::sample_truncated(row, vocab, params_.temperature, params_.top_k, params_.top_p,
                                      next_uniform(), &candidates_);
  if (logprob != nullptr && params_.logprobs >= 0) {
    compute_logprobs(logits, vocab, token, params_.logprobs, logprob);
  }
  if (params_.repetition_penalty != 1.0f) seen_.insert(token);
  if (params_.presence_penalty != 0.0f || params_.frequency_penalty != 0.0f) {
    ++output_counts_[token];
  }
  ++num_output_;
  return token;
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
      if (ev.has_logprob) res.logprobs.push_back(ev.logprob);
      if (ev.finished) res.finish_reason = ev.finish_reason;
      if (options_.on_token) options_.on_token(ev.request_id, ev.token);
    }
  }
  return results;
}

}  // namespace flexpert
