// SPDX-License-Identifier: Apache-2.0
// `flexpert plan-memory`: per-rank bytes of a serving group from config.json alone, and the
// largest context and batch that fit (moe/memory_plan.h; docs/memory.md).
#include <algorithm>
#include <cmath>
#include <cstdio>
#include <nlohmann/json.hpp>
#include <string>

#include "cli/commands.h"
#include "cli/flags.h"
#include "flexpert/model_config.h"
#include "moe/memory_plan.h"

namespace flexpert::cli {
namespace {

constexpr double kGiB = 1024.0 * 1024.0 * 1024.0;

Result<int> int_flag(const Flags& flags, const std::string& name, int64_t min_value) {
  FLEX_ASSIGN_OR_RETURN(int64_t v, flags.integer(name));
  if (v < min_value || v > (int64_t{1} << 30)) {
    return invalid_argument("--" + name + " must be in [" + std::to_string(min_value) + ", 2^30]");
  }
  return static_cast<int>(v);
}

Result<uint64_t> gib_flag(const Flags& flags, const std::string& name) {
  FLEX_ASSIGN_OR_RETURN(double v, flags.number(name));
  if (!(v >= 0) || v > 1e6) return invalid_argument("--" + name + " must be in [0, 1e6] GiB");
  return static_cast<uint64_t>(std::llround(v * kGiB));
}

nlohmann::json terms_json(const std::vector<MemoryTerm>& terms) {
  nlohmann::json out = nlohmann::json::array();
  for (const MemoryTerm& t : terms) {
    nlohmann::json j = {{"name", t.name}, {"bytes", t.bytes}};
    if (t.params > 0) j["params"] = t.params;
    if (t.estimate) j["estimate"] = true;
    if (!t.detail.empty()) j["detail"] = t.detail;
    out.push_back(std::move(j));
  }
  return out;
}

nlohmann::json to_json(const MemoryPlan& p, const MemoryFit& fit) {
  const int64_t free_bytes =
      static_cast<int64_t>(p.memory_bytes) - static_cast<int64_t>(p.total_bytes);
  return {
      {"model_type", p.model_type},
      {"quantization", p.quantization},
      {"device", p.device},
      {"ranks", p.ranks},
      {"max_ranks", p.max_ranks},
      {"min_ranks", p.min_ranks},
      {"spare_ranks", p.spare_ranks},
      {"slots_per_rank", p.slots_per_rank},
      {"num_moe_layers", p.num_moe_layers},
      {"max_seq_len", p.max_seq_len},
      {"max_sequences", p.max_sequences},
      {"step_tokens", p.step_tokens},
      {"params",
       {{"dense", p.dense_params},
        {"routed_experts", p.expert_params},
        {"total", p.dense_params + p.expert_params},
        {"activated", p.activated_params}}},
      {"per_rank",
       {{"dense", p.dense_bytes},
        {"dense_terms", terms_json(p.dense)},
        {"slot_bytes", p.slot_bytes},
        {"expert_slots", p.expert_slot_bytes},
        {"kv_bytes_per_token", p.kv_bytes_per_token},
        {"kv_slots", p.kv_slots},
        {"kv_cache", p.kv_bytes},
        {"workspaces", p.workspace_bytes},
        {"workspace_terms", terms_json(p.workspaces)},
        {"total", p.total_bytes},
        {"memory", p.memory_bytes},
        {"free", free_bytes},
        {"fits", p.fits()}}},
      {"host_per_rank", {{"total", p.host_bytes}, {"terms", terms_json(p.host)}}},
      {"cuda_ipc_recv_bytes", p.cuda_ipc_recv_bytes},
      {"group_total", p.total_bytes * static_cast<uint64_t>(p.ranks + p.spare_ranks)},
      {"group_host_total", p.host_bytes * static_cast<uint64_t>(p.ranks + p.spare_ranks)},
      {"largest",
       {{"max_seq_len_at_max_sequences", fit.max_seq_len},
        {"at_model_limit", fit.at_model_limit},
        {"max_sequences_at_max_seq_len", fit.max_sequences},
        {"kv_tokens", fit.kv_tokens}}},
  };
}

std::string gib(uint64_t bytes) {
  char buf[32];
  std::snprintf(buf, sizeof(buf), "%9.2f", static_cast<double>(bytes) / kGiB);
  return buf;
}

std::string billions(int64_t params) {
  char buf[32];
  if (params < 100'000'000) {
    std::snprintf(buf, sizeof(buf), "%.2f M", static_cast<double>(params) / 1e6);
  } else {
    std::snprintf(buf, sizeof(buf), "%.2f B", static_cast<double>(params) / 1e9);
  }
  return buf;
}

void print_line(const std::string& name, uint64_t bytes, const std::string& detail) {
  std::printf("  %-32s %s  %s\n", name.c_str(), gib(bytes).c_str(), detail.c_str());
}

void print_terms(const std::vector<MemoryTerm>& terms) {
  for (const MemoryTerm& t : terms) {
    std::string detail = t.detail;
    if (t.params > 0) detail = billions(t.params) + (detail.empty() ? "" : ", " + detail);
    if (t.estimate) detail += detail.empty() ? "estimate" : " (estimate)";
    print_line("  " + t.name, t.bytes, detail);
  }
}

void print_text(const MemoryPlan& p, const MemoryFit& fit) {
  std::printf("%s, %s weights on %s: %d rank%s (capacity %d, smallest group %d, %d spare)\n",
              p.model_type.c_str(), p.quantization.c_str(), p.device.c_str(), p.ranks,
              p.ranks == 1 ? "" : "s", p.max_ranks, p.min_ranks, p.spare_ranks);
  std::printf(
      "parameters: %s = dense %s + routed experts %s (%d x %d MoE layers); "
      "activated %s\n",
      billions(p.dense_params + p.expert_params).c_str(), billions(p.dense_params).c_str(),
      billions(p.expert_params).c_str(), p.num_experts, p.num_moe_layers,
      billions(p.activated_params).c_str());
  std::printf("per rank%34s\n", "GiB");
  print_line("dense weights", p.dense_bytes, "every rank");
  print_terms(p.dense);
  char detail[160];
  std::snprintf(detail, sizeof(detail), "%d slots x %d layers x %.2f MiB", p.slots_per_rank,
                p.num_moe_layers, static_cast<double>(p.slot_bytes) / (1024.0 * 1024.0));
  print_line("expert slots", p.expert_slot_bytes, detail);
  std::snprintf(detail, sizeof(detail), "%d sequences x %d tokens x %llu B", p.kv_slots,
                p.max_seq_len, static_cast<unsigned long long>(p.kv_bytes_per_token));
  print_line("KV cache", p.kv_bytes, detail);
  print_line("workspaces", p.workspace_bytes,
             p.step_tokens > 0 ? "steps of " + std::to_string(p.step_tokens) + " tokens" : "");
  print_terms(p.workspaces);
  print_line("total", p.total_bytes, "");
  print_line("memory", p.memory_bytes, "--gpu-memory-gib");
  const bool fits = p.fits();
  print_line(fits ? "free" : "over by",
             fits ? p.memory_bytes - p.total_bytes : p.total_bytes - p.memory_bytes,
             fits ? "fits" : "DOES NOT FIT");
  const int group = p.ranks + p.spare_ranks;
  std::printf("group of %d rank%s: %.2f GiB of device memory, %.2f GiB of host memory\n", group,
              group == 1 ? "" : "s", static_cast<double>(p.total_bytes) * group / kGiB,
              static_cast<double>(p.host_bytes) * group / kGiB);
  std::printf("host memory per rank%22s\n", "GiB");
  print_terms(p.host);
  if (p.device == "cpu") {
    std::printf("  (the worker's transport is shm)\n");
  } else {
    // Worker::load: a GPU rank runs cuda_ipc with host_collectives.
    std::printf(
        "  (a GPU worker's transport is cuda_ipc with its collectives in host shared memory: the "
        "mailboxes above; device collectives would hold them in %.2f GiB of device memory)\n",
        static_cast<double>(p.cuda_ipc_recv_bytes) / kGiB);
  }
  std::printf(
      "largest context at %d sequences: %d tokens%s; largest batch at %d tokens: %d "
      "sequences; KV room: %lld tokens\n",
      p.max_sequences, fit.max_seq_len, fit.at_model_limit ? " (the model's limit)" : "",
      p.max_seq_len, fit.max_sequences, static_cast<long long>(fit.kv_tokens));
}

Status run(const Flags& flags) {
  if (!flags.has("model")) return invalid_argument("--model DIR is required");
  MemoryPlanOptions o;
  FLEX_ASSIGN_OR_RETURN(o.ranks, int_flag(flags, "ranks", 1));
  FLEX_ASSIGN_OR_RETURN(o.max_ranks, int_flag(flags, "max-ranks", 0));
  FLEX_ASSIGN_OR_RETURN(o.min_ranks, int_flag(flags, "min-ranks", 0));
  FLEX_ASSIGN_OR_RETURN(o.spare_ranks, int_flag(flags, "spare-ranks", 0));
  FLEX_ASSIGN_OR_RETURN(o.slots_per_rank, int_flag(flags, "slots-per-rank", 0));
  FLEX_ASSIGN_OR_RETURN(o.eplb_spare_slots, int_flag(flags, "eplb-spare-slots", 0));
  FLEX_ASSIGN_OR_RETURN(o.min_replicas, min_replicas_flag(flags));
  o.min_replicas = std::max(o.min_replicas, 1);  // auto sizes nothing: its replicas fill slots.
  FLEX_ASSIGN_OR_RETURN(o.max_seq_len, int_flag(flags, "max-context", 0));
  FLEX_ASSIGN_OR_RETURN(o.max_sequences, int_flag(flags, "max-sequences", 1));
  FLEX_ASSIGN_OR_RETURN(o.max_tokens_per_step, int_flag(flags, "max-tokens-per-step", 1));
  FLEX_ASSIGN_OR_RETURN(o.memory_bytes, gib_flag(flags, "gpu-memory-gib"));
  FLEX_ASSIGN_OR_RETURN(o.reserve_bytes, gib_flag(flags, "reserve-gib"));
  o.quantization = flags.str("quantization");
  o.device = flags.str("device");
  FLEX_ASSIGN_OR_RETURN(ModelConfig config, ModelConfig::load(flags.str("model")));
  FLEX_ASSIGN_OR_RETURN(MemoryPlan plan, plan_memory(config, o));
  FLEX_ASSIGN_OR_RETURN(MemoryFit fit, fit_memory(config, o));
  if (flags.flag("json")) {
    std::printf("%s\n", to_json(plan, fit).dump(2).c_str());
  } else {
    print_text(plan, fit);
  }
  return Status();
}

}  // namespace

int cmd_plan_memory(const Args& args) {
  Flags flags;
  flags.value("model", "", "model directory (only config.json is read)")
      .value("ranks", "1", "ranks at start (as serve)")
      .value("max-ranks", "0", "capacity in ranks (default: --ranks)")
      .value("min-ranks", "0", "smallest group to shrink to (default: --ranks); sizes the slots")
      .value("spare-ranks", "0", "ranks kept loaded beside the members")
      .value("slots-per-rank", "0", "expert slots per rank and layer (default: as serve)")
      .value("eplb-spare-slots", "1", "free expert slots per rank (as serve)")
      .value("min-replicas", "auto", "replicas every expert keeps (as serve; auto sizes as 1)")
      .value("quantization", "",
             "bf16 or fp8 weights (default: fp8 for an FP8 checkpoint on cuda, else bf16)")
      .value("max-context", "0", "context length (default: the model's, at most 4096)")
      .value("max-sequences", "32", "concurrent sequences per rank")
      .value("max-tokens-per-step", "256", "token budget per rank and step (EP mailboxes)")
      .value("device", "cuda", "cuda or cpu")
      .value("gpu-memory-gib", "140.4",
             "memory per rank in GiB (default: an H200's 143,771 MiB, sold as 141 GB)")
      .value("reserve-gib", "1", "CUDA context, kernels and graphs per rank (an estimate)")
      .boolean("json", "print JSON")
      .boolean("help", "show this help");
  if (Status s = flags.parse(args); !s.ok()) return report_error("plan-memory", s);
  if (flags.flag("help")) {
    std::printf("usage: flexpert plan-memory --model DIR --ranks N [flags]\n%s",
                flags.help().c_str());
    return 0;
  }
  if (Status s = run(flags); !s.ok()) return report_error("plan-memory", s);
  return 0;
}

}  // namespace flexpert::cli
