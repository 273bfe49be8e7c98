// SPDX-License-Identifier: Apache-2.0
// `flexpert serve` (front end + workers behind HTTP) and `flexpert worker` (one rank).
#include <signal.h>
#include <sys/resource.h>

#include <atomic>
#include <cstdio>
#include <ctime>
#include <filesystem>

#include "cli/commands.h"
#include "cli/flags.h"
#include "core/fd_table.h"
#include "flexpert/chat_template.h"
#include "flexpert/logging.h"
#include "flexpert/tokenizer.h"
#include "flexpert/worker.h"
#include "serve/cluster_engine.h"
#include "serve/http_server.h"
#include "serve/local_engine.h"

namespace flexpert::cli {
namespace {

// A stop signal taken by a thread that does not block it (libraries start threads
// before main: UCX's has every signal unblocked) runs this instead of killing the
// process; the main thread's wait below sees the flag.
std::atomic<int> g_stop_signal{0};
void on_stop_signal(int sig) { g_stop_signal.store(sig); }

Result<int> int_flag(const Flags& flags, const std::string& name, int64_t min_value) {
  FLEX_ASSIGN_OR_RETURN(int64_t v, flags.integer(name));
  if (v < min_value) {
    return invalid_argument("--" + name + " must be >= " + std::to_string(min_value));
  }
  return static_cast<int>(v);
}

// Every HTTP connection is a descriptor: the soft limit (often 1024) would cap the
// server below --http-max-connections, so it is raised to the hard limit.
void raise_open_file_limit() {
  rlimit limit{};
  if (::getrlimit(RLIMIT_NOFILE, &limit) == 0 && limit.rlim_cur < limit.rlim_max) {
    limit.rlim_cur = limit.rlim_max;
    (void)::setrlimit(RLIMIT_NOFILE, &limit);
  }
}

// Descriptors a worker reserves at start: CUDA devices and IPC handles, peers' sockets and
// shared memory, /proc entries of watched peers; the front end raises its own limit.
constexpr int kWorkerFdTable = 4096;

ClusterEngine* cluster_ = nullptr;  // Set when serving a group (not --local).

// The text layer: --tokenizer DIR, else the model directory when it holds tokenizer.json,
// else none (token ids only). The chat template is parsed here, so that one the engine cannot
// run fails at start (InvalidArgument: exit 2), never at request time.
struct LoadedText {
  std::unique_ptr<Tokenizer> tokenizer;
  std::unique_ptr<ChatTemplate> chat_template;
};

Result<LoadedText> load_text(const Flags& flags) {
  LoadedText text;
  std::string dir = flags.str("tokenizer");
  if (dir.empty()) {
    std::error_code ec;
    if (!std::filesystem::is_regular_file(flags.str("model") + "/tokenizer.json", ec)) return text;
    dir = flags.str("model");
  }
  Result<std::unique_ptr<Tokenizer>> tokenizer = Tokenizer::load(dir);
  if (!tokenizer.ok()) {
    return invalid_argument("loading the tokenizer from " + dir + ": " +
                            tokenizer.status().to_string());
  }
  text.tokenizer = std::move(tokenizer.value());
  Result<std::unique_ptr<ChatTemplate>> chat = ChatTemplate::from_tokenizer(*text.tokenizer);
  if (chat.ok()) {
    text.chat_template = std::move(chat.value());
  } else if (chat.status().code() != StatusCode::kNotFound) {
    return invalid_argument("the chat template of " + dir +
                            "/tokenizer_config.json cannot be run: " + chat.status().message());
  }
  FLEX_LOG(INFO) << "tokenizer from " << dir << " (" << text.tokenizer->vocab_size() << " tokens"
                 << (text.chat_template ? ", chat template" : ", no chat template") << ")";
  return text;
}

// 127.0.0.0/8, ::1 and localhost: only this machine reaches a control plane there.
bool is_loopback(const std::string& host) {
  return host == "localhost" || host == "::1" || host == "[::1]" || host.rfind("127.", 0) == 0;
}

Status run_serve(const Flags& flags) {
  if (!flags.has("model")) return invalid_argument("--model DIR is required");
  // Block the stop signals in every thread; the main thread waits for them below.
  sigset_t stop_signals;
  sigemptyset(&stop_signals);
  sigaddset(&stop_signals, SIGINT);
  sigaddset(&stop_signals, SIGTERM);
  pthread_sigmask(SIG_BLOCK, &stop_signals, nullptr);
  struct sigaction stop_action {};
  stop_action.sa_handler = on_stop_signal;
  stop_action.sa_flags = SA_RESTART;
  sigaction(SIGINT, &stop_action, nullptr);
  sigaction(SIGTERM, &stop_action, nullptr);

  // Before any worker starts: a bad tokenizer, template or quantization costs no group start.
  // --local runs the CPU model in this process.
  FLEX_RETURN_IF_ERROR(check_quantization(flags.flag("local") ? "cpu" : flags.str("device"),
                                          flags.str("quantization")));
  FLEX_ASSIGN_OR_RETURN(LoadedText text, load_text(flags));
  std::unique_ptr<ServingEngine> engine;
  std::string description;
  if (flags.flag("local")) {
    LocalEngineOptions options;
    FLEX_ASSIGN_OR_RETURN(options.max_sequences, int_flag(flags, "max-sequences", 1));
    FLEX_ASSIGN_OR_RETURN(options.max_tokens_per_step, int_flag(flags, "max-tokens-per-step", 1));
    options.placement = flags.str("placement").empty() ? "identity" : flags.str("placement");
    FLEX_ASSIGN_OR_RETURN(auto local, LocalEngine::create(flags.str("model"), options));
    engine = std::move(local);
    description = "in-process engine";
  } else {
    ClusterOptions options;
    options.model_dir = flags.str("model");
    FLEX_ASSIGN_OR_RETURN(options.ranks, int_flag(flags, "ranks", 1));
    FLEX_ASSIGN_OR_RETURN(options.max_ranks, int_flag(flags, "max-ranks", 0));
    FLEX_ASSIGN_OR_RETURN(options.min_ranks, int_flag(flags, "min-ranks", 0));
    FLEX_ASSIGN_OR_RETURN(options.slots_per_rank, int_flag(flags, "slots-per-rank", 0));
    FLEX_ASSIGN_OR_RETURN(options.max_sequences, int_flag(flags, "max-sequences", 1));
    FLEX_ASSIGN_OR_RETURN(options.max_tokens_per_step, int_flag(flags, "max-tokens-per-step", 1));
    FLEX_ASSIGN_OR_RETURN(options.max_seq_len, int_flag(flags, "max-seq-len", 0));
    FLEX_ASSIGN_OR_RETURN(options.transport_timeout_ms, int_flag(flags, "transport-timeout-ms", 1));
    FLEX_ASSIGN_OR_RETURN(options.threads_per_worker, int_flag(flags, "threads-per-worker", 0));
    FLEX_ASSIGN_OR_RETURN(options.control_port, int_flag(flags, "control-port", 0));
    options.placement = flags.str("placement");
    const std::string launcher = flags.str("launcher");
    if (launcher != "fork" && launcher != "external") {
      return invalid_argument("--launcher must be fork or external");
    }
    options.spawn_workers = launcher == "fork" && !flags.flag("no-spawn");
    options.launch_command = flags.str("launch-command");
    if (!options.launch_command.empty() && options.spawn_workers) {
      return invalid_argument("--launch-command needs --no-spawn (or --launcher external)");
    }
    FLEX_ASSIGN_OR_RETURN(options.cluster_key,
                          secret_from(flags, "cluster-key", "FLEXPERT_CLUSTER_KEY"));
    options.control_host = flags.str("control-host");
    if (!is_loopback(options.control_host) && options.cluster_key.empty()) {
      // Other machines can reach the control port: only the key tells our workers apart.
      return invalid_argument("--control-host " + options.control_host +
                              " is not a loopback address: it needs the group's cluster key "
                              "(FLEXPERT_CLUSTER_KEY, --cluster-key-file or --cluster-key)");
    }
    options.transport = flags.str("transport");
    if (options.transport != "shm" && options.transport != "ucx" && options.transport != "hier") {
      return invalid_argument("--transport must be shm, ucx or hier");
    }
    if (!options.spawn_workers && options.cluster_key.empty()) {
      // Without a key anyone who reaches the control port could take a rank.
      return invalid_argument(
          "--no-spawn needs the group's cluster key (FLEXPERT_CLUSTER_KEY or "
          "--cluster-key-file), which the hand-started workers give too");
    }
    options.eplb = flags.flag("eplb");
    options.step_timing = flags.flag("step-timing");
    FLEX_ASSIGN_OR_RETURN(options.eplb_window_s, flags.number("eplb-window-s"));
    FLEX_ASSIGN_OR_RETURN(options.eplb_interval_s, flags.number("eplb-interval-s"));
    FLEX_ASSIGN_OR_RETURN(options.eplb_spare_slots, int_flag(flags, "eplb-spare-slots", 0));
    FLEX_ASSIGN_OR_RETURN(options.min_replicas, min_replicas_flag(flags));
    FLEX_ASSIGN_OR_RETURN(options.spare_ranks, int_flag(flags, "spare-ranks", 0));
    options.eplb_policy = flags.str("eplb-policy");
    FLEX_ASSIGN_OR_RETURN(options.eplb_smoothing, flags.number("eplb-smoothing"));
    FLEX_ASSIGN_OR_RETURN(options.eplb_min_gain, flags.number("eplb-min-gain"));
    if (!(options.eplb_smoothing >= 0 && options.eplb_smoothing < 1) ||
        !(options.eplb_min_gain >= 0)) {
      return invalid_argument("--eplb-smoothing must be in [0, 1), --eplb-min-gain >= 0");
    }
    options.reconfigure = flags.str("reconfigure");
    options.device = flags.str("device");
    if (flags.str("cuda-dtype") != "bf16" && flags.str("cuda-dtype") != "f32") {
      return invalid_argument("--cuda-dtype must be bf16 or f32");
    }
    options.device_f32 = flags.str("cuda-dtype") == "f32";
    options.quantization = flags.str("quantization");
    FLEX_ASSIGN_OR_RETURN(options.gpus, int_flag(flags, "gpus", 1));
    if (options.gpus > 1 && options.device != "cuda") {
      return invalid_argument("--gpus spreads ranks over GPUs: it needs --device cuda");
    }
    if (options.reconfigure != "live" && options.reconfigure != "stop-the-world") {
      return invalid_argument("--reconfigure must be live or stop-the-world");
    }
    FLEX_ASSIGN_OR_RETURN(options.heartbeat_timeout_ms, int_flag(flags, "heartbeat-timeout-ms", 1));
    FLEX_ASSIGN_OR_RETURN(options.start_timeout_ms, int_flag(flags, "start-timeout-ms", 1));
    FLEX_ASSIGN_OR_RETURN(options.leave_drain_ms, int_flag(flags, "leave-drain-ms", 0));
    if (options.eplb_policy != "auto" && options.eplb_policy != "global" &&
        options.eplb_policy != "hierarchical") {
      return invalid_argument("--eplb-policy must be auto, global or hierarchical");
    }
    if (!(options.eplb_window_s > 0) || !(options.eplb_interval_s > 0)) {
      return invalid_argument("--eplb-window-s and --eplb-interval-s must be > 0");
    }
    if (options.max_ranks > 0 && options.max_ranks < options.ranks) {
      return invalid_argument("--max-ranks must be >= --ranks");
    }
    if (!options.spawn_workers && options.launch_command.empty()) {
      options.on_listening = [&options](const std::string& endpoint) {
        std::printf("waiting for %d workers: flexpert worker --join %s --rank R\n", options.ranks,
                    endpoint.substr(6).c_str());  // Without "tcp://".
        std::fflush(stdout);
      };
    }
    FLEX_ASSIGN_OR_RETURN(auto cluster, ClusterEngine::start(options));
    description = std::to_string(options.ranks) + " ranks, control " + cluster->control_endpoint();
    cluster_ = cluster.get();
    engine = std::move(cluster);
  }
  HttpOptions http;
  http.host = flags.str("host");
  FLEX_ASSIGN_OR_RETURN(http.port, int_flag(flags, "port", 0));
  FLEX_ASSIGN_OR_RETURN(http.admin_key, admin_key_from(flags));
  FLEX_ASSIGN_OR_RETURN(http.api_key, secret_from(flags, "api-key", "FLEXPERT_API_KEY"));
  if (text.tokenizer && text.tokenizer->vocab_size() > engine->vocab_size()) {
    Status s = invalid_argument(
        "the tokenizer has " + std::to_string(text.tokenizer->vocab_size()) +
        " tokens, more than the model's vocabulary (" + std::to_string(engine->vocab_size()) + ")");
    (void)engine->shutdown();
    return s;
  }
  http.text = {text.tokenizer.get(), text.chat_template.get()};
  FLEX_ASSIGN_OR_RETURN(http.max_connections, int_flag(flags, "http-max-connections", 1));
  FLEX_ASSIGN_OR_RETURN(http.max_connections_per_client,
                        int_flag(flags, "http-max-connections-per-client", 1));
  FLEX_ASSIGN_OR_RETURN(http.request_timeout_ms, int_flag(flags, "http-request-timeout-ms", 1));
  raise_open_file_limit();
  http.model_name = flags.str("served-model-name");
  HttpServer server(*engine, http);
  if (cluster_ != nullptr) {
    ClusterEngine* cluster = cluster_;
    server.add_get_route("/v1/eplb",
                         [cluster]() -> Result<nlohmann::json> { return cluster->eplb_status(); });
    server.add_post_route("/v1/eplb/rebalance",
                          [cluster](const nlohmann::json&) { return cluster->rebalance(); });
    server.add_post_route("/v1/scale",
                          [cluster](const nlohmann::json& body) -> Result<nlohmann::json> {
                            FLEX_ASSIGN_OR_RETURN(ScaleTarget target, ScaleTarget::from_json(body));
                            return cluster->scale(target);
                          });
    server.add_post_route(
        "/v1/eplb/drain", [cluster](const nlohmann::json& body) -> Result<nlohmann::json> {
          bool cancel = false;
          if (!body.is_null()) {
            if (!body.is_object()) return invalid_argument("body must be a JSON object");
            auto it = body.find("cancel");
            if (it != body.end() && !it->is_null()) {
              if (!it->is_boolean()) return invalid_argument("\"cancel\" must be true or false");
              cancel = it->get<bool>();
            }
          }
          const bool was_running = cluster->drain_rebalance(cancel);
          return nlohmann::json{{"was_running", was_running}, {"cancelled", cancel && was_running}};
        });
  }
  FLEX_RETURN_IF_ERROR(server.start());
  std::printf("serving on http://%s:%d (%s)\n", http.host.c_str(), server.port(),
              description.c_str());
  std::fflush(stdout);
  int sig = 0;
  while (sig <= 0) {
    const timespec poll_interval{0, 100'000'000};
    sig = sigtimedwait(&stop_signals, nullptr, &poll_interval);
    if (sig <= 0) sig = g_stop_signal.load();
  }
  FLEX_LOG(INFO) << "signal " << sig << ": stopping";
  // In-flight requests get their final response before the listener closes.
  Status s = engine->shutdown();
  server.stop();
  return s;
}

}  // namespace

int cmd_serve(const Args& args) {
  Flags flags;
  flags.value("model", "", "checkpoint directory")
      .value("ranks", "1", "worker processes (ranks) at start")
      .value("max-ranks", "0", "capacity in ranks (default: --ranks)")
      .value("min-ranks", "0", "smallest group to shrink to (default: --ranks); sizes the slots")
      .value("slots-per-rank", "0",
             "expert slots per rank and layer (default: the experts fit "
             "on --min-ranks ranks, plus spares)")
      .value("placement", "", "replicate:R[:SEED] or a JSON slot map over max-ranks x slots")
      .value("max-sequences", "32", "concurrent sequences per rank")
      .value("max-tokens-per-step", "256", "token budget per rank and step")
      .value("max-seq-len", "0", "context length (default: the model's, at most 4096)")
      .value("threads-per-worker", "0", "compute threads per rank (default: cores / ranks)")
      .value("transport-timeout-ms", "30000", "how long a rank waits for a silent peer")
      .value("host", "127.0.0.1", "HTTP address")
      .value("port", "8000", "HTTP port (0: any free port)")
      .value("control-port", "0", "ZeroMQ control port (0: any free port)")
      .value("control-host", "127.0.0.1",
             "address the control plane listens on and workers are told (not loopback: needs "
             "the cluster key)")
      .value("transport", "shm",
             "workers' data plane: shm (one host), ucx (any hosts; builds with UCX) or hier "
             "(any hosts: shm, or cuda_ipc for GPU workers, between workers of one host; ucx "
             "between hosts)")
      .value("admin-key", "",
             "bearer key for admin routes and /v1/status detail (visible in ps: prefer "
             "FLEXPERT_ADMIN_KEY or --admin-key-file)")
      .value("admin-key-file", "", "a file whose first line is the admin key")
      .value("api-key", "",
             "bearer key for the inference routes (visible in ps: prefer FLEXPERT_API_KEY or "
             "--api-key-file)")
      .value("api-key-file", "", "a file whose first line is the API key")
      .value("tokenizer", "",
             "directory with tokenizer.json (and tokenizer_config.json: chat template); default: "
             "--model when it holds tokenizer.json")
      .value("cluster-key", "",
             "key workers must present (default with spawned workers: a random one; "
             "visible in ps: prefer FLEXPERT_CLUSTER_KEY or --cluster-key-file)")
      .value("cluster-key-file", "", "a file whose first line is the cluster key")
      .value("http-max-connections", "1024", "open HTTP connections in all (more get 503)")
      .value("http-max-connections-per-client", "256",
             "open HTTP connections per client address (more get 503)")
      .value("http-request-timeout-ms", "10000",
             "for a request's headers and body to arrive (408 otherwise)")
      .value("served-model-name", "flexpert", "the model name in responses")
      .value("eplb-window-s", "30", "EPLB load window (seconds)")
      .value("eplb-interval-s", "60", "seconds between automatic rebalances (with --eplb)")
      .value("eplb-spare-slots", "1", "free expert slots per rank for replicas and moves")
      .value("eplb-policy", "auto", "placement policy: auto, global, hierarchical")
      .value("eplb-smoothing", "0",
             "weight of earlier load windows in a rebalance's plan, in [0, 1) (0: this window)")
      .value("eplb-min-gain", "0",
             "skip a rebalance that raises mean balancedness by less than this (0: never skip)")
      .value("min-replicas", "auto",
             "replicas every expert keeps (2+: a lost rank needs no reload); auto: two while "
             "the slots (sized by --min-ranks) hold them beside the spare ones, else one")
      .value("spare-ranks", "0",
             "workers kept loaded beside the members (ids of --max-ranks): a lost rank's "
             "replacement without a process start")
      .value("device", "cpu", "where workers run the model: cpu, cuda, cuda:N")
      .value("cuda-dtype", "bf16", "weights and activations on the GPU: bf16 or f32")
      .value("quantization", "",
             "routed experts of a block-FP8 checkpoint (deepseek, qwen3), as in generate: bf16 "
             "(dequantized at load) or fp8 (kept e4m3: --device cuda); default fp8 for a "
             "block-FP8 checkpoint on a GPU that runs it, else bf16")
      .value("gpus", "1", "with --device cuda: rank r runs on cuda:(r mod N) of this host")
      .value("reconfigure", "live", "membership changes: live, or stop-the-world (baseline)")
      .value("heartbeat-timeout-ms", "2000", "a worker silent this long is declared lost")
      .value("start-timeout-ms", "120000", "for a starting or joining worker to be ready")
      .value("leave-drain-ms", "2000",
             "a scale-down lets the leaving workers finish their requests this long; the rest "
             "re-run on the others (0: at once)")
      .boolean("eplb", "rebalance experts automatically every --eplb-interval-s")
      .boolean("step-timing",
               "workers time their MoE exchanges (per rank in /v1/status and /metrics; bench "
               "serve prints the breakdown)")
      .value("launcher", "fork",
             "how workers start: fork (here), external (by hand or --launch-command)")
      .value("launch-command", "",
             "with --no-spawn: shell command that starts a worker (FLEXPERT_RANK, FLEXPERT_JOIN "
             "in its environment; non-zero exit: a failed start)")
      .boolean("no-spawn",
               "do not start workers (--launcher external); wait for `flexpert worker --join`")
      .boolean("local", "run the model in this process (no workers)")
      .boolean("help", "show this help");
  if (Status s = flags.parse(args); !s.ok()) return report_error("serve", s);
  if (flags.flag("help")) {
    std::printf("usage: flexpert serve --model DIR [flags]\n%s", flags.help().c_str());
    return 0;
  }
  if (Status s = run_serve(flags); !s.ok()) return report_error("serve", s);
  return 0;
}

int cmd_worker(const Args& args) {
  Flags flags;
  flags.value("join", "", "the front end's control address HOST:PORT")
      .value("rank", "", "rank id to take, or auto (the front end assigns an open one)")
      .value("cluster-key", "",
             "the group's key (visible in ps: prefer FLEXPERT_CLUSTER_KEY or --cluster-key-file)")
      .value("cluster-key-file", "", "a file whose first line is the cluster key")
      .boolean("help", "show this help");
  if (Status s = flags.parse(args); !s.ok()) return report_error("worker", s);
  if (flags.flag("help")) {
    std::printf("usage: flexpert worker --join HOST:PORT --rank R\n%s", flags.help().c_str());
    return 0;
  }
  WorkerOptions options;
  std::string join = flags.str("join");
  if (join.empty()) return report_error("worker", invalid_argument("--join HOST:PORT is required"));
  options.endpoint = join.rfind("tcp://", 0) == 0 ? join : "tcp://" + join;
  auto rank = flags.integer("rank");
  if (flags.str("rank") == "auto") {
    options.rank = kAutoRank;  // The front end assigns an open id.
  } else if (!rank.ok() || rank.value() < 0) {
    return report_error("worker", invalid_argument("--rank must be an integer >= 0 or auto"));
  } else {
    options.rank = static_cast<int>(rank.value());
  }
  auto key = secret_from(flags, "cluster-key", "FLEXPERT_CLUSTER_KEY");
  if (!key.ok()) return report_error("worker", key.status());
  options.cluster_key = key.value();
  // Before any thread exists: growing the table later stalls steps (core/fd_table.h).
  (void)reserve_fd_table(kWorkerFdTable);
  return run_worker(options);
}

}  // namespace flexpert::cli
