// SPDX-License-Identifier: Apache-2.0
// `flexpert synth`: write a random-weight checkpoint with a real model's shapes.
#include <cstdio>
#include <filesystem>
#include <fstream>

#include "checkpoint/synth.h"
#include "cli/commands.h"
#include "cli/flags.h"
#include "flexpert/tokenizer.h"

namespace flexpert::cli {

Result<DType> parse_weight_dtype(const std::string& name) {
  if (name == "bf16" || name == "bfloat16") return DType::kBF16;
  if (name == "f32" || name == "float32") return DType::kF32;
  if (name == "f16" || name == "float16") return DType::kF16;
  return invalid_argument("--dtype must be bf16, f16 or f32, got '" + name + "'");
}

int cmd_synth(const Args& args) {
  Flags flags;
  flags.value("preset", "", "tiny | qwen3-30b-a3b | deepseek-tiny | deepseek-v3 | deepseek-v2-lite")
      .value("out", "", "output directory")
      .value("layers", "-1", "number of decoder layers (default: the preset's)")
      .value("dtype", "bf16", "weight dtype: bf16, f16, f32")
      .value("seed", "0", "random seed")
      .boolean("fp8",
               "FP8 E4M3 projections with 128x128 block scales, as DeepSeek-V3 and Qwen3-FP8 "
               "ship them")
      .boolean("fp8-dequantized",
               "with --fp8: write its dequantized twin instead (the e4m3 * scale values in "
               "--dtype, no quantization_config), to compare a model's FP8 path against")
      .value("vocab-size", "", "vocabulary size (default: the tokenizer's, else the preset's)")
      .value("tokenizer", "",
             "copy DIR's tokenizer.json and tokenizer_config.json into --out (the vocabulary "
             "must fit; EOS from tokenizer_config.json)")
      .value("generation-config", "",
             "JSON text written as --out's generation_config.json (EOS ids, sampling "
             "defaults), checked as the model loader reads it")
      .boolean("help", "show this help");
  if (Status s = flags.parse(args); !s.ok()) return report_error("synth", s);
  if (flags.flag("help")) {
    std::printf("usage: flexpert synth [flags]\n%s", flags.help().c_str());
    return 0;
  }
  auto run = [&]() -> Status {
    if (!flags.has("preset")) return invalid_argument("--preset is required");
    if (!flags.has("out")) return invalid_argument("--out DIR is required");
    SynthOptions options;
    options.preset = flags.str("preset");
    options.out_dir = flags.str("out");
    FLEX_ASSIGN_OR_RETURN(int64_t layers, flags.integer("layers"));
    if (layers == 0 || layers < -1) return invalid_argument("--layers must be >= 1");
    options.num_layers = static_cast<int>(layers);
    FLEX_ASSIGN_OR_RETURN(options.dtype, parse_weight_dtype(flags.str("dtype")));
    FLEX_ASSIGN_OR_RETURN(int64_t seed, flags.integer("seed"));
    options.seed = static_cast<uint64_t>(seed);
    options.fp8 = flags.flag("fp8");
    options.fp8_dequantized = flags.flag("fp8-dequantized");
    std::unique_ptr<Tokenizer> tokenizer;
    if (flags.has("tokenizer")) {
      FLEX_ASSIGN_OR_RETURN(tokenizer, Tokenizer::load(flags.str("tokenizer")));
    }
    if (tokenizer || flags.has("vocab-size")) {
      FLEX_ASSIGN_OR_RETURN(ModelConfig config, synth_preset_config(options.preset));
      int64_t vocab = tokenizer ? tokenizer->vocab_size() : config.vocab_size;
      if (flags.has("vocab-size")) {
        FLEX_ASSIGN_OR_RETURN(vocab, flags.integer("vocab-size"));
        if (vocab < 1 || vocab > (int64_t{1} << 22)) {
          return invalid_argument("--vocab-size must be in [1, 4194304]");
        }
        if (tokenizer && vocab < tokenizer->vocab_size()) {
          return invalid_argument("--vocab-size " + std::to_string(vocab) +
                                  " is smaller than the tokenizer's vocabulary (" +
                                  std::to_string(tokenizer->vocab_size()) + ")");
        }
      }
      config.vocab_size = static_cast<int>(vocab);
      if (tokenizer && tokenizer->special_token_ids().eos) {
        config.eos_token_ids = {*tokenizer->special_token_ids().eos};
      }
      options.config = config;
    }
    Progress progress("writing " + options.out_dir);
    options.progress = [&](uint64_t done, uint64_t total) {
      progress.update(done >> 20, total >> 20, " MiB");
    };
    Status s = synthesize_checkpoint(options);
    progress.finish();
    const std::string gen_path = options.out_dir + "/generation_config.json";
    if (s.ok() && !flags.has("generation-config")) {
      std::error_code ec;
      std::filesystem::remove(gen_path, ec);  // A stale one would change the new model.
    }
    if (s.ok() && flags.has("generation-config")) {
      const std::string& path = gen_path;
      std::ofstream out(path, std::ios::binary | std::ios::trunc);
      out << flags.str("generation-config");
      if (!out.flush()) return failed_precondition("writing " + path + " failed");
      out.close();
      FLEX_RETURN_IF_ERROR(ModelConfig::load(options.out_dir).status());
    }
    if (!s.ok() || !tokenizer) return s;
    namespace fs = std::filesystem;
    for (const char* name : {"tokenizer.json", "tokenizer_config.json"}) {
      const fs::path from = fs::path(flags.str("tokenizer")) / name;
      if (!fs::exists(from)) continue;
      std::error_code ec;
      fs::copy_file(from, fs::path(options.out_dir) / name, fs::copy_options::overwrite_existing,
                    ec);
      if (ec) return failed_precondition("copying " + from.string() + ": " + ec.message());
    }
    return Status();
  };
  if (Status s = run(); !s.ok()) return report_error("synth", s);
  std::printf("wrote %s\n", flags.str("out").c_str());
  return 0;
}

}  // namespace flexpert::cli
