// SPDX-License-Identifier: Apache-2.0
#include "cuda/ep_moe.h"

#include <algorithm>
#include <chrono>
#include <cstdlib>
#include <cstring>
#include <limits>
#include <string>
#include <thread>

#include "cuda/kernels.h"
#include "cuda/knobs.h"
#include "flexpert/logging.h"

namespace flexpert::cuda {
namespace {

// Rows of one row-compute launch (more are computed in several).
constexpr int kChunkRows = 8192;
// Rows one owner may receive in a device exchange step (more: the host exchange).
constexpr int64_t kMaxDeviceRows = 65536;

// Exchanges of one epoch (the value's low 40 bits): years at thousands a second.
constexpr uint64_t kExchangesPerEpoch = uint64_t{1} << 40;

// The buffers a rank registers with its transport (Transport::register_buffer) for peers to
// map: the device exchange's (kWindowBuffer + WindowBuffer), then its slot buffer of each MoE
// layer (kSlotsBuffer + layer). Above the region ids the worker uses (layers).
enum WindowBuffer { kWindow, kRouteH, kRouteSlot, kY, kRowOfPair, kNumWindowBuffers };
constexpr int kWindowBuffer = 1 << 20;
constexpr int kSlotsBuffer = kWindowBuffer + kNumWindowBuffers;

int64_t now_ns() {
  return std::chrono::duration_cast<std::chrono::nanoseconds>(
             std::chrono::steady_clock::now().time_since_epoch())
      .count();
}

}  // namespace

// A rank's slot buffers as mapped by the weight mover.
struct DeviceEpMoe::SlotMapping {
  uint64_t incarnation = 0;          // Of the owner (a new one is mapped afresh).
  std::map<int, PeerBuffer> layers;  // Layer -> its slot buffer.
};

// A member's buffers as mapped into this process.
struct DeviceEpMoe::PeerMapping {
  int rank = -1;
  uint64_t incarnation = 0;
  std::vector<PeerBuffer> maps;      // The buffers opened so far, in WindowBuffer order.
  void* at[kNumWindowBuffers] = {};  // The buffers opened so far (open_peer).
  int opened = 0;
  int64_t open_ns = 0;  // Spent opening them.
  EpPeer peer;
  std::function<bool()> owner_exited;  // PeerBuffer::owner_exited of its buffers (null: none).
};

struct DeviceEpMoe::Retired {
  std::unique_ptr<PeerMapping> peer;
  std::unique_ptr<SlotMapping> slots;
  int64_t since_ns = 0;
};

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

void DeviceEpMoe::retire(std::unique_ptr<PeerMapping> peer, std::unique_ptr<SlotMapping> slots) {
  if (peer == nullptr && slots == nullptr) return;
  std::lock_guard<std::mutex> lock(retire_mu_);
  retired_.push_back(Retired{std::move(peer), std::move(slots), now_ns()});
  if (!closer_.joinable()) {
    closer_ = std::thread([this] {
      std::unique_lock<std::mutex> lk(retire_mu_);
      while (!closer_stop_ || !retired_.empty()) {
        if (retired_.empty()) {
          retire_cv_.wait(lk, [this] { return closer_stop_ || !retired_.empty(); });
        } else {
          retire_cv_.wait_for(lk, std::chrono::milliseconds(5));  // Polls the owners.
        }
        // Closable: the owner has exited (or was never watched), or it is past the cap.
        std::vector<Retired> close;
        const int64_t now = now_ns();
        for (size_t i = 0; i < retired_.size();) {
          const Retired& r = retired_[i];
          const bool ready = closer_stop_ || r.peer == nullptr || !r.peer->owner_exited ||
                             r.peer->owner_exited() || now - r.since_ns > kRetireCapNs;
          if (ready) {
            close.push_back(std::move(retired_[i]));
            retired_.erase(retired_.begin() + static_cast<std::ptrdiff_t>(i));
          } else {
            ++i;
          }
        }
        if (close.empty()) continue;
        lk.unlock();
        close.clear();  // The last references: the transport's mappings close now.
        lk.lock();
      }
    });
  }
  retire_cv_.notify_all();
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
    Status s;
    for (int seg = 0; s.ok() && seg < num_segments; ++seg) {
      if (n > 0) s = run_segment(seg, bucket, capture, enqueue_segment);
      if (s.ok() && seg + 1 < num_segments) {
        s = enqueue_device_exchange(seg, n, num_real, bound, ep_->group());
      }
    }
    if (s.ok()) return finish_device_step(ep_->group());
    // Exchanges already enqueued must not outlive the step: abort their waits, drain.
    *abort_.as<int32_t>() = 1;
    (void)cudaStreamSynchronize(stream_);
    *abort_.as<int32_t>() = 0;
    (void)cudaMemsetAsync(status_.data(), 0, sizeof(EpStatus), stream_);
    (void)cudaStreamSynchronize(stream_);
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

Status DeviceEpMoe::init_device_exchange(EpMoeExecutor& executor) {
  const MoeDims& d = config_.dims;
  const int n = executor.transport().max_ranks();
  const int64_t max_pairs = static_cast<int64_t>(config_.max_tokens) * d.top_k;
  FLEX_ASSIGN_OR_RETURN(
      window_, DeviceBuffer::create_zeroed(sizeof(EpWindow) + max_pairs * sizeof(int32_t)));
  FLEX_ASSIGN_OR_RETURN(peer_table_, DeviceBuffer::create_zeroed(kEpMaxRanks * sizeof(EpPeer)));
  FLEX_ASSIGN_OR_RETURN(status_, DeviceBuffer::create_zeroed(sizeof(EpStatus)));
  FLEX_ASSIGN_OR_RETURN(num_rows_, DeviceBuffer::create_zeroed(sizeof(int32_t)));
  FLEX_ASSIGN_OR_RETURN(
      stats_, DeviceBuffer::create_zeroed(config_.moe_layers.size() * config_.num_local_slots *
                                          sizeof(int64_t)));
  FLEX_ASSIGN_OR_RETURN(status_host_, PinnedBuffer::create(sizeof(EpStatus)));
  FLEX_ASSIGN_OR_RETURN(abort_, PinnedBuffer::create(sizeof(int32_t)));
  FLEX_ASSIGN_OR_RETURN(progress_, PinnedBuffer::create(sizeof(uint64_t)));
  std::memset(status_host_.data(), 0, sizeof(EpStatus));
  std::memset(abort_.data(), 0, sizeof(int32_t));
  std::memset(progress_.data(), 0, sizeof(uint64_t));
  FLEX_ASSIGN_OR_RETURN(step_done_, Event::create());
  self_.window = window_.as<EpWindow>();
  self_.pos = reinterpret_cast<const int32_t*>(self_.window + 1);
  self_.h = config_.route_h;
  self_.slot = config_.route_slot;
  self_.y = scratch_.y.data();
  self_.row_of_pair = scratch_.row_of_pair.as<int32_t>();

  // Registered before this rank reports ready: peers map them in their first device step of
  // an epoch that has this rank.
  Transport& transport = executor.transport();
  const size_t T = static_cast<size_t>(config_.max_tokens), K = static_cast<size_t>(d.top_k);
  const struct {
    const void* data;
    size_t num_bytes;
  } buffers[kNumWindowBuffers] = {
      {self_.window, window_.num_bytes()},
      {self_.h, T * d.hidden * dtype_size(d.dtype)},
      {self_.slot, T * K * sizeof(int32_t)},
      {self_.y, scratch_.y.num_bytes()},
      {self_.row_of_pair, scratch_.row_of_pair.num_bytes()},
  };
  for (int b = 0; b < kNumWindowBuffers; ++b) {
    FLEX_RETURN_IF_ERROR(transport
                             .register_buffer(kWindowBuffer + b, const_cast<void*>(buffers[b].data),
                                              buffers[b].num_bytes)
                             .annotate("EP exchange buffer " + std::to_string(b)));
  }
  // And the slot buffers of every MoE layer, for peers' weight movers.
  ep_ = &executor;
  FLEX_RETURN_IF_ERROR(register_slot_buffers());
  mapped_.resize(static_cast<size_t>(n));
  device_exchange_ = true;
  executor.set_device_probe([this](const Group& group) { return ready_for(group); });
  return Status();
}

Status DeviceEpMoe::register_slot_buffers() {
  Transport& transport = ep_->transport();
  for (int layer : config_.moe_layers) {
    FLEX_RETURN_IF_ERROR(transport
                             .register_buffer(kSlotsBuffer + layer,
                                              const_cast<void*>(config_.layer_slots(layer)),
                                              slot_buffer_bytes())
                             .annotate("slot buffer of layer " + std::to_string(layer)));
  }
  slot_maps_.resize(static_cast<size_t>(transport.max_ranks()));
  direct_reads_ = transport.capabilities().device_buffer_reads;
  return Status();
}

size_t DeviceEpMoe::slot_buffer_bytes() const {
  // Every rank's slot buffer of a layer has this rank's shape (one configuration).
  return static_cast<size_t>(config_.num_local_slots) * config_.dims.slot_bytes();
}

Result<uint64_t> DeviceEpMoe::window_incarnation(int r) {
  if (r < 0 || r >= static_cast<int>(mapped_.size())) {
    return invalid_argument("rank " + std::to_string(r) + " out of range");
  }
  Result<PeerBuffer> window = ep_->transport().map_peer_buffer(r, kWindowBuffer, MapMode::kLookup);
  if (!window.ok()) return window.status().annotate("EP window of rank " + std::to_string(r));
  return window->incarnation;
}

Result<bool> DeviceEpMoe::open_peer(PeerMapping& m, int64_t deadline_ns) {
  Transport& transport = ep_->transport();
  const int64_t t0 = now_ns();
  while (m.opened < kNumWindowBuffers) {
    const int b = m.opened;
    Result<PeerBuffer> mapped = transport.map_peer_buffer(m.rank, kWindowBuffer + b, MapMode::kMap);
    if (!mapped.ok()) {
      return mapped.status().annotate("mapping rank " + std::to_string(m.rank) + "'s EP buffers");
    }
    if (mapped->incarnation != m.incarnation) {
      return unavailable("rank " + std::to_string(m.rank) + " is a new incarnation (" +
                         std::to_string(mapped->incarnation) + ") since its mapping began");
    }
    if (b == 0) m.owner_exited = mapped->owner_exited;
    m.at[b] = mapped->data;
    m.maps.push_back(std::move(mapped).value());
    ++m.opened;
    if (now_ns() >= deadline_ns) break;
  }
  m.open_ns += now_ns() - t0;
  if (m.opened < kNumWindowBuffers) return false;
  m.peer.window = static_cast<EpWindow*>(m.at[kWindow]);
  m.peer.pos = reinterpret_cast<const int32_t*>(m.peer.window + 1);
  m.peer.h = m.at[kRouteH];
  m.peer.slot = static_cast<const int32_t*>(m.at[kRouteSlot]);
  m.peer.y = m.at[kY];
  m.peer.row_of_pair = static_cast<const int32_t*>(m.at[kRowOfPair]);
  return true;
}

Status DeviceEpMoe::map_peer(int r) {
  FLEX_ASSIGN_OR_RETURN(const uint64_t incarnation, window_incarnation(r));
  std::unique_ptr<PeerMapping>& m = mapped_[r];
  if (m != nullptr && m->incarnation == incarnation) return Status();
  // A new rank or incarnation: map it afresh (the old incarnation's mappings are closed
  // once it has exited, as a departed rank's).
  retire(std::move(m), nullptr);
  auto fresh = std::make_unique<PeerMapping>();
  fresh->rank = r;
  fresh->incarnation = incarnation;
  FLEX_RETURN_IF_ERROR(open_peer(*fresh, std::numeric_limits<int64_t>::max()).status());
  m = std::move(fresh);
  ++peer_mappings_;
  return Status();
}

bool DeviceEpMoe::ready_for(const Group& group) {
  if (!device_exchange_) return false;
  stepped_.store(true);
  if (peers_mapped_ && group.epoch == mapped_group_.epoch && group.ranks == mapped_group_.ranks) {
    return true;
  }
  // A failed mapping (a window not readable, an open that failed) is tried again a second
  // later; the host exchange serves meanwhile.
  if (map_failed_ && now_ns() >= map_retry_ns_) checked_ = false;
  if (!checked_ || group.epoch != checked_group_.epoch || group.ranks != checked_group_.ranks) {
    // A group not checked yet: the members whose buffers are not mapped (or belong to an
    // incarnation that left) are to be mapped, a slice a step; the rest is ready now.
    checked_ = true;
    checked_group_ = group;
    checked_ready_ = false;
    map_failed_ = false;
    for (auto& m : staged_) retire(std::move(m), nullptr);  // An epoch never run.
    staged_.clear();
    map_todo_.clear();
    for (int r : group.ranks) {
      if (r == ep_->transport().rank()) continue;
      Result<uint64_t> incarnation = window_incarnation(r);
      if (!incarnation.ok() && incarnation.status().code() == StatusCode::kUnimplemented) {
        // A member whose buffers the transport never maps (hier: a rank on another host):
        // the host exchange for as long as this group lasts. The member itself answers no as
        // well (this rank is on another host for it), and every header carries the answer.
        FLEX_LOG(INFO) << "rank " << ep_->transport().rank() << ", epoch " << group.epoch
                       << ": host exchange, " << incarnation.status().to_string();
        map_failed_ = true;
        map_retry_ns_ = std::numeric_limits<int64_t>::max();
        return false;
      }
      if (!incarnation.ok()) {
        FLEX_LOG(WARN) << "epoch " << group.epoch << ": no device exchange yet, "
                       << incarnation.status().to_string();
        map_failed_ = true;
        map_retry_ns_ = now_ns() + kMapRetryNs;
        return false;
      }
      if (mapped_[r] != nullptr && mapped_[r]->incarnation == *incarnation) continue;
      auto m = std::make_unique<PeerMapping>();
      m->rank = r;
      m->incarnation = *incarnation;
      map_todo_.push_back(std::move(m));
    }
  }
  if (checked_ready_ || map_failed_) return checked_ready_;
  // A slice of the mapping a step, before this rank's step header: mapping a peer across
  // GPUs takes milliseconds, and the group waits for its slowest member at every step.
  const int64_t deadline = now_ns() + kMapSliceNs;
  while (!map_todo_.empty()) {
    PeerMapping& m = *map_todo_.back();
    Result<bool> done = open_peer(m, deadline);
    if (!done.ok()) {
      FLEX_LOG(WARN) << "epoch " << group.epoch << ": no device exchange yet, "
                     << done.status().to_string();
      map_failed_ = true;
      map_retry_ns_ = now_ns() + kMapRetryNs;
      return false;
    }
    if (!done.value()) break;  // This step's slice is used up.
    FLEX_LOG(INFO) << "rank " << ep_->transport().rank() << ", epoch " << group.epoch << ": rank "
                   << m.rank << " mapped in " << m.open_ns / 1e6 << " ms, " << map_todo_.size() - 1
                   << " to go";
    staged_.push_back(std::move(map_todo_.back()));
    map_todo_.pop_back();
    if (now_ns() >= deadline) break;
  }
  checked_ready_ = map_todo_.empty();
  return checked_ready_;
}

Status DeviceEpMoe::map_peers(const Group& group) {
  if (peers_mapped_ && group.epoch == mapped_group_.epoch && group.ranks == mapped_group_.ranks) {
    return Status();
  }
  const int me = ep_->transport().rank();
  const int64_t t0 = now_ns();
  const int64_t mappings0 = peer_mappings_;
  FLEX_CUDA_TRY(cudaStreamSynchronize(stream_));  // Nothing reads the mappings replaced below.
  const bool checked =
      checked_ready_ && group.epoch == checked_group_.epoch && group.ranks == checked_group_.ranks;
  if (checked) {
    // What ready_for mapped for this group, in place of older incarnations.
    for (auto& m : staged_) {
      const int r = m->rank;
      retire(std::move(mapped_[r]), nullptr);
      mapped_[r] = std::move(m);
      ++peer_mappings_;
    }
    staged_.clear();
  }
  std::vector<EpPeer> table(kEpMaxRanks);
  std::vector<bool> member(mapped_.size(), false);
  for (int r : group.ranks) {
    if (r < 0 || r >= static_cast<int>(mapped_.size())) {
      return invalid_argument("rank " + std::to_string(r) + " out of range");
    }
    member[r] = true;
    if (r == me) {
      table[r] = self_;
      continue;
    }
    // Mapped and checked already when a worker drives the steps (ready_for); else here.
    if (!checked || mapped_[r] == nullptr) FLEX_RETURN_IF_ERROR(map_peer(r));
    table[r] = mapped_[r]->peer;
  }
  // Departed ranks: nothing runs that reads them (the last step finished; a slot copy
  // holds slots_mu_ until it landed).
  const int64_t t1 = now_ns();
  int released = 0;
  {
    std::lock_guard<std::mutex> lock(slots_mu_);
    for (size_t r = 0; r < mapped_.size(); ++r) {
      if (member[r]) continue;
      released += mapped_[r] != nullptr || slot_maps_[r] != nullptr;
      retire(std::move(mapped_[r]), std::move(slot_maps_[r]));
    }
  }
  const int64_t t2 = now_ns();
  FLEX_CUDA_TRY(cudaMemcpyAsync(peer_table_.data(), table.data(), kEpMaxRanks * sizeof(EpPeer),
                                cudaMemcpyHostToDevice, stream_));
  FLEX_CUDA_TRY(cudaStreamSynchronize(stream_));
  if (!peers_mapped_ || group.epoch != mapped_group_.epoch) exchange_index_ = 0;
  mapped_group_ = group;
  peers_mapped_ = true;
  if (const int64_t t3 = now_ns(); t3 - t0 > 1'000'000) {
    FLEX_LOG(INFO) << "rank " << me << ", epoch " << group.epoch << ": peers mapped in "
                   << (t3 - t0) / 1e6 << " ms (" << peer_mappings_ - mappings0 << " mapped in "
                   << (t1 - t0) / 1e6 << " ms, " << released << " released in " << (t2 - t1) / 1e6
                   << " ms)";
  }
  return Status();
}

EpArgs DeviceEpMoe::exchange_args(const Group& group) const {
  EpArgs a;
  a.peers = peer_table_.as<EpPeer>();
  a.me = ep_->transport().rank();
  for (int r : group.ranks) a.members |= uint64_t{1} << r;
  a.slots_per_rank = ep_->slots_per_rank();
  a.top_k = config_.dims.top_k;
  a.hidden = config_.dims.hidden;
  a.dtype = config_.dims.dtype;
  a.status = status_.as<EpStatus>();
  a.abort = abort_.as<int32_t>();
  a.progress = progress_.as<uint64_t>();
  // The host aborts waits on a dead peer or at the transport's timeout; this is a backstop.
  a.timeout_ns = int64_t{2} * ep_->transport().timeout_ms() * 1'000'000;
  return a;
}

Status DeviceEpMoe::enqueue_device_exchange(int seg, int n, int num_real, int bound,
                                            const Group& group) {
  const int layer = config_.moe_layers[seg];
  const MoeDims& d = config_.dims;
  EpArgs a = exchange_args(group);
  // Values stay below 2^63: bit 63 marks a given-up exchange (ep_exchange.h).
  if (exchange_index_ + 1 >= kExchangesPerEpoch || group.epoch >= (uint64_t{1} << 23)) {
    return resource_exhausted("expert-parallel exchange values of epoch " +
                              std::to_string(group.epoch) + " are used up (a new epoch resets)");
  }
  a.value = (group.epoch << 40) | ++exchange_index_;
  int32_t* pos = reinterpret_cast<int32_t*>(window_.as<EpWindow>() + 1);
  FLEX_CUDA_TRY(ep_publish(a, num_real * d.top_k, pos, stream_));
  FLEX_CUDA_TRY(ep_wait(a, /*which=*/0, stream_));
  FLEX_CUDA_TRY(ep_gather(a, bound, rows_.data(), scratch_.slot.as<int32_t>(),
                          num_rows_.as<int32_t>(), stream_));
  MoeLayerWeights w;
  w.slots = config_.layer_slots(layer);
  if (w.slots == nullptr) {
    return invalid_argument("rows for layer " + std::to_string(layer) + " without experts");
  }
  w.slot_stats = stats_.as<int64_t>() + static_cast<size_t>(seg) * config_.num_local_slots;
  // Tiles sized for the rows an owner expects (a share of the bound), not the bound.
  const int members = std::max<int>(1, static_cast<int>(group.ranks.size()));
  const GemmTile tile = choose_tile(d.dtype, std::max(1, bound / members), config_.num_local_slots,
                                    d.hidden, d.intermediate);
  if (local_dims_.fp8) {
    // Peers read the rows from scratch_.y: the FP8 grouped GEMMs, which leave them there.
    FLEX_RETURN_IF_ERROR(run_fp8_experts(local_dims_, w, scratch_, rows_.data(), bound,
                                         num_rows_.as<int32_t>(), nullptr, /*accumulate=*/false,
                                         stream_, /*force_tile=*/-1, /*combine=*/false));
  } else {
    FLEX_RETURN_IF_ERROR(run_moe(local_dims_, w, scratch_, rows_.data(), bound,
                                 num_rows_.as<int32_t>(), nullptr, /*accumulate=*/false, blas_,
                                 stream_, static_cast<int>(tile),
                                 kMoePermute | kMoeGateUp | kMoeDown));
  }
  FLEX_CUDA_TRY(ep_signal_done(a, stream_));
  FLEX_CUDA_TRY(ep_wait(a, /*which=*/1, stream_));
  FLEX_CUDA_TRY(ep_combine(a, config_.route_weight, pos, num_real, n, out_.as<float>(), stream_));
  return Status();
}

Status DeviceEpMoe::finish_device_step(const Group& group) {
  Transport& transport = ep_->transport();
  FLEX_CUDA_TRY(cudaMemcpyAsync(status_host_.data(), status_.data(), sizeof(EpStatus),
                                cudaMemcpyDeviceToHost, stream_));
  FLEX_RETURN_IF_ERROR(step_done_.record(stream_));
  volatile int32_t* abort = abort_.as<int32_t>();
  const volatile uint64_t* progress = progress_.as<uint64_t>();
  const int64_t start = now_ns();
  const int64_t timeout_ns = int64_t{transport.timeout_ms()} * 1'000'000;
  int64_t deadline = start + timeout_ns;  // Moved on by every wait that passes.
  uint64_t seen = *progress;
  int64_t next_check = start + 1'000'000;
  Status gone;  // A member the transport saw end.
  for (;;) {
    const cudaError_t q = cudaEventQuery(step_done_.get());
    if (q == cudaSuccess) break;
    if (q != cudaErrorNotReady) return cuda_status(q, "expert-parallel step");
    const int64_t now = now_ns();
    if (*abort == 0 && now >= next_check) {
      for (int r : group.ranks) {
        if (r == transport.rank()) continue;
        if (Status s = transport.peer_status(r); !s.ok()) {
          gone = std::move(s);
          *abort = 1;  // The waits give up; the rest of the step does no peer work.
          break;
        }
      }
      next_check = now + 1'000'000;
    }
    if (const uint64_t p = *progress; p != seen) {
      seen = p;
      deadline = now + timeout_ns;
    }
    if (*abort == 0 && now >= deadline) *abort = 1;
    if (now - start < 1'000'000) {
      std::this_thread::yield();
    } else {
      std::this_thread::sleep_for(std::chrono::microseconds(50));
    }
  }
  EpStatus st;
  std::memcpy(&st, status_host_.data(), sizeof(st));
  *abort = 0;
  if (st.failed == 0) return Status();
  FLEX_CUDA_TRY(cudaMemsetAsync(status_.data(), 0, sizeof(EpStatus), stream_));
  FLEX_CUDA_TRY(cudaStreamSynchronize(stream_));
  if (!gone.ok()) return gone;
  if (st.overflow < 0) {
    return failed_precondition("a routed slot lives on a rank outside epoch " +
                               std::to_string(group.epoch));
  }
  if (st.overflow > 0) {
    return internal_error("expert-parallel step: " + std::to_string(st.overflow) +
                          " rows for this rank, over the step's bound");
  }
  const std::string where = "expert-parallel exchange (epoch " + std::to_string(group.epoch) +
                            ", exchange " + std::to_string(exchange_index_) +
                            " of the epoch so far)";
  auto rank_list = [](uint64_t mask) {
    std::string text;
    for (int r = 0; r < kEpMaxRanks; ++r) {
      if (((mask >> r) & 1) != 0) text += (text.empty() ? "" : ", ") + std::to_string(r);
    }
    return text;
  };
  if (st.aborted != 0) {
    // A member that gave up may have seen a peer die before this rank's own check did:
    // name the dead peer (the front end recovers from that report) rather than only
    // the member that gave up.
    for (int r : group.ranks) {
      if (r == transport.rank()) continue;
      if (Status s = transport.peer_status(r); !s.ok()) return s;
    }
    return aborted(where + ": rank(s) " + rank_list(st.aborted) +
                   " gave the step up (an error of their own, or a peer they lost)");
  }
  for (int r = 0; r < kEpMaxRanks; ++r) {
    if (((st.missing >> r) & 1) == 0) continue;
    if (Status s = transport.peer_status(r); !s.ok()) return s;
  }
  return deadline_exceeded(where + ": no word from rank(s) " + rank_list(st.missing) + " within " +
                           std::to_string(transport.timeout_ms()) + " ms");
}

Status DeviceEpMoe::copy_slot(int layer, int src_rank, size_t offset, void* dst, size_t bytes,
                              cudaStream_t stream) {
  if (!device_exchange_ && !direct_reads_) {
    return unimplemented("no device exchange, and the transport reads no device buffers");
  }
  const size_t buffer_bytes = slot_buffer_bytes();
  if (offset + bytes > buffer_bytes || offset + bytes < offset) {
    return invalid_argument("slot copy of " + std::to_string(bytes) + " bytes at " +
                            std::to_string(offset) + " past the slot buffer");
  }
  Transport& transport = ep_->transport();
  const uint8_t* src = nullptr;
  // Held until the copy landed: map_peers releases a departed rank's mappings under it.
  std::lock_guard<std::mutex> lock(slots_mu_);
  if (src_rank == transport.rank()) {
    src = static_cast<const uint8_t*>(config_.layer_slots(layer));
  } else {
    if (src_rank < 0 || src_rank >= static_cast<int>(slot_maps_.size())) {
      return invalid_argument("rank " + std::to_string(src_rank) + " out of range");
    }
    // Mapping a layer's slots of another GPU takes ~19 us per MB of the buffer (H200 x2:
    // 1.2 GB for a Qwen3-30B-A3B layer), and the driver holds this process's stepping
    // thread meanwhile (a 21 ms step in a rebalance): a serving rank takes the host
    // mirrors instead (the transport answers Unimplemented). A joiner, not serving yet, maps
    // them while it prepares. Slots of a rank on another host are never mapped (hier answers
    // Unimplemented): the host mirrors, read over the network.
    const MapMode mode = stepped_.load() ? MapMode::kMapSameDevice : MapMode::kMap;
    Result<PeerBuffer> mapped = transport.map_peer_buffer(src_rank, kSlotsBuffer + layer, mode);
    if (!mapped.ok()) {
      if (mapped.status().code() == StatusCode::kUnimplemented && direct_reads_ &&
          !transport.map_peer_buffer(src_rank, kSlotsBuffer + layer, MapMode::kLookup).ok()) {
        // Never mappable here (kLookup refused too: another host, not a same-host GPU that
        // kMapSameDevice declined): a CUDA-aware UCX gets it into `dst`, returning once it
        // landed, where the caller would read the host mirror and upload it. `dst` is a free
        // slot, so nothing on `stream` is ordered against it.
        return transport.read(src_rank, kSlotsBuffer + layer, offset, dst, bytes)
            .annotate("slots of layer " + std::to_string(layer) + " of rank " +
                      std::to_string(src_rank) + " (device to device over ucx)");
      }
      if (mapped.status().code() == StatusCode::kUnimplemented) {
        return unimplemented("rank " + std::to_string(src_rank) + "'s slots of layer " +
                             std::to_string(layer) + " are not mapped (" +
                             mapped.status().message() + ")");
      }
      return mapped.status().annotate("slot buffers of rank " + std::to_string(src_rank));
    }
    if (mapped->num_bytes != buffer_bytes) {
      return data_loss("rank " + std::to_string(src_rank) + "'s slot buffer of layer " +
                       std::to_string(layer) + " has " + std::to_string(mapped->num_bytes) +
                       " bytes, expected " + std::to_string(buffer_bytes));
    }
    std::unique_ptr<SlotMapping>& m = slot_maps_[src_rank];
    if (m == nullptr || m->incarnation != mapped->incarnation) {
      m = std::make_unique<SlotMapping>();  // A new rank or incarnation.
      m->incarnation = mapped->incarnation;
    }
    src = static_cast<const uint8_t*>(mapped->data);
    m->layers[layer] = std::move(mapped).value();  // Held until the mapping is released.
  }
  if (src == nullptr) return invalid_argument("layer " + std::to_string(layer) + " has no slots");
  if (src + offset == dst) return Status();  // A slot onto itself.
  FLEX_CUDA_TRY(cudaMemcpyAsync(dst, src + offset, bytes, cudaMemcpyDeviceToDevice, stream));
  FLEX_CUDA_TRY(cudaStreamSynchronize(stream));
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
