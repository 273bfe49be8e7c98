// SPDX-License-Identifier: Apache-2.0
// Loading tokenizer.json and tokenizer_config.json into a Tokenizer::Impl. Every component
// the files name is either understood or refused with Unimplemented naming it, so a tokenizer
// never silently encodes differently from the Rust `tokenizers` library.
#include <fstream>
#include <nlohmann/json.hpp>
#include <sstream>

#include "tokenizer/tokenizer_impl.h"

namespace flexpert {
namespace {

using nlohmann::json;
using tok::PreTokenizerStep;

// The ByteLevel pre-tokenizer's own split (GPT-2's), used when its `use_regex` is true.
constexpr std::string_view kByteLevelRegex =
    R"('s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)|\s+)";

std::string type_of(const json& j) {
  if (!j.is_object() || !j.contains("type") || !j["type"].is_string()) return "";
  return j["type"].get<std::string>();
}

bool flag(const json& j, const char* key, bool fallback = false) {
  auto it = j.find(key);
  return it != j.end() && it->is_boolean() ? it->get<bool>() : fallback;
}

// The bytes the ByteLevel decoder makes of one token: each char mapped back to its byte, or
// the token's own UTF-8 when any char is outside the byte map (added tokens such as
// "<｜begin▁of▁sentence｜>").
std::string byte_level_bytes(const std::string& token) {
  std::string bytes;
  size_t pos = 0;
  while (pos < token.size()) {
    const int b = tok::char_to_byte(tok::next_code_point(token, &pos));
    if (b < 0) return token;
    bytes.push_back(static_cast<char>(b));
  }
  return bytes;
}

Status parse_normalizer(const json& j, std::vector<tok::NormalForm>* out) {
  if (j.is_null()) return Status();
  const std::string type = type_of(j);
  if (type == "Sequence") {
    for (const json& n : j.value("normalizers", json::array())) {
      FLEX_RETURN_IF_ERROR(parse_normalizer(n, out));
    }
    return Status();
  }
  if (type == "NFC") return out->push_back(tok::NormalForm::kNfc), Status();
  if (type == "NFD") return out->push_back(tok::NormalForm::kNfd), Status();
  if (type == "NFKC") return out->push_back(tok::NormalForm::kNfkc), Status();
  if (type == "NFKD") return out->push_back(tok::NormalForm::kNfkd), Status();
  return unimplemented("normalizer '" + type +
                       "' is not supported (NFC, NFD, NFKC, NFKD, Sequence)");
}

Result<tok::SplitBehavior> parse_behavior(const std::string& name) {
  if (name == "Removed") return tok::SplitBehavior::kRemoved;
  if (name == "Isolated") return tok::SplitBehavior::kIsolated;
  if (name == "MergedWithPrevious") return tok::SplitBehavior::kMergedWithPrevious;
  if (name == "MergedWithNext") return tok::SplitBehavior::kMergedWithNext;
  if (name == "Contiguous") return tok::SplitBehavior::kContiguous;
  return invalid_argument("Split behavior '" + name + "' is unknown");
}

Status parse_pre_tokenizer(const json& j, std::vector<PreTokenizerStep>* out) {
  if (j.is_null()) return Status();
  const std::string type = type_of(j);
  if (type == "Sequence") {
    for (const json& p : j.value("pretokenizers", json::array())) {
      FLEX_RETURN_IF_ERROR(parse_pre_tokenizer(p, out));
    }
    return Status();
  }
  PreTokenizerStep step;
  if (type == "Split") {
    const json& pattern = j.value("pattern", json::object());
    std::string text;
    bool literal;
    if (pattern.contains("Regex") && pattern["Regex"].is_string()) {
      text = pattern["Regex"].get<std::string>();
      literal = false;
    } else if (pattern.contains("String") && pattern["String"].is_string()) {
      text = pattern["String"].get<std::string>();
      literal = true;
    } else {
      return invalid_argument("Split pre-tokenizer without a Regex or String pattern");
    }
    FLEX_ASSIGN_OR_RETURN(step.regex, tok::Regex::compile(text, literal));
    FLEX_ASSIGN_OR_RETURN(step.behavior, parse_behavior(j.value("behavior", "Isolated")));
    step.invert = flag(j, "invert");
  } else if (type == "ByteLevel") {
    step.kind = PreTokenizerStep::Kind::kByteLevel;
    step.add_prefix_space = flag(j, "add_prefix_space", true);
    if (flag(j, "use_regex", true)) {
      FLEX_ASSIGN_OR_RETURN(step.regex, tok::Regex::compile(kByteLevelRegex));
    }
  } else {
    return unimplemented("pre-tokenizer '" + type +
                         "' is not supported (Split, ByteLevel, Sequence)");
  }
  out->push_back(std::move(step));
  return Status();
}

Status parse_post_processor(const json& j, Tokenizer::Impl* impl) {
  if (j.is_null()) return Status();
  const std::string type = type_of(j);
  if (type == "Sequence") {
    for (const json& p : j.value("processors", json::array())) {
      FLEX_RETURN_IF_ERROR(parse_post_processor(p, impl));
    }
    return Status();
  }
  if (type == "ByteLevel") return Status();  // Changes offsets only, never ids.
  if (type != "TemplateProcessing") {
    return unimplemented("post-processor '" + type +
                         "' is not supported (ByteLevel, TemplateProcessing, Sequence)");
  }
  const json& specials = j.value("special_tokens", json::object());
  std::vector<tok::TemplateItem> items;
  for (const json& piece : j.value("single", json::array())) {
    tok::TemplateItem item;
    if (piece.contains("Sequence")) {
      item.is_sequence = true;
    } else if (piece.contains("SpecialToken")) {
      const std::string name = piece["SpecialToken"].value("id", "");
      if (!specials.contains(name)) {
        return invalid_argument("TemplateProcessing names special token '" + name +
                                "' missing from its special_tokens");
      }
      for (const json& id : specials[name].value("ids", json::array())) {
        item.ids.push_back(id.get<int32_t>());
      }
    } else {
      return invalid_argument("TemplateProcessing item is neither Sequence nor SpecialToken");
    }
    items.push_back(std::move(item));
  }
  impl->post_template = std::move(items);
  return Status();
}

Status parse_decoder(const json& j) {
  const std::string type = type_of(j);
  if (type == "ByteLevel") return Status();
  if (type == "Sequence") {
    const json& decoders = j.value("decoders", json::array());
    if (decoders.size() == 1) return parse_decoder(decoders[0]);
  }
  return unimplemented("decoder '" + (j.is_null() ? std::string("null") : type) +
                       "' is not supported: byte-level BPE needs the ByteLevel decoder");
}

void set_token(Tokenizer::Impl* impl, int32_t id, const std::string& token) {
  if (id >= static_cast<int32_t>(impl->id_to_token.size())) {
    impl->id_to_token.resize(id + 1);
    impl->id_to_bytes.resize(id + 1);
    impl->special.resize(id + 1, false);
  }
  impl->id_to_token[id] = token;
  impl->id_to_bytes[id] = byte_level_bytes(token);
}

Status parse_model(const json& model, Tokenizer::Impl* impl) {
  const std::string type = type_of(model);
  if (type != "BPE" && !(type.empty() && model.contains("merges"))) {
    return unimplemented("model '" + type + "' is not supported (BPE)");
  }
  if (model.contains("dropout") && !model["dropout"].is_null() && model["dropout"] != 0.0) {
    return unimplemented("BPE dropout is not supported");
  }
  if (flag(model, "byte_fallback")) return unimplemented("BPE byte_fallback is not supported");
  for (const char* key : {"continuing_subword_prefix", "end_of_word_suffix"}) {
    if (model.contains(key) && model[key].is_string() && !model[key].get<std::string>().empty()) {
      return unimplemented(std::string("BPE ") + key + " is not supported");
    }
  }
  const json& vocab = model.value("vocab", json::object());
  if (!vocab.is_object() || vocab.empty()) return invalid_argument("BPE model has no vocab");
  for (auto it = vocab.begin(); it != vocab.end(); ++it) {
    const int64_t id = it.value().get<int64_t>();
    if (id < 0 || id >= (int64_t{1} << 30)) return invalid_argument("vocab id out of range");
    set_token(impl, static_cast<int32_t>(id), it.key());
    impl->token_to_id.emplace(it.key(), static_cast<int32_t>(id));
  }
  auto model_id = [&](const std::string& token) -> Result<int32_t> {
    auto found = vocab.find(token);
    if (found == vocab.end()) return invalid_argument("merge uses '" + token + "', not in vocab");
    return found->get<int32_t>();
  };
  std::vector<tok::BpeModel::Merge> merges;
  for (const json& m : model.value("merges", json::array())) {
    std::string a, b;
    if (m.is_string()) {
      const std::string s = m.get<std::string>();
      const size_t space = s.find(' ');
      if (space == std::string::npos) return invalid_argument("merge '" + s + "' has no space");
      a = s.substr(0, space);
      b = s.substr(space + 1);
    } else if (m.is_array() && m.size() == 2) {
      a = m[0].get<std::string>();
      b = m[1].get<std::string>();
    } else {
      return invalid_argument("a merge is neither \"a b\" nor [a, b]");
    }
    tok::BpeModel::Merge merge;
    FLEX_ASSIGN_OR_RETURN(merge.left, model_id(a));
    FLEX_ASSIGN_OR_RETURN(merge.right, model_id(b));
    FLEX_ASSIGN_OR_RETURN(merge.result, model_id(a + b));
    merges.push_back(merge);
  }
  std::array<int32_t, 256> byte_ids;
  std::string one_char;
  for (int b = 0; b < 256; ++b) {
    one_char.clear();
    tok::append_utf8(tok::byte_to_char()[b], &one_char);
    auto found = vocab.find(one_char);
    byte_ids[b] = found == vocab.end() ? -1 : found->get<int32_t>();
  }
  std::unordered_map<std::string, int32_t> word_ids;
  if (flag(model, "ignore_merges")) {
    for (auto it = vocab.begin(); it != vocab.end(); ++it) {
      word_ids.emplace(byte_level_bytes(it.key()), it.value().get<int32_t>());
    }
  }
  impl->bpe = std::make_unique<tok::BpeModel>(byte_ids, merges, std::move(word_ids));
  return Status();
}

Status parse_added_tokens(const json& list, Tokenizer::Impl* impl) {
  std::vector<tok::AddedToken> raw, normalized;
  std::vector<std::string> raw_patterns, normalized_patterns;
  for (const json& t : list) {
    tok::AddedToken token;
    token.content = t.value("content", "");
    token.id = t.value("id", -1);
    if (token.content.empty() || token.id < 0) {
      return invalid_argument("an added token lacks content or id");
    }
    token.special = flag(t, "special");
    token.normalized = flag(t, "normalized", !token.special);
    token.lstrip = flag(t, "lstrip");
    token.rstrip = flag(t, "rstrip");
    token.single_word = flag(t, "single_word");
    set_token(impl, token.id, token.content);
    impl->special[token.id] = token.special;
    impl->token_to_id[token.content] = token.id;
    if (token.normalized) {
      std::string pattern = token.content;
      for (tok::NormalForm form : impl->normalizers) {
        FLEX_ASSIGN_OR_RETURN(pattern, tok::normalize(pattern, form));
      }
      normalized_patterns.push_back(std::move(pattern));
      normalized.push_back(std::move(token));
    } else {
      raw_patterns.push_back(token.content);
      raw.push_back(std::move(token));
    }
  }
  impl->raw_added = tok::AddedTokenMatcher(std::move(raw), std::move(raw_patterns));
  impl->normalized_added =
      tok::AddedTokenMatcher(std::move(normalized), std::move(normalized_patterns));
  return Status();
}

// bos_token and friends: a string, {"content": ...} (an AddedToken), or null.
std::string config_token(const json& config, const char* key) {
  auto it = config.find(key);
  if (it == config.end()) return "";
  if (it->is_string()) return it->get<std::string>();
  if (it->is_object() && it->contains("content") && (*it)["content"].is_string()) {
    return (*it)["content"].get<std::string>();
  }
  return "";
}

Status parse_config(const json& config, Tokenizer::Impl* impl) {
  auto lookup = [&](const std::string& token) -> std::optional<int32_t> {
    if (token.empty()) return std::nullopt;
    auto it = impl->token_to_id.find(token);
    if (it == impl->token_to_id.end()) return std::nullopt;
    return it->second;
  };
  impl->bos_token = config_token(config, "bos_token");
  impl->eos_token = config_token(config, "eos_token");
  impl->special_ids.bos = lookup(impl->bos_token);
  impl->special_ids.eos = lookup(impl->eos_token);
  impl->special_ids.pad = lookup(config_token(config, "pad_token"));
  impl->special_ids.unk = lookup(config_token(config, "unk_token"));
  auto it = config.find("chat_template");
  if (it != config.end() && it->is_string()) {
    impl->chat_template = it->get<std::string>();
  } else if (it != config.end() && it->is_array()) {
    for (const json& t : *it) {
      if (t.value("name", "") == "default") impl->chat_template = t.value("template", "");
    }
  }
  return Status();
}

Result<std::string> read_file(const std::string& path) {
  std::ifstream in(path, std::ios::binary);
  if (!in) return not_found("cannot read " + path);
  std::ostringstream text;
  text << in.rdbuf();
  if (!in.good() && !in.eof()) return data_loss("error reading " + path);
  return text.str();
}

}  // namespace

Result<std::unique_ptr<Tokenizer>> Tokenizer::from_json(std::string_view tokenizer_json,
                                                        std::string_view config_json) {
  auto impl = std::make_unique<Impl>();
  json root = json::parse(tokenizer_json, nullptr, /*allow_exceptions=*/false);
  if (root.is_discarded() || !root.is_object()) {
    return invalid_argument("tokenizer.json is not a JSON object");
  }
  try {
    FLEX_RETURN_IF_ERROR(parse_normalizer(root.value("normalizer", json()), &impl->normalizers)
                             .annotate("normalizer"));
    FLEX_RETURN_IF_ERROR(
        parse_pre_tokenizer(root.value("pre_tokenizer", json()), &impl->pre_tokenizer)
            .annotate("pre_tokenizer"));
    bool byte_level = false;
    for (const auto& step : impl->pre_tokenizer) {
      byte_level |= step.kind == PreTokenizerStep::Kind::kByteLevel;
    }
    if (!byte_level) {
      return unimplemented("pre_tokenizer has no ByteLevel step: only byte-level BPE is supported");
    }
    FLEX_RETURN_IF_ERROR(parse_model(root.value("model", json()), impl.get()).annotate("model"));
    FLEX_RETURN_IF_ERROR(parse_added_tokens(root.value("added_tokens", json::array()), impl.get())
                             .annotate("added_tokens"));
    FLEX_RETURN_IF_ERROR(parse_post_processor(root.value("post_processor", json()), impl.get())
                             .annotate("post_processor"));
    FLEX_RETURN_IF_ERROR(parse_decoder(root.value("decoder", json())));
    if (impl->post_template) {
      for (const auto& item : *impl->post_template) {
        for (int32_t id : item.ids) {
          if (id < 0 || id >= static_cast<int32_t>(impl->id_to_token.size())) {
            return invalid_argument("post_processor: special id " + std::to_string(id) +
                                    " is not in the vocabulary");
          }
        }
      }
    }
    if (!config_json.empty()) {
      json config = json::parse(config_json, nullptr, /*allow_exceptions=*/false);
      if (config.is_discarded() || !config.is_object()) {
        return invalid_argument("tokenizer_config.json is not a JSON object");
      }
      FLEX_RETURN_IF_ERROR(parse_config(config, impl.get()));
    }
  } catch (const json::exception& e) {
    // A field of the wrong JSON type deep inside the file.
    return invalid_argument(std::string("tokenizer.json: ") + e.what());
  }
  return std::unique_ptr<Tokenizer>(new Tokenizer(std::move(impl)));
}

Result<std::unique_ptr<Tokenizer>> Tokenizer::load(const std::string& dir) {
  FLEX_ASSIGN_OR_RETURN(std::string tokenizer_json, read_file(dir + "/tokenizer.json"));
  std::string config_json;
  if (std::ifstream(dir + "/tokenizer_config.json")) {
    FLEX_ASSIGN_OR_RETURN(config_json, read_file(dir + "/tokenizer_config.json"));
  }
  auto tokenizer = from_json(tokenizer_json, config_json);
  if (!tokenizer.ok()) return tokenizer.status().annotate(dir);
  return tokenizer;
}

}  // namespace flexpert
