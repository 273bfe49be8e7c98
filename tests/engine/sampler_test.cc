// SPDX-License-Identifier: Apache-2.0
// Sampling against the distributions it must draw from, and the generation loop's
// stopping and queueing rules on the tiny fixture.
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <random>

#include "flexpert/generate.h"

namespace flexpert {
namespace {

std::vector<float> random_logits(std::mt19937& rng, int n) {
  std::normal_distribution<float> dist(0.f, 2.f);
  std::vector<float> v(n);
  for (float& x : v) x = dist(rng);
  return v;
}

TEST(SamplerTest, GreedyIsArgmax) {
  std::mt19937 rng(std::random_device{}());
  for (int trial = 0; trial < 20; ++trial) {
    auto logits = random_logits(rng, 50);
    Sampler s(SamplingParams{});
    const int32_t want =
        static_cast<int32_t>(std::max_element(logits.begin(), logits.end()) - logits.begin());
    EXPECT_EQ(s.sample(logits.data(), 50), want);
  }
}

TEST(SamplerTest, TemperatureFollowsSoftmax) {
  // Empirical frequencies of 200k draws against softmax(logits / T) in double.
  const std::vector<float> logits = {1.0f, 0.5f, -0.3f, 2.0f, 0.0f};
  SamplingParams p;
  p.temperature = 0.7f;
  p.seed = std::random_device{}();
  Sampler s(p);
  std::vector<double> want(5);
  double sum = 0;
  for (int i = 0; i < 5; ++i) sum += want[i] = std::exp(logits[i] / 0.7);
  std::vector<int> count(5, 0);
  const int n = 200000;
  for (int i = 0; i < n; ++i) ++count[s.sample(logits.data(), 5)];
  for (int i = 0; i < 5; ++i) {
    const double pi = want[i] / sum;
    EXPECT_NEAR(count[i] / static_cast<double>(n), pi, 5 * std::sqrt(pi * (1 - pi) / n)) << i;
  }
}

TEST(SamplerTest, TopKAndTopPRestrictTheSupport) {
  const std::vector<float> logits = {3.0f, 2.9f, 2.8f, -5.0f, 2.7f};
  SamplingParams p;
  p.temperature = 1.0f;
  p.top_k = 2;
  p.seed = 5;
  Sampler topk(p);
  for (int i = 0; i < 2000; ++i) {
    const int32_t t = topk.sample(logits.data(), 5);
    EXPECT_TRUE(t == 0 || t == 1) << t;
  }
  p.top_k = 0;
  p.top_p = 0.01f;  // Only the most likely token reaches the mass.
  Sampler topp(p);
  for (int i = 0; i < 200; ++i) EXPECT_EQ(topp.sample(logits.data(), 5), 0);
}

// A vocabulary where the top-p prefix spans hundreds of tokens (the sampler sorts it
// in growing pieces): the support must be exactly the sorted prefix whose mass reaches
// top_p, and the draws must follow the softmax renormalised over it; with top_p = 1 the
// whole vocabulary (no sort at all).
TEST(SamplerTest, LargeVocabularyFollowsTheSortedTopPPrefix) {
  std::mt19937 rng(std::random_device{}());
  const int V = 4000;
  std::vector<float> logits(V);
  std::normal_distribution<float> dist(0.f, 0.5f);
  for (float& x : logits) x = dist(rng);
  for (float top_p : {0.2f, 0.6f, 1.0f}) {
    SamplingParams p;
    p.temperature = 0.8f;
    p.top_p = top_p;
    p.seed = rng();
    // Reference: full sort (logit desc, id asc), softmax in double, prefix by mass.
    std::vector<int> order(V);
    for (int i = 0; i < V; ++i) order[i] = i;
    std::sort(order.begin(), order.end(), [&](int a, int b) {
      return logits[a] > logits[b] || (logits[a] == logits[b] && a < b);
    });
    std::vector<double> w(V);
    double sum = 0;
    for (int i = 0; i < V; ++i) sum += w[i] = std::exp((logits[i] - logits[order[0]]) / 0.8);
    size_t cut = V;
    double acc = 0;
    for (int i = 0; i < V && top_p < 1.0f; ++i) {
      acc += w[order[i]] / sum;
      if (acc >= top_p) {
        cut = i + 1;
        break;
      }
    }
    std::vector<char> in_support(V, 0);
    double mass = 0;
    for (size_t i = 0; i < cut; ++i) in_support[order[i]] = 1, mass += w[order[i]];
    if (top_p < 1.0f) {
      EXPECT_GT(cut, 64u) << "the prefix must need more than one piece";
    }
    Sampler s(p);
    std::vector<int> count(V, 0);
    const int n = 20000;
    for (int i = 0; i < n; ++i) {
      const int32_t t = s.sample(logits.data(), V);
      ASSERT_TRUE(t >= 0 && t < V && in_support[t]) << "top_p " << top_p << " drew " << t;
      ++count[t];
    }
    for (int k = 0; k < 5; ++k) {  // The five most likely tokens.
      const double pi = w[order[k]] / mass;
      EXPECT_NEAR(count[order[k]] / static_cast<double>(n), pi, 5 * std::sqrt(pi * (1 - pi) / n))
          << "top_p " << top_p << " rank " << k;
    }
  }
}

TEST(SamplerTest, SameSeedSameDraws) {
  std::mt19937 rng(std::random_device{}());
  auto logits = random_logits(rng, 100);
  SamplingParams p;
  p.temperature = 1.3f;
  p.top_p = 0.9f;
  p.seed = rng();
  Sampler a(p), b(p);
  for (int i = 0; i < 100; ++i)
    EXPECT_EQ(a.sample(logits.data(), 100), b.sample(logits.data(), 100));
}

TEST(SamplerTest, ValidatesParameters) {
  SamplingParams p;
  EXPECT_TRUE(p.validate().ok());
  p.temperature = -1;
  EXPECT_FALSE(p.validate().ok());
  p = {};
  p.top_p = 0;
  EXPECT_FALSE(p.validate().ok());
  p = {};
  p.top_k = -2;
  EXPECT_FALSE(p.validate().ok());
  p = {};
  p.max_tokens = 0;
  EXPECT_FALSE(p.validate().ok());
  p = {};
  p.temperature = NAN;
  EXPECT_FALSE(p.validate().ok());
}

class GeneratorTest : public ::testing::Test {
 protected:
  void SetUp() override {
    ModelOptions options;
    options.max_sequences = 2;  // Fewer than requests: the rest queue.
    auto m = Model::load(std::string(FLEXPERT_TESTDATA_DIR) + "/qwen3moe-tiny", options);
    ASSERT_TRUE(m.ok()) << m.status().to_string();
    model_ = std::move(m).value();
  }
  std::unique_ptr<Model> model_;
};

TEST_F(GeneratorTest, QueuedRequestsMatchSoloRuns) {
  std::mt19937 rng(std::random_device{}());
  std::vector<GenerationRequest> requests;
  for (int i = 0; i < 5; ++i) {
    GenerationRequest r;
    for (int t = 0; t < 2 + i * 3; ++t) r.prompt.push_back(static_cast<int32_t>(rng() % 512));
    r.params.max_tokens = 3 + i;
    r.params.temperature = i % 2 ? 0.8f : 0.0f;
    r.params.seed = rng();
    requests.push_back(r);
  }
  Generator gen(*model_);
  auto together = gen.run(requests);
  ASSERT_TRUE(together.ok());
  for (size_t i = 0; i < requests.size(); ++i) {
    auto solo = gen.run({requests[i]});
    ASSERT_TRUE(solo.ok());
    EXPECT_EQ(together.value()[i].tokens, solo.value()[0].tokens) << i;
    EXPECT_EQ(together.value()[i].tokens.size(),
              static_cast<size_t>(requests[i].params.max_tokens));
    EXPECT_EQ(together.value()[i].finish_reason, "length");
  }
}

TEST_F(GeneratorTest, StopsAtStopToken) {
  GenerationRequest r;
  r.prompt = {40, 483, 62, 463, 395};  // Greedy: 136, 109, 322, ... (reference.json)
  r.params.max_tokens = 16;
  r.params.stop_token_ids = {322};
  Generator gen(*model_);
  auto out = gen.run({r});
  ASSERT_TRUE(out.ok());
  EXPECT_EQ(out.value()[0].tokens, (std::vector<int32_t>{136, 109, 322}));
  EXPECT_EQ(out.value()[0].finish_reason, "stop");
}

TEST_F(GeneratorTest, RejectsBadRequestsBeforeRunning) {
  Generator gen(*model_);
  GenerationRequest empty;
  EXPECT_EQ(gen.run({empty}).status().code(), StatusCode::kInvalidArgument);
  GenerationRequest oov;
  oov.prompt = {1, 99999};
  EXPECT_EQ(gen.run({oov}).status().code(), StatusCode::kInvalidArgument);
  GenerationRequest too_long;
  too_long.prompt = {1};
  too_long.params.max_tokens = model_->max_seq_len();
  EXPECT_EQ(gen.run({too_long}).status().code(), StatusCode::kInvalidArgument);
}

}  // namespace
}  // namespace flexpert
