// SPDX-License-Identifier: Apache-2.0
// `flexpert demo` (the main job: an elastic group under load, scaled and hit by a
// killed rank, with a report) and `flexpert bench elastic` (the same scenario in
// both reconfiguration modes, JSON plus a PNG timeline).
#include <sys/stat.h>

#include <cstdio>
#include <fstream>
#include <random>

#include "checkpoint/synth.h"
#include "cli/commands.h"
#include "cli/flags.h"
#include "flexpert/generate.h"
#include "flexpert/logging.h"
#include "flexpert/model.h"
#include "serve/elastic_bench.h"
#ifdef FLEXPERT_WITH_CUDA
#include "cuda/device.h"
#endif

namespace flexpert::cli {
namespace {

// The model to run: --model, else a synthetic tiny Qwen3-MoE made once under --cache.
Result<std::string> demo_model(const Flags& flags) {
  if (!flags.str("model").empty()) return flags.str("model");
  SynthOptions synth;
  synth.preset = "tiny";
  synth.dtype = DType::kF32;
  synth.seed = 7;
  synth.out_dir = flags.str("cache") + "/tiny-f32";
  struct stat st {};
  if (stat((synth.out_dir + "/config.json").c_str(), &st) != 0) {
    std::printf("synthesising a tiny Qwen3-MoE checkpoint in %s\n", synth.out_dir.c_str());
    FLEX_RETURN_IF_ERROR(synthesize_checkpoint(synth));
  }
  return synth.out_dir;
}

// Prompts, and their greedy continuations from one in-process model on the workers'
// device and dtype (the reference every completion of the group must equal).
Status make_workload(const std::string& model_dir, int num_prompts, int max_tokens,
                     ElasticRunOptions* o) {
  ModelOptions mopts;
  mopts.max_sequences = num_prompts;
  mopts.device = o->cluster.device == "cpu" ? "cpu" : "cuda";
  mopts.device_dtype = o->cluster.device_f32 ? DType::kF32 : DType::kBF16;
  FLEX_ASSIGN_OR_RETURN(auto model, Model::load(model_dir, mopts));
  std::mt19937 rng(11);
  std::vector<GenerationRequest> requests;
  for (int i = 0; i < num_prompts; ++i) {
    GenerationRequest r;
    const int len = 4 + static_cast<int>(rng() % 12);
    for (int t = 0; t < len; ++t) {
      r.prompt.push_back(static_cast<int32_t>(rng() % model->config().vocab_size));
    }
    r.params.max_tokens = max_tokens;
    r.params.ignore_eos = true;
    o->prompts.push_back(r.prompt);
    requests.push_back(std::move(r));
  }
  {
    Generator generator(*model);
    FLEX_ASSIGN_OR_RETURN(auto results, generator.run(requests));
    for (auto& r : results) o->expected.push_back(std::move(r.tokens));
  }
#ifdef FLEXPERT_WITH_CUDA
  if (mopts.device == "cuda") {
    // This process then holds no CUDA context: under MPS, a server that failed (a rank
    // killed inside a kernel) restarts only once every client is gone, and the workers'
    // replacements need it to.
    model.reset();
    cuda::release_device();
  }
#endif
  return Status();
}

// Validates every flag, then makes the model (demo_model) and the workload.
Result<ElasticRunOptions> scenario(const Flags& flags) {
  ElasticRunOptions o;
  FLEX_ASSIGN_OR_RETURN(int64_t ranks, flags.integer("ranks"));
  FLEX_ASSIGN_OR_RETURN(int64_t max_ranks, flags.integer("max-ranks"));
  FLEX_ASSIGN_OR_RETURN(int64_t concurrency, flags.integer("concurrency"));
  FLEX_ASSIGN_OR_RETURN(int64_t max_tokens, flags.integer("max-tokens"));
  FLEX_ASSIGN_OR_RETURN(o.duration_s, flags.number("duration"));
  if (ranks < 1 || max_ranks < ranks) return invalid_argument("need 1 <= --ranks <= --max-ranks");
  if (concurrency < 1 || max_tokens < 2 || !(o.duration_s > 0)) {
    return invalid_argument("--concurrency >= 1, --max-tokens >= 2 and --duration > 0 please");
  }
  FLEX_ASSIGN_OR_RETURN(o.events, parse_elastic_events(flags.str("events")));
  for (const auto& ev : o.events) {
    if (ev.kind == "scale" && (ev.ranks < 1 || ev.ranks > max_ranks)) {
      return invalid_argument("event '" + ev.label() + "' is outside [1, --max-ranks]");
    }
    if (ev.at_s >= o.duration_s) return invalid_argument("event after --duration");
  }
  o.cluster.ranks = static_cast<int>(ranks);
  o.cluster.max_ranks = static_cast<int>(max_ranks);
  FLEX_ASSIGN_OR_RETURN(int64_t min_ranks, flags.integer("min-ranks"));
  if (min_ranks < 1 || min_ranks > ranks)
    return invalid_argument("need 1 <= --min-ranks <= --ranks");
  o.cluster.min_ranks = static_cast<int>(min_ranks);
  FLEX_ASSIGN_OR_RETURN(int64_t spare_ranks, flags.integer("spare-ranks"));
  if (spare_ranks < 0 || ranks + spare_ranks > max_ranks) {
    return invalid_argument("need 0 <= --spare-ranks <= --max-ranks - --ranks");
  }
  o.cluster.spare_ranks = static_cast<int>(spare_ranks);
  FLEX_ASSIGN_OR_RETURN(o.cluster.min_replicas, min_replicas_flag(flags));
  o.cluster.threads_per_worker = 1;
  o.cluster.transport_timeout_ms = 5000;
  o.concurrency = static_cast<int>(concurrency);
  o.max_tokens = static_cast<int>(max_tokens);
  o.cluster.device = flags.str("device");
  if (o.cluster.device != "cpu" && o.cluster.device != "cuda") {
    return invalid_argument("--device must be cpu or cuda (ranks spread with --gpus)");
  }
  if (flags.str("cuda-dtype") != "bf16" && flags.str("cuda-dtype") != "f32") {
    return invalid_argument("--cuda-dtype must be bf16 or f32");
  }
  o.cluster.device_f32 = flags.str("cuda-dtype") == "f32";
  FLEX_ASSIGN_OR_RETURN(int64_t gpus, flags.integer("gpus"));
  if (gpus < 1 || (gpus > 1 && o.cluster.device != "cuda")) {
    return invalid_argument("--gpus must be >= 1, and > 1 only with --device cuda");
  }
  o.cluster.gpus = static_cast<int>(gpus);
  FLEX_ASSIGN_OR_RETURN(o.cluster.model_dir, demo_model(flags));
  FLEX_RETURN_IF_ERROR(make_workload(o.cluster.model_dir, 16, o.max_tokens, &o));
  o.log = [](const std::string& line) {
    std::printf("%s\n", line.c_str());
    std::fflush(stdout);
  };
  return o;
}

void print_report(const nlohmann::json& r) {
  const auto& req = r["requests"];
  std::printf(
      "\n== %s reconfiguration: %d requests completed, %d failed, %d rejected (503), "
      "%d differ from the single-process reference\n",
      r["mode"].get<std::string>().c_str(), req["completed"].get<int>(), req["failed"].get<int>(),
      req["rejected"].get<int>(), req["mismatched"].get<int>());
  std::printf("steady state: %.0f tokens/s, longest inter-token gap %.1f ms (median per 250 ms)\n",
              r["steady"]["tokens_per_s"].get<double>(), r["steady"]["max_gap_ms"].get<double>());
  std::printf("%-14s %7s %10s %10s %9s %14s %8s %9s  %s\n", "event", "at s", "prepare ms",
              "commit ms", "stall ms", "no tokens ms", "failed", "rejected", "status");
  for (const auto& e : r["events"]) {
    auto ms = [&](const char* key) {
      return e.contains(key) ? e[key].get<double>() * 1e3
                             : (e["end_s"].get<double>() - e["at_s"].get<double>()) * 1e3;
    };
    std::printf("%-14s %7.2f %10.1f %10.1f %9.1f %14.1f %8d %9d  %s\n",
                e["label"].get<std::string>().c_str(), e["at_s"].get<double>(), ms("prepare_s"),
                e.contains("commit_s") ? e["commit_s"].get<double>() * 1e3 : 0.0,
                e["stall_ms"].get<double>(), e["service_gap_ms"].get<double>(),
                e["failed_requests"].get<int>(), e["rejected_requests"].get<int>(),
                e["status"].get<std::string>().c_str());
    if (e.contains("longest_gaps") && !e["longest_gaps"].empty()) {
      std::string line = "  longest gaps:";
      for (const auto& g : e["longest_gaps"]) {
        char buf[96];
        std::snprintf(buf, sizeof(buf), " %.1f ms (%s-%s)", g["ms"].get<double>(),
                      g["from"].get<std::string>().c_str(), g["to"].get<std::string>().c_str());
        line += buf;
      }
      std::printf("%s\n", line.c_str());
    }
  }
}

Status write_outputs(const std::vector<nlohmann::json>& reports, const std::string& json_path,
                     const std::string& png_path) {
  if (!json_path.empty()) {
    std::ofstream out(json_path);
    out << nlohmann::json(reports).dump(1) << "\n";
    if (!out) return unavailable("cannot write " + json_path);
    std::printf("wrote %s\n", json_path.c_str());
  }
  if (!png_path.empty()) {
    Status s = plot_elastic(reports, png_path);
    if (s.ok()) {
      std::printf("wrote %s\n", png_path.c_str());
    } else {
      std::printf("%s\n", s.message().c_str());
    }
  }
  return Status();
}

void common_flags(Flags& flags, const char* events, const char* duration) {
  flags.value("model", "", "checkpoint directory (default: a synthetic tiny Qwen3-MoE)")
      .value("cache", "out/synth", "where the synthetic model is kept")
      .value("ranks", "2", "ranks at start")
      .value("max-ranks", "4", "capacity in ranks")
      .value("min-ranks", "1",
             "smallest group the slots are sized for (= --ranks: a killed rank's experts do "
             "not fit on the survivors, so a replacement rank takes them)")
      .value("spare-ranks", "0", "workers kept loaded beside the members for replacements")
      .value("min-replicas", "auto", "replicas every expert keeps (as serve --min-replicas)")
      .value("events", events, "SECONDS:scale:RANKS or SECONDS:kill:RANK, comma-separated")
      .value("duration", duration, "seconds of load")
      .value("concurrency", "6", "client threads")
      .value("max-tokens", "24", "tokens per request (greedy)")
      .value("device", "cpu", "where workers run the model: cpu or cuda")
      .value("cuda-dtype", "f32",
             "with --device cuda: f32 (completions checked against one process) or bf16")
      .value("gpus", "1", "with --device cuda: rank r runs on cuda:(r mod N)")
      .boolean("help", "show this help");
}

}  // namespace

int cmd_demo(const Args& args) {
  Flags flags;
  common_flags(flags, "2:scale:4,4:scale:3,6:kill:1,8:scale:1,10:scale:3", "12");
  flags.value("out", "out/demo", "directory for demo.json and demo.png");
  if (Status s = flags.parse(args); !s.ok()) return report_error("demo", s);
  if (flags.flag("help")) {
    std::printf(
        "usage: flexpert demo [flags]\n"
        "Starts a group of worker processes on a tiny model, drives load, scales it up and\n"
        "down, kills a rank, and reports what the clients saw.\n%s",
        flags.help().c_str());
    return 0;
  }
  Status s = [&]() -> Status {
    FLEX_ASSIGN_OR_RETURN(ElasticRunOptions o, scenario(flags));
    o.cluster.reconfigure = "live";
    FLEX_ASSIGN_OR_RETURN(nlohmann::json report, run_elastic(o));
    print_report(report);
    const std::string out = flags.str("out");
    mkdir(out.c_str(), 0755);
    FLEX_RETURN_IF_ERROR(write_outputs({report}, out + "/demo.json", out + "/demo.png"));
    const auto& req = report["requests"];
    if (req["failed"].get<int>() + req["mismatched"].get<int>() > 0) {
      return internal_error("some requests failed or differ from the reference");
    }
    return Status();
  }();
  if (!s.ok()) return report_error("demo", s);
  return 0;
}

int cmd_bench_elastic(const Args& args) {
  Flags flags;
  common_flags(flags, "3:scale:4,6:scale:3,9:kill:1,12:scale:3", "15");
  flags.value("modes", "live,stop-the-world", "reconfiguration modes to run, in order")
      .value("json", "bench-elastic.json", "write the reports here")
      .value("plot", "bench-elastic.png", "write the timeline here");
  if (Status s = flags.parse(args); !s.ok()) return report_error("bench elastic", s);
  if (flags.flag("help")) {
    std::printf("usage: flexpert bench elastic [flags]\n%s", flags.help().c_str());
    return 0;
  }
  Status s = [&]() -> Status {
    FLEX_ASSIGN_OR_RETURN(ElasticRunOptions o, scenario(flags));
    std::vector<nlohmann::json> reports;
    std::stringstream modes(flags.str("modes"));
    std::string mode;
    while (std::getline(modes, mode, ',')) {
      if (mode != "live" && mode != "stop-the-world") {
        return invalid_argument("--modes items must be live or stop-the-world");
      }
      o.cluster.reconfigure = mode;
      FLEX_ASSIGN_OR_RETURN(nlohmann::json report, run_elastic(o));
      print_report(report);
      reports.push_back(std::move(report));
    }
    return write_outputs(reports, flags.str("json"), flags.str("plot"));
  }();
  if (!s.ok()) return report_error("bench elastic", s);
  return 0;
}

}  // namespace flexpert::cli
