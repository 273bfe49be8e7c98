// SPDX-License-Identifier: Apache-2.0
#include "checkpoint/synth.h"

#include <cmath>
#include <cstdio>
#include <cstring>
#include <filesystem>
#include <memory>
#include <mutex>
#include <nlohmann/json.hpp>
#include <string_view>
#include <vector>

#include "file_util.h"
#include "flexpert/checkpoint.h"
#include "flexpert/thread_pool.h"

namespace flexpert {
namespace {

namespace fs = std::filesystem;

enum class Init { kNorm, kLinear, kRouter, kEmbedding, kBias };

struct TensorSpec {
  std::string name;
  Shape shape;
  Init init;
  bool projection = false;  // A 2-D projection weight: FP8-quantized with --fp8.
  bool f32 = false;         // Always F32 (DeepSeek-V3's e_score_correction_bias).
};

// Hugging Face Qwen3MoeForCausalLM's state dict, in layer order so that a shard
// holds whole consecutive layers. Projections as Qwen3's FP8 checkpoints quantize them
// (attention, experts, dense MLP; not the router, norms, embedding or LM head).
std::vector<TensorSpec> qwen3_moe_tensors(const ModelConfig& c) {
  const int64_t h = c.hidden_size;
  const int64_t q_dim = int64_t{c.num_attention_heads} * c.head_dim;
  const int64_t kv_dim = int64_t{c.num_key_value_heads} * c.head_dim;
  std::vector<TensorSpec> specs;
  auto proj = [&](std::string name, Shape shape) {
    specs.push_back({std::move(name), std::move(shape), Init::kLinear, true});
  };
  specs.push_back({"model.embed_tokens.weight", {c.vocab_size, h}, Init::kEmbedding});
  for (int layer = 0; layer < c.num_hidden_layers; ++layer) {
    const std::string p = "model.layers." + std::to_string(layer) + ".";
    specs.push_back({p + "input_layernorm.weight", {h}, Init::kNorm});
    proj(p + "self_attn.q_proj.weight", {q_dim, h});
    proj(p + "self_attn.k_proj.weight", {kv_dim, h});
    proj(p + "self_attn.v_proj.weight", {kv_dim, h});
    proj(p + "self_attn.o_proj.weight", {h, q_dim});
    specs.push_back({p + "self_attn.q_norm.weight", {c.head_dim}, Init::kNorm});
    specs.push_back({p + "self_attn.k_norm.weight", {c.head_dim}, Init::kNorm});
    specs.push_back({p + "post_attention_layernorm.weight", {h}, Init::kNorm});
    if (c.is_moe_layer(layer)) {
      const int64_t inter = c.moe_intermediate_size;
      specs.push_back({p + "mlp.gate.weight", {c.num_experts, h}, Init::kRouter});
      for (int e = 0; e < c.num_experts; ++e) {
        const std::string pe = p + "mlp.experts." + std::to_string(e) + ".";
        proj(pe + "gate_proj.weight", {inter, h});
        proj(pe + "up_proj.weight", {inter, h});
        proj(pe + "down_proj.weight", {h, inter});
      }
    } else {
      const int64_t inter = c.intermediate_size;
      proj(p + "mlp.gate_proj.weight", {inter, h});
      proj(p + "mlp.up_proj.weight", {inter, h});
      proj(p + "mlp.down_proj.weight", {h, inter});
    }
  }
  specs.push_back({"model.norm.weight", {h}, Init::kNorm});
  if (!c.tie_word_embeddings) specs.push_back({"lm_head.weight", {c.vocab_size, h}, Init::kLinear});
  return specs;
}

// Hugging Face DeepseekV3ForCausalLM's (and V2's) state dict, without the
// multi-token-prediction layers, in layer order.
std::vector<TensorSpec> deepseek_tensors(const ModelConfig& c) {
  const int64_t h = c.hidden_size, heads = c.num_attention_heads;
  const int64_t q_head = int64_t{c.qk_nope_head_dim} + c.qk_rope_head_dim;
  const int64_t r = c.kv_lora_rank;
  std::vector<TensorSpec> specs;
  auto proj = [&](std::string name, Shape shape) {
    specs.push_back({std::move(name), std::move(shape), Init::kLinear, true});
  };
  auto mlp = [&](const std::string& p, int64_t inter) {
    proj(p + "gate_proj.weight", {inter, h});
    proj(p + "up_proj.weight", {inter, h});
    proj(p + "down_proj.weight", {h, inter});
  };
  specs.push_back({"model.embed_tokens.weight", {c.vocab_size, h}, Init::kEmbedding});
  for (int layer = 0; layer < c.num_hidden_layers; ++layer) {
    const std::string p = "model.layers." + std::to_string(layer) + ".";
    const std::string a = p + "self_attn.";
    specs.push_back({p + "input_layernorm.weight", {h}, Init::kNorm});
    if (c.q_lora_rank > 0) {
      proj(a + "q_a_proj.weight", {c.q_lora_rank, h});
      specs.push_back({a + "q_a_layernorm.weight", {c.q_lora_rank}, Init::kNorm});
      proj(a + "q_b_proj.weight", {heads * q_head, c.q_lora_rank});
    } else {
      proj(a + "q_proj.weight", {heads * q_head, h});
    }
    proj(a + "kv_a_proj_with_mqa.weight", {r + c.qk_rope_head_dim, h});
    specs.push_back({a + "kv_a_layernorm.weight", {r}, Init::kNorm});
    proj(a + "kv_b_proj.weight", {heads * (int64_t{c.qk_nope_head_dim} + c.v_head_dim), r});
    proj(a + "o_proj.weight", {h, heads * c.v_head_dim});
    specs.push_back({p + "post_attention_layernorm.weight", {h}, Init::kNorm});
    if (c.is_moe_layer(layer)) {
      specs.push_back({p + "mlp.gate.weight", {c.num_experts, h}, Init::kRouter});
      if (c.topk_method == "noaux_tc") {
        specs.push_back(
            {p + "mlp.gate.e_score_correction_bias", {c.num_experts}, Init::kBias, false, true});
      }
      for (int e = 0; e < c.num_experts; ++e) {
        mlp(p + "mlp.experts." + std::to_string(e) + ".", c.moe_intermediate_size);
      }
      if (c.num_shared_experts > 0) {
        mlp(p + "mlp.shared_experts.", int64_t{c.moe_intermediate_size} * c.num_shared_experts);
      }
    } else {
      mlp(p + "mlp.", c.intermediate_size);
    }
  }
  specs.push_back({"model.norm.weight", {h}, Init::kNorm});
  if (!c.tie_word_embeddings) specs.push_back({"lm_head.weight", {c.vocab_size, h}, Init::kLinear});
  return specs;
}

inline uint64_t splitmix64(uint64_t x) {
  x += 0x9e3779b97f4a7c15ull;
  x = (x ^ (x >> 30)) * 0xbf58476d1ce4e5b9ull;
  x = (x ^ (x >> 27)) * 0x94d049bb133111ebull;
  return x ^ (x >> 31);
}

// Keyed by name, not position, so a tensor keeps its values when num_layers changes.
uint64_t tensor_key(uint64_t seed, std::string_view name) {
  uint64_t h = 0xcbf29ce484222325ull;  // FNV-1a.
  for (char ch : name) h = (h ^ static_cast<uint8_t>(ch)) * 0x100000001b3ull;
  return splitmix64(seed ^ splitmix64(h));
}

// Irwin-Hall with four 16-bit uniforms from one hash: mean 0, variance 1, bounded
// by +-3.46. Close enough to normal for weights, and far cheaper than Box-Muller.
inline float normalish(uint64_t h) {
  const float sum =
      static_cast<float>((h & 0xffff) + ((h >> 16) & 0xffff) + ((h >> 32) & 0xffff) + (h >> 48));
  return (sum - 131070.0f) * (1.7320508f / 65536.0f);
}

// Element i of a tensor is mean + std * (row < boosted_rows ? 2 : 1) * noise(i).
struct Distribution {
  uint64_t key;
  float mean;
  float std;
  int64_t row_elems;     // Elements per row (the last dimension).
  int64_t boosted_rows;  // Leading rows whose std is doubled.
};

Distribution distribution_for(const TensorSpec& spec, uint64_t seed) {
  Distribution d{tensor_key(seed, spec.name), 0.0f, 1.0f, spec.shape.back(), 0};
  const float fan_in = static_cast<float>(spec.shape.back());
  switch (spec.init) {
    case Init::kNorm:
      d.mean = 1.0f;
      d.std = 0.05f;
      break;
    case Init::kLinear:
      d.std = 1.0f / std::sqrt(fan_in);
      break;
    case Init::kRouter:
      d.std = 2.0f / std::sqrt(fan_in);
      d.boosted_rows = std::max<int64_t>(1, spec.shape[0] / 8);
      break;
    case Init::kEmbedding:  // Unit scale, so the residual stream starts where RMSNorm keeps it.
      d.std = 1.0f;
      break;
    case Init::kBias:  // Small next to sigmoid scores: nudges routing, never dominates it.
      d.std = 0.02f;
      break;
  }
  return d;
}

inline float value_at(const Distribution& d, int64_t i) {
  const float scale = i / d.row_elems < d.boosted_rows ? 2.0f : 1.0f;
  const uint64_t h = splitmix64(d.key + static_cast<uint64_t>(i) * 0x9e3779b97f4a7c15ull);
  return d.mean + d.std * scale * normalish(h);
}

SafetensorsWriter::Fill make_fill(Distribution d, DType dtype) {
  return [d, dtype](uint64_t offset, void* dst, uint64_t num_bytes) {
    const size_t elem_bytes = dtype_size(dtype);
    const int64_t first = static_cast<int64_t>(offset / elem_bytes);
    const int64_t count = static_cast<int64_t>(num_bytes / elem_bytes);
    auto* out = static_cast<uint8_t*>(dst);
    ThreadPool::global().parallel_for(count, int64_t{1} << 15, [&](int64_t begin, int64_t end) {
      constexpr int64_t kBlock = 256;
      float block[kBlock];
      for (int64_t b = begin; b < end; b += kBlock) {
        const int64_t n = std::min(kBlock, end - b);
        for (int64_t k = 0; k < n; ++k) block[k] = value_at(d, first + b + k);
        convert_from_f32(dtype, block, out + b * elem_bytes, static_cast<size_t>(n));
      }
    });
  };
}

// DeepSeek-V3's FP8 layout: 128x128 blocks, each with scale s = absmax / 448 (the largest
// E4M3 value), stored as `<name>_scale_inv` since the loader multiplies by it.
constexpr int64_t kFp8Block = 128;
constexpr float kFp8Max = 448.0f;

// The block scales of one tensor, computed once (by whichever of the weight and scale
// fills runs first) by regenerating the tensor's values.
struct BlockScales {
  Distribution d;
  int64_t rows = 0, cols = 0, block_cols = 0;
  std::once_flag once;
  std::vector<float> scale;  // [ceil(rows / 128), ceil(cols / 128)]

  const std::vector<float>& get() {
    std::call_once(once, [this] {
      const int64_t block_rows = (rows + kFp8Block - 1) / kFp8Block;
      scale.assign(static_cast<size_t>(block_rows * block_cols), 0.0f);
      ThreadPool::global().parallel_for(block_rows, 1, [&](int64_t b0, int64_t b1) {
        for (int64_t br = b0; br < b1; ++br) {
          float* s = scale.data() + br * block_cols;
          for (int64_t i = br * kFp8Block; i < std::min(rows, (br + 1) * kFp8Block); ++i) {
            for (int64_t j = 0; j < cols; ++j) {
              s[j / kFp8Block] = std::max(s[j / kFp8Block], std::fabs(value_at(d, i * cols + j)));
            }
          }
          for (int64_t bc = 0; bc < block_cols; ++bc) s[bc] = std::max(s[bc] / kFp8Max, 1e-12f);
        }
      });
    });
    return scale;
  }
};

SafetensorsWriter::Fill make_fp8_fill(std::shared_ptr<BlockScales> scales) {
  return [scales](uint64_t offset, void* dst, uint64_t num_bytes) {
    const std::vector<float>& s = scales->get();
    const int64_t cols = scales->cols;
    auto* out = static_cast<uint8_t*>(dst);
    const int64_t first = static_cast<int64_t>(offset);
    ThreadPool::global().parallel_for(
        static_cast<int64_t>(num_bytes), int64_t{1} << 15, [&](int64_t begin, int64_t end) {
          for (int64_t k = begin; k < end; ++k) {
            const int64_t i = first + k;
            const float block_scale =
                s[(i / cols / kFp8Block) * scales->block_cols + (i % cols) / kFp8Block];
            out[k] = f32_to_f8e4m3(value_at(scales->d, i) / block_scale);
          }
        });
  };
}

// The values make_fp8_fill's codes stand for, e4m3 * s, rounded once to `dtype`: the
// dequantized twin of an FP8 checkpoint, computed here from the writer's own codes and
// scales (tests compare it with what a loader dequantizes).
SafetensorsWriter::Fill make_dequantized_fill(std::shared_ptr<BlockScales> scales, DType dtype) {
  return [scales, dtype](uint64_t offset, void* dst, uint64_t num_bytes) {
    const std::vector<float>& s = scales->get();
    const int64_t cols = scales->cols;
    const size_t elem_bytes = dtype_size(dtype);
    const int64_t first = static_cast<int64_t>(offset / elem_bytes);
    const int64_t count = static_cast<int64_t>(num_bytes / elem_bytes);
    auto* out = static_cast<uint8_t*>(dst);
    ThreadPool::global().parallel_for(count, int64_t{1} << 15, [&](int64_t begin, int64_t end) {
      for (int64_t k = begin; k < end; ++k) {
        const int64_t i = first + k;
        const float block_scale =
            s[(i / cols / kFp8Block) * scales->block_cols + (i % cols) / kFp8Block];
        const float v = f8e4m3_to_f32(f32_to_f8e4m3(value_at(scales->d, i) / block_scale));
        const float w = v * block_scale;
        convert_from_f32(dtype, &w, out + k * elem_bytes, 1);
      }
    });
  };
}

SafetensorsWriter::Fill make_scale_fill(std::shared_ptr<BlockScales> scales) {
  return [scales](uint64_t offset, void* dst, uint64_t num_bytes) {
    const std::vector<float>& s = scales->get();
    std::memcpy(dst, reinterpret_cast<const char*>(s.data()) + offset, num_bytes);
  };
}

// One tensor as written: its name, dtype, shape and how its bytes are produced.
struct FileTensor {
  std::string name;
  DType dtype;
  Shape shape;
  SafetensorsWriter::Fill fill;
  uint64_t bytes() const { return static_cast<uint64_t>(shape_numel(shape)) * dtype_size(dtype); }
};

// The tensors of `specs` as they go into the files: an FP8 projection becomes the
// quantized weight followed by its scales.
std::vector<FileTensor> file_tensors(const std::vector<TensorSpec>& specs,
                                     const SynthOptions& options) {
  std::vector<FileTensor> out;
  for (const TensorSpec& spec : specs) {
    const Distribution d = distribution_for(spec, options.seed);
    if (options.fp8 && spec.projection) {
      auto scales = std::make_shared<BlockScales>();
      scales->d = d;
      scales->rows = spec.shape[0];
      scales->cols = spec.shape[1];
      scales->block_cols = (scales->cols + kFp8Block - 1) / kFp8Block;
      const int64_t block_rows = (scales->rows + kFp8Block - 1) / kFp8Block;
      if (options.fp8_dequantized) {
        out.push_back(
            {spec.name, options.dtype, spec.shape, make_dequantized_fill(scales, options.dtype)});
        continue;
      }
      out.push_back({spec.name, DType::kF8E4M3, spec.shape, make_fp8_fill(scales)});
      out.push_back({spec.name + "_scale_inv",
                     DType::kF32,
                     {block_rows, scales->block_cols},
                     make_scale_fill(scales)});
      continue;
    }
    const DType dtype = spec.f32 ? DType::kF32 : options.dtype;
    out.push_back({spec.name, dtype, spec.shape, make_fill(d, dtype)});
  }
  return out;
}

const char* torch_dtype_name(DType dtype) {
  switch (dtype) {
    case DType::kF32:
      return "float32";
    case DType::kBF16:
      return "bfloat16";
    case DType::kF16:
      return "float16";
    case DType::kF8E4M3:
      return "float8_e4m3fn";
  }
  return "?";
}

// Consecutive tensors go into one shard until the next would overflow it.
std::vector<std::vector<size_t>> plan_shards(const std::vector<uint64_t>& bytes,
                                             uint64_t max_shard_bytes) {
  std::vector<std::vector<size_t>> shards;
  uint64_t used = 0;
  for (size_t i = 0; i < bytes.size(); ++i) {
    if (shards.empty() || (used + bytes[i] > max_shard_bytes && used > 0)) {
      shards.emplace_back();
      used = 0;
    }
    shards.back().push_back(i);
    used += bytes[i];
  }
  return shards;
}

std::string shard_name(size_t index, size_t count) {
  char buf[64];
  std::snprintf(buf, sizeof(buf), "model-%05zu-of-%05zu.safetensors", index + 1, count);
  return buf;
}

ModelConfig qwen3_moe_preset(int hidden, int layers, int heads, int kv_heads, int head_dim,
                             int experts, int top_k, int moe_inter, int inter, int vocab) {
  ModelConfig c;
  c.model_type = "qwen3_moe";
  c.hidden_size = hidden;
  c.num_hidden_layers = layers;
  c.num_attention_heads = heads;
  c.num_key_value_heads = kv_heads;
  c.head_dim = head_dim;
  c.num_experts = experts;
  c.num_experts_per_tok = top_k;
  c.moe_intermediate_size = moe_inter;
  c.intermediate_size = inter;
  c.vocab_size = vocab;
  c.norm_topk_prob = true;
  c.rope_theta = 1e6;
  c.rms_norm_eps = 1e-6;
  c.torch_dtype = "bfloat16";
  return c;
}

ModelConfig deepseek_preset(bool v3, int hidden, int layers, int heads, int q_lora, int kv_lora,
                            int nope, int rope, int v_dim, int experts, int top_k, int shared,
                            int moe_inter, int inter, int vocab, int first_dense) {
  ModelConfig c;
  c.model_type = v3 ? "deepseek_v3" : "deepseek_v2";
  c.hidden_size = hidden;
  c.num_hidden_layers = layers;
  c.num_attention_heads = heads;
  c.num_key_value_heads = heads;
  c.q_lora_rank = q_lora;
  c.kv_lora_rank = kv_lora;
  c.qk_nope_head_dim = nope;
  c.qk_rope_head_dim = rope;
  c.head_dim = rope;
  c.v_head_dim = v_dim;
  c.num_experts = experts;
  c.num_experts_per_tok = top_k;
  c.num_shared_experts = shared;
  c.moe_intermediate_size = moe_inter;
  c.intermediate_size = inter;
  c.vocab_size = vocab;
  c.first_k_dense_replace = first_dense;
  c.topk_method = v3 ? "noaux_tc" : "greedy";
  c.scoring_func = v3 ? "sigmoid" : "softmax";
  c.norm_topk_prob = v3;
  c.routed_scaling_factor = v3 ? 2.5 : 1.0;
  c.rope_interleave = true;
  c.rope_theta = 10000.0;
  c.rms_norm_eps = 1e-6;
  c.torch_dtype = "bfloat16";
  return c;
}

// DeepSeek-V3 and V2-Lite extend their 4k pretraining context 40x with YaRN.
RopeScaling deepseek_yarn(double mscale) {
  RopeScaling r;
  r.type = "yarn";
  r.factor = 40.0;
  r.original_max_position_embeddings = 4096;
  r.mscale = mscale;
  r.mscale_all_dim = mscale;
  return r;
}

}  // namespace

Result<ModelConfig> synth_preset_config(const std::string& preset) {
  if (preset == "tiny") {
    ModelConfig c = qwen3_moe_preset(128, 4, 4, 2, 32, 16, 4, 64, 256, 512);
    c.max_position_embeddings = 1024;
    return c;
  }
  if (preset == "qwen3-30b-a3b") {
    ModelConfig c = qwen3_moe_preset(2048, 48, 32, 4, 128, 128, 8, 768, 6144, 151936);
    c.max_position_embeddings = 40960;
    c.eos_token_ids = {151645};
    return c;
  }
  if (preset == "deepseek-tiny") {
    ModelConfig c = deepseek_preset(true, 128, 3, 4, 64, 32, 16, 8, 16, 32, 4, 1, 64, 256, 512, 1);
    c.n_group = 4;
    c.topk_group = 2;
    c.max_position_embeddings = 1024;
    c.eos_token_ids = {1};
    return c;
  }
  if (preset == "deepseek-v3") {
    ModelConfig c = deepseek_preset(true, 7168, 61, 128, 1536, 512, 128, 64, 128, 256, 8, 1, 2048,
                                    18432, 129280, 3);
    c.n_group = 8;
    c.topk_group = 4;
    c.num_nextn_predict_layers = 1;
    c.max_position_embeddings = 163840;
    c.rope_scaling = deepseek_yarn(1.0);
    c.eos_token_ids = {1};
    return c;
  }
  if (preset == "deepseek-v2-lite") {
    ModelConfig c = deepseek_preset(false, 2048, 27, 16, 0, 512, 128, 64, 128, 64, 6, 2, 1408,
                                    10944, 102400, 1);
    c.max_position_embeddings = 163840;
    c.rope_scaling = deepseek_yarn(0.707);
    c.eos_token_ids = {100001};
    return c;
  }
  return invalid_argument(
      "unknown synth preset '" + preset +
      "' (presets: tiny, qwen3-30b-a3b, deepseek-tiny, deepseek-v3, deepseek-v2-lite)");
}

Status synthesize_checkpoint(const SynthOptions& options) {
  ModelConfig config;
  if (options.config.has_value()) {
    config = *options.config;
  } else {
    FLEX_ASSIGN_OR_RETURN(config, synth_preset_config(options.preset));
  }
  if (options.out_dir.empty()) return invalid_argument("synth: out_dir is empty");
  if (options.max_shard_bytes == 0) return invalid_argument("synth: max_shard_bytes is 0");
  if (options.num_layers != -1) {
    if (options.num_layers <= 0) {
      return invalid_argument("synth: num_layers must be positive or -1, got " +
                              std::to_string(options.num_layers));
    }
    config.num_hidden_layers = options.num_layers;
    std::erase_if(config.mlp_only_layers, [&](int l) { return l >= options.num_layers; });
  }
  if (options.dtype == DType::kF8E4M3) {
    return invalid_argument("synth: F8_E4M3 is not a dtype for every tensor; use fp8");
  }
  config.torch_dtype = torch_dtype_name(options.dtype);
  if (options.fp8_dequantized && !options.fp8) {
    return invalid_argument("synth: fp8_dequantized needs fp8");
  }
  if (options.fp8 && !options.fp8_dequantized) {
    config.quant_method = "fp8";
    config.weight_block_size = {static_cast<int>(kFp8Block), static_cast<int>(kFp8Block)};
  }
  // The config the runtime will read back must pass the same validation.
  const std::string config_text = config.to_json();
  FLEX_RETURN_IF_ERROR(ModelConfig::from_json(config_text).status().annotate("synth config"));

  std::error_code ec;
  fs::create_directories(options.out_dir, ec);
  if (ec) {
    return failed_precondition("synth: cannot create " + options.out_dir + ": " + ec.message());
  }
  const std::string dir = options.out_dir;

  const std::vector<TensorSpec> specs =
      config.is_deepseek() ? deepseek_tensors(config) : qwen3_moe_tensors(config);
  const std::vector<FileTensor> tensors = file_tensors(specs, options);
  std::vector<uint64_t> bytes;
  uint64_t total = 0;
  for (const FileTensor& t : tensors) {
    bytes.push_back(t.bytes());
    total += bytes.back();
  }
  const bool sharded = total > options.max_shard_bytes;
  const auto shards =
      sharded ? plan_shards(bytes, options.max_shard_bytes) : std::vector<std::vector<size_t>>{{}};
  // Checkpoint::open prefers model.safetensors, so a stale one would shadow new shards.
  fs::remove(dir + (sharded ? "/model.safetensors" : "/model.safetensors.index.json"), ec);

  nlohmann::json weight_map = nlohmann::json::object();
  uint64_t done_before = 0;
  for (size_t s = 0; s < shards.size(); ++s) {
    const std::string file = sharded ? shard_name(s, shards.size()) : "model.safetensors";
    SafetensorsWriter writer;
    writer.set_metadata("format", "pt");  // transformers refuses files without it.
    auto add = [&](size_t i) {
      writer.add(tensors[i].name, tensors[i].dtype, tensors[i].shape, tensors[i].fill);
      weight_map[tensors[i].name] = file;
    };
    if (sharded) {
      for (size_t i : shards[s]) add(i);
    } else {
      for (size_t i = 0; i < tensors.size(); ++i) add(i);
    }
    std::function<void(uint64_t, uint64_t)> progress;
    if (options.progress) {
      progress = [&](uint64_t done, uint64_t) { options.progress(done_before + done, total); };
    }
    FLEX_RETURN_IF_ERROR(writer.write(dir + "/" + file, progress));
    done_before += writer.total_bytes();
  }
  if (sharded) {
    nlohmann::json index = {{"metadata", {{"total_size", total}}}, {"weight_map", weight_map}};
    FLEX_RETURN_IF_ERROR(
        write_file_atomically(dir + "/model.safetensors.index.json", index.dump(2) + "\n"));
  }
  return write_file_atomically(dir + "/config.json", config_text);
}

}  // namespace flexpert
