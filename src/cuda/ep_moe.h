// SPDX-License-Identifier: Apache-2.0
// DeviceEpMoe: the device side of expert parallelism for a CUDA model (Qwen3-MoE and
// DeepSeek share it); owned by the model, driven by its thread.
//
// A step is a chain of segments. Segment s (< number of MoE layers) ends with MoE layer
// moe_layers[s]'s routing on the device; its normalised rows, chosen slots and router
// weights go to pinned host memory (enqueue_route_out). Between segments the executor
// exchanges them with the peers (dispatch), computes the rows this rank owns through
// the RowCompute installed here (the grouped GEMMs over the device copy of the local
// slots), returns results (combine) and sums them per token; segment s + 1 starts by
// adding that sum to the residual stream (enqueue_add_output). A decode bucket replays
// one graph per segment, captured on the bucket's second step (the first warms cuBLAS
// up); nothing captured depends on the expert map or the membership epoch, so neither
// recaptures. The model keeps its slot mirrors and counts; this class only reads them.
//
// Device exchange (ep_exchange.h; the default with an EpMoeExecutor, unless
// FLEXPERT_EP_EXCHANGE=host): the rows never leave the GPU. Between segments the model's
// stream runs publish, wait, gather, the grouped GEMMs over the rows this rank owns, done,
// wait and combine, reading the peers' buffers through the transport's mapped peer buffers
// (registered by every rank at load, mapped once per incarnation of a member; needs a
// transport with capabilities().mapped_peer_buffers, else the host exchange serves); the host
// enqueues the step (at most kExchangesAhead exchanges past the device) and waits at its
// end, watching the members' liveness (Transport::peer_status) meanwhile: a death ends
// the waits on the dead rank (ep_release) and the step fails with the transport's
// "rank R (pid P) died". An owner receives at most the group's
// step tokens * top_k rows (EpMoeExecutor::step_tokens, from the step headers); a step whose
// bound exceeds the capacity sized at load takes the host exchange (every member decides
// the same from the same headers). Ranks are meant to be processes (under MPS when they
// share a GPU); ranks of one process wait on each other inside one CUDA context, so they
// need CUDA_MODULE_LOADING=EAGER (a lazy kernel load waits for the context's running
// kernels, the peer's waits among them), streams on separate hardware queues
// (CUDA_DEVICE_MAX_CONNECTIONS) and nothing that synchronises the device mid-step. The
// release's stream too must not share the step stream's hardware queue (a worker makes
// five streams, under the default eight queues).
//
// FP8 slots (MoeDims::fp8, docs/cuda.md "FP8 experts"): the owner's rows run through
// fp8_experts.h's kernels, as in one process (moe_layer.h's fp8_path): FP8 wgmma where it
// runs; else the host exchange's row compute takes the decode kernels up to
// kDecodeMaxTokens rows and the tile above, and the device exchange the tile, which leaves
// the rows in the scratch for the peers to read. Slot
// buffers, their mappings and copy_slot are sized by MoeDims::slot_bytes() (scales included).
#pragma once

#include <atomic>
#include <condition_variable>
#include <functional>
#include <map>
#include <memory>
#include <mutex>
#include <thread>
#include <vector>

#include "cuda/blas.h"
#include "cuda/device.h"
#include "cuda/ep_exchange.h"
#include "cuda/moe_layer.h"
#include "flexpert/model.h"
#include "moe/ep_executor.h"
#include "moe/expert_slots.h"
#include "moe/moe_executor.h"

namespace flexpert::cuda {

// Device addresses of a step's inputs (fixed, so graphs read them at replay); the
// pinned host copy (host_in_ of the models) has the same layout, filled by
// fill_step_inputs.
struct StepInputs {
  int32_t* ids;
  int32_t* positions;
  int32_t* kv_slots;
  int32_t* last_rows;  // Token row of each logits row.
  int32_t* num_valid;  // [1] tokens that are not padding.
};

// Rows of an expert-parallel step as the models lay out their pinned step inputs (ids,
// positions, KV slots at strides of max_tokens; logits rows at 3 * max_tokens; the
// count of real rows at 3 * max_tokens + max_rows).
struct EpStepRows {
  int num_tokens = 0;  // Device rows (a decode bucket includes its padding).
  int num_real = 0;    // Rows that are not padding.
  int num_rows = 0;    // Logits rows computed.
};
// bucket > 0: a decode batch padded to `bucket` rows (padding in KV slot spare_kv_slot);
// else every token of every chunk. Never split: every member must run the same
// exchanges (Unimplemented past max_tokens; the worker's token budget is far below).
Result<EpStepRows> fill_step_inputs(const std::vector<SequenceChunk>& batch, int bucket,
                                    int max_tokens, int max_rows, int spare_kv_slot, int32_t* host);

class DeviceEpMoe {
 public:
  struct Config {
    MoeDims dims;  // The model's: global slot count, top_k, shapes, dtype.
    int first_slot = 0;
    int num_local_slots = 0;
    int max_tokens = 0;           // Tokens of one step (the model's step capacity).
    std::vector<int> moe_layers;  // Segment s ends at MoE layer moe_layers[s].
    // Device slot buffer ([num_local_slots][dims.slot_bytes()]) of a MoE layer.
    std::function<const void*(int layer)> layer_slots;
    MoeExecutor* executor = nullptr;                      // Not owned.
    const std::vector<ExpertSlots>* mirrors = nullptr;    // [layer] host slots (executor shape).
    std::vector<std::vector<int64_t>>* counts = nullptr;  // [layer][global slot] rows computed.
    // The model's routing buffers, which every segment ending in a MoE layer fills:
    // routed rows [max_tokens, H] in dims.dtype, and the routing's slots and weights
    // [max_tokens * top_k]; each the base of a cudaMalloc (the transport exports them to the
    // device exchange's peers; the host exchange copies them out).
    const void* route_h = nullptr;
    const int32_t* route_slot = nullptr;
    const float* route_weight = nullptr;
    int device = 0;
  };
  // Installs compute_rows() as the executor's RowCompute; Unimplemented if it takes none.
  static Result<std::unique_ptr<DeviceEpMoe>> create(Config config, Blas& blas,
                                                     cudaStream_t stream);
  // Uninstalls the RowCompute (the executor outlives the model).
  ~DeviceEpMoe();
  DeviceEpMoe(const DeviceEpMoe&) = delete;
  DeviceEpMoe& operator=(const DeviceEpMoe&) = delete;

  // Enqueued by the model inside its segments (capturable).
  // The routing of the segment's MoE layer (Config::route_h / route_slot / route_weight).
  Status enqueue_route_out(int num_tokens);
  Status enqueue_add_output(float* x, int num_tokens);

  // One step of num_tokens device rows (num_real of them real, the rest decode padding);
  // bucket > 0 with graphs on: replay / capture per segment. Joins every exchange even
  // when num_tokens is 0. enqueue_segment(seg) enqueues segment seg.
  Status run_step(int num_tokens, int num_real, int bucket, bool graphs,
                  const std::function<Status(int seg)>& enqueue_segment);

  // Segments of a step: one per MoE layer and the last (the head).
  int num_segments() const { return static_cast<int>(config_.moe_layers.size()) + 1; }
  // Captures the segment graphs of one decode bucket now, alone (after one eager pass
  // over the segments): the inputs are the model's (padding rows), no exchange runs.
  Status warm_up(int bucket, const std::function<Status(int seg)>& enqueue_segment);

  int64_t num_graph_captures() const { return captures_; }
  bool graphs_failed() const { return graphs_failed_; }
  bool device_exchange() const { return device_exchange_; }
  // copy_slot() may serve: the device exchange's mappings, or device reads over the transport.
  bool copies_slots() const { return device_exchange_ || direct_reads_; }

  // Copies `bytes` at `offset` of rank src_rank's slots of `layer` (this rank's own too)
  // into `dst`, device to device on `stream`, and returns once it landed. The weight
  // mover's thread: it maps peers' slot buffers through the transport (registered at load),
  // holding them apart from the step's mappings; a departed rank's
  // are released at the next epoch's map_peers. Unimplemented (the caller copies through
  // the host mirrors) for a layer of another rank not mapped yet once this rank serves:
  // mapping it would hold the serving thread (see stepped_). A rank on another host
  // (never mapped): read() through the transport straight into `dst` where it has
  // capabilities().device_buffer_reads (a CUDA-aware UCX), else Unimplemented; such a read
  // holds no lock that map_peers takes, and fails Aborted when an epoch change's map_peers
  // ran meanwhile.
  Status copy_slot(int layer, int src_rank, size_t offset, void* dst, size_t bytes,
                   cudaStream_t stream);

  // Adds the rows the device exchange counted per slot into Config::counts and zeroes them
  // (synchronises the stream); reset_counts() zeroes them only.
  Status collect_counts();
  Status reset_counts();

 private:
  DeviceEpMoe(Config config, Blas& blas, cudaStream_t stream);
  Status run_segment(int seg, int bucket, bool capture,
                     const std::function<Status(int seg)>& enqueue_segment);
  Status exchange(int seg, int num_real);
  Status compute_rows(int layer, const int32_t* local_slot, const float* const* rows, int64_t count,
                      float* results);
  Status enqueue_route_copies(int num_tokens);
  // Device exchange.
  struct PeerMapping;
  Status init_device_exchange(EpMoeExecutor& executor);
  Status map_peers(const Group& group);
  // Maps rank r's buffers unless mapped_[r] holds its current incarnation.
  Status map_peer(int r);
  // The incarnation of rank r whose buffers the transport would map now (maps nothing).
  Result<uint64_t> window_incarnation(int r);
  // Registers every MoE layer's slot buffer with ep_'s transport (peers' copy_slot).
  Status register_slot_buffers();
  // copy_slot through a mapping (or this rank's own slots), under slots_mu_ until the copy
  // landed: true once it has; false where the slots are another host's, read by the transport.
  Result<bool> copy_mapped_slot(int layer, int src_rank, size_t offset, void* dst, size_t bytes,
                                cudaStream_t stream);
  // Bytes of one layer's slot buffer, on every rank (one configuration).
  size_t slot_buffer_bytes() const;
  // Opens m's buffers (m.rank and m.info set) after those opened before, until all are or
  // the clock passes deadline_ns (at least one a call); true once all are.
  Result<bool> open_peer(PeerMapping& m, int64_t deadline_ns);
  // EpMoeExecutor's device probe (the stepping thread, before each step header): true
  // when every member of `group` is mapped (or was mapped here, to be installed by
  // map_peers at the next device step); else maps one more member and says no, so that
  // the group serves with the host exchange meanwhile. Across GPUs mapping one peer takes
  // milliseconds (H200 x2, 8 ranks: 2-3.5 ms for five buffers), which the whole lockstep group
  // waited for at once at every scale-up; on another thread it stalled the steps longer (the driver
  // serialises this context's calls with it: 50-250 ms). A member the transport answers
  // Unimplemented for (hier: on another host) is never mapped: no for as long as the group
  // lasts.
  bool ready_for(const Group& group);
  static constexpr int64_t kMapSliceNs = 500'000;        // Mapping per step, at least one buffer.
  static constexpr int64_t kMapRetryNs = 1'000'000'000;  // After a failed mapping.
  EpArgs exchange_args(const Group& group) const;
  Status enqueue_device_exchange(int seg, int num_tokens, int num_real, int bound,
                                 const Group& group);
  Status finish_device_step(const Group& group);
  // The watch of one step (start_watch at its start): until `done` completes, checks the
  // members' liveness every millisecond and the transport's timeout since the last wait
  // that passed, ending the waits of the dead or, at the timeout, of every member
  // (release_waits). finish_device_step watches the step's end, enqueue_device_exchange
  // the exchange kExchangesAhead before the one it enqueues.
  struct StepWatch {
    int64_t deadline_ns = 0, next_check_ns = 0;
    uint64_t seen = 0;  // progress_ at the last look.
    Status gone;        // A member the transport saw end.
    // The step's first release (0: none) and the next report of a step still running.
    int64_t released_ns = 0, next_report_ns = 0;
  };
  void start_watch();
  uint64_t other_members(const Group& group) const;  // Bits of the members but this rank.
  Status watch_until(cudaEvent_t done, const Group& group);
  // Ends the waits of the step's exchanges on `ranks` (ep_release from release_stream_),
  // the host's abort word set too; again at most every kReleaseAgainNs while the step runs.
  // A release that cannot be enqueued ends the process (its stream would never drain).
  void release_waits(uint64_t ranks, int64_t now_ns);
  // After a step whose exchanges failed or were released (its stream drained): the
  // released flags back to their values, the step's status cleared, the abort word down.
  Status reset_after_failed_step();
  static constexpr int64_t kReleaseAgainNs = 1'000'000;
  // A step still running this long after its waits were released is reported (each
  // second), and at kReleasedStepLimitNs the process ends: a stream that does not drain
  // would hold the rank, and with it the group, for good.
  void check_released_step(int64_t now_ns);
  static constexpr int64_t kReleasedStepReportNs = 1'000'000'000;
  static constexpr int64_t kReleasedStepLimitNs = 10'000'000'000;
  // Step timing (EpMoeExecutor::timing, a group of more than one member): events on the
  // stream around each device exchange's dispatch (publish, wait, gather) and combine (done,
  // wait, combine), 4 per MoE layer: [dispatch start, end, combine start, end]. The segments'
  // graphs hold none (the exchange runs between them, eagerly); then the step's start and
  // end (record_exchange_event(-1, .)). Created at the first timed step; read once the step
  // has finished (add_exchange_time), which also logs a step slower than
  // FLEXPERT_STEP_LOG_MS with its parts.
  Status start_exchange_timing(const Group& group);
  Status record_exchange_event(int seg, int which);
  Status add_exchange_time();

  Config config_;
  Blas& blas_;
  cudaStream_t stream_;
  MoeDims local_dims_;  // Row compute: top_k 1 over the local slots.
  MoeScratch scratch_;
  int chunk_rows_ = 0;
  DeviceBuffer rows_, results_;         // Row compute: [chunk, H] in dtype / f32.
  DeviceBuffer out_, ones_, iota_;      // Step: f32 [T, H] MoE output, [T] 1.0, [T] t.
  PinnedBuffer rows_host_, slot_host_;  // Row compute staging.
  PinnedBuffer h_host_, route_slot_host_, route_weight_host_, out_host_;
  std::vector<float> x_;  // Routed rows as f32 (bf16 models).
  Routing routing_;
  std::map<int, std::vector<GraphExec>> graphs_;  // Bucket -> segment graphs.
  std::map<int, int> bucket_steps_;               // Bucket -> steps run.
  int64_t captures_ = 0;
  bool graphs_failed_ = false;

  // Device exchange (device_exchange_ false: the executor's host exchange).
  bool device_exchange_ = false;
  // The transport reads peers' device buffers (slots) into ours (device_buffer_reads).
  bool direct_reads_ = false;
  EpMoeExecutor* ep_ = nullptr;  // Set with the device exchange or direct_reads_.
  int device_cap_ = 0;           // Rows an owner may receive in one device step.
  DeviceBuffer window_;          // EpWindow, then pos [max_tokens * top_k].
  DeviceBuffer peer_table_;      // EpPeer [kEpMaxRanks]
  DeviceBuffer status_;          // EpStatus
  DeviceBuffer num_rows_;        // i32: rows received this layer
  DeviceBuffer stats_;           // i64 [MoE layer][local slot]: rows computed
  PinnedBuffer status_host_, abort_, progress_;
  Event step_done_;
  Stream release_stream_;            // ep_release's kernel, while stream_ waits.
  std::vector<Event> ahead_events_;  // [kExchangesAhead]: an exchange's end, by segment.
  static constexpr int kExchangesAhead = 8;
  static constexpr int64_t kSlowWaitNs = 100'000'000;  // Logged: a stall's place in the logs.
  StepWatch watch_;
  uint64_t released_ = 0;  // Ranks whose flags release_waits wrote this step.
  int64_t released_at_ns_ = 0;
  EpPeer self_;
  std::vector<std::unique_ptr<PeerMapping>> mapped_;  // [rank]; null: not mapped
  // ready_for's: the group it checked last, its members still to map and those mapped
  // for it (installed by map_peers), whether all are, or a mapping failed.
  bool checked_ = false;
  bool checked_ready_ = false;
  bool map_failed_ = false;
  int64_t map_retry_ns_ = 0;  // When a failed mapping is tried again.
  Group checked_group_;
  std::vector<std::unique_ptr<PeerMapping>> map_todo_;
  std::vector<std::unique_ptr<PeerMapping>> staged_;
  bool peers_mapped_ = false;
  Group mapped_group_;
  uint64_t exchange_index_ = 0;  // Exchanges of this epoch so far.
  bool timed_step_ = false;      // This step records exchange_events_.
  int64_t timed_start_ns_ = 0;   // A timed step's start and end of enqueueing (host clock).
  int64_t timed_enqueued_ns_ = 0;
  std::vector<Event> exchange_events_;
  int64_t peer_mappings_ = 0;  // PeerMappings built (map_peer).
  // The weight mover's mappings of peers' slot buffers ([rank], guarded by slots_mu_).
  struct SlotMapping;
  std::mutex slots_mu_;
  // Under slots_mu_: the group changes map_peers installed (each releases departed ranks'
  // slot mappings); a slot read over the transport (without the lock) that one overtook
  // fails (copy_slot).
  uint64_t slots_generation_ = 0;
  // Set by the stepping thread once this rank serves: from then on copy_slot maps no slot
  // buffer of another rank (the host mirrors carry those copies).
  std::atomic<bool> stepped_{false};
  std::vector<std::unique_ptr<SlotMapping>> slot_maps_;
  // Departed ranks' mappings, closed by closer_ (started at the first) once the owner's
  // process has exited, or kRetireCapNs after the departure: closing the mapping of a
  // rank that has just died, while the driver still tears its memory down, stalls this
  // context's work until the teardown ends (H200 under MPS: the recovery's first step
  // took 17-22 ms with the close on that step or on another thread, 2.5-3 ms without). An
  // owner still alive at the departure (a scale-down's leaver) is closed at once instead:
  // under MPS the server tears a client down after its exit, and a close then waited for
  // that teardown's driver lock while holding this context (a survivor's step 10-23 ms,
  // ~0.3 s after a scale-down's commit, in 5 of 15 runs).
  struct Retired;
  static constexpr int64_t kRetireCapNs = 2'000'000'000;
  void retire(std::unique_ptr<PeerMapping> peer, std::unique_ptr<SlotMapping> slots);
  std::mutex retire_mu_;
  std::condition_variable retire_cv_;
  std::vector<Retired> retired_;
  bool closer_stop_ = false;
  std::thread closer_;
};

}  // namespace flexpert::cuda
