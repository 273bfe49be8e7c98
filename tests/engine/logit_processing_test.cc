// SPDX-License-Identifier: Apache-2.0
// Logit processing and logprobs against references computed here in double precision
// over small hand-made logits (HF / vLLM / OpenAI semantics as include/flexpert/generate.h
// states them), the one validation, and the Scheduler's kLogits rows.
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <limits>
#include <map>
#include <set>

#include "flexpert/generate.h"
#include "flexpert/scheduler.h"
#include "flexpert/tensor.h"

namespace flexpert {
namespace {

const std::vector<float> kLogits = {2.0f, -1.5f, 0.25f, 3.0f, -0.5f, 1.0f, 0.0f, -3.0f};
constexpr int kVocab = 8;

std::vector<float> processed(const SamplingParams& p, const std::vector<int32_t>& prompt,
                             int num_generated, const std::vector<int32_t>& stop_ids = {}) {
  Sampler s(p, stop_ids);
  s.add_prompt(prompt, num_generated);
  std::vector<float> out = kLogits;
  s.process(out.data(), kVocab);
  return out;
}

// The reference: every step written out on doubles, straight from the definitions.
std::vector<double> reference(const SamplingParams& p, const std::vector<int32_t>& prompt,
                              const std::vector<int32_t>& generated, int num_sampled,
                              const std::vector<int32_t>& stop_ids) {
  std::vector<double> x(kLogits.begin(), kLogits.end());
  std::set<int32_t> seen(prompt.begin(), prompt.end());
  seen.insert(generated.begin(), generated.end());
  for (int32_t id : seen) {
    x[id] = x[id] > 0 ? x[id] / p.repetition_penalty : x[id] * p.repetition_penalty;
  }
  std::map<int32_t, int> count;
  for (int32_t id : generated) ++count[id];
  for (const auto& [id, n] : count) x[id] -= p.presence_penalty + p.frequency_penalty * n;
  for (const auto& [id, b] : p.logit_bias) x[id] += b;
  if (num_sampled < p.min_tokens) {
    for (int32_t id : stop_ids) x[id] = -std::numeric_limits<double>::infinity();
  }
  return x;
}

void expect_near(const std::vector<float>& got, const std::vector<double>& want) {
  ASSERT_EQ(got.size(), want.size());
  for (size_t i = 0; i < got.size(); ++i) {
    if (std::isinf(want[i])) {
      EXPECT_EQ(got[i], static_cast<float>(want[i])) << i;
    } else {
      EXPECT_NEAR(got[i], want[i], 1e-6) << i;
    }
  }
}

TEST(LogitProcessingTest, RepetitionPenaltyDividesPositiveAndMultipliesNegative) {
  SamplingParams p;
  p.repetition_penalty = 1.5f;
  // Prompt {0, 1}, then generated {3} (the tail of the prompt of a re-run).
  expect_near(processed(p, {0, 1, 3}, 1), reference(p, {0, 1}, {3}, 0, {}));
  const auto got = processed(p, {0, 1, 3}, 1);
  EXPECT_NEAR(got[0], 2.0 / 1.5, 1e-6);   // Positive: divided.
  EXPECT_NEAR(got[1], -1.5 * 1.5, 1e-6);  // Negative: multiplied.
  EXPECT_EQ(got[2], kLogits[2]);          // Never seen: untouched.
}

TEST(LogitProcessingTest, PresenceAndFrequencyCountGeneratedTokensOnly) {
  SamplingParams p;
  p.presence_penalty = 0.5f;
  p.frequency_penalty = 0.25f;
  // Prompt {0, 2}; generated {2, 5, 5}: id 0 is in the prompt only and keeps its logit.
  const auto got = processed(p, {0, 2, 2, 5, 5}, 3);
  expect_near(got, reference(p, {0, 2}, {2, 5, 5}, 0, {}));
  EXPECT_EQ(got[0], kLogits[0]);
  EXPECT_NEAR(got[5], 1.0 - 0.5 - 2 * 0.25, 1e-6);
}

TEST(LogitProcessingTest, AllStepsInTheDocumentedOrder) {
  SamplingParams p;
  p.repetition_penalty = 2.0f;
  p.presence_penalty = -0.75f;
  p.frequency_penalty = 1.25f;
  p.logit_bias = {{0, 1.0f}, {4, -2.5f}, {6, 7.0f}, {0, 0.5f}};  // Id 0 twice: both add.
  p.min_tokens = 2;
  p.max_tokens = 4;
  const std::vector<int32_t> stops = {3, 7};
  const auto got = processed(p, {0, 4, 3, 0}, 2, stops);
  expect_near(got, reference(p, {0, 4}, {3, 0}, 0, stops));
  // Repetition before the bias: (2 / 2) + 1.5 - presence/frequency, not (2 + 1.5) / 2.
  EXPECT_NEAR(got[0], 2.0 / 2 + 0.75 - 1.25 + 1.5, 1e-6);
}

TEST(LogitProcessingTest, LogitBiasOfPlus100MakesGreedyPickTheToken) {
  for (int32_t target = 0; target < kVocab; ++target) {
    SamplingParams p;
    p.logit_bias = {{target, 100.0f}};
    Sampler s(p);
    for (int i = 0; i < 3; ++i) EXPECT_EQ(s.sample(kLogits.data(), kVocab), target);
  }
}

TEST(LogitProcessingTest, MinTokensMasksStopIdsUntilReached) {
  SamplingParams p;
  p.min_tokens = 2;
  p.max_tokens = 8;
  Sampler s(p, /*stop_ids=*/{3, 0});  // 3 and 0 are the two largest logits.
  EXPECT_EQ(s.sample(kLogits.data(), kVocab), 5);
  EXPECT_EQ(s.sample(kLogits.data(), kVocab), 5);
  EXPECT_EQ(s.sample(kLogits.data(), kVocab), 3);  // Two generated: unmasked.
}

TEST(LogitProcessingTest, GreedyWithoutProcessingIsTheArgmaxBitForBit) {
  // Near-ties and a NaN: the kLogits path (logprobs on) must pick what argmax picks.
  const std::vector<float> row = {1.0f, std::nextafter(1.0f, 2.0f), NAN, 1.0f};
  SamplingParams off;
  SamplingParams on;
  on.logprobs = 2;
  Sampler a(off), b(on);
  TokenLogprob lp;
  EXPECT_EQ(a.sample(row.data(), 4), 1);
  EXPECT_EQ(b.sample(row.data(), 4, &lp), 1);
  EXPECT_EQ(lp.token, 1);
}

TEST(LogprobsTest, LogSoftmaxNormalisedWithTopKByLogprobThenId) {
  const std::vector<float> row = {0.5f, 2.0f, -1.0f, 2.0f, 0.5f, 3.0f};
  double z = 0;
  for (float x : row) z += std::exp(static_cast<double>(x));
  TokenLogprob lp;
  compute_logprobs(row.data(), 6, 2, 6, &lp);
  EXPECT_EQ(lp.token, 2);
  EXPECT_NEAR(lp.logprob, -1.0 - std::log(z), 1e-6);
  ASSERT_EQ(lp.top.size(), 6u);
  const std::vector<int32_t> order = {5, 1, 3, 0, 4, 2};  // Ties (1, 3), (0, 4): lower id first.
  double total = 0;
  for (size_t i = 0; i < 6; ++i) {
    EXPECT_EQ(lp.top[i].first, order[i]) << i;
    EXPECT_NEAR(lp.top[i].second, row[order[i]] - std::log(z), 1e-6) << i;
    total += std::exp(static_cast<double>(lp.top[i].second));
  }
  EXPECT_NEAR(total, 1.0, 1e-6);
  compute_logprobs(row.data(), 6, 5, 2, &lp);
  EXPECT_EQ(lp.top,
            (std::vector<std::pair<int32_t, float>>{{5, lp.top[0].second}, {1, lp.top[1].second}}));
  compute_logprobs(row.data(), 6, 5, 0, &lp);
  EXPECT_TRUE(lp.top.empty());
}

TEST(LogprobsTest, AreOfTheRawDistributionWhateverTheProcessing) {
  SamplingParams p;
  p.logit_bias = {{7, 100.0f}};
  p.logprobs = 3;
  Sampler s(p);
  TokenLogprob lp;
  EXPECT_EQ(s.sample(kLogits.data(), kVocab, &lp), 7);
  TokenLogprob raw;
  compute_logprobs(kLogits.data(), kVocab, 7, 3, &raw);
  EXPECT_EQ(lp, raw);
  EXPECT_EQ(lp.top[0].first, 3);  // The model's favourite, not the biased token.
}

TEST(LogprobsTest, SampledRowsDrawAsTheFastPathDoes) {
  // Same seed, temperature and cuts: the host path (logprobs on) draws the same tokens.
  SamplingParams p;
  p.temperature = 0.9f;
  p.top_k = 5;
  p.top_p = 0.9f;
  p.seed = 1234;
  SamplingParams q = p;
  q.logprobs = 1;
  Sampler a(p), b(q);
  TokenLogprob lp;
  for (int i = 0; i < 200; ++i) {
    ASSERT_EQ(a.sample(kLogits.data(), kVocab), b.sample(kLogits.data(), kVocab, &lp)) << i;
  }
}

TEST(ValidateTest, RangesNameTheField) {
  auto field_of = [](const SamplingParams& p, int vocab = kVocab) {
    std::string field;
    Status s = p.validate(vocab, &field);
    EXPECT_EQ(s.ok(), field.empty());
    return field;
  };
  SamplingParams ok;
  ok.repetition_penalty = 2.0f;
  ok.presence_penalty = -2.0f;
  ok.frequency_penalty = 2.0f;
  ok.logit_bias = {{7, -100.0f}, {0, 100.0f}};
  ok.min_tokens = ok.max_tokens;
  ok.logprobs = 20;
  EXPECT_EQ(field_of(ok), "");
  const std::vector<std::pair<std::function<void(SamplingParams&)>, std::string>> bad = {
      {[](SamplingParams& p) { p.repetition_penalty = 0.0f; }, "repetition_penalty"},
      {[](SamplingParams& p) { p.repetition_penalty = 2.01f; }, "repetition_penalty"},
      {[](SamplingParams& p) { p.presence_penalty = -2.01f; }, "presence_penalty"},
      {[](SamplingParams& p) { p.frequency_penalty = NAN; }, "frequency_penalty"},
      {[](SamplingParams& p) {
         p.logit_bias = {{8, 1.0f}};
       },
       "logit_bias"},
      {[](SamplingParams& p) {
         p.logit_bias = {{-1, 1.0f}};
       },
       "logit_bias"},
      {[](SamplingParams& p) {
         p.logit_bias = {{1, 100.5f}};
       },
       "logit_bias"},
      {[](SamplingParams& p) { p.min_tokens = p.max_tokens + 1; }, "min_tokens"},
      {[](SamplingParams& p) { p.min_tokens = -1; }, "min_tokens"},
      {[](SamplingParams& p) { p.logprobs = 21; }, "logprobs"},
      {[](SamplingParams& p) { p.logprobs = -2; }, "logprobs"},
      {[](SamplingParams& p) { p.max_tokens = 0; }, "max_tokens"},
      {[](SamplingParams& p) { p.stop_token_ids = {8}; }, "stop_token_ids"},
  };
  for (const auto& [mutate, field] : bad) {
    SamplingParams p;
    mutate(p);
    EXPECT_EQ(field_of(p), field);
  }
  // Without a vocabulary only the sign of an id is checked.
  SamplingParams big;
  big.logit_bias = {{1000, 1.0f}};
  EXPECT_EQ(field_of(big, 0), "");
  std::string field;
  EXPECT_FALSE(validate_request({1, 2}, SamplingParams{}, kVocab, 17, &field).ok());
  EXPECT_EQ(field, "max_tokens");  // 2 + 16 > 17.
  EXPECT_TRUE(validate_request({1, 2}, SamplingParams{}, kVocab, 18, &field).ok());
}

Tensor rows_of(const std::vector<float>& row, int n) {
  Tensor t = Tensor::empty(DType::kF32, {n, static_cast<int64_t>(row.size())});
  for (int b = 0; b < n; ++b) std::copy(row.begin(), row.end(), t.data<float>() + b * row.size());
  return t;
}

TEST(SchedulerProcessingTest, ProcessedRowsAreLogitsAndMinTokensGoesPastEos) {
  // EOS is id 3, the logits' argmax: greedy stops at once; with min_tokens 3 the first
  // three tokens avoid it (id 0 is next best) and the fourth is EOS.
  for (int min_tokens : {0, 3}) {
    Scheduler sched(SchedulerLimits{kVocab, 2, 64, 64, {3}});
    SamplingParams p;
    p.min_tokens = min_tokens;
    p.max_tokens = 8;
    p.logprobs = min_tokens == 0 ? -1 : 1;
    sched.add(1, {1, 2}, p);
    std::vector<int32_t> got;
    std::string reason;
    while (!sched.idle()) {
      const auto& batch = sched.build_step();
      ASSERT_EQ(batch.size(), 1u);
      EXPECT_EQ(sched.row_outputs()[0].kind,
                min_tokens == 0 ? RowOutput::kGreedy : RowOutput::kLogits);
      std::vector<TokenEvent> events;
      // The fast path's token is the model's argmax (3).
      sched.complete_step(rows_of(kLogits, 1), {3}, &events);
      ASSERT_EQ(events.size(), 1u);
      got.push_back(events[0].token);
      EXPECT_EQ(events[0].has_logprob, min_tokens > 0);
      if (events[0].has_logprob) {
        EXPECT_EQ(events[0].logprob.token, events[0].token);
      }
      if (events[0].finished) reason = events[0].finish_reason;
    }
    const std::vector<int32_t> want =
        min_tokens == 0 ? std::vector<int32_t>{3} : std::vector<int32_t>{0, 0, 0, 3};
    EXPECT_EQ(got, want);
    EXPECT_EQ(reason, "stop");
  }
}

TEST(SchedulerProcessingTest, ReRunCountsEarlierOutputForPenalties) {
  // A re-run's prompt ends with 2 generated tokens {3, 3}: a frequency penalty of 2
  // lowers id 3 from 3.0 to -1.0, so greedy picks id 0; as plain prompt it would not.
  for (int num_generated : {0, 2}) {
    Scheduler sched(SchedulerLimits{kVocab, 2, 64, 64, {}});
    SamplingParams p;
    p.frequency_penalty = 2.0f;
    p.max_tokens = 1;
    sched.add(1, {1, 3, 3}, p, num_generated);
    sched.build_step();
    std::vector<TokenEvent> events;
    sched.complete_step(rows_of(kLogits, 1), {3}, &events);
    ASSERT_EQ(events.size(), 1u);
    EXPECT_EQ(events[0].token, num_generated == 0 ? 3 : 0);
  }
}

}  // namespace
}  // namespace flexpert
