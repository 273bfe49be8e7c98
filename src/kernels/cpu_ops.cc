// SPDX-License-Identifier: Apache-2.0
#include "cpu_ops.h"

#include <cblas.h>

#include <algorithm>
#include <cmath>
#include <cstring>
#include <numeric>
#include <vector>

#include "flexpert/logging.h"

namespace flexpert::kernels {
namespace {

// OpenBLAS runs single-threaded inside flexpert: our pool owns the cores, and
// concurrent BLAS calls from pool threads must not each spawn their own threads.
void init_blas_once() {
  static const bool done = [] {
    openblas_set_num_threads(1);
    return true;
  }();
  (void)done;
}

// Output columns per task: small enough that a converted weight panel (cols x k
// floats) stays in L2, large enough to amortise the BLAS call.
int64_t column_block(int64_t k) {
  int64_t cols = (256 * 1024) / (k * 4);
  cols = std::clamp<int64_t>(cols, 16, 512);
  return cols / 16 * 16;
}

std::vector<float>& scratch(size_t n) {
  thread_local std::vector<float> buf;
  if (buf.size() < n) buf.resize(n);
  return buf;
}

}  // namespace

void matmul_nt(const float* x, int64_t m, int64_t k, const Tensor& w, float* y, ThreadPool& pool) {
  init_blas_once();
  FLEX_CHECK(w.dim() == 2 && w.size(1) == k && w.is_contiguous())
      << "weight " << shape_to_string(w.shape()) << " vs k=" << k;
  FLEX_CHECK(w.dtype() != DType::kF8E4M3) << "FP8 weights must be dequantized at load";
  const int64_t n = w.size(0);
  if (m == 0 || n == 0) return;
  const int64_t block = column_block(k);
  const int64_t num_blocks = (n + block - 1) / block;
  const size_t elem = dtype_size(w.dtype());
  pool.parallel_for(num_blocks, 1, [&](int64_t b0, int64_t b1) {
    for (int64_t b = b0; b < b1; ++b) {
      const int64_t n0 = b * block;
      const int64_t nc = std::min(block, n - n0);
      const char* wsrc = static_cast<const char*>(w.raw()) + n0 * k * elem;
      const float* wp;
      if (w.dtype() == DType::kF32) {
        wp = reinterpret_cast<const float*>(wsrc);
      } else {
        std::vector<float>& buf = scratch(static_cast<size_t>(nc * k));
        convert_to_f32(w.dtype(), wsrc, buf.data(), static_cast<size_t>(nc * k));
        wp = buf.data();
      }
      if (m == 1) {
        cblas_sgemv(CblasRowMajor, CblasNoTrans, static_cast<int>(nc), static_cast<int>(k), 1.0f,
                    wp, static_cast<int>(k), x, 1, 0.0f, y + n0, 1);
      } else {
        cblas_sgemm(CblasRowMajor, CblasNoTrans, CblasTrans, static_cast<int>(m),
                    static_cast<int>(nc), static_cast<int>(k), 1.0f, x, static_cast<int>(k), wp,
                    static_cast<int>(k), 0.0f, y + n0, static_cast<int>(n));
      }
    }
  });
}

void rms_norm(const float* x, const float* weight, int64_t rows, int64_t dim, float eps,
              float* out) {
  for (int64_t r = 0; r < rows; ++r) {
    const float* xr = x + r * dim;
    double ss = 0.0;
    for (int64_t i = 0; i < dim; ++i) ss += static_cast<double>(xr[i]) * xr[i];
    const float inv = static_cast<float>(1.0 / std::sqrt(ss / static_cast<double>(dim) + eps));
    float* o = out + r * dim;
    for (int64_t i = 0; i < dim; ++i) o[i] = xr[i] * inv * weight[i];
  }
}

void rope_rotate_half(float* x, int64_t num_tokens, int64_t num_heads, int64_t head_dim,
                      const int32_t* positions, double theta) {
  const int64_t half = head_dim / 2;
  std::vector<float> cosv(half), sinv(half);
  for (int64_t t = 0; t < num_tokens; ++t) {
    for (int64_t i = 0; i < half; ++i) {
      const double inv_freq = std::pow(theta, -2.0 * static_cast<double>(i) / head_dim);
      const double angle = static_cast<double>(positions[t]) * inv_freq;
      cosv[i] = static_cast<float>(std::cos(angle));
      sinv[i] = static_cast<float>(std::sin(angle));
    }
    for (int64_t h = 0; h < num_heads; ++h) {
      float* v = x + (t * num_heads + h) * head_dim;
      for (int64_t i = 0; i < half; ++i) {
        const float a = v[i];
        const float b = v[i + half];
        v[i] = a * cosv[i] - b * sinv[i];
        v[i + half] = b * cosv[i] + a * sinv[i];
      }
    }
  }
}

void rope(float* x, int64_t num_tokens, int64_t num_heads, int64_t head_stride, int64_t rope_dim,
          const int32_t* positions, const double* inv_freq, double scale, bool interleaved) {
  const int64_t half = rope_dim / 2;
  std::vector<float> cosv(half), sinv(half), pair(rope_dim);
  for (int64_t t = 0; t < num_tokens; ++t) {
    for (int64_t i = 0; i < half; ++i) {
      const double angle = static_cast<double>(positions[t]) * inv_freq[i];
      cosv[i] = static_cast<float>(std::cos(angle) * scale);
      sinv[i] = static_cast<float>(std::sin(angle) * scale);
    }
    for (int64_t h = 0; h < num_heads; ++h) {
      float* v = x + (t * num_heads + h) * head_stride;
      if (interleaved) {
        for (int64_t i = 0; i < half; ++i) {
          pair[i] = v[2 * i];
          pair[i + half] = v[2 * i + 1];
        }
        std::copy(pair.begin(), pair.end(), v);
      }
      for (int64_t i = 0; i < half; ++i) {
        const float a = v[i];
        const float b = v[i + half];
        v[i] = a * cosv[i] - b * sinv[i];
        v[i + half] = b * cosv[i] + a * sinv[i];
      }
    }
  }
}

void matmul_nt_heads(const float* x, int64_t m, int64_t x_row_stride, int64_t x_head_stride,
                     const float* w, int64_t num_heads, int64_t n, int64_t k, float* y,
                     int64_t y_row_stride, int64_t y_head_stride, ThreadPool& pool) {
  init_blas_once();
  if (m == 0) return;
  pool.parallel_for(num_heads, 1, [&](int64_t h0, int64_t h1) {
    for (int64_t h = h0; h < h1; ++h) {
      cblas_sgemm(CblasRowMajor, CblasNoTrans, CblasTrans, static_cast<int>(m), static_cast<int>(n),
                  static_cast<int>(k), 1.0f, x + h * x_head_stride, static_cast<int>(x_row_stride),
                  w + h * n * k, static_cast<int>(k), 0.0f, y + h * y_head_stride,
                  static_cast<int>(y_row_stride));
    }
  });
}

void mla_attention(const float* q, const float* cache, int64_t num_tokens, int64_t first_pos,
                   int64_t num_heads, int64_t latent_dim, int64_t rope_dim, float scale, float* out,
                   ThreadPool& pool) {
  init_blas_once();
  const int64_t dim = latent_dim + rope_dim;
  const int64_t rows = num_tokens * num_heads;
  if (rows == 0) return;
  // Rows (token, head) in tiles: one GEMM scores a tile against the cache, one more
  // sums the latents. Every head reads the same rows, so a tile shares its loads.
  const int64_t tile = std::clamp<int64_t>(rows / (4 * pool.num_threads()), 1, 32);
  const int64_t num_tiles = (rows + tile - 1) / tile;
  pool.parallel_for(num_tiles, 1, [&](int64_t b0, int64_t b1) {
    for (int64_t b = b0; b < b1; ++b) {
      const int64_t r0 = b * tile;
      const int64_t nr = std::min(tile, rows - r0);
      const int64_t len = first_pos + (r0 + nr - 1) / num_heads + 1;  // Longest row of the tile.
      std::vector<float>& p = scratch(static_cast<size_t>(nr * len));
      cblas_sgemm(CblasRowMajor, CblasNoTrans, CblasTrans, static_cast<int>(nr),
                  static_cast<int>(len), static_cast<int>(dim), scale, q + r0 * dim,
                  static_cast<int>(dim), cache, static_cast<int>(dim), 0.0f, p.data(),
                  static_cast<int>(len));
      for (int64_t r = 0; r < nr; ++r) {
        float* pr = p.data() + r * len;
        const int64_t row_len = first_pos + (r0 + r) / num_heads + 1;
        const float max_score = *std::max_element(pr, pr + row_len);
        double sum = 0.0;
        for (int64_t j = 0; j < row_len; ++j) {
          pr[j] = std::exp(pr[j] - max_score);
          sum += pr[j];
        }
        const float inv = static_cast<float>(1.0 / sum);
        for (int64_t j = 0; j < row_len; ++j) pr[j] *= inv;
        std::fill(pr + row_len, pr + len, 0.0f);  // Causal: later positions weigh nothing.
      }
      cblas_sgemm(CblasRowMajor, CblasNoTrans, CblasNoTrans, static_cast<int>(nr),
                  static_cast<int>(latent_dim), static_cast<int>(len), 1.0f, p.data(),
                  static_cast<int>(len), cache, static_cast<int>(dim), 0.0f, out + r0 * latent_dim,
                  static_cast<int>(latent_dim));
    }
  });
}

void attention(const float* q, const float* k_cache, const float* v_cache, int64_t num_tokens,
               int64_t first_pos, int64_t num_q_heads, int64_t num_kv_heads, int64_t head_dim,
               float scale, float* out, ThreadPool& pool) {
  const int64_t group = num_q_heads / num_kv_heads;
  const int64_t kv_stride = num_kv_heads * head_dim;
  pool.parallel_for(num_tokens * num_q_heads, 1, [&](int64_t i0, int64_t i1) {
    for (int64_t idx = i0; idx < i1; ++idx) {
      const int64_t t = idx / num_q_heads;
      const int64_t h = idx % num_q_heads;
      const int64_t kvh = h / group;
      const int64_t len = first_pos + t + 1;
      const float* qv = q + idx * head_dim;
      std::vector<float>& p = scratch(static_cast<size_t>(len));
      float max_score = -INFINITY;
      for (int64_t j = 0; j < len; ++j) {
        const float* kv = k_cache + j * kv_stride + kvh * head_dim;
        float s = 0.f;
        for (int64_t d = 0; d < head_dim; ++d) s += qv[d] * kv[d];
        p[j] = s * scale;
        max_score = std::max(max_score, p[j]);
      }
      double sum = 0.0;
      for (int64_t j = 0; j < len; ++j) {
        p[j] = std::exp(p[j] - max_score);
        sum += p[j];
      }
      const float inv = static_cast<float>(1.0 / sum);
      float* o = out + idx * head_dim;
      std::fill(o, o + head_dim, 0.f);
      for (int64_t j = 0; j < len; ++j) {
        const float pj = p[j] * inv;
        const float* vv = v_cache + j * kv_stride + kvh * head_dim;
        for (int64_t d = 0; d < head_dim; ++d) o[d] += pj * vv[d];
      }
    }
  });
}

void silu_mul(const float* gate, const float* up, int64_t n, float* out) {
  for (int64_t i = 0; i < n; ++i) {
    const float g = gate[i];
    out[i] = g / (1.0f + std::exp(-g)) * up[i];
  }
}

void router_topk(const float* logits, int64_t num_tokens, int64_t num_experts, int64_t k,
                 bool norm_topk_prob, int32_t* ids, float* weights) {
  std::vector<float> prob(num_experts);
  std::vector<int32_t> order(num_experts);
  for (int64_t t = 0; t < num_tokens; ++t) {
    const float* l = logits + t * num_experts;
    const float mx = *std::max_element(l, l + num_experts);
    double sum = 0.0;
    for (int64_t e = 0; e < num_experts; ++e) {
      prob[e] = std::exp(l[e] - mx);
      sum += prob[e];
    }
    for (int64_t e = 0; e < num_experts; ++e) prob[e] = static_cast<float>(prob[e] / sum);
    std::iota(order.begin(), order.end(), 0);
    std::partial_sort(order.begin(), order.begin() + k, order.end(), [&](int32_t a, int32_t b) {
      return prob[a] > prob[b] || (prob[a] == prob[b] && a < b);
    });
    double top_sum = 0.0;
    for (int64_t j = 0; j < k; ++j) top_sum += prob[order[j]];
    for (int64_t j = 0; j < k; ++j) {
      ids[t * k + j] = order[j];
      weights[t * k + j] =
          norm_topk_prob ? static_cast<float>(prob[order[j]] / top_sum) : prob[order[j]];
    }
  }
}

void embedding(const Tensor& table, const int32_t* ids, int64_t num_tokens, float* out) {
  const int64_t dim = table.size(1);
  const size_t row_bytes = static_cast<size_t>(dim) * dtype_size(table.dtype());
  for (int64_t t = 0; t < num_tokens; ++t) {
    FLEX_CHECK(ids[t] >= 0 && ids[t] < table.size(0)) << "token id " << ids[t];
    const char* row = static_cast<const char*>(table.raw()) + ids[t] * row_bytes;
    convert_to_f32(table.dtype(), row, out + t * dim, static_cast<size_t>(dim));
  }
}

int64_t argmax(const float* x, int64_t n) {
  int64_t best = -1;
  for (int64_t i = 0; i < n; ++i) {
    if (!std::isnan(x[i]) && (best < 0 || x[i] > x[best])) best = i;
  }
  return best < 0 ? 0 : best;
}

int32_t sample_truncated(const float* logits, int64_t vocab, float temperature, int top_k,
                         float top_p, double u01,
                         std::vector<std::pair<uint32_t, int32_t>>* scratch) {
  const bool cut_k = top_k > 0 && top_k < vocab;
  if (!cut_k && !(top_p < 1.0f)) return sample_softmax(logits, vocab, temperature, u01);
  // Rank order as a key: the float's bits mapped so that a larger key ranks first; NaN
  // lowest (below -inf), -0 as +0 (the device's order too).
  auto rank_key = [](float v) -> uint32_t {
    if (std::isnan(v)) return 0u;
    const float f = v == 0.f ? 0.f : v;
    uint32_t u;
    std::memcpy(&u, &f, sizeof(u));
    return (u & 0x80000000u) ? ~u : (u | 0x80000000u);
  };
  using Candidate = std::pair<uint32_t, int32_t>;  // (rank key, id)
  auto before = [](const Candidate& a, const Candidate& b) {
    return a.first > b.first || (a.first == b.first && a.second < b.second);
  };
  const float mx = logits[argmax(logits, vocab)];
  const double inv_t = 1.0 / temperature;
  auto weight = [&](int64_t i) {
    return std::isnan(logits[i]) ? 0.0 : std::exp((logits[i] - mx) * inv_t);
  };
  // Members of a cut after candidate `last`: every id not ranking after it.
  auto member = [&](int64_t i, const Candidate& last) {
    return !before(last, {rank_key(logits[i]), static_cast<int32_t>(i)});
  };
  std::vector<Candidate> local;
  std::vector<Candidate>& cand = scratch != nullptr ? *scratch : local;
  cand.resize(static_cast<size_t>(vocab));
  for (int64_t i = 0; i < vocab; ++i) cand[i] = {rank_key(logits[i]), static_cast<int32_t>(i)};
  size_t keep = static_cast<size_t>(vocab), sorted = 0;
  if (cut_k) {
    keep = static_cast<size_t>(top_k);
    std::partial_sort(cand.begin(), cand.begin() + keep, cand.end(), before);
    sorted = keep;
  }
  Candidate last{0u, static_cast<int32_t>(vocab)};  // Everything.
  if (cut_k) last = cand[keep - 1];
  if (top_p < 1.0f) {
    double total = 0.0;  // K's weight, in id order.
    for (int64_t i = 0; i < vocab; ++i) {
      if (member(i, last)) total += weight(i);
    }
    const double target = static_cast<double>(top_p) * total;
    // The first candidate at which the running weight reaches the target: sort the first
    // 64, 512, ... of K until the prefix reaches it (no full sort of the vocabulary).
    for (size_t m = std::min<size_t>(keep, 64);; m = std::min(keep, m * 8)) {
      if (m > sorted) {
        std::partial_sort(cand.begin() + sorted, cand.begin() + m, cand.begin() + keep, before);
        sorted = m;
      }
      double acc = 0.0;
      size_t i = 0;
      while (i < m && acc < target) acc += weight(cand[i++].second);
      if (acc >= target || m == keep) {
        last = cand[std::max<size_t>(i, 1) - 1];
        break;
      }
    }
  }
  double mass = 0.0;
  for (int64_t i = 0; i < vocab; ++i) {
    if (member(i, last)) mass += weight(i);
  }
  const double target = u01 * mass;
  double acc = 0.0;
  int32_t pick = last.second;
  for (int64_t i = 0; i < vocab; ++i) {
    if (!member(i, last)) continue;
    acc += weight(i);
    pick = static_cast<int32_t>(i);
    if (target < acc) break;
  }
  return pick;
}

int32_t sample_softmax(const float* logits, int64_t vocab, float temperature, double u01) {
  const float mx = logits[argmax(logits, vocab)];
  const double inv_t = 1.0 / temperature;
  auto weight = [&](int64_t i) {  // NaN: weight 0 (never drawn while another id can be).
    return std::isnan(logits[i]) ? 0.0 : std::exp((logits[i] - mx) * inv_t);
  };
  double total = 0.0;
  for (int64_t i = 0; i < vocab; ++i) total += weight(i);
  const double target = u01 * total;
  double acc = 0.0;
  for (int64_t i = 0; i < vocab; ++i) {
    acc += weight(i);
    if (target < acc) return static_cast<int32_t>(i);
  }
  return static_cast<int32_t>(vocab - 1);
}

}  // namespace flexpert::kernels
