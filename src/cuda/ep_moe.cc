// SPDX-License-Identifier: Apache-2.0
#include "cuda/ep_moe.h"

#include <algorithm>
#include <chrono>
#include <cstring>
#include <string>
#include <thread>

#include "cuda/ep_moe_peers.h"
#include "cuda/kernels.h"
#include "cuda/knobs.h"
#include "flexpert/logging.h"

namespace flexpert::cuda {
namespace {

// Rows of one row-compute launch (more are computed in several).
constexpr int kChunkRows = 8192;
// Rows one owner may receive in a device exchange step (more: the host exchange).
constexpr int64_t kMaxDeviceRows = 65536;

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
      !config.layer_slots || config.route_h == nullptr || config.route_slot == nullptr ||
      config.route_weight == nullptr) {
    return invalid_argument(
        "expert parallelism on CUDA needs an executor, slots, counts and the routing buffers");
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
  // The device exchange: an owner's rows of one step and its GEMM scratch (the host
  // exchange's chunks fit in them too).
  auto* ep = dynamic_cast<EpMoeExecutor*>(m->config_.executor);
  const bool host_only = ep_exchange_host();
  // Peers' buffers are mapped through the transport (docs/ARCHITECTURE.md, mapped peer
  // buffers): the worker's GPU ranks take the cuda_ipc backend.
  const bool device_exchange =
      ep != nullptr && !host_only && ep->transport().capabilities().mapped_peer_buffers &&
      ep->transport().max_ranks() <= kEpMaxRanks && d.top_k <= 64 && d.hidden % 8 == 0;
  if (device_exchange) {
    m->device_cap_ = static_cast<int>(std::min<int64_t>(
        static_cast<int64_t>(T * K) * ep->transport().max_ranks(), kMaxDeviceRows));
  }
  const int rows_cap = std::max(m->chunk_rows_, m->device_cap_);
  FLEX_ASSIGN_OR_RETURN(m->scratch_, MoeScratch::create(m->local_dims_, rows_cap));
  FLEX_ASSIGN_OR_RETURN(m->rows_, DeviceBuffer::create(static_cast<size_t>(rows_cap) * H * esize));
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
  if (device_exchange) {
    FLEX_RETURN_IF_ERROR(m->init_device_exchange(*ep));
  } else if (ep != nullptr && ep->transport().capabilities().device_buffer_reads) {
    // No peer to map (ucx across hosts), but a CUDA-aware UCX reads peers' slot buffers
    // straight into ours (docs/ARCHITECTURE.md "GPU ranks on different hosts").
    m->ep_ = ep;
    FLEX_RETURN_IF_ERROR(m->register_slot_buffers());
  }
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

DeviceEpMoe::DeviceEpMoe(Config config, Blas& blas, cudaStream_t stream)
    : config_(std::move(config)), blas_(blas), stream_(stream) {}

DeviceEpMoe::~DeviceEpMoe() {
  if (config_.executor != nullptr) (void)config_.executor->set_row_compute(nullptr);
  if (ep_ != nullptr) ep_->set_device_probe(nullptr);
  if (closer_.joinable()) {
    {
      std::lock_guard<std::mutex> lock(retire_mu_);
      closer_stop_ = true;
    }
    retire_cv_.notify_all();
    closer_.join();  // Closes what is still queued.
  }
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
    if (local_dims_.fp8) {
      // FP8 slots: the same kernels as one process (fp8_experts.h), slots and weights 1 given.
      FLEX_RETURN_IF_ERROR(run_fp8_experts(local_dims_, w, scratch_, rows_.data(), m, nullptr,
                                           results_.as<float>(), /*accumulate=*/false, stream_));
    } else {
      FLEX_RETURN_IF_ERROR(run_moe(local_dims_, w, scratch_, rows_.data(), m, nullptr,
                                   results_.as<float>(), /*accumulate=*/false, blas_, stream_, -1,
                                   kMoePermute | kMoeGateUp | kMoeDown | kMoeCombine));
    }
    FLEX_CUDA_TRY(cudaMemcpyAsync(results + b * H, results_.data(), m * H * sizeof(float),
                                  cudaMemcpyDeviceToHost, stream_));
    FLEX_CUDA_TRY(cudaStreamSynchronize(stream_));  // Staging is reused by the next chunk.
  }
  return Status();
}

Status DeviceEpMoe::enqueue_route_out(int n) {
  // The device exchange reads the routing buffers in place; its host fallback copies
  // them itself.
  return device_exchange_ ? Status() : enqueue_route_copies(n);
}

Status DeviceEpMoe::enqueue_route_copies(int n) {
  const size_t pairs = static_cast<size_t>(n) * config_.dims.top_k;
  FLEX_CUDA_TRY(
      cudaMemcpyAsync(h_host_.data(), config_.route_h,
                      static_cast<size_t>(n) * config_.dims.hidden * dtype_size(config_.dims.dtype),
                      cudaMemcpyDeviceToHost, stream_));
  FLEX_CUDA_TRY(cudaMemcpyAsync(route_slot_host_.data(), config_.route_slot,
                                pairs * sizeof(int32_t), cudaMemcpyDeviceToHost, stream_));
  FLEX_CUDA_TRY(cudaMemcpyAsync(route_weight_host_.data(), config_.route_weight,
                                pairs * sizeof(float), cudaMemcpyDeviceToHost, stream_));
  return Status();
}

Status DeviceEpMoe::enqueue_add_output(float* x, int n) {
  const int H = config_.dims.hidden;
  // The device exchange's combine wrote out_ (its host fallback copies out_host_ there).
  if (!device_exchange_) {
    FLEX_CUDA_TRY(cudaMemcpyAsync(out_.data(), out_host_.data(),
                                  static_cast<size_t>(n) * H * sizeof(float),
                                  cudaMemcpyHostToDevice, stream_));
  }
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
  stepped_.store(true);
  if (!graphs || graphs_failed_) bucket = 0;
  bool capture = false;
  if (bucket > 0) {
    const auto it = graphs_.find(bucket);
    const bool complete = it != graphs_.end() && it->second.size() == config_.moe_layers.size() + 1;
    if (!complete) capture = bucket_steps_[bucket]++ > 0;
  }
  const int num_segments = static_cast<int>(config_.moe_layers.size()) + 1;
  // The device exchange, unless the group's rows may exceed what an owner can hold.
  bool on_device = false;
  int bound = 0;
  if (device_exchange_) {
    const int64_t tokens = ep_->step_tokens();
    const int64_t pairs = tokens > 0 ? tokens * config_.dims.top_k : device_cap_;
    // And only once every member has mapped its peers (ready_for, through the headers).
    on_device = pairs <= device_cap_ && ep_->group_device_ready();
    bound = static_cast<int>(std::min<int64_t>(pairs, device_cap_));
    if (on_device) FLEX_RETURN_IF_ERROR(map_peers(ep_->group()));
  }
  if (on_device) {
    start_watch();
    Status s = start_exchange_timing(ep_->group());
    for (int seg = 0; s.ok() && seg < num_segments; ++seg) {
      if (n > 0) s = run_segment(seg, bucket, capture, enqueue_segment);
      if (s.ok() && seg + 1 < num_segments) {
        const int64_t t0 = ep_moe_detail::now_ns();
        s = enqueue_device_exchange(seg, n, num_real, bound, ep_->group());
        if (const double ms = (ep_moe_detail::now_ns() - t0) / 1e6;
            knobs().step_log_ms >= 0 && ms > knobs().step_log_ms) {
          FLEX_LOG(INFO) << "rank " << ep_->transport().rank() << ": exchange " << seg
                         << " enqueued in " << ms << " ms on the host";
        }
      }
    }
    if (s.ok()) {
      FLEX_RETURN_IF_ERROR(finish_device_step(ep_->group()));
      return add_exchange_time();
    }
    // Exchanges already enqueued must not outlive the step: end their waits, drain.
    const Group& group = ep_->group();
    while (cudaStreamQuery(stream_) == cudaErrorNotReady) {
      const int64_t now = ep_moe_detail::now_ns();
      release_waits(other_members(group), now);
      check_released_step(now);
      std::this_thread::sleep_for(std::chrono::microseconds(50));
    }
    (void)reset_after_failed_step();
    return s;
  }
  for (int seg = 0; seg < num_segments; ++seg) {
    if (n > 0) FLEX_RETURN_IF_ERROR(run_segment(seg, bucket, capture, enqueue_segment));
    if (seg + 1 == num_segments) break;
    if (device_exchange_ && n > 0) FLEX_RETURN_IF_ERROR(enqueue_route_copies(n));
    if (n > 0) FLEX_CUDA_TRY(cudaStreamSynchronize(stream_));  // Routed rows on the host.
    FLEX_RETURN_IF_ERROR(exchange(seg, num_real));
    if (device_exchange_ && n > 0) {
      FLEX_CUDA_TRY(cudaMemcpyAsync(out_.data(), out_host_.data(),
                                    static_cast<size_t>(n) * config_.dims.hidden * sizeof(float),
                                    cudaMemcpyHostToDevice, stream_));
    }
  }
  return Status();
}

Status DeviceEpMoe::collect_counts() {
  if (!device_exchange_) return Status();
  const size_t L = config_.moe_layers.size(), S = config_.num_local_slots;
  std::vector<int64_t> rows(L * S);
  FLEX_CUDA_TRY(cudaMemcpyAsync(rows.data(), stats_.data(), rows.size() * sizeof(int64_t),
                                cudaMemcpyDeviceToHost, stream_));
  FLEX_CUDA_TRY(cudaMemsetAsync(stats_.data(), 0, stats_.num_bytes(), stream_));
  FLEX_CUDA_TRY(cudaStreamSynchronize(stream_));
  for (size_t seg = 0; seg < L; ++seg) {
    std::vector<int64_t>& counts = (*config_.counts)[config_.moe_layers[seg]];
    for (size_t s = 0; s < S; ++s) counts[config_.first_slot + s] += rows[seg * S + s];
  }
  return Status();
}

Status DeviceEpMoe::reset_counts() {
  if (!device_exchange_) return Status();
  FLEX_CUDA_TRY(cudaMemsetAsync(stats_.data(), 0, stats_.num_bytes(), stream_));
  FLEX_CUDA_TRY(cudaStreamSynchronize(stream_));
  return Status();
}
}  // namespace flexpert::cuda
