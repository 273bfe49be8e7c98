// SPDX-License-Identifier: Apache-2.0
// DeepseekV3Model against a naive float64 forward pass written here from the
// transformers modeling code (expanded, non-absorbed MLA; RoPE as interleave +
// rotate_half for V3, as complex pairs for V2; YaRN; every router variant). The naive
// pass is first checked against Hugging Face's reference of testdata/deepseekv3-tiny,
// then covers what that fixture does not: DeepSeek-V2 (q_proj without q LoRA,
// softmax routing, greedy and group-limited), YaRN with an attention factor, plain
// (non-interleaved) RoPE and moe_layer_freq, on synthetic checkpoints.
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <numbers>
#include <numeric>

#include "checkpoint/synth.h"
#include "reference_util.h"

namespace flexpert {
namespace {

using namespace model_test;
using Vec = std::vector<double>;

const std::string kFixture = std::string(FLEXPERT_TESTDATA_DIR) + "/deepseekv3-tiny";

class Naive {
 public:
  Naive(const Checkpoint& ck, const ModelConfig& c) : ck_(ck), c_(c) {}

  // Last-position logits of one prompt.
  Vec forward(const std::vector<int32_t>& ids) {
    const int64_t T = static_cast<int64_t>(ids.size()), H = c_.hidden_size;
    Vec x(T * H);
    const Vec embed = w("model.embed_tokens.weight");
    for (int64_t t = 0; t < T; ++t) {
      std::copy_n(embed.begin() + ids[t] * H, H, x.begin() + t * H);
    }
    for (int l = 0; l < c_.num_hidden_layers; ++l) {
      const std::string p = "model.layers." + std::to_string(l) + ".";
      Vec h = rms_norm(x, w(p + "input_layernorm.weight"), c_.rms_norm_eps);
      add(&x, attention(p + "self_attn.", h, T));
      h = rms_norm(x, w(p + "post_attention_layernorm.weight"), c_.rms_norm_eps);
      add(&x, c_.is_moe_layer(l) ? moe(p + "mlp.", h, T) : mlp(p + "mlp.", h, T));
    }
    Vec last(x.end() - H, x.end());
    return linear(rms_norm(last, w("model.norm.weight"), c_.rms_norm_eps), w("lm_head.weight"),
                  c_.vocab_size);
  }

 private:
  Vec w(const std::string& name) const {
    auto t = ck_.get(name);
    EXPECT_TRUE(t.ok()) << name;
    const Tensor f = t.value().to(DType::kF32);
    return Vec(f.data<float>(), f.data<float>() + f.numel());
  }

  // y[t, o] = sum_i x[t, i] W[o, i] with W [out, in].
  static Vec linear(const Vec& x, const Vec& W, int64_t out) {
    const int64_t in = static_cast<int64_t>(W.size()) / out,
                  T = static_cast<int64_t>(x.size()) / in;
    Vec y(T * out, 0.0);
    for (int64_t t = 0; t < T; ++t) {
      for (int64_t o = 0; o < out; ++o) {
        double s = 0;
        for (int64_t i = 0; i < in; ++i) s += x[t * in + i] * W[o * in + i];
        y[t * out + o] = s;
      }
    }
    return y;
  }

  static Vec rms_norm(const Vec& x, const Vec& weight, double eps) {
    const int64_t D = static_cast<int64_t>(weight.size()), T = static_cast<int64_t>(x.size()) / D;
    Vec y(x.size());
    for (int64_t t = 0; t < T; ++t) {
      double ss = 0;
      for (int64_t i = 0; i < D; ++i) ss += x[t * D + i] * x[t * D + i];
      const double inv = 1 / std::sqrt(ss / D + eps);
      for (int64_t i = 0; i < D; ++i) y[t * D + i] = x[t * D + i] * inv * weight[i];
    }
    return y;
  }

  static void add(Vec* x, const Vec& y) {
    for (size_t i = 0; i < x->size(); ++i) (*x)[i] += y[i];
  }

  static double mscale(double scale, double m) {
    return scale <= 1 ? 1.0 : 0.1 * m * std::log(scale) + 1.0;
  }

  // transformers' _compute_yarn_parameters / default RoPE, and the attention factor.
  Vec inv_freq(double* attention_factor) const {
    const int dim = c_.qk_rope_head_dim;
    const double base = c_.rope_theta;
    Vec f(dim / 2);
    for (int i = 0; i < dim / 2; ++i) f[i] = 1.0 / std::pow(base, 2.0 * i / dim);
    *attention_factor = 1.0;
    const RopeScaling& r = c_.rope_scaling;
    if (r.type != "yarn") return f;
    const double orig = r.original_max_position_embeddings;
    *attention_factor = r.mscale && r.mscale_all_dim
                            ? mscale(r.factor, r.mscale) / mscale(r.factor, r.mscale_all_dim)
                            : mscale(r.factor, 1.0);
    auto corr = [&](double rot) {
      return dim * std::log(orig / (rot * 2 * std::numbers::pi)) / (2 * std::log(base));
    };
    const double low = std::max(std::floor(corr(r.beta_fast)), 0.0);
    double high = std::min(std::ceil(corr(r.beta_slow)), dim - 1.0);
    if (low == high) high += 0.001;
    for (int i = 0; i < dim / 2; ++i) {
      const double extra = 1 - std::clamp((i - low) / (high - low), 0.0, 1.0);
      f[i] = f[i] / r.factor * (1 - extra) + f[i] * extra;
    }
    return f;
  }

  // Rotates x[0, D) at position `pos` as the family's modeling code does.
  void rope(double* x, int pos) const {
    const int D = c_.qk_rope_head_dim, half = D / 2;
    double af = 1;
    const Vec f = inv_freq(&af);
    Vec out(D);
    if (c_.model_type == "deepseek_v2") {  // view_as_complex: pairs (2i, 2i+1), kept in place.
      for (int i = 0; i < half; ++i) {
        const double c = std::cos(pos * f[i]) * af, s = std::sin(pos * f[i]) * af;
        out[2 * i] = x[2 * i] * c - x[2 * i + 1] * s;
        out[2 * i + 1] = x[2 * i] * s + x[2 * i + 1] * c;
      }
    } else {
      Vec y(x, x + D);
      if (c_.rope_interleave) {  // view(d/2, 2).transpose: evens, then odds.
        for (int i = 0; i < half; ++i) {
          y[i] = x[2 * i];
          y[i + half] = x[2 * i + 1];
        }
      }
      for (int i = 0; i < D; ++i) {
        const double c = std::cos(pos * f[i % half]) * af, s = std::sin(pos * f[i % half]) * af;
        const double rotated = i < half ? -y[i + half] : y[i - half];
        out[i] = y[i] * c + rotated * s;
      }
    }
    std::copy(out.begin(), out.end(), x);
  }

  Vec attention(const std::string& p, const Vec& h, int64_t T) const {
    const int64_t nh = c_.num_attention_heads, dn = c_.qk_nope_head_dim, dr = c_.qk_rope_head_dim;
    const int64_t dv = c_.v_head_dim, r = c_.kv_lora_rank, dq = dn + dr;
    Vec q;
    if (c_.q_lora_rank > 0) {
      const Vec qa = rms_norm(linear(h, w(p + "q_a_proj.weight"), c_.q_lora_rank),
                              w(p + "q_a_layernorm.weight"), 1e-6);
      q = linear(qa, w(p + "q_b_proj.weight"), nh * dq);
    } else {
      q = linear(h, w(p + "q_proj.weight"), nh * dq);
    }
    const Vec ckv = linear(h, w(p + "kv_a_proj_with_mqa.weight"), r + dr);
    Vec latent(T * r), k_pe(T * dr);
    for (int64_t t = 0; t < T; ++t) {
      std::copy_n(ckv.begin() + t * (r + dr), r, latent.begin() + t * r);
      std::copy_n(ckv.begin() + t * (r + dr) + r, dr, k_pe.begin() + t * dr);
      rope(k_pe.data() + t * dr, static_cast<int>(t));
      for (int64_t hd = 0; hd < nh; ++hd)
        rope(q.data() + (t * nh + hd) * dq + dn, static_cast<int>(t));
    }
    const Vec kv = linear(rms_norm(latent, w(p + "kv_a_layernorm.weight"), 1e-6),
                          w(p + "kv_b_proj.weight"), nh * (dn + dv));
    double scale = 1 / std::sqrt(static_cast<double>(dq));
    if (c_.rope_scaling.type == "yarn" && c_.rope_scaling.mscale_all_dim) {
      const double m = mscale(c_.rope_scaling.factor, c_.rope_scaling.mscale_all_dim);
      scale *= m * m;
    }
    Vec out(T * nh * dv, 0.0);
    for (int64_t hd = 0; hd < nh; ++hd) {
      for (int64_t i = 0; i < T; ++i) {
        const double* qi = q.data() + (i * nh + hd) * dq;
        Vec s(i + 1);
        for (int64_t j = 0; j <= i; ++j) {
          const double* kj = kv.data() + (j * nh + hd) * (dn + dv);
          double dot = 0;
          for (int64_t d = 0; d < dn; ++d) dot += qi[d] * kj[d];
          for (int64_t d = 0; d < dr; ++d) dot += qi[dn + d] * k_pe[j * dr + d];
          s[j] = dot * scale;
        }
        const double mx = *std::max_element(s.begin(), s.end());
        double sum = 0;
        for (double& v : s) sum += v = std::exp(v - mx);
        for (int64_t j = 0; j <= i; ++j) {
          const double* vj = kv.data() + (j * nh + hd) * (dn + dv) + dn;
          for (int64_t d = 0; d < dv; ++d) out[(i * nh + hd) * dv + d] += s[j] / sum * vj[d];
        }
      }
    }
    return linear(out, w(p + "o_proj.weight"), c_.hidden_size);
  }

  Vec mlp(const std::string& p, const Vec& h, int64_t T) const {
    const Vec gate = w(p + "gate_proj.weight");
    const int64_t inter = static_cast<int64_t>(gate.size()) / c_.hidden_size;
    Vec g = linear(h, gate, inter);
    const Vec u = linear(h, w(p + "up_proj.weight"), inter);
    for (size_t i = 0; i < g.size(); ++i) g[i] = g[i] / (1 + std::exp(-g[i])) * u[i];
    return linear(g, w(p + "down_proj.weight"), c_.hidden_size);
  }

  Vec moe(const std::string& p, const Vec& h, int64_t T) const {
    const int64_t H = c_.hidden_size, E = c_.num_experts, K = c_.num_experts_per_tok;
    const Vec logits = linear(h, w(p + "gate.weight"), E);
    const bool noaux = c_.topk_method == "noaux_tc";
    const Vec bias = noaux ? w(p + "gate.e_score_correction_bias") : Vec(E, 0.0);
    Vec out = c_.num_shared_experts > 0 ? mlp(p + "shared_experts.", h, T) : Vec(T * H, 0.0);
    for (int64_t t = 0; t < T; ++t) {
      Vec score(E), choice(E);
      double mx = -INFINITY, sum = 0;
      for (int64_t e = 0; e < E; ++e) mx = std::max(mx, logits[t * E + e]);
      for (int64_t e = 0; e < E; ++e) {
        if (c_.scoring_func == "softmax") {
          sum += score[e] = std::exp(logits[t * E + e] - mx);
        } else {
          score[e] = 1 / (1 + std::exp(-logits[t * E + e]));
        }
      }
      if (c_.scoring_func == "softmax") {
        for (double& s : score) s /= sum;
      }
      for (int64_t e = 0; e < E; ++e) choice[e] = score[e] + bias[e];
      std::vector<int> allowed(E);
      std::iota(allowed.begin(), allowed.end(), 0);
      if (c_.topk_method != "greedy") {
        const int64_t G = c_.n_group, size = E / G;
        std::vector<std::pair<double, int>> groups;
        for (int64_t g = 0; g < G; ++g) {
          Vec cg(choice.begin() + g * size, choice.begin() + (g + 1) * size);
          std::sort(cg.rbegin(), cg.rend());
          groups.push_back({noaux ? cg[0] + cg[1] : cg[0], static_cast<int>(g)});
        }
        std::sort(groups.begin(), groups.end(), [](auto a, auto b) { return a.first > b.first; });
        allowed.clear();
        for (int i = 0; i < c_.topk_group; ++i) {
          for (int64_t e = 0; e < size; ++e) allowed.push_back(groups[i].second * size + e);
        }
      }
      std::sort(allowed.begin(), allowed.end(),
                [&](int a, int b) { return choice[a] > choice[b]; });
      double top = 0;
      for (int64_t k = 0; k < K; ++k) top += score[allowed[k]];
      const Vec row(h.begin() + t * H, h.begin() + (t + 1) * H);
      for (int64_t k = 0; k < K; ++k) {
        const int e = allowed[k];
        const double weight = score[e] / (c_.norm_topk_prob ? top : 1.0) * c_.routed_scaling_factor;
        const Vec y = mlp(p + "experts." + std::to_string(e) + ".", row, 1);
        for (int64_t i = 0; i < H; ++i) out[t * H + i] += weight * y[i];
      }
    }
    return out;
  }

  const Checkpoint& ck_;
  const ModelConfig& c_;
};

// The model's and the naive pass's last-position logits for a few prompts.
void expect_matches_naive(const std::string& dir, double tol) {
  auto config = ModelConfig::load(dir);
  auto ckpt = Checkpoint::open(dir);
  ASSERT_TRUE(config.ok() && ckpt.ok()) << config.status().to_string();
  Naive naive(**ckpt, *config);
  auto model = load(dir, "replicate:5:1");
  ASSERT_NE(model, nullptr);
  for (const RefPrompt& p : load_reference(kFixture)) {
    const Vec want = naive.forward(p.input_ids);
    const double err = rel_l2(prompt_logits(*model, p.input_ids).data(), want);
    std::printf("  %s: relative L2 vs naive float64 = %.3g\n", config->model_type.c_str(), err);
    EXPECT_LT(err, tol);
  }
}

TEST(DeepseekNaiveTest, NaivePassMatchesHuggingFace) {
  auto config = ModelConfig::load(kFixture);
  auto ckpt = Checkpoint::open(kFixture);
  ASSERT_TRUE(config.ok() && ckpt.ok());
  Naive naive(**ckpt, *config);
  for (const RefPrompt& p : load_reference(kFixture)) {
    const Vec got = naive.forward(p.input_ids);
    std::vector<float> as_float(got.begin(), got.end());
    EXPECT_LT(rel_l2(as_float.data(), p.logits), 1e-6);
  }
}

// The deepseek-tiny shapes with the options under test.
std::string write_variant(const std::string& name, const std::function<void(ModelConfig*)>& edit) {
  ModelConfig c = synth_preset_config("deepseek-tiny").value();
  edit(&c);
  const std::string dir = ::testing::TempDir() + "/deepseek-naive-" + name;
  SynthOptions options;
  options.out_dir = dir;
  options.dtype = DType::kF32;
  options.seed = 5;
  options.config = c;
  Status s = synthesize_checkpoint(options);
  EXPECT_TRUE(s.ok()) << s.to_string();
  return dir;
}

RopeScaling yarn(double factor, double mscale, double mscale_all_dim) {
  RopeScaling r;
  r.type = "yarn";
  r.factor = factor;
  r.original_max_position_embeddings = 256;
  r.mscale = mscale;
  r.mscale_all_dim = mscale_all_dim;
  return r;
}

TEST(DeepseekNaiveTest, V2LiteStyle) {
  // No q LoRA, softmax + greedy routing, unnormalized weights, two shared experts,
  // complex-pair RoPE with YaRN (mscale = mscale_all_dim: attention factor 1).
  const std::string dir = write_variant("v2lite", [](ModelConfig* c) {
    c->model_type = "deepseek_v2";
    c->q_lora_rank = 0;
    c->topk_method = "greedy";
    c->scoring_func = "softmax";
    c->n_group = 1;
    c->topk_group = 1;
    c->norm_topk_prob = false;
    c->routed_scaling_factor = 1.0;
    c->num_shared_experts = 2;
    c->rope_scaling = yarn(4.0, 0.707, 0.707);
  });
  expect_matches_naive(dir, 1e-4);
  std::filesystem::remove_all(dir);
}

TEST(DeepseekNaiveTest, V2GroupLimitedGreedy) {
  const std::string dir = write_variant("v2group", [](ModelConfig* c) {
    c->model_type = "deepseek_v2";
    c->topk_method = "group_limited_greedy";
    c->scoring_func = "softmax";
    c->n_group = 4;
    c->topk_group = 2;
    c->norm_topk_prob = false;
    c->routed_scaling_factor = 16.0;
  });
  expect_matches_naive(dir, 1e-4);
  std::filesystem::remove_all(dir);
}

TEST(DeepseekNaiveTest, V3PlainRopeYarnAttentionFactorAndLayerFrequency) {
  // rope_interleave=false, YaRN with an attention factor != 1 (cos/sin scaled) and
  // a softmax mscale, MoE every other layer after the dense one.
  const std::string dir = write_variant("v3plain", [](ModelConfig* c) {
    c->rope_interleave = false;
    c->rope_scaling = yarn(8.0, 1.0, 0.5);
    c->num_hidden_layers = 4;
    c->moe_layer_freq = 2;
  });
  auto config = ModelConfig::load(dir);
  ASSERT_TRUE(config.ok());
  EXPECT_FALSE(config->is_moe_layer(1));
  EXPECT_TRUE(config->is_moe_layer(2));
  expect_matches_naive(dir, 1e-4);
  std::filesystem::remove_all(dir);
}

}  // namespace
}  // namespace flexpert
