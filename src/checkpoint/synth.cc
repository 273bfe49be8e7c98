// SPDX-License-Identifier: Apache-2.0
#include "checkpoint/synth.h"

#include <cmath>
#include <cstdio>
#include <filesystem>
#include <nlohmann/json.hpp>
#include <string_view>
#include <vector>

#include "file_util.h"
#include "flexpert/checkpoint.h"
#include "flexpert/thread_pool.h"

namespace flexpert {
namespace {

namespace fs = std::filesystem;

enum class Init { kNorm, kLinear, kRouter, kEmbedding };

struct TensorSpec {
  std::string name;
  Shape shape;
  Init init;
};

// Hugging Face Qwen3MoeForCausalLM's state dict, in layer order so that a shard
// holds whole consecutive layers.
std::vector<TensorSpec> qwen3_moe_tensors(const ModelConfig& c) {
  const int64_t h = c.hidden_size;
  const int64_t q_dim = int64_t{c.num_attention_heads} * c.head_dim;
  const int64_t kv_dim = int64_t{c.num_key_value_heads} * c.head_dim;
  std::vector<TensorSpec> specs;
  specs.push_back({"model.embed_tokens.weight", {c.vocab_size, h}, Init::kEmbedding});
  for (int layer = 0; layer < c.num_hidden_layers; ++layer) {
    const std::string p = "model.layers." + std::to_string(layer) + ".";
    specs.push_back({p + "input_layernorm.weight", {h}, Init::kNorm});
    specs.push_back({p + "self_attn.q_proj.weight", {q_dim, h}, Init::kLinear});
    specs.push_back({p + "self_attn.k_proj.weight", {kv_dim, h}, Init::kLinear});
    specs.push_back({p + "self_attn.v_proj.weight", {kv_dim, h}, Init::kLinear});
    specs.push_back({p + "self_attn.o_proj.weight", {h, q_dim}, Init::kLinear});
    specs.push_back({p + "self_attn.q_norm.weight", {c.head_dim}, Init::kNorm});
    specs.push_back({p + "self_attn.k_norm.weight", {c.head_dim}, Init::kNorm});
    specs.push_back({p + "post_attention_layernorm.weight", {h}, Init::kNorm});
    if (c.is_moe_layer(layer)) {
      const int64_t inter = c.moe_intermediate_size;
      specs.push_back({p + "mlp.gate.weight", {c.num_experts, h}, Init::kRouter});
      for (int e = 0; e < c.num_experts; ++e) {
        const std::string pe = p + "mlp.experts." + std::to_string(e) + ".";
        specs.push_back({pe + "gate_proj.weight", {inter, h}, Init::kLinear});
        specs.push_back({pe + "up_proj.weight", {inter, h}, Init::kLinear});
        specs.push_back({pe + "down_proj.weight", {h, inter}, Init::kLinear});
      }
    } else {
      const int64_t inter = c.intermediate_size;
      specs.push_back({p + "mlp.gate_proj.weight", {inter, h}, Init::kLinear});
      specs.push_back({p + "mlp.up_proj.weight", {inter, h}, Init::kLinear});
      specs.push_back({p + "mlp.down_proj.weight", {h, inter}, Init::kLinear});
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
  }
  return d;
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
        for (int64_t k = 0; k < n; ++k) {
          const int64_t i = first + b + k;
          const float scale = i / d.row_elems < d.boosted_rows ? 2.0f : 1.0f;
          const uint64_t h = splitmix64(d.key + static_cast<uint64_t>(i) * 0x9e3779b97f4a7c15ull);
          block[k] = d.mean + d.std * scale * normalish(h);
        }
        convert_from_f32(dtype, block, out + b * elem_bytes, static_cast<size_t>(n));
      }
    });
  };
}

const char* torch_dtype_name(DType dtype) {
  switch (dtype) {
    case DType::kF32:
      return "float32";
    case DType::kBF16:
      return "bfloat16";
    case DType::kF16:
      return "float16";
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
  return invalid_argument("unknown synth preset '" + preset + "' (presets: tiny, qwen3-30b-a3b)");
}

Status synthesize_checkpoint(const SynthOptions& options) {
  FLEX_ASSIGN_OR_RETURN(ModelConfig config, synth_preset_config(options.preset));
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
  config.torch_dtype = torch_dtype_name(options.dtype);
  // The config the runtime will read back must pass the same validation.
  const std::string config_text = config.to_json();
  FLEX_RETURN_IF_ERROR(ModelConfig::from_json(config_text).status().annotate("synth config"));

  std::error_code ec;
  fs::create_directories(options.out_dir, ec);
  if (ec) {
    return failed_precondition("synth: cannot create " + options.out_dir + ": " + ec.message());
  }
  const std::string dir = options.out_dir;

  const std::vector<TensorSpec> specs = qwen3_moe_tensors(config);
  std::vector<uint64_t> bytes;
  uint64_t total = 0;
  for (const TensorSpec& s : specs) {
    bytes.push_back(static_cast<uint64_t>(shape_numel(s.shape)) * dtype_size(options.dtype));
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
      writer.add(specs[i].name, options.dtype, specs[i].shape,
                 make_fill(distribution_for(specs[i], options.seed), options.dtype));
      weight_map[specs[i].name] = file;
    };
    if (sharded) {
      for (size_t i : shards[s]) add(i);
    } else {
      for (size_t i = 0; i < specs.size(); ++i) add(i);
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
