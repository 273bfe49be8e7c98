// SPDX-License-Identifier: Apache-2.0
// The step driving the CUDA models share (CudaQwen3MoeModel, CudaDeepseekV3Model):
// forward() dispatch, decode steps replayed from a graph per batch bucket, prefill
// in pieces of max_step_tokens_, the expert-parallel step, slot statistics and
// in-place placement switches.
// Written once over the members both models have (each befriends StepDriver); the
// model-specific parts are the members it calls: validate, upload_inputs,
// enqueue_step (one process), enqueue_segment (expert parallel), write_routing_tables.
#pragma once

#include <algorithm>
#include <cstring>
#include <string>
#include <vector>

#include "cuda/device.h"
#include "cuda/ep_moe.h"
#include "flexpert/logging.h"
#include "flexpert/model.h"

namespace flexpert::cuda {

inline int next_pow2(int v) {
  int p = 1;
  while (p < v) p <<= 1;
  return p;
}

struct StepDriver {
  template <class M>
  static Status forward(M& m, const std::vector<SequenceChunk>& batch, Tensor* logits) {
    FLEX_RETURN_IF_ERROR(m.validate(batch));
    const int64_t B = static_cast<int64_t>(batch.size());
    if (!logits->owned() || logits->dim() != 2 || logits->size(0) != B ||
        logits->size(1) != m.config_.vocab_size) {
      *logits = Tensor::empty(DType::kF32, {B, m.config_.vocab_size});
    }
    FLEX_RETURN_IF_ERROR(set_device(m.device_));
    if (m.ep_) return run_ep(m, batch, logits->data<float>());  // Joins exchanges even when empty.
    if (B == 0) return Status();
    const bool decode = std::all_of(batch.begin(), batch.end(),
                                    [](const SequenceChunk& c) { return c.tokens.size() == 1; });
    if (decode && m.use_graphs_) return run_decode(m, batch, logits->data<float>());
    return run_pieces(m, batch, logits->data<float>());
  }

  template <class M>
  static Status run_decode(M& m, const std::vector<SequenceChunk>& batch, float* logits) {
    const int B = static_cast<int>(batch.size());
    const int bucket = next_pow2(B);
    FLEX_RETURN_IF_ERROR(fill_step_inputs(batch, bucket, m.max_step_tokens_, m.max_rows_,
                                          m.max_sequences_, m.host_in_.template as<int32_t>())
                             .status());
    FLEX_RETURN_IF_ERROR(m.upload_inputs(bucket, bucket));
    cudaStream_t s = m.stream_.get();
    auto it = m.graphs_.find(bucket);
    if (it != m.graphs_.end()) {
      FLEX_RETURN_IF_ERROR(it->second.launch(s));
    } else {
      FLEX_RETURN_IF_ERROR(run_and_capture(m, bucket));
    }
    const size_t bytes = static_cast<size_t>(B) * m.config_.vocab_size * sizeof(float);
    FLEX_CUDA_TRY(
        cudaMemcpyAsync(m.host_logits_.data(), m.logits_.data(), bytes, cudaMemcpyDeviceToHost, s));
    FLEX_RETURN_IF_ERROR(m.stream_.synchronize());
    std::memcpy(logits, m.host_logits_.data(), bytes);
    return Status();
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
      FLEX_RETURN_IF_ERROR(m.upload_inputs(bucket, bucket));
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
  static Status run_pieces(M& m, const std::vector<SequenceChunk>& batch, float* logits) {
    const size_t T = static_cast<size_t>(m.max_step_tokens_);
    const size_t V = static_cast<size_t>(m.config_.vocab_size);
    int32_t* host = m.host_in_.template as<int32_t>();
    int n = 0;
    std::vector<int> row_chunk;  // Logits row -> chunk index.
    auto flush = [&]() -> Status {
      const int rows = static_cast<int>(row_chunk.size());
      host[3 * T + m.max_rows_] = n;
      FLEX_RETURN_IF_ERROR(m.upload_inputs(n, rows));
      FLEX_RETURN_IF_ERROR(m.enqueue_step(n, rows));
      if (rows > 0) {
        FLEX_CUDA_TRY(cudaMemcpyAsync(m.host_logits_.data(), m.logits_.data(),
                                      rows * V * sizeof(float), cudaMemcpyDeviceToHost,
                                      m.stream_.get()));
      }
      FLEX_RETURN_IF_ERROR(m.stream_.synchronize());  // Also frees host_in_ for the next piece.
      for (int r = 0; r < rows; ++r) {
        std::memcpy(logits + row_chunk[r] * V, m.host_logits_.template as<float>() + r * V,
                    V * sizeof(float));
      }
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
    if (m.ep_) return m.slot_counts_;
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
      return;
    }
    if (!set_device(m.device_).ok()) return;
    for (auto& L : m.layers_) {
      if (L.is_moe) (void)cudaMemsetAsync(L.stats.data(), 0, L.stats.num_bytes(), m.stream_.get());
    }
    (void)m.stream_.synchronize();
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
        FLEX_RETURN_IF_ERROR(m.write_routing_tables(l, placement.slot_map(l)));
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
    FLEX_ASSIGN_OR_RETURN(m.ep_moe_, DeviceEpMoe::create(std::move(ep), m.blas_, m.stream_.get()));
    return Status();
  }

  // One expert-parallel step: the model's device segments (enqueue_segment) between
  // the MoE layers' exchanges; decode steps replay a graph per (bucket, segment).
  template <class M>
  static Status run_ep(M& m, const std::vector<SequenceChunk>& batch, float* logits) {
    const int B = static_cast<int>(batch.size());
    const size_t V = static_cast<size_t>(m.config_.vocab_size);
    const bool decode =
        B > 0 && std::all_of(batch.begin(), batch.end(),
                             [](const SequenceChunk& c) { return c.tokens.size() == 1; });
    const int bucket = decode && m.use_graphs_ && !m.ep_moe_->graphs_failed() ? next_pow2(B) : 0;
    FLEX_ASSIGN_OR_RETURN(EpStepRows rows,
                          fill_step_inputs(batch, bucket, m.max_step_tokens_, m.max_rows_,
                                           m.max_sequences_, m.host_in_.template as<int32_t>()));
    const int n = rows.num_tokens, num_rows = rows.num_rows;
    if (n > 0) FLEX_RETURN_IF_ERROR(m.upload_inputs(n, num_rows));
    FLEX_RETURN_IF_ERROR(m.ep_moe_->run_step(
        n, rows.num_real, bucket, m.use_graphs_,
        [&m, n, num_rows](int seg) { return m.enqueue_segment(seg, n, num_rows); }));
    if (B == 0) return Status();
    FLEX_CUDA_TRY(cudaMemcpyAsync(m.host_logits_.data(), m.logits_.data(), B * V * sizeof(float),
                                  cudaMemcpyDeviceToHost, m.stream_.get()));
    FLEX_RETURN_IF_ERROR(m.stream_.synchronize());
    std::memcpy(logits, m.host_logits_.data(), B * V * sizeof(float));
    return Status();
  }
};

}  // namespace flexpert::cuda
