// SPDX-License-Identifier: Apache-2.0
#include "cuda/cuda_moe_model.h"

#include <algorithm>
#include <chrono>
#include <cstring>
#include <string>

#include "cuda/kernels.h"
#include "flexpert/logging.h"
#include "flexpert/thread_pool.h"

namespace flexpert::cuda {
namespace {

// An expert's reload (load_expert) longer than this is logged with its parts.
constexpr double kSlowReloadMs = 5;

int next_pow2(int v) {
  int p = 1;
  while (p < v) p <<= 1;
  return p;
}

}  // namespace

// Where a step's results go (Model::forward_step): logits rows to `logits` (every row
// without `spec`, else the kLogits rows), and with `tokens` every row's token.
struct CudaMoeModel::StepOut {
  float* logits = nullptr;
  const std::vector<RowOutput>* spec = nullptr;
  int32_t* tokens = nullptr;
};

// The arguments of sample_rows for up to max_rows draws in one buffer (device, and its
// pinned host copy): inverse temperatures and draws (double), then logits rows and
// tokens (int32).
struct CudaMoeModel::SampleArgsLayout {
  size_t inv_t, u01, rows, top_k, top_p, tokens, bytes;
  explicit SampleArgsLayout(int max_rows) {
    const size_t R = static_cast<size_t>(max_rows);
    inv_t = 0;
    u01 = R * sizeof(double);
    rows = 2 * R * sizeof(double);
    top_k = rows + R * sizeof(int32_t);
    top_p = top_k + R * sizeof(int32_t);
    tokens = top_p + R * sizeof(float);
    bytes = tokens + R * sizeof(int32_t);
  }
};

MoeLayerWeights CudaMoeModel::MoeLayer::weights() {
  MoeLayerWeights w;
  w.router = router.data();
  w.slots = slots.data();
  w.rep_start = rep_start.as<int32_t>();
  w.rep_count = rep_count.as<int32_t>();
  w.rep_slots = rep_slots.as<int32_t>();
  w.slot_stats = stats.as<int64_t>();
  return w;
}

CudaMoeModel::CudaMoeModel(std::unique_ptr<Checkpoint> checkpoint, ModelConfig config,
                           const ModelOptions& options, int device)
    : checkpoint_(std::move(checkpoint)),
      config_(std::move(config)),
      device_(device),
      dtype_(options.device_dtype),
      use_graphs_(options.cuda_graphs) {}

CudaMoeModel::~CudaMoeModel() { release_device(); }

void CudaMoeModel::release_device() {
  (void)set_device(device_);
  (void)stream_.synchronize();
  ep_moe_.reset();
  graphs_.clear();
}

Status CudaMoeModel::init_placement(const ModelOptions& options) {
  const ModelConfig& c = config_;
  if (dtype_ != DType::kF32 && dtype_ != DType::kBF16) {
    return invalid_argument("CUDA computes in f32 or bf16, not " + std::string(dtype_name(dtype_)));
  }
  max_sequences_ = std::max(1, options.max_sequences);
  max_seq_len_ = options.max_seq_len > 0 ? options.max_seq_len
                                         : std::min(std::max(c.max_position_embeddings, 1), 4096);
  const int num_experts = std::max(c.num_experts, 1);
  if (options.expert_placement.has_value()) {
    placement_ = *options.expert_placement;
    FLEX_RETURN_IF_ERROR(placement_.check_shape(c.num_hidden_layers, num_experts));
  } else {
    FLEX_ASSIGN_OR_RETURN(
        placement_, ExpertPlacement::parse(options.placement, c.num_hidden_layers, num_experts));
  }
  const int num_slots = placement_.num_slots();
  first_slot_ = options.first_slot;
  num_local_slots_ = options.num_local_slots < 0 ? num_slots : options.num_local_slots;
  if (first_slot_ < 0 || num_local_slots_ < 1 || first_slot_ + num_local_slots_ > num_slots) {
    return invalid_argument("local slots [" + std::to_string(first_slot_) + ", +" +
                            std::to_string(num_local_slots_) + ") outside the placement's " +
                            std::to_string(num_slots) + " slots");
  }
  // All slots local (one rank): the single-process path, executor unused.
  ep_ = !(first_slot_ == 0 && num_local_slots_ == num_slots);
  if (ep_ && options.moe_executor == nullptr) {
    return invalid_argument("a CUDA model holding part of the slots needs a moe_executor");
  }
  moe_dims_.dtype = dtype_;
  moe_dims_.hidden = c.hidden_size;
  moe_dims_.intermediate = c.moe_intermediate_size;
  moe_dims_.num_experts = c.num_experts;
  moe_dims_.top_k = c.num_experts_per_tok;
  moe_dims_.num_slots = num_slots;
  moe_dims_.norm_topk_prob = c.norm_topk_prob;
  bool any_moe = false;
  for (int l = 0; l < c.num_hidden_layers; ++l) any_moe = any_moe || c.is_moe_layer(l);
  if (any_moe) FLEX_RETURN_IF_ERROR(moe_dims_.validate());
  return Status();
}

Status CudaMoeModel::create_streams() {
  FLEX_RETURN_IF_ERROR(set_device(device_));
  FLEX_ASSIGN_OR_RETURN(stream_, Stream::create());
  FLEX_ASSIGN_OR_RETURN(blas_, Blas::create(stream_.get()));
  return Status();
}

Status CudaMoeModel::finish_create(const ModelOptions& options) {
  if (ep_) FLEX_RETURN_IF_ERROR(init_ep(options));
  slot_counts_.assign(config_.num_hidden_layers,
                      std::vector<int64_t>(static_cast<size_t>(placement_.num_slots()), 0));
  return Status();
}

// Every layer through load_layer, each MoE layer with its host slot mirror: in the region
// peers read from (options.allocate_slots), or on the heap when expert parallel without
// one (the executor still needs the slots' shape). The mirror holds the device's slot
// images (pack_slot), so its slots are MoeDims::slot_bytes() long: FP8 slots (with their
// scales) are opaque byte images.
Status CudaMoeModel::load_layers(const ModelOptions& options) {
  const ModelConfig& c = config_;
  mirrors_.resize(c.num_hidden_layers);
  FLEX_ASSIGN_OR_RETURN(upload_stream_, Stream::create());
  const int hidden = static_cast<int>(c.hidden_size);
  const int inter = static_cast<int>(c.moe_intermediate_size);
  const size_t slot_bytes = static_cast<size_t>(moe_dims_.slot_bytes());
  auto mirror = [&](void* mem) {
    if (moe_dims_.fp8) return ExpertSlots::opaque(num_local_slots_, hidden, inter, slot_bytes, mem);
    return mem != nullptr ? ExpertSlots(dtype_, num_local_slots_, hidden, inter, mem)
                          : ExpertSlots(dtype_, num_local_slots_, hidden, inter);
  };
  for (int l = 0; l < c.num_hidden_layers; ++l) {
    if (c.is_moe_layer(l) && options.allocate_slots) {
      FLEX_ASSIGN_OR_RETURN(void* mem, options.allocate_slots(l, num_local_slots_ * slot_bytes));
      mirrors_[l] = mirror(mem);
    } else if (c.is_moe_layer(l) && ep_) {
      mirrors_[l] = mirror(nullptr);
    }
    FLEX_RETURN_IF_ERROR(load_layer(l).annotate("layer " + std::to_string(l)));
    if (options.progress) options.progress(l + 1, c.num_hidden_layers);
  }
  return Status();
}

Status CudaMoeModel::load_moe_state(int layer, MoeLayer* state) {
  const int num_slots = num_local_slots_;  // Global slots first_slot_ + [0, num_slots).
  const size_t slot_bytes = static_cast<size_t>(moe_dims_.slot_bytes());
  FLEX_ASSIGN_OR_RETURN(state->slots, DeviceBuffer::create_zeroed(num_slots * slot_bytes));
  const std::vector<int>& map = placement_.slot_map(layer);
  ExpertSlots& mirror = mirrors_[layer];
  // Pack a batch of slots in parallel on the host (into the mirror when there is one),
  // then copy it up.
  constexpr int kBatch = 16;
  std::vector<uint8_t> own_staging(mirror.num_slots() > 0 ? 0 : kBatch * slot_bytes);
  ThreadPool& pool = ThreadPool::global();
  for (int s0 = 0; s0 < num_slots; s0 += kBatch) {
    const int n = std::min(kBatch, num_slots - s0);
    uint8_t* staging =
        mirror.num_slots() > 0 ? static_cast<uint8_t*>(mirror.slot_data(s0)) : own_staging.data();
    std::vector<Status> errors(static_cast<size_t>(n));
    pool.parallel_for(n, 1, [&](int64_t b, int64_t e) {
      for (int64_t i = b; i < e; ++i) {
        uint8_t* image = staging + i * slot_bytes;
        const int expert = map[first_slot_ + s0 + i];
        if (expert == ExpertPlacement::kFreeSlot) {
          std::memset(image, 0, slot_bytes);
        } else {
          errors[i] = pack_slot(layer, expert, image);
        }
      }
    });
    for (const Status& s : errors) FLEX_RETURN_IF_ERROR(s);
    FLEX_CUDA_TRY(cudaMemcpy(state->slots.as<uint8_t>() + s0 * slot_bytes, staging, n * slot_bytes,
                             cudaMemcpyHostToDevice));
  }
  const size_t E = static_cast<size_t>(config_.num_experts);
  const size_t total_slots = static_cast<size_t>(placement_.num_slots());
  FLEX_ASSIGN_OR_RETURN(state->rep_start, DeviceBuffer::create(E * sizeof(int32_t)));
  FLEX_ASSIGN_OR_RETURN(state->rep_count, DeviceBuffer::create(E * sizeof(int32_t)));
  FLEX_ASSIGN_OR_RETURN(state->rep_slots, DeviceBuffer::create(total_slots * sizeof(int32_t)));
  FLEX_ASSIGN_OR_RETURN(state->stats, DeviceBuffer::create_zeroed(total_slots * sizeof(int64_t)));
  return write_routing_tables(layer, placement_.slot_map(layer));
}

Status CudaMoeModel::load_expert(int layer, int expert, int local_slot) {
  if (!is_moe(layer)) {
    return invalid_argument("layer " + std::to_string(layer) + " has no routed experts");
  }
  if (expert < 0 || expert >= config_.num_experts || local_slot < 0 ||
      local_slot >= num_local_slots_) {
    return invalid_argument("expert " + std::to_string(expert) + " or local slot " +
                            std::to_string(local_slot) + " out of range");
  }
  const size_t slot_bytes = static_cast<size_t>(moe_dims_.slot_bytes());
  ExpertSlots& mirror = mirrors_[layer];
  if (mirror.num_slots() > 0) {
    // Timed: a recovery's reload is this, once per lost expert (docs/benchmarks.md,
    // "Losing a rank"); a slow one is logged with its parts.
    const auto t0 = std::chrono::steady_clock::now();
    FLEX_RETURN_IF_ERROR(
        pack_slot(layer, expert, static_cast<uint8_t*>(mirror.slot_data(local_slot))));
    const auto t1 = std::chrono::steady_clock::now();
    const Status uploaded = slots_written(layer, local_slot);
    const auto t2 = std::chrono::steady_clock::now();
    using Ms = std::chrono::duration<double, std::milli>;
    if (Ms(t2 - t0).count() > kSlowReloadMs) {
      FLEX_LOG(INFO) << "layer " << layer << " expert " << expert << " reloaded in "
                     << Ms(t2 - t0).count() << " ms (read " << Ms(t1 - t0).count() << ", upload "
                     << Ms(t2 - t1).count() << ", " << slot_bytes << " bytes)";
    }
    return uploaded;
  }
  std::vector<uint8_t> image(slot_bytes);
  FLEX_RETURN_IF_ERROR(pack_slot(layer, expert, image.data()));
  FLEX_RETURN_IF_ERROR(set_device(device_));
  FLEX_CUDA_TRY(cudaMemcpyAsync(moe_layer(layer).slots.as<uint8_t>() + local_slot * slot_bytes,
                                image.data(), slot_bytes, cudaMemcpyHostToDevice,
                                upload_stream_.get()));
  return upload_stream_.synchronize();
}

// The step inputs (StepInputs' layout) and outputs (last hidden rows, f32 logits and
// their pinned host copy), sized for steps of max(step_tokens, rows) tokens and one logits
// row per sequence (a decode bucket).
Status CudaMoeModel::allocate_io(int step_tokens) {
  max_rows_ = next_pow2(max_sequences_);
  max_step_tokens_ = std::max(step_tokens, max_rows_);
  const size_t T = static_cast<size_t>(max_step_tokens_);
  const size_t R = static_cast<size_t>(max_rows_);
  const size_t H = config_.hidden_size, V = config_.vocab_size;
  const size_t num_ints = 3 * T + R + 1;
  FLEX_ASSIGN_OR_RETURN(inputs_, DeviceBuffer::create_zeroed(num_ints * sizeof(int32_t)));
  FLEX_ASSIGN_OR_RETURN(host_in_, PinnedBuffer::create(num_ints * sizeof(int32_t)));
  int32_t* base = inputs_.as<int32_t>();
  in_ = {base, base + T, base + 2 * T, base + 3 * T, base + 3 * T + R};
  FLEX_ASSIGN_OR_RETURN(last_h_, DeviceBuffer::create(R * H * dtype_size(dtype_)));
  FLEX_ASSIGN_OR_RETURN(logits_, DeviceBuffer::create(R * V * sizeof(float)));
  FLEX_ASSIGN_OR_RETURN(host_logits_, PinnedBuffer::create(R * V * sizeof(float)));
  FLEX_ASSIGN_OR_RETURN(greedy_keys_, DeviceBuffer::create(R * sizeof(unsigned long long)));
  FLEX_ASSIGN_OR_RETURN(host_greedy_keys_, PinnedBuffer::create(R * sizeof(unsigned long long)));
  const size_t args = SampleArgsLayout(max_rows_).bytes;
  FLEX_ASSIGN_OR_RETURN(sample_args_, DeviceBuffer::create(args));
  FLEX_ASSIGN_OR_RETURN(host_sample_args_, PinnedBuffer::create(args));
  FLEX_ASSIGN_OR_RETURN(
      sample_partials_,
      DeviceBuffer::create(R * sample_rows_chunks(static_cast<int>(V)) * sizeof(double)));
  return Status();
}

Status CudaMoeModel::enqueue_head(int num_rows) {
  if (num_rows == 0) return Status();
  const ModelConfig& c = config_;
  FLEX_CUDA_TRY(rms_norm(dtype_, x_.as<float>(), in_.last_rows, final_norm_.as<float>(), num_rows,
                         c.hidden_size, static_cast<float>(c.rms_norm_eps), last_h_.data(),
                         stream_.get()));
  return blas_.gemm_nt(dtype_, last_h_.data(), num_rows, c.hidden_size, lm_head_.data(),
                       c.vocab_size, DType::kF32, logits_.data());
}

Status CudaMoeModel::validate(const std::vector<SequenceChunk>& batch) const {
  std::vector<bool> used(static_cast<size_t>(max_sequences_), false);
  for (const SequenceChunk& chunk : batch) {
    if (chunk.kv_slot < 0 || chunk.kv_slot >= max_sequences_) {
      return invalid_argument("kv slot " + std::to_string(chunk.kv_slot) + " out of range [0, " +
                              std::to_string(max_sequences_) + ")");
    }
    if (used[chunk.kv_slot]) {
      return invalid_argument("kv slot " + std::to_string(chunk.kv_slot) + " used twice in a step");
    }
    used[chunk.kv_slot] = true;
    if (chunk.tokens.empty()) return invalid_argument("a sequence chunk has no tokens");
    if (chunk.start_pos < 0 ||
        chunk.start_pos + static_cast<int64_t>(chunk.tokens.size()) > max_seq_len_) {
      return invalid_argument("positions " + std::to_string(chunk.start_pos) + ".." +
                              std::to_string(chunk.start_pos + chunk.tokens.size()) +
                              " exceed the context length " + std::to_string(max_seq_len_));
    }
    for (int32_t id : chunk.tokens) {
      if (id < 0 || id >= config_.vocab_size) {
        return invalid_argument("token id " + std::to_string(id) + " outside the vocabulary [0, " +
                                std::to_string(config_.vocab_size) + ")");
      }
    }
  }
  return Status();
}

// Copies host_in_'s first num_tokens tokens, num_rows logits rows and the count of real
// rows to the device inputs (enqueued; host_in_ must stay until it ran).
Status CudaMoeModel::upload_inputs(int num_tokens, int num_rows) {
  const size_t T = static_cast<size_t>(max_step_tokens_);
  const int32_t* host = host_in_.as<int32_t>();
  cudaStream_t s = stream_.get();
  const size_t n = static_cast<size_t>(num_tokens) * sizeof(int32_t);
  FLEX_CUDA_TRY(cudaMemcpyAsync(in_.ids, host, n, cudaMemcpyHostToDevice, s));
  FLEX_CUDA_TRY(cudaMemcpyAsync(in_.positions, host + T, n, cudaMemcpyHostToDevice, s));
  FLEX_CUDA_TRY(cudaMemcpyAsync(in_.kv_slots, host + 2 * T, n, cudaMemcpyHostToDevice, s));
  FLEX_CUDA_TRY(cudaMemcpyAsync(in_.last_rows, host + 3 * T, num_rows * sizeof(int32_t),
                                cudaMemcpyHostToDevice, s));
  FLEX_CUDA_TRY(cudaMemcpyAsync(in_.num_valid, host + 3 * T + max_rows_, sizeof(int32_t),
                                cudaMemcpyHostToDevice, s));
  return Status();
}

// The results of the step's first `rows` logits rows (row r is batch row batch_row[r], or
// r without a map): tokens picked on the device (argmax_rows, and sample_rows for kSample
// rows: 8 + 4 bytes a row cross), logits rows only where wanted, one copy per run of
// wanted rows. After the step's work; synchronizes.
Status CudaMoeModel::download(int rows, const int* batch_row, const StepOut& out) {
  const size_t V = static_cast<size_t>(config_.vocab_size);
  cudaStream_t s = stream_.get();
  auto row_of = [batch_row](int r) { return batch_row ? batch_row[r] : r; };
  auto kind = [&](int r) {
    return out.spec == nullptr ? RowOutput::kLogits : (*out.spec)[row_of(r)].kind;
  };
  auto wanted = [&](int r) { return kind(r) == RowOutput::kLogits; };
  auto* keys = host_greedy_keys_.as<unsigned long long>();
  float* host_logits = host_logits_.as<float>();
  const SampleArgsLayout layout(max_rows_);
  auto* host_args = host_sample_args_.as<uint8_t>();
  int draws = 0;
  if (rows > 0 && out.tokens != nullptr) {
    auto* dev_keys = greedy_keys_.as<unsigned long long>();
    FLEX_CUDA_TRY(argmax_rows(logits_.as<float>(), rows, static_cast<int>(V), dev_keys, s));
    FLEX_CUDA_TRY(cudaMemcpyAsync(keys, dev_keys, rows * sizeof(unsigned long long),
                                  cudaMemcpyDeviceToHost, s));
    auto* inv_t = reinterpret_cast<double*>(host_args + layout.inv_t);
    auto* u01 = reinterpret_cast<double*>(host_args + layout.u01);
    auto* sample_row = reinterpret_cast<int32_t*>(host_args + layout.rows);
    auto* top_k = reinterpret_cast<int32_t*>(host_args + layout.top_k);
    auto* top_p = reinterpret_cast<float*>(host_args + layout.top_p);
    for (int r = 0; r < rows; ++r) {
      if (kind(r) != RowOutput::kSample) continue;
      const RowOutput& spec = (*out.spec)[row_of(r)];
      inv_t[draws] = 1.0 / spec.temperature;
      u01[draws] = spec.u01;
      top_k[draws] = spec.top_k;
      top_p[draws] = spec.top_p;
      sample_row[draws++] = r;
    }
  }
  if (draws > 0) {
    // The host arguments sit at max_rows strides: one copy takes them all.
    uint8_t* dev_args = sample_args_.as<uint8_t>();
    FLEX_CUDA_TRY(cudaMemcpyAsync(dev_args, host_args, layout.tokens, cudaMemcpyHostToDevice, s));
    SampleRowsArgs a;
    a.logits = logits_.as<float>();
    a.vocab = static_cast<int>(V);
    a.keys = greedy_keys_.as<unsigned long long>();
    a.rows = reinterpret_cast<const int32_t*>(dev_args + layout.rows);
    a.inv_temperature = reinterpret_cast<const double*>(dev_args + layout.inv_t);
    a.u01 = reinterpret_cast<const double*>(dev_args + layout.u01);
    a.n = draws;
    a.partials = sample_partials_.as<double>();
    a.tokens = reinterpret_cast<int32_t*>(dev_args + layout.tokens);
    a.top_k = reinterpret_cast<const int32_t*>(dev_args + layout.top_k);
    a.top_p = reinterpret_cast<const float*>(dev_args + layout.top_p);
    FLEX_CUDA_TRY(sample_rows(a, s));
    FLEX_CUDA_TRY(cudaMemcpyAsync(host_args + layout.tokens, dev_args + layout.tokens,
                                  draws * sizeof(int32_t), cudaMemcpyDeviceToHost, s));
  }
  for (int r = 0; r < rows;) {
    if (!wanted(r)) {
      ++r;
      continue;
    }
    int end = r + 1;
    while (end < rows && wanted(end)) ++end;
    FLEX_CUDA_TRY(cudaMemcpyAsync(host_logits + r * V, logits_.as<float>() + r * V,
                                  (end - r) * V * sizeof(float), cudaMemcpyDeviceToHost, s));
    r = end;
  }
  FLEX_RETURN_IF_ERROR(stream_.synchronize());
  const auto* sampled = reinterpret_cast<const int32_t*>(host_args + layout.tokens);
  for (int r = 0, d = 0; r < rows; ++r) {
    if (wanted(r)) {
      std::memcpy(out.logits + row_of(r) * V, host_logits + r * V, V * sizeof(float));
    }
    if (out.tokens == nullptr) continue;
    out.tokens[row_of(r)] =
        kind(r) == RowOutput::kSample ? sampled[d++] : argmax_key_index(keys[r]);
  }
  return Status();
}

Status CudaMoeModel::forward(const std::vector<SequenceChunk>& batch, Tensor* logits) {
  return run(batch, logits, nullptr, nullptr);
}

Status CudaMoeModel::forward_step(const std::vector<SequenceChunk>& batch,
                                  const std::vector<RowOutput>& rows, Tensor* logits,
                                  std::vector<int32_t>* tokens) {
  return run(batch, logits, &rows, tokens);
}

Status CudaMoeModel::run(const std::vector<SequenceChunk>& batch, Tensor* logits,
                         const std::vector<RowOutput>* spec, std::vector<int32_t>* tokens) {
  FLEX_RETURN_IF_ERROR(validate(batch));
  const int64_t B = static_cast<int64_t>(batch.size());
  if (spec != nullptr) {
    if (spec->size() != batch.size()) {
      return invalid_argument("forward_step: " + std::to_string(spec->size()) +
                              " row outputs for a batch of " + std::to_string(B));
    }
    for (const RowOutput& r : *spec) {
      if (r.kind == RowOutput::kSample &&
          (!(r.temperature > 0.0f) || !(r.u01 >= 0.0 && r.u01 < 1.0) || r.top_k < 0 ||
           !(r.top_p > 0.0f && r.top_p <= 1.0f))) {
        return invalid_argument(
            "forward_step: a kSample row needs temperature > 0, u01 in [0, 1), top_k >= 0 "
            "and top_p in (0, 1]");
      }
    }
  }
  if (!logits->owned() || logits->dim() != 2 || logits->size(0) != B ||
      logits->size(1) != config_.vocab_size) {
    *logits = Tensor::empty(DType::kF32, {B, config_.vocab_size});
  }
  if (tokens != nullptr) tokens->resize(batch.size());
  const StepOut out{logits->data<float>(), spec, tokens ? tokens->data() : nullptr};
  FLEX_RETURN_IF_ERROR(set_device(device_));
  if (ep_) return run_ep(batch, out);  // Joins exchanges even when empty.
  if (B == 0) return Status();
  const bool decode = std::all_of(batch.begin(), batch.end(),
                                  [](const SequenceChunk& c) { return c.tokens.size() == 1; });
  if (decode && use_graphs_) return run_decode(batch, out);
  return run_pieces(batch, out);
}

Status CudaMoeModel::run_decode(const std::vector<SequenceChunk>& batch, const StepOut& out) {
  const int B = static_cast<int>(batch.size());
  const int bucket = next_pow2(B);
  FLEX_RETURN_IF_ERROR(fill_step_inputs(batch, bucket, max_step_tokens_, max_rows_, max_sequences_,
                                        host_in_.as<int32_t>())
                           .status());
  FLEX_RETURN_IF_ERROR(upload_inputs(bucket, bucket));
  cudaStream_t s = stream_.get();
  auto it = graphs_.find(bucket);
  if (it != graphs_.end()) {
    FLEX_RETURN_IF_ERROR(it->second.launch(s));
  } else {
    FLEX_RETURN_IF_ERROR(run_and_capture(bucket));
  }
  return download(B, nullptr, out);
}

// A bucket's first decode step: eagerly (which also warms cuBLAS up for its shapes), then
// captured; a failed capture turns graphs off (eager decoding from then on).
Status CudaMoeModel::run_and_capture(int bucket) {
  cudaStream_t s = stream_.get();
  FLEX_RETURN_IF_ERROR(enqueue_step(bucket, bucket));
  FLEX_RETURN_IF_ERROR(GraphExec::begin_capture(s));
  Status st = enqueue_step(bucket, bucket);
  if (!st.ok()) {
    GraphExec::abandon_capture(s);
    FLEX_LOG(WARN) << "CUDA graph capture failed, decoding eagerly: " << st.to_string();
    use_graphs_ = false;
    return Status();
  }
  auto graph = GraphExec::end_capture(s);
  if (!graph.ok()) {
    FLEX_LOG(WARN) << "CUDA graph capture failed, decoding eagerly: " << graph.status().to_string();
    use_graphs_ = false;
    return Status();
  }
  graphs_.emplace(bucket, std::move(graph).value());
  ++graph_captures_;
  return Status();
}

// Every decode bucket (1, 2, 4, ... max_rows_) runs once and is captured on padding rows
// alone (the spare KV slot, no real row: no slot statistics), each segment on its own
// when expert parallel (no exchange: peers take no part).
Status CudaMoeModel::warm_up() {
  if (!use_graphs_) return Status();
  FLEX_RETURN_IF_ERROR(set_device(device_));
  for (int bucket = 1; bucket <= max_rows_; bucket *= 2) {
    FLEX_RETURN_IF_ERROR(fill_step_inputs({}, bucket, max_step_tokens_, max_rows_, max_sequences_,
                                          host_in_.as<int32_t>())
                             .status());
    FLEX_RETURN_IF_ERROR(upload_inputs(bucket, bucket));
    if (ep_) {
      FLEX_RETURN_IF_ERROR(ep_moe_->warm_up(
          bucket, [this, bucket](int seg) { return enqueue_segment(seg, bucket, bucket); }));
    } else if (graphs_.find(bucket) == graphs_.end()) {
      FLEX_RETURN_IF_ERROR(run_and_capture(bucket));
    }
    FLEX_RETURN_IF_ERROR(stream_.synchronize());  // host_in_ is refilled next.
    if (!use_graphs_ || (ep_ && ep_moe_->graphs_failed())) break;
  }
  return warm_up_prefill();
}

// A prefill piece of each token count just past a power of two (3, 5, 9, ...), as one
// sequence in the spare KV slot, eagerly (each segment on its own when expert parallel): the
// dense projections' cuBLASLt algorithms are chosen here, one per power of two (Blas),
// rather than in the first step of each new length, which the whole group waits for.
Status CudaMoeModel::warm_up_prefill() {
  const int limit = std::min(max_step_tokens_, max_seq_len_);
  for (int m = 3; m <= limit; m = 2 * m - 1) {
    SequenceChunk chunk;
    chunk.kv_slot = max_sequences_;
    chunk.tokens.assign(static_cast<size_t>(m), 0);
    FLEX_RETURN_IF_ERROR(fill_step_inputs({chunk}, 0, max_step_tokens_, max_rows_, max_sequences_,
                                          host_in_.as<int32_t>())
                             .status());
    // No real token (as the decode buckets' padding): no slot statistics.
    host_in_.as<int32_t>()[3 * static_cast<size_t>(max_step_tokens_) + max_rows_] = 0;
    FLEX_RETURN_IF_ERROR(upload_inputs(m, 1));
    if (ep_) {
      const int segments = ep_moe_->num_segments();
      for (int seg = 0; seg < segments; ++seg) FLEX_RETURN_IF_ERROR(enqueue_segment(seg, m, 1));
    } else {
      FLEX_RETURN_IF_ERROR(enqueue_step(m, 1));
    }
    FLEX_RETURN_IF_ERROR(stream_.synchronize());
  }
  return Status();
}

Status CudaMoeModel::run_pieces(const std::vector<SequenceChunk>& batch, const StepOut& out) {
  const size_t T = static_cast<size_t>(max_step_tokens_);
  int32_t* host = host_in_.as<int32_t>();
  int n = 0;
  std::vector<int> row_chunk;  // Logits row -> chunk index.
  auto flush = [&]() -> Status {
    const int rows = static_cast<int>(row_chunk.size());
    host[3 * T + max_rows_] = n;
    FLEX_RETURN_IF_ERROR(upload_inputs(n, rows));
    FLEX_RETURN_IF_ERROR(enqueue_step(n, rows));
    // Synchronizes, which also frees host_in_ for the next piece.
    FLEX_RETURN_IF_ERROR(download(rows, row_chunk.data(), out));
    n = 0;
    row_chunk.clear();
    return Status();
  };
  for (size_t b = 0; b < batch.size(); ++b) {
    const SequenceChunk& chunk = batch[b];
    for (size_t i = 0; i < chunk.tokens.size(); ++i) {
      host[n] = chunk.tokens[i];
      host[T + n] = chunk.start_pos + static_cast<int32_t>(i);
      host[2 * T + n] = chunk.kv_slot;
      if (i + 1 == chunk.tokens.size()) {
        host[3 * T + row_chunk.size()] = n;
        row_chunk.push_back(static_cast<int>(b));
      }
      ++n;
      if (n == static_cast<int>(T)) FLEX_RETURN_IF_ERROR(flush());
    }
  }
  if (n > 0) FLEX_RETURN_IF_ERROR(flush());
  return Status();
}

// Rows computed per [layer][slot]: counted on the device, or on the host by the EP
// executor.
const std::vector<std::vector<int64_t>>& CudaMoeModel::slot_counts() const {
  if (ep_) {
    // Rows the device exchange counted join the host's (the counts vector is the
    // model's cache of them, as below).
    Status s = set_device(device_);
    if (s.ok()) s = ep_moe_->collect_counts();
    if (!s.ok()) FLEX_LOG(WARN) << "slot counts: " << s.to_string();
    return slot_counts_;
  }
  if (set_device(device_).ok()) {
    auto* self = const_cast<CudaMoeModel*>(this);  // The hook is not const; nothing changes.
    for (int l = 0; l < config_.num_hidden_layers; ++l) {
      if (!self->is_moe(l)) continue;
      const cudaError_t err = cudaMemcpyAsync(
          slot_counts_[l].data(), self->moe_layer(l).stats.data(),
          slot_counts_[l].size() * sizeof(int64_t), cudaMemcpyDeviceToHost, stream_.get());
      if (err != cudaSuccess) FLEX_LOG(WARN) << "slot counts: " << cudaGetErrorString(err);
    }
    const Status s = stream_.synchronize();
    if (!s.ok()) FLEX_LOG(WARN) << "slot counts: " << s.to_string();
  }
  return slot_counts_;
}

void CudaMoeModel::reset_slot_counts() {
  if (ep_) {
    for (auto& layer : slot_counts_) std::fill(layer.begin(), layer.end(), 0);
    if (set_device(device_).ok()) {
      if (Status s = ep_moe_->reset_counts(); !s.ok())
        FLEX_LOG(WARN) << "slot counts: " << s.to_string();
    }
    return;
  }
  if (!set_device(device_).ok()) return;
  for (int l = 0; l < config_.num_hidden_layers; ++l) {
    if (!is_moe(l)) continue;
    MoeLayer& L = moe_layer(l);
    (void)cudaMemsetAsync(L.stats.data(), 0, L.stats.num_bytes(), stream_.get());
  }
  (void)stream_.synchronize();
}

// Layer `layer`'s routing tables (logical expert -> replica slots) to the device, in
// place (graphs keep reading the same addresses).
Status CudaMoeModel::write_routing_tables(int layer, const std::vector<int>& slot_map) {
  const RoutingTables t = build_routing_tables(slot_map, config_.num_experts);
  MoeLayer& L = moe_layer(layer);
  cudaStream_t s = stream_.get();
  FLEX_CUDA_TRY(cudaMemcpyAsync(L.rep_start.data(), t.rep_start.data(),
                                t.rep_start.size() * sizeof(int32_t), cudaMemcpyHostToDevice, s));
  FLEX_CUDA_TRY(cudaMemcpyAsync(L.rep_count.data(), t.rep_count.data(),
                                t.rep_count.size() * sizeof(int32_t), cudaMemcpyHostToDevice, s));
  FLEX_CUDA_TRY(cudaMemcpyAsync(L.rep_slots.data(), t.rep_slots.data(),
                                t.rep_slots.size() * sizeof(int32_t), cudaMemcpyHostToDevice, s));
  return stream_.synchronize();  // `t` dies here.
}

ExpertSlots* CudaMoeModel::local_slots(int layer) {
  if (layer < 0 || layer >= static_cast<int>(mirrors_.size())) return nullptr;
  return mirrors_[layer].num_slots() > 0 ? &mirrors_[layer] : nullptr;
}

// The mirror's slot to the device, on the mover thread's own stream (never waits on, or
// blocks, the step's graphs); returns once it landed.
Status CudaMoeModel::slots_written(int layer, int local_slot) {
  ExpertSlots* mirror = local_slots(layer);
  if (mirror == nullptr || local_slot < 0 || local_slot >= mirror->num_slots()) {
    return invalid_argument("layer " + std::to_string(layer) + " has no host slot " +
                            std::to_string(local_slot));
  }
  const size_t bytes = mirror->slot_bytes();
  FLEX_RETURN_IF_ERROR(set_device(device_));
  FLEX_CUDA_TRY(cudaMemcpyAsync(moe_layer(layer).slots.as<uint8_t>() + local_slot * bytes,
                                mirror->slot_data(local_slot), bytes, cudaMemcpyHostToDevice,
                                upload_stream_.get()));
  return upload_stream_.synchronize();
}

// Device to device (the peer's slots mapped through CUDA IPC, or read by a CUDA-aware UCX),
// then the mirror, on the mover thread's stream.
Status CudaMoeModel::copy_slot(int layer, int local_slot, int src_rank, int src_slot) {
  if (!ep_ || !ep_moe_->copies_slots()) {
    return unimplemented(
        "slots move between device memories with the device exchange or device reads only");
  }
  ExpertSlots* mirror = local_slots(layer);
  if (mirror == nullptr || local_slot < 0 || local_slot >= mirror->num_slots() || src_slot < 0 ||
      src_slot >= mirror->num_slots()) {
    return invalid_argument("layer " + std::to_string(layer) + ": no slot " +
                            std::to_string(local_slot) + " <- " + std::to_string(src_slot));
  }
  const size_t bytes = mirror->slot_bytes();
  FLEX_RETURN_IF_ERROR(set_device(device_));
  uint8_t* dst = moe_layer(layer).slots.as<uint8_t>() + local_slot * bytes;
  cudaStream_t s = upload_stream_.get();
  FLEX_RETURN_IF_ERROR(ep_moe_->copy_slot(layer, src_rank, src_slot * bytes, dst, bytes, s));
  const cudaError_t err =
      cudaMemcpyAsync(mirror->slot_data(local_slot), dst, bytes, cudaMemcpyDeviceToHost, s);
  const Status landed = upload_stream_.synchronize();  // Also after a failed enqueue.
  FLEX_CUDA_TRY(err);
  return landed;
}

// Rewrites the device routing tables in place (no reallocation: graphs stay valid).
Status CudaMoeModel::set_placement(ExpertPlacement placement) {
  const ExpertPlacement& now = placement_;
  if (placement.num_slots() != now.num_slots() || placement.num_layers() != now.num_layers() ||
      placement.num_experts() != now.num_experts()) {
    return invalid_argument("new placement has a different shape");
  }
  for (int l = 0; l < placement.num_layers(); ++l) {
    if (!is_moe(l)) continue;
    for (int e = 0; e < placement.num_experts(); ++e) {
      if (placement.replicas(l, e).empty()) {
        return invalid_argument("expert " + std::to_string(e) + " of layer " + std::to_string(l) +
                                " has no replica");
      }
    }
  }
  FLEX_RETURN_IF_ERROR(set_device(device_));
  for (int l = 0; l < placement.num_layers(); ++l) {
    if (is_moe(l)) {
      FLEX_RETURN_IF_ERROR(write_routing_tables(l, placement.slot_map(l)));
    }
  }
  placement_ = std::move(placement);
  return Status();
}

Status CudaMoeModel::init_ep(const ModelOptions& options) {
  for (int l = 0; l < config_.num_hidden_layers; ++l) {
    if (is_moe(l)) moe_layer_ids_.push_back(l);
  }
  DeviceEpMoe::Config ep;
  ep.dims = moe_dims_;
  ep.first_slot = first_slot_;
  ep.num_local_slots = num_local_slots_;
  ep.max_tokens = max_step_tokens_;
  ep.moe_layers = moe_layer_ids_;
  ep.layer_slots = [this](int layer) -> const void* {
    return is_moe(layer) ? moe_layer(layer).slots.data() : nullptr;
  };
  ep.executor = options.moe_executor;
  ep.mirrors = &mirrors_;
  ep.counts = &slot_counts_;
  ep.route_h = h_.data();
  ep.route_slot = moe_.slot.as<int32_t>();
  ep.route_weight = moe_.weight.as<float>();
  ep.device = device_;
  FLEX_ASSIGN_OR_RETURN(ep_moe_, DeviceEpMoe::create(std::move(ep), blas_, stream_.get()));
  return Status();
}

// One expert-parallel step: the model's device segments (enqueue_segment) between the MoE
// layers' exchanges; decode steps replay a graph per (bucket, segment).
Status CudaMoeModel::run_ep(const std::vector<SequenceChunk>& batch, const StepOut& out) {
  const int B = static_cast<int>(batch.size());
  const bool decode = B > 0 && std::all_of(batch.begin(), batch.end(), [](const SequenceChunk& c) {
                        return c.tokens.size() == 1;
                      });
  const int bucket = decode && use_graphs_ && !ep_moe_->graphs_failed() ? next_pow2(B) : 0;
  FLEX_ASSIGN_OR_RETURN(EpStepRows rows,
                        fill_step_inputs(batch, bucket, max_step_tokens_, max_rows_, max_sequences_,
                                         host_in_.as<int32_t>()));
  const int n = rows.num_tokens, num_rows = rows.num_rows;
  if (n > 0) FLEX_RETURN_IF_ERROR(upload_inputs(n, num_rows));
  FLEX_RETURN_IF_ERROR(ep_moe_->run_step(
      n, rows.num_real, bucket, use_graphs_,
      [this, n, num_rows](int seg) { return enqueue_segment(seg, n, num_rows); }));
  if (B == 0) return Status();
  return download(B, nullptr, out);
}

}  // namespace flexpert::cuda
