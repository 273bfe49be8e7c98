// SPDX-License-Identifier: Apache-2.0
#include "moe/ep_executor.h"

#include <chrono>
#include <cstring>

#include "flexpert/logging.h"

namespace flexpert {
namespace {

// Dispatch payload: uint32 count, count x int32 local slot, count x H floats.
// Combine payload: count x H floats, in the order the rows arrived.
size_t dispatch_bytes(size_t count, int64_t hidden) {
  return sizeof(uint32_t) + count * sizeof(int32_t) + count * hidden * sizeof(float);
}

using Clock = std::chrono::steady_clock;

// Timing off (sum_ms null): no clock read.
Clock::time_point start_timer(const double* sum_ms) {
  return sum_ms != nullptr ? Clock::now() : Clock::time_point{};
}
void stop_timer(double* sum_ms, Clock::time_point start) {
  if (sum_ms != nullptr) {
    *sum_ms += std::chrono::duration<double, std::milli>(Clock::now() - start).count();
  }
}

}  // namespace

EpMoeExecutor::EpMoeExecutor(Transport& transport, int slots_per_rank, ThreadPool& pool)
    : transport_(transport), slots_per_rank_(slots_per_rank), pool_(pool) {
  const int n = transport.max_ranks();
  pairs_to_.resize(n);
  send_.resize(n);
  recv_first_.resize(n);
  recv_count_.resize(n);
}

size_t EpMoeExecutor::max_exchange_bytes(int64_t max_tokens, int top_k, int64_t hidden) {
  return dispatch_bytes(static_cast<size_t>(max_tokens * top_k), hidden);
}

Status EpMoeExecutor::execute(int layer, const float* x, const Routing& routing,
                              const ExpertSlots& local_slots, int first_slot, float* out,
                              int64_t* slot_counts) {
  const int me = transport_.rank();
  const int n = transport_.max_ranks();
  const int64_t H = local_slots.hidden();
  const int K = routing.top_k;
  const int64_t pairs = routing.num_tokens * K;
  FLEX_CHECK(first_slot == me * slots_per_rank_);
  double* timed = timing_ && group_.ranks.size() > 1 ? &exchange_ms_ : nullptr;
  const Clock::time_point dispatch_start = start_timer(timed);

  // Dispatch: bucket pairs by the rank holding their slot.
  for (auto& v : pairs_to_) v.clear();
  for (int64_t p = 0; p < pairs; ++p) {
    const int rank = routing.slot[p] / slots_per_rank_;
    if (!group_.contains(rank)) {
      return failed_precondition("layer " + std::to_string(layer) + ": slot " +
                                 std::to_string(routing.slot[p]) + " lives on rank " +
                                 std::to_string(rank) + ", not a member of epoch " +
                                 std::to_string(group_.epoch));
    }
    pairs_to_[rank].push_back(static_cast<int32_t>(p));
  }
  std::vector<ByteSpan> send(n);
  for (int r : group_.ranks) {
    if (r == me) continue;
    const auto& list = pairs_to_[r];
    auto& buf = send_[r];
    buf.resize(dispatch_bytes(list.size(), H));
    const uint32_t count = static_cast<uint32_t>(list.size());
    std::memcpy(buf.data(), &count, sizeof(count));
    auto* slots = reinterpret_cast<int32_t*>(buf.data() + sizeof(uint32_t));
    auto* rows = reinterpret_cast<float*>(slots + count);
    for (uint32_t i = 0; i < count; ++i) {
      const int32_t p = list[i];
      slots[i] = routing.slot[p] - r * slots_per_rank_;
      std::memcpy(rows + i * H, x + (p / K) * H, H * sizeof(float));
    }
    send[r] = {buf.data(), buf.size()};
  }
  FLEX_ASSIGN_OR_RETURN(std::vector<ByteSpan> recv, transport_.exchange(group_, send));
  stop_timer(timed, dispatch_start);

  // Everything this rank computes: its own pairs, then each peer's rows. A malformed
  // dispatch still joins the combine (empty) so that peers fail at the same layer
  // instead of waiting for this rank until their timeout.
  Status bad;
  recv_slot_.clear();
  recv_row_.clear();
  for (int r = 0; r < n; ++r) {
    recv_first_[r] = static_cast<int>(recv_slot_.size());
    recv_count_[r] = 0;
    if (!group_.contains(r)) continue;
    if (r == me) {
      for (int32_t p : pairs_to_[me]) {
        recv_slot_.push_back(routing.slot[p] - first_slot);
        recv_row_.push_back(x + (p / K) * H);
      }
    } else {
      const ByteSpan& span = recv[r];
      uint32_t count = 0;
      if (span.num_bytes >= sizeof(uint32_t)) std::memcpy(&count, span.data, sizeof(count));
      if (span.num_bytes < sizeof(uint32_t) || span.num_bytes != dispatch_bytes(count, H)) {
        bad = data_loss("dispatch from rank " + std::to_string(r) + " has " +
                        std::to_string(span.num_bytes) + " bytes for " + std::to_string(count) +
                        " rows");
        break;
      }
      const auto* slots =
          reinterpret_cast<const int32_t*>(static_cast<const char*>(span.data) + sizeof(uint32_t));
      const auto* rows = reinterpret_cast<const float*>(slots + count);
      for (uint32_t i = 0; i < count; ++i) {
        if (slots[i] < 0 || slots[i] >= local_slots.num_slots()) {
          bad = data_loss("rank " + std::to_string(r) + " sent a row for local slot " +
                          std::to_string(slots[i]));
          break;
        }
        recv_slot_.push_back(slots[i]);
        recv_row_.push_back(rows + i * H);
      }
    }
    if (!bad.ok()) break;
    recv_count_[r] = static_cast<int>(recv_slot_.size()) - recv_first_[r];
  }
  if (!bad.ok()) {
    for (int r : group_.ranks) send[r] = {};
    (void)transport_.exchange(group_, send);
    return bad;
  }

  // Compute grouped by local slot (CPU), or in arrival order by the installed RowCompute.
  const int64_t total = static_cast<int64_t>(recv_slot_.size());
  ensure_f32_rows(&results_, total, H);
  if (compute_) {
    groups_.row_of_pair.resize(static_cast<size_t>(total));
    for (int64_t i = 0; i < total; ++i) groups_.row_of_pair[i] = i;
    if (total > 0) {
      Status s =
          compute_(layer, recv_slot_.data(), recv_row_.data(), total, results_.data<float>());
      if (!s.ok()) {
        for (int r : group_.ranks) send[r] = {};
        (void)transport_.exchange(group_, send);  // Peers fail at this layer too.
        return s;
      }
    }
  } else {
    local_routing_.num_tokens = total;
    local_routing_.top_k = 1;
    local_routing_.slot = recv_slot_;
    group_by_slot(local_routing_, local_slots.num_slots(), &groups_);
    ensure_f32_rows(&rows_, total, H);
    float* rows = rows_.data<float>();
    for (int64_t i = 0; i < total; ++i) {
      std::memcpy(rows + groups_.row_of_pair[i] * H, recv_row_[i], H * sizeof(float));
    }
    compute_slots(rows, groups_.offsets, local_slots, results_.data<float>(), pool_);
  }
  if (slot_counts != nullptr) {
    for (int32_t s : recv_slot_) ++slot_counts[first_slot + s];
  }

  // Combine: results back to their senders, in the order the rows arrived.
  const Clock::time_point combine_start = start_timer(timed);
  const float* results = results_.data<float>();
  for (int r : group_.ranks) {
    send[r] = {};
    if (r == me) continue;
    auto& buf = send_[r];
    buf.resize(static_cast<size_t>(recv_count_[r]) * H * sizeof(float));
    auto* dst = reinterpret_cast<float*>(buf.data());
    for (int i = 0; i < recv_count_[r]; ++i) {
      std::memcpy(dst + i * H, results + groups_.row_of_pair[recv_first_[r] + i] * H,
                  H * sizeof(float));
    }
    send[r] = {buf.data(), buf.size()};
  }
  FLEX_ASSIGN_OR_RETURN(std::vector<ByteSpan> back, transport_.exchange(group_, send));
  stop_timer(timed, combine_start);

  // Sum per token in k order, whichever rank computed each pair.
  std::vector<const float*> pair_result(static_cast<size_t>(pairs), nullptr);
  for (int r : group_.ranks) {
    const auto& list = pairs_to_[r];
    if (r == me) {
      for (size_t i = 0; i < list.size(); ++i) {
        pair_result[list[i]] = results + groups_.row_of_pair[recv_first_[me] + i] * H;
      }
      continue;
    }
    if (back[r].num_bytes != list.size() * H * sizeof(float)) {
      return data_loss("combine from rank " + std::to_string(r) + " has " +
                       std::to_string(back[r].num_bytes) + " bytes, expected " +
                       std::to_string(list.size() * H * sizeof(float)));
    }
    const auto* rows_back = static_cast<const float*>(back[r].data);
    for (size_t i = 0; i < list.size(); ++i) pair_result[list[i]] = rows_back + i * H;
  }
  for (int64_t t = 0; t < routing.num_tokens; ++t) {
    float* o = out + t * H;
    std::fill(o, o + H, 0.f);
    for (int j = 0; j < K; ++j) {
      const float w = routing.weight[t * K + j];
      const float* r = pair_result[t * K + j];
      for (int64_t h = 0; h < H; ++h) o[h] += w * r[h];
    }
  }
  return Status();
}

}  // namespace flexpert
