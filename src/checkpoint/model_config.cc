// SPDX-License-Identifier: Apache-2.0
#include "flexpert/model_config.h"

#include <algorithm>
#include <climits>
#include <filesystem>
#include <nlohmann/json.hpp>

#include "core/json_limits.h"
#include "file_util.h"
#include "flexpert/logging.h"

namespace flexpert {
namespace {

using json = nlohmann::json;

enum class Need { kRequired, kOptional };

// Absent and null read alike: Hugging Face writes null for "use the default".
const json* find_field(const json& j, const char* key) {
  auto it = j.find(key);
  return it == j.end() || it->is_null() ? nullptr : &*it;
}

Status missing(const char* key) {
  return invalid_argument("missing field '" + std::string(key) + "'");
}

Status to_int(const json& v, const std::string& what, int* out) {
  bool fits = false;
  if (v.is_number_unsigned()) {
    fits = v.get<uint64_t>() <= INT_MAX;
  } else if (v.is_number_integer()) {
    fits = v.get<int64_t>() >= INT_MIN && v.get<int64_t>() <= INT_MAX;
  }
  if (!fits) return invalid_argument(what + " must be an int, got " + v.dump());
  *out = v.get<int>();
  return Status();
}

Status read_int(const json& j, const char* key, Need need, int* out) {
  const json* v = find_field(j, key);
  if (v == nullptr) return need == Need::kRequired ? missing(key) : Status();
  return to_int(*v, "field '" + std::string(key) + "'", out);
}

Status read_double(const json& j, const char* key, Need need, double* out) {
  const json* v = find_field(j, key);
  if (v == nullptr) return need == Need::kRequired ? missing(key) : Status();
  if (!v->is_number()) {
    return invalid_argument("field '" + std::string(key) + "' must be a number, got " + v->dump());
  }
  *out = v->get<double>();
  return Status();
}

Status read_bool(const json& j, const char* key, bool* out) {
  const json* v = find_field(j, key);
  if (v == nullptr) return Status();
  if (!v->is_boolean()) {
    return invalid_argument("field '" + std::string(key) + "' must be a bool, got " + v->dump());
  }
  *out = v->get<bool>();
  return Status();
}

Status read_string(const json& j, const char* key, std::string* out) {
  const json* v = find_field(j, key);
  if (v == nullptr) return Status();
  if (!v->is_string()) {
    return invalid_argument("field '" + std::string(key) + "' must be a string, got " + v->dump());
  }
  *out = v->get<std::string>();
  return Status();
}

// A list of ints, or (when `scalar_ok`) one int standing for a list of one.
Status read_int_list(const json& j, const char* key, bool scalar_ok, std::vector<int>* out) {
  const json* v = find_field(j, key);
  out->clear();
  if (v == nullptr) return Status();
  const json list = scalar_ok && v->is_number_integer() ? json::array({*v}) : *v;
  if (!list.is_array()) {
    return invalid_argument("field '" + std::string(key) + "' must be a list, got " + v->dump());
  }
  for (const json& item : list) {
    int value = 0;
    FLEX_RETURN_IF_ERROR(to_int(item, "an item of field '" + std::string(key) + "'", &value));
    out->push_back(value);
  }
  return Status();
}

// The first of `keys` present in `j`, else the first key (so "missing" names it).
const char* pick_spelling(const json& j, std::initializer_list<const char*> keys) {
  for (const char* key : keys) {
    if (find_field(j, key) != nullptr) return key;
  }
  return *keys.begin();
}

Status parse_quantization(const json& j, ModelConfig* c);

// Fields every supported architecture shares with Llama-style configs.
Status parse_common(const json& j, ModelConfig* c) {
  FLEX_RETURN_IF_ERROR(read_int(j, "vocab_size", Need::kRequired, &c->vocab_size));
  FLEX_RETURN_IF_ERROR(read_int(j, "hidden_size", Need::kRequired, &c->hidden_size));
  FLEX_RETURN_IF_ERROR(read_int(j, "intermediate_size", Need::kRequired, &c->intermediate_size));
  FLEX_RETURN_IF_ERROR(read_int(j, "num_hidden_layers", Need::kRequired, &c->num_hidden_layers));
  FLEX_RETURN_IF_ERROR(
      read_int(j, "num_attention_heads", Need::kRequired, &c->num_attention_heads));
  c->num_key_value_heads = c->num_attention_heads;  // Hugging Face's default: plain MHA.
  FLEX_RETURN_IF_ERROR(
      read_int(j, "num_key_value_heads", Need::kOptional, &c->num_key_value_heads));
  c->head_dim = 0;
  FLEX_RETURN_IF_ERROR(read_int(j, "head_dim", Need::kOptional, &c->head_dim));
  if (find_field(j, "head_dim") == nullptr && c->num_attention_heads > 0) {
    if (c->hidden_size % c->num_attention_heads != 0) {
      return invalid_argument("field 'head_dim' is absent and hidden_size " +
                              std::to_string(c->hidden_size) + " is not a multiple of " +
                              "num_attention_heads " + std::to_string(c->num_attention_heads));
    }
    c->head_dim = c->hidden_size / c->num_attention_heads;
  }
  FLEX_RETURN_IF_ERROR(read_double(j, "rms_norm_eps", Need::kOptional, &c->rms_norm_eps));

  // transformers >= 5 moved rope_theta into rope_parameters.
  if (find_field(j, "rope_theta") != nullptr) {
    FLEX_RETURN_IF_ERROR(read_double(j, "rope_theta", Need::kOptional, &c->rope_theta));
  } else if (const json* rope = find_field(j, "rope_parameters"); rope && rope->is_object()) {
    FLEX_RETURN_IF_ERROR(read_double(*rope, "rope_theta", Need::kOptional, &c->rope_theta)
                             .annotate("in field 'rope_parameters'"));
  }
  c->max_position_embeddings = 32768;  // Qwen3MoeConfig's default.
  FLEX_RETURN_IF_ERROR(
      read_int(j, "max_position_embeddings", Need::kOptional, &c->max_position_embeddings));
  FLEX_RETURN_IF_ERROR(read_bool(j, "attention_bias", &c->attention_bias));
  FLEX_RETURN_IF_ERROR(read_bool(j, "tie_word_embeddings", &c->tie_word_embeddings));
  FLEX_RETURN_IF_ERROR(read_int_list(j, "eos_token_id", /*scalar_ok=*/true, &c->eos_token_ids));
  FLEX_RETURN_IF_ERROR(read_string(j, pick_spelling(j, {"torch_dtype", "dtype"}), &c->torch_dtype));
  return parse_quantization(j, c);
}

// `rope_scaling` (transformers 4) or `rope_parameters` (5): the first one naming a type.
const json* find_rope_scaling(const json& j, const char** key) {
  for (const char* k : {"rope_scaling", "rope_parameters"}) {
    const json* rope = find_field(j, k);
    if (rope == nullptr || !rope->is_object()) continue;
    if (find_field(*rope, "rope_type") != nullptr || find_field(*rope, "type") != nullptr) {
      *key = k;
      return rope;
    }
  }
  return nullptr;
}

// Qwen3MoeModel runs plain RoPE only; a scaled one is reported, as before.
void warn_rope_scaling_ignored(const json& j) {
  const char* key = nullptr;
  const json* rope = find_rope_scaling(j, &key);
  if (rope == nullptr) return;
  const json* type = find_field(*rope, pick_spelling(*rope, {"rope_type", "type"}));
  if (type != nullptr && !(type->is_string() && *type == "default")) {
    FLEX_LOG(WARN) << "config: " << key << ".rope_type " << type->dump()
                   << " is ignored; plain RoPE is used";
  }
}

Status parse_rope_scaling(const json& j, ModelConfig* c) {
  const char* key = nullptr;
  const json* rope = find_rope_scaling(j, &key);
  if (rope == nullptr) return Status();
  RopeScaling& r = c->rope_scaling;
  Status s = read_string(*rope, pick_spelling(*rope, {"rope_type", "type"}), &r.type);
  if (s.ok() && r.type != "default" && r.type != "yarn") {
    return unimplemented("field '" + std::string(key) + "': rope type '" + r.type +
                         "' is not implemented (supported: default, yarn)");
  }
  if (s.ok() && r.type == "yarn") {
    s = read_double(*rope, "factor", Need::kRequired, &r.factor);
    if (s.ok()) {
      s = read_int(*rope, "original_max_position_embeddings", Need::kOptional,
                   &r.original_max_position_embeddings);
    }
    if (s.ok()) s = read_double(*rope, "beta_fast", Need::kOptional, &r.beta_fast);
    if (s.ok()) s = read_double(*rope, "beta_slow", Need::kOptional, &r.beta_slow);
    if (s.ok()) s = read_double(*rope, "mscale", Need::kOptional, &r.mscale);
    if (s.ok()) s = read_double(*rope, "mscale_all_dim", Need::kOptional, &r.mscale_all_dim);
    if (s.ok()) s = read_double(*rope, "attention_factor", Need::kOptional, &r.attention_factor);
    if (s.ok()) s = read_bool(*rope, "truncate", &r.truncate);
    if (s.ok() && !(r.factor > 0)) s = invalid_argument("field 'factor' must be positive");
    if (s.ok() && r.original_max_position_embeddings < 0) {
      s = invalid_argument("field 'original_max_position_embeddings' must not be negative");
    }
  }
  return s.annotate("in field '" + std::string(key) + "'");
}

// `quantization_config`: block-scaled FP8 (DeepSeek-V3, Qwen3-FP8) is dequantized at load.
Status parse_quantization(const json& j, ModelConfig* c) {
  const json* q = find_field(j, "quantization_config");
  if (q == nullptr) return Status();
  if (!q->is_object()) {
    return invalid_argument("field 'quantization_config' must be an object, got " + q->dump());
  }
  FLEX_RETURN_IF_ERROR(
      read_string(*q, "quant_method", &c->quant_method).annotate("in field 'quantization_config'"));
  if (c->quant_method != "fp8") {
    return unimplemented("quantization_config.quant_method '" + c->quant_method +
                         "' is not implemented (supported: fp8)");
  }
  std::string fmt = "e4m3";
  FLEX_RETURN_IF_ERROR(read_string(*q, "fmt", &fmt).annotate("in field 'quantization_config'"));
  if (fmt != "e4m3") {
    return unimplemented("quantization_config.fmt '" + fmt +
                         "' is not implemented (supported: e4m3)");
  }
  FLEX_RETURN_IF_ERROR(
      read_int_list(*q, "weight_block_size", /*scalar_ok=*/false, &c->weight_block_size)
          .annotate("in field 'quantization_config'"));
  if (c->weight_block_size.empty()) c->weight_block_size = {128, 128};
  if (c->weight_block_size.size() != 2 || c->weight_block_size[0] <= 0 ||
      c->weight_block_size[1] <= 0) {
    return invalid_argument(
        "field 'quantization_config.weight_block_size' must be two positive ints, got " +
        q->value("weight_block_size", json()).dump());
  }
  return Status();
}

Status check_positive(const char* field, int value) {
  if (value > 0) return Status();
  return invalid_argument("field '" + std::string(field) + "' must be positive, got " +
                          std::to_string(value));
}

bool num_experts_positive(const ModelConfig& c) { return c.num_experts > 0; }

Status parse_qwen3_moe(const json& j, ModelConfig* c) {
  FLEX_RETURN_IF_ERROR(parse_common(j, c));
  warn_rope_scaling_ignored(j);
  FLEX_RETURN_IF_ERROR(read_int(j, pick_spelling(j, {"num_experts", "num_local_experts"}),
                                Need::kRequired, &c->num_experts));
  FLEX_RETURN_IF_ERROR(
      read_int(j, "num_experts_per_tok", Need::kRequired, &c->num_experts_per_tok));
  FLEX_RETURN_IF_ERROR(
      read_int(j, "moe_intermediate_size", Need::kRequired, &c->moe_intermediate_size));
  FLEX_RETURN_IF_ERROR(read_bool(j, "norm_topk_prob", &c->norm_topk_prob));
  FLEX_RETURN_IF_ERROR(
      read_int(j, "decoder_sparse_step", Need::kOptional, &c->decoder_sparse_step));
  return read_int_list(j, "mlp_only_layers", /*scalar_ok=*/false, &c->mlp_only_layers);
}

bool qwen3_moe_is_moe_layer(const ModelConfig& c, int layer) {
  // Qwen3MoeDecoderLayer's rule.
  return num_experts_positive(c) &&
         std::find(c.mlp_only_layers.begin(), c.mlp_only_layers.end(), layer) ==
             c.mlp_only_layers.end() &&
         (layer + 1) % c.decoder_sparse_step == 0;
}

void write_qwen3_moe(const ModelConfig& c, nlohmann::ordered_json* j) {
  (*j)["num_experts"] = c.num_experts;
  (*j)["num_experts_per_tok"] = c.num_experts_per_tok;
  (*j)["norm_topk_prob"] = c.norm_topk_prob;
  (*j)["decoder_sparse_step"] = c.decoder_sparse_step;
  (*j)["mlp_only_layers"] = c.mlp_only_layers;
}

constexpr const char* kTopkMethods[] = {"greedy", "group_limited_greedy", "noaux_tc"};
constexpr const char* kScoringFuncs[] = {"softmax", "sigmoid"};

template <size_t N>
Status check_choice(const char* field, const std::string& value, const char* const (&choices)[N]) {
  std::string list;
  for (const char* choice : choices) {
    if (value == choice) return Status();
    list += (list.empty() ? "" : ", ") + std::string(choice);
  }
  return invalid_argument("field '" + std::string(field) + "' has unsupported value '" + value +
                          "' (supported: " + list + ")");
}

// DeepseekV2Config / DeepseekV3Config; the two differ in their routing defaults and in
// that V2's rotary embedding is always the interleaved (complex) form.
Status parse_deepseek(const json& j, ModelConfig* c, bool v3) {
  FLEX_RETURN_IF_ERROR(parse_common(j, c));
  FLEX_RETURN_IF_ERROR(read_int(j, "n_routed_experts", Need::kRequired, &c->num_experts));
  FLEX_RETURN_IF_ERROR(
      read_int(j, "num_experts_per_tok", Need::kRequired, &c->num_experts_per_tok));
  FLEX_RETURN_IF_ERROR(
      read_int(j, "moe_intermediate_size", Need::kRequired, &c->moe_intermediate_size));
  FLEX_RETURN_IF_ERROR(read_int(j, "n_shared_experts", Need::kOptional, &c->num_shared_experts));
  FLEX_RETURN_IF_ERROR(
      read_int(j, "first_k_dense_replace", Need::kOptional, &c->first_k_dense_replace));
  FLEX_RETURN_IF_ERROR(read_int(j, "moe_layer_freq", Need::kOptional, &c->moe_layer_freq));
  FLEX_RETURN_IF_ERROR(
      read_int(j, "num_nextn_predict_layers", Need::kOptional, &c->num_nextn_predict_layers));
  FLEX_RETURN_IF_ERROR(read_int(j, "q_lora_rank", Need::kOptional, &c->q_lora_rank));
  FLEX_RETURN_IF_ERROR(read_int(j, "kv_lora_rank", Need::kRequired, &c->kv_lora_rank));
  FLEX_RETURN_IF_ERROR(read_int(j, "qk_nope_head_dim", Need::kRequired, &c->qk_nope_head_dim));
  FLEX_RETURN_IF_ERROR(read_int(j, "qk_rope_head_dim", Need::kRequired, &c->qk_rope_head_dim));
  FLEX_RETURN_IF_ERROR(read_int(j, "v_head_dim", Need::kRequired, &c->v_head_dim));
  FLEX_RETURN_IF_ERROR(read_int(j, "n_group", Need::kOptional, &c->n_group));
  FLEX_RETURN_IF_ERROR(read_int(j, "topk_group", Need::kOptional, &c->topk_group));
  c->topk_method = v3 ? "noaux_tc" : "greedy";
  FLEX_RETURN_IF_ERROR(read_string(j, "topk_method", &c->topk_method));
  c->scoring_func = v3 ? "sigmoid" : "softmax";
  FLEX_RETURN_IF_ERROR(read_string(j, "scoring_func", &c->scoring_func));
  c->norm_topk_prob = v3;
  FLEX_RETURN_IF_ERROR(read_bool(j, "norm_topk_prob", &c->norm_topk_prob));
  c->routed_scaling_factor = v3 ? 2.5 : 1.0;
  FLEX_RETURN_IF_ERROR(
      read_double(j, "routed_scaling_factor", Need::kOptional, &c->routed_scaling_factor));
  c->rope_interleave = true;
  if (v3) FLEX_RETURN_IF_ERROR(read_bool(j, "rope_interleave", &c->rope_interleave));
  FLEX_RETURN_IF_ERROR(parse_rope_scaling(j, c));
  c->head_dim = c->qk_rope_head_dim;  // As transformers sets it: the rotary dimension.

  FLEX_RETURN_IF_ERROR(check_choice("topk_method", c->topk_method, kTopkMethods));
  FLEX_RETURN_IF_ERROR(check_choice("scoring_func", c->scoring_func, kScoringFuncs));
  FLEX_RETURN_IF_ERROR(check_positive("kv_lora_rank", c->kv_lora_rank));
  FLEX_RETURN_IF_ERROR(check_positive("qk_nope_head_dim", c->qk_nope_head_dim));
  FLEX_RETURN_IF_ERROR(check_positive("qk_rope_head_dim", c->qk_rope_head_dim));
  FLEX_RETURN_IF_ERROR(check_positive("v_head_dim", c->v_head_dim));
  FLEX_RETURN_IF_ERROR(check_positive("moe_layer_freq", c->moe_layer_freq));
  FLEX_RETURN_IF_ERROR(check_positive("n_group", c->n_group));
  FLEX_RETURN_IF_ERROR(check_positive("topk_group", c->topk_group));
  if (c->qk_rope_head_dim % 2 != 0) {
    return invalid_argument("field 'qk_rope_head_dim' must be even for RoPE, got " +
                            std::to_string(c->qk_rope_head_dim));
  }
  const std::pair<const char*, int> non_negative[] = {
      {"q_lora_rank", c->q_lora_rank},
      {"n_shared_experts", c->num_shared_experts},
      {"first_k_dense_replace", c->first_k_dense_replace},
      {"num_nextn_predict_layers", c->num_nextn_predict_layers}};
  for (auto [field, value] : non_negative) {
    if (value < 0) {
      return invalid_argument("field '" + std::string(field) + "' must not be negative, got " +
                              std::to_string(value));
    }
  }
  if (!(c->routed_scaling_factor > 0)) {
    return invalid_argument("field 'routed_scaling_factor' must be positive");
  }
  if (c->topk_method != "greedy" && c->num_experts > 0) {
    if (c->num_experts % c->n_group != 0) {
      return invalid_argument("field 'n_group' (" + std::to_string(c->n_group) +
                              ") must divide n_routed_experts (" + std::to_string(c->num_experts) +
                              ")");
    }
    if (c->topk_group > c->n_group) {
      return invalid_argument("field 'topk_group' (" + std::to_string(c->topk_group) +
                              ") exceeds n_group (" + std::to_string(c->n_group) + ")");
    }
    if (c->num_experts_per_tok > c->topk_group * (c->num_experts / c->n_group)) {
      return invalid_argument("field 'num_experts_per_tok' (" +
                              std::to_string(c->num_experts_per_tok) + ") exceeds the " +
                              std::to_string(c->topk_group * (c->num_experts / c->n_group)) +
                              " experts of topk_group groups");
    }
  }
  return Status();
}

Status parse_deepseek_v3(const json& j, ModelConfig* c) { return parse_deepseek(j, c, true); }
Status parse_deepseek_v2(const json& j, ModelConfig* c) { return parse_deepseek(j, c, false); }

bool deepseek_is_moe_layer(const ModelConfig& c, int layer) {
  // DeepseekV3DecoderLayer's rule (moe_layer_freq as in DeepSeek's own modeling code).
  return num_experts_positive(c) && layer >= c.first_k_dense_replace &&
         layer % c.moe_layer_freq == 0;
}

void write_deepseek(const ModelConfig& c, nlohmann::ordered_json* j) {
  nlohmann::ordered_json& o = *j;
  o["n_routed_experts"] = c.num_experts;
  o["num_experts_per_tok"] = c.num_experts_per_tok;
  o["n_shared_experts"] = c.num_shared_experts;
  o["first_k_dense_replace"] = c.first_k_dense_replace;
  o["moe_layer_freq"] = c.moe_layer_freq;
  o["num_nextn_predict_layers"] = c.num_nextn_predict_layers;
  if (c.q_lora_rank > 0) {
    o["q_lora_rank"] = c.q_lora_rank;
  } else {
    o["q_lora_rank"] = nullptr;
  }
  o["kv_lora_rank"] = c.kv_lora_rank;
  o["qk_nope_head_dim"] = c.qk_nope_head_dim;
  o["qk_rope_head_dim"] = c.qk_rope_head_dim;
  o["v_head_dim"] = c.v_head_dim;
  o["n_group"] = c.n_group;
  o["topk_group"] = c.topk_group;
  o["topk_method"] = c.topk_method;
  o["scoring_func"] = c.scoring_func;
  o["norm_topk_prob"] = c.norm_topk_prob;
  o["routed_scaling_factor"] = c.routed_scaling_factor;
  if (c.model_type == "deepseek_v3") o["rope_interleave"] = c.rope_interleave;
  const RopeScaling& r = c.rope_scaling;
  if (r.type != "default") {
    nlohmann::ordered_json rope;
    rope["type"] = r.type;
    rope["factor"] = r.factor;
    if (r.original_max_position_embeddings > 0) {
      rope["original_max_position_embeddings"] = r.original_max_position_embeddings;
    }
    rope["beta_fast"] = r.beta_fast;
    rope["beta_slow"] = r.beta_slow;
    if (r.mscale != 0) rope["mscale"] = r.mscale;
    if (r.mscale_all_dim != 0) rope["mscale_all_dim"] = r.mscale_all_dim;
    if (r.attention_factor != 0) rope["attention_factor"] = r.attention_factor;
    if (!r.truncate) rope["truncate"] = false;
    o["rope_scaling"] = rope;
  }
}

struct Architecture {
  const char* model_type;
  const char* hf_class;  // For "architectures" in to_json().
  Status (*parse)(const json&, ModelConfig*);
  bool (*is_moe_layer)(const ModelConfig&, int layer);
  void (*write)(const ModelConfig&, nlohmann::ordered_json*);  // Family fields of to_json().
};

// A new architecture adds a row and its functions.
constexpr Architecture kArchitectures[] = {
    {"qwen3_moe", "Qwen3MoeForCausalLM", parse_qwen3_moe, qwen3_moe_is_moe_layer, write_qwen3_moe},
    {"deepseek_v3", "DeepseekV3ForCausalLM", parse_deepseek_v3, deepseek_is_moe_layer,
     write_deepseek},
    {"deepseek_v2", "DeepseekV2ForCausalLM", parse_deepseek_v2, deepseek_is_moe_layer,
     write_deepseek},
};

const Architecture* find_architecture(const std::string& model_type) {
  for (const Architecture& a : kArchitectures) {
    if (model_type == a.model_type) return &a;
  }
  return nullptr;
}

// Upper bounds, checked before anything is sized from the config: a hostile
// config.json (2^31-1 experts, 1e8 layers) must be an error, not an allocation that
// aborts or swaps. Each is far above any published model (DeepSeek-V3: 61 layers,
// 256 experts, vocabulary 129,280, hidden 7,168; Qwen3-235B: 94 layers, 128 experts).
Status check_sizes(const ModelConfig& c) {
  const struct {
    const char* field;
    int64_t value;
    int64_t max;
  } limits[] = {
      {"vocab_size", c.vocab_size, int64_t{1} << 22},
      {"hidden_size", c.hidden_size, int64_t{1} << 16},
      {"intermediate_size", c.intermediate_size, int64_t{1} << 20},
      {"moe_intermediate_size", c.moe_intermediate_size, int64_t{1} << 20},
      {"num_hidden_layers", c.num_hidden_layers, 1024},
      {"num_attention_heads", c.num_attention_heads, 1024},
      {"num_key_value_heads", c.num_key_value_heads, 1024},
      {"head_dim", c.head_dim, 4096},
      {"num_experts", c.num_experts, 16384},
      {"num_experts_per_tok", c.num_experts_per_tok, 1024},
      {"num_shared_experts", c.num_shared_experts, 1024},
      {"kv_lora_rank", c.kv_lora_rank, int64_t{1} << 16},
      {"q_lora_rank", c.q_lora_rank, int64_t{1} << 16},
      {"qk_nope_head_dim", c.qk_nope_head_dim, 4096},
      {"qk_rope_head_dim", c.qk_rope_head_dim, 4096},
      {"v_head_dim", c.v_head_dim, 4096},
      {"max_position_embeddings", c.max_position_embeddings, int64_t{1} << 24},
  };
  for (const auto& l : limits) {
    if (l.value > l.max) {
      return invalid_argument("field '" + std::string(l.field) + "' is " + std::to_string(l.value) +
                              ", above the supported " + std::to_string(l.max));
    }
  }
  // Per-expert state (placement, slots, router rows) scales with layers x experts.
  constexpr int64_t kMaxExpertInstances = int64_t{1} << 20;
  if (int64_t{c.num_hidden_layers} * c.num_experts > kMaxExpertInstances) {
    return invalid_argument("num_hidden_layers x num_experts (" +
                            std::to_string(int64_t{c.num_hidden_layers} * c.num_experts) +
                            ") is above the supported " + std::to_string(kMaxExpertInstances));
  }
  return Status();
}

Status validate(const ModelConfig& c) {
  FLEX_RETURN_IF_ERROR(check_sizes(c));
  FLEX_RETURN_IF_ERROR(check_positive("vocab_size", c.vocab_size));
  FLEX_RETURN_IF_ERROR(check_positive("hidden_size", c.hidden_size));
  FLEX_RETURN_IF_ERROR(check_positive("intermediate_size", c.intermediate_size));
  FLEX_RETURN_IF_ERROR(check_positive("num_hidden_layers", c.num_hidden_layers));
  FLEX_RETURN_IF_ERROR(check_positive("num_attention_heads", c.num_attention_heads));
  FLEX_RETURN_IF_ERROR(check_positive("num_key_value_heads", c.num_key_value_heads));
  FLEX_RETURN_IF_ERROR(check_positive("head_dim", c.head_dim));
  FLEX_RETURN_IF_ERROR(check_positive("decoder_sparse_step", c.decoder_sparse_step));
  if (c.head_dim % 2 != 0) {
    return invalid_argument("field 'head_dim' must be even for RoPE, got " +
                            std::to_string(c.head_dim));
  }
  if (c.num_attention_heads % c.num_key_value_heads != 0) {
    return invalid_argument("field 'num_attention_heads' (" +
                            std::to_string(c.num_attention_heads) +
                            ") must be a multiple of 'num_key_value_heads' (" +
                            std::to_string(c.num_key_value_heads) + ")");
  }
  if (c.num_experts < 0) return invalid_argument("field 'num_experts' must not be negative");
  if (c.num_experts > 0) {
    FLEX_RETURN_IF_ERROR(check_positive("moe_intermediate_size", c.moe_intermediate_size));
    FLEX_RETURN_IF_ERROR(check_positive("num_experts_per_tok", c.num_experts_per_tok));
    if (c.num_experts_per_tok > c.num_experts) {
      return invalid_argument("field 'num_experts_per_tok' (" +
                              std::to_string(c.num_experts_per_tok) + ") exceeds num_experts (" +
                              std::to_string(c.num_experts) + ")");
    }
  }
  for (int layer : c.mlp_only_layers) {
    if (layer < 0 || layer >= c.num_hidden_layers) {
      return invalid_argument("field 'mlp_only_layers' names layer " + std::to_string(layer) +
                              " of a " + std::to_string(c.num_hidden_layers) + "-layer model");
    }
  }
  if (!(c.rms_norm_eps > 0)) return invalid_argument("field 'rms_norm_eps' must be positive");
  if (!(c.rope_theta > 0)) return invalid_argument("field 'rope_theta' must be positive");
  if (c.max_position_embeddings < 0) {
    return invalid_argument("field 'max_position_embeddings' must not be negative");
  }
  for (int id : c.eos_token_ids) {
    if (id < 0 || id >= c.vocab_size) {
      return invalid_argument("field 'eos_token_id' " + std::to_string(id) +
                              " is outside the vocabulary of " + std::to_string(c.vocab_size));
    }
  }
  return Status();
}

}  // namespace

std::string ModelConfig::default_gpu_quantization() const {
  const bool blocks_128 =
      weight_block_size.empty() || weight_block_size == std::vector<int>{128, 128};
  return quant_method == "fp8" && blocks_128 ? "fp8" : "bf16";
}

bool ModelConfig::is_moe_layer(int layer) const {
  const Architecture* arch = find_architecture(model_type);
  return arch != nullptr && arch->is_moe_layer(*this, layer);
}

Result<ModelConfig> ModelConfig::from_json(const std::string& text) {
  FLEX_RETURN_IF_ERROR(check_json_nesting(text, "config"));
  json j;
  try {
    j = json::parse(text);
  } catch (const json::exception& e) {
    return invalid_argument(std::string("config is not valid JSON: ") + e.what());
  }
  if (!j.is_object()) return invalid_argument("config JSON is not an object");
  ModelConfig c;
  FLEX_RETURN_IF_ERROR(read_string(j, "model_type", &c.model_type));
  if (c.model_type.empty()) return missing("model_type");
  const Architecture* arch = find_architecture(c.model_type);
  if (arch == nullptr) {
    std::string supported;
    for (const Architecture& a : kArchitectures) {
      supported += (supported.empty() ? "" : ", ") + std::string(a.model_type);
    }
    return invalid_argument("unsupported model_type '" + c.model_type +
                            "' (supported: " + supported + ")");
  }
  try {
    FLEX_RETURN_IF_ERROR(arch->parse(j, &c));
  } catch (const json::exception& e) {  // The readers check types first; this is a backstop.
    return invalid_argument(std::string("config: ") + e.what());
  }
  FLEX_RETURN_IF_ERROR(validate(c));
  return c;
}

Result<ModelConfig> ModelConfig::load(const std::string& dir) {
  const std::string path = dir + "/config.json";
  FLEX_ASSIGN_OR_RETURN(std::string text, read_text_file(path));
  auto config = from_json(text);
  if (!config.ok()) return config.status().annotate(path);
  const std::string gen_path = dir + "/generation_config.json";
  std::error_code ec;
  if (std::filesystem::exists(gen_path, ec)) {
    FLEX_ASSIGN_OR_RETURN(std::string gen_text, read_text_file(gen_path));
    FLEX_RETURN_IF_ERROR(config->apply_generation_config(gen_text).annotate(gen_path));
  }
  return config;
}

std::string ModelConfig::to_json() const {
  const Architecture* arch = find_architecture(model_type);
  nlohmann::ordered_json j;
  if (arch != nullptr) j["architectures"] = {arch->hf_class};
  j["model_type"] = model_type;
  j["vocab_size"] = vocab_size;
  j["hidden_size"] = hidden_size;
  j["intermediate_size"] = intermediate_size;
  j["moe_intermediate_size"] = moe_intermediate_size;
  j["num_hidden_layers"] = num_hidden_layers;
  j["num_attention_heads"] = num_attention_heads;
  j["num_key_value_heads"] = num_key_value_heads;
  j["head_dim"] = head_dim;
  if (arch != nullptr) arch->write(*this, &j);
  j["hidden_act"] = "silu";
  j["rms_norm_eps"] = rms_norm_eps;
  j["rope_theta"] = rope_theta;
  j["max_position_embeddings"] = max_position_embeddings;
  j["attention_bias"] = attention_bias;
  j["tie_word_embeddings"] = tie_word_embeddings;
  if (eos_token_ids.empty()) {
    j["eos_token_id"] = nullptr;
  } else if (eos_token_ids.size() == 1) {
    j["eos_token_id"] = eos_token_ids[0];
  } else {
    j["eos_token_id"] = eos_token_ids;
  }
  if (!torch_dtype.empty()) j["torch_dtype"] = torch_dtype;
  if (!quant_method.empty()) {
    j["quantization_config"] = {{"activation_scheme", "dynamic"},
                                {"fmt", "e4m3"},
                                {"quant_method", quant_method},
                                {"weight_block_size", weight_block_size}};
  }
  return j.dump(2) + "\n";
}

}  // namespace flexpert
