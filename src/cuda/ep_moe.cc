// SPDX-License-Identifier: Apache-2.0
#include "cuda/ep_moe.h"

#include <algorithm>
#include <cstring>
#include <string>

#include "cuda/kernels.h"
#include "flexpert/logging.h"

namespace flexpert::cuda {
namespace {

// Rows of one row-compute launch (more are computed in several).
constexpr int kChunkRows = 8192;

}  // namespace

Result<EpStepRows> fill_step_inputs(const std::vector<SequenceChunk>& batch, int bucket,
                                    int max_tokens, int max_rows, int spare_kv_slot,
                                    int32_t* host) {
  const size_t T = static_cast<size_t>(max_tokens);
  const int B = static_cast<int>(batch.size());
  EpStepRows r;
  if (bucket > 0) {
    for (int i = 0; i < bucket; ++i) {
      const bool real = i < B;
      host[i] = real ? batch[i].tokens[0] : 0;
      host[T + i] = real ? batch[i].start_pos : 0;
      host[2 * T + i] = real ? batch[i].kv_slot : spare_kv_slot;
      host[3 * T + i] = i;
    }
    r = {bucket, B, bucket};
  } else {
    int n = 0;
    for (int b = 0; b < B; ++b) {
      const SequenceChunk& chunk = batch[b];
      if (n + chunk.tokens.size() > T) {
        return unimplemented("an expert-parallel CUDA step holds at most " + std::to_string(T) +
                             " tokens");
      }
      for (size_t i = 0; i < chunk.tokens.size(); ++i) {
        host[n] = chunk.tokens[i];
        host[T + n] = chunk.start_pos + static_cast<int32_t>(i);
        host[2 * T + n] = chunk.kv_slot;
        ++n;
      }
      host[3 * T + b] = n - 1;  // Logits row b: the chunk's last token.
    }
    r = {n, n, B};
  }
  host[3 * T + max_rows] = r.num_real;
  return r;
}

Result<std::unique_ptr<DeviceEpMoe>> DeviceEpMoe::create(Config config, Blas& blas,
                                                         cudaStream_t stream) {
  if (config.executor == nullptr || config.mirrors == nullptr || config.counts == nullptr ||
      !config.layer_slots) {
    return invalid_argument("expert parallelism on CUDA needs an executor, slots and counts");
  }
  std::unique_ptr<DeviceEpMoe> m(new DeviceEpMoe(std::move(config), blas, stream));
  const MoeDims& d = m->config_.dims;
  const size_t H = d.hidden, esize = dtype_size(d.dtype);
  const size_t T = static_cast<size_t>(m->config_.max_tokens);
  const size_t K = static_cast<size_t>(d.top_k);
  m->local_dims_ = d;
  m->local_dims_.top_k = 1;
  m->local_dims_.num_experts = std::min(m->config_.num_local_slots, 512);  // Tile choice only.
  m->local_dims_.num_slots = m->config_.num_local_slots;
  m->chunk_rows_ = kChunkRows;
  const size_t C = static_cast<size_t>(m->chunk_rows_);
  FLEX_ASSIGN_OR_RETURN(m->scratch_, MoeScratch::create(m->local_dims_, m->chunk_rows_));
  FLEX_ASSIGN_OR_RETURN(m->rows_, DeviceBuffer::create(C * H * esize));
  FLEX_ASSIGN_OR_RETURN(m->results_, DeviceBuffer::create(C * H * sizeof(float)));
  FLEX_ASSIGN_OR_RETURN(m->rows_host_, PinnedBuffer::create(C * H * esize));
  FLEX_ASSIGN_OR_RETURN(m->slot_host_, PinnedBuffer::create(C * sizeof(int32_t)));
  FLEX_ASSIGN_OR_RETURN(m->out_, DeviceBuffer::create_zeroed(T * H * sizeof(float)));
  FLEX_ASSIGN_OR_RETURN(m->ones_, DeviceBuffer::create(std::max(T, C) * sizeof(float)));
  FLEX_ASSIGN_OR_RETURN(m->iota_, DeviceBuffer::create(T * sizeof(int32_t)));
  FLEX_ASSIGN_OR_RETURN(m->h_host_, PinnedBuffer::create(T * H * esize));
  FLEX_ASSIGN_OR_RETURN(m->route_slot_host_, PinnedBuffer::create(T * K * sizeof(int32_t)));
  FLEX_ASSIGN_OR_RETURN(m->route_weight_host_, PinnedBuffer::create(T * K * sizeof(float)));
  FLEX_ASSIGN_OR_RETURN(m->out_host_, PinnedBuffer::create(T * H * sizeof(float)));
  std::memset(m->out_host_.data(), 0, m->out_host_.num_bytes());  // Padding rows stay finite.
  const std::vector<float> ones(std::max(T, C), 1.f);
  std::vector<int32_t> iota(T);
  for (size_t i = 0; i < T; ++i) iota[i] = static_cast<int32_t>(i);
  FLEX_CUDA_TRY(cudaMemcpy(m->ones_.data(), ones.data(), ones.size() * sizeof(float),
                           cudaMemcpyHostToDevice));
  FLEX_CUDA_TRY(cudaMemcpy(m->iota_.data(), iota.data(), iota.size() * sizeof(int32_t),
                           cudaMemcpyHostToDevice));
  // The row compute combines with weight 1 (top_k 1): results in arrival order.
  FLEX_CUDA_TRY(cudaMemcpy(m->scratch_.weight.data(), ones.data(), C * sizeof(float),
                           cudaMemcpyHostToDevice));
  m->routing_.top_k = d.top_k;
  DeviceEpMoe* self = m.get();
  if (!m->config_.executor->set_row_compute([self](int layer, const int32_t* local_slot,
                                                   const float* const* rows, int64_t count,
                                                   float* results) {
        return self->compute_rows(layer, local_slot, rows, count, results);
      })) {
    return unimplemented("the MoE executor cannot hand its rows to the GPU");
  }
  return m;
}

DeviceEpMoe::~DeviceEpMoe() {
  if (config_.executor != nullptr) (void)config_.executor->set_row_compute(nullptr);
}

Status DeviceEpMoe::compute_rows(int layer, const int32_t* local_slot, const float* const* rows,
                                 int64_t count, float* results) {
  const void* slots = config_.layer_slots(layer);
  if (slots == nullptr) {
    return invalid_argument("rows for layer " + std::to_string(layer) + " without experts");
  }
  const DType dtype = config_.dims.dtype;
  const int64_t H = config_.dims.hidden;
  const size_t esize = dtype_size(dtype);
  MoeLayerWeights w;
  w.slots = slots;
  for (int64_t b = 0; b < count; b += chunk_rows_) {
    const int m = static_cast<int>(std::min<int64_t>(chunk_rows_, count - b));
    int32_t* slot = slot_host_.as<int32_t>();
    for (int i = 0; i < m; ++i) {
      slot[i] = local_slot[b + i];
      if (slot[i] < 0 || slot[i] >= config_.num_local_slots) {
        return data_loss("row for local slot " + std::to_string(slot[i]));
      }
      const float* src = rows[b + i];
      if (dtype == DType::kF32) {
        std::memcpy(rows_host_.as<float>() + i * H, src, H * sizeof(float));
      } else {
        uint16_t* dst = rows_host_.as<uint16_t>() + i * H;
        for (int64_t h = 0; h < H; ++h) dst[h] = f32_to_bf16(src[h]);
      }
    }
    FLEX_CUDA_TRY(cudaMemcpyAsync(rows_.data(), rows_host_.data(), m * H * esize,
                                  cudaMemcpyHostToDevice, stream_));
    FLEX_CUDA_TRY(cudaMemcpyAsync(scratch_.slot.data(), slot, m * sizeof(int32_t),
                                  cudaMemcpyHostToDevice, stream_));
    FLEX_RETURN_IF_ERROR(run_moe(local_dims_, w, scratch_, rows_.data(), m, nullptr,
                                 results_.as<float>(), /*accumulate=*/false, blas_, stream_, -1,
                                 kMoePermute | kMoeGateUp | kMoeDown | kMoeCombine));
    FLEX_CUDA_TRY(cudaMemcpyAsync(results + b * H, results_.data(), m * H * sizeof(float),
                                  cudaMemcpyDeviceToHost, stream_));
    FLEX_CUDA_TRY(cudaStreamSynchronize(stream_));  // Staging is reused by the next chunk.
  }
  return Status();
}

Status DeviceEpMoe::enqueue_route_out(const void* h, const MoeScratch& routing, int n) {
  const size_t pairs = static_cast<size_t>(n) * config_.dims.top_k;
  FLEX_CUDA_TRY(
      cudaMemcpyAsync(h_host_.data(), h,
                      static_cast<size_t>(n) * config_.dims.hidden * dtype_size(config_.dims.dtype),
                      cudaMemcpyDeviceToHost, stream_));
  FLEX_CUDA_TRY(cudaMemcpyAsync(route_slot_host_.data(), routing.slot.data(),
                                pairs * sizeof(int32_t), cudaMemcpyDeviceToHost, stream_));
  FLEX_CUDA_TRY(cudaMemcpyAsync(route_weight_host_.data(), routing.weight.data(),
                                pairs * sizeof(float), cudaMemcpyDeviceToHost, stream_));
  return Status();
}

Status DeviceEpMoe::enqueue_add_output(float* x, int n) {
  const int H = config_.dims.hidden;
  FLEX_CUDA_TRY(cudaMemcpyAsync(out_.data(), out_host_.data(),
                                static_cast<size_t>(n) * H * sizeof(float), cudaMemcpyHostToDevice,
                                stream_));
  FLEX_CUDA_TRY(combine(DType::kF32, out_.data(), ones_.as<float>(), iota_.as<int32_t>(), n, 1, H,
                        /*accumulate=*/true, x, stream_));
  return Status();
}

Status DeviceEpMoe::exchange(int seg, int num_real) {
  const int layer = config_.moe_layers[seg];
  const int64_t H = config_.dims.hidden;
  const size_t pairs = static_cast<size_t>(num_real) * routing_.top_k;
  routing_.num_tokens = num_real;
  const int32_t* slots = route_slot_host_.as<int32_t>();
  const float* weights = route_weight_host_.as<float>();
  routing_.slot.assign(slots, slots + pairs);
  routing_.weight.assign(weights, weights + pairs);
  routing_.expert.assign(pairs, -1);  // Not needed past the replica choice.
  const float* x = h_host_.as<float>();
  if (config_.dims.dtype == DType::kBF16) {
    x_.resize(static_cast<size_t>(num_real) * H);
    const uint16_t* h = h_host_.as<uint16_t>();
    for (size_t i = 0; i < x_.size(); ++i) x_[i] = bf16_to_f32(h[i]);
    x = x_.data();
  }
  return config_.executor->execute(layer, x, routing_, (*config_.mirrors)[layer],
                                   config_.first_slot, out_host_.as<float>(),
                                   (*config_.counts)[layer].data());
}

Status DeviceEpMoe::run_segment(int seg, int bucket, bool capture,
                                const std::function<Status(int seg)>& enqueue_segment) {
  if (bucket > 0 && !graphs_failed_) {
    std::vector<GraphExec>& graphs = graphs_[bucket];
    if (seg < static_cast<int>(graphs.size())) return graphs[seg].launch(stream_);
    if (capture && seg == static_cast<int>(graphs.size())) {
      FLEX_RETURN_IF_ERROR(GraphExec::begin_capture(stream_));
      Status st = enqueue_segment(seg);
      if (!st.ok()) {
        GraphExec::abandon_capture(stream_);
      } else {
        auto graph = GraphExec::end_capture(stream_);
        if (graph.ok()) {
          graphs.push_back(std::move(graph).value());
          ++captures_;
          return graphs.back().launch(stream_);
        }
        st = graph.status();
      }
      FLEX_LOG(WARN) << "CUDA graph capture failed, running segments eagerly: " << st.to_string();
      graphs_failed_ = true;
    }
  }
  return enqueue_segment(seg);
}

Status DeviceEpMoe::warm_up(int bucket, const std::function<Status(int seg)>& enqueue_segment) {
  const size_t num_segments = config_.moe_layers.size() + 1;
  const auto it = graphs_.find(bucket);
  if (graphs_failed_ || (it != graphs_.end() && it->second.size() == num_segments)) {
    return Status();
  }
  for (size_t seg = 0; seg < num_segments; ++seg) {
    FLEX_RETURN_IF_ERROR(enqueue_segment(static_cast<int>(seg)));
  }
  for (size_t seg = 0; seg < num_segments && !graphs_failed_; ++seg) {
    FLEX_RETURN_IF_ERROR(
        run_segment(static_cast<int>(seg), bucket, /*capture=*/true, enqueue_segment));
  }
  bucket_steps_[bucket] = std::max(bucket_steps_[bucket], 1);
  FLEX_CUDA_TRY(cudaStreamSynchronize(stream_));
  return Status();
}

Status DeviceEpMoe::run_step(int n, int num_real, int bucket, bool graphs,
                             const std::function<Status(int seg)>& enqueue_segment) {
  if (!graphs || graphs_failed_) bucket = 0;
  bool capture = false;
  if (bucket > 0) {
    const auto it = graphs_.find(bucket);
    const bool complete = it != graphs_.end() && it->second.size() == config_.moe_layers.size() + 1;
    if (!complete) capture = bucket_steps_[bucket]++ > 0;
  }
  const int num_segments = static_cast<int>(config_.moe_layers.size()) + 1;
  for (int seg = 0; seg < num_segments; ++seg) {
    if (n > 0) FLEX_RETURN_IF_ERROR(run_segment(seg, bucket, capture, enqueue_segment));
    if (seg + 1 == num_segments) break;
    if (n > 0) FLEX_CUDA_TRY(cudaStreamSynchronize(stream_));  // Routed rows on the host.
    FLEX_RETURN_IF_ERROR(exchange(seg, num_real));
  }
  return Status();
}

}  // namespace flexpert::cuda
