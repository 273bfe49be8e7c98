// SPDX-License-Identifier: Apache-2.0
// `flexpert bench generate`: prefill and decode throughput of one model at several batch sizes.
//
// Without --model it synthesises the preset once into --cache (reused on later
// runs). Prefill: one step holding every sequence's whole prompt. Decode:
// --gen-tokens steps of one token per sequence. Prints a table, writes JSON.
// --agreement N: also the greedy tokens of N prompts per item, compared with the first
// item's or with those of --reference (cli/agreement.h).
#include <sys/stat.h>

#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstdio>
#include <fstream>
#include <nlohmann/json.hpp>
#include <random>
#include <sstream>
#include <thread>

#include "checkpoint/synth.h"
#include "cli/agreement.h"
#include "cli/commands.h"
#include "cli/flags.h"
#include "cli/step_floor.h"
#include "flexpert/model.h"
#include "flexpert/thread_pool.h"
#include "kernels/cpu_ops.h"
#include "serve/bench_serve.h"
#include "serve/slow_clients_bench.h"

namespace flexpert::cli {

Result<DType> parse_weight_dtype(const std::string& name);

namespace {

double seconds_since(std::chrono::steady_clock::time_point t0) {
  return std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
}

Result<std::string> ensure_model(const Flags& flags) {
  if (flags.has("model")) return flags.str("model");
  SynthOptions options;
  options.preset = flags.str("preset");
  FLEX_ASSIGN_OR_RETURN(int64_t layers, flags.integer("layers"));
  options.num_layers = static_cast<int>(layers);
  FLEX_ASSIGN_OR_RETURN(options.dtype, parse_weight_dtype(flags.str("dtype")));
  options.fp8 = flags.flag("fp8");
  options.out_dir = flags.str("cache") + "/" + options.preset + "-L" + std::to_string(layers) +
                    "-" + flags.str("dtype") + (options.fp8 ? "-fp8" : "");
  struct stat st {};
  if (stat((options.out_dir + "/config.json").c_str(), &st) == 0) return options.out_dir;
  Progress progress("synthesising " + options.out_dir);
  options.progress = [&](uint64_t done, uint64_t total) {
    progress.update(done >> 20, total >> 20, " MiB");
  };
  Status s = synthesize_checkpoint(options);
  progress.finish();
  FLEX_RETURN_IF_ERROR(s);
  return options.out_dir;
}

// --quantization: "" (the model's default) or a comma-separated list of bf16 / fp8, each
// loaded and measured in turn (so FP8 decode lands beside bf16 in one run).
Result<std::vector<std::string>> quantization_list(const Flags& flags) {
  std::vector<std::string> out;
  std::stringstream all(flags.str("quantization"));
  std::string item;
  while (std::getline(all, item, ',')) {
    if (item != "bf16" && item != "fp8") {
      return invalid_argument("--quantization items must be bf16 or fp8, got '" + item + "'");
    }
    out.push_back(item);
  }
  if (out.empty()) out.push_back("");
  return out;
}

Status run_generate_bench(const Flags& flags) {
  FLEX_ASSIGN_OR_RETURN(auto batches, flags.int_list("batches"));
  FLEX_ASSIGN_OR_RETURN(int64_t prompt_len, flags.integer("prompt-len"));
  FLEX_ASSIGN_OR_RETURN(int64_t gen_tokens, flags.integer("gen-tokens"));
  if (prompt_len < 1 || gen_tokens < 1) return invalid_argument("lengths must be >= 1");
  FLEX_ASSIGN_OR_RETURN(double temperature, flags.number("temperature"));
  if (!(temperature >= 0.0) || !std::isfinite(temperature)) {
    return invalid_argument("--temperature must be a finite number >= 0");
  }
  const bool sample_on_host = flags.flag("sample-on-host");
  FLEX_ASSIGN_OR_RETURN(int64_t top_k, flags.integer("top-k"));
  FLEX_ASSIGN_OR_RETURN(double top_p, flags.number("top-p"));
  if (top_k < 0 || top_k > INT32_MAX) return invalid_argument("--top-k must be >= 0");
  if (!(top_p > 0.0 && top_p <= 1.0)) return invalid_argument("--top-p must be in (0, 1]");
  for (int64_t b : batches) {
    if (b < 1) return invalid_argument("--batches items must be >= 1");
  }
  FLEX_ASSIGN_OR_RETURN(std::vector<std::string> quantizations, quantization_list(flags));
  FLEX_ASSIGN_OR_RETURN(int64_t num_agreement, flags.integer("agreement"));
  if (num_agreement < 0 || num_agreement > 4096) {
    return invalid_argument("--agreement must be in [0, 4096]");
  }
  if (flags.has("reference") && num_agreement == 0) {
    return invalid_argument("--reference needs --agreement N");
  }
  FLEX_ASSIGN_OR_RETURN(std::string dir, ensure_model(flags));
  const int64_t max_batch =
      std::max(*std::max_element(batches.begin(), batches.end()), num_agreement);
  nlohmann::json runs = nlohmann::json::array();
  nlohmann::json out;
  // --agreement: the reference's greedy tokens (--reference's, else the first item's).
  TokenRows prompts, reference_tokens;
  std::string reference_name;
  int64_t reference_vocab = 0;
  nlohmann::json agreements = nlohmann::json::array();
  if (num_agreement > 0 && flags.has("reference")) {
    ModelOptions options;
    options.max_sequences = static_cast<int>(num_agreement);
    options.max_seq_len = static_cast<int>(prompt_len + gen_tokens + 1);
    options.device = flags.str("device");
    FLEX_ASSIGN_OR_RETURN(options.device_dtype, parse_weight_dtype(flags.str("cuda-dtype")));
    reference_name = flags.str("reference");
    Progress progress("loading the reference " + reference_name);
    options.progress = [&](int done, int total) { progress.update(done, total, " layers"); };
    FLEX_ASSIGN_OR_RETURN(auto reference, Model::load(reference_name, options));
    progress.finish();
    prompts = agreement_prompts(static_cast<int>(num_agreement), static_cast<int>(prompt_len),
                                reference->config().vocab_size, /*seed=*/2);
    reference_vocab = reference->config().vocab_size;
    FLEX_ASSIGN_OR_RETURN(reference_tokens,
                          greedy_tokens(*reference, prompts, static_cast<int>(gen_tokens)));
  }
  for (const std::string& quantization : quantizations) {
    ModelOptions options;
    options.max_sequences = static_cast<int>(max_batch);
    const bool floor = flags.flag("floor");
    constexpr int kCounted = 4;  // --floor: decode steps that count the routed experts.
    options.max_seq_len = static_cast<int>(prompt_len + gen_tokens + 1 + (floor ? kCounted : 0));
    options.device = flags.str("device");
    FLEX_ASSIGN_OR_RETURN(options.device_dtype, parse_weight_dtype(flags.str("cuda-dtype")));
    options.quantization = quantization;
    if (quantizations.size() > 1 || !quantization.empty()) {
      std::printf("quantization %s\n", quantization.empty() ? "(default)" : quantization.c_str());
    }
    Progress progress("loading " + dir);
    options.progress = [&](int done, int total) { progress.update(done, total, " layers"); };
    FLEX_ASSIGN_OR_RETURN(auto model, Model::load(dir, options));
    progress.finish();
    const ModelConfig& c = model->config();
    if (reference_vocab != 0 && reference_vocab != c.vocab_size) {
      return invalid_argument("--reference has another vocabulary than --model");
    }
    // --floor: what a decode step must read, against the copy bandwidth measured now.
    StepBytes floor_bytes;
    double copy_rate = 0;
    if (floor) {
      FLEX_ASSIGN_OR_RETURN(floor_bytes, step_bytes(dir, c, options.device, options.device_dtype,
                                                    quantization == "fp8"));
      FLEX_ASSIGN_OR_RETURN(copy_rate, copy_bytes_per_s(options.device));
      std::printf(
          "floor: %.1f MB dense per step, %.2f MB per expert, %.1f KB KV per token "
          "(%s); copy %.0f GB/s (read + write)\n",
          floor_bytes.dense / 1e6, floor_bytes.expert / 1e6, floor_bytes.kv_per_token / 1e3,
          floor_bytes.weights_dtype.c_str(), copy_rate / 1e9);
    }

    std::mt19937 rng(1);
    std::printf("%-6s %12s %12s %14s%s\n", "batch", "prefill tok/s", "decode tok/s",
                "decode ms/step", floor ? "   experts/step  floor ms  % of floor" : "");
    Tensor logits;
    std::vector<int32_t> tokens;
    std::mt19937_64 draws(7);
    for (int64_t b : batches) {
      std::vector<SequenceChunk> batch(static_cast<size_t>(b));
      for (int64_t i = 0; i < b; ++i) {
        batch[i].kv_slot = static_cast<int>(i);
        batch[i].start_pos = 0;
        for (int64_t t = 0; t < prompt_len; ++t) {
          batch[i].tokens.push_back(static_cast<int32_t>(rng() % c.vocab_size));
        }
      }
      // Greedy, or softmax sampling at --temperature (cut to --top-k / --top-p): tokens are
      // picked where the logits are (Model::forward_step), no logits row is copied out;
      // with --sample-on-host the rows' logits come out and the host draws
      // (kernels::sample_truncated).
      std::vector<RowOutput> rows(static_cast<size_t>(b));
      std::vector<double> u(static_cast<size_t>(b));
      auto step = [&]() -> Status {
        for (int64_t i = 0; i < b; ++i) {
          RowOutput& r = rows[i];
          r.kind = temperature == 0 ? RowOutput::kGreedy
                   : sample_on_host ? RowOutput::kLogits
                                    : RowOutput::kSample;
          r.temperature = static_cast<float>(temperature);
          r.top_k = static_cast<int>(top_k);
          r.top_p = static_cast<float>(top_p);
          r.u01 = u[i] = std::generate_canonical<double, 53>(draws);
        }
        FLEX_RETURN_IF_ERROR(model->forward_step(batch, rows, &logits, &tokens));
        for (int64_t i = 0; i < b && rows[0].kind == RowOutput::kLogits; ++i) {
          tokens[i] = kernels::sample_truncated(logits.data<float>() + i * c.vocab_size,
                                                c.vocab_size, static_cast<float>(temperature),
                                                rows[i].top_k, rows[i].top_p, u[i]);
        }
        return Status();
      };
      auto t0 = std::chrono::steady_clock::now();
      FLEX_RETURN_IF_ERROR(step());
      const double prefill_s = seconds_since(t0);
      t0 = std::chrono::steady_clock::now();
      for (int64_t s = 0; s < gen_tokens; ++s) {
        for (int64_t i = 0; i < b; ++i) {
          batch[i].start_pos = static_cast<int>(prompt_len + s);
          batch[i].tokens = {tokens[i]};
        }
        FLEX_RETURN_IF_ERROR(step());
      }
      const double decode_s = seconds_since(t0);
      // The floor's expert term: slots each layer routed to, over a few more (untimed)
      // decode steps; a step reads each such slot once whatever its number of rows.
      double experts_per_step = 0, floor_ms = 0;
      if (floor) {
        double slots = 0;
        for (int s = 0; s < kCounted; ++s) {
          for (int64_t i = 0; i < b; ++i) {
            batch[i].start_pos = static_cast<int>(prompt_len + gen_tokens + s);
            batch[i].tokens = {tokens[i]};
          }
          model->reset_slot_counts();
          FLEX_RETURN_IF_ERROR(step());
          for (const auto& layer : model->slot_counts()) {
            slots += static_cast<double>(
                std::count_if(layer.begin(), layer.end(), [](int64_t n) { return n > 0; }));
          }
        }
        experts_per_step = slots / kCounted;
        const double context =
            static_cast<double>(prompt_len) + 0.5 * static_cast<double>(gen_tokens);
        const double bytes = floor_bytes.dense + experts_per_step * floor_bytes.expert +
                             static_cast<double>(b) * context * floor_bytes.kv_per_token;
        // At the copy rate (read + write counted): what a read stream reaches on these chips.
        floor_ms = 1e3 * bytes / copy_rate;
      }
      const double prefill_tps = static_cast<double>(b * prompt_len) / prefill_s;
      const double decode_tps = static_cast<double>(b * gen_tokens) / decode_s;
      const double step_ms = 1e3 * decode_s / static_cast<double>(gen_tokens);
      std::printf("%-6lld %12.1f %12.1f %14.2f", static_cast<long long>(b), prefill_tps, decode_tps,
                  step_ms);
      if (floor) {
        std::printf(" %14.1f %9.3f %10.1f %%", experts_per_step, floor_ms,
                    100.0 * floor_ms / step_ms);
      }
      std::printf("\n");
      std::fflush(stdout);
      runs.push_back({{"batch", b},
                      {"quantization", quantization.empty() ? "default" : quantization},
                      {"prefill_tokens_per_s", prefill_tps},
                      {"decode_tokens_per_s", decode_tps},
                      {"decode_ms_per_step", step_ms},
                      {"prefill_s", prefill_s},
                      {"decode_s", decode_s}});
      if (floor) {
        runs.back()["experts_per_step"] = experts_per_step;
        runs.back()["floor_ms"] = floor_ms;
        runs.back()["floor_fraction"] = floor_ms / step_ms;
      }
    }
    out = {{"benchmark", "generate"},
           {"model", dir},
           {"layers", c.num_hidden_layers},
           {"hidden_size", c.hidden_size},
           {"num_experts", c.num_experts},
           {"top_k", c.num_experts_per_tok},
           {"prompt_len", prompt_len},
           {"gen_tokens", gen_tokens},
           {"temperature", temperature},
           {"sample_top_k", top_k},
           {"sample_top_p", top_p},
           {"sample_on_host", sample_on_host},
           {"threads", ThreadPool::global().num_threads()},
           {"hardware_threads", std::thread::hardware_concurrency()},
           {"quantization", flags.has("quantization") ? flags.str("quantization") : "default"}};
    if (num_agreement > 0) {
      const std::string name = quantization.empty() ? "default" : quantization;
      if (prompts.empty()) {
        prompts = agreement_prompts(static_cast<int>(num_agreement), static_cast<int>(prompt_len),
                                    c.vocab_size, /*seed=*/2);
      }
      FLEX_ASSIGN_OR_RETURN(TokenRows tokens,
                            greedy_tokens(*model, prompts, static_cast<int>(gen_tokens)));
      if (reference_tokens.empty()) {
        reference_tokens = std::move(tokens);
        reference_name = "quantization " + name;
      } else {
        const Agreement a = compare_tokens(tokens, reference_tokens);
        std::printf(
            "agreement (%s against %s): %d of %d prompts, all %lld greedy tokens equal; "
            "%.2f leading tokens equal on average\n",
            name.c_str(), reference_name.c_str(), a.num_equal, a.num_prompts,
            static_cast<long long>(gen_tokens), a.mean_common_prefix);
        agreements.push_back({{"quantization", name},
                              {"reference", reference_name},
                              {"prompts", a.num_prompts},
                              {"equal_prompts", a.num_equal},
                              {"equal_share", static_cast<double>(a.num_equal) / a.num_prompts},
                              {"mean_common_prefix", a.mean_common_prefix}});
      }
    }
    if (floor) {
      out["floor"] = {{"dense_bytes", floor_bytes.dense},
                      {"expert_bytes", floor_bytes.expert},
                      {"kv_bytes_per_token", floor_bytes.kv_per_token},
                      {"copy_bytes_per_s", copy_rate}};
    }
  }
  out["runs"] = runs;
  if (num_agreement > 0) {
    out["agreement"] = {{"prompts", num_agreement},
                        {"prompt_len", prompt_len},
                        {"gen_tokens", gen_tokens},
                        {"items", agreements}};
  }
  if (flags.has("json")) {
    std::ofstream f(flags.str("json"));
    f << out.dump(2) << "\n";
    if (!f) return invalid_argument("cannot write " + flags.str("json"));
  }
  return Status();
}

}  // namespace

Status run_serve_bench(const Flags& flags) {
  BenchServeOptions options;
  options.url = flags.str("url");
  FLEX_ASSIGN_OR_RETURN(int64_t concurrency, flags.integer("concurrency"));
  FLEX_ASSIGN_OR_RETURN(int64_t requests, flags.integer("requests"));
  FLEX_ASSIGN_OR_RETURN(int64_t prompt_len, flags.integer("prompt-len"));
  FLEX_ASSIGN_OR_RETURN(int64_t max_tokens, flags.integer("max-tokens"));
  FLEX_ASSIGN_OR_RETURN(int64_t seed, flags.integer("seed"));
  options.concurrency = static_cast<int>(concurrency);
  options.num_requests = static_cast<int>(requests);
  options.prompt_len = static_cast<int>(prompt_len);
  options.max_tokens = static_cast<int>(max_tokens);
  options.seed = static_cast<uint64_t>(seed);
  options.stream = !flags.flag("no-stream");
  FLEX_ASSIGN_OR_RETURN(options.api_key, secret_from(flags, "api-key", "FLEXPERT_API_KEY"));
  FLEX_ASSIGN_OR_RETURN(options.admin_key, admin_key_from(flags));
  Progress progress("requests");
  FLEX_ASSIGN_OR_RETURN(nlohmann::json result, bench_serve(options, [&](int done, int total) {
                          progress.update(static_cast<uint64_t>(done),
                                          static_cast<uint64_t>(total));
                        }));
  progress.finish();
  std::printf("%s", format_bench_table(result).c_str());
  if (flags.has("json")) {
    std::ofstream f(flags.str("json"));
    f << result.dump(2) << "\n";
    if (!f) return invalid_argument("cannot write " + flags.str("json"));
  }
  return Status();
}

int cmd_bench_serve(const Args& args) {
  Flags flags;
  flags.value("url", "http://127.0.0.1:8000", "server to load")
      .value("concurrency", "8", "requests in flight")
      .value("requests", "64", "requests in total")
      .value("prompt-len", "32", "prompt tokens per request (random ids)")
      .value("max-tokens", "32", "tokens generated per request (greedy, EOS ignored)")
      .value("seed", "0", "prompt seed")
      .value("json", "", "write results to this file")
      .value("api-key", "", "the server's API key (prefer FLEXPERT_API_KEY or --api-key-file)")
      .value("api-key-file", "", "a file whose first line is the API key")
      .value("admin-key", "",
             "the server's admin key, for the per-rank step detail of /v1/status (prefer "
             "FLEXPERT_ADMIN_KEY or --admin-key-file)")
      .value("admin-key-file", "", "a file whose first line is the admin key")
      .boolean("no-stream", "measure whole requests instead of streamed tokens")
      .boolean("help", "show this help");
  if (Status s = flags.parse(args); !s.ok()) return report_error("bench serve", s);
  if (flags.flag("help")) {
    std::printf("usage: flexpert bench serve [flags]\n%s", flags.help().c_str());
    return 0;
  }
  if (Status s = run_serve_bench(flags); !s.ok()) return report_error("bench serve", s);
  return 0;
}

int cmd_bench_slow_clients(const Args& args) {
  Flags flags;
  flags.value("url", "http://127.0.0.1:8000", "server to probe (http://HOST:PORT, IPv4)")
      .value("steps", "64,256,1024", "slow connections held, one step after another")
      .value("hold-s", "3", "seconds each step is held while /health is probed")
      .value("streams", "0", "streaming completions started first")
      .value("probe-source", "127.0.0.2", "local address of the /health probe (\"\": any)")
      .value("stream-max-tokens", "256", "tokens per streaming completion")
      .value("json", "", "write results to this file")
      .boolean("help", "show this help");
  if (Status s = flags.parse(args); !s.ok()) return report_error("bench slow-clients", s);
  if (flags.flag("help")) {
    std::printf("usage: flexpert bench slow-clients [flags]\n%s", flags.help().c_str());
    return 0;
  }
  auto run = [&]() -> Status {
    SlowClientsOptions o;
    const std::string url = flags.str("url");
    const size_t host_at = url.rfind("http://", 0) == 0 ? 7 : 0;
    const size_t colon = url.rfind(':');
    if (colon == std::string::npos || colon < host_at) {
      return invalid_argument("--url must be http://HOST:PORT");
    }
    o.host = url.substr(host_at, colon - host_at);
    FLEX_ASSIGN_OR_RETURN(int64_t port, parse_int(url.substr(colon + 1), "--url port"));
    if (port < 1 || port > 65535) return invalid_argument("--url port must be in [1, 65535]");
    o.port = static_cast<int>(port);
    o.probe_source = flags.str("probe-source");
    FLEX_ASSIGN_OR_RETURN(auto steps, flags.int_list("steps"));
    o.steps.clear();
    for (int64_t n : steps) {
      if (n < 0 || n > 1000000) return invalid_argument("--steps must be in [0, 1000000]");
      o.steps.push_back(static_cast<int>(n));
    }
    FLEX_ASSIGN_OR_RETURN(o.hold_s, flags.number("hold-s"));
    if (!(o.hold_s > 0 && o.hold_s <= 3600))
      return invalid_argument("--hold-s must be in (0, 3600]");
    FLEX_ASSIGN_OR_RETURN(int64_t streams, flags.integer("streams"));
    FLEX_ASSIGN_OR_RETURN(int64_t stream_tokens, flags.integer("stream-max-tokens"));
    if (streams < 0 || streams > 100000 || stream_tokens < 1 || stream_tokens > 1000000) {
      return invalid_argument("--streams must be in [0, 100000], --stream-max-tokens >= 1");
    }
    o.num_streams = static_cast<int>(streams);
    o.stream_max_tokens = static_cast<int>(stream_tokens);
    FLEX_ASSIGN_OR_RETURN(nlohmann::json result, bench_slow_clients(o));
    std::printf("%8s %8s %6s %6s %8s %10s %10s %10s %s\n", "slow", "held", "503", "408", "probes",
                "p50_ms", "p99_ms", "max_ms", "health<100ms");
    for (const auto& s : result["steps"]) {
      std::printf("%8d %8.0f %6d %6d %8d %10.2f %10.2f %10.2f %s\n", s["slow_target"].get<int>(),
                  s["slow_held"].get<double>(), s["refused_503"].get<int>(),
                  s["timed_out_408"].get<int>(), s["probes"].get<int>(),
                  s["health_ms"]["p50"].get<double>(), s["health_ms"]["p99"].get<double>(),
                  s["health_ms"]["max"].get<double>(),
                  s["within_target"].get<bool>() ? "yes" : "no");
    }
    std::printf("tolerated: %d slow connections with every /health probe under %.0f ms\n",
                result["tolerated"].get<int>(), o.health_target_ms);
    if (flags.has("json")) {
      std::ofstream f(flags.str("json"));
      f << result.dump(2) << "\n";
      if (!f) return invalid_argument("cannot write " + flags.str("json"));
    }
    return Status();
  };
  if (Status s = run(); !s.ok()) return report_error("bench slow-clients", s);
  return 0;
}

int cmd_bench(const Args& args) {
  if (!args.empty() && args[0] == "slow-clients")
    return cmd_bench_slow_clients(Args(args.begin() + 1, args.end()));
  if (!args.empty() && args[0] == "serve")
    return cmd_bench_serve(Args(args.begin() + 1, args.end()));
  if (!args.empty() && args[0] == "elastic")
    return cmd_bench_elastic(Args(args.begin() + 1, args.end()));
  if (args.empty() || args[0] != "generate") {
    std::fprintf(stderr, "usage: flexpert bench generate|serve|elastic|slow-clients [flags]\n");
    return 2;
  }
  Flags flags;
  flags.value("model", "", "checkpoint directory (default: synthesise --preset)")
      .value("preset", "qwen3-30b-a3b", "synth preset when --model is not given")
      .value("layers", "2", "decoder layers of the synthesised model")
      .value("dtype", "bf16", "weight dtype of the synthesised model")
      .value("cache", "out/synth", "where synthesised models are kept")
      .value("batches", "1,8,32", "batch sizes")
      .value("prompt-len", "64", "prompt tokens per sequence")
      .value("gen-tokens", "16", "decode steps")
      .value("temperature", "0", "0: greedy; > 0: sample from softmax(logits / T)")
      .value("top-k", "0", "with --temperature: keep the k most likely tokens (0: all)")
      .value("top-p", "1", "with --temperature: keep the smallest prefix reaching this mass")
      .boolean("sample-on-host", "with --temperature: copy the logits out and draw on the host")
      .value("device", "cpu", "cpu, cuda or cuda:N")
      .value("cuda-dtype", "bf16", "weights and activations on the GPU: bf16 or f32")
      .value("quantization", "",
             "routed experts of a block-FP8 checkpoint, as in generate: bf16 or fp8; a list "
             "(bf16,fp8) loads and measures each in turn; default: generate's")
      .boolean("fp8", "synthesise the preset with block-FP8 projections (synth --fp8)")
      .value("agreement", "0",
             "N > 0: also --gen-tokens greedy tokens of N random prompts of --prompt-len per "
             "item, compared with the first item's (or --reference's): prompts all equal")
      .value("reference", "",
             "with --agreement: compare every item with this checkpoint's tokens (loaded "
             "first, default quantization), e.g. synth --fp8-dequantized's twin")
      .value("json", "", "write results to this file")
      .boolean("floor", "also the step's byte floor and the % of it reached (decode)")
      .boolean("help", "show this help");
  const Args rest(args.begin() + 1, args.end());
  if (Status s = flags.parse(rest); !s.ok()) return report_error("bench generate", s);
  if (flags.flag("help")) {
    std::printf("usage: flexpert bench generate [flags]\n%s", flags.help().c_str());
    return 0;
  }
  if (Status s = run_generate_bench(flags); !s.ok()) return report_error("bench generate", s);
  return 0;
}

}  // namespace flexpert::cli
