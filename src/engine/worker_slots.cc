// SPDX-License-Identifier: Apache-2.0
// The worker's model and its slots: Worker::load (transport, executor, model, scheduler) and
// the weight mover, which pulls experts into free slots beside serving (worker_impl.h).
#include <algorithm>
#include <chrono>
#include <cstring>
#include <deque>
#include <string>

#include "cluster/protocol.h"
#include "engine/placement_wire.h"
#include "engine/worker_impl.h"
#include "flexpert/logging.h"
#include "flexpert/thread_pool.h"
#include "moe/expert_slots.h"

namespace flexpert::engine_detail {
namespace {

// The CUDA ordinal a --device names ("cuda" is 0, "cuda:N" is N); -1 for the CPU (or a spec
// the model load rejects with its own message).
int gpu_ordinal(const std::string& device) {
  if (device == "cuda") return 0;
  if (device.rfind("cuda:", 0) != 0 || device.size() == 5 || device.size() > 9) return -1;
  const std::string digits = device.substr(5);
  if (digits.find_first_not_of("0123456789") != std::string::npos) return -1;
  return std::stoi(digits);
}

}  // namespace

Status Worker::load() {
  FLEX_ASSIGN_OR_RETURN(model_config_, ModelConfig::load(config_.model_dir));
  TransportOptions topts;
  topts.session = config_.session;
  topts.rank = options_.rank;
  topts.incarnation = config_.incarnation;
  topts.max_ranks = config_.max_ranks;
  topts.max_gather_bytes = sizeof(StepHeader);
  // A step carries at most the token budget, or one decode token per sequence when
  // more sequences run than the budget: the worst case of one rank to one peer.
  topts.max_exchange_bytes = EpMoeExecutor::max_exchange_bytes(
      std::max(config_.max_tokens_per_step, config_.max_sequences),
      model_config_.num_experts_per_tok, model_config_.hidden_size);
  topts.timeout_ms = config_.timeout_ms;
  std::string backend = config_.transport;
  if ((backend == "shm" || backend == "hier") && gpu_ordinal(config_.device) >= 0) {
    // A GPU rank: the device exchange and slot copies read peers' GPU memory through the
    // transport's mapped peer buffers (docs/ARCHITECTURE.md), which cuda_ipc has; its
    // collectives and regions stay in host shared memory, as shm's. hier takes cuda_ipc so
    // within the host (its peers on other hosts are not mappable: host paths).
    if (backend == "shm") backend = "cuda_ipc";
    topts.host_collectives = true;
    topts.device = gpu_ordinal(config_.device);
  }
  FLEX_ASSIGN_OR_RETURN(transport_, create_transport(backend, topts));
  {
    MutexLock lock(heartbeat_mutex_);
    lost_sink_ = transport_.get();
  }
  ThreadPool& pool = ThreadPool::global();
  executor_ = std::make_unique<EpMoeExecutor>(*transport_, config_.slots_per_rank, pool);
  executor_->set_timing(config_.step_timing);

  ModelOptions mopts;
  FLEX_ASSIGN_OR_RETURN(mopts.expert_placement,
                        from_wire(config_.placement, model_config_.num_hidden_layers,
                                  std::max(1, model_config_.num_experts)));
  mopts.max_sequences = config_.max_sequences;
  mopts.max_seq_len = config_.max_seq_len;
  mopts.first_slot = options_.rank * config_.slots_per_rank;
  mopts.num_local_slots = config_.slots_per_rank;
  mopts.allocate_slots = [this](int layer, size_t bytes) -> Result<void*> {
    FLEX_ASSIGN_OR_RETURN(Region region, transport_->allocate_region(layer, bytes));
    return region.data;
  };
  mopts.moe_executor = executor_.get();
  mopts.device = config_.device;
  mopts.device_dtype = config_.device_f32 ? DType::kF32 : DType::kBF16;
  mopts.quantization = config_.quantization;
  FLEX_ASSIGN_OR_RETURN(model_, Model::load(config_.model_dir, mopts));
  // Before Ready: a joiner captures its graphs while the group serves without it.
  const auto t0 = std::chrono::steady_clock::now();
  FLEX_RETURN_IF_ERROR(model_->warm_up().annotate("warm-up"));
  const double warm_ms =
      std::chrono::duration<double, std::milli>(std::chrono::steady_clock::now() - t0).count();
  if (model_->num_graph_captures() > 0) {
    FLEX_LOG(INFO) << "rank " << options_.rank << " warmed up: " << model_->num_graph_captures()
                   << " graphs captured in " << warm_ms << " ms";
  }
  scheduler_ = std::make_unique<Scheduler>(
      SchedulerLimits{model_config_.vocab_size, model_->max_sequences(), model_->max_seq_len(),
                      config_.max_tokens_per_step, model_config_.eos_token_ids});
  proto::Ready ready;
  ready.rank = options_.rank;
  ready.incarnation = config_.incarnation;
  ready.transport_address = transport_->address();
  ready.vocab_size = model_config_.vocab_size;
  ready.max_seq_len = model_->max_seq_len();
  return send_msg(control_, ready);
}

proto::PullDone Worker::pull(const proto::PullCommand& cmd) {
  proto::PullDone done;
  done.id = cmd.id;
  const auto t0 = std::chrono::steady_clock::now();
  ExpertSlots* slots = model_->local_slots(cmd.layer);
  Status s;
  if (slots == nullptr || cmd.dst_slots.size() != cmd.src_ranks.size() ||
      cmd.dst_slots.size() != cmd.src_slots.size()) {
    s = invalid_argument("bad pull command for layer " + std::to_string(cmd.layer));
  }
  for (size_t i = 0; s.ok() && i < cmd.dst_slots.size(); ++i) {
    const int dst = cmd.dst_slots[i];
    const bool from_checkpoint = cmd.src_ranks[i] == proto::PullCommand::kFromCheckpoint;
    if (dst < 0 || dst >= slots->num_slots() || cmd.src_slots[i] < 0 ||
        (!from_checkpoint && cmd.src_slots[i] >= slots->num_slots())) {
      s = invalid_argument("pull slot out of range");
      break;
    }
    const size_t bytes = slots->slot_bytes();
    // Regions are per layer; a slot's weights are one contiguous block in it.
    if (cmd.src_ranks[i] == proto::PullCommand::kFromCheckpoint) {
      s = model_->load_expert(cmd.layer, cmd.src_slots[i], dst);
    } else {
      // Device to device where the model can (GPU ranks: a copy engine reads the peer's
      // slot through CUDA IPC), else through the host mirrors.
      s = model_->copy_slot(cmd.layer, dst, cmd.src_ranks[i], cmd.src_slots[i]);
      if (s.code() != StatusCode::kUnimplemented) {
        if (s.ok()) ++done.device_copies;
      } else if (cmd.src_ranks[i] == options_.rank) {
        std::memcpy(slots->slot_data(dst), slots->slot_data(cmd.src_slots[i]), bytes);
        s = model_->slots_written(cmd.layer, dst);
      } else {
        s = transport_->read(cmd.src_ranks[i], cmd.layer, cmd.src_slots[i] * bytes,
                             slots->slot_data(dst), bytes);
        // A GPU model uploads the slot now: PullDone (and so any map using it) comes after.
        if (s.ok()) s = model_->slots_written(cmd.layer, dst);
      }
    }
    if (s.ok()) done.num_bytes += bytes;
  }
  done.seconds = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
  done.code = static_cast<int>(s.code());
  done.message = s.ok() ? "" : s.message();
  return done;
}

void Worker::mover_loop() {
  MutexLock lock(mover_mutex_);
  for (;;) {
    mover_cv_.wait(lock, [&]() REQUIRES(mover_mutex_) { return mover_stop_ || !pulls_.empty(); });
    if (mover_stop_) return;
    proto::PullCommand cmd = std::move(pulls_.front());
    pulls_.pop_front();
    lock.unlock();
    proto::PullDone done = pull(cmd);  // Destination slots are free in the current map.
    lock.lock();
    pulled_.push_back(std::move(done));
  }
}

void Worker::send_pull_results() {
  std::deque<proto::PullDone> done;
  {
    MutexLock lock(mover_mutex_);
    done.swap(pulled_);
  }
  for (const auto& d : done) (void)send_msg(control_, d);
}

}  // namespace flexpert::engine_detail
