// SPDX-License-Identifier: Apache-2.0
// `flexpert generate`: run prompts through a model and print the new ids, or the new text for
// a text prompt (--prompt) or a chat (--chat, rendered with the tokenizer's chat template).
#include <chrono>
#include <cstdio>
#include <fstream>
#include <nlohmann/json.hpp>
#include <sstream>

#include "cli/commands.h"
#include "cli/flags.h"
#include "flexpert/chat_template.h"
#include "flexpert/generate.h"
#include "flexpert/model.h"
#include "flexpert/tokenizer.h"

namespace flexpert::cli {

Result<DType> parse_weight_dtype(const std::string& name);

namespace {

Result<std::vector<std::vector<int32_t>>> parse_prompts(const std::string& text) {
  std::vector<std::vector<int32_t>> prompts;
  std::stringstream all(text);
  std::string one;
  while (std::getline(all, one, ';')) {
    std::vector<int32_t> ids;
    std::stringstream ss(one);
    std::string item;
    while (std::getline(ss, item, ',')) {
      FLEX_ASSIGN_OR_RETURN(int64_t v, parse_int(item, "--prompt-ids item"));
      ids.push_back(static_cast<int32_t>(v));
    }
    if (ids.empty()) return invalid_argument("--prompt-ids has an empty prompt");
    prompts.push_back(std::move(ids));
  }
  if (prompts.empty()) return invalid_argument("--prompt-ids is required (e.g. 1,2,3)");
  return prompts;
}

// --prompt TEXT or --chat FILE.json, encoded with --tokenizer (default: --model).
Result<std::vector<int32_t>> text_prompt(const Flags& flags, const Tokenizer& tokenizer) {
  if (flags.has("prompt")) return tokenizer.encode(flags.str("prompt"));
  std::ifstream in(flags.str("chat"));
  std::stringstream messages;
  messages << in.rdbuf();
  if (!in) return invalid_argument("--chat " + flags.str("chat") + ": cannot read the file");
  FLEX_ASSIGN_OR_RETURN(auto chat_template, ChatTemplate::from_tokenizer(tokenizer));
  ChatRenderOptions options;
  options.add_generation_prompt = true;
  FLEX_ASSIGN_OR_RETURN(std::string text, chat_template->render(messages.str(), options));
  // The template writes the special tokens itself.
  return tokenizer.encode(text, {.add_special_tokens = false});
}

Status run(const Flags& flags) {
  if (!flags.has("model")) return invalid_argument("--model DIR is required");
  const int num_inputs = flags.has("prompt-ids") + flags.has("prompt") + flags.has("chat");
  if (num_inputs != 1) return invalid_argument("give one of --prompt-ids, --prompt or --chat");
  std::unique_ptr<Tokenizer> tokenizer;
  std::vector<std::vector<int32_t>> prompts;
  if (flags.has("prompt-ids")) {
    FLEX_ASSIGN_OR_RETURN(prompts, parse_prompts(flags.str("prompt-ids")));
  } else {
    FLEX_ASSIGN_OR_RETURN(tokenizer, Tokenizer::load(flags.has("tokenizer") ? flags.str("tokenizer")
                                                                            : flags.str("model")));
    FLEX_ASSIGN_OR_RETURN(std::vector<int32_t> ids, text_prompt(flags, *tokenizer));
    if (ids.empty()) return invalid_argument("the prompt encodes to no tokens");
    prompts.push_back(std::move(ids));
  }
  SamplingParams params;
  FLEX_ASSIGN_OR_RETURN(int64_t max_tokens, flags.integer("max-tokens"));
  FLEX_ASSIGN_OR_RETURN(double temperature, flags.number("temperature"));
  FLEX_ASSIGN_OR_RETURN(int64_t top_k, flags.integer("top-k"));
  FLEX_ASSIGN_OR_RETURN(double top_p, flags.number("top-p"));
  FLEX_ASSIGN_OR_RETURN(int64_t seed, flags.integer("seed"));
  params.max_tokens = static_cast<int>(max_tokens);
  params.temperature = static_cast<float>(temperature);
  params.top_k = static_cast<int>(top_k);
  params.top_p = static_cast<float>(top_p);
  params.seed = static_cast<uint64_t>(seed);
  params.ignore_eos = flags.flag("ignore-eos");
  if (flags.has("stop-token-ids")) {
    FLEX_ASSIGN_OR_RETURN(auto stops, flags.int_list("stop-token-ids"));
    for (int64_t s : stops) params.stop_token_ids.push_back(static_cast<int32_t>(s));
  }
  FLEX_RETURN_IF_ERROR(params.validate());

  ModelOptions options;
  options.placement = flags.str("placement");
  options.max_sequences = static_cast<int>(prompts.size());
  options.device = flags.str("device");
  FLEX_ASSIGN_OR_RETURN(options.device_dtype, parse_weight_dtype(flags.str("cuda-dtype")));
  options.quantization = flags.str("quantization");
  Progress progress("loading layers");
  options.progress = [&](int done, int total) { progress.update(done, total); };
  const auto t0 = std::chrono::steady_clock::now();
  FLEX_ASSIGN_OR_RETURN(auto model, Model::load(flags.str("model"), options));
  progress.finish();
  const auto t1 = std::chrono::steady_clock::now();

  std::vector<GenerationRequest> requests;
  for (auto& p : prompts) requests.push_back({std::move(p), params});
  Generator generator(*model);
  FLEX_ASSIGN_OR_RETURN(auto results, generator.run(requests));
  const auto t2 = std::chrono::steady_clock::now();

  if (flags.flag("json")) {
    nlohmann::json out;
    out["choices"] = nlohmann::json::array();
    for (size_t i = 0; i < results.size(); ++i) {
      out["choices"].push_back({{"index", i},
                                {"token_ids", results[i].tokens},
                                {"finish_reason", results[i].finish_reason}});
      if (tokenizer) {
        FLEX_ASSIGN_OR_RETURN(out["choices"][i]["text"],
                              tokenizer->decode(results[i].tokens, /*skip_special_tokens=*/true));
      }
    }
    out["load_s"] = std::chrono::duration<double>(t1 - t0).count();
    out["generate_s"] = std::chrono::duration<double>(t2 - t1).count();
    std::printf("%s\n", out.dump().c_str());
  } else if (tokenizer) {
    FLEX_ASSIGN_OR_RETURN(std::string text,
                          tokenizer->decode(results[0].tokens, /*skip_special_tokens=*/true));
    std::printf("%s\n", text.c_str());
  } else {
    for (const auto& r : results) {
      for (size_t i = 0; i < r.tokens.size(); ++i) std::printf(i ? ",%d" : "%d", r.tokens[i]);
      std::printf("\n");
    }
  }
  return Status();
}

}  // namespace

int cmd_generate(const Args& args) {
  Flags flags;
  flags.value("model", "", "checkpoint directory (config.json + safetensors)")
      .value("prompt-ids", "", "prompt token ids, comma-separated; ';' separates prompts")
      .value("prompt", "", "a text prompt (prints the new text)")
      .value("chat", "",
             "a JSON file of chat messages, rendered with the chat template and a generation "
             "prompt (prints the new text)")
      .value("tokenizer", "",
             "directory with tokenizer.json for --prompt / --chat (default: --model)")
      .value("max-tokens", "16", "new tokens per prompt")
      .value("temperature", "0", "0 = greedy")
      .value("top-k", "0", "sample among the k most likely (0 = all)")
      .value("top-p", "1", "nucleus sampling mass")
      .value("seed", "0", "sampling seed")
      .value("stop-token-ids", "", "extra stop ids, comma-separated")
      .value("placement", "identity",
             "expert placement: identity, replicate:R[:SEED], or a JSON file")
      .value("device", "cpu", "cpu, cuda or cuda:N")
      .value("cuda-dtype", "bf16", "weights and activations on the GPU: bf16 or f32")
      .value("quantization", "",
             "routed experts of a block-FP8 checkpoint (deepseek, qwen3): bf16 (dequantized at "
             "load) or fp8 (kept e4m3: --device cuda); default fp8 for a block-FP8 checkpoint "
             "on a GPU that runs it, else bf16")
      .boolean("ignore-eos", "do not stop at the model's EOS ids")
      .boolean("json", "print one JSON object")
      .boolean("help", "show this help");
  if (Status s = flags.parse(args); !s.ok()) return report_error("generate", s);
  if (flags.flag("help")) {
    std::printf("usage: flexpert generate [flags]\n%s", flags.help().c_str());
    return 0;
  }
  if (Status s = run(flags); !s.ok()) return report_error("generate", s);
  return 0;
}

}  // namespace flexpert::cli
