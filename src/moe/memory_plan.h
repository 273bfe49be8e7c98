// SPDX-License-Identifier: Apache-2.0
// plan_memory: the bytes one rank of a serving group holds, from config.json alone.
//
// It mirrors what a worker allocates (src/engine/worker_slots.cc; the CUDA models in src/cuda,
// the CPU models in src/model; the shm transport): dense weights (every rank holds them:
// attention is data parallel), expert slots at capacity (expert_slots_per_rank, placement.h),
// the KV cache, step workspaces, transport buffers. Each term says whether the code sizes
// it exactly as written here or it is an estimate (the CUDA context). `fp8` plans FP8 e4m3
// weights with fp32 block scales for every projection a block-FP8 checkpoint quantizes
// (docs/memory.md); the GPU path does not keep them FP8 yet, so that column is the plan for
// that path. Pure functions of their arguments; thread-safe.
#pragma once

#include <cstdint>
#include <string>
#include <vector>

#include "flexpert/model_config.h"
#include "flexpert/status.h"

namespace flexpert {

// sizeof(StepHeader) in src/engine/worker_impl.h (static_assert there): the gather mailboxes.
inline constexpr uint64_t kStepHeaderBytes = 32;

struct MemoryPlanOptions {
  int ranks = 1;
  int max_ranks = 0;  // 0: ranks.
  int min_ranks = 0;  // 0: ranks.
  int spare_ranks = 0;
  int slots_per_rank = 0;  // 0: expert_slots_per_rank() (as `serve`).
  int eplb_spare_slots = 1;
  int min_replicas = 1;
  // "bf16" or "fp8"; "": fp8 for a block-FP8 checkpoint on cuda, else bf16.
  std::string quantization;
  std::string device = "cuda";  // "cuda" (or "cuda:N") or "cpu".
  int max_seq_len = 0;          // 0: the model's, at most 4096 (as `serve`).
  int max_sequences = 32;       // Per rank.
  int max_tokens_per_step = 256;
  uint64_t memory_bytes = 0;            // Per rank: the GPU's (cuda), or what a CPU rank may use.
  uint64_t reserve_bytes = 1ull << 30;  // CUDA context, kernels, graphs: an estimate.
};

// One line of the plan. `params` counts weights (0 for buffers).
struct MemoryTerm {
  std::string name;
  int64_t params = 0;
  uint64_t bytes = 0;
  bool estimate = false;
  std::string detail;
};

struct MemoryPlan {
  std::string model_type;
  std::string quantization;  // "bf16" or "fp8" (resolved); on the CPU "f32" or "f16" too.
  std::string device;
  int ranks = 0, max_ranks = 0, min_ranks = 0, spare_ranks = 0;
  int num_experts = 0, num_moe_layers = 0, slots_per_rank = 0;
  int max_seq_len = 0, max_sequences = 0;
  int step_tokens = 0;  // Tokens of one step piece on the GPU (workspace rows).

  int64_t dense_params = 0;      // Held by every rank.
  int64_t expert_params = 0;     // Routed experts of all MoE layers, each once.
  int64_t activated_params = 0;  // Dense + top_k experts per MoE layer: one token's.
  uint64_t slot_bytes = 0;       // One expert slot: gate, up, down (and scales).

  std::vector<MemoryTerm> dense;       // Sum: dense_bytes.
  std::vector<MemoryTerm> workspaces;  // Sum: workspace_bytes.
  std::vector<MemoryTerm> host;        // Host memory of a GPU rank besides; not in total.
  uint64_t dense_bytes = 0;
  uint64_t expert_slot_bytes = 0;   // slots_per_rank x MoE layers x slot_bytes.
  uint64_t kv_bytes_per_token = 0;  // All layers, one cached token.
  int kv_slots = 0;                 // Sequences the cache holds (the GPU keeps one spare).
  uint64_t kv_bytes = 0;
  uint64_t workspace_bytes = 0;
  uint64_t total_bytes = 0;  // dense + expert slots + KV + workspaces.
  uint64_t memory_bytes = 0;
  uint64_t host_bytes = 0;  // Sum of `host`.
  // Device bytes of a cuda_ipc transport's receive buffer at max_ranks (device collectives).
  // Not in total_bytes: a GPU worker's cuda_ipc keeps its collectives in host shared memory
  // (TransportOptions::host_collectives), the `host` term of the mailboxes.
  uint64_t cuda_ipc_recv_bytes = 0;

  bool fits() const { return total_bytes <= memory_bytes; }
};

// InvalidArgument for flags out of range (as `serve` refuses them), fp8 on the CPU path
// (which dequantizes) or slots that cannot hold the experts; Unimplemented for what the
// models refuse (attention_bias).
Result<MemoryPlan> plan_memory(const ModelConfig& config, const MemoryPlanOptions& options);

// The largest context at options.max_sequences and the largest batch at the context of
// `options` (the plan's max_seq_len) whose whole plan fits in options.memory_bytes; 0 when
// none does. Contexts stop at max_position_embeddings.
struct MemoryFit {
  int max_seq_len = 0;
  bool at_model_limit = false;  // max_seq_len is max_position_embeddings: memory allows more.
  int max_sequences = 0;
  int64_t kv_tokens = 0;  // Cached tokens the memory left after the rest holds (all sequences).
};
Result<MemoryFit> fit_memory(const ModelConfig& config, const MemoryPlanOptions& options);

}  // namespace flexpert
