// SPDX-License-Identifier: Apache-2.0
#include "model/routed_experts.h"

#include <algorithm>
#include <cstring>

#include "kernels/cpu_ops.h"

namespace flexpert {

Status validate_batch(const std::vector<SequenceChunk>& batch, int max_sequences, int max_seq_len,
                      int vocab_size) {
  std::vector<bool> used(static_cast<size_t>(max_sequences), false);
  for (const SequenceChunk& chunk : batch) {
    if (chunk.kv_slot < 0 || chunk.kv_slot >= max_sequences) {
      return invalid_argument("kv slot " + std::to_string(chunk.kv_slot) + " out of range [0, " +
                              std::to_string(max_sequences) + ")");
    }
    if (used[chunk.kv_slot]) {
      return invalid_argument("kv slot " + std::to_string(chunk.kv_slot) + " used twice in a step");
    }
    used[chunk.kv_slot] = true;
    if (chunk.tokens.empty()) return invalid_argument("a sequence chunk has no tokens");
    if (chunk.start_pos < 0 ||
        chunk.start_pos + static_cast<int64_t>(chunk.tokens.size()) > max_seq_len) {
      return invalid_argument("positions " + std::to_string(chunk.start_pos) + ".." +
                              std::to_string(chunk.start_pos + chunk.tokens.size()) +
                              " exceed the context length " + std::to_string(max_seq_len));
    }
    for (int32_t id : chunk.tokens) {
      if (id < 0 || id >= vocab_size) {
        return invalid_argument("token id " + std::to_string(id) + " outside the vocabulary [0, " +
                                std::to_string(vocab_size) + ")");
      }
    }
  }
  return Status();
}

void flatten_batch(const std::vector<SequenceChunk>& batch, std::vector<int32_t>* ids,
                   std::vector<int32_t>* positions) {
  ids->clear();
  positions->clear();
  for (const SequenceChunk& chunk : batch) {
    for (size_t i = 0; i < chunk.tokens.size(); ++i) {
      positions->push_back(chunk.start_pos + static_cast<int32_t>(i));
      ids->push_back(chunk.tokens[i]);
    }
  }
}

void last_token_logits(const Tensor& x, const std::vector<SequenceChunk>& batch,
                       const Tensor& final_norm, double eps, const Tensor& lm_head, int vocab_size,
                       ThreadPool& pool, Tensor* logits) {
  const int64_t H = x.size(1);
  const int64_t B = static_cast<int64_t>(batch.size());
  Tensor last = Tensor::empty(DType::kF32, {std::max<int64_t>(B, 1), H});
  int64_t t = 0;
  for (int64_t b = 0; b < B; ++b) {
    t += static_cast<int64_t>(batch[b].tokens.size());
    kernels::rms_norm(x.data<float>() + (t - 1) * H, final_norm.data<float>(), 1, H,
                      static_cast<float>(eps), last.data<float>() + b * H);
  }
  if (!logits->owned() || logits->size(0) != B || logits->size(1) != vocab_size) {
    *logits = Tensor::empty(DType::kF32, {B, vocab_size});
  }
  kernels::matmul_nt(last.data<float>(), B, H, lm_head, logits->data<float>(), pool);
}

int default_max_seq_len(const ModelConfig& config, const ModelOptions& options) {
  return options.max_seq_len > 0 ? options.max_seq_len
                                 : std::min(std::max(config.max_position_embeddings, 1), 4096);
}

Status RoutedExperts::init(const ModelConfig& config, const ModelOptions& options,
                           ThreadPool* pool) {
  pool_ = pool;
  const int num_experts = std::max(config.num_experts, 1);
  if (options.expert_placement.has_value()) {
    placement_ = *options.expert_placement;
    FLEX_RETURN_IF_ERROR(placement_.check_shape(config.num_hidden_layers, num_experts));
  } else {
    FLEX_ASSIGN_OR_RETURN(
        placement_,
        ExpertPlacement::parse(options.placement, config.num_hidden_layers, num_experts));
  }
  first_slot_ = options.first_slot;
  num_local_slots_ = options.num_local_slots < 0 ? placement_.num_slots() : options.num_local_slots;
  if (first_slot_ < 0 || first_slot_ + num_local_slots_ > placement_.num_slots()) {
    return invalid_argument("local slots [" + std::to_string(first_slot_) + ", " +
                            std::to_string(first_slot_ + num_local_slots_) +
                            ") outside the placement's " + std::to_string(placement_.num_slots()) +
                            " slots");
  }
  if (options.moe_executor != nullptr) {
    executor_ = options.moe_executor;
  } else {
    own_executor_ = std::make_unique<LocalMoeExecutor>(*pool_);
    executor_ = own_executor_.get();
  }
  rebuild_replicas();
  slot_counts_.assign(config.num_hidden_layers,
                      std::vector<int64_t>(static_cast<size_t>(placement_.num_slots()), 0));
  return Status();
}

namespace {

struct ExpertTensors {
  std::string names[3];  // gate, up, down.
  Tensor w[3];           // Read from the checkpoint, in its dtype.
};

constexpr const char* kParts[3] = {"gate_proj.weight", "up_proj.weight", "down_proj.weight"};

// The dtype of an expert's projections in the file (its gate's), once each is there with
// its shape (errors name the tensor); reads nothing.
Result<DType> check_expert(const Checkpoint& ck, const std::string& prefix, int expert,
                           int64_t hidden, int64_t inter) {
  const std::string ep = prefix + std::to_string(expert) + ".";
  const Shape shapes[3] = {{inter, hidden}, {inter, hidden}, {hidden, inter}};
  DType dtype = DType::kF32;
  for (int p = 0; p < 3; ++p) {
    FLEX_ASSIGN_OR_RETURN(SafetensorsFile::Entry e, ck.entry(ep + kParts[p], shapes[p]));
    if (p == 0) dtype = e.dtype;
  }
  return dtype;
}

Result<ExpertTensors> find_expert(const Checkpoint& ck, const std::string& prefix, int expert,
                                  int64_t hidden, int64_t inter) {
  ExpertTensors t;
  const std::string ep = prefix + std::to_string(expert) + ".";
  const Shape shapes[3] = {{inter, hidden}, {inter, hidden}, {hidden, inter}};
  for (int p = 0; p < 3; ++p) {
    t.names[p] = ep + kParts[p];
    FLEX_ASSIGN_OR_RETURN(t.w[p], ck.get(t.names[p], shapes[p]));
  }
  return t;
}

// Copies one expert into a slot, dequantizing FP8 weights on the way.
Status copy_expert(const Checkpoint& ck, const ModelConfig& config, const ExpertTensors& t,
                   int slot, ExpertSlots* slots) {
  if (t.w[0].dtype() != DType::kF8E4M3) return slots->load(slot, t.w[0], t.w[1], t.w[2]);
  Tensor dq[3];
  for (int p = 0; p < 3; ++p) {
    FLEX_ASSIGN_OR_RETURN(dq[p],
                          ck.get_weight(t.names[p], t.w[p].shape(), config.weight_block_size));
  }
  return slots->load(slot, dq[0], dq[1], dq[2]);
}

// Reads one expert straight from the checkpoint into `slot` when the file holds the slots'
// dtype: a pread per projection into the slot, no copy or conversion on the way (the bytes
// the converting path writes: its conversion between equal dtypes is a memcpy). False, having
// read nothing, when a dtype differs (FP8, dequantized by copy_expert).
Result<bool> read_expert_into_slot(const Checkpoint& ck, const std::string& prefix, int expert,
                                   int slot, ExpertSlots* slots) {
  if (slots->is_opaque()) return false;
  const std::string ep = prefix + std::to_string(expert) + ".";
  const Tensor dst[3] = {slots->gate(slot), slots->up(slot), slots->down(slot)};
  for (int p = 0; p < 3; ++p) {
    FLEX_ASSIGN_OR_RETURN(SafetensorsFile::Entry e, ck.entry(ep + kParts[p], dst[p].shape()));
    if (e.dtype != slots->dtype()) return false;
  }
  for (int p = 0; p < 3; ++p) {
    FLEX_RETURN_IF_ERROR(ck.read_into(ep + kParts[p], {{0, dst[p].num_bytes(), dst[p].raw()}}));
  }
  return true;
}

// One expert from the checkpoint into `slot`: straight from the file, or read and converted.
Status load_into_slot(const Checkpoint& ck, const ModelConfig& config, const std::string& prefix,
                      int expert, int slot, ExpertSlots* slots) {
  FLEX_ASSIGN_OR_RETURN(bool read, read_expert_into_slot(ck, prefix, expert, slot, slots));
  if (read) return Status();
  FLEX_ASSIGN_OR_RETURN(ExpertTensors t,
                        find_expert(ck, prefix, expert, slots->hidden(), slots->intermediate()));
  return copy_expert(ck, config, t, slot, slots);
}

}  // namespace

Status RoutedExperts::load_layer(const Checkpoint& ck, const ModelConfig& config, int layer,
                                 const std::string& prefix, int64_t hidden, int64_t inter,
                                 const ModelOptions& options, ExpertSlots* slots) {
  const int E = config.num_experts;
  const int H = static_cast<int>(hidden), I = static_cast<int>(inter);
  // Check every expert's tensors first (errors name the tensor), then read the experts this
  // rank holds into their slots in parallel.
  DType file_dtype = DType::kBF16;
  for (int e = 0; e < E; ++e) {
    FLEX_ASSIGN_OR_RETURN(DType d, check_expert(ck, prefix, e, hidden, inter));
    if (e == 0) file_dtype = d;
  }
  // FP8 experts are stored dequantized: slots hold what the kernels read.
  const DType dtype = file_dtype == DType::kF8E4M3 ? DType::kBF16 : file_dtype;
  if (options.allocate_slots) {
    const size_t bytes = ExpertSlots::bytes_for(dtype, num_local_slots_, H, I);
    FLEX_ASSIGN_OR_RETURN(void* storage, options.allocate_slots(layer, bytes));
    *slots = ExpertSlots(dtype, num_local_slots_, H, I, storage);
  } else {
    *slots = ExpertSlots(dtype, num_local_slots_, H, I);
  }
  const std::vector<int>& map = placement_.slot_map(layer);
  std::vector<Status> errors(static_cast<size_t>(num_local_slots_));
  pool_->parallel_for(num_local_slots_, 1, [&](int64_t s0, int64_t s1) {
    for (int64_t s = s0; s < s1; ++s) {
      const int e = map[first_slot_ + s];
      if (e == ExpertPlacement::kFreeSlot) {
        // NOTE: written now (zeros, as the slot reads) so that its pages are touched at load:
        // a first touch of fresh shared memory (clearing and mapping each page) made a
        // recovery's reload into the slot several times slower than the copy itself.
        std::memset(slots->slot_data(static_cast<int>(s)), 0, slots->slot_bytes());
        continue;
      }
      errors[s] = load_into_slot(ck, config, prefix, e, static_cast<int>(s), slots);
    }
  });
  for (const Status& s : errors) FLEX_RETURN_IF_ERROR(s.annotate(prefix));
  return Status();
}

Status RoutedExperts::load_expert(const Checkpoint& ck, const ModelConfig& config, int expert,
                                  int local_slot, const std::string& prefix,
                                  ExpertSlots* slots) const {
  if (expert < 0 || expert >= config.num_experts || local_slot < 0 ||
      local_slot >= num_local_slots_) {
    return invalid_argument("expert " + std::to_string(expert) + " or local slot " +
                            std::to_string(local_slot) + " out of range");
  }
  return load_into_slot(ck, config, prefix, expert, local_slot, slots);
}

void RoutedExperts::rebuild_replicas() {
  replicas_.assign(placement_.num_layers(), {});
  for (int l = 0; l < placement_.num_layers(); ++l) {
    for (int e = 0; e < placement_.num_experts(); ++e)
      replicas_[l].push_back(placement_.replicas(l, e));
  }
}

Status RoutedExperts::set_placement(ExpertPlacement placement) {
  if (placement.num_slots() != placement_.num_slots() ||
      placement.num_layers() != placement_.num_layers() ||
      placement.num_experts() != placement_.num_experts()) {
    return invalid_argument("new placement has a different shape");
  }
  placement_ = std::move(placement);
  rebuild_replicas();
  return Status();
}

void RoutedExperts::reset_slot_counts() {
  for (auto& v : slot_counts_) std::fill(v.begin(), v.end(), 0);
}

}  // namespace flexpert
