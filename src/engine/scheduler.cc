// SPDX-License-Identifier: Apache-2.0
#include "flexpert/scheduler.h"

#include <algorithm>

#include "flexpert/logging.h"

namespace flexpert {

Scheduler::Scheduler(SchedulerLimits limits) : limits_(std::move(limits)) {
  for (int s = limits_.max_sequences - 1; s >= 0; --s) free_slots_.push_back(s);
}

Status Scheduler::validate(const std::vector<int32_t>& prompt, const SamplingParams& params) const {
  return validate_request(prompt, params, limits_.vocab_size, limits_.max_seq_len);
}

void Scheduler::add(uint64_t request_id, std::vector<int32_t> prompt, SamplingParams params,
                    int num_generated) {
  Sequence seq;
  seq.id = request_id;
  seq.prompt = std::move(prompt);
  if (params.needs_logits()) {
    // What min_tokens masks: the request's stop ids, and EOS unless ignore_eos.
    std::vector<int32_t> stop_ids = params.stop_token_ids;
    if (!params.ignore_eos) {
      stop_ids.insert(stop_ids.end(), limits_.eos_token_ids.begin(), limits_.eos_token_ids.end());
    }
    seq.sampler = std::make_unique<Sampler>(params, std::move(stop_ids));
    seq.sampler->add_prompt(seq.prompt, num_generated);
  } else {
    seq.sampler = std::make_unique<Sampler>(params);
  }
  seq.params = std::move(params);
  waiting_.push_back(std::move(seq));
}

bool Scheduler::cancel(uint64_t request_id) {
  for (auto it = waiting_.begin(); it != waiting_.end(); ++it) {
    if (it->id == request_id) {
      waiting_.erase(it);
      return true;
    }
  }
  for (auto it = running_.begin(); it != running_.end(); ++it) {
    if (it->id == request_id) {
      free_slots_.push_back(it->kv_slot);
      running_.erase(it);
      return true;
    }
  }
  return false;
}

std::vector<uint64_t> Scheduler::request_ids() const {
  std::vector<uint64_t> ids;
  for (const auto& s : running_) ids.push_back(s.id);
  for (const auto& s : waiting_) ids.push_back(s.id);
  return ids;
}

const std::vector<SequenceChunk>& Scheduler::build_step() {
  while (!waiting_.empty() && !free_slots_.empty()) {
    Sequence seq = std::move(waiting_.front());
    waiting_.pop_front();
    seq.kv_slot = free_slots_.back();
    free_slots_.pop_back();
    running_.push_back(std::move(seq));
  }
  batch_.clear();
  batch_owner_.clear();
  int64_t budget = limits_.max_tokens_per_step;
  // Decode tokens first: a running sequence never waits behind a long prompt.
  for (size_t i = 0; i < running_.size(); ++i) {
    const Sequence& s = running_[i];
    if (s.prefilled < static_cast<int>(s.prompt.size())) continue;
    batch_.push_back(
        {s.kv_slot, static_cast<int>(s.prompt.size() + s.output.size()) - 1, {s.output.back()}});
    batch_owner_.push_back(i);
    --budget;
  }
  for (size_t i = 0; i < running_.size() && budget > 0; ++i) {
    const Sequence& s = running_[i];
    const int done = s.prefilled;
    if (done >= static_cast<int>(s.prompt.size())) continue;
    const int64_t n = std::min<int64_t>(budget, static_cast<int64_t>(s.prompt.size()) - done);
    batch_.push_back({s.kv_slot, done,
                      std::vector<int32_t>(s.prompt.begin() + done, s.prompt.begin() + done + n)});
    batch_owner_.push_back(i);
    budget -= n;
  }
  row_outputs_.assign(batch_.size(), RowOutput{});
  for (size_t b = 0; b < batch_.size(); ++b) {
    Sequence& s = running_[batch_owner_[b]];
    const bool completes = s.prefilled + static_cast<int>(batch_[b].tokens.size()) >=
                           static_cast<int>(s.prompt.size());
    if (!completes) continue;
    RowOutput& out = row_outputs_[b];
    if (s.sampler->needs_logits()) {
      out.kind = RowOutput::kLogits;  // Processed and drawn on the host (complete_step).
      continue;
    }
    if (s.sampler->greedy()) continue;
    out.kind = RowOutput::kSample;
    out.temperature = s.sampler->temperature();
    out.top_k = s.sampler->top_k();
    out.top_p = s.sampler->top_p();
    out.u01 = s.sampler->next_uniform();
  }
  return batch_;
}

void Scheduler::complete_step(const Tensor& logits, const std::vector<int32_t>& tokens,
                              std::vector<TokenEvent>* events) {
  const int vocab = limits_.vocab_size;
  for (size_t b = 0; b < batch_.size(); ++b) {
    Sequence& s = running_[batch_owner_[b]];
    if (s.prefilled < static_cast<int>(s.prompt.size())) {
      s.prefilled += static_cast<int>(batch_[b].tokens.size());
      if (s.prefilled < static_cast<int>(s.prompt.size())) continue;  // More chunks to go.
    }
    TokenEvent ev;
    ev.request_id = s.id;
    ev.has_logprob = s.params.logprobs >= 0;
    const int32_t next =
        row_outputs_[b].kind == RowOutput::kLogits
            ? s.sampler->sample(logits.data<float>() + b * vocab, vocab, &ev.logprob)
            : tokens[b];
    ev.token = next;
    s.output.push_back(next);
    const auto& stops = s.params.stop_token_ids;
    const auto& eos = limits_.eos_token_ids;
    if (std::find(stops.begin(), stops.end(), next) != stops.end() ||
        (!s.params.ignore_eos && std::find(eos.begin(), eos.end(), next) != eos.end())) {
      ev.finished = true;
      ev.finish_reason = "stop";
    } else if (static_cast<int>(s.output.size()) >= s.params.max_tokens) {
      ev.finished = true;
      ev.finish_reason = "length";
    }
    s.finished = ev.finished;
    events->push_back(ev);
  }
  // Retire finished sequences, keeping the order of the rest.
  std::vector<Sequence> still;
  still.reserve(running_.size());
  for (Sequence& s : running_) {
    if (s.finished) {
      free_slots_.push_back(s.kv_slot);
    } else {
      still.push_back(std::move(s));
    }
  }
  running_ = std::move(still);
  batch_.clear();
  batch_owner_.clear();
}

}  // namespace flexpert
