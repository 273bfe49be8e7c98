// SPDX-License-Identifier: Apache-2.0
// Tests of the dense CPU kernels (matmul_nt, rms_norm, rope_rotate_half, attention) against
// float64 references written here as plain loops. Inputs are random per run; the seed is in
// every failure message. Outputs are poisoned with NaN so an unwritten element fails.
#include <gtest/gtest.h>

#include <cmath>
#include <cstdint>
#include <string>
#include <tuple>
#include <vector>

#include "flexpert/dtype.h"
#include "flexpert/tensor.h"
#include "flexpert/thread_pool.h"
#include "kernel_test_util.h"
#include "kernels/cpu_ops.h"

namespace flexpert::kernels {
namespace {

using testing_util::close_elementwise;
using testing_util::close_rel_l2;
using testing_util::poison;
using testing_util::ref_bf16_to_double;
using testing_util::ref_f16_to_double;
using testing_util::SeededRng;

constexpr double kTol = 1e-5;

// ---------------------------------------------------------------------------------------------
// matmul_nt

struct MatmulShape {
  int64_t m, n, k;
};

// A [n, k] weight of `dtype` with random contents, and its values decoded to double from the
// stored bits.
Tensor random_weight(SeededRng& rng, DType dtype, int64_t n, int64_t k, std::vector<double>* ref) {
  Tensor w = Tensor::empty(dtype, {n, k});
  ref->resize(static_cast<size_t>(n * k));
  for (int64_t i = 0; i < n * k; ++i) {
    switch (dtype) {
      case DType::kF32: {
        const float v = rng.normal();
        w.data<float>()[i] = v;
        (*ref)[i] = v;
        break;
      }
      case DType::kBF16: {
        const uint16_t h = rng.bf16_bits();
        w.data<uint16_t>()[i] = h;
        (*ref)[i] = ref_bf16_to_double(h);
        break;
      }
      case DType::kF16: {
        const uint16_t h = rng.f16_bits();
        w.data<uint16_t>()[i] = h;
        (*ref)[i] = ref_f16_to_double(h);
        break;
      }
      case DType::kF8E4M3:  // A storage type, dequantized at load: kernels never see it.
        ADD_FAILURE() << "no FP8 weights in matmul_nt";
        return w;
    }
  }
  return w;
}

// y[i, j] = sum_l x[i, l] * w[j, l].
std::vector<double> ref_matmul_nt(const std::vector<float>& x, const std::vector<double>& w,
                                  int64_t m, int64_t n, int64_t k) {
  std::vector<double> y(static_cast<size_t>(m * n));
  for (int64_t i = 0; i < m; ++i) {
    for (int64_t j = 0; j < n; ++j) {
      double acc = 0.0;
      for (int64_t l = 0; l < k; ++l) acc += static_cast<double>(x[i * k + l]) * w[j * k + l];
      y[i * n + j] = acc;
    }
  }
  return y;
}

class MatmulTest : public ::testing::TestWithParam<std::tuple<DType, int, MatmulShape>> {};

TEST_P(MatmulTest, MatchesFloat64Reference) {
  const auto [dtype, num_threads, shape] = GetParam();
  const auto [m, n, k] = shape;
  SeededRng rng;
  SCOPED_TRACE(rng.trace());

  std::vector<double> w_ref;
  Tensor w = random_weight(rng, dtype, n, k, &w_ref);
  const std::vector<float> x = rng.normal_vector(static_cast<size_t>(m * k));
  std::vector<float> y(static_cast<size_t>(m * n));
  poison(y);

  ThreadPool pool(num_threads);
  matmul_nt(x.data(), m, k, w, y.data(), pool);

  const std::vector<double> ref = ref_matmul_nt(x, w_ref, m, n, k);
  // Row by row, so one wrong row cannot hide behind many right ones.
  for (int64_t i = 0; i < m; ++i) {
    SCOPED_TRACE("row " + std::to_string(i));
    std::vector<float> got_row(y.begin() + i * n, y.begin() + (i + 1) * n);
    std::vector<double> ref_row(ref.begin() + i * n, ref.begin() + (i + 1) * n);
    EXPECT_TRUE(close_rel_l2(got_row, ref_row, kTol));
  }
}

std::string matmul_name(const ::testing::TestParamInfo<MatmulTest::ParamType>& info) {
  const auto [dtype, num_threads, s] = info.param;
  return std::string(dtype_name(dtype)) + "_t" + std::to_string(num_threads) + "_m" +
         std::to_string(s.m) + "_n" + std::to_string(s.n) + "_k" + std::to_string(s.k);
}

// Shapes: m = 1 takes the gemv path. n is mostly not a multiple of 16 and large k values make
// column blocks of 16..64 columns, so n spans several blocks with a ragged last one.
INSTANTIATE_TEST_SUITE_P(
    Shapes, MatmulTest,
    ::testing::Combine(::testing::Values(DType::kF32, DType::kBF16, DType::kF16),
                       ::testing::Values(1, 3),
                       ::testing::Values(MatmulShape{1, 1, 1}, MatmulShape{1, 7, 3},
                                         MatmulShape{1, 150, 1001}, MatmulShape{1, 600, 33},
                                         MatmulShape{2, 45, 64}, MatmulShape{5, 150, 1001},
                                         MatmulShape{3, 600, 33}, MatmulShape{17, 40, 4097},
                                         MatmulShape{4, 32, 17})),
    matmul_name);

// ---------------------------------------------------------------------------------------------
// rms_norm

std::vector<double> ref_rms_norm(const std::vector<float>& x, const std::vector<float>& weight,
                                 int64_t rows, int64_t dim, double eps) {
  std::vector<double> out(x.size());
  for (int64_t r = 0; r < rows; ++r) {
    double sum_sq = 0.0;
    for (int64_t i = 0; i < dim; ++i)
      sum_sq += static_cast<double>(x[r * dim + i]) * x[r * dim + i];
    const double inv_rms = 1.0 / std::sqrt(sum_sq / static_cast<double>(dim) + eps);
    for (int64_t i = 0; i < dim; ++i) out[r * dim + i] = x[r * dim + i] * inv_rms * weight[i];
  }
  return out;
}

// Random rows, one of them tiny so that eps visibly matters (mean square ~1e-6 vs eps 1e-5).
std::vector<float> rms_norm_input(SeededRng& rng, int64_t rows, int64_t dim) {
  std::vector<float> x = rng.normal_vector(static_cast<size_t>(rows * dim), 2.0f);
  if (rows > 1) {
    for (int64_t i = 0; i < dim; ++i) x[dim + i] *= 5e-4f;
  }
  return x;
}

class RmsNormTest : public ::testing::TestWithParam<std::tuple<int64_t, int64_t>> {};

TEST_P(RmsNormTest, MatchesFloat64Reference) {
  const auto [rows, dim] = GetParam();
  SeededRng rng;
  SCOPED_TRACE(rng.trace());
  const float eps = 1e-5f;
  const std::vector<float> x = rms_norm_input(rng, rows, dim);
  std::vector<float> weight(static_cast<size_t>(dim));
  for (float& w : weight) w = rng.uniform(0.5f, 1.5f);
  std::vector<float> out(x.size());
  poison(out);

  rms_norm(x.data(), weight.data(), rows, dim, eps, out.data());

  EXPECT_TRUE(close_elementwise(out, ref_rms_norm(x, weight, rows, dim, eps), kTol));
}

TEST_P(RmsNormTest, InPlaceMatchesFloat64Reference) {
  const auto [rows, dim] = GetParam();
  SeededRng rng;
  SCOPED_TRACE(rng.trace());
  const float eps = 1e-6f;
  const std::vector<float> x = rms_norm_input(rng, rows, dim);
  std::vector<float> weight(static_cast<size_t>(dim));
  for (float& w : weight) w = rng.uniform(-1.5f, 1.5f);
  std::vector<float> inout = x;

  rms_norm(inout.data(), weight.data(), rows, dim, eps, inout.data());

  EXPECT_TRUE(close_elementwise(inout, ref_rms_norm(x, weight, rows, dim, eps), kTol));
}

INSTANTIATE_TEST_SUITE_P(Shapes, RmsNormTest,
                         ::testing::Values(std::make_tuple(1, 1), std::make_tuple(1, 64),
                                           std::make_tuple(3, 33), std::make_tuple(4, 4096)));

// ---------------------------------------------------------------------------------------------
// rope_rotate_half

// Hugging Face Llama: inv_freq[i] = theta^(-2i/D); emb = cat(freqs, freqs);
// out = x * cos(emb) + rotate_half(x) * sin(emb), rotate_half(x) = cat(-x2, x1).
std::vector<double> ref_rope(const std::vector<float>& x, int64_t num_tokens, int64_t num_heads,
                             int64_t head_dim, const std::vector<int32_t>& positions,
                             double theta) {
  const int64_t half = head_dim / 2;
  std::vector<double> out(x.size());
  std::vector<double> cos_emb(head_dim), sin_emb(head_dim), rotated(head_dim);
  for (int64_t t = 0; t < num_tokens; ++t) {
    for (int64_t i = 0; i < half; ++i) {
      const double inv_freq = std::pow(theta, -2.0 * static_cast<double>(i) / head_dim);
      const double angle = positions[t] * inv_freq;
      cos_emb[i] = cos_emb[i + half] = std::cos(angle);
      sin_emb[i] = sin_emb[i + half] = std::sin(angle);
    }
    for (int64_t h = 0; h < num_heads; ++h) {
      const float* v = x.data() + (t * num_heads + h) * head_dim;
      for (int64_t d = 0; d < head_dim; ++d) rotated[d] = d < half ? -v[d + half] : v[d - half];
      double* o = out.data() + (t * num_heads + h) * head_dim;
      for (int64_t d = 0; d < head_dim; ++d) o[d] = v[d] * cos_emb[d] + rotated[d] * sin_emb[d];
    }
  }
  return out;
}

class RopeTest : public ::testing::TestWithParam<std::tuple<int64_t, double>> {};

TEST_P(RopeTest, MatchesHuggingFaceFormula) {
  const auto [head_dim, theta] = GetParam();
  SeededRng rng;
  SCOPED_TRACE(rng.trace());
  // Positions out of order, with repeats, 0, and large values; several per run.
  std::vector<int32_t> positions = {0, 1, 2, 7, 100, 4095, 32767, 1};
  for (int i = 0; i < 4; ++i) positions.push_back(static_cast<int32_t>(rng.uniform_int(0, 131071)));
  const int64_t num_tokens = static_cast<int64_t>(positions.size());
  const int64_t num_heads = 3;
  const std::vector<float> x =
      rng.normal_vector(static_cast<size_t>(num_tokens * num_heads * head_dim));
  std::vector<float> got = x;

  rope_rotate_half(got.data(), num_tokens, num_heads, head_dim, positions.data(), theta);

  EXPECT_TRUE(
      close_elementwise(got, ref_rope(x, num_tokens, num_heads, head_dim, positions, theta), kTol));
}

INSTANTIATE_TEST_SUITE_P(HeadDims, RopeTest,
                         ::testing::Combine(::testing::Values<int64_t>(2, 8, 64, 128),
                                            ::testing::Values(10000.0, 1000000.0)));

TEST(RopeEdgeTest, PositionZeroIsIdentity) {
  SeededRng rng;
  SCOPED_TRACE(rng.trace());
  const std::vector<float> x = rng.normal_vector(2 * 4 * 16);
  std::vector<float> got = x;
  const std::vector<int32_t> positions = {0, 0};
  rope_rotate_half(got.data(), 2, 4, 16, positions.data(), 10000.0);
  EXPECT_EQ(got, x);
}

// ---------------------------------------------------------------------------------------------
// attention

struct AttentionCase {
  int64_t num_q_heads, num_kv_heads, head_dim, first_pos, num_tokens;
  int num_threads;
};

// Token t of the new ones attends to cache positions [0, first_pos + t]; q head h reads kv head
// h / (num_q_heads / num_kv_heads).
std::vector<double> ref_attention(const std::vector<float>& q, const std::vector<float>& k_cache,
                                  const std::vector<float>& v_cache, const AttentionCase& c,
                                  double scale) {
  const int64_t d_model = c.head_dim;
  const int64_t group = c.num_q_heads / c.num_kv_heads;
  std::vector<double> out(static_cast<size_t>(c.num_tokens * c.num_q_heads * d_model));
  for (int64_t t = 0; t < c.num_tokens; ++t) {
    const int64_t len = c.first_pos + t + 1;
    for (int64_t h = 0; h < c.num_q_heads; ++h) {
      const int64_t kvh = h / group;
      const float* qv = q.data() + (t * c.num_q_heads + h) * d_model;
      std::vector<double> score(static_cast<size_t>(len));
      double max_score = -INFINITY;
      for (int64_t j = 0; j < len; ++j) {
        const float* kv = k_cache.data() + (j * c.num_kv_heads + kvh) * d_model;
        double dot = 0.0;
        for (int64_t d = 0; d < d_model; ++d) dot += static_cast<double>(qv[d]) * kv[d];
        score[j] = dot * scale;
        max_score = std::max(max_score, score[j]);
      }
      double denom = 0.0;
      for (double& s : score) denom += (s = std::exp(s - max_score));
      double* o = out.data() + (t * c.num_q_heads + h) * d_model;
      for (int64_t d = 0; d < d_model; ++d) {
        double acc = 0.0;
        for (int64_t j = 0; j < len; ++j) {
          acc += score[j] / denom * v_cache[(j * c.num_kv_heads + kvh) * d_model + d];
        }
        o[d] = acc;
      }
    }
  }
  return out;
}

class AttentionTest : public ::testing::TestWithParam<
                          std::tuple<int64_t /*num_kv_heads*/, int64_t /*head_dim*/,
                                     int64_t /*first_pos*/, int64_t /*num_tokens*/, int>> {};

TEST_P(AttentionTest, CausalGqaMatchesFloat64Reference) {
  const auto [num_kv_heads, head_dim, first_pos, num_tokens, num_threads] = GetParam();
  const AttentionCase c{4, num_kv_heads, head_dim, first_pos, num_tokens, num_threads};
  SeededRng rng;
  SCOPED_TRACE(rng.trace());

  // The cache has rows past the last new token; they hold NaN and must never be read.
  const int64_t used_rows = first_pos + num_tokens;
  const int64_t cache_rows = used_rows + 3;
  const size_t row = static_cast<size_t>(num_kv_heads * head_dim);
  std::vector<float> k_cache = rng.normal_vector(cache_rows * row);
  std::vector<float> v_cache = rng.normal_vector(cache_rows * row);
  for (size_t i = used_rows * row; i < cache_rows * row; ++i) k_cache[i] = v_cache[i] = NAN;
  const std::vector<float> q =
      rng.normal_vector(static_cast<size_t>(num_tokens * c.num_q_heads * head_dim), 1.5f);
  const float scale = 1.0f / std::sqrt(static_cast<float>(head_dim));
  std::vector<float> out(q.size());
  poison(out);

  ThreadPool pool(num_threads);
  attention(q.data(), k_cache.data(), v_cache.data(), num_tokens, first_pos, c.num_q_heads,
            num_kv_heads, head_dim, scale, out.data(), pool);

  const std::vector<double> ref = ref_attention(q, k_cache, v_cache, c, scale);
  EXPECT_TRUE(close_rel_l2(out, ref, kTol));
  EXPECT_TRUE(close_elementwise(out, ref, kTol));
}

std::string attention_name(const ::testing::TestParamInfo<AttentionTest::ParamType>& info) {
  const auto [kv, d, first_pos, tokens, threads] = info.param;
  return "kv" + std::to_string(kv) + "_d" + std::to_string(d) + "_pos" + std::to_string(first_pos) +
         "_new" + std::to_string(tokens) + "_t" + std::to_string(threads);
}

INSTANTIATE_TEST_SUITE_P(Cases, AttentionTest,
                         ::testing::Combine(::testing::Values<int64_t>(1, 2, 4),
                                            ::testing::Values<int64_t>(16, 64),
                                            ::testing::Values<int64_t>(0, 5, 37),
                                            ::testing::Values<int64_t>(1, 4),
                                            ::testing::Values(1, 3)),
                         attention_name);

// With a single visible position the softmax is 1 and the output is that position's value row.
TEST(AttentionEdgeTest, FirstTokenCopiesItsValue) {
  SeededRng rng;
  SCOPED_TRACE(rng.trace());
  const int64_t num_q_heads = 4, num_kv_heads = 2, head_dim = 8;
  const std::vector<float> k_cache = rng.normal_vector(num_kv_heads * head_dim);
  const std::vector<float> v_cache = rng.normal_vector(num_kv_heads * head_dim);
  const std::vector<float> q = rng.normal_vector(num_q_heads * head_dim);
  std::vector<float> out(q.size());
  poison(out);
  ThreadPool pool(1);
  attention(q.data(), k_cache.data(), v_cache.data(), 1, 0, num_q_heads, num_kv_heads, head_dim,
            0.35f, out.data(), pool);
  for (int64_t h = 0; h < num_q_heads; ++h) {
    for (int64_t d = 0; d < head_dim; ++d) {
      EXPECT_NEAR(out[h * head_dim + d], v_cache[(h / 2) * head_dim + d], 1e-6)
          << "head " << h << " dim " << d;
    }
  }
}

}  // namespace
}  // namespace flexpert::kernels
