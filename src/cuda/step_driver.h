// SPDX-License-Identifier: Apache-2.0
// What the CUDA models share (CudaQwen3MoeModel, CudaDeepseekV3Model): step inputs
// and logits buffers, input validation, forward() dispatch, decode steps replayed from
// a graph per batch bucket (and warm_up capturing them all), prefill in pieces of
// max_step_tokens_, the expert-parallel step, slot statistics, routing tables and
// in-place placement switches, the host slot mirror and its uploads.
// Written once over the members both models have (each befriends StepDriver); the
// model-specific parts are the members it calls: enqueue_step (one process) and
// enqueue_segment (expert parallel).
#pragma once

#include <algorithm>
#include <cstring>
#include <string>
#include <vector>

#include "cuda/device.h"
#include "cuda/ep_moe.h"
#include "cuda/kernels.h"
#include "cuda/moe_layer.h"
#include "flexpert/logging.h"
#include "flexpert/model.h"

namespace flexpert::cuda {

inline int next_pow2(int v) {
  int p = 1;
  while (p < v) p <<= 1;
  return p;
}

struct StepDriver {
  // The step inputs (device and pinned host, StepInputs' layout) and outputs (last
  // hidden rows, f32 logits and their pinned host copy), sized for steps of
  // max(step_tokens, rows) tokens and one logits row per sequence (a decode bucket).
  // Tokens per step piece: a prefill longer than this runs as consecutive pieces.
  static constexpr int kDefaultStepTokens = 2048;

  template <class M>
  static Status allocate_io(M& m, int step_tokens = kDefaultStepTokens) {
    m.max_rows_ = next_pow2(m.max_sequences_);
    m.max_step_tokens_ = std::max(step_tokens, m.max_rows_);
    const size_t T = static_cast<size_t>(m.max_step_tokens_);
    const size_t R = static_cast<size_t>(m.max_rows_);
    const size_t H = m.config_.hidden_size, V = m.config_.vocab_size;
    const size_t num_ints = 3 * T + R + 1;
    FLEX_ASSIGN_OR_RETURN(m.inputs_, DeviceBuffer::create_zeroed(num_ints * sizeof(int32_t)));
    FLEX_ASSIGN_OR_RETURN(m.host_in_, PinnedBuffer::create(num_ints * sizeof(int32_t)));
    int32_t* base = m.inputs_.template as<int32_t>();
    m.in_ = {base, base + T, base + 2 * T, base + 3 * T, base + 3 * T + R};
    FLEX_ASSIGN_OR_RETURN(m.last_h_, DeviceBuffer::create(R * H * dtype_size(m.dtype_)));
    FLEX_ASSIGN_OR_RETURN(m.logits_, DeviceBuffer::create(R * V * sizeof(float)));
    FLEX_ASSIGN_OR_RETURN(m.host_logits_, PinnedBuffer::create(R * V * sizeof(float)));
    FLEX_ASSIGN_OR_RETURN(m.greedy_keys_, DeviceBuffer::create(R * sizeof(unsigned long long)));
    FLEX_ASSIGN_OR_RETURN(m.host_greedy_keys_,
                          PinnedBuffer::create(R * sizeof(unsigned long long)));
    const size_t args = SampleArgsLayout(m.max_rows_).bytes;
    FLEX_ASSIGN_OR_RETURN(m.sample_args_, DeviceBuffer::create(args));
    FLEX_ASSIGN_OR_RETURN(m.host_sample_args_, PinnedBuffer::create(args));
    FLEX_ASSIGN_OR_RETURN(
        m.sample_partials_,
        DeviceBuffer::create(R * sample_rows_chunks(static_cast<int>(V)) * sizeof(double)));
    return Status();
  }

  // The arguments of sample_rows for up to max_rows draws in one buffer (device, and its
  // pinned host copy): inverse temperatures and draws (double), then logits rows and
  // tokens (int32).
  struct SampleArgsLayout {
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

  // Every layer through the model's load_layer, each MoE layer with its host slot
  // mirror: in the region peers read from (options.allocate_slots), or on the heap
  // when expert parallel without one (the executor still needs the slots' shape).
  template <class M>
  static Status load_layers(M& m, const ModelOptions& options) {
    const ModelConfig& c = m.config_;
    m.layers_.resize(c.num_hidden_layers);
    m.mirrors_.resize(c.num_hidden_layers);
    FLEX_ASSIGN_OR_RETURN(m.upload_stream_, Stream::create());
    const int hidden = static_cast<int>(c.hidden_size);
    const int inter = static_cast<int>(c.moe_intermediate_size);
    for (int l = 0; l < c.num_hidden_layers; ++l) {
      if (c.is_moe_layer(l) && options.allocate_slots) {
        const size_t bytes = ExpertSlots::bytes_for(m.dtype_, m.num_local_slots_, hidden, inter);
        FLEX_ASSIGN_OR_RETURN(void* mem, options.allocate_slots(l, bytes));
        m.mirrors_[l] = ExpertSlots(m.dtype_, m.num_local_slots_, hidden, inter, mem);
      } else if (c.is_moe_layer(l) && m.ep_) {
        m.mirrors_[l] = ExpertSlots(m.dtype_, m.num_local_slots_, hidden, inter);
      }
      FLEX_RETURN_IF_ERROR(m.load_layer(l, &m.layers_[l]).annotate("layer " + std::to_string(l)));
      if (options.progress) options.progress(l + 1, c.num_hidden_layers);
    }
    return Status();
  }

  // The device routing tables and statistics of a MoE layer (any model's Layer).
  template <class L>
  static MoeLayerWeights moe_weights(L& layer) {
    MoeLayerWeights w;
    w.router = layer.router.data();
    w.slots = layer.slots.data();
    w.rep_start = layer.rep_start.template as<int32_t>();
    w.rep_count = layer.rep_count.template as<int32_t>();
    w.rep_slots = layer.rep_slots.template as<int32_t>();
    w.slot_stats = layer.stats.template as<int64_t>();
    return w;
  }

  template <class M>
  static Status validate(const M& m, const std::vector<SequenceChunk>& batch) {
    std::vector<bool> used(static_cast<size_t>(m.max_sequences_), false);
    for (const SequenceChunk& chunk : batch) {
      if (chunk.kv_slot < 0 || chunk.kv_slot >= m.max_sequences_) {
        return invalid_argument("kv slot " + std::to_string(chunk.kv_slot) + " out of range [0, " +
                                std::to_string(m.max_sequences_) + ")");
      }
      if (used[chunk.kv_slot]) {
        return invalid_argument("kv slot " + std::to_string(chunk.kv_slot) +
                                " used twice in a step");
      }
      used[chunk.kv_slot] = true;
      if (chunk.tokens.empty()) return invalid_argument("a sequence chunk has no tokens");
      if (chunk.start_pos < 0 ||
          chunk.start_pos + static_cast<int64_t>(chunk.tokens.size()) > m.max_seq_len_) {
        return invalid_argument("positions " + std::to_string(chunk.start_pos) + ".." +
                                std::to_string(chunk.start_pos + chunk.tokens.size()) +
                                " exceed the context length " + std::to_string(m.max_seq_len_));
      }
      for (int32_t id : chunk.tokens) {
        if (id < 0 || id >= m.config_.vocab_size) {
          return invalid_argument("token id " + std::to_string(id) +
                                  " outside the vocabulary [0, " +
                                  std::to_string(m.config_.vocab_size) + ")");
        }
      }
    }
    return Status();
  }

  // Copies host_in_'s first num_tokens tokens, num_rows logits rows and the count of
  // real rows to the device inputs (enqueued; host_in_ must stay until it ran).
  template <class M>
  static Status upload_inputs(M& m, int num_tokens, int num_rows) {
    const size_t T = static_cast<size_t>(m.max_step_tokens_);
    const int32_t* host = m.host_in_.template as<int32_t>();
    cudaStream_t s = m.stream_.get();
    const size_t n = static_cast<size_t>(num_tokens) * sizeof(int32_t);
    FLEX_CUDA_TRY(cudaMemcpyAsync(m.in_.ids, host, n, cudaMemcpyHostToDevice, s));
    FLEX_CUDA_TRY(cudaMemcpyAsync(m.in_.positions, host + T, n, cudaMemcpyHostToDevice, s));
    FLEX_CUDA_TRY(cudaMemcpyAsync(m.in_.kv_slots, host + 2 * T, n, cudaMemcpyHostToDevice, s));
    FLEX_CUDA_TRY(cudaMemcpyAsync(m.in_.last_rows, host + 3 * T, num_rows * sizeof(int32_t),
                                  cudaMemcpyHostToDevice, s));
    FLEX_CUDA_TRY(cudaMemcpyAsync(m.in_.num_valid, host + 3 * T + m.max_rows_, sizeof(int32_t),
                                  cudaMemcpyHostToDevice, s));
    return Status();
  }

  // Where a step's results go (Model::forward_step): logits rows to `logits` (every
  // row without `spec`, else the kLogits rows), and with `tokens` every row's token.
  struct StepOut {
    float* logits = nullptr;
    const std::vector<RowOutput>* spec = nullptr;
    int32_t* tokens = nullptr;
  };

  // The results of the step's first `rows` logits rows (row r is batch row
  // batch_row[r], or r without a map): tokens picked on the device (argmax_rows, and
  // sample_rows for kSample rows: 8 + 4 bytes a row cross), logits rows only where
  // wanted, one copy per run of wanted rows. After the step's work; synchronizes.
  template <class M>
  static Status download(M& m, int rows, const int* batch_row, const StepOut& out) {
    const size_t V = static_cast<size_t>(m.config_.vocab_size);
    cudaStream_t s = m.stream_.get();
    auto row_of = [batch_row](int r) { return batch_row ? batch_row[r] : r; };
    auto kind = [&](int r) {
      return out.spec == nullptr ? RowOutput::kLogits : (*out.spec)[row_of(r)].kind;
    };
    auto wanted = [&](int r) { return kind(r) == RowOutput::kLogits; };
    auto* keys = m.host_greedy_keys_.template as<unsigned long long>();
    float* host_logits = m.host_logits_.template as<float>();
    const SampleArgsLayout layout(m.max_rows_);
    auto* host_args = m.host_sample_args_.template as<uint8_t>();
    int draws = 0;
    if (rows > 0 && out.tokens != nullptr) {
      auto* dev_keys = m.greedy_keys_.template as<unsigned long long>();
      FLEX_CUDA_TRY(
          argmax_rows(m.logits_.template as<float>(), rows, static_cast<int>(V), dev_keys, s));
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
      uint8_t* dev_args = m.sample_args_.template as<uint8_t>();
      FLEX_CUDA_TRY(cudaMemcpyAsync(dev_args, host_args, layout.tokens, cudaMemcpyHostToDevice, s));
      SampleRowsArgs a;
      a.logits = m.logits_.template as<float>();
      a.vocab = static_cast<int>(V);
      a.keys = m.greedy_keys_.template as<unsigned long long>();
      a.rows = reinterpret_cast<const int32_t*>(dev_args + layout.rows);
      a.inv_temperature = reinterpret_cast<const double*>(dev_args + layout.inv_t);
      a.u01 = reinterpret_cast<const double*>(dev_args + layout.u01);
      a.n = draws;
      a.partials = m.sample_partials_.template as<double>();
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
      FLEX_CUDA_TRY(cudaMemcpyAsync(host_logits + r * V, m.logits_.template as<float>() + r * V,
                                    (end - r) * V * sizeof(float), cudaMemcpyDeviceToHost, s));
      r = end;
    }
    FLEX_RETURN_IF_ERROR(m.stream_.synchronize());
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

  // Model::forward (spec and tokens null) and Model::forward_step.
  template <class M>
  static Status forward(M& m, const std::vector<SequenceChunk>& batch, Tensor* logits,
                        const std::vector<RowOutput>* spec = nullptr,
                        std::vector<int32_t>* tokens = nullptr) {
    FLEX_RETURN_IF_ERROR(validate(m, batch));
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
        logits->size(1) != m.config_.vocab_size) {
      *logits = Tensor::empty(DType::kF32, {B, m.config_.vocab_size});
    }
    if (tokens != nullptr) tokens->resize(batch.size());
    const StepOut out{logits->data<float>(), spec, tokens ? tokens->data() : nullptr};
    FLEX_RETURN_IF_ERROR(set_device(m.device_));
    if (m.ep_) return run_ep(m, batch, out);  // Joins exchanges even when empty.
    if (B == 0) return Status();
    const bool decode = std::all_of(batch.begin(), batch.end(),
                                    [](const SequenceChunk& c) { return c.tokens.size() == 1; });
    if (decode && m.use_graphs_) return run_decode(m, batch, out);
    return run_pieces(m, batch, out);
  }

  template <class M>
  static Status run_decode(M& m, const std::vector<SequenceChunk>& batch, const StepOut& out) {
    const int B = static_cast<int>(batch.size());
    const int bucket = next_pow2(B);
    FLEX_RETURN_IF_ERROR(fill_step_inputs(batch, bucket, m.max_step_tokens_, m.max_rows_,
                                          m.max_sequences_, m.host_in_.template as<int32_t>())
                             .status());
    FLEX_RETURN_IF_ERROR(upload_inputs(m, bucket, bucket));
    cudaStream_t s = m.stream_.get();
    auto it = m.graphs_.find(bucket);
    if (it != m.graphs_.end()) {
      FLEX_RETURN_IF_ERROR(it->second.launch(s));
    } else {
      FLEX_RETURN_IF_ERROR(run_and_capture(m, bucket));
    }
    return download(m, B, nullptr, out);
  }

  // A bucket's first decode step: eagerly (which also warms cuBLAS up for its shapes),
  // then captured; a failed capture turns graphs off (eager decoding from then on).
  template <class M>
  static Status run_and_capture(M& m, int bucket) {
    cudaStream_t s = m.stream_.get();
    FLEX_RETURN_IF_ERROR(m.enqueue_step(bucket, bucket));
    FLEX_RETURN_IF_ERROR(GraphExec::begin_capture(s));
    Status st = m.enqueue_step(bucket, bucket);
    if (!st.ok()) {
      GraphExec::abandon_capture(s);
      FLEX_LOG(WARN) << "CUDA graph capture failed, decoding eagerly: " << st.to_string();
      m.use_graphs_ = false;
      return Status();
    }
    auto graph = GraphExec::end_capture(s);
    if (!graph.ok()) {
      FLEX_LOG(WARN) << "CUDA graph capture failed, decoding eagerly: "
                     << graph.status().to_string();
      m.use_graphs_ = false;
      return Status();
    }
    m.graphs_.emplace(bucket, std::move(graph).value());
    ++m.graph_captures_;
    return Status();
  }

  // Model::warm_up: every decode bucket (1, 2, 4, ... max_rows_) runs once and is
  // captured on padding rows alone (the spare KV slot, no real row: no slot statistics),
  // each segment on its own when expert parallel (no exchange: peers take no part).
  template <class M>
  static Status warm_up(M& m) {
    if (!m.use_graphs_) return Status();
    FLEX_RETURN_IF_ERROR(set_device(m.device_));
    for (int bucket = 1; bucket <= m.max_rows_; bucket *= 2) {
      FLEX_RETURN_IF_ERROR(fill_step_inputs({}, bucket, m.max_step_tokens_, m.max_rows_,
                                            m.max_sequences_, m.host_in_.template as<int32_t>())
                               .status());
      FLEX_RETURN_IF_ERROR(upload_inputs(m, bucket, bucket));
      if (m.ep_) {
        FLEX_RETURN_IF_ERROR(m.ep_moe_->warm_up(
            bucket, [&m, bucket](int seg) { return m.enqueue_segment(seg, bucket, bucket); }));
      } else if (m.graphs_.find(bucket) == m.graphs_.end()) {
        FLEX_RETURN_IF_ERROR(run_and_capture(m, bucket));
      }
      FLEX_RETURN_IF_ERROR(m.stream_.synchronize());  // host_in_ is refilled next.
      if (!m.use_graphs_ || (m.ep_ && m.ep_moe_->graphs_failed())) break;
    }
    return Status();
  }

  template <class M>
  static Status run_pieces(M& m, const std::vector<SequenceChunk>& batch, const StepOut& out) {
    const size_t T = static_cast<size_t>(m.max_step_tokens_);
    int32_t* host = m.host_in_.template as<int32_t>();
    int n = 0;
    std::vector<int> row_chunk;  // Logits row -> chunk index.
    auto flush = [&]() -> Status {
      const int rows = static_cast<int>(row_chunk.size());
      host[3 * T + m.max_rows_] = n;
      FLEX_RETURN_IF_ERROR(upload_inputs(m, n, rows));
      FLEX_RETURN_IF_ERROR(m.enqueue_step(n, rows));
      // Synchronizes, which also frees host_in_ for the next piece.
      FLEX_RETURN_IF_ERROR(download(m, rows, row_chunk.data(), out));
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
  template <class M>
  static const std::vector<std::vector<int64_t>>& slot_counts(const M& m) {
    if (m.ep_) {
      // Rows the device exchange counted join the host's (the counts vector is the
      // model's cache of them, as below).
      Status s = set_device(m.device_);
      if (s.ok()) s = m.ep_moe_->collect_counts();
      if (!s.ok()) FLEX_LOG(WARN) << "slot counts: " << s.to_string();
      return m.slot_counts_;
    }
    if (set_device(m.device_).ok()) {
      for (size_t l = 0; l < m.layers_.size(); ++l) {
        if (!m.layers_[l].is_moe) continue;
        const cudaError_t err = cudaMemcpyAsync(m.slot_counts_[l].data(), m.layers_[l].stats.data(),
                                                m.slot_counts_[l].size() * sizeof(int64_t),
                                                cudaMemcpyDeviceToHost, m.stream_.get());
        if (err != cudaSuccess) FLEX_LOG(WARN) << "slot counts: " << cudaGetErrorString(err);
      }
      const Status s = m.stream_.synchronize();
      if (!s.ok()) FLEX_LOG(WARN) << "slot counts: " << s.to_string();
    }
    return m.slot_counts_;
  }

  template <class M>
  static void reset_slot_counts(M& m) {
    if (m.ep_) {
      for (auto& layer : m.slot_counts_) std::fill(layer.begin(), layer.end(), 0);
      if (set_device(m.device_).ok()) {
        if (Status s = m.ep_moe_->reset_counts(); !s.ok())
          FLEX_LOG(WARN) << "slot counts: " << s.to_string();
      }
      return;
    }
    if (!set_device(m.device_).ok()) return;
    for (auto& L : m.layers_) {
      if (L.is_moe) (void)cudaMemsetAsync(L.stats.data(), 0, L.stats.num_bytes(), m.stream_.get());
    }
    (void)m.stream_.synchronize();
  }

  // Layer `layer`'s routing tables (logical expert -> replica slots) to the device,
  // in place (graphs keep reading the same addresses).
  template <class M>
  static Status write_routing_tables(M& m, int layer, const std::vector<int>& slot_map) {
    const RoutingTables t = build_routing_tables(slot_map, m.config_.num_experts);
    auto& L = m.layers_[layer];
    cudaStream_t s = m.stream_.get();
    FLEX_CUDA_TRY(cudaMemcpyAsync(L.rep_start.data(), t.rep_start.data(),
                                  t.rep_start.size() * sizeof(int32_t), cudaMemcpyHostToDevice, s));
    FLEX_CUDA_TRY(cudaMemcpyAsync(L.rep_count.data(), t.rep_count.data(),
                                  t.rep_count.size() * sizeof(int32_t), cudaMemcpyHostToDevice, s));
    FLEX_CUDA_TRY(cudaMemcpyAsync(L.rep_slots.data(), t.rep_slots.data(),
                                  t.rep_slots.size() * sizeof(int32_t), cudaMemcpyHostToDevice, s));
    return m.stream_.synchronize();  // `t` dies here.
  }

  // Model::local_slots: the host mirror of a MoE layer's local slots (null without).
  template <class M>
  static ExpertSlots* local_slots(M& m, int layer) {
    if (layer < 0 || layer >= static_cast<int>(m.mirrors_.size())) return nullptr;
    return m.mirrors_[layer].num_slots() > 0 ? &m.mirrors_[layer] : nullptr;
  }

  // Model::slots_written: the mirror's slot to the device, on the mover thread's own
  // stream (never waits on, or blocks, the step's graphs); returns once it landed.
  template <class M>
  static Status slots_written(M& m, int layer, int local_slot) {
    ExpertSlots* mirror = local_slots(m, layer);
    if (mirror == nullptr || local_slot < 0 || local_slot >= mirror->num_slots()) {
      return invalid_argument("layer " + std::to_string(layer) + " has no host slot " +
                              std::to_string(local_slot));
    }
    const size_t bytes = mirror->slot_bytes();
    FLEX_RETURN_IF_ERROR(set_device(m.device_));
    FLEX_CUDA_TRY(cudaMemcpyAsync(
        m.layers_[layer].slots.template as<uint8_t>() + local_slot * bytes,
        mirror->slot_data(local_slot), bytes, cudaMemcpyHostToDevice, m.upload_stream_.get()));
    return m.upload_stream_.synchronize();
  }

  // Model::copy_slot: device to device (the peer's slots mapped through CUDA IPC), then
  // the mirror, on the mover thread's stream.
  template <class M>
  static Status copy_slot(M& m, int layer, int local_slot, int src_rank, int src_slot) {
    if (!m.ep_ || !m.ep_moe_->device_exchange()) {
      return unimplemented("slots move between device memories with the device exchange only");
    }
    ExpertSlots* mirror = local_slots(m, layer);
    if (mirror == nullptr || local_slot < 0 || local_slot >= mirror->num_slots() || src_slot < 0 ||
        src_slot >= mirror->num_slots()) {
      return invalid_argument("layer " + std::to_string(layer) + ": no slot " +
                              std::to_string(local_slot) + " <- " + std::to_string(src_slot));
    }
    const size_t bytes = mirror->slot_bytes();
    FLEX_RETURN_IF_ERROR(set_device(m.device_));
    uint8_t* dst = m.layers_[layer].slots.template as<uint8_t>() + local_slot * bytes;
    cudaStream_t s = m.upload_stream_.get();
    FLEX_RETURN_IF_ERROR(m.ep_moe_->copy_slot(layer, src_rank, src_slot * bytes, dst, bytes, s));
    const cudaError_t err =
        cudaMemcpyAsync(mirror->slot_data(local_slot), dst, bytes, cudaMemcpyDeviceToHost, s);
    const Status landed = m.upload_stream_.synchronize();  // Also after a failed enqueue.
    FLEX_CUDA_TRY(err);
    return landed;
  }

  // Rewrites the device routing tables in place (no reallocation: graphs stay valid).
  template <class M>
  static Status set_placement(M& m, ExpertPlacement placement) {
    const ExpertPlacement& now = m.placement_;
    if (placement.num_slots() != now.num_slots() || placement.num_layers() != now.num_layers() ||
        placement.num_experts() != now.num_experts()) {
      return invalid_argument("new placement has a different shape");
    }
    for (int l = 0; l < placement.num_layers(); ++l) {
      if (!m.layers_[l].is_moe) continue;
      for (int e = 0; e < placement.num_experts(); ++e) {
        if (placement.replicas(l, e).empty()) {
          return invalid_argument("expert " + std::to_string(e) + " of layer " + std::to_string(l) +
                                  " has no replica");
        }
      }
    }
    FLEX_RETURN_IF_ERROR(set_device(m.device_));
    for (int l = 0; l < placement.num_layers(); ++l) {
      if (m.layers_[l].is_moe) {
        FLEX_RETURN_IF_ERROR(write_routing_tables(m, l, placement.slot_map(l)));
      }
    }
    m.placement_ = std::move(placement);
    return Status();
  }

  // Expert parallelism: the DeviceEpMoe over this model's MoE layers and slots.
  template <class M>
  static Status init_ep(M& m, const ModelOptions& options) {
    for (size_t l = 0; l < m.layers_.size(); ++l) {
      if (m.layers_[l].is_moe) m.moe_layer_ids_.push_back(static_cast<int>(l));
    }
    DeviceEpMoe::Config ep;
    ep.dims = m.moe_dims_;
    ep.first_slot = m.first_slot_;
    ep.num_local_slots = m.num_local_slots_;
    ep.max_tokens = m.max_step_tokens_;
    ep.moe_layers = m.moe_layer_ids_;
    ep.layer_slots = [&m](int layer) -> const void* {
      if (layer < 0 || layer >= static_cast<int>(m.layers_.size()) || !m.layers_[layer].is_moe) {
        return nullptr;
      }
      return m.layers_[layer].slots.data();
    };
    ep.executor = options.moe_executor;
    ep.mirrors = &m.mirrors_;
    ep.counts = &m.slot_counts_;
    ep.route_h = m.h_.data();
    ep.route_slot = m.moe_.slot.template as<int32_t>();
    ep.route_weight = m.moe_.weight.template as<float>();
    ep.device = m.device_;
    FLEX_ASSIGN_OR_RETURN(m.ep_moe_, DeviceEpMoe::create(std::move(ep), m.blas_, m.stream_.get()));
    return Status();
  }

  // One expert-parallel step: the model's device segments (enqueue_segment) between
  // the MoE layers' exchanges; decode steps replay a graph per (bucket, segment).
  template <class M>
  static Status run_ep(M& m, const std::vector<SequenceChunk>& batch, const StepOut& out) {
    const int B = static_cast<int>(batch.size());
    const bool decode =
        B > 0 && std::all_of(batch.begin(), batch.end(),
                             [](const SequenceChunk& c) { return c.tokens.size() == 1; });
    const int bucket = decode && m.use_graphs_ && !m.ep_moe_->graphs_failed() ? next_pow2(B) : 0;
    FLEX_ASSIGN_OR_RETURN(EpStepRows rows,
                          fill_step_inputs(batch, bucket, m.max_step_tokens_, m.max_rows_,
                                           m.max_sequences_, m.host_in_.template as<int32_t>()));
    const int n = rows.num_tokens, num_rows = rows.num_rows;
    if (n > 0) FLEX_RETURN_IF_ERROR(upload_inputs(m, n, num_rows));
    FLEX_RETURN_IF_ERROR(m.ep_moe_->run_step(
        n, rows.num_real, bucket, m.use_graphs_,
        [&m, n, num_rows](int seg) { return m.enqueue_segment(seg, n, num_rows); }));
    if (B == 0) return Status();
    return download(m, B, nullptr, out);
  }
};

}  // namespace flexpert::cuda
