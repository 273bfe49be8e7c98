// SPDX-License-Identifier: Apache-2.0
// The CUDA Qwen3-MoE model in its expert-parallel mode, in one process: a loopback
// executor hands every routed row to the model's RowCompute (as EpMoeExecutor does for
// the rows a rank owns), so the device segments, the host round trip of each MoE
// layer, the segment graphs, the host slot mirror and slots_written() are exercised
// without peers. Greedy tokens must equal the Hugging Face reference, also after a map
// that moves experts into slots filled through the mirror, without a graph recapture.
// Qwen3-MoE and DeepSeek-V3 (shared experts beside the exchanged routed ones).
// Then two ranks of one process (a thread each) over real shm transports and EpMoeExecutors:
// the device exchange (rows read from the peer's buffers by kernels) against the reference
// and against the host exchange, a silent or departed peer ending a step with an error, and a
// slot read over the transport (another host's slots) that an epoch change does not wait for.
#include <gtest/gtest.h>
#include <unistd.h>

#include <array>
#include <chrono>
#include <condition_variable>
#include <cstdlib>
#include <cstring>
#include <functional>
#include <memory>
#include <mutex>
#include <thread>

#include "cuda/device.h"
#include "cuda/ep_exchange.h"
#include "cuda/ep_moe_peers.h"
#include "cuda_ep_ranks.h"
#include "cuda_model_util.h"
#include "flexpert/generate.h"
#include "flexpert/model.h"
#include "moe/ep_executor.h"
#include "moe/expert_slots.h"
#include "moe/moe_executor.h"
#include "transport/fault_injecting_transport.h"
#include "transport/forwarding_transport.h"

namespace flexpert {
namespace {

// One rank holding local slots [first_slot, ...): every pair is computed here.
class LoopbackExecutor final : public MoeExecutor {
 public:
  bool set_row_compute(RowCompute compute) override {
    compute_ = std::move(compute);
    return true;
  }
  Status execute(int layer, const float* x, const Routing& routing, const ExpertSlots& local_slots,
                 int first_slot, float* out, int64_t* slot_counts) override {
    ++calls;
    const int64_t H = local_slots.hidden();
    const int K = routing.top_k;
    const int64_t pairs = routing.num_tokens * K;
    std::vector<int32_t> slots(pairs);
    std::vector<const float*> rows(pairs);
    for (int64_t p = 0; p < pairs; ++p) {
      slots[p] = routing.slot[p] - first_slot;
      rows[p] = x + (p / K) * H;
      if (slot_counts != nullptr) ++slot_counts[routing.slot[p]];
    }
    std::vector<float> results(pairs * H);
    if (pairs > 0) {
      FLEX_RETURN_IF_ERROR(compute_(layer, slots.data(), rows.data(), pairs, results.data()));
    }
    for (int64_t t = 0; t < routing.num_tokens; ++t) {
      float* o = out + t * H;
      std::fill(o, o + H, 0.f);
      for (int k = 0; k < K; ++k) {
        const float w = routing.weight[t * K + k];
        const float* r = results.data() + (t * K + k) * H;
        for (int64_t h = 0; h < H; ++h) o[h] += w * r[h];
      }
    }
    return Status();
  }
  int64_t calls = 0;

 private:
  RowCompute compute_;
};

using cuda_test::load_reference;

std::vector<std::vector<int32_t>> greedy(Model& model,
                                         const std::vector<cuda_test::RefPrompt>& ref) {
  return cuda_test::greedy_tokens(model, ref);
}

// `num_experts` experts in slots 0.. of every layer, then a free local slot and a free
// slot of a "peer".
void check_ep_model(const std::string& name, int num_experts, int num_layers) {
  const std::string dir = std::string(FLEXPERT_TESTDATA_DIR) + "/" + name;
  const int spare = num_experts;
  std::string slots = "[";
  for (int s = 0; s < num_experts; ++s) slots += std::to_string(s) + ",";
  slots += "-1,-1]";
  std::string layers = slots;
  for (int l = 1; l < num_layers; ++l) layers += "," + slots;
  LoopbackExecutor executor;
  ModelOptions options;
  options.device = "cuda";
  options.device_dtype = DType::kF32;
  options.placement = R"({"layers": [)" + layers + "]}";
  options.max_sequences = 8;
  options.first_slot = 0;
  options.num_local_slots = num_experts + 1;
  options.moe_executor = &executor;
  auto loaded = Model::load(dir, options);
  ASSERT_TRUE(loaded.ok()) << loaded.status().to_string();
  Model& model = *loaded.value();
  const auto ref = load_reference(dir);
  const auto first = greedy(model, ref);
  ASSERT_EQ(first.size(), ref.size());
  for (size_t i = 0; i < ref.size(); ++i) EXPECT_EQ(first[i], ref[i].greedy) << "prompt " << i;
  EXPECT_GT(executor.calls, 0);
  EXPECT_GT(model.num_graph_captures(), 0);
  // Run again so that every bucket seen is captured, then count.
  (void)greedy(model, ref);
  const int64_t captures = model.num_graph_captures();

  // Move expert 3 of every MoE layer into the free local slot through the host mirror
  // (as the worker's mover does after a pull), then switch to a map without slot 3.
  const ExpertPlacement& p = model.placement();
  std::vector<std::vector<int>> maps;
  for (int l = 0; l < p.num_layers(); ++l) {
    std::vector<int> map = p.slot_map(l);
    ExpertSlots* mirror = model.local_slots(l);
    if (mirror != nullptr) {
      std::memcpy(mirror->slot_data(spare), mirror->slot_data(3), mirror->slot_bytes());
      ASSERT_TRUE(model.slots_written(l, spare).ok());
      map[spare] = 3;
      map[3] = ExpertPlacement::kFreeSlot;
    }
    maps.push_back(map);
  }
  auto next = ExpertPlacement::from_slot_maps(p.num_experts(), maps);
  ASSERT_TRUE(next.ok()) << next.status().to_string();
  ASSERT_TRUE(model.set_placement(std::move(next).value()).ok());
  model.reset_slot_counts();
  const auto second = greedy(model, ref);
  EXPECT_EQ(second, first);
  EXPECT_EQ(model.num_graph_captures(), captures) << "a map switch must not recapture";
  int64_t moved = 0;
  for (int l = 0; l < p.num_layers(); ++l) {
    if (model.local_slots(l) == nullptr) continue;
    EXPECT_EQ(model.slot_counts()[l][3], 0) << "layer " << l;
    moved += model.slot_counts()[l][spare];
  }
  EXPECT_GT(moved, 0) << "no row reached the moved expert";
}

TEST(CudaEpTest, Qwen3RowComputeMatchesReferenceAndMapsDoNotRecapture) {
  FLEX_SKIP_WITHOUT_GPU();
  check_ep_model("qwen3moe-tiny", 16, 4);
}

TEST(CudaEpTest, DeepseekRowComputeMatchesReferenceAndMapsDoNotRecapture) {
  FLEX_SKIP_WITHOUT_GPU();
  check_ep_model("deepseekv3-tiny", 32, 3);
}

// Two ranks of one process, each holding half the slots of qwen3moe-tiny (f32).
struct TwoRanks : cuda_test::TwoEpRanks {
  static constexpr int kExperts = 16, kSlotsPerRank = kExperts / kRanks;

  using Wrap = std::function<std::unique_ptr<Transport>(std::unique_ptr<Transport>)>;
  explicit TwoRanks(const std::string& tag, int timeout_ms = 20000,
                    const std::string& backend = "cuda_ipc", Wrap wrap = nullptr)
      : TwoEpRanks(std::string(FLEXPERT_TESTDATA_DIR) + "/qwen3moe-tiny", model_options(),
                   {"cuda-ep-" + tag, kSlotsPerRank, EpMoeExecutor::max_exchange_bytes(2048, 8, 64),
                    timeout_ms, backend, std::move(wrap)}) {}

  static ModelOptions model_options() {
    ModelOptions options;
    options.device = "cuda";
    options.device_dtype = DType::kF32;
    options.max_sequences = 8;
    return options;
  }
};

// Both ranks generate the reference continuations (same prompts, so the same steps);
// returns each rank's tokens and slot counts, and the collectives its transport ran.
struct TwoRankRun {
  std::vector<std::vector<int32_t>> tokens[TwoRanks::kRanks];
  std::vector<std::vector<int64_t>> counts[TwoRanks::kRanks];
  int64_t collectives = 0;
};
TwoRankRun run_two_ranks(const std::string& tag, const std::string& backend = "cuda_ipc") {
  TwoRankRun run;
  TwoRanks g(tag, 20000, backend);
  if (!g.ready) return run;
  const auto ref = load_reference(std::string(FLEXPERT_TESTDATA_DIR) + "/qwen3moe-tiny");
  std::thread peer([&] { run.tokens[1] = greedy(*g.models[1], ref); });
  run.tokens[0] = greedy(*g.models[0], ref);
  peer.join();
  for (int r = 0; r < TwoRanks::kRanks; ++r) {
    run.counts[r] = g.models[r]->slot_counts();
    run.collectives += g.transports[r]->num_collectives();
  }
  return run;
}

// Both ranks run `batch` (one row each, greedy) as one step, rank 1 on a thread of its own;
// each rank's status, its tokens in out[rank].
std::array<Status, TwoRanks::kRanks> step_both(TwoRanks& g, const std::vector<SequenceChunk>& batch,
                                               std::vector<int32_t> out[TwoRanks::kRanks]) {
  const std::vector<RowOutput> rows(batch.size());
  std::array<Status, TwoRanks::kRanks> st;
  std::thread peer([&] {
    Tensor logits;
    st[1] = g.models[1]->forward_step(batch, rows, &logits, &out[1]);
  });
  Tensor logits;
  st[0] = g.models[0]->forward_step(batch, rows, &logits, &out[0]);
  peer.join();
  return st;
}

TEST(CudaEpTest, DeviceExchangeBetweenTwoRanksMatchesReferenceAndHostExchange) {
  FLEX_SKIP_WITHOUT_GPU();
  unsetenv("FLEXPERT_EP_EXCHANGE");
  const TwoRankRun device = run_two_ranks("dev");
  setenv("FLEXPERT_EP_EXCHANGE", "host", 1);
  const TwoRankRun host = run_two_ranks("host");
  unsetenv("FLEXPERT_EP_EXCHANGE");
  const auto ref = load_reference(std::string(FLEXPERT_TESTDATA_DIR) + "/qwen3moe-tiny");
  for (int r = 0; r < TwoRanks::kRanks; ++r) {
    ASSERT_EQ(device.tokens[r].size(), ref.size()) << "rank " << r;
    for (size_t i = 0; i < ref.size(); ++i) {
      EXPECT_EQ(device.tokens[r][i], ref[i].greedy) << "rank " << r << " prompt " << i;
    }
    EXPECT_EQ(host.tokens[r], device.tokens[r]) << "rank " << r;
    // The same rows reached the same slots, counted on the device or by the executor.
    EXPECT_EQ(device.counts[r], host.counts[r]) << "rank " << r;
  }
  int64_t rows = 0;
  for (const auto& layer : device.counts[0]) {
    for (int s = 0; s < TwoRanks::kSlotsPerRank; ++s) rows += layer[s];
  }
  EXPECT_GT(rows, 0) << "rank 0 computed no rows";
  EXPECT_EQ(device.collectives, 0) << "the device exchange used the host transport";
  EXPECT_GT(host.collectives, 0);
}

// A transport without mapped peer buffers (shm) leaves the device exchange off: the steps
// take the host exchange, with the reference's tokens.
TEST(CudaEpTest, ATransportWithoutMappedPeerBuffersServesWithTheHostExchange) {
  FLEX_SKIP_WITHOUT_GPU();
  unsetenv("FLEXPERT_EP_EXCHANGE");
  const TwoRankRun run = run_two_ranks("shm", "shm");
  const auto ref = load_reference(std::string(FLEXPERT_TESTDATA_DIR) + "/qwen3moe-tiny");
  for (int r = 0; r < TwoRanks::kRanks; ++r) {
    ASSERT_EQ(run.tokens[r].size(), ref.size()) << "rank " << r;
    for (size_t i = 0; i < ref.size(); ++i) {
      EXPECT_EQ(run.tokens[r][i], ref[i].greedy) << "rank " << r << " prompt " << i;
    }
  }
  EXPECT_GT(run.collectives, 0) << "no host exchange ran";
}

// A new epoch as a worker drives it (EpMoeExecutor::device_ready in the step headers,
// the group's answer by set_group_device_ready): the probe maps one peer a call (here the
// one peer, a rank of this process) and then says yes; a step of a group not ready takes
// the host exchange, then the device exchange runs (no host collective) with the tokens
// the host exchange gave for the same prompt; a later epoch of the same members needs
// no mapping.
TEST(CudaEpTest, ANewEpochServesWithTheHostExchangeUntilItsPeersAreMapped) {
  FLEX_SKIP_WITHOUT_GPU();
  unsetenv("FLEXPERT_EP_EXCHANGE");
  TwoRanks g("probe");
  ASSERT_TRUE(g.ready);
  auto step = [&](int kv_slot, std::vector<int32_t> out[TwoRanks::kRanks]) {
    const auto st = step_both(g, {{kv_slot, 0, {3, 1, 4, 1, 5}}}, out);
    EXPECT_TRUE(st[0].ok()) << st[0].to_string();
    EXPECT_TRUE(st[1].ok()) << st[1].to_string();
  };
  auto collectives = [&] {
    return g.transports[0]->num_collectives() + g.transports[1]->num_collectives();
  };
  for (auto& e : g.executors) e->set_group_device_ready(false);
  std::vector<int32_t> host[TwoRanks::kRanks], device[TwoRanks::kRanks];
  const int64_t c0 = collectives();
  step(0, host);
  EXPECT_GT(collectives(), c0) << "a group not ready ran the device exchange";

  for (auto& e : g.executors) ASSERT_TRUE(e->device_ready()) << "one peer, mapped in one call";
  for (auto& e : g.executors) e->set_group_device_ready(true);
  const int64_t c1 = collectives();
  step(1, device);
  EXPECT_EQ(collectives(), c1) << "the device exchange used the host transport";
  for (int r = 0; r < TwoRanks::kRanks; ++r) {
    ASSERT_EQ(device[r].size(), 1u);
    EXPECT_EQ(device[r], host[r]) << "rank " << r;
  }
  // A later epoch with the same members is ready at once (nothing new to map).
  for (auto& e : g.executors) e->set_group(Group{2, {0, 1}});
  EXPECT_TRUE(g.executors[0]->device_ready());
}

// Model::copy_slot: a peer's slot and one of this rank's own, device to device; the host
// mirror of the destination is refreshed from the device, so it equals the source.
TEST(CudaEpTest, CopySlotMovesWeightsBetweenDevices) {
  FLEX_SKIP_WITHOUT_GPU();
  unsetenv("FLEXPERT_EP_EXCHANGE");
  TwoRanks g("copy");
  ASSERT_TRUE(g.ready);
  Model& m = *g.models[0];
  const int layer = 1;
  ExpertSlots* mine = m.local_slots(layer);
  ExpertSlots* theirs = g.models[1]->local_slots(layer);
  ASSERT_TRUE(mine != nullptr && theirs != nullptr);
  const size_t bytes = mine->slot_bytes();
  ASSERT_NE(std::memcmp(mine->slot_data(5), theirs->slot_data(3), bytes), 0);
  Status s = m.copy_slot(layer, 5, /*src_rank=*/1, 3);
  ASSERT_TRUE(s.ok()) << s.to_string();
  EXPECT_EQ(std::memcmp(mine->slot_data(5), theirs->slot_data(3), bytes), 0);
  s = m.copy_slot(layer, 6, /*src_rank=*/0, 2);
  ASSERT_TRUE(s.ok()) << s.to_string();
  EXPECT_EQ(std::memcmp(mine->slot_data(6), mine->slot_data(2), bytes), 0);
  EXPECT_EQ(m.copy_slot(layer, 8, 1, 3).code(), StatusCode::kInvalidArgument);
  EXPECT_EQ(m.copy_slot(layer, 5, 7, 3).code(), StatusCode::kInvalidArgument);
}

// Slots as a rank on another host has them (docs/ARCHITECTURE.md, "GPU ranks on different
// hosts"): never mapped (map_peer_buffer of a slot buffer answers Unimplemented, as hier does),
// read by the transport into device memory (device_buffer_reads, as a CUDA-aware UCX). A slot
// read waits at a gate the test opens; the gate opens itself after a minute, so that a read
// holding up the test fails it instead of hanging it.
class RemoteSlotsTransport final : public ForwardingTransport {
 public:
  struct Gate {
    std::mutex mu;
    std::condition_variable cv;
    bool open = false, opened_by_timeout = false;
    int readers = 0;  // Reads that reached the gate.
    bool wait_for_reader() {
      std::unique_lock<std::mutex> lock(mu);
      return cv.wait_for(lock, std::chrono::minutes(1), [&] { return readers > 0; });
    }
    void release() {
      std::lock_guard<std::mutex> lock(mu);
      open = true;
      cv.notify_all();
    }
  };
  RemoteSlotsTransport(std::unique_ptr<Transport> inner, std::shared_ptr<Gate> gate)
      : ForwardingTransport(std::move(inner)), gate_(std::move(gate)) {}

  TransportCapabilities capabilities() const override {
    TransportCapabilities c = inner().capabilities();
    c.device_buffer_reads = true;
    return c;
  }
  Result<PeerBuffer> map_peer_buffer(int peer, int buffer_id, MapMode mode) override {
    if (peer != rank() && buffer_id >= cuda::ep_moe_detail::kSlotsBuffer) {
      return unimplemented("slots of rank " + std::to_string(peer) + ": another host's");
    }
    return inner().map_peer_buffer(peer, buffer_id, mode);
  }
  Status read(int peer, int region_id, size_t offset, void* dst, size_t num_bytes) override {
    if (region_id < cuda::ep_moe_detail::kSlotsBuffer) {
      return inner().read(peer, region_id, offset, dst, num_bytes);
    }
    {
      std::unique_lock<std::mutex> lock(gate_->mu);
      ++gate_->readers;
      gate_->cv.notify_all();
      if (!gate_->cv.wait_for(lock, std::chrono::minutes(1), [&] { return gate_->open; })) {
        gate_->opened_by_timeout = true;
      }
    }
    FLEX_ASSIGN_OR_RETURN(PeerBuffer slots,
                          inner().map_peer_buffer(peer, region_id, MapMode::kMap));
    if (offset + num_bytes > slots.num_bytes) return invalid_argument("read past the slots");
    const cudaError_t err = cudaMemcpy(dst, static_cast<const uint8_t*>(slots.data) + offset,
                                       num_bytes, cudaMemcpyDefault);
    if (err != cudaSuccess) return internal_error(cudaGetErrorString(err));
    return Status();
  }

 private:
  std::shared_ptr<Gate> gate_;  // Shared with the test, which opens it.
};

// A slot read over the transport (the weight mover's thread) holds no lock that an epoch
// change needs: both ranks step in a new epoch (the device exchange, so map_peers runs) while
// the read waits, and the copy that the epoch change overtook fails Aborted. Read again in
// the same epoch it lands, and the host mirror equals the source.
TEST(CudaEpTest, ASlotReadOverTheTransportHoldsNoEpochChangeBack) {
  FLEX_SKIP_WITHOUT_GPU();
  unsetenv("FLEXPERT_EP_EXCHANGE");
  auto gate = std::make_shared<RemoteSlotsTransport::Gate>();
  TwoRanks g("remote", 20000, "cuda_ipc",
             [gate](std::unique_ptr<Transport> t) -> std::unique_ptr<Transport> {
               return std::make_unique<RemoteSlotsTransport>(std::move(t), gate);
             });
  ASSERT_TRUE(g.ready);
  const int layer = 1;
  ExpertSlots* mine = g.models[0]->local_slots(layer);
  ExpertSlots* theirs = g.models[1]->local_slots(layer);
  ASSERT_TRUE(mine != nullptr && theirs != nullptr);
  const size_t bytes = mine->slot_bytes();
  ASSERT_NE(std::memcmp(mine->slot_data(5), theirs->slot_data(3), bytes), 0);

  Status copied;
  std::thread mover([&] { copied = g.models[0]->copy_slot(layer, 5, /*src_rank=*/1, 3); });
  if (!gate->wait_for_reader()) {
    mover.join();
    FAIL() << "the copy read no slot over the transport: " << copied.to_string();
  }
  for (auto& e : g.executors) e->set_group(Group{2, {0, 1}});
  std::vector<int32_t> tokens[TwoRanks::kRanks];
  const auto stepped = step_both(g, {{0, 0, {1, 2, 3, 4}}}, tokens);
  const int64_t collectives = g.transports[0]->num_collectives();
  gate->release();
  mover.join();
  EXPECT_FALSE(gate->opened_by_timeout) << "the epoch's steps waited for the slot read";
  EXPECT_TRUE(stepped[0].ok()) << stepped[0].to_string();
  EXPECT_TRUE(stepped[1].ok()) << stepped[1].to_string();
  EXPECT_EQ(collectives, 0) << "the steps took the host exchange: no map_peers ran";
  EXPECT_EQ(copied.code(), StatusCode::kAborted) << copied.to_string();

  const Status again = g.models[0]->copy_slot(layer, 5, /*src_rank=*/1, 3);
  ASSERT_TRUE(again.ok()) << again.to_string();
  EXPECT_EQ(std::memcmp(mine->slot_data(5), theirs->slot_data(3), bytes), 0);
}

// One rank steps while its peer stays silent, then while its peer has shut down: the step
// fails (DeadlineExceeded after the transport's timeout; Unavailable at once), never hangs,
// and the model steps again once the peer is back.
TEST(CudaEpTest, DeviceExchangeWithASilentOrDepartedPeerFailsTheStep) {
  FLEX_SKIP_WITHOUT_GPU();
  unsetenv("FLEXPERT_EP_EXCHANGE");
  TwoRanks g("silent", /*timeout_ms=*/1500);
  ASSERT_TRUE(g.ready);
  const std::vector<SequenceChunk> batch = {{0, 0, {1, 2, 3, 4}}};
  const std::vector<RowOutput> rows(1);
  Tensor logits;
  std::vector<int32_t> tokens;
  auto t0 = std::chrono::steady_clock::now();
  Status s = g.models[0]->forward_step(batch, rows, &logits, &tokens);
  double ms =
      std::chrono::duration<double, std::milli>(std::chrono::steady_clock::now() - t0).count();
  EXPECT_EQ(s.code(), StatusCode::kDeadlineExceeded) << s.to_string();
  EXPECT_NE(s.message().find("rank(s) 1"), std::string::npos) << s.to_string();
  EXPECT_GE(ms, 1400);
  EXPECT_LT(ms, 6000);

  // Both ranks step together in a new epoch: the failure left nothing behind.
  for (auto& e : g.executors) e->set_group(Group{2, {0, 1}});
  std::vector<int32_t> both[TwoRanks::kRanks];
  const auto stepped = step_both(g, batch, both);
  EXPECT_TRUE(stepped[0].ok()) << stepped[0].to_string();
  EXPECT_TRUE(stepped[1].ok()) << stepped[1].to_string();
  EXPECT_EQ(both[0], both[1]);

  // The peer shuts down: seen by peer_status within a millisecond or so, not the timeout.
  ASSERT_TRUE(g.transports[1]->shutdown().ok());
  for (auto& e : g.executors) e->set_group(Group{3, {0, 1}});
  t0 = std::chrono::steady_clock::now();
  s = g.models[0]->forward_step({{1, 0, {5, 6}}}, rows, &logits, &tokens);
  ms = std::chrono::duration<double, std::milli>(std::chrono::steady_clock::now() - t0).count();
  EXPECT_EQ(s.code(), StatusCode::kUnavailable) << s.to_string();
  EXPECT_NE(s.message().find("rank 1"), std::string::npos) << s.to_string();
  EXPECT_LT(ms, 1000);
}

// The exchange kernels alone, two ranks of this process sharing plain device pointers
// (each on its own stream; every host write goes on the rank's stream). Rank 1 routes a
// pair to a rank outside the group (its own error) and, its step failed, runs ahead into
// the next exchange, giving that up too; rank 0, waiting for the first, fails at once
// naming rank 1 instead of at the timeout. A wait that finds only that earlier given-up
// value keeps waiting, and passes when rank 1 publishes normally. Then done: a rank whose
// exchange failed signals done given up, and its sources fail at once. Last, a silent
// peer: the host's ep_release ends the wait on it, and ep_unrelease makes sure no later
// wait passes on the released flag.
TEST(CudaEpTest, AnExchangeGivenUpFailsItsPeersAtOnce) {
  FLEX_SKIP_WITHOUT_GPU();
  constexpr int kRanks = 2, kPairs = 4, kSlotsPerRank = 4, kHidden = 8;
  const size_t window_bytes = sizeof(cuda::EpWindow) + kPairs * sizeof(int32_t);
  struct Rank {
    cuda::DeviceBuffer window, h, slot, y, row_of_pair, status;
    cuda::Stream stream;
  };
  Rank ranks[kRanks];
  std::vector<cuda::EpPeer> peers(cuda::kEpMaxRanks);
  for (int r = 0; r < kRanks; ++r) {
    Rank& k = ranks[r];
    k.window = std::move(cuda::DeviceBuffer::create_zeroed(window_bytes)).value();
    k.h = std::move(cuda::DeviceBuffer::create_zeroed(kPairs * kHidden * 4)).value();
    k.slot = std::move(cuda::DeviceBuffer::create_zeroed(kPairs * 4)).value();
    k.y = std::move(cuda::DeviceBuffer::create_zeroed(kRanks * kPairs * kHidden * 4)).value();
    k.row_of_pair = std::move(cuda::DeviceBuffer::create_zeroed(kRanks * kPairs * 4)).value();
    k.status = std::move(cuda::DeviceBuffer::create_zeroed(sizeof(cuda::EpStatus))).value();
    k.stream = std::move(cuda::Stream::create()).value();
    peers[r].window = k.window.as<cuda::EpWindow>();
    peers[r].pos = reinterpret_cast<const int32_t*>(k.window.as<char>() + sizeof(cuda::EpWindow));
    peers[r].h = k.h.data();
    peers[r].slot = k.slot.as<int32_t>();
    peers[r].y = k.y.data();
    peers[r].row_of_pair = k.row_of_pair.as<int32_t>();
  }
  auto peers_d = cuda_test::to_device_raw(peers);
  ASSERT_EQ(cudaDeviceSynchronize(), cudaSuccess);  // The zeroing and copies above landed.
  auto abort_word = std::move(cuda::PinnedBuffer::create(sizeof(int32_t))).value();
  auto progress = std::move(cuda::PinnedBuffer::create(2 * sizeof(uint64_t))).value();
  *abort_word.as<int32_t>() = 0;
  auto args = [&](int r, uint64_t value) {
    cuda::EpArgs a;
    a.peers = peers_d.as<cuda::EpPeer>();
    a.window = ranks[r].window.as<cuda::EpWindow>();
    a.me = r;
    a.members = 0b11;
    a.slots_per_rank = kSlotsPerRank;
    a.top_k = 1;
    a.hidden = kHidden;
    a.dtype = DType::kF32;
    a.value = value;
    a.status = ranks[r].status.as<cuda::EpStatus>();
    a.abort = abort_word.as<int32_t>();
    a.progress = progress.as<uint64_t>() + r;
    a.timeout_ns = 5'000'000'000;  // The failure must come long before this.
    return a;
  };
  auto set_slots = [&](int r, std::vector<int32_t> slots) {
    ASSERT_EQ(cudaMemcpyAsync(ranks[r].slot.data(), slots.data(), kPairs * 4,
                              cudaMemcpyHostToDevice, ranks[r].stream.get()),
              cudaSuccess);
    ASSERT_EQ(cudaStreamSynchronize(ranks[r].stream.get()), cudaSuccess);
  };
  auto set_failed = [&](int r) {
    static const int32_t one = 1;
    ASSERT_EQ(cudaMemcpyAsync(&ranks[r].status.as<cuda::EpStatus>()->failed, &one, sizeof(one),
                              cudaMemcpyHostToDevice, ranks[r].stream.get()),
              cudaSuccess);
    ASSERT_EQ(cudaStreamSynchronize(ranks[r].stream.get()), cudaSuccess);
  };
  // The rank's status after its stream drained; then cleared for the next exchange.
  auto status_of = [&](int r) {
    cuda::EpStatus st{};
    EXPECT_EQ(cudaMemcpyAsync(&st, ranks[r].status.data(), sizeof(st), cudaMemcpyDeviceToHost,
                              ranks[r].stream.get()),
              cudaSuccess);
    EXPECT_EQ(cudaMemsetAsync(ranks[r].status.data(), 0, sizeof(st), ranks[r].stream.get()),
              cudaSuccess);
    EXPECT_EQ(cudaStreamSynchronize(ranks[r].stream.get()), cudaSuccess);
    return st;
  };
  auto publish = [&](int r, uint64_t value) {
    const cuda::EpArgs a = args(r, value);
    int32_t* pos = reinterpret_cast<int32_t*>(ranks[r].window.as<char>() + sizeof(cuda::EpWindow));
    ASSERT_EQ(cuda::ep_publish(a, kPairs, pos, ranks[r].stream.get()), cudaSuccess);
  };
  auto since = [](std::chrono::steady_clock::time_point t0) {
    return std::chrono::duration<double, std::milli>(std::chrono::steady_clock::now() - t0).count();
  };
  const uint64_t v = (uint64_t{7} << 40) | 1;
  set_slots(0, {0, 1, 4, 5});
  set_slots(1, {2, 6, 4 * kSlotsPerRank + 1, 3});  // Slot 17: rank 4's, not a member.

  // Ready given up, and rank 1 already past it (the next exchange given up too).
  publish(1, v);
  publish(1, v + 1);
  cuda::EpStatus st1 = status_of(1);
  EXPECT_EQ(st1.failed, 1);
  EXPECT_EQ(st1.overflow, -1);
  auto t0 = std::chrono::steady_clock::now();
  publish(0, v);
  ASSERT_EQ(cuda::ep_wait(args(0, v), 0, ranks[0].stream.get()), cudaSuccess);
  cuda::EpStatus st0 = status_of(0);
  EXPECT_EQ(st0.failed, 1);
  EXPECT_EQ(st0.aborted, uint64_t{1} << 1);
  EXPECT_EQ(st0.missing, 0u);
  EXPECT_LT(since(t0), 1000);

  // The exchange after those: rank 0 waits while rank 1's flag still holds the given-up
  // v + 1, then rank 1 publishes sound pairs and both waits pass.
  set_slots(1, {2, 6, 1, 3});
  publish(0, v + 2);
  ASSERT_EQ(cuda::ep_wait(args(0, v + 2), 0, ranks[0].stream.get()), cudaSuccess);
  std::this_thread::sleep_for(std::chrono::milliseconds(100));
  EXPECT_EQ(cudaStreamQuery(ranks[0].stream.get()), cudaErrorNotReady)
      << "a wait passed on an earlier exchange's given-up flag";
  publish(1, v + 2);
  ASSERT_EQ(cuda::ep_wait(args(1, v + 2), 0, ranks[1].stream.get()), cudaSuccess);
  for (int r : {0, 1}) {
    const cuda::EpStatus st = status_of(r);
    EXPECT_EQ(st.failed, 0) << "rank " << r;
    EXPECT_EQ(st.aborted, 0u) << "rank " << r;
  }

  // Done given up: rank 1's exchange fails after publishing (set here as a failed gather
  // would), it signals done given up; rank 0 waiting for done fails at once.
  for (int r : {1, 0}) publish(r, v + 3);
  set_failed(1);
  ASSERT_EQ(cuda::ep_signal_done(args(1, v + 3), ranks[1].stream.get()), cudaSuccess);
  (void)status_of(1);
  t0 = std::chrono::steady_clock::now();
  ASSERT_EQ(cuda::ep_wait(args(0, v + 3), 0, ranks[0].stream.get()), cudaSuccess);
  ASSERT_EQ(cuda::ep_signal_done(args(0, v + 3), ranks[0].stream.get()), cudaSuccess);
  ASSERT_EQ(cuda::ep_wait(args(0, v + 3), 1, ranks[0].stream.get()), cudaSuccess);
  st0 = status_of(0);
  EXPECT_EQ(st0.failed, 1);
  EXPECT_EQ(st0.aborted, uint64_t{1} << 1);
  EXPECT_LT(since(t0), 1000);

  // A silent peer: rank 1 never publishes v + 4. Where the waits are memory operations,
  // ep_release from another stream ends rank 0's wait: failed, rank 1 missing. After
  // ep_unrelease a wait for a later value holds again until rank 1 publishes it. A release
  // over a flag that had passed keeps its value: that wait passes, nobody is missing.
  if (!cuda::ep_stream_waits()) GTEST_SKIP() << "no 64-bit stream memory operations";
  cuda::EpWindow* window0 = ranks[0].window.as<cuda::EpWindow>();
  auto side = std::move(cuda::Stream::create()).value();
  publish(0, v + 4);
  ASSERT_EQ(cuda::ep_wait(args(0, v + 4), 0, ranks[0].stream.get()), cudaSuccess);
  std::this_thread::sleep_for(std::chrono::milliseconds(100));
  EXPECT_EQ(cudaStreamQuery(ranks[0].stream.get()), cudaErrorNotReady) << "passed a silent peer";
  ASSERT_EQ(cuda::ep_release(window0, 0b10, side.get()), cudaSuccess);
  st0 = status_of(0);
  EXPECT_EQ(st0.failed, 1);
  EXPECT_EQ(st0.missing, uint64_t{1} << 1);
  EXPECT_EQ(st0.aborted, 0u);
  ASSERT_TRUE(side.synchronize().ok());
  ASSERT_EQ(cuda::ep_unrelease(window0, ranks[0].stream.get()), cudaSuccess);
  (void)status_of(0);

  publish(0, v + 5);
  ASSERT_EQ(cuda::ep_wait(args(0, v + 5), 0, ranks[0].stream.get()), cudaSuccess);
  std::this_thread::sleep_for(std::chrono::milliseconds(100));
  EXPECT_EQ(cudaStreamQuery(ranks[0].stream.get()), cudaErrorNotReady)
      << "a later wait passed on a released flag";
  set_slots(1, {2, 6, 1, 3});
  publish(1, v + 5);
  st0 = status_of(0);
  EXPECT_EQ(st0.failed, 0);
  EXPECT_EQ(st0.missing, 0u);

  publish(1, v + 6);
  (void)status_of(1);
  ASSERT_EQ(cuda::ep_release(window0, 0b10, side.get()), cudaSuccess);
  ASSERT_TRUE(side.synchronize().ok());
  publish(0, v + 6);
  ASSERT_EQ(cuda::ep_wait(args(0, v + 6), 0, ranks[0].stream.get()), cudaSuccess);
  st0 = status_of(0);
  EXPECT_EQ(st0.failed, 0) << "a released flag that had passed failed the wait";
  EXPECT_EQ(st0.missing, 0u);
  ASSERT_EQ(cuda::ep_unrelease(window0, ranks[0].stream.get()), cudaSuccess);
  (void)status_of(0);
  uint64_t flag = 0;
  ASSERT_EQ(cudaMemcpy(&flag, &window0->ready[1], sizeof(flag), cudaMemcpyDeviceToHost),
            cudaSuccess);
  EXPECT_EQ(flag, v + 6) << "the release did not keep the peer's value";
}

}  // namespace
}  // namespace flexpert
