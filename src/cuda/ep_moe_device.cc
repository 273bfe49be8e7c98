// SPDX-License-Identifier: Apache-2.0
// DeviceEpMoe: the device exchange of one step (ep_exchange.h's kernels on the model's
// stream) and its end, watched from the host (ep_moe.h).
#include <algorithm>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <string>
#include <thread>

#include "cuda/ep_moe.h"
#include "cuda/ep_moe_peers.h"
#include "cuda/knobs.h"
#include "flexpert/logging.h"

namespace flexpert::cuda {
namespace {

// Exchanges of one epoch (the value's low 40 bits): years at thousands a second.
constexpr uint64_t kExchangesPerEpoch = uint64_t{1} << 40;

}  // namespace

using ep_moe_detail::now_ns;

EpArgs DeviceEpMoe::exchange_args(const Group& group) const {
  EpArgs a;
  a.peers = peer_table_.as<EpPeer>();
  a.window = window_.as<EpWindow>();
  a.me = ep_->transport().rank();
  for (int r : group.ranks) a.members |= uint64_t{1} << r;
  a.slots_per_rank = ep_->slots_per_rank();
  a.top_k = config_.dims.top_k;
  a.hidden = config_.dims.hidden;
  a.dtype = config_.dims.dtype;
  a.status = status_.as<EpStatus>();
  a.abort = abort_.as<int32_t>();
  a.progress = progress_.as<uint64_t>();
  // The host ends waits on a dead peer or at the transport's timeout (ep_release); the
  // kernel's own limit is a backstop where the waits spin (ep_stream_waits() false).
  a.timeout_ns = int64_t{2} * ep_->transport().timeout_ms() * 1'000'000;
  return a;
}

Status DeviceEpMoe::enqueue_device_exchange(int seg, int n, int num_real, int bound,
                                            const Group& group) {
  const int layer = config_.moe_layers[seg];
  const MoeDims& d = config_.dims;
  EpArgs a = exchange_args(group);
  // Values stay below 2^62: bit 62 marks a flag the host released (ep_exchange.h).
  if (exchange_index_ + 1 >= kExchangesPerEpoch || group.epoch >= (uint64_t{1} << 22)) {
    return resource_exhausted("expert-parallel exchange values of epoch " +
                              std::to_string(group.epoch) + " are used up (a new epoch resets)");
  }
  a.value = (group.epoch << 40) | ++exchange_index_;
  // At most kExchangesAhead exchanges queued past the device: the host ends waits on a
  // dead peer only while it watches, never while a full launch queue holds it.
  Event& ahead = ahead_events_[static_cast<size_t>(seg) % ahead_events_.size()];
  if (seg >= static_cast<int>(ahead_events_.size())) {
    FLEX_RETURN_IF_ERROR(watch_until(ahead.get(), group));
  }
  int32_t* pos = reinterpret_cast<int32_t*>(window_.as<EpWindow>() + 1);
  FLEX_RETURN_IF_ERROR(record_exchange_event(seg, 0));
  FLEX_CUDA_TRY(ep_publish(a, num_real * d.top_k, pos, stream_));
  FLEX_CUDA_TRY(ep_wait(a, /*which=*/0, stream_));
  FLEX_CUDA_TRY(ep_gather(a, bound, rows_.data(), scratch_.slot.as<int32_t>(),
                          num_rows_.as<int32_t>(), stream_));
  FLEX_RETURN_IF_ERROR(record_exchange_event(seg, 1));
  MoeLayerWeights w;
  w.slots = config_.layer_slots(layer);
  if (w.slots == nullptr) {
    return invalid_argument("rows for layer " + std::to_string(layer) + " without experts");
  }
  w.slot_stats = stats_.as<int64_t>() + static_cast<size_t>(seg) * config_.num_local_slots;
  // Tiles sized for the rows an owner expects (a share of the bound), not the bound.
  const int members = std::max<int>(1, static_cast<int>(group.ranks.size()));
  const int expected = std::max(1, bound / members);
  const GemmTile tile =
      choose_tile(d.dtype, expected, config_.num_local_slots, d.hidden, d.intermediate);
  if (local_dims_.fp8) {
    // Peers read the rows from scratch_.y: the FP8 grouped GEMMs, which leave them there.
    FLEX_RETURN_IF_ERROR(run_fp8_experts(local_dims_, w, scratch_, rows_.data(), bound,
                                         num_rows_.as<int32_t>(), nullptr, /*accumulate=*/false,
                                         stream_, /*force_tile=*/-1, /*combine=*/false, expected));
  } else {
    FLEX_RETURN_IF_ERROR(run_moe(local_dims_, w, scratch_, rows_.data(), bound,
                                 num_rows_.as<int32_t>(), nullptr, /*accumulate=*/false, blas_,
                                 stream_, static_cast<int>(tile),
                                 kMoePermute | kMoeGateUp | kMoeDown));
  }
  FLEX_RETURN_IF_ERROR(record_exchange_event(seg, 2));
  FLEX_CUDA_TRY(ep_signal_done(a, stream_));
  FLEX_CUDA_TRY(ep_wait(a, /*which=*/1, stream_));
  FLEX_CUDA_TRY(ep_combine(a, config_.route_weight, pos, num_real, n, out_.as<float>(), stream_));
  FLEX_RETURN_IF_ERROR(ahead.record(stream_));
  return record_exchange_event(seg, 3);
}

Status DeviceEpMoe::start_exchange_timing(const Group& group) {
  const bool log_slow = knobs().step_log_ms >= 0;
  timed_step_ = (ep_->timing() || log_slow) && group.ranks.size() > 1;
  if (!timed_step_) return Status();
  const size_t needed = 4 * config_.moe_layers.size() + 2;  // And the step's start and end.
  if (exchange_events_.size() != needed) {
    exchange_events_.clear();
    for (size_t i = 0; i < needed; ++i) {
      FLEX_ASSIGN_OR_RETURN(Event e, Event::create());
      exchange_events_.push_back(std::move(e));
    }
  }
  timed_start_ns_ = now_ns();
  return exchange_events_[needed - 2].record(stream_);
}

Status DeviceEpMoe::record_exchange_event(int seg, int which) {
  if (!timed_step_) return Status();
  if (seg < 0) {  // The step's end: everything enqueued.
    timed_enqueued_ns_ = now_ns();
    return exchange_events_.back().record(stream_);
  }
  return exchange_events_[4 * static_cast<size_t>(seg) + which].record(stream_);
}

Status DeviceEpMoe::add_exchange_time() {
  if (!timed_step_) return Status();
  // finish_device_step saw the step's last event complete: every event here has too.
  const size_t L = config_.moe_layers.size();
  double ms = 0;
  for (size_t i = 0; i + 1 < 4 * L; i += 2) {
    FLEX_ASSIGN_OR_RETURN(float part,
                          Event::elapsed_ms(exchange_events_[i], exchange_events_[i + 1]));
    ms += part;
  }
  if (ep_->timing()) ep_->add_exchange_ms(ms);
  const double limit = knobs().step_log_ms;
  if (limit < 0) return Status();
  const Event& begin = exchange_events_[4 * L];
  FLEX_ASSIGN_OR_RETURN(float total, Event::elapsed_ms(begin, exchange_events_.back()));
  if (total <= limit) return Status();
  // Where a slow step went, on this rank's stream: each MoE layer's dense part before its
  // dispatch, the dispatch (publish, wait for the peers' rows, gather), the local experts,
  // the combine (done, wait for the peers' results, combine); then the last segment.
  std::string parts;
  const Event* prev = &begin;
  for (size_t l = 0; l < L; ++l) {
    const Event* e = &exchange_events_[4 * l];
    float dense = 0, dispatch = 0, experts = 0, combine = 0;
    FLEX_ASSIGN_OR_RETURN(dense, Event::elapsed_ms(*prev, e[0]));
    FLEX_ASSIGN_OR_RETURN(dispatch, Event::elapsed_ms(e[0], e[1]));
    FLEX_ASSIGN_OR_RETURN(experts, Event::elapsed_ms(e[1], e[2]));
    FLEX_ASSIGN_OR_RETURN(combine, Event::elapsed_ms(e[2], e[3]));
    char buf[160];
    std::snprintf(buf, sizeof(buf),
                  " | layer %d: dense %.2f, dispatch %.2f, experts %.2f, combine %.2f",
                  config_.moe_layers[l], dense, dispatch, experts, combine);
    parts += buf;
    prev = &e[3];
  }
  FLEX_ASSIGN_OR_RETURN(float tail, Event::elapsed_ms(*prev, exchange_events_.back()));
  FLEX_LOG(INFO) << "rank " << ep_->transport().rank() << ": a device step of " << total
                 << " ms (enqueued in " << (timed_enqueued_ns_ - timed_start_ns_) / 1e6
                 << " ms on the host)" << parts << " | last segment " << tail;
  return Status();
}

void DeviceEpMoe::release_waits(uint64_t ranks, int64_t now_ns) {
  *abort_.as<int32_t>() = 1;  // Kernels spinning without memory operations give up too.
  if (ranks == 0) return;
  if ((ranks & ~released_) == 0 && now_ns - released_at_ns_ < kReleaseAgainNs) return;
  if (watch_.released_ns == 0) {
    watch_.released_ns = now_ns;
    watch_.next_report_ns = now_ns + kReleasedStepReportNs;
    FLEX_LOG(INFO) << "rank " << ep_->transport().rank() << ": releasing the exchange's waits on "
                   << "ranks (mask) " << ranks;
  }
  released_ |= ranks;
  released_at_ns_ = now_ns;
  if (const cudaError_t e = ep_release(window_.as<EpWindow>(), released_, release_stream_.get());
      e != cudaSuccess) {
    // The step's stream would never drain: the process ends, and the group recovers
    // without it as from any death.
    FLEX_LOG(ERROR) << "expert-parallel exchange: the waits on dead or silent peers cannot be "
                       "ended ("
                    << cudaGetErrorString(e) << "); exiting";
    std::abort();
  }
}

Status DeviceEpMoe::reset_after_failed_step() {
  Status s = release_stream_.synchronize();  // Every release landed before the reset.
  if (s.ok() && released_ != 0) {
    s = cuda_status(ep_unrelease(window_.as<EpWindow>(), stream_), "ep_unrelease");
  }
  if (s.ok()) {
    s = cuda_status(cudaMemsetAsync(status_.data(), 0, sizeof(EpStatus), stream_),
                    "clearing the exchange status");
  }
  if (s.ok()) s = cuda_status(cudaStreamSynchronize(stream_), "expert-parallel step");
  released_ = 0;
  *abort_.as<int32_t>() = 0;
  return s;
}

void DeviceEpMoe::check_released_step(int64_t now) {
  StepWatch& w = watch_;
  if (w.released_ns == 0 || now < w.next_report_ns) return;
  const int rank = ep_->transport().rank();
  const int64_t ms = (now - w.released_ns) / 1'000'000;
  if (now - w.released_ns >= kReleasedStepLimitNs) {
    FLEX_LOG(ERROR) << "rank " << rank << ": the device has not finished the step " << ms
                    << " ms after its exchange's waits were released; exiting";
    std::abort();
  }
  FLEX_LOG(WARN) << "rank " << rank << ": the device has not finished the step " << ms
                 << " ms after its exchange's waits were released (progress "
                 << *progress_.as<uint64_t>() << ")";
  w.next_report_ns = now + kReleasedStepReportNs;
}

void DeviceEpMoe::start_watch() {
  const int64_t now = now_ns();
  watch_ = StepWatch{};
  watch_.deadline_ns = now + int64_t{ep_->transport().timeout_ms()} * 1'000'000;
  watch_.seen = *progress_.as<uint64_t>();
  watch_.next_check_ns = now + 1'000'000;
}

uint64_t DeviceEpMoe::other_members(const Group& group) const {
  uint64_t others = 0;
  for (int r : group.ranks) others |= r == ep_->transport().rank() ? 0 : uint64_t{1} << r;
  return others;
}

Status DeviceEpMoe::watch_until(cudaEvent_t done, const Group& group) {
  Transport& transport = ep_->transport();
  const volatile uint64_t* progress = progress_.as<uint64_t>();
  const int64_t timeout_ns = int64_t{transport.timeout_ms()} * 1'000'000;
  const int64_t start = now_ns();
  StepWatch& w = watch_;
  for (;;) {
    const cudaError_t q = cudaEventQuery(done);
    if (q == cudaSuccess) return Status();
    if (q != cudaErrorNotReady) return cuda_status(q, "expert-parallel step");
    const int64_t now = now_ns();
    if (now >= w.next_check_ns) {
      // Dead peers' waits end (the rest of the step does no peer work); every released
      // member's again while the step runs on (a live peer may overwrite a release).
      uint64_t dead = 0;
      for (int r : group.ranks) {
        if (r == transport.rank()) continue;
        if (Status s = transport.peer_status(r); !s.ok()) {
          if (w.gone.ok()) w.gone = std::move(s);
          dead |= uint64_t{1} << r;
        }
      }
      if (dead != 0 || released_ != 0) release_waits(dead | released_, now);
      w.next_check_ns = now + 1'000'000;
    }
    if (const uint64_t p = *progress; p != w.seen) {
      w.seen = p;
      w.deadline_ns = now + timeout_ns;  // Moved on by every wait that passes.
    }
    if (now >= w.deadline_ns) {  // No wait passed for the transport's timeout: end them all.
      release_waits(other_members(group), now);
    }
    check_released_step(now);
    if (now - start < 1'000'000) {
      std::this_thread::yield();
    } else {
      std::this_thread::sleep_for(std::chrono::microseconds(50));
    }
  }
}

Status DeviceEpMoe::finish_device_step(const Group& group) {
  Transport& transport = ep_->transport();
  FLEX_CUDA_TRY(cudaMemcpyAsync(status_host_.data(), status_.data(), sizeof(EpStatus),
                                cudaMemcpyDeviceToHost, stream_));
  FLEX_RETURN_IF_ERROR(record_exchange_event(-1, 0));
  FLEX_RETURN_IF_ERROR(step_done_.record(stream_));
  const int64_t t0 = now_ns();
  FLEX_RETURN_IF_ERROR(watch_until(step_done_.get(), group));
  if (const int64_t waited = now_ns() - t0; waited > kSlowWaitNs) {
    FLEX_LOG(INFO) << "rank " << transport.rank() << " epoch " << group.epoch << ": waited "
                   << waited / 1'000'000 << " ms for the device to finish a step";
  }
  volatile int32_t* abort = abort_.as<int32_t>();
  const Status gone = watch_.gone;
  EpStatus st;
  std::memcpy(&st, status_host_.data(), sizeof(st));
  if (st.failed == 0 && released_ == 0) {
    *abort = 0;
    return Status();
  }
  FLEX_RETURN_IF_ERROR(reset_after_failed_step());
  if (st.failed == 0) return Status();  // Released after every wait had passed.
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
}  // namespace flexpert::cuda
