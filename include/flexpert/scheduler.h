// SPDX-License-Identifier: Apache-2.0
// Scheduler: continuous batching of generation requests over one Model's KV slots.
//
// Requests join (add) and leave (finish, cancel) between steps. build_step()
// forms the next batch: one decode token per running sequence, then prompt
// chunks of sequences still prefilling while the per-step token budget lasts;
// waiting requests get a KV slot as slots free up (FIFO). complete_step() takes
// the step's logits, samples, and reports new tokens and finished requests.
// Not thread-safe: owned by the one thread that drives the model.
#pragma once

#include <cstdint>
#include <deque>
#include <memory>
#include <string>
#include <vector>

#include "flexpert/generate.h"
#include "flexpert/model.h"

namespace flexpert {

struct SchedulerLimits {
  int vocab_size = 0;
  int max_sequences = 1;
  int max_seq_len = 0;
  int max_tokens_per_step = 2048;
  std::vector<int32_t> eos_token_ids;
};

struct TokenEvent {
  uint64_t request_id = 0;
  int32_t token = -1;
  bool finished = false;
  std::string finish_reason;  // "stop" or "length" when finished.
};

class Scheduler {
 public:
  explicit Scheduler(SchedulerLimits limits);

  // InvalidArgument (naming the problem) for a request the model cannot run.
  Status validate(const std::vector<int32_t>& prompt, const SamplingParams& params) const;
  // Queues a validated request. Ids must be unique among live requests.
  void add(uint64_t request_id, std::vector<int32_t> prompt, SamplingParams params);
  // Drops a queued or running request; returns false when unknown.
  bool cancel(uint64_t request_id);

  // The next step's batch (empty when nothing is runnable). Valid until the next call.
  const std::vector<SequenceChunk>& build_step();
  // Per row of the batch last built, what Model::forward_step must return: the greedy
  // token (greedy requests, and prompt chunks that produce no token), a token drawn at
  // the sampler's next uniform draw (temperature without top-k / top-p: the draw is
  // taken here), or the logits row (top-k / top-p: sampled on the host).
  const std::vector<RowOutput>& row_outputs() const { return row_outputs_; }
  // Consumes the step's results for the batch last built (Model::forward_step's tokens
  // and logits, whose kLogits rows are read); appends events.
  void complete_step(const Tensor& logits, const std::vector<int32_t>& tokens,
                     std::vector<TokenEvent>* events);

  size_t num_running() const { return running_.size(); }
  size_t num_waiting() const { return waiting_.size(); }
  bool idle() const { return running_.empty() && waiting_.empty(); }
  // Live request ids (running then waiting).
  std::vector<uint64_t> request_ids() const;

 private:
  struct Sequence {
    uint64_t id;
    std::vector<int32_t> prompt;
    SamplingParams params;
    std::unique_ptr<Sampler> sampler;
    std::vector<int32_t> output;
    int kv_slot = -1;
    int prefilled = 0;
    bool finished = false;
  };

  SchedulerLimits limits_;
  std::deque<Sequence> waiting_;
  std::vector<Sequence> running_;
  std::vector<int> free_slots_;
  std::vector<SequenceChunk> batch_;
  std::vector<size_t> batch_owner_;  // running_ index of each chunk.
  std::vector<RowOutput> row_outputs_;
};

}  // namespace flexpert
