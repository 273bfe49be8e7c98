// SPDX-License-Identifier: Apache-2.0
// CudaMoeModel: what the CUDA MoE models (CudaQwen3MoeModel, CudaDeepseekV3Model) share,
// written once: the placement and local slots, step inputs and logits buffers, input
// validation, forward() dispatch, decode steps replayed from a graph per batch bucket
// (warm_up captures them all), prefill in pieces of max_step_tokens(), the expert-
// parallel step, slot statistics, routing tables rewritten in place, the host slot
// mirror, expert loads and slot uploads, weights read with block FP8 dequantized and the
// routed experts' slot images, bf16 or kept in FP8 (cuda_moe_model_weights.cc). A model
// supplies its layers through the hooks (load_layer, moe_layer, enqueue_step,
// enqueue_segment).
//
// Memory is allocated at load and never after: routing tables are device buffers that
// set_placement() rewrites in place, so captured graphs stay valid (docs/ARCHITECTURE.md,
// "Capacity and holes"). One driver thread calls forward*, warm_up, set_placement and
// the statistics; the weight mover calls load_expert / slots_written / copy_slot on its
// own stream. A derived class's destructor calls release_device() first.
#pragma once

#include <map>
#include <memory>
#include <vector>

#include "cuda/blas.h"
#include "cuda/device.h"
#include "cuda/ep_moe.h"
#include "cuda/moe_layer.h"
#include "flexpert/checkpoint.h"
#include "flexpert/model.h"
#include "moe/expert_slots.h"

namespace flexpert::cuda {

class CudaMoeModel : public Model {
 public:
  ~CudaMoeModel() override;

  const ModelConfig& config() const override { return config_; }
  const ExpertPlacement& placement() const override { return placement_; }
  int max_sequences() const override { return max_sequences_; }
  int max_seq_len() const override { return max_seq_len_; }
  Status forward(const std::vector<SequenceChunk>& batch, Tensor* logits) override;
  Status forward_step(const std::vector<SequenceChunk>& batch, const std::vector<RowOutput>& rows,
                      Tensor* logits, std::vector<int32_t>* tokens) override;
  const std::vector<std::vector<int64_t>>& slot_counts() const override;
  void reset_slot_counts() override;
  ExpertSlots* local_slots(int layer) override;
  Status set_placement(ExpertPlacement placement) override;
  Status load_expert(int layer, int expert, int local_slot) override;
  Status slots_written(int layer, int local_slot) override;
  Status copy_slot(int layer, int local_slot, int src_rank, int src_slot) override;
  Status warm_up() override;
  Status device_lost() const override { return context_failure(); }
  int64_t num_graph_captures() const override {
    return graph_captures_ + (ep_moe_ ? ep_moe_->num_graph_captures() : 0);
  }

  DType dtype() const { return dtype_; }
  int max_step_tokens() const { return max_step_tokens_; }

 protected:
  // Tokens per step piece: a prefill longer than this runs as consecutive pieces.
  static constexpr int kDefaultStepTokens = 2048;

  // The routing state of a layer; each model's Layer derives from it.
  struct MoeLayer {
    bool is_moe = false;
    DeviceBuffer router;                           // [E, H]
    DeviceBuffer slots;                            // [num_local_slots][slot_elems]
    DeviceBuffer rep_start, rep_count, rep_slots;  // i32 routing tables
    DeviceBuffer stats;                            // i64 [num_slots]
    MoeLayerWeights weights();
  };

  CudaMoeModel(std::unique_ptr<Checkpoint> checkpoint, ModelConfig config,
               const ModelOptions& options, int device);

  // Hooks. load_layer loads layer `layer` (its mirror is set up; layer_moe_state then
  // allocates its routing state); moe_layer returns that layer's routing state;
  // enqueue_step enqueues the whole network for n tokens and num_rows logits rows;
  // enqueue_segment the device part between two MoE layers (expert parallel).
  virtual Status load_layer(int layer) = 0;
  virtual MoeLayer& moe_layer(int layer) = 0;
  virtual Status enqueue_step(int n, int num_rows) = 0;
  virtual Status enqueue_segment(int seg, int n, int num_rows) = 0;

  // Steps of a model's create(), in this order. init_placement: sequences, context,
  // the placement and this process's slots, moe_dims_ (its dtype, sizes and slot
  // count). init_fp8_experts: with ModelOptions::quantization "fp8", checks the
  // checkpoint (block FP8, 128 x 128), dtype (bf16) and GPU, and sets moe_dims_.fp8.
  // create_streams: the device, stream_, blas_. load_layers: every layer's
  // mirror and load_layer. allocate_io: the step inputs and outputs. finish_create: the
  // expert-parallel executor and the statistics.
  Status init_placement(const ModelOptions& options);
  Status init_fp8_experts(const ModelOptions& options);
  Status create_streams();
  Status load_layers(const ModelOptions& options);
  Status allocate_io(int step_tokens = kDefaultStepTokens);
  Status finish_create(const ModelOptions& options);
  // A MoE layer's slots (packed from the checkpoint) and routing tables; load_layer
  // calls it after uploading the router.
  Status load_moe_state(int layer, MoeLayer* state);
  // A 2-D weight ready for upload: as stored, block FP8 dequantized to bf16
  // (Checkpoint::get_weight with the config's block size).
  Result<Tensor> weight(const std::string& name, const Shape& shape) const;
  // Expert `expert` of `layer` as a slot image: with moe_dims_.fp8 the checkpoint's e4m3
  // codes and scales (pack_expert_fp8), else pack_expert's layout in dtype_.
  Status pack_slot(int layer, int expert, uint8_t* image) const;
  // RMSNorm of the last rows of x_ and the LM head into logits_.
  Status enqueue_head(int num_rows);
  // Synchronizes and drops the graphs and the executor (before the layers they read).
  void release_device();

  std::unique_ptr<Checkpoint> checkpoint_;
  ModelConfig config_;
  ExpertPlacement placement_;
  int device_ = 0;
  DType dtype_ = DType::kBF16;
  bool use_graphs_ = true;
  int max_sequences_ = 0;
  int max_seq_len_ = 0;
  int max_rows_ = 0;         // Logits rows per step: max_sequences rounded up to a bucket.
  int max_step_tokens_ = 0;  // Tokens per piece.
  MoeDims moe_dims_;

  Stream stream_;
  Blas blas_;  // Bound to stream_; destroyed before it.
  DeviceBuffer embed_, lm_head_, final_norm_, rope_cos_, rope_sin_;
  // Step inputs (StepInputs' layout over inputs_; host_in_ the same on the host).
  DeviceBuffer inputs_;
  StepInputs in_{};
  PinnedBuffer host_in_;
  // x_: the residual stream (f32); h_: normalised rows (compute dtype); last_h_ and
  // logits_: the logits rows. The model allocates x_ and h_.
  DeviceBuffer x_, h_, last_h_, logits_;
  PinnedBuffer host_logits_;
  MoeScratch moe_;
  bool ep_ = false;  // Exchanges through options.moe_executor (not all slots local).
  int first_slot_ = 0;
  int num_local_slots_ = 0;           // Slots in each MoE layer's device buffer.
  std::vector<ExpertSlots> mirrors_;  // [layer]; empty for dense layers or no mirror.
  std::vector<int> moe_layer_ids_;    // Segment s ends at MoE layer moe_layer_ids_[s].
  std::unique_ptr<DeviceEpMoe> ep_moe_;

 private:
  struct StepOut;
  struct SampleArgsLayout;
  Status validate(const std::vector<SequenceChunk>& batch) const;
  Status upload_inputs(int num_tokens, int num_rows);
  Status warm_up_prefill();  // warm_up's second part: prefill lengths.
  Status download(int rows, const int* batch_row, const StepOut& out);
  Status run(const std::vector<SequenceChunk>& batch, Tensor* logits,
             const std::vector<RowOutput>* spec, std::vector<int32_t>* tokens);
  Status run_decode(const std::vector<SequenceChunk>& batch, const StepOut& out);
  Status run_and_capture(int bucket);
  Status run_pieces(const std::vector<SequenceChunk>& batch, const StepOut& out);
  Status run_ep(const std::vector<SequenceChunk>& batch, const StepOut& out);
  Status write_routing_tables(int layer, const std::vector<int>& slot_map);
  Status init_ep(const ModelOptions& options);
  bool is_moe(int layer) {
    return layer >= 0 && layer < config_.num_hidden_layers && moe_layer(layer).is_moe;
  }

  DeviceBuffer greedy_keys_;  // argmax_rows' keys per logits row, and their host copy.
  PinnedBuffer host_greedy_keys_;
  DeviceBuffer sample_args_;  // sample_rows' arguments (SampleArgsLayout).
  PinnedBuffer host_sample_args_;
  DeviceBuffer sample_partials_;
  mutable std::vector<std::vector<int64_t>> slot_counts_;
  Stream upload_stream_;             // The mover thread's (slots_written).
  std::map<int, GraphExec> graphs_;  // Decode bucket -> graph.
  int64_t graph_captures_ = 0;
};

}  // namespace flexpert::cuda
