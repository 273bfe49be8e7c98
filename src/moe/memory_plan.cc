// SPDX-License-Identifier: Apache-2.0
// NOTE: every term below restates an allocation of the worker's model, cited by file; the
// CUDA constants (step piece, EP chunk rows, cuBLAS workspaces, split scratch) are copied
// from src/cuda, which a CPU-only build does not compile. A change there changes this plan.
#include "moe/memory_plan.h"

#include <algorithm>
#include <string>

#include "flexpert/placement.h"
#include "transport/shm/shm_layout.h"

namespace flexpert {
namespace {

// src/cuda/cuda_moe_model.h kDefaultStepTokens; src/cuda/ep_moe.cc kChunkRows, kMaxDeviceRows;
// src/cuda/blas.cc and head_gemm.cc kWorkspaceBytes; src/cuda/ep_exchange.h kEpMaxRanks,
// sizeof(EpWindow), sizeof(EpPeer), sizeof(EpStatus); src/cuda/moe_layer.cc kMinTileRows;
// src/cuda/kernels.h kPermuteCountInts, sample_rows_chunks; src/cuda/attention.cu
// kSplitTargetWarps, kGqaMaxWarps; src/cuda/mla_kernels.cu kMlaSplitTargetBlocks, kMmaRows.
constexpr int64_t kStepTokens = 2048;
constexpr int64_t kChunkRows = 8192;
constexpr int64_t kMaxDeviceRows = 65536;
constexpr uint64_t kBlasWorkspace = 32ull << 20;
constexpr uint64_t kHeadGemmWorkspace = 8ull << 20;
constexpr int kEpMaxRanks = 64;
constexpr uint64_t kEpWindowBytes = 2816, kEpPeerBytes = 48, kEpStatusBytes = 24;
constexpr int64_t kMinTileRows = 4;
constexpr int64_t kPermuteCountInts = 3;
constexpr int64_t kSplitTargetWarps = 2048, kGqaMaxWarps = 2048;
constexpr int64_t kMlaSplitTargetBlocks = 264, kMlaMmaRows = 16;
constexpr size_t kDeviceAlignBytes = 256;  // src/transport/cuda_ipc/cuda_ipc_layout.h

uint64_t u(int64_t v) { return static_cast<uint64_t>(std::max<int64_t>(v, 0)); }
int64_t ceil_div(int64_t a, int64_t b) { return (a + b - 1) / b; }
int64_t next_pow2(int64_t v) {
  int64_t p = 1;
  while (p < v) p <<= 1;
  return p;
}
uint64_t round_up(uint64_t n, uint64_t align) { return (n + align - 1) / align * align; }

// How a projection matrix is stored: 16-bit (or the CPU's checkpoint dtype), or FP8 e4m3
// with one fp32 scale per block (docs/memory.md).
struct MatrixFormat {
  uint64_t elem_bytes = 2;
  bool fp8 = false;
  int64_t block_rows = 128, block_cols = 128;

  uint64_t bytes(int64_t rows, int64_t cols) const {
    if (!fp8) return u(rows * cols) * elem_bytes;
    return u(rows * cols) + u(ceil_div(rows, block_rows) * ceil_div(cols, block_cols)) * 4;
  }
};

// Adds params and bytes to a term.
void add(MemoryTerm& t, int64_t params, uint64_t bytes) {
  t.params += params;
  t.bytes += bytes;
}

// The dense weights every rank holds (the GPU models' load_layer / load_weights, the CPU
// models' load_layer): attention, norms, embeddings and head, routers, shared experts, dense
// MLP layers. `proj`: attention and MLP projections; `plain`: 16-bit matrices that stay so
// (embeddings, head, routers); vectors are f32 on both paths.
std::vector<MemoryTerm> dense_terms(const ModelConfig& c, const MatrixFormat& proj, uint64_t plain,
                                    bool cpu, int* num_moe_layers) {
  const int64_t H = c.hidden_size, V = c.vocab_size, E = c.num_experts;
  auto term = [](const char* name) {
    MemoryTerm t;
    t.name = name;
    return t;
  };
  MemoryTerm embed = term("embedding + LM head"), attn = term("attention"), norms = term("norms"),
             router = term("routers"), shared = term("shared experts"),
             mlp = term("dense MLP layers");
  // A tied head: the GPU uploads the embedding twice; the CPU borrows it.
  add(embed, V * H, u(V * H) * plain);
  if (c.tie_word_embeddings) {
    if (!cpu) embed.bytes += u(V * H) * plain;
  } else {
    add(embed, V * H, u(V * H) * plain);
  }
  add(norms, H, u(H) * 4);  // model.norm
  int moe_layers = 0, dense_layers = 0;
  for (int l = 0; l < c.num_hidden_layers; ++l) {
    add(norms, 2 * H, u(2 * H) * 4);
    if (c.is_deepseek()) {
      const int64_t nh = c.num_attention_heads, dn = c.qk_nope_head_dim, dr = c.qk_rope_head_dim;
      const int64_t dv = c.v_head_dim, r = c.kv_lora_rank, qr = c.q_lora_rank;
      if (qr > 0) {
        add(attn, qr * H, proj.bytes(qr, H));
        add(attn, nh * (dn + dr) * qr, proj.bytes(nh * (dn + dr), qr));
        add(norms, qr, u(qr) * 4);
      } else {
        add(attn, nh * (dn + dr) * H, proj.bytes(nh * (dn + dr), H));
      }
      add(attn, (r + dr) * H, proj.bytes(r + dr, H));
      add(norms, r, u(r) * 4);
      // kv_b, as the absorbed factors w_uk_t and w_uv (f32 on the CPU).
      const int64_t kv_b = nh * (dn + dv) * r;
      add(attn, kv_b, cpu ? u(kv_b) * 4 : proj.bytes(nh * (dn + dv), r));
      add(attn, H * nh * dv, proj.bytes(H, nh * dv));
    } else {
      const int64_t D = c.head_dim, q_dim = c.num_attention_heads * D;
      const int64_t kv_dim = c.num_key_value_heads * D;
      add(attn, q_dim * H, proj.bytes(q_dim, H));
      add(attn, 2 * kv_dim * H, 2 * proj.bytes(kv_dim, H));
      add(attn, H * q_dim, proj.bytes(H, q_dim));
      add(norms, 2 * D, u(2 * D) * 4);
    }
    if (c.is_moe_layer(l)) {
      ++moe_layers;
      // The CPU Qwen3 model keeps its router in f32.
      add(router, E * H, u(E * H) * (cpu && !c.is_deepseek() ? 4 : plain));
      if (c.is_deepseek() && c.topk_method == "noaux_tc") add(router, E, u(E) * 4);
      const int64_t S = static_cast<int64_t>(c.moe_intermediate_size) * c.num_shared_experts;
      if (c.is_deepseek() && S > 0) {
        add(shared, 3 * S * H, 2 * proj.bytes(S, H) + proj.bytes(H, S));
      }
    } else {
      ++dense_layers;
      const int64_t I = c.intermediate_size;
      add(mlp, 3 * I * H, 2 * proj.bytes(I, H) + proj.bytes(H, I));
    }
  }
  attn.detail = std::to_string(c.num_hidden_layers) + " layers";
  mlp.detail = std::to_string(dense_layers) + " layers";
  router.detail = shared.detail = std::to_string(moe_layers) + " MoE layers";
  if (c.tie_word_embeddings) embed.detail = cpu ? "tied" : "tied: uploaded twice";
  *num_moe_layers = moe_layers;
  std::vector<MemoryTerm> out;
  for (MemoryTerm* t : {&embed, &attn, &norms, &router, &shared, &mlp}) {
    if (t->params > 0) out.push_back(std::move(*t));
  }
  return out;
}

// MoeScratch::create (src/cuda/moe_layer.cc) for `tokens` tokens.
uint64_t moe_scratch_bytes(int64_t tokens, int64_t top_k, int64_t num_experts, int64_t num_slots,
                           int64_t hidden, int64_t inter, uint64_t esize, bool fp8) {
  const int64_t P = tokens * top_k;
  const int64_t tiles = ceil_div(P, kMinTileRows) + std::min(P, num_slots);
  uint64_t bytes = u(tokens * num_experts) * 4 + u(5 * P) * 4 + u(num_slots + 1) * 4 +
                   u(kPermuteCountInts * num_slots) * 4 + u(2 * tiles) * 4 + 4 +
                   u(P * inter) * esize + u(P * hidden) * esize + 4 + 8;
  if (fp8) {  // The rows quantized to e4m3 for the FP8 GEMMs, and their scales.
    const int64_t k = std::max(hidden, inter);
    bytes += u(std::max<int64_t>(P, 1) * k) +
             u(ceil_div(k, 128)) * round_up(u(std::max<int64_t>(P, 1)), 4) * 4;
  }
  return bytes;
}

// The CUDA model's scratch (allocate_io, allocate_scratch), tables, and DeviceEpMoe's buffers
// (src/cuda/ep_moe.cc) when the rank holds part of the slots; pinned host buffers go to
// `host`.
void cuda_workspaces(const ModelConfig& c, const MemoryPlan& p, uint64_t reserve,
                     std::vector<MemoryTerm>* dev, std::vector<MemoryTerm>* host) {
  const uint64_t e = 2;  // bf16 activations.
  const bool fp8 = p.quantization == "fp8";
  const int64_t R = next_pow2(p.max_sequences);
  const int64_t T = std::max(kStepTokens, R);
  const int64_t H = c.hidden_size, V = c.vocab_size, K = c.num_experts_per_tok;
  const int64_t E = c.num_experts;
  const int64_t num_slots = static_cast<int64_t>(p.max_ranks) * p.slots_per_rank;
  const int64_t S = p.slots_per_rank;
  const std::string rows = std::to_string(T) + " tokens";
  MemoryTerm io{"step inputs and logits", 0, 0, false, std::to_string(R) + " logits rows"};
  io.bytes = u(3 * T + R + 1) * 4 + u(R * H) * e + u(R * V) * 4 + u(R) * 8 + u(R) * 32 +
             u(R * ceil_div(V, 4096)) * 8;
  MemoryTerm act{"activations", 0, 0, false, rows};
  int64_t inter = 0;  // Widest dense MLP (or DeepSeek's shared experts).
  for (int l = 0; l < c.num_hidden_layers; ++l) {
    if (!c.is_moe_layer(l)) inter = std::max<int64_t>(inter, c.intermediate_size);
    if (c.is_moe_layer(l) && c.is_deepseek()) {
      inter = std::max<int64_t>(inter, int64_t{c.moe_intermediate_size} * c.num_shared_experts);
    }
  }
  act.bytes = u(T * H) * 4 + u(T * H) * e + u(T * 2 * inter) * 4 + u(T * inter) * e;
  int64_t half = c.head_dim / 2;
  if (c.is_deepseek()) {
    const int64_t nh = c.num_attention_heads, r = c.kv_lora_rank, dr = c.qk_rope_head_dim;
    const int64_t qr = std::max(c.q_lora_rank, 0);
    act.bytes += u(T * (qr + r + dr)) * 4 + u(T * qr) * e +
                 u(T * nh * (c.qk_nope_head_dim + dr)) * e + u(T * nh * (r + dr)) * 4 +
                 u(T * nh * r) * e + u(2 * kMlaSplitTargetBlocks * kMlaMmaRows * (r + 2)) * 4 +
                 u(T * nh * c.v_head_dim) * e;
    half = dr / 2;
  } else {
    const int64_t D = c.head_dim, nq = c.num_attention_heads, nkv = c.num_key_value_heads;
    const int64_t group = nq / std::max<int64_t>(1, nkv);
    act.bytes += u(T * (nq + 2 * nkv) * D) * 4 + u(2 * T * nq * D) * e +
                 u(std::max(2 * kSplitTargetWarps, kGqaMaxWarps * group) * (D + 2)) * 4;
  }
  MemoryTerm moe{"MoE scratch", 0, 0, false, rows + " x top-" + std::to_string(K)};
  if (p.num_moe_layers > 0) {
    moe.bytes = moe_scratch_bytes(T, K, E, num_slots, H, c.moe_intermediate_size, e, fp8);
  }
  MemoryTerm tables{"RoPE and routing tables", 0, 0, false, ""};
  tables.bytes = u(2 * p.max_seq_len * half) * 4 +
                 u(p.num_moe_layers) * (u(2 * E) * 4 + u(num_slots) * 4 + u(num_slots) * 8);
  MemoryTerm blas{"cuBLAS workspaces", 0, kBlasWorkspace, false, ""};
  if (c.is_deepseek()) blas.bytes += kHeadGemmWorkspace;
  MemoryTerm pinned{"pinned step buffers", 0, 0, false, ""};
  pinned.bytes = u(3 * T + R + 1) * 4 + u(R * V) * 4 + u(R) * 8 + u(R) * 32;
  MemoryTerm ep{"EP exchange", 0, 0, false, ""};
  const bool expert_parallel = num_slots != S && p.num_moe_layers > 0;
  if (expert_parallel) {
    // DeviceEpMoe::create: an owner's rows of a step (the device exchange) and their GEMMs.
    const bool device_exchange = p.max_ranks <= kEpMaxRanks && K <= 64 && H % 8 == 0;
    const int64_t cap = device_exchange ? std::min(T * K * p.max_ranks, kMaxDeviceRows) : 0;
    const int64_t rows_cap = std::max(kChunkRows, cap);
    ep.bytes = moe_scratch_bytes(rows_cap, 1, std::min<int64_t>(S, 512), S, H,
                                 c.moe_intermediate_size, e, fp8) +
               u(rows_cap * H) * e + u(kChunkRows * H) * 4 + u(T * H) * 4 +
               u(std::max(T, kChunkRows)) * 4 + u(T) * 4;
    if (device_exchange) {
      ep.bytes += kEpWindowBytes + u(T * K) * 4 + kEpMaxRanks * kEpPeerBytes + kEpStatusBytes + 4 +
                  u(p.num_moe_layers) * u(S) * 8;
    }
    ep.detail = std::to_string(rows_cap) + " rows an owner receives" +
                (device_exchange ? "" : " (host exchange)");
    pinned.bytes +=
        u(kChunkRows * H) * e + u(kChunkRows) * 4 + u(T * H) * e + u(T * K) * 8 + u(T * H) * 4;
  }
  MemoryTerm context{"CUDA context, kernels, graphs", 0, reserve, true, "--reserve-gib"};
  for (MemoryTerm* t : {&io, &act, &moe, &ep, &tables, &blas, &context}) {
    if (t->bytes > 0) dev->push_back(std::move(*t));
  }
  host->push_back(std::move(pinned));
}

Status check_options(const ModelConfig& c, const MemoryPlanOptions& o) {
  if (o.ranks < 1) return invalid_argument("--ranks must be >= 1");
  if (o.max_ranks != 0 && o.max_ranks < o.ranks) {
    return invalid_argument("--max-ranks must be >= --ranks");
  }
  const int max_ranks = o.max_ranks > 0 ? o.max_ranks : o.ranks;
  if (o.spare_ranks < 0 || o.ranks + o.spare_ranks > max_ranks) {
    return invalid_argument("--spare-ranks must be in [0, --max-ranks - --ranks]");
  }
  if (o.min_ranks < 0 || o.slots_per_rank < 0 || o.eplb_spare_slots < 0) {
    return invalid_argument("--min-ranks, --slots-per-rank and --eplb-spare-slots must be >= 0");
  }
  if (o.min_replicas < 1) return invalid_argument("--min-replicas must be >= 1");
  if (o.max_sequences < 1) return invalid_argument("--max-sequences must be >= 1");
  if (o.max_tokens_per_step < 1) return invalid_argument("--max-tokens-per-step must be >= 1");
  if (o.max_seq_len < 0) return invalid_argument("--max-context must be >= 0");
  if (o.device != "cpu" && o.device != "cuda" && o.device.rfind("cuda:", 0) != 0) {
    return invalid_argument("--device must be cuda, cuda:N or cpu, got '" + o.device + "'");
  }
  if (!o.quantization.empty() && o.quantization != "bf16" && o.quantization != "fp8") {
    return invalid_argument("--quantization must be bf16 or fp8, got '" + o.quantization + "'");
  }
  if (o.device == "cpu" && o.quantization == "fp8") {
    return invalid_argument(
        "--quantization fp8 on --device cpu: the CPU path dequantizes FP8 weights to bf16 at load");
  }
  if (c.attention_bias) return unimplemented("attention_bias=true is not supported");
  return Status();
}

}  // namespace

Result<MemoryPlan> plan_memory(const ModelConfig& c, const MemoryPlanOptions& o) {
  FLEX_RETURN_IF_ERROR(check_options(c, o));
  MemoryPlan p;
  p.model_type = c.model_type;
  const bool cpu = o.device == "cpu";
  p.device = cpu ? "cpu" : "cuda";
  p.quantization = !o.quantization.empty() ? o.quantization
                   : cpu                   ? "bf16"
                                           : c.default_gpu_quantization();
  p.ranks = o.ranks;
  p.max_ranks = o.max_ranks > 0 ? o.max_ranks : o.ranks;
  p.min_ranks = o.min_ranks > 0 ? std::min(o.min_ranks, o.ranks) : o.ranks;
  p.spare_ranks = o.spare_ranks;
  p.num_experts = std::max(1, c.num_experts);
  // As ClusterEngine::Impl::start: --min-replicas places E * (R - 1) extra replicas.
  const int extra = p.num_experts * (o.min_replicas - 1);
  p.slots_per_rank = o.slots_per_rank > 0 ? o.slots_per_rank
                                          : expert_slots_per_rank(p.num_experts, extra, o.ranks,
                                                                  o.min_ranks, o.eplb_spare_slots);
  if (static_cast<int64_t>(o.ranks) * p.slots_per_rank < p.num_experts + int64_t{extra}) {
    return invalid_argument(std::to_string(o.ranks) + " ranks x " +
                            std::to_string(p.slots_per_rank) + " slots cannot hold " +
                            std::to_string(p.num_experts) + " experts + " + std::to_string(extra) +
                            " replicas");
  }
  p.max_sequences = o.max_sequences;
  p.max_seq_len =
      o.max_seq_len > 0 ? o.max_seq_len : std::min(std::max(c.max_position_embeddings, 1), 4096);
  p.step_tokens = cpu ? 0 : static_cast<int>(std::max(kStepTokens, next_pow2(p.max_sequences)));

  // Weights: bf16 on the GPU; the checkpoint's dtype on the CPU (FP8 dequantized to bf16).
  MatrixFormat proj;
  if (cpu && c.torch_dtype == "float32") {
    proj.elem_bytes = 4;
    p.quantization = "f32";
  } else if (cpu && c.torch_dtype == "float16") {
    p.quantization = "f16";
  }
  const uint64_t plain = proj.elem_bytes;
  if (p.quantization == "fp8") {
    proj.fp8 = true;
    if (c.weight_block_size.size() == 2) {
      proj.block_rows = std::max(1, c.weight_block_size[0]);
      proj.block_cols = std::max(1, c.weight_block_size[1]);
    }
  }
  p.dense = dense_terms(c, proj, plain, cpu, &p.num_moe_layers);
  for (const MemoryTerm& t : p.dense) {
    p.dense_params += t.params;
    p.dense_bytes += t.bytes;
  }
  const int64_t H = c.hidden_size, I = c.moe_intermediate_size;
  const int64_t expert = 3 * H * I;
  p.expert_params = expert * c.num_experts * p.num_moe_layers;
  p.activated_params = p.dense_params + expert * c.num_experts_per_tok * p.num_moe_layers;
  p.slot_bytes = 2 * proj.bytes(I, H) + proj.bytes(H, I);
  p.expert_slot_bytes = u(p.slots_per_rank) * u(p.num_moe_layers) * p.slot_bytes;

  // KV cache: GQA keeps k and v of every kv head, MLA the latent and the rope key; bf16 and
  // one spare sequence on the GPU (cuda_qwen3_moe.h, cuda_deepseek_v3.h), f32 on the CPU.
  const int64_t per_layer = c.is_deepseek() ? int64_t{c.kv_lora_rank} + c.qk_rope_head_dim
                                            : 2 * int64_t{c.num_key_value_heads} * c.head_dim;
  p.kv_bytes_per_token = u(per_layer) * u(c.num_hidden_layers) * (cpu ? 4 : 2);
  p.kv_slots = p.max_sequences + (cpu ? 0 : 1);
  p.kv_bytes = u(p.kv_slots) * u(p.max_seq_len) * p.kv_bytes_per_token;

  // Transport (src/engine/worker_slots.cc Worker::load): the shm control segment at --max-ranks,
  // mailboxes for the step headers and the EP exchange's worst case (host shared memory).
  const int64_t exchange_rows =
      int64_t{std::max(o.max_tokens_per_step, o.max_sequences)} * c.num_experts_per_tok;
  const uint64_t exchange_bytes = 4 + u(exchange_rows) * 4 + u(exchange_rows * H) * 4;
  FLEX_ASSIGN_OR_RETURN(shm::Layout layout,
                        shm::Layout::compute(p.max_ranks, kStepHeaderBytes, exchange_bytes));
  p.host.push_back({"transport (shm mailboxes)", 0, layout.total_bytes, false,
                    std::to_string(2 * p.max_ranks) + " x " + std::to_string(exchange_bytes) +
                        " B exchange mailboxes"});
  // cuda_ipc with device collectives (a GPU worker runs it with host_collectives, the
  // mailboxes above) would hold the same mailboxes' payloads in a device receive buffer
  // (src/transport/cuda_ipc/cuda_ipc_layout.cc).
  p.cuda_ipc_recv_bytes =
      std::max<uint64_t>(u(2 * p.max_ranks) * (round_up(kStepHeaderBytes, kDeviceAlignBytes) +
                                               round_up(exchange_bytes, kDeviceAlignBytes)),
                         kDeviceAlignBytes);
  if (!cpu) {
    cuda_workspaces(c, p, o.reserve_bytes, &p.workspaces, &p.host);
    // The host image of the slots peers read one-sidedly (CudaMoeModel::load_layers).
    p.host.push_back({"expert slot mirror", 0, p.expert_slot_bytes, false, "shm regions"});
  }
  for (const MemoryTerm& t : p.workspaces) p.workspace_bytes += t.bytes;
  for (const MemoryTerm& t : p.host) p.host_bytes += t.bytes;
  p.total_bytes = p.dense_bytes + p.expert_slot_bytes + p.kv_bytes + p.workspace_bytes;
  p.memory_bytes = o.memory_bytes;
  return p;
}

Result<MemoryFit> fit_memory(const ModelConfig& c, const MemoryPlanOptions& o) {
  FLEX_ASSIGN_OR_RETURN(MemoryPlan base, plan_memory(c, o));
  MemoryFit fit;
  const uint64_t rest = base.total_bytes - base.kv_bytes;
  if (rest < o.memory_bytes && base.kv_bytes_per_token > 0) {
    fit.kv_tokens = static_cast<int64_t>((o.memory_bytes - rest) / base.kv_bytes_per_token);
  }
  // Largest v in [1, hi] with fits(v) (monotone: every term grows with context and batch).
  auto largest = [&](int64_t hi, auto&& with) -> Result<int> {
    int64_t lo = 0;
    while (lo < hi) {
      const int64_t mid = lo + (hi - lo + 1) / 2;
      MemoryPlanOptions t = o;
      with(t, static_cast<int>(mid));
      FLEX_ASSIGN_OR_RETURN(MemoryPlan plan, plan_memory(c, t));
      if (plan.fits()) {
        lo = mid;
      } else {
        hi = mid - 1;
      }
    }
    return static_cast<int>(lo);
  };
  FLEX_ASSIGN_OR_RETURN(fit.max_seq_len,
                        largest(std::max(c.max_position_embeddings, 1),
                                [](MemoryPlanOptions& t, int v) { t.max_seq_len = v; }));
  fit.at_model_limit = fit.max_seq_len == std::max(c.max_position_embeddings, 1);
  FLEX_ASSIGN_OR_RETURN(fit.max_sequences,
                        largest(int64_t{1} << 20, [&](MemoryPlanOptions& t, int v) {
                          t.max_sequences = v;
                          t.max_seq_len = base.max_seq_len;
                        }));
  return fit;
}

}  // namespace flexpert
