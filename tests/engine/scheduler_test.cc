// SPDX-License-Identifier: Apache-2.0
// What each row of a step asks of the model (Scheduler::row_outputs: the greedy token, a
// softmax draw, or the logits) and where each row's token comes from.
#include "flexpert/scheduler.h"

#include <gtest/gtest.h>

#include "flexpert/tensor.h"

namespace flexpert {
namespace {

std::vector<int> kinds(const std::vector<RowOutput>& rows) {
  std::vector<int> k;
  for (const RowOutput& r : rows) k.push_back(r.kind);
  return k;
}

// Logits rows whose argmax is argmax[b] (every other entry 0).
Tensor peaked_logits(const std::vector<int>& argmax, int vocab) {
  Tensor t = Tensor::empty(DType::kF32, {static_cast<int64_t>(argmax.size()), vocab});
  float* p = t.data<float>();
  for (size_t b = 0; b < argmax.size(); ++b) {
    for (int v = 0; v < vocab; ++v) p[b * vocab + v] = v == argmax[b] ? 10.f : 0.f;
  }
  return t;
}

TEST(SchedulerTest, RowOutputsFollowTheSamplers) {
  constexpr int kVocab = 8;
  Scheduler sched(SchedulerLimits{kVocab, 4, 64, 6, {}});
  SamplingParams greedy;
  greedy.max_tokens = 4;
  SamplingParams sampled = greedy;
  sampled.temperature = 1.0f;
  sampled.top_k = 1;  // Sampled, yet deterministic: the logits' argmax.
  SamplingParams plain = greedy;
  plain.temperature = 0.7f;
  plain.seed = 11;
  sched.add(1, {1, 2, 3, 4}, greedy);
  sched.add(2, {1, 2, 3, 4, 5}, sampled);

  // Step 1: request 1's whole prompt, request 2's first 2 tokens (budget 6).
  const auto& b1 = sched.build_step();
  ASSERT_EQ(b1.size(), 2u);
  EXPECT_EQ(b1[1].tokens.size(), 2u);
  EXPECT_EQ(kinds(sched.row_outputs()), (std::vector<int>{RowOutput::kGreedy, RowOutput::kGreedy}));
  std::vector<TokenEvent> events;
  sched.complete_step(peaked_logits({3, 3}, kVocab), {5, 0}, &events);
  ASSERT_EQ(events.size(), 1u);
  EXPECT_EQ(events[0].request_id, 1u);
  EXPECT_EQ(events[0].token, 5);  // From the greedy tokens, not the logits (3).

  // Step 2: request 1 decodes, request 2's prompt completes: its row is a draw with its
  // top-k cut, which the model makes (the token comes from `tokens`, not the logits).
  const auto& b2 = sched.build_step();
  ASSERT_EQ(b2.size(), 2u);
  EXPECT_EQ(b2[0].tokens, (std::vector<int32_t>{5}));
  EXPECT_EQ(kinds(sched.row_outputs()), (std::vector<int>{RowOutput::kGreedy, RowOutput::kSample}));
  EXPECT_EQ(sched.row_outputs()[1].top_k, 1);
  EXPECT_EQ(sched.row_outputs()[1].top_p, 1.0f);
  events.clear();
  sched.complete_step(peaked_logits({4, 6}, kVocab), {2, 7}, &events);
  ASSERT_EQ(events.size(), 2u);
  EXPECT_EQ(events[0].token, 2);
  EXPECT_EQ(events[1].token, 7);

  // A plain-softmax request: its row carries the temperature and the sampler's next
  // draw (the same draw a Sampler with that seed makes first), and takes the token.
  sched.add(3, {1, 2}, plain);
  sched.build_step();
  const auto& outs = sched.row_outputs();
  ASSERT_EQ(outs.size(), 3u);
  EXPECT_EQ(outs[2].kind, RowOutput::kSample);
  EXPECT_EQ(outs[2].temperature, 0.7f);
  Sampler twin(plain);
  EXPECT_EQ(outs[2].u01, twin.next_uniform());
  events.clear();
  sched.complete_step(peaked_logits({1, 6, 0}, kVocab), {1, 4, 3}, &events);
  ASSERT_EQ(events.size(), 3u);
  EXPECT_EQ(events[2].token, 3);
}

}  // namespace
}  // namespace flexpert
