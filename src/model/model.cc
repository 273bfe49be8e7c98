// SPDX-License-Identifier: Apache-2.0
// The CPU model class for a checkpoint's model_type (Model::load is src/factory's).
#include "flexpert/model.h"

#include <string>

#include "kernels/cpu_ops.h"
#include "model/cpu_model.h"
#include "model/deepseek_v3.h"
#include "model/qwen3_moe.h"

namespace flexpert {

Result<std::unique_ptr<Model>> load_cpu_model(const std::string& dir, const ModelOptions& options) {
  FLEX_ASSIGN_OR_RETURN(ModelConfig config, ModelConfig::load(dir));
  FLEX_ASSIGN_OR_RETURN(std::unique_ptr<Checkpoint> ckpt, Checkpoint::open(dir));
  if (config.model_type == "qwen3_moe") {
    // Block-FP8 checkpoints quantize only the projections, which the model dequantizes
    // at load (Checkpoint::get_weight); any other FP8 tensor has no reading here.
    for (const std::string& name : ckpt->names()) {
      if (name.ends_with("_proj.weight")) continue;
      auto t = ckpt->get(name);
      if (t.ok() && t->dtype() == DType::kF8E4M3) {
        return unimplemented("tensor '" + name +
                             "' is FP8; only projection weights (*_proj.weight) may be");
      }
    }
    FLEX_ASSIGN_OR_RETURN(auto model,
                          Qwen3MoeModel::create(std::move(ckpt), std::move(config), options));
    return std::unique_ptr<Model>(std::move(model));
  }
  if (config.is_deepseek()) {
    FLEX_ASSIGN_OR_RETURN(auto model,
                          DeepseekV3Model::create(std::move(ckpt), std::move(config), options));
    return std::unique_ptr<Model>(std::move(model));
  }
  return unimplemented("model_type '" + config.model_type + "' has no implementation");
}

Status Model::forward_step(const std::vector<SequenceChunk>& batch,
                           const std::vector<RowOutput>& rows, Tensor* logits,
                           std::vector<int32_t>* tokens) {
  if (rows.size() != batch.size()) {
    return invalid_argument("forward_step: " + std::to_string(rows.size()) +
                            " row outputs for a batch of " + std::to_string(batch.size()));
  }
  FLEX_RETURN_IF_ERROR(forward(batch, logits));
  const int64_t vocab = config().vocab_size;
  tokens->resize(batch.size());
  for (size_t b = 0; b < batch.size(); ++b) {
    const float* row = logits->data<float>() + b * vocab;
    const RowOutput& r = rows[b];
    (*tokens)[b] =
        r.kind == RowOutput::kSample
            ? kernels::sample_truncated(row, vocab, r.temperature, r.top_k, r.top_p, r.u01)
            : static_cast<int32_t>(kernels::argmax(row, vocab));
  }
  return Status();
}

}  // namespace flexpert
