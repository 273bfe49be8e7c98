// SPDX-License-Identifier: Apache-2.0
// Model: an MoE decoder (Qwen3-MoE or DeepSeek-V3/V2) with its KV cache. Model::load
// picks the implementation from config.json's model_type and ModelOptions::device: the
// CPU models (src/model) or, with "cuda[:N]" in a FLEXPERT_WITH_CUDA build, the CUDA
// models (src/cuda).
//
// Loads a checkpoint directory (config.json + safetensors): the CPU models keep the
// mapped file alive and borrow dense weights from it, the CUDA models upload them;
// expert weights are copied into physical slots laid out by an ExpertPlacement.
// forward() runs one step for a batch of sequences, each a chunk of new tokens at
// consecutive positions in a KV-cache slot (a prefill chunk or one decode token). The
// KV cache is sized at load for max_sequences x max_seq_len and never reallocated. One
// thread drives a Model at a time (forward is not re-entrant); a CPU model
// parallelises internally over the ThreadPool, a CUDA model runs on its device's stream.
#pragma once

#include <cstdint>
#include <functional>
#include <memory>
#include <optional>
#include <string>
#include <vector>

#include "flexpert/model_config.h"
#include "flexpert/placement.h"
#include "flexpert/status.h"
#include "flexpert/tensor.h"
#include "flexpert/thread_pool.h"

namespace flexpert {

class ExpertSlots;
class MoeExecutor;

struct ModelOptions {
  // The expert placement: `expert_placement` when set (its layers and experts must be the
  // model's; a serving group's worker gets it from the front end), else the spec
  // `placement` (ExpertPlacement::parse: what --placement names).
  std::string placement = "identity";
  std::optional<ExpertPlacement> expert_placement;
  int max_sequences = 8;       // KV-cache slots.
  int max_seq_len = 0;         // Positions per slot; 0: min(config, 4096).
  ThreadPool* pool = nullptr;  // nullptr: ThreadPool::global().
  // Called as layers load: (layers done, layers total).
  std::function<void(int, int)> progress;

  // Expert parallelism. This process stores global slots
  // [first_slot, first_slot + num_local_slots) of every MoE layer (num_local_slots
  // < 0: all of the placement's slots) and loads only the experts those hold.
  int first_slot = 0;
  int num_local_slots = -1;
  // Where a layer's slot storage lives (e.g. a transport region peers can read);
  // nullptr: the heap. Must return at least num_bytes, zeroed, alive as long as the model.
  std::function<Result<void*>(int layer, size_t num_bytes)> allocate_slots;
  // Runs routed rows through the experts (e.g. across ranks); nullptr: in process.
  // Not owned; must outlive the model.
  MoeExecutor* moe_executor = nullptr;

  // Where the model runs: "cpu", or "cuda" / "cuda:N" (builds with FLEXPERT_WITH_CUDA).
  // On a GPU, weights and GEMM inputs are `device_dtype` (kBF16, or kF32 to verify
  // against the CPU) with f32 accumulation, and decode steps replay CUDA graphs captured
  // once per batch-size bucket unless cuda_graphs is false. Expert parallelism on a GPU
  // (Qwen3-MoE, DeepSeek): the executor's rows are computed on the device (MoeExecutor::
  // set_row_compute); allocate_slots memory holds a host mirror of the local slots.
  std::string device = "cpu";
  DType device_dtype = DType::kBF16;
  bool cuda_graphs = true;
  // Routed expert weights of a block-FP8 checkpoint: "bf16" dequantizes them at load (the
  // CPU path always does), "fp8" keeps them e4m3 with their block scales (GPU only,
  // docs/memory.md); "": on a GPU ModelConfig::default_gpu_quantization() where it can run
  // (device_dtype bf16, compute capability 8.9 or newer), else bf16. "fp8" with device
  // "cpu" is InvalidArgument.
  std::string quantization;
};

// ModelOptions::quantization against ModelOptions::device, before anything loads: "", "bf16"
// or "fp8", and "fp8" not on the CPU; else InvalidArgument saying which. Model::load checks it
// too; a serving front end calls it at start, before any worker loads.
Status check_quantization(const std::string& device, const std::string& quantization);

// What Model::forward_step returns for one batch row: a token always, and the row's
// logits for kLogits.
struct RowOutput {
  enum Kind : uint8_t {
    kGreedy,  // The argmax of the row's logits (the lowest id on ties; NaN never wins).
    kSample,  // kernels::sample_truncated(row, temperature, top_k, top_p, u01): softmax(logits /
              // T) cut to top-k / top-p, drawn at u01.
    kLogits,  // The greedy token and the logits row (the caller samples on the host).
  };
  Kind kind = kGreedy;
  float temperature = 1.0f;  // kSample: > 0.
  int top_k = 0;             // kSample: 0 (no limit) or the candidates kept.
  float top_p = 1.0f;        // kSample: in (0, 1]; 1: no limit.
  double u01 = 0.0;          // kSample: the uniform draw, in [0, 1).
};

// The new tokens of one sequence in a step.
struct SequenceChunk {
  int kv_slot = 0;    // Which KV-cache slot the sequence owns.
  int start_pos = 0;  // Position of tokens[0]; earlier positions are cached.
  std::vector<int32_t> tokens;
};

class Model {
 public:
  static Result<std::unique_ptr<Model>> load(const std::string& dir, const ModelOptions& options);
  virtual ~Model() = default;

  virtual const ModelConfig& config() const = 0;
  virtual const ExpertPlacement& placement() const = 0;
  virtual int max_sequences() const = 0;
  virtual int max_seq_len() const = 0;

  // Runs one step. `logits` receives [batch.size(), vocab] f32: the logits of the
  // last token of each chunk. InvalidArgument for an out-of-range token id,
  // slot or position; nothing is written to the cache then. An empty batch still
  // runs every layer (an expert-parallel rank without requests joins the exchange).
  // Errors of the MoE executor (a dead peer, an epoch change) are returned as is;
  // the KV cache of the batch's sequences is then undefined for this step.
  virtual Status forward(const std::vector<SequenceChunk>& batch, Tensor* logits) = 0;
  // Runs one step as forward() does, and returns per batch row (rows[b]) its token in
  // (*tokens)[b] and, for kLogits rows only, its logits row in *logits (other rows are
  // unspecified). A GPU model picks the tokens on the device and copies out B ids
  // instead of B x vocab floats. The default runs forward() and picks on the host.
  virtual Status forward_step(const std::vector<SequenceChunk>& batch,
                              const std::vector<RowOutput>& rows, Tensor* logits,
                              std::vector<int32_t>* tokens);

  // Rows computed per [layer][slot] since the last reset (EPLB load statistics).
  virtual const std::vector<std::vector<int64_t>>& slot_counts() const = 0;
  virtual void reset_slot_counts() = 0;

  // The slot storage of MoE layer `layer` held by this process (nullptr for dense layers).
  virtual ExpertSlots* local_slots(int layer) = 0;
  // Replaces the expert placement (same slot count); the caller has made sure that
  // every slot it maps holds the right weights. Takes effect at the next forward().
  virtual Status set_placement(ExpertPlacement placement) = 0;
  // Copies logical expert `expert` of MoE layer `layer` from the checkpoint into
  // local slot `local_slot` (recovery of an expert whose every replica was lost).
  // Safe beside forward() while no placement the model uses maps that slot.
  virtual Status load_expert(int layer, int expert, int local_slot) {
    return unimplemented("this model cannot reload experts from its checkpoint");
  }
  // Tells the model that local slot `local_slot` of local_slots(layer) was written (a
  // pull from a peer): a GPU model copies it to its device copy before returning, so
  // a map that points at the slot may be committed once this returns. Called by the
  // weight mover thread beside forward(), under the same rule as load_expert.
  virtual Status slots_written(int layer, int local_slot) { return Status(); }
  // Copies local slot `src_slot` of rank `src_rank` (this rank too) of MoE layer `layer`
  // into local slot `local_slot` between device memories, on a copy engine (GPU ranks with
  // the device exchange, whose peers export their slots through CUDA IPC), refreshes the
  // host mirror of the slot, and returns once both landed; a map may then use the slot.
  // Unimplemented when the model cannot: the caller copies host mirrors (transport read()
  // and slots_written). The weight mover's call, under the same rule as load_expert.
  virtual Status copy_slot(int layer, int local_slot, int src_rank, int src_slot) {
    return unimplemented("this model copies slots through host memory");
  }
  // Not OK once the device can run nothing more in this process: a GPU context failed with
  // a sticky error (an illegal address, a failed launch, an MPS server that failed), after
  // which every call fails. A worker then exits and the group replaces it. OK on the CPU.
  virtual Status device_lost() const { return Status(); }
  // CUDA graphs captured so far (0 on the CPU): stays flat across set_placement().
  virtual int64_t num_graph_captures() const { return 0; }
  // Prepares what steps replay, in isolation from any group: a GPU model captures the
  // decode graph of every batch bucket on padding rows (nothing a request sees, no
  // slot statistics, no exchange with peers), so a rank that joins a serving group
  // captures while it prepares and not on its first steps. Nothing to do on the CPU.
  virtual Status warm_up() { return Status(); }
};

}  // namespace flexpert
