// SPDX-License-Identifier: Apache-2.0
// The kernels of DeepSeek's MLA against float64 references: rope (plain and
// interleaved, scaled), matmul_nt_heads, and mla_attention (causal over a latent
// cache, tiles of rows that straddle tokens).
#include <gtest/gtest.h>

#include <cmath>
#include <vector>

#include "kernel_test_util.h"
#include "kernels/cpu_ops.h"

namespace flexpert::kernels {
namespace {

using testing_util::close_rel_l2;
using testing_util::SeededRng;

TEST(MlaOpsTest, RopeRotatesPairsAndWritesInterleavedDeinterleaved) {
  SeededRng rng;
  SCOPED_TRACE(rng.trace());
  const int64_t T = 5, heads = 3, stride = 11, D = 8;  // Rope part first in each head row.
  const std::vector<double> inv_freq = {1.0, 0.3, 0.05, 0.001};
  const std::vector<int32_t> pos = {0, 1, 7, 30, 511};
  for (bool interleaved : {false, true}) {
    std::vector<float> x(T * heads * stride);
    for (float& v : x) v = rng.normal();
    std::vector<double> want(x.begin(), x.end());
    for (int64_t t = 0; t < T; ++t) {
      for (int64_t h = 0; h < heads; ++h) {
        double* v = want.data() + (t * heads + h) * stride;
        std::vector<double> a(D / 2), b(D / 2);  // The pairs (a_i, b_i) that rotate.
        for (int64_t i = 0; i < D / 2; ++i) {
          a[i] = interleaved ? v[2 * i] : v[i];
          b[i] = interleaved ? v[2 * i + 1] : v[i + D / 2];
        }
        for (int64_t i = 0; i < D / 2; ++i) {
          const double c = std::cos(pos[t] * inv_freq[i]) * 1.5,
                       s = std::sin(pos[t] * inv_freq[i]) * 1.5;
          v[i] = a[i] * c - b[i] * s;
          v[i + D / 2] = b[i] * c + a[i] * s;
        }
      }
    }
    rope(x.data(), T, heads, stride, D, pos.data(), inv_freq.data(), 1.5, interleaved);
    EXPECT_TRUE(close_rel_l2(x, want, 1e-6)) << "interleaved " << interleaved;
  }
}

TEST(MlaOpsTest, MatmulPerHeadWithStrides) {
  SeededRng rng;
  SCOPED_TRACE(rng.trace());
  const int64_t m = 7, heads = 5, n = 6, k = 9;
  const int64_t x_stride = heads * (k + 2), y_stride = heads * (n + 3);
  std::vector<float> x(m * x_stride), w(heads * n * k), y(m * y_stride, 0.f);
  for (float& v : x) v = rng.normal();
  for (float& v : w) v = rng.normal();
  ThreadPool pool(3);
  matmul_nt_heads(x.data(), m, x_stride, k + 2, w.data(), heads, n, k, y.data(), y_stride, n + 3,
                  pool);
  std::vector<double> want(y.size(), 0.0);
  for (int64_t t = 0; t < m; ++t) {
    for (int64_t h = 0; h < heads; ++h) {
      for (int64_t o = 0; o < n; ++o) {
        double s = 0;
        for (int64_t i = 0; i < k; ++i) {
          s += static_cast<double>(x[t * x_stride + h * (k + 2) + i]) * w[(h * n + o) * k + i];
        }
        want[t * y_stride + h * (n + 3) + o] = s;
      }
    }
  }
  EXPECT_TRUE(close_rel_l2(y, want, 1e-6));
}

TEST(MlaOpsTest, AttentionOverTheLatentCacheIsCausal) {
  SeededRng rng;
  SCOPED_TRACE(rng.trace());
  const int64_t latent = 24, rope_dim = 8, dim = latent + rope_dim;
  for (int64_t heads : {1, 3, 16}) {
    for (int64_t first_pos : {0, 5}) {
      const int64_t T = 6, len = first_pos + T;
      std::vector<float> q(T * heads * dim), cache(len * dim), out(T * heads * latent, NAN);
      for (float& v : q) v = rng.normal();
      for (float& v : cache) v = rng.normal();
      const float scale = 0.3f;
      ThreadPool pool(2);
      mla_attention(q.data(), cache.data(), T, first_pos, heads, latent, rope_dim, scale,
                    out.data(), pool);
      std::vector<double> want(out.size(), 0.0);
      for (int64_t t = 0; t < T; ++t) {
        for (int64_t h = 0; h < heads; ++h) {
          const float* qv = q.data() + (t * heads + h) * dim;
          const int64_t n = first_pos + t + 1;
          std::vector<double> p(n);
          double mx = -INFINITY, sum = 0;
          for (int64_t j = 0; j < n; ++j) {
            double s = 0;
            for (int64_t d = 0; d < dim; ++d) s += static_cast<double>(qv[d]) * cache[j * dim + d];
            p[j] = s * scale;
            mx = std::max(mx, p[j]);
          }
          for (double& v : p) sum += v = std::exp(v - mx);
          for (int64_t j = 0; j < n; ++j) {
            for (int64_t d = 0; d < latent; ++d) {
              want[(t * heads + h) * latent + d] += p[j] / sum * cache[j * dim + d];
            }
          }
        }
      }
      EXPECT_TRUE(close_rel_l2(out, want, 1e-5)) << "heads " << heads << " first_pos " << first_pos;
    }
  }
}

}  // namespace
}  // namespace flexpert::kernels
