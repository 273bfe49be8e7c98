// SPDX-License-Identifier: Apache-2.0
// Which rows of a step need their logits (Scheduler::want_logits) and where each
// row's token comes from (the greedy tokens of Model::forward_step, or the logits).
#include "flexpert/scheduler.h"

#include <gtest/gtest.h>

#include "flexpert/tensor.h"

namespace flexpert {
namespace {

// Logits rows whose argmax is argmax[b] (every other entry 0).
Tensor peaked_logits(const std::vector<int>& argmax, int vocab) {
  Tensor t = Tensor::empty(DType::kF32, {static_cast<int64_t>(argmax.size()), vocab});
  float* p = t.data<float>();
  for (size_t b = 0; b < argmax.size(); ++b) {
    for (int v = 0; v < vocab; ++v) p[b * vocab + v] = v == argmax[b] ? 10.f : 0.f;
  }
  return t;
}

TEST(SchedulerTest, OnlyCompletingSampledRowsWantLogits) {
  constexpr int kVocab = 8;
  Scheduler sched(SchedulerLimits{kVocab, 4, 64, 6, {}});
  SamplingParams greedy;
  greedy.max_tokens = 4;
  SamplingParams sampled = greedy;
  sampled.temperature = 1.0f;
  sampled.top_k = 1;  // Sampled, yet deterministic: the logits' argmax.
  sched.add(1, {1, 2, 3, 4}, greedy);
  sched.add(2, {1, 2, 3, 4, 5}, sampled);

  // Step 1: request 1's whole prompt, request 2's first 2 tokens (budget 6).
  const auto& b1 = sched.build_step();
  ASSERT_EQ(b1.size(), 2u);
  EXPECT_EQ(b1[1].tokens.size(), 2u);
  EXPECT_EQ(sched.want_logits(), (std::vector<uint8_t>{0, 0}));
  std::vector<TokenEvent> events;
  const std::vector<int32_t> greedy1 = {5, 0};
  sched.complete_step(peaked_logits({3, 3}, kVocab), &events, &greedy1);
  ASSERT_EQ(events.size(), 1u);
  EXPECT_EQ(events[0].request_id, 1u);
  EXPECT_EQ(events[0].token, 5);  // From the greedy tokens, not the logits (3).

  // Step 2: request 1 decodes, request 2's prompt completes: its row wants logits.
  const auto& b2 = sched.build_step();
  ASSERT_EQ(b2.size(), 2u);
  EXPECT_EQ(b2[0].tokens, (std::vector<int32_t>{5}));
  EXPECT_EQ(sched.want_logits(), (std::vector<uint8_t>{0, 1}));
  events.clear();
  const std::vector<int32_t> greedy2 = {2, 7};
  sched.complete_step(peaked_logits({4, 6}, kVocab), &events, &greedy2);
  ASSERT_EQ(events.size(), 2u);
  EXPECT_EQ(events[0].token, 2);
  EXPECT_EQ(events[1].token, 6);  // Sampled from its logits row, not greedy2[1].

  // Without greedy tokens every row samples from the logits.
  sched.build_step();
  events.clear();
  sched.complete_step(peaked_logits({1, 6}, kVocab), &events);
  ASSERT_EQ(events.size(), 2u);
  EXPECT_EQ(events[0].token, 1);
  EXPECT_EQ(events[1].token, 6);
}

}  // namespace
}  // namespace flexpert
