// SPDX-License-Identifier: Apache-2.0
#include "flexpert/generate.h"

#include <algorithm>
#include <chrono>
#include <cmath>
#include <deque>

#include "flexpert/logging.h"
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
  candidates_.resize(static_cast<size_t>(vocab));
  for (int64_t i = 0; i < vocab; ++i) candidates_[i] = {logits[i], static_cast<int32_t>(i)};
  auto by_logit = [](const auto& a, const auto& b) {
    return a.first > b.first || (a.first == b.first && a.second < b.second);
  };
  size_t keep = static_cast<size_t>(vocab);
  if (params_.top_k > 0) keep = std::min(keep, static_cast<size_t>(params_.top_k));
  std::partial_sort(candidates_.begin(), candidates_.begin() + keep, candidates_.end(), by_logit);
  candidates_.resize(keep);
  // Softmax at the temperature, in double for a stable cumulative sum.
  std::vector<double> prob(keep);
  const double mx = candidates_[0].first;
  double sum = 0.0;
  for (size_t i = 0; i < keep; ++i) {
    prob[i] = std::exp((candidates_[i].first - mx) / params_.temperature);
    sum += prob[i];
  }
  // top-p: the smallest prefix whose mass reaches top_p (at least one token).
  size_t cut = keep;
  if (params_.top_p < 1.0f) {
    double acc = 0.0;
    for (size_t i = 0; i < keep; ++i) {
      acc += prob[i] / sum;
      if (acc >= params_.top_p) {
        cut = i + 1;
        break;
      }
    }
  }
  double mass = 0.0;
  for (size_t i = 0; i < cut; ++i) mass += prob[i];
  const double u = std::uniform_real_distribution<double>(0.0, mass)(rng_);
  double acc = 0.0;
  for (size_t i = 0; i < cut; ++i) {
    acc += prob[i];
    if (u < acc) return candidates_[i].second;
  }
  return candidates_[cut - 1].second;
}

Generator::Generator(Model& model, GeneratorOptions options)
    : model_(model), options_(std::move(options)) {}

Result<std::vector<GenerationResult>> Generator::run(const std::vector<GenerationRequest>& requests) {
  const ModelConfig& config = model_.config();
  for (size_t i = 0; i < requests.size(); ++i) {
    const auto& r = requests[i];
    const std::string which = "request " + std::to_string(i) + ": ";
    if (r.prompt.empty()) return invalid_argument(which + "empty prompt");
    for (int32_t id : r.prompt) {
      if (id < 0 || id >= config.vocab_size) {
        return invalid_argument(which + "token id " + std::to_string(id) +
                                " outside the vocabulary [0, " + std::to_string(config.vocab_size) +
                                ")");
      }
    }
    FLEX_RETURN_IF_ERROR(r.params.validate().annotate(which));
    if (static_cast<int64_t>(r.prompt.size()) + r.params.max_tokens > model_.max_seq_len()) {
      return invalid_argument(which + "prompt (" + std::to_string(r.prompt.size()) +
                              ") + max_tokens (" + std::to_string(r.params.max_tokens) +
                              ") exceeds the context length " +
                              std::to_string(model_.max_seq_len()));
    }
  }

  struct Active {
    size_t request;
    int kv_slot;
    int prefilled = 0;  // Prompt tokens already in the cache.
    Sampler sampler;
  };
  std::vector<GenerationResult> results(requests.size());
  std::deque<size_t> waiting;
  for (size_t i = 0; i < requests.size(); ++i) waiting.push_back(i);
  std::vector<int> free_slots;
  for (int s = model_.max_sequences() - 1; s >= 0; --s) free_slots.push_back(s);
  std::vector<Active> active;
  std::vector<SequenceChunk> batch;
  std::vector<size_t> batch_owner;  // Index into `active` of each chunk.
  Tensor logits;

  while (!waiting.empty() || !active.empty()) {
    while (!waiting.empty() && !free_slots.empty()) {
      const size_t r = waiting.front();
      waiting.pop_front();
      active.push_back(Active{r, free_slots.back(), 0, Sampler(requests[r].params)});
      free_slots.pop_back();
    }
    // Decode tokens first (one each), then prefill chunks while the budget lasts.
    batch.clear();
    batch_owner.clear();
    int64_t budget = options_.max_tokens_per_step;
    for (size_t a = 0; a < active.size(); ++a) {
      const auto& req = requests[active[a].request];
      if (active[a].prefilled < static_cast<int>(req.prompt.size())) continue;
      const auto& out = results[active[a].request].tokens;
      batch.push_back({active[a].kv_slot,
                       static_cast<int>(req.prompt.size() + out.size()) - 1,
                       {out.back()}});
      batch_owner.push_back(a);
      --budget;
    }
    for (size_t a = 0; a < active.size() && budget > 0; ++a) {
      const auto& prompt = requests[active[a].request].prompt;
      const int done = active[a].prefilled;
      if (done >= static_cast<int>(prompt.size())) continue;
      const int64_t n = std::min<int64_t>(budget, static_cast<int64_t>(prompt.size()) - done);
      batch.push_back({active[a].kv_slot, done,
                       std::vector<int32_t>(prompt.begin() + done, prompt.begin() + done + n)});
      batch_owner.push_back(a);
      budget -= n;
    }
    const auto t0 = std::chrono::steady_clock::now();
    FLEX_RETURN_IF_ERROR(model_.forward(batch, &logits));
    int64_t step_tokens = 0;
    for (size_t b = 0; b < batch.size(); ++b) {
      Active& act = active[batch_owner[b]];
      const auto& req = requests[act.request];
      step_tokens += static_cast<int64_t>(batch[b].tokens.size());
      const bool was_prefill = act.prefilled < static_cast<int>(req.prompt.size());
      if (was_prefill) {
        act.prefilled += static_cast<int>(batch[b].tokens.size());
        if (act.prefilled < static_cast<int>(req.prompt.size())) continue;  // More chunks to go.
      }
      const int32_t next = act.sampler.sample(logits.data<float>() + b * config.vocab_size,
                                              config.vocab_size);
      GenerationResult& res = results[act.request];
      res.tokens.push_back(next);
      if (options_.on_token) options_.on_token(act.request, next);
      const auto& stops = req.params.stop_token_ids;
      const auto& eos = config.eos_token_ids;
      if (std::find(stops.begin(), stops.end(), next) != stops.end() ||
          (!req.params.ignore_eos && std::find(eos.begin(), eos.end(), next) != eos.end())) {
        res.finish_reason = "stop";
      } else if (static_cast<int>(res.tokens.size()) >= req.params.max_tokens) {
        res.finish_reason = "length";
      }
    }
    if (options_.on_step) {
      options_.on_step(step_tokens, std::chrono::duration<double>(
                                        std::chrono::steady_clock::now() - t0).count());
    }
    // Retire finished requests, keeping the order of the rest.
    std::vector<Active> still;
    for (Active& act : active) {
      if (results[act.request].finish_reason.empty()) {
        still.push_back(std::move(act));
      } else {
        free_slots.push_back(act.kv_slot);
      }
    }
    active = std::move(still);
  }
  return results;
}

}  // namespace flexpert
