// SPDX-License-Identifier: Apache-2.0
// ClusterEngine: the front end's side of a serving group of worker processes.
//
// It owns membership (which ranks are members, in which epoch), spawns workers
// (or accepts hand-started ones through `flexpert worker --join`), places each
// request on the least-loaded serving rank, relays its tokens to the caller,
// and watches workers (process exit, heartbeats, their error reports). A
// control thread owns the ZeroMQ ROUTER socket; public methods are thread-safe
// and hand commands to it through a queue.
#pragma once

#include <functional>
#include <memory>
#include <string>
#include <vector>

#include "serve/serving_engine.h"

namespace flexpert {

struct ClusterOptions {
  std::string model_dir;
  int ranks = 1;
  int max_ranks = 0;                 // 0: ranks.
  int slots_per_rank = 0;            // 0: enough for the experts and replicas on min_ranks ranks.
  int min_ranks = 0;                 // Smallest group to shrink to; 0: ranks.
  std::string placement;             // "", "replicate:R[:SEED]", or a JSON file over all slots.
  int max_sequences = 32;            // Per rank.
  int max_tokens_per_step = 256;     // Per rank; sizes the exchange buffers.
  int max_seq_len = 0;               // 0: the model's, capped at 4096.
  int transport_timeout_ms = 30000;  // Silent peers; dead ones are seen at once.
  int heartbeat_timeout_ms = 2000;   // Heartbeats come from a thread of their own.
  // How workers start (serve/launcher.h): true, forked here (ForkLauncher); false, by hand or
  // by an orchestrator (ExternalLauncher), joining with `flexpert worker --join`.
  bool spawn_workers = true;
  // Without spawn_workers: a shell command that starts one worker, run with FLEXPERT_RANK and
  // FLEXPERT_JOIN (HOST:PORT) in its environment; a non-zero exit is a failed start. Empty:
  // the front end prints the `flexpert worker` line to run and waits.
  std::string launch_command;
  std::string worker_binary;  // Default: this executable.
  // What every worker's hello must carry. Empty with spawn_workers: a random key,
  // handed to spawned workers through their environment (never argv). Empty
  // without: hellos are not checked.
  std::string cluster_key;
  int threads_per_worker = 0;  // 0: cores / ranks (at least 1).
  std::string control_host = "127.0.0.1";
  int control_port = 0;           // 0: any free port.
  int start_timeout_ms = 120000;  // For every rank to be ready.
  // A scale-down (or a leave) lets the leavers finish what they run for up to this long
  // before it commits; what they still run then re-runs on the survivors (0: at once).
  int leave_drain_ms = 2000;
  // Called once the control socket is bound, with its endpoint (tcp://HOST:PORT).
  std::function<void(const std::string&)> on_listening;

  // Expert load balancing. Load is counted per slot in every forward pass and
  // aggregated here over a sliding window; a rebalance plans a new placement and
  // moves weights into free slots while serving, layer by layer.
  bool eplb = false;                 // Rebalance every eplb_interval_s on its own.
  double eplb_window_s = 30;         // Load window.
  double eplb_interval_s = 60;       // Between automatic rebalances.
  int eplb_spare_slots = 1;          // Free slots per rank beyond what the experts need.
  std::string eplb_policy = "auto";  // auto | global | hierarchical
  // Load smoothing: a rebalance plans on weight * (earlier windows) + (1 - weight) * (this
  // window), as shares per layer (eplb::smooth_load); 0 = this window only. Scale-ups,
  // scale-downs and recoveries plan on the same smoothed load (without advancing it).
  double eplb_smoothing = 0;
  // Skip threshold: a rebalance whose plan raises the mean balancedness by less than this moves
  // nothing (eplb::PlanInput::min_gain); 0 = always move. Never applies to a membership change,
  // which must place lost or leaving experts.
  double eplb_min_gain = 0;
  // Replicas every expert keeps; 0 (`--min-replicas auto`): auto_min_replicas for the
  // members at hand (two while the slots hold them beside the spare ones, else one).
  int min_replicas = 0;
  // Workers kept started and Ready beside the members (at free ids of max_ranks): a
  // recovery or a scale-up takes them instead of starting a process (its stall).
  int spare_ranks = 0;
  // Workers time their MoE exchanges (WorkerConfig::step_timing): /v1/status and /metrics
  // show each rank's exchange time beside its step time.
  bool step_timing = false;

  // Elastic membership. "live": scale and recover while serving (prepare aside,
  // commit at a step boundary). "stop-the-world": the naive baseline (stop
  // admitting with 503, drain, restart every worker, resume).
  std::string reconfigure = "live";

  std::string device = "cpu";  // Workers' ModelOptions::device: cpu, cuda, cuda:N.
  bool device_f32 = false;     // f32 on the GPU (verification) instead of bf16.
  // Workers' ModelOptions::quantization ("", "bf16", "fp8"), sent in their WorkerConfig;
  // checked at start (check_quantization).
  std::string quantization;
  int gpus = 1;  // device "cuda": rank r runs on cuda:(r mod gpus).
  // The workers' data plane (create_transport): "shm" (one host), "ucx" (any hosts) or "hier"
  // (any hosts: shm within one, ucx across).
  std::string transport = "shm";
};

// The device rank `rank` runs on: options.device, or with device "cuda" and gpus > 1,
// cuda:(rank mod gpus) (ranks spread over the host's GPUs; joiners reuse freed ids).
std::string rank_device(const ClusterOptions& options, int rank);

// POST /v1/scale: {"ranks": N} (which ranks leave is chosen: least loaded) or
// {"remove": [ranks]}.
struct ScaleTarget {
  int ranks = -1;
  std::vector<int> remove;
  // InvalidArgument (HTTP 400) naming what is wrong with the body.
  static Result<ScaleTarget> from_json(const nlohmann::json& body);
};

class ClusterEngine : public ServingEngine {
 public:
  // Starts the control plane and the workers; returns once the first epoch has
  // committed (every rank loaded and stepping), or the error that prevented it.
  static Result<std::unique_ptr<ClusterEngine>> start(const ClusterOptions& options);
  ~ClusterEngine() override;

  // tcp://HOST:PORT that `flexpert worker --join` connects to.
  std::string control_endpoint() const;

  int vocab_size() const override;
  int max_context() const override;
  SamplingDefaults sampling_defaults() const override;
  Result<uint64_t> submit(CompletionRequest request, CompletionCallback on_event) override;
  void cancel(uint64_t request_id) override;
  bool healthy() const override;
  // Degraded with the healer retrying: the seconds until its next attempt (rounded up, 1 to
  // 30, its longest backoff); otherwise 1.
  int retry_after_s() const override;
  nlohmann::json status() const override;
  std::string metrics_text() const override;
  Status shutdown() override;

  // Plans a placement from the load window and moves it in now (blocks until done).
  // FailedPrecondition while another rebalance runs; returns its report.
  Result<nlohmann::json> rebalance();
  // Waits until no rebalance is in flight. With `cancel`, a running one stops at its
  // next safe point (between map switches; every committed map stays valid).
  // Returns whether one was running.
  bool drain_rebalance(bool cancel);
  // Changes the membership while serving; returns once the new epoch has committed
  // (its report: epoch, members, phase timings) or the change failed and was rolled
  // back. FailedPrecondition (409) while another reconfiguration or a rebalance runs;
  // InvalidArgument (400) for a target outside [1, max_ranks] or an unknown rank.
  Result<nlohmann::json> scale(const ScaleTarget& target);

  // GET /v1/eplb: placement, window load, balancedness, the last rebalance.
  nlohmann::json eplb_status() const;

  class Impl;

 private:
  explicit ClusterEngine(std::unique_ptr<Impl> impl);
  std::unique_ptr<Impl> impl_;
};

}  // namespace flexpert
