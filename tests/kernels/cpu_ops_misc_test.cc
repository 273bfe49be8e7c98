// SPDX-License-Identifier: Apache-2.0
// Tests of the elementwise and selection CPU kernels (silu_mul, router_topk, embedding, argmax)
// against float64 references written here. Random inputs per run; the seed is in every failure
// message. Outputs are poisoned before each call so an unwritten element fails.
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <limits>
#include <numeric>
#include <random>
#include <set>
#include <string>
#include <tuple>
#include <vector>

#include "flexpert/dtype.h"
#include "flexpert/tensor.h"
#include "kernel_test_util.h"
#include "kernels/cpu_ops.h"

namespace flexpert::kernels {
namespace {

using testing_util::poison;
using testing_util::ref_bf16_to_double;
using testing_util::ref_f16_to_double;
using testing_util::SeededRng;

// ---------------------------------------------------------------------------------------------
// silu_mul

TEST(SiluMulTest, MatchesFloat64Reference) {
  SeededRng rng;
  SCOPED_TRACE(rng.trace());
  std::vector<float> gate = {0.f, -0.f, 1.f, -1.f, 80.f, -80.f, 100.f, -100.f, 1e-20f, -1e-20f};
  for (int i = 0; i < 1000; ++i) gate.push_back(rng.uniform(-20.f, 20.f));
  const size_t n = gate.size();
  const std::vector<float> up = rng.normal_vector(n, 3.0f);
  std::vector<float> out(n);
  poison(out);

  silu_mul(gate.data(), up.data(), static_cast<int64_t>(n), out.data());

  for (size_t i = 0; i < n; ++i) {
    const double g = gate[i];
    const double want = g / (1.0 + std::exp(-g)) * up[i];
    // Relative 1e-5, with an absolute floor far below any value the loop produces except the
    // underflowing silu(-100) ~ -4e-42.
    EXPECT_LE(std::fabs(out[i] - want), 1e-5 * std::fabs(want) + 1e-30)
        << "i=" << i << " gate=" << gate[i] << " up=" << up[i] << " got " << out[i] << " want "
        << want;
  }
}

// ---------------------------------------------------------------------------------------------
// router_topk

// Softmax in double, experts sorted by probability descending (ties: lower index first).
struct RefRoute {
  std::vector<double> prob;    // By expert.
  std::vector<int32_t> order;  // Experts, most probable first.
};

RefRoute ref_route(const float* logits, int64_t num_experts) {
  RefRoute r;
  double max_logit = -INFINITY;
  for (int64_t e = 0; e < num_experts; ++e) max_logit = std::max<double>(max_logit, logits[e]);
  double sum = 0.0;
  for (int64_t e = 0; e < num_experts; ++e) {
    r.prob.push_back(std::exp(static_cast<double>(logits[e]) - max_logit));
    sum += r.prob.back();
  }
  for (double& p : r.prob) p /= sum;
  r.order.resize(static_cast<size_t>(num_experts));
  std::iota(r.order.begin(), r.order.end(), 0);
  std::stable_sort(r.order.begin(), r.order.end(),
                   [&](int32_t a, int32_t b) { return r.prob[a] > r.prob[b]; });
  return r;
}

// Two probabilities are ordered unambiguously when they differ by much more than the f32
// kernel's rounding (a few 1e-6 relative); below 1e-30 f32 probabilities may underflow to ties.
bool clearly_greater(double a, double b) { return a - b > 1e-4 * a + 1e-30; }

bool weight_close(float got, double want) {
  return std::fabs(got - want) <= 1e-5 * std::fabs(want) + 1e-7;
}

struct RouterCase {
  int64_t num_experts, k;
};

class RouterTopkTest : public ::testing::TestWithParam<std::tuple<RouterCase, bool>> {};

TEST_P(RouterTopkTest, MatchesFloat64Reference) {
  const auto [rc, norm_topk_prob] = GetParam();
  const auto [num_experts, k] = rc;
  SeededRng rng;
  SCOPED_TRACE(rng.trace());

  // Ordinary tokens, one very peaked (large logits), one offset by +1000 (overflows exp
  // without max subtraction) and one almost uniform (many near ties).
  const int64_t num_tokens = 9;
  std::vector<float> logits =
      rng.normal_vector(static_cast<size_t>(num_tokens * num_experts), 1.5f);
  for (int64_t e = 0; e < num_experts; ++e) {
    logits[6 * num_experts + e] *= 20.f;
    logits[7 * num_experts + e] += 1000.f;
    logits[8 * num_experts + e] *= 0.01f;
  }
  std::vector<int32_t> ids(static_cast<size_t>(num_tokens * k), -7);
  std::vector<float> weights(static_cast<size_t>(num_tokens * k));
  poison(weights);

  router_topk(logits.data(), num_tokens, num_experts, k, norm_topk_prob, ids.data(),
              weights.data());

  for (int64_t t = 0; t < num_tokens; ++t) {
    SCOPED_TRACE("token " + std::to_string(t));
    const RefRoute ref = ref_route(logits.data() + t * num_experts, num_experts);
    std::vector<double> sorted(static_cast<size_t>(num_experts));
    for (int64_t j = 0; j < num_experts; ++j) sorted[j] = ref.prob[ref.order[j]];
    const double top_sum = std::accumulate(sorted.begin(), sorted.begin() + k, 0.0);
    const double denom = norm_topk_prob ? top_sum : 1.0;
    const int32_t* got_ids = ids.data() + t * k;
    const float* got_w = weights.data() + t * k;

    std::set<int32_t> distinct;
    for (int64_t j = 0; j < k; ++j) {
      const int32_t id = got_ids[j];
      ASSERT_TRUE(id >= 0 && id < num_experts) << "slot " << j << " id " << id;
      distinct.insert(id);
      // The j-th largest weight is well defined even where ties make the id ambiguous.
      EXPECT_TRUE(weight_close(got_w[j], sorted[j] / denom))
          << "slot " << j << ": got " << got_w[j] << ", want " << sorted[j] / denom;
      // And the weight must belong to the id reported next to it.
      EXPECT_TRUE(weight_close(got_w[j], ref.prob[id] / denom))
          << "slot " << j << " id " << id << ": got " << got_w[j] << ", its probability is "
          << ref.prob[id] / denom;
      const bool separated_above = j == 0 || clearly_greater(sorted[j - 1], sorted[j]);
      const bool separated_below =
          j + 1 >= num_experts || clearly_greater(sorted[j], sorted[j + 1]);
      if (separated_above && separated_below) {
        EXPECT_EQ(id, ref.order[j]) << "slot " << j;
      }
    }
    EXPECT_EQ(distinct.size(), static_cast<size_t>(k)) << "repeated expert ids";
    if (k == num_experts || clearly_greater(sorted[k - 1], sorted[k])) {
      const std::set<int32_t> want(ref.order.begin(), ref.order.begin() + k);
      EXPECT_EQ(distinct, want) << "top-k set";
    }
    if (norm_topk_prob) {
      EXPECT_NEAR(std::accumulate(got_w, got_w + k, 0.0), 1.0, 1e-5);
    }
  }
}

std::string router_name(const ::testing::TestParamInfo<RouterTopkTest::ParamType>& info) {
  const auto [rc, norm] = info.param;
  // Appended piecewise: GCC 12 warns falsely (-Wrestrict) on "literal" + std::string here.
  std::string name = "e";
  name += std::to_string(rc.num_experts);
  name += "_k";
  name += std::to_string(rc.k);
  name += norm ? "_norm" : "_raw";
  return name;
}

INSTANTIATE_TEST_SUITE_P(Cases, RouterTopkTest,
                         ::testing::Combine(::testing::Values(RouterCase{8, 2}, RouterCase{60, 4},
                                                              RouterCase{128, 8}, RouterCase{16, 1},
                                                              RouterCase{5, 5}),
                                            ::testing::Bool()),
                         router_name);

TEST(RouterTopkEdgeTest, ExactTiesPickLowerIndexFirst) {
  // Equal logits give bit-identical probabilities, so the order is fully specified.
  const std::vector<float> logits = {1.f, 3.f, 3.f, 0.f, 3.f, 3.f,   // token 0
                                     0.f, 0.f, 0.f, 0.f, 0.f, 0.f};  // token 1
  std::vector<int32_t> ids(6, -1);
  std::vector<float> weights(6);
  poison(weights);
  router_topk(logits.data(), 2, 6, 3, /*norm_topk_prob=*/false, ids.data(), weights.data());
  EXPECT_EQ(ids, (std::vector<int32_t>{1, 2, 4, 0, 1, 2}));
  const double p3 = 1.0 / (4.0 + std::exp(-2.0) + std::exp(-3.0));
  for (int j = 0; j < 3; ++j) {
    EXPECT_NEAR(weights[j], p3, 1e-6);
    EXPECT_NEAR(weights[3 + j], 1.0 / 6.0, 1e-6);
  }

  poison(weights);
  router_topk(logits.data(), 2, 6, 3, /*norm_topk_prob=*/true, ids.data(), weights.data());
  EXPECT_EQ(ids, (std::vector<int32_t>{1, 2, 4, 0, 1, 2}));
  for (float w : weights) EXPECT_NEAR(w, 1.0 / 3.0, 1e-6);
}

// ---------------------------------------------------------------------------------------------
// embedding

class EmbeddingTest : public ::testing::TestWithParam<DType> {};

TEST_P(EmbeddingTest, GathersRowsExactly) {
  const DType dtype = GetParam();
  SeededRng rng;
  SCOPED_TRACE(rng.trace());
  const int64_t vocab = 37, dim = 19;
  Tensor table = Tensor::empty(dtype, {vocab, dim});
  std::vector<double> table_ref(static_cast<size_t>(vocab * dim));
  for (int64_t i = 0; i < vocab * dim; ++i) {
    if (dtype == DType::kF32) {
      table.data<float>()[i] = rng.normal();
      table_ref[i] = table.data<float>()[i];
    } else {
      const uint16_t h = dtype == DType::kBF16 ? rng.bf16_bits() : rng.f16_bits();
      table.data<uint16_t>()[i] = h;
      table_ref[i] = dtype == DType::kBF16 ? ref_bf16_to_double(h) : ref_f16_to_double(h);
    }
  }
  std::vector<int32_t> ids = {0, static_cast<int32_t>(vocab - 1), 5, 5};
  for (int i = 0; i < 20; ++i) ids.push_back(static_cast<int32_t>(rng.uniform_int(0, vocab - 1)));
  const int64_t num_tokens = static_cast<int64_t>(ids.size());
  std::vector<float> out(static_cast<size_t>(num_tokens * dim));
  poison(out);

  embedding(table, ids.data(), num_tokens, out.data());

  for (int64_t t = 0; t < num_tokens; ++t) {
    for (int64_t d = 0; d < dim; ++d) {
      // Widening bf16/f16 to f32 is exact, so equality is required.
      ASSERT_EQ(static_cast<double>(out[t * dim + d]), table_ref[ids[t] * dim + d])
          << "token " << t << " (id " << ids[t] << ") dim " << d;
    }
  }
}

INSTANTIATE_TEST_SUITE_P(DTypes, EmbeddingTest,
                         ::testing::Values(DType::kF32, DType::kBF16, DType::kF16),
                         [](const auto& info) { return std::string(dtype_name(info.param)); });

// ---------------------------------------------------------------------------------------------
// argmax

int64_t ref_argmax(const std::vector<float>& x) {
  int64_t best = 0;
  for (size_t i = 1; i < x.size(); ++i) {
    if (x[i] > x[best]) best = static_cast<int64_t>(i);
  }
  return best;
}

TEST(ArgmaxTest, RandomVectors) {
  SeededRng rng;
  SCOPED_TRACE(rng.trace());
  for (size_t n : {1, 2, 17, 1000, 151936}) {
    const std::vector<float> x = rng.normal_vector(n);
    EXPECT_EQ(argmax(x.data(), static_cast<int64_t>(n)), ref_argmax(x)) << "n=" << n;
  }
}

TEST(ArgmaxTest, TiesPickLowestIndex) {
  SeededRng rng;
  SCOPED_TRACE(rng.trace());
  for (int trial = 0; trial < 50; ++trial) {
    // Few distinct values, so the maximum almost always repeats.
    std::vector<float> x(static_cast<size_t>(rng.uniform_int(2, 64)));
    for (float& v : x) v = static_cast<float>(rng.uniform_int(-3, 2));
    EXPECT_EQ(argmax(x.data(), static_cast<int64_t>(x.size())), ref_argmax(x)) << "trial " << trial;
  }
  const std::vector<float> equal(10, -2.5f);
  EXPECT_EQ(argmax(equal.data(), 10), 0);
  const std::vector<float> late = {-1.f, 0.f, 4.f, 3.f, 4.f};
  EXPECT_EQ(argmax(late.data(), 5), 2);
}

TEST(ArgmaxTest, EdgePositionsAndInfinities) {
  const float inf = std::numeric_limits<float>::infinity();
  const std::vector<float> last = {-5.f, -4.f, -3.f, -2.f};
  EXPECT_EQ(argmax(last.data(), 4), 3);
  const std::vector<float> neg_inf = {-inf, -inf, -1e30f, -inf};
  EXPECT_EQ(argmax(neg_inf.data(), 4), 2);
  const std::vector<float> pos_inf = {1.f, inf, 2.f, inf};
  EXPECT_EQ(argmax(pos_inf.data(), 4), 1);
  const std::vector<float> one = {7.f};
  EXPECT_EQ(argmax(one.data(), 1), 0);
  const float nan = std::numeric_limits<float>::quiet_NaN();
  const std::vector<float> first_nan = {nan, -3.f, 2.f, nan};
  EXPECT_EQ(argmax(first_nan.data(), 4), 2);  // std::max_element would answer 0.
  const std::vector<float> all_nan = {nan, nan};
  EXPECT_EQ(argmax(all_nan.data(), 2), 0);
}

// sample_softmax is the inverse CDF in id order: weights 1, 2, 3 (logits 0, ln 2, ln 3
// at T = 1; ln 4, ln 8, ln 12 at T = 2 give the same) split [0, 1) at 1/6 and 1/2.
TEST(SampleSoftmaxTest, InverseTransformInIdOrder) {
  const std::vector<float> w123 = {0.f, std::log(2.f), std::log(3.f)};
  const std::vector<float> w123_t2 = {2 * std::log(2.f), 2 * std::log(4.f), 2 * std::log(6.f)};
  for (const auto& [logits, t] : {std::pair{&w123, 1.0f}, std::pair{&w123_t2, 2.0f}}) {
    EXPECT_EQ(sample_softmax(logits->data(), 3, t, 0.0), 0);
    EXPECT_EQ(sample_softmax(logits->data(), 3, t, 0.16), 0);
    EXPECT_EQ(sample_softmax(logits->data(), 3, t, 0.17), 1);
    EXPECT_EQ(sample_softmax(logits->data(), 3, t, 0.49), 1);
    EXPECT_EQ(sample_softmax(logits->data(), 3, t, 0.51), 2);
    EXPECT_EQ(sample_softmax(logits->data(), 3, t, 0.999999), 2);
  }
  // A very low temperature is the argmax; -inf never gets drawn.
  const float inf = std::numeric_limits<float>::infinity();
  const std::vector<float> peaked = {-inf, 1.f, 3.f, 2.f};
  for (double u : {0.0, 0.5, 0.999}) EXPECT_EQ(sample_softmax(peaked.data(), 4, 1e-3f, u), 2);
  // NaN weighs nothing: never drawn beside a number.
  const float nan = std::numeric_limits<float>::quiet_NaN();
  const std::vector<float> holes = {nan, 0.f, nan, 0.f, nan};
  for (double u : {0.0, 0.49, 0.51, 0.999}) {
    EXPECT_EQ(sample_softmax(holes.data(), 5, 1.f, u), u < 0.5 ? 1 : 3) << u;
  }
}

// sample_truncated on small hand-made rows: the cut sets and the id-order draw.
TEST(SampleTruncatedTest, CutsAndDrawsInIdOrder) {
  // Weights 1, 2, 3, 4 at ids 0..3 (T = 1): rank order 3, 2, 1, 0.
  const std::vector<float> w = {0.f, std::log(2.f), std::log(3.f), std::log(4.f)};
  // top_k 2: ids 2 and 3 (weights 3, 4), drawn in id order: [0, 3/7) -> 2, then 3.
  EXPECT_EQ(sample_truncated(w.data(), 4, 1.f, 2, 1.f, 0.0), 2);
  EXPECT_EQ(sample_truncated(w.data(), 4, 1.f, 2, 1.f, 0.42), 2);
  EXPECT_EQ(sample_truncated(w.data(), 4, 1.f, 2, 1.f, 0.43), 3);
  // top_p: total 10; 0.4 is reached by id 3 alone (4 >= 4), 0.41 needs id 2 too.
  EXPECT_EQ(sample_truncated(w.data(), 4, 1.f, 0, 0.4f, 0.99), 3);
  EXPECT_EQ(sample_truncated(w.data(), 4, 1.f, 0, 0.41f, 0.0), 2);
  // top_k 3 then top_p 0.5 of K's 9: 4 < 4.5, 4 + 3 >= 4.5: ids 2 and 3.
  EXPECT_EQ(sample_truncated(w.data(), 4, 1.f, 3, 0.5f, 0.0), 2);
  EXPECT_EQ(sample_truncated(w.data(), 4, 1.f, 3, 0.5f, 0.99), 3);
  // Ties rank by id: four equal logits, top_k 2 keeps ids 0 and 1.
  const std::vector<float> flat = {1.f, 1.f, 1.f, 1.f};
  EXPECT_EQ(sample_truncated(flat.data(), 4, 1.f, 2, 1.f, 0.99), 1);
  EXPECT_EQ(sample_truncated(flat.data(), 4, 1.f, 0, 0.5f, 0.99), 1);  // 0.25 < 0.5 <= 0.5.
  // NaN ranks last with weight 0; -0 ties with +0 (ids decide).
  const float nan = std::numeric_limits<float>::quiet_NaN();
  const std::vector<float> odd = {nan, -0.f, 0.f, -1.f};
  EXPECT_EQ(sample_truncated(odd.data(), 4, 1.f, 1, 1.f, 0.5), 1);
  EXPECT_EQ(sample_truncated(odd.data(), 4, 1.f, 3, 1.f, 0.999), 3);
  // All NaN: no weight anywhere; the cut keeps the first candidate (id 0).
  const std::vector<float> none(4, nan);
  EXPECT_EQ(sample_truncated(none.data(), 4, 1.f, 2, 0.5f, 0.7), 0);
  // No cut: sample_softmax exactly.
  EXPECT_EQ(sample_truncated(w.data(), 4, 1.f, 0, 1.f, 0.5), sample_softmax(w.data(), 4, 1.f, 0.5));
  EXPECT_EQ(sample_truncated(w.data(), 4, 1.f, 4, 1.f, 0.5), sample_softmax(w.data(), 4, 1.f, 0.5));
}

// Against a brute force of the definition (full sort, K, P by running weight, id-order
// inverse transform) on random rows with many ties, for many cuts and draws.
TEST(SampleTruncatedTest, MatchesTheDefinitionOnRandomRows) {
  std::mt19937 rng(17);
  for (int trial = 0; trial < 60; ++trial) {
    const int V = 50 + static_cast<int>(rng() % 3000);
    std::vector<float> l(V);
    for (float& x : l) x = static_cast<float>(static_cast<int>(rng() % 40)) / 8.f;  // Ties.
    const float t = 0.3f + static_cast<float>(rng() % 100) / 50.f;
    const int k = static_cast<int>(rng() % 3) == 0 ? 0 : 1 + static_cast<int>(rng() % V);
    const float p = static_cast<int>(rng() % 3) == 0 ? 1.f : 0.05f + (rng() % 90) / 100.f;
    std::vector<int> order(V);
    std::iota(order.begin(), order.end(), 0);
    std::sort(order.begin(), order.end(),
              [&](int a, int b) { return l[a] > l[b] || (l[a] == l[b] && a < b); });
    const float mx = l[order[0]];
    auto w = [&](int i) { return std::exp((l[i] - mx) * (1.0 / t)); };
    const int nk = k > 0 && k < V ? k : V;
    std::vector<char> in(V, 0);
    for (int i = 0; i < nk; ++i) in[order[i]] = 1;
    if (p < 1.f) {
      double total = 0;
      for (int i = 0; i < V; ++i) total += in[i] ? w(i) : 0.0;
      double acc = 0;
      int cut = 0;
      while (cut < nk && acc < p * total) acc += w(order[cut++]);
      std::fill(in.begin(), in.end(), 0);
      for (int i = 0; i < std::max(cut, 1); ++i) in[order[i]] = 1;
    }
    double mass = 0;
    for (int i = 0; i < V; ++i) mass += in[i] ? w(i) : 0.0;
    for (int d = 0; d < 20; ++d) {
      const double u = std::generate_canonical<double, 53>(rng);
      int want = -1;
      double acc = 0;
      for (int i = 0; i < V && want < 0; ++i) {
        if (!in[i]) continue;
        acc += w(i);
        if (u * mass < acc) want = i;
      }
      if (want < 0) {  // Rounding left none: the last member.
        want = V - 1 - static_cast<int>(std::find(in.rbegin(), in.rend(), 1) - in.rbegin());
      }
      ASSERT_EQ(sample_truncated(l.data(), V, t, k, p, u), want)
          << "V " << V << " T " << t << " top_k " << k << " top_p " << p << " u " << u;
    }
  }
}

}  // namespace
}  // namespace flexpert::kernels
