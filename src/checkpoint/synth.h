// SPDX-License-Identifier: Apache-2.0
// Synthetic checkpoints: a config.json plus safetensors weights with the tensor
// names and shapes of a real Hugging Face model and random, deterministic values,
// so that the runtime can be run and benchmarked at full size without the weights.
//
// Values are a pure function of (seed, tensor name, element index): any chunk is
// generated independently, in parallel on ThreadPool::global(), and two runs with
// one seed write identical files. Norm weights are 1 + small noise, linear weights
// have std 1/sqrt(fan_in), the router (mlp.gate) has std 2/sqrt(hidden) with its
// first num_experts/8 rows doubled so that routing is decisive and skewed.
// With `fp8`, the 2-D projection weights (attention, dense MLP, shared and routed
// experts; not the embedding, router, norms or LM head) are written as DeepSeek-V3 and
// Qwen3's FP8 checkpoints ship them: F8_E4M3 values of weight / s plus `<name>_scale_inv`
// F32 tensors holding s per 128x128 block (s = block absmax / 448), and config.json gets
// a fp8 quantization_config. The dequantized values approximate the unquantized ones of
// the same seed to fp8's precision (relative error <= 2^-4 per element, above 2^-6 * s).
// With `fp8_dequantized` too, those projections are written instead as the values the
// FP8 checkpoint of the same seed stands for (e4m3 * s, rounded once to `dtype`), with no
// quantization_config: an unquantized twin to test loaders' dequantization against.
// Blocking, file I/O only; safe to call from several threads on different out_dirs.
#pragma once

#include <cstdint>
#include <functional>
#include <optional>
#include <string>

#include "flexpert/dtype.h"
#include "flexpert/model_config.h"
#include "flexpert/status.h"

namespace flexpert {

struct SynthOptions {
  std::string preset = "";   // See synth_preset_config().
  std::string out_dir = "";  // Created if missing.
  int num_layers = -1;       // -1: the preset's.
  DType dtype = DType::kBF16;
  uint64_t seed = 0;
  bool fp8 = false;              // Block-quantized FP8 projections (see above).
  bool fp8_dequantized = false;  // With fp8: its dequantized twin (see above).
  // Called with bytes of weights written so far and the total, from the calling thread.
  std::function<void(uint64_t done, uint64_t total)> progress = nullptr;
  // Above this, the weights are split into model-0000i-of-0000n.safetensors shards
  // plus model.safetensors.index.json (a tensor is never split across shards).
  uint64_t max_shard_bytes = 4ull << 30;
  // Used instead of the preset when set (custom shapes and options, e.g. in tests).
  std::optional<ModelConfig> config = std::nullopt;
};

// "tiny" (the shape of testdata/qwen3moe-tiny), "qwen3-30b-a3b", "deepseek-tiny" (the
// shape of testdata/deepseekv3-tiny), "deepseek-v3" or "deepseek-v2-lite"; else
// InvalidArgument.
Result<ModelConfig> synth_preset_config(const std::string& preset);

// Writes OUT_DIR/config.json and the weights; replaces a previous synthetic
// checkpoint of either layout in OUT_DIR.
Status synthesize_checkpoint(const SynthOptions& options);

}  // namespace flexpert
