// SPDX-License-Identifier: Apache-2.0
#include "flexpert/model_config.h"

#include <algorithm>
#include <climits>
#include <nlohmann/json.hpp>

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
  for (const char* key : {"rope_scaling", "rope_parameters"}) {
    const json* rope = find_field(j, key);
    if (rope == nullptr || !rope->is_object()) continue;
    auto type = rope->find("rope_type");
    if (type != rope->end() && !(type->is_string() && *type == "default")) {
      FLEX_LOG(WARN) << "config: " << key << ".rope_type " << type->dump()
                     << " is ignored; plain RoPE is used";
    }
  }
  c->max_position_embeddings = 32768;  // Qwen3MoeConfig's default.
  FLEX_RETURN_IF_ERROR(
      read_int(j, "max_position_embeddings", Need::kOptional, &c->max_position_embeddings));
  FLEX_RETURN_IF_ERROR(read_bool(j, "attention_bias", &c->attention_bias));
  FLEX_RETURN_IF_ERROR(read_bool(j, "tie_word_embeddings", &c->tie_word_embeddings));
  FLEX_RETURN_IF_ERROR(read_int_list(j, "eos_token_id", /*scalar_ok=*/true, &c->eos_token_ids));
  return read_string(j, pick_spelling(j, {"torch_dtype", "dtype"}), &c->torch_dtype);
}

Status parse_qwen3_moe(const json& j, ModelConfig* c) {
  FLEX_RETURN_IF_ERROR(parse_common(j, c));
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

struct Architecture {
  const char* model_type;
  const char* hf_class;  // For "architectures" in to_json().
  Status (*parse)(const json&, ModelConfig*);
};

// A new architecture (deepseek_v3) adds a row and its parse function.
constexpr Architecture kArchitectures[] = {
    {"qwen3_moe", "Qwen3MoeForCausalLM", parse_qwen3_moe},
};

const Architecture* find_architecture(const std::string& model_type) {
  for (const Architecture& a : kArchitectures) {
    if (model_type == a.model_type) return &a;
  }
  return nullptr;
}

Status check_positive(const char* field, int value) {
  if (value > 0) return Status();
  return invalid_argument("field '" + std::string(field) + "' must be positive, got " +
                          std::to_string(value));
}

Status validate(const ModelConfig& c) {
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

bool ModelConfig::is_moe_layer(int layer) const {
  // Qwen3MoeDecoderLayer's rule.
  return num_experts > 0 &&
         std::find(mlp_only_layers.begin(), mlp_only_layers.end(), layer) ==
             mlp_only_layers.end() &&
         (layer + 1) % decoder_sparse_step == 0;
}

Result<ModelConfig> ModelConfig::from_json(const std::string& text) {
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
  j["num_experts"] = num_experts;
  j["num_experts_per_tok"] = num_experts_per_tok;
  j["norm_topk_prob"] = norm_topk_prob;
  j["decoder_sparse_step"] = decoder_sparse_step;
  j["mlp_only_layers"] = mlp_only_layers;
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
  return j.dump(2) + "\n";
}

}  // namespace flexpert
