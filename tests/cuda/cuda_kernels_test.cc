// SPDX-License-Identifier: Apache-2.0
// The CUDA MoE block and attention against the CPU kernels, on random data:
// every GEMM tile, f32 and bf16, several token counts, replicated slots.
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <limits>
#include <random>
#include <string>
#include <tuple>
#include <type_traits>
#include <vector>

#include "cuda/blas.h"
#include "cuda/decode_moe.h"
#include "cuda/device.h"
#include "cuda/grouped_moe.h"
#include "cuda/head_gemm.h"
#include "cuda/kernels.h"
#include "cuda/mla_kernels.h"
#include "cuda/moe_layer.h"
#include "cuda_test_util.h"
#include "flexpert/placement.h"
#include "kernels/cpu_ops.h"
#include "moe/expert_slots.h"
#include "moe/moe_layer.h"

namespace flexpert {
namespace {

using namespace cuda_test;

struct MoeCase {
  DType dtype;
  cuda::GemmTile tile;
  int tokens;
};

std::string case_name(const MoeCase& c) {
  return std::string(dtype_name(c.dtype)) + " " + cuda::tile_name(c.tile) + " tokens " +
         std::to_string(c.tokens);
}

class CudaMoeTest : public ::testing::TestWithParam<MoeCase> {};

TEST_P(CudaMoeTest, MatchesCpuMoeBlock) {
  FLEX_SKIP_WITHOUT_GPU();
  const MoeCase c = GetParam();
  const bool bf = c.dtype == DType::kBF16;
  const int H = 256, I = 128, E = 16, K = 4, T = c.tokens;
  // Every expert once, then 8 replicas: hot experts 0, 3 and 7 get several.
  std::vector<int> map;
  for (int e = 0; e < E; ++e) map.push_back(e);
  for (int e : {3, 7, 0, 3, 11, 7, 3, 15}) map.push_back(e);
  const int S = static_cast<int>(map.size());
  auto placement = ExpertPlacement::from_slot_maps(E, {map});
  ASSERT_TRUE(placement.ok());
  std::vector<std::vector<int>> replicas;
  for (int e = 0; e < E; ++e) replicas.push_back(placement.value().replicas(0, e));

  std::mt19937 rng(1234 + T);
  auto maybe_round = [&](std::vector<float> v) { return bf ? round_bf16(std::move(v)) : v; };
  const std::vector<float> x = maybe_round(uniform(static_cast<size_t>(T) * H, 1.f, rng));
  const std::vector<float> router = maybe_round(uniform(static_cast<size_t>(E) * H, 0.2f, rng));
  std::vector<std::vector<float>> gate(E), up(E), down(E);
  for (int e = 0; e < E; ++e) {
    gate[e] = maybe_round(uniform(static_cast<size_t>(I) * H, 1.f / std::sqrt(H), rng));
    up[e] = maybe_round(uniform(static_cast<size_t>(I) * H, 1.f / std::sqrt(H), rng));
    down[e] = maybe_round(uniform(static_cast<size_t>(H) * I, 1.f / std::sqrt(I), rng));
  }

  // CPU reference in f32 on the same (rounded) values.
  ExpertSlots cpu_slots(DType::kF32, S, H, I);
  for (int s = 0; s < S; ++s) {
    const int e = map[s];
    ASSERT_TRUE(cpu_slots
                    .load(s, Tensor::borrow(gate[e].data(), DType::kF32, {I, H}),
                          Tensor::borrow(up[e].data(), DType::kF32, {I, H}),
                          Tensor::borrow(down[e].data(), DType::kF32, {H, I}))
                    .ok());
  }
  const Tensor router_t = Tensor::borrow(router.data(), DType::kF32, {E, H});
  std::vector<float> want(static_cast<size_t>(T) * H);
  std::vector<int64_t> cpu_counts(S, 0);
  MoeWorkspace ws;
  moe_forward_local(x.data(), T, router_t, RouterParams{E, K, true}, replicas, cpu_slots,
                    want.data(), &ws, cpu_counts.data(), ThreadPool::global());

  // GPU.
  cuda::MoeDims dims;
  dims.dtype = c.dtype;
  dims.hidden = H;
  dims.intermediate = I;
  dims.num_experts = E;
  dims.top_k = K;
  dims.num_slots = S;
  dims.norm_topk_prob = true;
  const size_t slot_bytes = dims.slot_elems() * dtype_size(c.dtype);
  std::vector<uint8_t> image(S * slot_bytes);
  for (int s = 0; s < S; ++s) {
    cuda::pack_expert(gate[map[s]].data(), up[map[s]].data(), down[map[s]].data(), H, I, c.dtype,
                      image.data() + s * slot_bytes);
  }
  auto slots = to_device_raw(image);
  auto router_d = to_device(router, c.dtype);
  auto x_d = to_device(x, c.dtype);
  const cuda::RoutingTables tables = cuda::build_routing_tables(map, E);
  auto rep_start = to_device_raw(tables.rep_start);
  auto rep_count = to_device_raw(tables.rep_count);
  auto rep_slots = to_device_raw(tables.rep_slots);
  auto stats = cuda::DeviceBuffer::create_zeroed(S * sizeof(int64_t));
  ASSERT_TRUE(stats.ok());
  auto out = to_device(std::vector<float>(static_cast<size_t>(T) * H, NAN), DType::kF32);
  auto stream = cuda::Stream::create();
  ASSERT_TRUE(stream.ok());
  auto blas = cuda::Blas::create(stream.value().get());
  ASSERT_TRUE(blas.ok());
  auto scratch = cuda::MoeScratch::create(dims, T);
  ASSERT_TRUE(scratch.ok()) << scratch.status().to_string();
  if (!cuda::tile_supports(c.tile, c.dtype, 2 * I, H)) {
    GTEST_SKIP() << "tile " << cuda::tile_name(c.tile) << " not available in this build/device";
  }
  cuda::MoeLayerWeights w;
  w.router = router_d.data();
  w.slots = slots.data();
  w.rep_start = rep_start.as<int32_t>();
  w.rep_count = rep_count.as<int32_t>();
  w.rep_slots = rep_slots.as<int32_t>();
  w.slot_stats = stats.value().as<int64_t>();
  Status st = cuda::run_moe(dims, w, scratch.value(), x_d.data(), T, nullptr, out.as<float>(),
                            false, blas.value(), stream.value().get(), static_cast<int>(c.tile));
  ASSERT_TRUE(st.ok()) << st.to_string();
  ASSERT_TRUE(stream.value().synchronize().ok());
  const std::vector<float> got = to_host(out.data(), want.size(), DType::kF32);
  const double err = rel_l2(got, want);
  std::printf("  %s: relative L2 vs CPU = %.3g\n", case_name(c).c_str(), err);
  EXPECT_LT(err, bf ? 2e-2 : 1e-5) << case_name(c);

  std::vector<int32_t> experts, pair_slots;
  ASSERT_TRUE(
      cuda::read_routing(scratch.value(), T * K, stream.value().get(), &experts, &pair_slots).ok());
  int mismatches = 0;
  for (int p = 0; p < T * K; ++p) mismatches += experts[p] != ws.routing.expert[p];
  EXPECT_LE(mismatches, bf ? T * K / 50 : 0) << "routing differs from the CPU";
  std::vector<int64_t> gpu_counts(S);
  ASSERT_EQ(cudaMemcpy(gpu_counts.data(), stats.value().data(), S * sizeof(int64_t),
                       cudaMemcpyDeviceToHost),
            cudaSuccess);
  int64_t total = 0;
  for (int s = 0; s < S; ++s) total += gpu_counts[s];
  EXPECT_EQ(total, static_cast<int64_t>(T) * K);
  if (!bf) {
    EXPECT_EQ(gpu_counts, cpu_counts);
  }
}

std::vector<MoeCase> moe_cases() {
  std::vector<MoeCase> cases;
  for (int t : {1, 7, 64, 300, 1000}) {
    cases.push_back({DType::kF32, cuda::GemmTile::kSimt, t});
    cases.push_back({DType::kBF16, cuda::GemmTile::kSimt, t});
    cases.push_back({DType::kBF16, cuda::GemmTile::kMma16, t});
    cases.push_back({DType::kBF16, cuda::GemmTile::kMma64, t});
    cases.push_back({DType::kBF16, cuda::GemmTile::kMma128, t});
    cases.push_back({DType::kBF16, cuda::GemmTile::kMma16N32, t});
    cases.push_back({DType::kBF16, cuda::GemmTile::kWgmma64, t});
    cases.push_back({DType::kBF16, cuda::GemmTile::kWgmma128, t});
    cases.push_back({DType::kBF16, cuda::GemmTile::kMma16K128, t});
    cases.push_back({DType::kBF16, cuda::GemmTile::kGemv, t});
    cases.push_back({DType::kBF16, cuda::GemmTile::kWgmma128N256, t});
    cases.push_back({DType::kBF16, cuda::GemmTile::kWgmmaWs128, t});
    cases.push_back({DType::kBF16, cuda::GemmTile::kWgmmaWs64, t});
    cases.push_back({DType::kBF16, cuda::GemmTile::kWgmmaPp128, t});
    cases.push_back({DType::kBF16, cuda::GemmTile::kWgmmaWs128Pp, t});
  }
  // 12000 pairs: the many-block permutation (kernels.h).
  cases.push_back({DType::kF32, cuda::GemmTile::kSimt, 3000});
  cases.push_back({DType::kBF16, cuda::GemmTile::kWgmmaWs128, 3000});
  return cases;
}

INSTANTIATE_TEST_SUITE_P(AllTiles, CudaMoeTest, ::testing::ValuesIn(moe_cases()));

// The Hopper tiles at the shapes of a real model (Qwen3-30B-A3B: hidden 2048, inter
// 768, top-8; 32 experts to keep it small): every tile against kMma64 (mma.sync) on the
// same bf16 data, several rows per expert (the small-shape test above cannot reach
// K = 768 / 2048 or several column blocks).
TEST(CudaMoeTest, HopperTilesAgreeAtModelShapes) {
  FLEX_SKIP_WITHOUT_GPU();
  if (!cuda::wgmma_available()) GTEST_SKIP() << "no wgmma on this build/device";
  const int H = 2048, I = 768, E = 32, K = 8;
  std::mt19937 rng(99);
  cuda::MoeDims dims;
  dims.dtype = DType::kBF16;
  dims.hidden = H;
  dims.intermediate = I;
  dims.num_experts = E;
  dims.top_k = K;
  dims.num_slots = E;
  dims.norm_topk_prob = true;
  const size_t slot_bytes = dims.slot_elems() * 2;
  std::vector<uint8_t> image(E * slot_bytes);
  for (int e = 0; e < E; ++e) {
    const auto gate = uniform(static_cast<size_t>(I) * H, 1.f / std::sqrt(H), rng);
    const auto up = uniform(static_cast<size_t>(I) * H, 1.f / std::sqrt(H), rng);
    const auto down = uniform(static_cast<size_t>(H) * I, 1.f / std::sqrt(I), rng);
    cuda::pack_expert(gate.data(), up.data(), down.data(), H, I, DType::kBF16,
                      image.data() + e * slot_bytes);
  }
  std::vector<int> map(E);
  for (int e = 0; e < E; ++e) map[e] = e;
  const cuda::RoutingTables tables = cuda::build_routing_tables(map, E);
  auto slots = to_device_raw(image);
  auto router = to_device(uniform(static_cast<size_t>(E) * H, 0.05f, rng), DType::kBF16);
  auto rep_start = to_device_raw(tables.rep_start);
  auto rep_count = to_device_raw(tables.rep_count);
  auto rep_slots = to_device_raw(tables.rep_slots);
  auto stream = cuda::Stream::create();
  ASSERT_TRUE(stream.ok());
  auto blas = cuda::Blas::create(stream.value().get());
  ASSERT_TRUE(blas.ok());
  cuda::MoeLayerWeights w;
  w.router = router.data();
  w.slots = slots.data();
  w.rep_start = rep_start.as<int32_t>();
  w.rep_count = rep_count.as<int32_t>();
  w.rep_slots = rep_slots.as<int32_t>();
  for (int T : {64, 700}) {  // 16 and 175 rows per expert.
    auto x = to_device(uniform(static_cast<size_t>(T) * H, 1.f, rng), DType::kBF16);
    auto scratch = cuda::MoeScratch::create(dims, T);
    ASSERT_TRUE(scratch.ok());
    auto run = [&](cuda::GemmTile tile) {
      auto out = to_device(std::vector<float>(static_cast<size_t>(T) * H, NAN), DType::kF32);
      const Status st =
          cuda::run_moe(dims, w, scratch.value(), x.data(), T, nullptr, out.as<float>(), false,
                        blas.value(), stream.value().get(), static_cast<int>(tile));
      EXPECT_TRUE(st.ok()) << st.to_string();
      EXPECT_TRUE(stream.value().synchronize().ok());
      return to_host(out.data(), static_cast<size_t>(T) * H, DType::kF32);
    };
    const std::vector<float> want = run(cuda::GemmTile::kMma64);
    for (cuda::GemmTile tile : {cuda::GemmTile::kWgmma64, cuda::GemmTile::kWgmma128N256,
                                cuda::GemmTile::kWgmmaWs64, cuda::GemmTile::kWgmmaWs128,
                                cuda::GemmTile::kWgmmaPp128, cuda::GemmTile::kWgmmaWs128Pp}) {
      const double err = rel_l2(run(tile), want);
      std::printf("  %d tokens, %s vs mma64: relative L2 %.3g\n", T, cuda::tile_name(tile), err);
      EXPECT_LT(err, 5e-3) << cuda::tile_name(tile) << " at " << T << " tokens";
    }
  }
}

// choose_tile by expected rows per expert at the shapes of Qwen3-30B-A3B and DeepSeek-V3:
// the GEMV tile up to a quarter row per expert, ws64 up to 48 rows, ws128 for both
// projections above (since its TMA epilogue it beats the ping-pong down projection)
// where the build and the device run wgmma, 128-row mma.sync tiles above 48 elsewhere;
// f32 always the simt tile.
TEST(CudaGemmTileTest, ChoosesByRowsPerExpert) {
  struct Shape {
    int hidden, inter, experts, top_k;
  };
  for (const Shape& s : {Shape{2048, 768, 128, 8}, Shape{7168, 2048, 256, 8}}) {
    auto pick = [&](int tokens, DType dtype = DType::kBF16) {
      return cuda::choose_tile(dtype, static_cast<int64_t>(tokens) * s.top_k, s.experts, s.hidden,
                               s.inter);
    };
    const int rows48 = s.experts * 48 / s.top_k, rows64 = s.experts * 64 / s.top_k;
    EXPECT_EQ(pick(4096, DType::kF32), cuda::GemmTile::kSimt);
    EXPECT_EQ(pick(1), cuda::GemmTile::kGemv);
    if (cuda::wgmma_available()) {
      EXPECT_EQ(pick(16), cuda::GemmTile::kWgmmaWs64);
      EXPECT_EQ(pick(rows48), cuda::GemmTile::kWgmmaWs64);
      EXPECT_EQ(pick(rows64), cuda::GemmTile::kWgmmaWs128);
      EXPECT_EQ(pick(16384), cuda::GemmTile::kWgmmaWs128);
    } else {
      EXPECT_LE(cuda::tile_rows(pick(rows48)), 64);
      EXPECT_EQ(cuda::tile_rows(pick(rows64)), 128);
      EXPECT_EQ(cuda::tile_rows(pick(16384)), 128);
    }
  }
}

// The many-block permutation against the one-block one and a host reference: same
// offsets, tile table (both equal to the host's) and statistics; rows of a slot in its range, each
// pair once.
TEST(CudaPermuteTest, ManyBlocksMatchOneBlock) {
  FLEX_SKIP_WITHOUT_GPU();
  const int S = 300, K = 8, T = 6250, P = T * K, valid_tokens = 6000, block_m = 64;
  ASSERT_GT(P, cuda::kPermuteMultiBlockPairs);
  std::mt19937 rng(7);
  std::vector<int32_t> slot(P);
  for (int32_t& s : slot) s = static_cast<int32_t>(rng() % 3 == 0 ? rng() % 20 : rng() % S);
  for (int32_t& s : slot) s = s % 7 == 5 ? 6 : s;  // Some slots stay empty.
  std::vector<int32_t> count(S, 0);
  std::vector<int64_t> want_stats(S, 0);
  for (int p = 0; p < P; ++p) {
    ++count[slot[p]];
    if (p < valid_tokens * K) ++want_stats[slot[p]];
  }
  std::vector<int32_t> want_offsets(S + 1, 0);
  for (int s = 0; s < S; ++s) want_offsets[s + 1] = want_offsets[s] + count[s];
  auto slot_d = to_device_raw(slot);
  auto valid_d = to_device_raw(std::vector<int32_t>{valid_tokens});
  auto stream = cuda::Stream::create();
  ASSERT_TRUE(stream.ok());
  struct Out {
    cuda::DeviceBuffer offsets, tile_slot, tile_row0, num_tiles, row_of_pair, pair_of_row, stats;
  };
  const int tiles = cuda::max_tiles(P, S, block_m);
  auto run = [&](bool many) {
    Out o{to_device_raw(std::vector<int32_t>(S + 1)), to_device_raw(std::vector<int32_t>(tiles)),
          to_device_raw(std::vector<int32_t>(tiles)), to_device_raw(std::vector<int32_t>(1)),
          to_device_raw(std::vector<int32_t>(P)),     to_device_raw(std::vector<int32_t>(P)),
          to_device_raw(std::vector<int64_t>(S))};
    auto counts = to_device_raw(std::vector<int32_t>(cuda::kPermuteCountInts * S, 12345));
    cuda::PermuteArgs a{slot_d.as<int32_t>(),
                        P,
                        K,
                        S,
                        block_m,
                        valid_d.as<int32_t>(),
                        o.offsets.as<int32_t>(),
                        o.tile_slot.as<int32_t>(),
                        o.tile_row0.as<int32_t>(),
                        o.num_tiles.as<int32_t>(),
                        o.row_of_pair.as<int32_t>(),
                        o.pair_of_row.as<int32_t>(),
                        o.stats.as<int64_t>(),
                        many ? counts.as<int32_t>() : nullptr};
    EXPECT_EQ(cuda::permute(a, stream.value().get()), cudaSuccess);
    EXPECT_TRUE(stream.value().synchronize().ok());
    return o;
  };
  const Out one = run(false), many = run(true);
  auto ints = [](const cuda::DeviceBuffer& b, size_t n) {
    std::vector<int32_t> v(n);
    EXPECT_EQ(cudaMemcpy(v.data(), b.data(), n * 4, cudaMemcpyDeviceToHost), cudaSuccess);
    return v;
  };
  std::vector<int64_t> stats(S);
  ASSERT_EQ(cudaMemcpy(stats.data(), many.stats.data(), S * 8, cudaMemcpyDeviceToHost),
            cudaSuccess);
  EXPECT_EQ(stats, want_stats);
  EXPECT_EQ(ints(many.offsets, S + 1), want_offsets);
  EXPECT_EQ(ints(one.offsets, S + 1), want_offsets);
  const int num_tiles = ints(many.num_tiles, 1)[0];
  EXPECT_EQ(num_tiles, ints(one.num_tiles, 1)[0]);
  ASSERT_LE(num_tiles, tiles);
  // The tile table from the host: slot by slot, block_m rows per tile.
  std::vector<int32_t> want_slot, want_row0;
  for (int s = 0; s < S; ++s) {
    for (int r0 = 0; r0 < count[s]; r0 += block_m) {
      want_slot.push_back(s);
      want_row0.push_back(want_offsets[s] + r0);
    }
  }
  ASSERT_EQ(num_tiles, static_cast<int>(want_slot.size()));
  EXPECT_EQ(ints(many.tile_slot, num_tiles), want_slot);
  EXPECT_EQ(ints(many.tile_row0, num_tiles), want_row0);
  EXPECT_EQ(ints(one.tile_slot, num_tiles), want_slot);
  EXPECT_EQ(ints(one.tile_row0, num_tiles), want_row0);
  const std::vector<int32_t> row_of_pair = ints(many.row_of_pair, P);
  const std::vector<int32_t> pair_of_row = ints(many.pair_of_row, P);
  int bad = 0;
  for (int p = 0; p < P; ++p) {
    const int r = row_of_pair[p];
    bad += r < want_offsets[slot[p]] || r >= want_offsets[slot[p] + 1] || pair_of_row[r] != p;
  }
  EXPECT_EQ(bad, 0) << "pairs outside their slot's rows or not inverse";
}

// The decode path (three kernels, decode_moe.h) against the unfused kGemv path on the
// same data: same experts, slots and slot statistics, outputs equal up to the router
// logits' rounding (cuBLAS there); then under a CUDA graph replayed twice, accumulating
// (the route kernel's ticket must be reset for each launch), with padding tokens.
// A layer for the decode-path tests: expert e's random gate/up/down (drawn from rng in
// expert order) packed into every slot `map` gives it, the router rows in bf16 and the
// routing tables, on the device.
struct DecodeTestLayer {
  cuda::DeviceBuffer slots, router, rep_start, rep_count, rep_slots;
  cuda::MoeLayerWeights weights(int64_t* stats) const {
    cuda::MoeLayerWeights w;
    w.router = router.data();
    w.slots = slots.data();
    w.rep_start = rep_start.as<int32_t>();
    w.rep_count = rep_count.as<int32_t>();
    w.rep_slots = rep_slots.as<int32_t>();
    w.slot_stats = stats;
    return w;
  }
};
DecodeTestLayer decode_test_layer(const cuda::MoeDims& dims, const std::vector<int>& map,
                                  const std::vector<float>& router, std::mt19937& rng) {
  const int H = dims.hidden, I = dims.intermediate, E = dims.num_experts;
  const size_t slot_bytes = dims.slot_elems() * 2;
  std::vector<uint8_t> image(map.size() * slot_bytes);
  std::vector<std::vector<float>> gate(E), up(E), down(E);
  for (int e = 0; e < E; ++e) {
    gate[e] = uniform(static_cast<size_t>(I) * H, 1.f / std::sqrt(H), rng);
    up[e] = uniform(static_cast<size_t>(I) * H, 1.f / std::sqrt(H), rng);
    down[e] = uniform(static_cast<size_t>(H) * I, 1.f / std::sqrt(I), rng);
  }
  for (size_t s = 0; s < map.size(); ++s) {
    cuda::pack_expert(gate[map[s]].data(), up[map[s]].data(), down[map[s]].data(), H, I,
                      DType::kBF16, image.data() + s * slot_bytes);
  }
  const cuda::RoutingTables tables = cuda::build_routing_tables(map, E);
  return {to_device_raw(image), to_device(router, DType::kBF16), to_device_raw(tables.rep_start),
          to_device_raw(tables.rep_count), to_device_raw(tables.rep_slots)};
}

// One decode-test MoE call, `call(weights, scratch, out)` (returning its Status), on fresh
// scratch, slot statistics and NaN-filled f32 outputs: the outputs, routing and statistics.
struct DecodeRun {
  std::vector<float> out;
  std::vector<int32_t> experts, slots;
  std::vector<int64_t> stats;
  std::vector<float> h;  // run_moe_norm's normalised rows.
};
template <typename Call>
DecodeRun decode_run(const cuda::MoeDims& dims, const DecodeTestLayer& layer, int tokens,
                     const cuda::Stream& stream, Call call) {
  DecodeRun r;
  const int S = dims.num_slots;
  auto stats = cuda::DeviceBuffer::create_zeroed(S * sizeof(int64_t));
  auto scratch = cuda::MoeScratch::create(dims, tokens);
  EXPECT_TRUE(stats.ok() && scratch.ok());
  const size_t n = static_cast<size_t>(tokens) * dims.hidden;
  auto out = to_device(std::vector<float>(n, NAN), DType::kF32);
  const Status st =
      call(layer.weights(stats.value().as<int64_t>()), scratch.value(), out.as<float>());
  EXPECT_TRUE(st.ok()) << st.to_string();
  EXPECT_TRUE(stream.synchronize().ok());
  r.out = to_host(out.data(), n, DType::kF32);
  EXPECT_TRUE(
      cuda::read_routing(scratch.value(), tokens * dims.top_k, stream.get(), &r.experts, &r.slots)
          .ok());
  r.stats.resize(S);
  EXPECT_EQ(
      cudaMemcpy(r.stats.data(), stats.value().data(), S * sizeof(int64_t), cudaMemcpyDeviceToHost),
      cudaSuccess);
  return r;
}

// The decode path against the unfused one: same experts, slots and statistics, outputs
// equal up to the router logits' rounding.
void expect_decode_matches(const DecodeRun& fused, const DecodeRun& unfused,
                           const std::string& label) {
  EXPECT_EQ(fused.experts, unfused.experts);
  EXPECT_EQ(fused.slots, unfused.slots);
  EXPECT_EQ(fused.stats, unfused.stats);
  const double err = rel_l2(fused.out, unfused.out);
  std::printf("  %s: relative L2 vs unfused path = %.3g\n", label.c_str(), err);
  EXPECT_LT(err, 1e-5);
}

struct DecodeCase {
  int tokens, top_k;
  int experts = 128;  // Up to 128: the route kernel's cluster; more: its ticket.
};

class CudaDecodeMoeTest : public ::testing::TestWithParam<DecodeCase> {};

TEST_P(CudaDecodeMoeTest, MatchesUnfusedPath) {
  FLEX_SKIP_WITHOUT_GPU();
  const DecodeCase c = GetParam();
  const int H = 320, I = 96, E = c.experts, K = c.top_k, T = c.tokens;
  std::vector<int> map;
  for (int e = 0; e < E; ++e) map.push_back(e);
  for (int e : {3, 7, 0, 3, 11, 7, 3, 15}) map.push_back(e);
  const int S = static_cast<int>(map.size());
  cuda::MoeDims dims;
  dims.dtype = DType::kBF16;
  dims.hidden = H;
  dims.intermediate = I;
  dims.num_experts = E;
  dims.top_k = K;
  dims.num_slots = S;
  dims.norm_topk_prob = true;
  ASSERT_TRUE(cuda::uses_decode_path(dims, T));

  std::mt19937 rng(77 + T * 10 + K);
  const std::vector<float> x = uniform(static_cast<size_t>(T) * H, 1.f, rng);
  const std::vector<float> router = uniform(static_cast<size_t>(E) * H, 0.2f, rng);
  const DecodeTestLayer layer = decode_test_layer(dims, map, router, rng);
  auto x_d = to_device(x, DType::kBF16);
  auto stream = cuda::Stream::create();
  ASSERT_TRUE(stream.ok());
  cudaStream_t s = stream.value().get();
  auto blas = cuda::Blas::create(s);
  ASSERT_TRUE(blas.ok());

  using Run = DecodeRun;
  // The layer's weights on the device, counting pairs into stats (may be null).
  auto layer_weights = [&](int64_t* stats) { return layer.weights(stats); };
  auto run = [&](int force_tile) {
    return decode_run(dims, layer, T, stream.value(),
                      [&](const cuda::MoeLayerWeights& w, cuda::MoeScratch& scratch, float* out) {
                        return cuda::run_moe(dims, w, scratch, x_d.data(), T, nullptr, out, false,
                                             blas.value(), s, force_tile);
                      });
  };
  const Run fused = run(-1);
  expect_decode_matches(
      fused, run(static_cast<int>(cuda::GemmTile::kGemv)),
      "decode T=" + std::to_string(T) + " K=" + std::to_string(K) + " E=" + std::to_string(E));
  // Up to 128 experts the route kernel ran as one cluster (its logits through rank 0's
  // shared memory), else with its ticket; both paths are compared above.
  if (std::getenv("FLEXPERT_NO_ROUTE_CLUSTER") == nullptr) {
    EXPECT_EQ(cuda::decode_route_cluster_blocks(E) > 0, E <= 128) << "E=" << E;
  }

  // A graph of two accumulating calls, replayed twice; tokens >= num_valid are padding.
  auto stats = cuda::DeviceBuffer::create_zeroed(S * sizeof(int64_t));
  auto scratch = cuda::MoeScratch::create(dims, T);
  ASSERT_TRUE(stats.ok() && scratch.ok());
  auto out = to_device(std::vector<float>(static_cast<size_t>(T) * H, 0.f), DType::kF32);
  const int valid = T > 1 ? T - 1 : 1;
  auto num_valid = to_device_raw(std::vector<int32_t>{valid});
  const cuda::MoeLayerWeights w = layer_weights(stats.value().as<int64_t>());
  ASSERT_TRUE(cuda::GraphExec::begin_capture(s).ok());
  for (int i = 0; i < 2; ++i) {
    const Status st =
        cuda::run_moe(dims, w, scratch.value(), x_d.data(), T, num_valid.as<int32_t>(),
                      out.as<float>(), true, blas.value(), s);
    if (!st.ok()) {
      cuda::GraphExec::abandon_capture(s);
      FAIL() << st.to_string();
    }
  }
  auto graph = cuda::GraphExec::end_capture(s);
  ASSERT_TRUE(graph.ok()) << graph.status().to_string();
  for (int i = 0; i < 2; ++i) ASSERT_TRUE(graph.value().launch(s).ok());
  ASSERT_TRUE(stream.value().synchronize().ok());
  const std::vector<float> got = to_host(out.data(), static_cast<size_t>(T) * H, DType::kF32);
  std::vector<float> want(fused.out.size());
  for (size_t i = 0; i < want.size(); ++i) want[i] = 4.f * fused.out[i];
  EXPECT_LT(rel_l2(got, want), 1e-6);
  std::vector<int64_t> graph_stats(S), want_stats(S, 0);
  ASSERT_EQ(cudaMemcpy(graph_stats.data(), stats.value().data(), S * sizeof(int64_t),
                       cudaMemcpyDeviceToHost),
            cudaSuccess);
  for (int p = 0; p < valid * K; ++p) want_stats[fused.slots[p]] += 4;
  EXPECT_EQ(graph_stats, want_stats);

  // The RMSNorm before the MoE inside the route kernel (run_moe_norm, one or two tokens):
  // h, the routing and the outputs bit for bit those of rms_norm and then run_moe.
  if (T > 2) return;
  const std::vector<float> norm_w = uniform(H, 1.f, rng);
  auto norm_w_d = to_device(norm_w, DType::kF32);
  auto x_f32 = to_device(x, DType::kF32);
  ASSERT_TRUE(cuda::decode_route_norm_fits(T, H));
  auto run_norm = [&](bool fused) {
    Run r;
    auto scratch = cuda::MoeScratch::create(dims, T);
    auto h = cuda::DeviceBuffer::create(static_cast<size_t>(T) * H * 2);
    EXPECT_TRUE(scratch.ok() && h.ok());
    auto out = to_device(std::vector<float>(static_cast<size_t>(T) * H, NAN), DType::kF32);
    const cuda::MoeLayerWeights w = layer_weights(nullptr);
    const float eps = 1e-6f;
    Status st;
    if (fused) {
      st =
          cuda::run_moe_norm(dims, w, scratch.value(),
                             cuda::MoeInputNorm{x_f32.as<float>(), norm_w_d.as<float>(), eps},
                             h.value().data(), T, nullptr, out.as<float>(), false, blas.value(), s);
    } else {
      EXPECT_EQ(cuda::rms_norm(DType::kBF16, x_f32.as<float>(), nullptr, norm_w_d.as<float>(), T, H,
                               eps, h.value().data(), s),
                cudaSuccess);
      st = cuda::run_moe(dims, w, scratch.value(), h.value().data(), T, nullptr, out.as<float>(),
                         false, blas.value(), s);
    }
    EXPECT_TRUE(st.ok()) << st.to_string();
    EXPECT_TRUE(stream.value().synchronize().ok());
    r.out = to_host(out.data(), static_cast<size_t>(T) * H, DType::kF32);
    r.h = to_host(h.value().data(), static_cast<size_t>(T) * H, DType::kBF16);
    EXPECT_TRUE(cuda::read_routing(scratch.value(), T * K, s, &r.experts, &r.slots).ok());
    return r;
  };
  const Run norm_fused = run_norm(true), norm_unfused = run_norm(false);
  EXPECT_EQ(norm_fused.slots, norm_unfused.slots);
  EXPECT_EQ(norm_fused.h, norm_unfused.h) << "h, bit for bit";
  EXPECT_EQ(norm_fused.out, norm_unfused.out) << "outputs, bit for bit";
}

INSTANTIATE_TEST_SUITE_P(Shapes, CudaDecodeMoeTest,
                         ::testing::Values(DecodeCase{1, 4}, DecodeCase{3, 4}, DecodeCase{8, 4},
                                           DecodeCase{1, 8}, DecodeCase{2, 8}, DecodeCase{4, 8},
                                           DecodeCase{2, 8, 256}, DecodeCase{1, 6, 40}));

// The decode path with DeepSeek's router (run_grouped_moe: the route kernel's last block
// runs grouped_topk's arithmetic) against the grouped GEMMs' path (kGemv tile, cuBLAS
// router, grouped_topk kernel) on the same data: DeepSeek-V3's sigmoid scores with
// correction bias and group-limited top-k (8 groups, 4 kept, normalised, scaled 2.5) and
// DeepSeek-V2's softmax greedy (unnormalised); same experts, slots and slot statistics,
// outputs equal up to the router logits' rounding.
TEST(CudaDecodeMoeTest, GroupedRouterMatchesUnfusedPath) {
  FLEX_SKIP_WITHOUT_GPU();
  ASSERT_EQ(std::getenv("FLEXPERT_NO_DECODE_MOE"), nullptr) << "this test covers the decode path";
  // V3: 256 experts, top-8 (the decode path up to 7 tokens: under a quarter row per
  // expert; the route kernel's ticket); V2: 64 experts, top-6 (up to 2 tokens; a cluster
  // of one expert a warp); V3's router over 128 experts (a cluster of two a warp).
  for (const int config : {0, 1, 2}) {
    const bool v3 = config != 1;
    const int H = 256, I = 96, E = config == 0 ? 256 : config == 1 ? 64 : 128, K = v3 ? 8 : 6;
    std::vector<int> map;
    for (int e = 0; e < E; ++e) map.push_back(e);
    for (int e : {3, 7, 0, 3, 11}) map.push_back(e);
    const int S = static_cast<int>(map.size());
    std::mt19937 rng(91);
    const std::vector<float> router = uniform(static_cast<size_t>(E) * H, 0.2f, rng);
    const std::vector<float> bias = uniform(E, 0.05f, rng);
    cuda::MoeDims dims;
    dims.dtype = DType::kBF16;
    dims.hidden = H;
    dims.intermediate = I;
    dims.num_experts = E;
    dims.top_k = K;
    dims.num_slots = S;
    const DecodeTestLayer layer = decode_test_layer(dims, map, router, rng);
    auto bias_d = to_device(bias, DType::kF32);
    auto stream = cuda::Stream::create();
    ASSERT_TRUE(stream.ok());
    cudaStream_t s = stream.value().get();
    auto blas = cuda::Blas::create(s);
    ASSERT_TRUE(blas.ok());
    {
      cuda::GroupedRouter r;
      r.sigmoid = v3;
      r.method = v3 ? cuda::GroupedTopkMethod::kNoauxTc : cuda::GroupedTopkMethod::kGreedy;
      r.num_groups = v3 ? 8 : 1;
      r.topk_groups = v3 ? 4 : 1;
      r.routed_scaling_factor = v3 ? 2.5f : 1.0f;
      dims.norm_topk_prob = v3;
      const std::vector<int> tokens =
          config == 0 ? std::vector<int>{1, 3, 7} : std::vector<int>{1, 2};
      for (const int T : tokens) {
        SCOPED_TRACE((v3 ? "V3 router, " : "V2 router, ") + std::to_string(E) + " experts, " +
                     std::to_string(T) + " tokens");
        ASSERT_TRUE(cuda::uses_decode_path(dims, T));
        const std::vector<float> x = uniform(static_cast<size_t>(T) * H, 1.f, rng);
        auto x_d = to_device(x, DType::kBF16);
        auto run = [&](int force_tile) {
          return decode_run(
              dims, layer, T, stream.value(),
              [&](const cuda::MoeLayerWeights& w, cuda::MoeScratch& scratch, float* out) {
                return cuda::run_grouped_moe(dims, r, bias_d.as<float>(), w, scratch, x_d.data(), T,
                                             nullptr, out, false, blas.value(), s, force_tile);
              });
        };
        const DecodeRun fused = run(-1);
        expect_decode_matches(fused, run(static_cast<int>(cuda::GemmTile::kGemv)),
                              std::string("grouped decode ") + (v3 ? "V3" : "V2") +
                                  " E=" + std::to_string(E) + " T=" + std::to_string(T));
        if (std::getenv("FLEXPERT_NO_ROUTE_CLUSTER") == nullptr) {
          EXPECT_EQ(cuda::decode_route_cluster_blocks(E) > 0, E <= 128);
        }
        // The RMSNorm before the MoE inside the route kernel (run_grouped_moe_norm, one or
        // two tokens): h and the outputs bit for bit those of rms_norm and then the MoE.
        if (T > 2) continue;
        const std::vector<float> x32 = uniform(static_cast<size_t>(T) * H, 2.f, rng);
        const std::vector<float> norm_w = uniform(H, 1.f, rng);
        auto x32_d = to_device(x32, DType::kF32);
        auto norm_w_d = to_device(norm_w, DType::kF32);
        const cuda::MoeInputNorm norm{x32_d.as<float>(), norm_w_d.as<float>(), 1e-6f};
        ASSERT_TRUE(cuda::route_norm_fuses(dims, cuda::MoeScratch::create(dims, T).value(), T));
        auto run_norm = [&](bool inside) {
          auto h = cuda::DeviceBuffer::create(static_cast<size_t>(T) * H * 2);
          EXPECT_TRUE(h.ok());
          DecodeRun res = decode_run(
              dims, layer, T, stream.value(),
              [&](const cuda::MoeLayerWeights& w, cuda::MoeScratch& scratch, float* out) {
                if (inside) {
                  return cuda::run_grouped_moe_norm(dims, r, bias_d.as<float>(), w, scratch, norm,
                                                    h.value().data(), T, nullptr, out, false,
                                                    blas.value(), s);
                }
                EXPECT_EQ(cuda::rms_norm(DType::kBF16, norm.x, nullptr, norm.weight, T, H, norm.eps,
                                         h.value().data(), s),
                          cudaSuccess);
                return cuda::run_grouped_moe(dims, r, bias_d.as<float>(), w, scratch,
                                             h.value().data(), T, nullptr, out, false, blas.value(),
                                             s);
              });
          res.h = to_host(h.value().data(), static_cast<size_t>(T) * H, DType::kBF16);
          return res;
        };
        const DecodeRun inside = run_norm(true), outside = run_norm(false);
        EXPECT_EQ(inside.slots, outside.slots);
        EXPECT_EQ(inside.stats, outside.stats);
        EXPECT_EQ(inside.h, outside.h) << "h, bit for bit";
        EXPECT_EQ(inside.out, outside.out) << "outputs, bit for bit";

        ASSERT_EQ(std::getenv("FLEXPERT_NO_SHARED_FUSION"), nullptr);
        // Shared experts inside the decode kernels (V2's top-6: two pieces of I columns, the
        // last partial, in the down kernel's two idle warps) against the dense MLP after the
        // MoE; V3's top-8 leaves no warp idle, so its shared experts run after (the same).
        const int Is = v3 ? I : I + 8;
        auto sgu = to_device(uniform(static_cast<size_t>(2) * Is * H, 0.3f, rng), DType::kBF16);
        auto sdown = to_device(uniform(static_cast<size_t>(H) * Is, 0.3f, rng), DType::kBF16);
        auto gu = cuda::DeviceBuffer::create(static_cast<size_t>(T) * 2 * Is * sizeof(float));
        auto act = cuda::DeviceBuffer::create(static_cast<size_t>(T) * Is * 2);
        ASSERT_TRUE(gu.ok() && act.ok());
        const cuda::SharedExperts shared{sgu.data(), sdown.data(), Is, gu.value().as<float>(),
                                         act.value().data()};
        EXPECT_EQ(cuda::decode_moe_supported(T, H, I, E, K, Is), !v3);
        auto run_shared = [&](bool inside) {
          auto h = cuda::DeviceBuffer::create(static_cast<size_t>(T) * H * 2);
          EXPECT_TRUE(h.ok());
          return decode_run(
              dims, layer, T, stream.value(),
              [&](const cuda::MoeLayerWeights& w, cuda::MoeScratch& scratch, float* out) {
                if (inside) {
                  return cuda::run_grouped_moe_norm(dims, r, bias_d.as<float>(), w, scratch, norm,
                                                    h.value().data(), T, nullptr, out, false,
                                                    blas.value(), s, &shared);
                }
                // rms_norm, the MoE's decode path, then the shared experts as a dense MLP.
                EXPECT_EQ(cuda::rms_norm(DType::kBF16, norm.x, nullptr, norm.weight, T, H, norm.eps,
                                         h.value().data(), s),
                          cudaSuccess);
                Status st =
                    cuda::run_grouped_moe(dims, r, bias_d.as<float>(), w, scratch, h.value().data(),
                                          T, nullptr, out, false, blas.value(), s);
                if (st.ok()) {
                  st = blas.value().linear(DType::kBF16, h.value().data(), T, H, sgu.data(), 2 * Is,
                                           gu.value().as<float>(), false);
                }
                if (st.ok()) {
                  st = blas.value().linear_swiglu(DType::kBF16, gu.value().as<float>(), T, Is,
                                                  sdown.data(), H, out, true, act.value().data());
                }
                return st;
              });
        };
        const DecodeRun with_inside = run_shared(true), with_after = run_shared(false);
        EXPECT_EQ(with_inside.slots, with_after.slots);
        const double err = rel_l2(with_inside.out, with_after.out);
        std::printf("  shared experts (%s, %d pieces): relative L2 vs after the MoE = %.3g\n",
                    v3 ? "after" : "inside", cuda::shared_pieces(Is, I), err);
        EXPECT_LT(err, 1e-5);
        EXPECT_GT(rel_l2(with_after.out, inside.out), 1e-2) << "the shared experts count";
      }
    }
  }
}

// The arguments of attention over `tokens` rows (q, the caches, positions and KV slots
// in device buffers) into `out`, scale 1 / sqrt(D); with `scratch` (attention_split_floats
// floats) split and tiled as the kernels choose.
cuda::AttentionArgs attention_args(const cuda::DeviceBuffer& q, const cuda::DeviceBuffer& k,
                                   const cuda::DeviceBuffer& v, const cuda::DeviceBuffer& pos,
                                   const cuda::DeviceBuffer& slot, int tokens, int nq, int nkv,
                                   int D, int max_seq_len, void* out, float* scratch = nullptr) {
  cuda::AttentionArgs a{q.data(),
                        k.data(),
                        v.data(),
                        pos.as<int32_t>(),
                        slot.as<int32_t>(),
                        tokens,
                        nq,
                        nkv,
                        D,
                        max_seq_len,
                        1.f / std::sqrt(static_cast<float>(D)),
                        out};
  if (scratch != nullptr) {
    a.split_scratch = scratch;
    a.split_capacity = cuda::attention_split_floats(D, nq, nkv);
  }
  return a;
}

// A batch of sequences as attention rows: each `len` consecutive positions from `start`
// in KV slot `slot`, one after the other.
struct AttnSeq {
  int slot, start, len;
};
// The rows' positions and KV slots.
void seq_rows(const std::vector<AttnSeq>& seqs, std::vector<int32_t>* pos,
              std::vector<int32_t>* slot) {
  for (const AttnSeq& sq : seqs) {
    for (int i = 0; i < sq.len; ++i) {
      pos->push_back(sq.start + i);
      slot->push_back(sq.slot);
    }
  }
}
// The CPU's attention of every row (q [rows, nq, D], caches [slots, max_seq_len, nkv, D]),
// scale 1 / sqrt(D).
std::vector<float> cpu_attention_rows(const std::vector<AttnSeq>& seqs, const std::vector<float>& q,
                                      const std::vector<float>& kc, const std::vector<float>& vc,
                                      int nq, int nkv, int D, int max_seq_len) {
  std::vector<float> want(q.size());
  int t0 = 0;
  for (const AttnSeq& sq : seqs) {
    const size_t off = static_cast<size_t>(sq.slot) * max_seq_len * nkv * D;
    kernels::attention(q.data() + static_cast<size_t>(t0) * nq * D, kc.data() + off,
                       vc.data() + off, sq.len, sq.start, nq, nkv, D,
                       1.f / std::sqrt(static_cast<float>(D)),
                       want.data() + static_cast<size_t>(t0) * nq * D, ThreadPool::global());
    t0 += sq.len;
  }
  return want;
}

class CudaAttentionTest : public ::testing::TestWithParam<std::pair<DType, int>> {};

TEST_P(CudaAttentionTest, MatchesCpuAttention) {
  FLEX_SKIP_WITHOUT_GPU();
  const auto [dtype, D] = GetParam();
  const bool bf = dtype == DType::kBF16;
  const int nq = 8, nkv = 2, max_seq_len = 96, num_slots = 3;
  // Two sequences: a 40-token prefill at 0 in slot 2 and one decode token at 70 in slot 0.
  const std::vector<AttnSeq> seqs = {{2, 0, 40}, {0, 70, 1}};
  std::mt19937 rng(7 + D);
  auto maybe_round = [&](std::vector<float> v) { return bf ? round_bf16(std::move(v)) : v; };
  const size_t cache_n = static_cast<size_t>(num_slots) * max_seq_len * nkv * D;
  const std::vector<float> kc = maybe_round(uniform(cache_n, 1.f, rng));
  const std::vector<float> vc = maybe_round(uniform(cache_n, 1.f, rng));
  std::vector<int32_t> pos, slot;
  seq_rows(seqs, &pos, &slot);
  const int T = static_cast<int>(pos.size());
  const std::vector<float> q = maybe_round(uniform(static_cast<size_t>(T) * nq * D, 1.f, rng));
  const std::vector<float> want = cpu_attention_rows(seqs, q, kc, vc, nq, nkv, D, max_seq_len);
  auto q_d = to_device(q, dtype);
  auto k_d = to_device(kc, dtype);
  auto v_d = to_device(vc, dtype);
  auto pos_d = to_device_raw(pos);
  auto slot_d = to_device_raw(slot);
  auto out_d = cuda::DeviceBuffer::create(q.size() * dtype_size(dtype));
  ASSERT_TRUE(out_d.ok());
  cuda::AttentionArgs a = attention_args(q_d, k_d, v_d, pos_d, slot_d, T, nq, nkv, D, max_seq_len,
                                         out_d.value().data());
  ASSERT_EQ(cuda::attention(dtype, a, nullptr), cudaSuccess);
  ASSERT_EQ(cudaDeviceSynchronize(), cudaSuccess);
  const std::vector<float> got = to_host(out_d.value().data(), q.size(), dtype);
  const double err = rel_l2(got, want);
  std::printf("  attention %s D=%d: relative L2 vs CPU = %.3g\n", dtype_name(dtype).data(), D, err);
  EXPECT_LT(err, bf ? 1e-2 : 1e-5);
  // Split over warps and merged: 41 tokens x 8 heads -> 7 splits a (token, head) pair; in
  // bf16 with D = 128 the GQA kernel, whose 41 x 2 (token, kv head) pairs split by the
  // GPU's resident warps. The decode token's 71 positions span 3 chunks, so most of its
  // splits are empty.
  const int64_t floats = cuda::attention_split_floats(D, nq, nkv);
  auto scratch = cuda::DeviceBuffer::create(floats * sizeof(float));
  ASSERT_TRUE(scratch.ok());
  a.split_scratch = scratch.value().as<float>();
  a.split_capacity = floats;
  const int splits = cuda::attention_splits(dtype, a);
  if (bf && D == 128) {
    ASSERT_GT(splits, 1);
  } else {
    ASSERT_EQ(splits, 7);
  }
  ASSERT_EQ(cuda::attention(dtype, a, nullptr), cudaSuccess);
  ASSERT_EQ(cudaDeviceSynchronize(), cudaSuccess);
  const double err_split = rel_l2(to_host(out_d.value().data(), q.size(), dtype), want);
  std::printf("  split %d ways: relative L2 vs CPU = %.3g\n", splits, err_split);
  EXPECT_LT(err_split, bf ? 1e-2 : 1e-5);
}

// Prefill tiles on tensor cores (AttentionArgs::tiles, bf16): tiles of 64 rows of one
// sequence (from position 0, from 64, partial last ones) in every pairing a block meets,
// and tiles spanning sequences, whose rows the decode (GQA) kernel takes; against the
// CPU, with the tiles' flags saying which ran.
TEST(CudaAttentionTileTest, PrefillTilesMatchCpu) {
  FLEX_SKIP_WITHOUT_GPU();
  // 231 tokens x 16 heads: enough pairs for one warp per pair (no splits), as prefill.
  const int nq = 16, nkv = 2, max_seq_len = 192, num_slots = 3;
  // A block takes a pair of 64-row tiles: as one job when all its rows are one
  // sequence's, else each tile that is. Layout 0: rows 0-129 one sequence, 130 a decode
  // token, 131-230 a third: tiles 0 + 1 one job, 3 (partial: its last warp has no rows)
  // alone, 2 (all three) by the GQA kernel. Layout 1: rows 0-63, 64-191 two sequences (pair
  // 0: two jobs), 192-211 and 212-221 two more (pair 1: only tile 2 is one sequence's).
  struct Layout {
    std::vector<AttnSeq> seqs;
    std::vector<float> flags;
    std::vector<int> rows;  // Checked one by one.
  };
  const std::vector<Layout> layouts = {
      {{{1, 0, 130}, {0, 70, 1}, {2, 10, 100}},
       {1.f, 1.f, 0.f, 1.f},
       {0, 63, 64, 127, 128, 130, 131, 191, 192, 230}},
      {{{0, 5, 64}, {1, 0, 128}, {2, 30, 20}, {0, 80, 10}},
       {1.f, 1.f, 1.f, 0.f},
       {0, 63, 64, 127, 128, 191, 192, 211, 212, 221}},
  };
  for (size_t c = 0; c < 2 * layouts.size(); ++c) {
    const size_t li = c / 2;
    const int D = c % 2 == 0 ? 64 : 128;
    const std::vector<AttnSeq>& seqs = layouts[li].seqs;
    std::mt19937 rng(17 + D);
    const size_t cache_n = static_cast<size_t>(num_slots) * max_seq_len * nkv * D;
    const std::vector<float> kc = round_bf16(uniform(cache_n, 1.f, rng));
    const std::vector<float> vc = round_bf16(uniform(cache_n, 1.f, rng));
    std::vector<int32_t> pos, slot;
    seq_rows(seqs, &pos, &slot);
    const int T = static_cast<int>(pos.size());
    const std::vector<float> q = round_bf16(uniform(static_cast<size_t>(T) * nq * D, 1.f, rng));
    const std::vector<float> want = cpu_attention_rows(seqs, q, kc, vc, nq, nkv, D, max_seq_len);
    auto q_d = to_device(q, DType::kBF16);
    auto k_d = to_device(kc, DType::kBF16);
    auto v_d = to_device(vc, DType::kBF16);
    auto pos_d = to_device_raw(pos);
    auto slot_d = to_device_raw(slot);
    auto scratch =
        cuda::DeviceBuffer::create(cuda::attention_split_floats(D, nq, nkv) * sizeof(float));
    ASSERT_TRUE(scratch.ok());
    auto run = [&](bool tiles) {
      auto out_d = cuda::DeviceBuffer::create(q.size() * 2);
      EXPECT_TRUE(out_d.ok());
      cuda::AttentionArgs a =
          attention_args(q_d, k_d, v_d, pos_d, slot_d, T, nq, nkv, D, max_seq_len,
                         out_d.value().data(), scratch.value().as<float>());
      a.tiles = tiles;
      // Without tiles the GQA kernel, its 231 x 2 (token, kv head) pairs split.
      const int splits = cuda::attention_splits(DType::kBF16, a);
      if (tiles) {
        EXPECT_EQ(splits, 1);
      } else {
        EXPECT_GT(splits, 1);
      }
      EXPECT_EQ(cuda::attention(DType::kBF16, a, nullptr), cudaSuccess);
      EXPECT_EQ(cudaDeviceSynchronize(), cudaSuccess);
      return to_host(out_d.value().data(), q.size(), DType::kBF16);
    };
    const std::vector<float> tiled = run(true);
    std::vector<float> flags(4);
    ASSERT_EQ(
        cudaMemcpy(flags.data(), scratch.value().data(), 4 * sizeof(float), cudaMemcpyDeviceToHost),
        cudaSuccess);
    EXPECT_EQ(flags, layouts[li].flags) << "tiles computed, layout " << li << ", D " << D;
    const std::vector<float> rows = run(false);
    const double err = rel_l2(tiled, want), err_rows = rel_l2(rows, want);
    std::printf("  tiles, layout %zu, D=%d: relative L2 vs CPU %.3g (without tiles: %.3g)\n", li, D,
                err, err_rows);
    EXPECT_LT(err, 1e-2) << "layout " << li << ", D " << D;
    // Row by row, the tiles' rows against the CPU: each tile kind is right on its own.
    for (int t : layouts[li].rows) {
      const size_t o = static_cast<size_t>(t) * nq * D;
      const std::vector<float> got(tiled.begin() + o, tiled.begin() + o + nq * D);
      const std::vector<float> ref(want.begin() + o, want.begin() + o + nq * D);
      EXPECT_LT(rel_l2(got, ref), 2e-2) << "layout " << li << ", D " << D << " row " << t;
    }
  }
}

// One decode token (8 heads -> 64 splits, the most): contexts whose chunks fill none to
// all of the splits past the first 32 (the merge's two halves, its loads in flight).
TEST(CudaAttentionSplitTest, OneDecodeTokenOverSixtyFourSplits) {
  FLEX_SKIP_WITHOUT_GPU();
  const int nq = 8, nkv = 2, D = 128, max_seq_len = 2112;
  std::mt19937 rng(11);
  for (DType dtype : {DType::kF32, DType::kBF16}) {
    const bool bf = dtype == DType::kBF16;
    auto maybe_round = [&](std::vector<float> v) { return bf ? round_bf16(std::move(v)) : v; };
    const size_t cache_n = static_cast<size_t>(max_seq_len) * nkv * D;
    const std::vector<float> kc = maybe_round(uniform(cache_n, 1.f, rng));
    const std::vector<float> vc = maybe_round(uniform(cache_n, 1.f, rng));
    auto k_d = to_device(kc, dtype);
    auto v_d = to_device(vc, dtype);
    auto scratch =
        cuda::DeviceBuffer::create(cuda::attention_split_floats(D, nq, nkv) * sizeof(float));
    ASSERT_TRUE(scratch.ok());
    for (int p : {0, 31, 40, 1030, 1100, 2047, 2111}) {
      const std::vector<float> q = maybe_round(uniform(static_cast<size_t>(nq) * D, 1.f, rng));
      const float scale = 1.f / std::sqrt(static_cast<float>(D));
      std::vector<float> want(q.size());
      kernels::attention(q.data(), kc.data(), vc.data(), 1, p, nq, nkv, D, scale, want.data(),
                         ThreadPool::global());
      auto q_d = to_device(q, dtype);
      auto pos_d = to_device_raw(std::vector<int32_t>{p});
      auto slot_d = to_device_raw(std::vector<int32_t>{0});
      auto out_d = cuda::DeviceBuffer::create(q.size() * dtype_size(dtype));
      ASSERT_TRUE(out_d.ok());
      cuda::AttentionArgs a =
          attention_args(q_d, k_d, v_d, pos_d, slot_d, 1, nq, nkv, D, max_seq_len,
                         out_d.value().data(), scratch.value().as<float>());
      // f32: a warp per head, 64 splits; bf16: the GQA kernel, 2 kv heads split over
      // more than 32 warps each (61 on an H200: within 5 % of 64's cost).
      const int splits = cuda::attention_splits(dtype, a);
      if (bf) {
        ASSERT_GT(splits, 32);
        ASSERT_LE(splits, 64);
      } else {
        ASSERT_EQ(splits, 64);
      }
      ASSERT_EQ(cuda::attention(dtype, a, nullptr), cudaSuccess);
      ASSERT_EQ(cudaDeviceSynchronize(), cudaSuccess);
      const double err = rel_l2(to_host(out_d.value().data(), q.size(), dtype), want);
      EXPECT_LT(err, bf ? 1e-2 : 1e-5) << dtype_name(dtype) << " at position " << p;
    }
  }
}

// Decode tokens on the GQA kernel (bf16, head_dim 64 / 128): groups of 1, 3, 4, 8, 12 and
// 16 query heads a kv head (up to 8 in the first half of the row block, 12 and 16 in
// both) and 32 (past the kernel's 16: a warp per head instead); contexts of one position, ending
// in, at and past a 32-position chunk's edge, and long ones; split and merged (scratch) and not.
TEST(CudaAttentionGqaTest, DecodeTokensMatchCpu) {
  FLEX_SKIP_WITHOUT_GPU();
  const int max_seq_len = 1536;
  const std::vector<int> starts = {0, 31, 32, 33, 200, 1500};
  std::vector<AttnSeq> seqs;
  for (size_t i = 0; i < starts.size(); ++i) seqs.push_back({static_cast<int>(i), starts[i], 1});
  const int T = static_cast<int>(seqs.size());
  std::vector<int32_t> pos, slot;
  seq_rows(seqs, &pos, &slot);
  auto pos_d = to_device_raw(pos);
  auto slot_d = to_device_raw(slot);
  const std::vector<std::pair<int, int>> heads = {{8, 8},  {16, 4}, {12, 4}, {32, 4},
                                                  {24, 2}, {32, 2}, {32, 1}};
  for (int D : {64, 128}) {
    for (const auto& [nq, nkv] : heads) {
      std::mt19937 rng(23 + D + nq / nkv);
      const size_t cache_n = static_cast<size_t>(T) * max_seq_len * nkv * D;
      const std::vector<float> kc = round_bf16(uniform(cache_n, 1.f, rng));
      const std::vector<float> vc = round_bf16(uniform(cache_n, 1.f, rng));
      const std::vector<float> q = round_bf16(uniform(static_cast<size_t>(T) * nq * D, 1.f, rng));
      const std::vector<float> want = cpu_attention_rows(seqs, q, kc, vc, nq, nkv, D, max_seq_len);
      auto q_d = to_device(q, DType::kBF16);
      auto k_d = to_device(kc, DType::kBF16);
      auto v_d = to_device(vc, DType::kBF16);
      auto scratch =
          cuda::DeviceBuffer::create(cuda::attention_split_floats(D, nq, nkv) * sizeof(float));
      ASSERT_TRUE(scratch.ok());
      for (bool split : {false, true}) {
        auto out_d = cuda::DeviceBuffer::create(q.size() * 2);
        ASSERT_TRUE(out_d.ok());
        cuda::AttentionArgs a =
            attention_args(q_d, k_d, v_d, pos_d, slot_d, T, nq, nkv, D, max_seq_len,
                           out_d.value().data(), split ? scratch.value().as<float>() : nullptr);
        // Split: the 6 x nkv (token, kv head) pairs by the GPU's resident warps, at most 64
        // ways; a warp per head (group 32): 6 x 32 pairs -> 11.
        const int splits = cuda::attention_splits(DType::kBF16, a);
        if (!split) {
          ASSERT_EQ(splits, 1);
        } else if (nq / nkv > 16) {
          ASSERT_EQ(splits, 11);
        } else {
          ASSERT_GT(splits, 1);
          ASSERT_LE(splits, 64);
        }
        ASSERT_EQ(cuda::attention(DType::kBF16, a, nullptr), cudaSuccess);
        ASSERT_EQ(cudaDeviceSynchronize(), cudaSuccess);
        const std::vector<float> got = to_host(out_d.value().data(), q.size(), DType::kBF16);
        std::printf("  D=%d, %d heads / %d kv heads, %d splits: relative L2 vs CPU %.3g\n", D, nq,
                    nkv, splits, rel_l2(got, want));
        for (int t = 0; t < T; ++t) {  // Token by token: each context length on its own.
          const size_t o = static_cast<size_t>(t) * nq * D;
          const std::vector<float> gt(got.begin() + o, got.begin() + o + nq * D);
          const std::vector<float> rf(want.begin() + o, want.begin() + o + nq * D);
          EXPECT_LT(rel_l2(gt, rf), 1e-2)
              << "D " << D << ", " << nq << " / " << nkv << " heads, split " << split
              << ", position " << starts[t];
        }
      }
    }
  }
}

// HeadGemm (MLA's per-head products) against float64 math on the same bf16 values: its
// decode GEMV (one or two tokens; DeepSeek-V2-Lite's absorbed key part into f32 and value
// part into bf16, and odd shapes: one to eight lanes a row, a partial row group, 32 lanes
// with a partial last pass) and cuBLAS (three tokens) with the model's strides.
TEST(CudaHeadGemmTest, MatchesFloat64) {
  FLEX_SKIP_WITHOUT_GPU();
  ASSERT_EQ(std::getenv("FLEXPERT_NO_HEAD_GEMV"), nullptr) << "this test covers the GEMV";
  struct Case {
    int heads, n, k, x_head, y_head;
    DType out;
  };
  auto stream = cuda::Stream::create();
  ASSERT_TRUE(stream.ok());
  auto hg = cuda::HeadGemm::create(stream.value().get());
  ASSERT_TRUE(hg.ok());
  std::mt19937 rng(12);
  for (const Case& c :
       {Case{16, 512, 128, 192, 576, DType::kF32}, Case{16, 128, 512, 512, 128, DType::kBF16},
        Case{5, 3, 8, 8, 7, DType::kF32}, Case{3, 37, 40, 48, 40, DType::kBF16},
        Case{2, 9, 1024, 1024, 9, DType::kF32}, Case{3, 11, 776, 784, 11, DType::kBF16}}) {
    for (int m : {1, 2, 3}) {
      SCOPED_TRACE("heads " + std::to_string(c.heads) + " n " + std::to_string(c.n) + " k " +
                   std::to_string(c.k) + " tokens " + std::to_string(m));
      const int64_t x_row = int64_t{c.heads} * c.x_head, y_row = int64_t{c.heads} * c.y_head;
      const std::vector<float> x = round_bf16(uniform(static_cast<size_t>(m * x_row), 1.f, rng));
      const std::vector<float> w =
          round_bf16(uniform(static_cast<size_t>(c.heads) * c.n * c.k, 1.f, rng));
      std::vector<float> want(static_cast<size_t>(m * y_row), 0.f);
      for (int t = 0; t < m; ++t) {
        for (int h = 0; h < c.heads; ++h) {
          for (int j = 0; j < c.n; ++j) {
            double sum = 0.0;
            for (int i = 0; i < c.k; ++i) {
              sum += static_cast<double>(x[t * x_row + h * c.x_head + i]) *
                     w[(static_cast<size_t>(h) * c.n + j) * c.k + i];
            }
            want[t * y_row + h * c.y_head + j] = static_cast<float>(sum);
          }
        }
      }
      auto x_d = to_device(x, DType::kBF16);
      auto w_d = to_device(w, DType::kBF16);
      auto y_d = to_device(std::vector<float>(want.size(), 0.f), c.out);
      if (m <= cuda::kHeadGemvMaxRows) {  // HeadGemm::run takes the GEMV for these.
        EXPECT_TRUE(
            cuda::head_gemv_fits({x_d.data(), x_row, c.x_head, w_d.data(), m, c.heads, c.n, c.k,
                                  y_d.data(), c.out == DType::kBF16, y_row, c.y_head}));
        EXPECT_LE(int64_t{c.heads} * c.n * c.k, cuda::HeadGemm::kHeadGemvMaxElems);
      }
      const Status st = hg.value().run(DType::kBF16, x_d.data(), m, x_row, c.x_head, w_d.data(),
                                       c.heads, c.n, c.k, c.out, y_d.data(), y_row, c.y_head);
      ASSERT_TRUE(st.ok()) << st.to_string();
      ASSERT_TRUE(stream.value().synchronize().ok());
      const double err = rel_l2(to_host(y_d.data(), want.size(), c.out), want);
      EXPECT_LT(err, c.out == DType::kBF16 ? 4e-3 : 1e-6);
    }
  }
  cuda::HeadGemvArgs bad{};
  bad.num_tokens = 1;
  bad.num_heads = 1;
  bad.n = 1;
  bad.k = 1032;  // Past four passes of 32 lanes.
  EXPECT_FALSE(cuda::head_gemv_fits(bad));
  bad.k = 128;
  bad.x_head_stride = 4;  // Breaks the 16-byte loads.
  EXPECT_FALSE(cuda::head_gemv_fits(bad));
}

// HeadGemm::run with MLA's rotary work (the decode step's absorbed query, one launch)
// against mla_rope_store and then the product alone: q_latent (absorbed and rotary parts)
// and the cache rows bit for bit, for one and two tokens in different KV slots, plain and
// interleaved RoPE, and three tokens (cuBLAS and the separate kernel).
TEST(CudaHeadGemmTest, RopeInsideEqualsMlaRopeStore) {
  FLEX_SKIP_WITHOUT_GPU();
  ASSERT_EQ(std::getenv("FLEXPERT_NO_HEAD_GEMV"), nullptr) << "this test covers the GEMV";
  const int nh = 4, dn = 16, dr = 8, r = 32, row = r + dr, max_len = 8, slots = 3;
  auto stream = cuda::Stream::create();
  ASSERT_TRUE(stream.ok());
  cudaStream_t s = stream.value().get();
  auto hg = cuda::HeadGemm::create(s);
  ASSERT_TRUE(hg.ok());
  std::mt19937 rng(13);
  std::vector<float> cosv(max_len * dr / 2), sinv(max_len * dr / 2);
  for (size_t i = 0; i < cosv.size(); ++i) {
    cosv[i] = std::cos(0.3f * static_cast<float>(i));
    sinv[i] = std::sin(0.3f * static_cast<float>(i));
  }
  auto cos_d = to_device(cosv, DType::kF32);
  auto sin_d = to_device(sinv, DType::kF32);
  auto norm_d = to_device(uniform(r, 1.f, rng), DType::kF32);
  auto w_d = to_device(uniform(static_cast<size_t>(nh) * r * dn, 1.f, rng), DType::kBF16);
  for (const int T : {1, 2, 3}) {
    for (const bool interleaved : {false, true}) {
      SCOPED_TRACE(std::to_string(T) + " tokens, interleaved " + std::to_string(interleaved));
      const std::vector<int32_t> pos = {5, 2, 7}, slot = {2, 0, 1};
      auto pos_d = to_device_raw(std::vector<int32_t>(pos.begin(), pos.begin() + T));
      auto slot_d = to_device_raw(std::vector<int32_t>(slot.begin(), slot.begin() + T));
      auto kv_d = to_device(uniform(static_cast<size_t>(T) * (row + 4), 2.f, rng), DType::kF32);
      auto q_d =
          to_device(uniform(static_cast<size_t>(T) * nh * (dn + dr), 1.f, rng), DType::kBF16);
      const size_t lat_n = static_cast<size_t>(T) * nh * row;
      const size_t cache_n = static_cast<size_t>(slots) * max_len * row;
      std::vector<std::vector<float>> lat(2), cache(2);
      for (const bool inside : {true, false}) {
        auto lat_d = to_device(std::vector<float>(lat_n, 0.f), DType::kF32);
        auto cache_d = to_device(std::vector<float>(cache_n, 0.f), DType::kBF16);
        const cuda::MlaRopeArgs ra{kv_d.as<float>(),
                                   row + 4,
                                   norm_d.as<float>(),
                                   1e-6f,
                                   q_d.data(),
                                   lat_d.as<float>(),
                                   cos_d.as<float>(),
                                   sin_d.as<float>(),
                                   interleaved,
                                   pos_d.as<int32_t>(),
                                   slot_d.as<int32_t>(),
                                   max_len,
                                   cache_d.data(),
                                   T,
                                   nh,
                                   dn,
                                   dr,
                                   r};
        if (!inside) {
          ASSERT_EQ(cuda::mla_rope_store(DType::kBF16, ra, s), cudaSuccess);
        }
        const Status st =
            hg.value().run(DType::kBF16, q_d.data(), T, nh * (dn + dr), dn + dr, w_d.data(), nh, r,
                           dn, DType::kF32, lat_d.data(), nh * row, row, inside ? &ra : nullptr);
        ASSERT_TRUE(st.ok()) << st.to_string();
        ASSERT_TRUE(stream.value().synchronize().ok());
        lat[inside] = to_host(lat_d.data(), lat_n, DType::kF32);
        cache[inside] = to_host(cache_d.data(), cache_n, DType::kBF16);
      }
      EXPECT_EQ(lat[1], lat[0]);
      EXPECT_EQ(cache[1], cache[0]);
      // The launch wrote something: each token's cache row and rotary query parts.
      for (int t = 0; t < T; ++t) {
        double row_sq = 0.0, rope_sq = 0.0;
        for (int i = 0; i < row; ++i) {
          const float v = cache[1][(static_cast<size_t>(slot[t]) * max_len + pos[t]) * row + i];
          row_sq += static_cast<double>(v) * v;
        }
        for (int i = r; i < row; ++i) {
          const float v = lat[1][static_cast<size_t>(t) * nh * row + i];
          rope_sq += static_cast<double>(v) * v;
        }
        EXPECT_GT(row_sq, 0.0) << "token " << t;
        EXPECT_GT(rope_sq, 0.0) << "token " << t;
      }
    }
  }
}

// Absorbed MLA against float64 math: token t, head h attends over rows 0..positions[t] of
// cache slot kv_slots[t] with scores scale * q_latent[t, h] . row, and outputs the
// softmax-weighted sum of the rows' first kv_lora_rank dims. bf16 with kv_lora_rank
// 128 / 256 / 512 runs on tensor cores (16 heads a block: 4, 16, 20 and 128 heads leave
// blocks partly empty or not; rope_dim 8 pads the rows to a multiple of 16), 64 on the
// CUDA cores; decode tokens at chunk edges and long contexts, and a 40-token prompt
// (causal), each with and without splits (merged by (pair, 128 dims) below 512 pairs, else
// a block per pair: both here) and with and without prompt groups (four tokens a block:
// the prompt's share their chunks, the decode tokens' slots differ and go one by one).
TEST(CudaMlaTest, AttentionMatchesFloat64) {
  FLEX_SKIP_WITHOUT_GPU();
  ASSERT_EQ(std::getenv("FLEXPERT_NO_MLA_MMA"), nullptr) << "this test covers the tensor cores";
  const int max_seq_len = 1536;
  struct Shape {
    int heads, rank, rope;
  };
  const std::vector<Shape> shapes = {
      {16, 512, 64}, {128, 512, 64}, {4, 256, 8}, {20, 128, 32}, {8, 64, 16}};
  const std::vector<int> decode_pos = {0, 31, 32, 33, 200, 1500};
  for (const bool prompt : {false, true}) {
    std::vector<int32_t> pos, slot;
    for (size_t i = 0; i < decode_pos.size(); ++i) {
      pos.push_back(decode_pos[i]);
      slot.push_back(static_cast<int32_t>(i));
    }
    for (int p = 0; prompt && p < 40; ++p) {
      pos.push_back(p);
      slot.push_back(static_cast<int32_t>(decode_pos.size()));
    }
    const int T = static_cast<int>(pos.size()), slots = static_cast<int>(decode_pos.size()) + 1;
    auto pos_d = to_device_raw(pos);
    auto slot_d = to_device_raw(slot);
    for (const Shape& sh : shapes) {
      const int row = sh.rank + sh.rope;
      std::mt19937 rng(41 + sh.heads + sh.rank);
      const std::vector<float> cache =
          round_bf16(uniform(static_cast<size_t>(slots) * max_seq_len * row, 1.f, rng));
      // Scores of standard deviation ~2: a softmax far from flat, so that a wrong maximum,
      // correction or base shows.
      const std::vector<float> q = uniform(static_cast<size_t>(T) * sh.heads * row, 6.f, rng);
      const float scale = 1.0f / std::sqrt(static_cast<float>(row));
      std::vector<float> want(static_cast<size_t>(T) * sh.heads * sh.rank);
      for (int t = 0; t < T; ++t) {
        const float* rows = cache.data() + static_cast<size_t>(slot[t]) * max_seq_len * row;
        for (int h = 0; h < sh.heads; ++h) {
          const float* qh = q.data() + (static_cast<size_t>(t) * sh.heads + h) * row;
          std::vector<double> s(pos[t] + 1);
          double mx = -1e300, sum = 0;
          for (int j = 0; j <= pos[t]; ++j) {
            double dot = 0;
            for (int d = 0; d < row; ++d) dot += static_cast<double>(qh[d]) * rows[j * row + d];
            s[j] = dot * scale;
            mx = std::max(mx, s[j]);
          }
          for (double& v : s) sum += v = std::exp(v - mx);
          for (int d = 0; d < sh.rank; ++d) {
            double acc = 0;
            for (int j = 0; j <= pos[t]; ++j) acc += s[j] * rows[j * row + d];
            want[(static_cast<size_t>(t) * sh.heads + h) * sh.rank + d] =
                static_cast<float>(acc / sum);
          }
        }
      }
      auto q_d = to_device(q, DType::kF32);
      auto cache_d = to_device(cache, DType::kBF16);
      auto scratch =
          cuda::DeviceBuffer::create(cuda::mla_attention_split_floats(sh.rank) * sizeof(float));
      ASSERT_TRUE(scratch.ok());
      for (const auto& [split, groups] : {std::pair{false, false}, std::pair{true, false},
                                          std::pair{false, true}, std::pair{true, true}}) {
        auto out_d = cuda::DeviceBuffer::create(want.size() * 2);
        ASSERT_TRUE(out_d.ok());
        cuda::MlaAttentionArgs a{q_d.as<float>(),
                                 cache_d.data(),
                                 pos_d.as<int32_t>(),
                                 slot_d.as<int32_t>(),
                                 T,
                                 sh.heads,
                                 sh.rank,
                                 sh.rope,
                                 max_seq_len,
                                 scale,
                                 out_d.value().data(),
                                 split ? scratch.value().as<float>() : nullptr,
                                 static_cast<int64_t>(scratch.value().num_bytes() / sizeof(float)),
                                 groups};
        const int splits = cuda::mla_attention_splits(DType::kBF16, a);
        if (!split) {
          ASSERT_EQ(splits, 1);
        } else if (!prompt && sh.heads <= 16) {
          ASSERT_GT(splits, 1);  // Decode steps have few (token, 16 heads) blocks.
        }
        ASSERT_EQ(cuda::mla_attention(DType::kBF16, a, nullptr), cudaSuccess);
        ASSERT_EQ(cudaDeviceSynchronize(), cudaSuccess);
        const std::vector<float> got = to_host(out_d.value().data(), want.size(), DType::kBF16);
        std::printf("  %d heads, rank %d, rope %d, %d tokens, %d splits%s: relative L2 %.3g\n",
                    sh.heads, sh.rank, sh.rope, T, splits, groups ? ", prompt groups" : "",
                    rel_l2(got, want));
        for (int t = 0; t < T; ++t) {  // Token by token: each context length on its own.
          const size_t n = static_cast<size_t>(sh.heads) * sh.rank, o = t * n;
          const std::vector<float> gt(got.begin() + o, got.begin() + o + n);
          const std::vector<float> rf(want.begin() + o, want.begin() + o + n);
          EXPECT_LT(rel_l2(gt, rf), 1e-2)
              << sh.heads << " heads, rank " << sh.rank << ", split " << split << ", groups "
              << groups << ", token " << t << " at " << pos[t];
        }
      }
    }
  }
}

// SwiGLU of f32 gate/up rows against float64: a row over several blocks of the 2D grid
// with a partial last one (10944 columns: DeepSeek-V2-Lite's dense FFN), and a short row.
TEST(CudaSiluMulTest, MatchesFloat64) {
  FLEX_SKIP_WITHOUT_GPU();
  for (const int inter : {10944, 96}) {
    const int rows = 3;
    std::mt19937 rng(5 + inter);
    const std::vector<float> gu = uniform(static_cast<size_t>(rows) * 2 * inter, 4.f, rng);
    std::vector<float> want(static_cast<size_t>(rows) * inter);
    for (int r = 0; r < rows; ++r) {
      for (int i = 0; i < inter; ++i) {
        const double g = gu[static_cast<size_t>(r) * 2 * inter + i];
        const double u = gu[static_cast<size_t>(r) * 2 * inter + inter + i];
        want[static_cast<size_t>(r) * inter + i] = static_cast<float>(g / (1 + std::exp(-g)) * u);
      }
    }
    auto gu_d = to_device(gu, DType::kF32);
    for (const DType dtype : {DType::kF32, DType::kBF16}) {
      auto out = cuda::DeviceBuffer::create(want.size() * dtype_size(dtype));
      ASSERT_TRUE(out.ok());
      ASSERT_EQ(cuda::silu_mul(dtype, gu_d.as<float>(), rows, inter, out.value().data(), nullptr),
                cudaSuccess);
      ASSERT_EQ(cudaDeviceSynchronize(), cudaSuccess);
      const double err = rel_l2(to_host(out.value().data(), want.size(), dtype), want);
      EXPECT_LT(err, dtype == DType::kF32 ? 1e-6 : 4e-3) << inter << " columns";
    }
  }
}

// RMSNorm against float64 math: rows by index, the float4 kernel (dim % 4 == 0, up to
// 8192) and the scalar one (other dims).
TEST(CudaRmsNormTest, MatchesFloat64) {
  FLEX_SKIP_WITHOUT_GPU();
  std::mt19937 rng(5);
  for (int dim : {36, 2048, 7168, 8192, 6, 8196}) {
    for (DType dtype : {DType::kF32, DType::kBF16}) {
      const int rows = 5, out_rows = 3;
      const std::vector<float> x = uniform(static_cast<size_t>(rows) * dim, 2.f, rng);
      const std::vector<float> w = uniform(dim, 1.f, rng);
      const std::vector<int32_t> index = {4, 0, 2};
      const float eps = 1e-6f;
      std::vector<float> want(static_cast<size_t>(out_rows) * dim);
      for (int r = 0; r < out_rows; ++r) {
        const float* xr = x.data() + static_cast<size_t>(index[r]) * dim;
        double ss = 0;
        for (int i = 0; i < dim; ++i) ss += static_cast<double>(xr[i]) * xr[i];
        const double inv = 1.0 / std::sqrt(ss / dim + eps);
        for (int i = 0; i < dim; ++i) want[static_cast<size_t>(r) * dim + i] = xr[i] * inv * w[i];
      }
      auto x_d = to_device(x, DType::kF32);
      auto w_d = to_device(w, DType::kF32);
      auto index_d = to_device_raw(index);
      auto out_d = cuda::DeviceBuffer::create(want.size() * dtype_size(dtype));
      ASSERT_TRUE(out_d.ok());
      ASSERT_EQ(cuda::rms_norm(dtype, x_d.as<float>(), index_d.as<int32_t>(), w_d.as<float>(),
                               out_rows, dim, eps, out_d.value().data(), nullptr),
                cudaSuccess);
      ASSERT_EQ(cudaDeviceSynchronize(), cudaSuccess);
      const double err = rel_l2(to_host(out_d.value().data(), want.size(), dtype), want);
      EXPECT_LT(err, dtype == DType::kBF16 ? 5e-3 : 1e-6) << "dim " << dim;
    }
  }
}

// gemv_nt (Blas::linear's decode path) against float64 math on the same bf16 values:
// every row count, a K with a partial last round of loads, accumulating and not.
TEST(CudaGemvTest, MatchesFloat64) {
  FLEX_SKIP_WITHOUT_GPU();
  std::mt19937 rng(3);
  for (int k : {8, 2048, 4104}) {
    for (int n : {1, 37, 1030}) {
      for (int m = 1; m <= cuda::kGemvMaxRows; ++m) {
        const std::vector<float> x = round_bf16(uniform(static_cast<size_t>(m) * k, 1.f, rng));
        const std::vector<float> w = round_bf16(uniform(static_cast<size_t>(n) * k, 1.f, rng));
        const std::vector<float> y0 = uniform(static_cast<size_t>(m) * n, 1.f, rng);
        for (bool accumulate : {false, true}) {
          std::vector<float> want(y0.size());
          for (int r = 0; r < m; ++r) {
            for (int c = 0; c < n; ++c) {
              double sum = accumulate ? y0[static_cast<size_t>(r) * n + c] : 0.0;
              for (int i = 0; i < k; ++i) {
                sum += static_cast<double>(x[static_cast<size_t>(r) * k + i]) *
                       w[static_cast<size_t>(c) * k + i];
              }
              want[static_cast<size_t>(r) * n + c] = static_cast<float>(sum);
            }
          }
          auto x_d = to_device(x, DType::kBF16);
          auto w_d = to_device(w, DType::kBF16);
          auto y_d = to_device(y0, DType::kF32);
          ASSERT_EQ(
              cuda::gemv_nt(x_d.data(), m, k, w_d.data(), n, y_d.as<float>(), accumulate, nullptr),
              cudaSuccess);
          ASSERT_EQ(cudaDeviceSynchronize(), cudaSuccess);
          const double err = rel_l2(to_host(y_d.data(), want.size(), DType::kF32), want);
          EXPECT_LT(err, 1e-6) << "m " << m << " k " << k << " n " << n << " acc " << accumulate;
        }
      }
    }
  }
  EXPECT_FALSE(cuda::gemv_nt_fits(DType::kF32, 1, 2048));
  EXPECT_FALSE(cuda::gemv_nt_fits(DType::kBF16, cuda::kGemvMaxRows + 1, 2048));
  EXPECT_FALSE(cuda::gemv_nt_fits(DType::kBF16, 1, 2044));
}

// gemv_norm_nt (the RMSNorm inside the GEMV) against rms_norm and then gemv_nt: the same
// bits, for one to eight rows, a dimension that is no multiple of the block's loads, and
// DeepSeek-V3's hidden size, over fewer columns than a block per 8 of them would fill the GPU
// with and more (then blocks loop over them); and the shapes it does not take.
TEST(CudaGemvTest, NormInsideEqualsRmsNormThenGemv) {
  FLEX_SKIP_WITHOUT_GPU();
  std::mt19937 rng(9);
  const float eps = 1e-6f;
  for (const auto& [m, k] :
       std::vector<std::pair<int, int>>{{1, 2048}, {2, 2048}, {8, 2048}, {3, 1000}, {3, 7168}}) {
    ASSERT_TRUE(cuda::gemv_norm_nt_fits(m, k)) << m << " x " << k;
    for (int n : {37, 1030, 5000}) {  // 5000: more blocks than the GPU holds (a loop).
      const std::vector<float> x = uniform(static_cast<size_t>(m) * k, 2.f, rng);
      const std::vector<float> nw = uniform(k, 1.f, rng);
      const std::vector<float> w = round_bf16(uniform(static_cast<size_t>(n) * k, 1.f, rng));
      auto x_d = to_device(x, DType::kF32);
      auto nw_d = to_device(nw, DType::kF32);
      auto w_d = to_device(w, DType::kBF16);
      auto h_d = cuda::DeviceBuffer::create(static_cast<size_t>(m) * k * 2);
      auto y_fused = cuda::DeviceBuffer::create(static_cast<size_t>(m) * n * sizeof(float));
      auto y_plain = cuda::DeviceBuffer::create(static_cast<size_t>(m) * n * sizeof(float));
      ASSERT_TRUE(h_d.ok() && y_fused.ok() && y_plain.ok());
      ASSERT_EQ(cuda::gemv_norm_nt(x_d.as<float>(), nw_d.as<float>(), eps, m, k, w_d.data(), n,
                                   y_fused.value().as<float>(), false, nullptr),
                cudaSuccess);
      ASSERT_EQ(cuda::rms_norm(DType::kBF16, x_d.as<float>(), nullptr, nw_d.as<float>(), m, k, eps,
                               h_d.value().data(), nullptr),
                cudaSuccess);
      ASSERT_EQ(cuda::gemv_nt(h_d.value().data(), m, k, w_d.data(), n, y_plain.value().as<float>(),
                              false, nullptr),
                cudaSuccess);
      ASSERT_EQ(cudaDeviceSynchronize(), cudaSuccess);
      const size_t count = static_cast<size_t>(m) * n;
      EXPECT_EQ(to_host(y_fused.value().data(), count, DType::kF32),
                to_host(y_plain.value().data(), count, DType::kF32))
          << "m " << m << " k " << k << " n " << n;
    }
  }
  EXPECT_FALSE(cuda::gemv_norm_nt_fits(8, 4096));  // 64 KB of rows.
  EXPECT_FALSE(cuda::gemv_norm_nt_fits(1, 8200));  // Past RMSNorm's registers.
  EXPECT_FALSE(cuda::gemv_norm_nt_fits(1, 2044));
}

// gemv_norm_nt_rows (rows x_stride apart, as DeepSeek's q LoRA norm reads them from the
// kv_a output) into f32 and bf16 against rms_norm_rows and then gemv_nt (bf16: rounded
// once from the same f32 sums); gemv_swiglu_nt against silu_mul and then gemv_nt. The
// same bits; and the shapes they do not take.
TEST(CudaGemvTest, ProloguesInsideEqualKernelsBefore) {
  FLEX_SKIP_WITHOUT_GPU();
  std::mt19937 rng(10);
  const float eps = 1e-6f;
  for (const auto& [m, k, stride, n] : std::vector<std::tuple<int, int, int, int>>{
           {1, 1536, 2112, 1030},
           {2, 1536, 2112, 1030},
           {1, 2048, 2048, 1030},
           {3, 1000, 1004, 1030},
           {2, 1536, 2112, 4100}}) {  // 4100: blocks loop over columns.
    const std::vector<float> x = uniform(static_cast<size_t>(m) * stride, 2.f, rng);
    const std::vector<float> nw = uniform(k, 1.f, rng);
    const std::vector<float> w = round_bf16(uniform(static_cast<size_t>(n) * k, 1.f, rng));
    auto x_d = to_device(x, DType::kF32);
    auto nw_d = to_device(nw, DType::kF32);
    auto w_d = to_device(w, DType::kBF16);
    auto h_d = cuda::DeviceBuffer::create(static_cast<size_t>(m) * k * 2);
    auto y_plain = cuda::DeviceBuffer::create(static_cast<size_t>(m) * n * sizeof(float));
    auto y_f32 = cuda::DeviceBuffer::create(static_cast<size_t>(m) * n * sizeof(float));
    auto y_bf16 = cuda::DeviceBuffer::create(static_cast<size_t>(m) * n * 2);
    ASSERT_TRUE(h_d.ok() && y_plain.ok() && y_f32.ok() && y_bf16.ok());
    ASSERT_EQ(cuda::rms_norm_rows(DType::kBF16, x_d.as<float>(), stride, nw_d.as<float>(), m, k,
                                  eps, h_d.value().data(), nullptr),
              cudaSuccess);
    ASSERT_EQ(cuda::gemv_nt(h_d.value().data(), m, k, w_d.data(), n, y_plain.value().as<float>(),
                            false, nullptr),
              cudaSuccess);
    ASSERT_EQ(cuda::gemv_norm_nt_rows(x_d.as<float>(), stride, nw_d.as<float>(), eps, m, k,
                                      w_d.data(), n, DType::kF32, y_f32.value().data(), nullptr),
              cudaSuccess);
    ASSERT_EQ(cuda::gemv_norm_nt_rows(x_d.as<float>(), stride, nw_d.as<float>(), eps, m, k,
                                      w_d.data(), n, DType::kBF16, y_bf16.value().data(), nullptr),
              cudaSuccess);
    ASSERT_EQ(cudaDeviceSynchronize(), cudaSuccess);
    const size_t count = static_cast<size_t>(m) * n;
    const std::vector<float> plain = to_host(y_plain.value().data(), count, DType::kF32);
    EXPECT_EQ(to_host(y_f32.value().data(), count, DType::kF32), plain)
        << "m " << m << " k " << k << " stride " << stride << " n " << n;
    EXPECT_EQ(to_host(y_bf16.value().data(), count, DType::kBF16), round_bf16(plain))
        << "m " << m << " k " << k << " stride " << stride << " n " << n;
    // The normalised rows themselves against float64 (rms_norm_rows' own check).
    const std::vector<float> h =
        to_host(h_d.value().data(), static_cast<size_t>(m) * k, DType::kBF16);
    std::vector<float> want(h.size());
    for (int r = 0; r < m; ++r) {
      double ss = 0.0;
      for (int i = 0; i < k; ++i) ss += static_cast<double>(x[r * stride + i]) * x[r * stride + i];
      const double inv = 1.0 / std::sqrt(ss / k + eps);
      for (int i = 0; i < k; ++i)
        want[r * k + i] = static_cast<float>(x[r * stride + i] * inv * nw[i]);
    }
    EXPECT_LT(rel_l2(h, want), 5e-3);
  }
  EXPECT_EQ(cuda::gemv_norm_nt_rows(nullptr, 1002, nullptr, eps, 1, 1000, nullptr, 8, DType::kF32,
                                    nullptr, nullptr),
            cudaErrorInvalidValue);  // A stride that breaks the float4 loads.

  for (const auto& [m, inter, n] : std::vector<std::tuple<int, int, int>>{
           {1, 2816, 777}, {2, 1408, 777}, {2, 1000, 777}, {2, 1408, 4100}}) {  // 4100: a loop.
    for (const bool accumulate : {false, true}) {
      const std::vector<float> gu = uniform(static_cast<size_t>(m) * 2 * inter, 4.f, rng);
      const std::vector<float> w = round_bf16(uniform(static_cast<size_t>(n) * inter, 1.f, rng));
      const std::vector<float> y0 = uniform(static_cast<size_t>(m) * n, 1.f, rng);
      auto gu_d = to_device(gu, DType::kF32);
      auto w_d = to_device(w, DType::kBF16);
      auto act = cuda::DeviceBuffer::create(static_cast<size_t>(m) * inter * 2);
      auto y_inside = to_device(y0, DType::kF32);
      auto y_before = to_device(y0, DType::kF32);
      ASSERT_TRUE(act.ok());
      ASSERT_TRUE(cuda::gemv_swiglu_nt_fits(m, inter));
      ASSERT_EQ(cuda::gemv_swiglu_nt(gu_d.as<float>(), m, inter, w_d.data(), n,
                                     y_inside.as<float>(), accumulate, nullptr),
                cudaSuccess);
      ASSERT_EQ(
          cuda::silu_mul(DType::kBF16, gu_d.as<float>(), m, inter, act.value().data(), nullptr),
          cudaSuccess);
      ASSERT_EQ(cuda::gemv_nt(act.value().data(), m, inter, w_d.data(), n, y_before.as<float>(),
                              accumulate, nullptr),
                cudaSuccess);
      ASSERT_EQ(cudaDeviceSynchronize(), cudaSuccess);
      const size_t count = static_cast<size_t>(m) * n;
      EXPECT_EQ(to_host(y_inside.data(), count, DType::kF32),
                to_host(y_before.data(), count, DType::kF32))
          << "m " << m << " inter " << inter << " accumulate " << accumulate;
    }
  }
  EXPECT_FALSE(cuda::gemv_swiglu_nt_fits(2, 18432));  // 72 KB of rows.
  EXPECT_FALSE(cuda::gemv_swiglu_nt_fits(1, 1004));   // Not a multiple of 8.
}

// A chain of programmatic dependent launches on one stream, as a batch-1 decode layer
// has them (pdl.cuh): h = rmsnorm(x); x += h w1^T; h = rmsnorm(x); y = h w2^T. Each
// kernel reads what the one before it wrote (and RMSNorm rewrites h while the GEMV
// before it reads it), so a wait out of place shows as a wrong y; against float64 with
// the same bf16 roundings of h.
TEST(CudaPdlTest, DecodeChainMatchesFloat64) {
  FLEX_SKIP_WITHOUT_GPU();
  const int H = 2048, N = 1536;
  std::mt19937 rng(23);
  const std::vector<float> x0 = uniform(H, 1.f, rng), g1 = uniform(H, 1.f, rng),
                           g2 = uniform(H, 1.f, rng);
  const std::vector<float> w1 = round_bf16(uniform(static_cast<size_t>(H) * H, 0.05f, rng));
  const std::vector<float> w2 = round_bf16(uniform(static_cast<size_t>(N) * H, 0.05f, rng));
  auto norm = [&](const std::vector<double>& v, const std::vector<float>& g) {
    double ss = 0;
    for (double e : v) ss += e * e;
    const double inv = 1.0 / std::sqrt(ss / H + 1e-6);
    std::vector<float> h(H);
    for (int i = 0; i < H; ++i) h[i] = static_cast<float>(v[i] * inv * g[i]);
    return round_bf16(std::move(h));
  };
  std::vector<double> x(x0.begin(), x0.end());
  std::vector<float> h = norm(x, g1);
  for (int r = 0; r < H; ++r) {
    for (int i = 0; i < H; ++i)
      x[r] += static_cast<double>(h[i]) * w1[static_cast<size_t>(r) * H + i];
  }
  h = norm(x, g2);
  std::vector<float> want(N);
  for (int c = 0; c < N; ++c) {
    double sum = 0;
    for (int i = 0; i < H; ++i)
      sum += static_cast<double>(h[i]) * w2[static_cast<size_t>(c) * H + i];
    want[c] = static_cast<float>(sum);
  }
  auto x_d = to_device(x0, DType::kF32);
  auto g1_d = to_device(g1, DType::kF32);
  auto g2_d = to_device(g2, DType::kF32);
  auto w1_d = to_device(w1, DType::kBF16);
  auto w2_d = to_device(w2, DType::kBF16);
  auto h_d = cuda::DeviceBuffer::create(H * 2);
  auto y_d = cuda::DeviceBuffer::create(N * 4);
  ASSERT_TRUE(h_d.ok() && y_d.ok());
  auto stream = cuda::Stream::create();
  ASSERT_TRUE(stream.ok());
  cudaStream_t s = stream.value().get();
  for (int rep = 0; rep < 3; ++rep) {  // The same chain again: x starts over.
    ASSERT_EQ(cudaMemcpyAsync(x_d.data(), x0.data(), H * 4, cudaMemcpyHostToDevice, s),
              cudaSuccess);
    ASSERT_EQ(cuda::rms_norm(DType::kBF16, x_d.as<float>(), nullptr, g1_d.as<float>(), 1, H, 1e-6f,
                             h_d.value().data(), s),
              cudaSuccess);
    ASSERT_EQ(cuda::gemv_nt(h_d.value().data(), 1, H, w1_d.data(), H, x_d.as<float>(), true, s),
              cudaSuccess);
    ASSERT_EQ(cuda::rms_norm(DType::kBF16, x_d.as<float>(), nullptr, g2_d.as<float>(), 1, H, 1e-6f,
                             h_d.value().data(), s),
              cudaSuccess);
    ASSERT_EQ(
        cuda::gemv_nt(h_d.value().data(), 1, H, w2_d.data(), N, y_d.value().as<float>(), false, s),
        cudaSuccess);
    ASSERT_EQ(stream.value().synchronize().ok(), true);
    const double err = rel_l2(to_host(y_d.value().data(), N, DType::kF32), want);
    EXPECT_LT(err, 1e-3) << "run " << rep;  // A race gives O(1).
  }
}

// DeepSeek's decode chain of programmatic dependent launches (one token, bf16): kv_a and
// q GEMVs normalising x themselves, head_gemv with the rotary blocks, MLA with splits and
// its merge, head_gemv, o_proj accumulating into x, the dense MLP's gate/up GEMV and the
// SwiGLU GEMV accumulating into x. Launched back to back (each kernel may start while
// its predecessor runs), then each followed by a stream synchronisation: the same bits
// for x and the cache, three times over. A read before a kernel's wait races.
TEST(CudaPdlTest, MlaDecodeChainMatchesStepwise) {
  FLEX_SKIP_WITHOUT_GPU();
  ASSERT_EQ(std::getenv("FLEXPERT_NO_PDL"), nullptr) << "this test covers the PDL chain";
  const int H = 512, nh = 16, dn = 32, dr = 64, r = 128, dv = 32, row = r + dr, I = 256;
  const int a_dim = r + dr, q_head = dn + dr, max_len = 64, pos = 40;
  std::mt19937 rng(29);
  auto bf = [&](size_t n, float scale) { return to_device(uniform(n, scale, rng), DType::kBF16); };
  auto f32 = [&](size_t n, float scale) { return to_device(uniform(n, scale, rng), DType::kF32); };
  auto w_a = bf(static_cast<size_t>(a_dim) * H, 0.05f),
       w_q = bf(size_t{1} * nh * q_head * H, 0.05f);
  auto w_uk = bf(size_t{1} * nh * r * dn, 0.2f), w_uv = bf(size_t{1} * nh * dv * r, 0.1f);
  auto w_o = bf(static_cast<size_t>(H) * nh * dv, 0.05f), w_gu = bf(size_t{2} * I * H, 0.05f);
  auto w_down = bf(static_cast<size_t>(H) * I, 0.05f);
  auto g_in = f32(H, 1.f), g_post = f32(H, 1.f), g_kv = f32(r, 1.f);
  std::vector<float> cosv(max_len * dr / 2), sinv(max_len * dr / 2);
  for (size_t i = 0; i < cosv.size(); ++i) {
    cosv[i] = std::cos(0.01f * static_cast<float>(i));
    sinv[i] = std::sin(0.01f * static_cast<float>(i));
  }
  auto cos_d = to_device(cosv, DType::kF32), sin_d = to_device(sinv, DType::kF32);
  auto pos_d = to_device_raw(std::vector<int32_t>{pos});
  auto slot_d = to_device_raw(std::vector<int32_t>{0});
  const std::vector<float> x0 = uniform(H, 1.f, rng);
  const std::vector<float> cache0 =
      round_bf16(uniform(static_cast<size_t>(max_len) * row, 1.f, rng));
  auto x_d = to_device(x0, DType::kF32);
  auto cache_d = to_device(cache0, DType::kBF16);
  auto cache_init = to_device(cache0, DType::kBF16);
  auto a_d = cuda::DeviceBuffer::create(a_dim * 4),
       q_d = cuda::DeviceBuffer::create(nh * q_head * 2);
  auto lat_q = cuda::DeviceBuffer::create(nh * row * 4),
       lat = cuda::DeviceBuffer::create(nh * r * 2);
  auto attn = cuda::DeviceBuffer::create(nh * dv * 2), gu = cuda::DeviceBuffer::create(2 * I * 4);
  auto split = cuda::DeviceBuffer::create(cuda::mla_attention_split_floats(r) * 4);
  ASSERT_TRUE(a_d.ok() && q_d.ok() && lat_q.ok() && lat.ok() && attn.ok() && gu.ok() && split.ok());
  auto stream = cuda::Stream::create();
  ASSERT_TRUE(stream.ok());
  cudaStream_t s = stream.value().get();
  const cuda::MlaRopeArgs ra{a_d.value().as<float>(),
                             a_dim,
                             g_kv.as<float>(),
                             1e-6f,
                             q_d.value().data(),
                             lat_q.value().as<float>(),
                             cos_d.as<float>(),
                             sin_d.as<float>(),
                             false,
                             pos_d.as<int32_t>(),
                             slot_d.as<int32_t>(),
                             max_len,
                             cache_d.data(),
                             1,
                             nh,
                             dn,
                             dr,
                             r};
  const cuda::HeadGemvArgs uk{
      q_d.value().data(),   nh * q_head, q_head,   w_uk.data(), 1, nh, r, dn,
      lat_q.value().data(), false,       nh * row, row};
  const cuda::HeadGemvArgs uv{lat.value().data(),  nh * r, r,       w_uv.data(), 1, nh, dv, r,
                              attn.value().data(), true,   nh * dv, dv};
  cuda::MlaAttentionArgs ma{lat_q.value().as<float>(),
                            cache_d.data(),
                            pos_d.as<int32_t>(),
                            slot_d.as<int32_t>(),
                            1,
                            nh,
                            r,
                            dr,
                            max_len,
                            0.1f,
                            lat.value().data()};
  ma.split_scratch = split.value().as<float>();
  ma.split_capacity = cuda::mla_attention_split_floats(r);
  ASSERT_GT(cuda::mla_attention_splits(DType::kBF16, ma), 1) << "the merge is in the chain";
  auto run = [&](bool stepwise) {
    std::vector<cudaError_t> e;
    auto step = [&](cudaError_t err) {
      e.push_back(err);
      if (stepwise) e.push_back(cudaStreamSynchronize(s));
    };
    EXPECT_EQ(cudaMemcpyAsync(x_d.data(), x0.data(), H * 4, cudaMemcpyHostToDevice, s),
              cudaSuccess);
    EXPECT_EQ(cudaMemcpyAsync(cache_d.data(), cache_init.data(), cache0.size() * 2,
                              cudaMemcpyDeviceToDevice, s),
              cudaSuccess);
    EXPECT_EQ(cudaStreamSynchronize(s), cudaSuccess);
    float* x = x_d.as<float>();
    step(cuda::gemv_norm_nt(x, g_in.as<float>(), 1e-6f, 1, H, w_a.data(), a_dim,
                            a_d.value().as<float>(), false, s));
    step(cuda::gemv_norm_nt_rows(x, H, g_in.as<float>(), 1e-6f, 1, H, w_q.data(), nh * q_head,
                                 DType::kBF16, q_d.value().data(), s));
    step(cuda::head_gemv(uk, s, &ra));
    step(cuda::mla_attention(DType::kBF16, ma, s));
    step(cuda::head_gemv(uv, s));
    step(cuda::gemv_nt(attn.value().data(), 1, nh * dv, w_o.data(), H, x, true, s));
    step(cuda::gemv_norm_nt(x, g_post.as<float>(), 1e-6f, 1, H, w_gu.data(), 2 * I,
                            gu.value().as<float>(), false, s));
    step(cuda::gemv_swiglu_nt(gu.value().as<float>(), 1, I, w_down.data(), H, x, true, s));
    EXPECT_EQ(cudaStreamSynchronize(s), cudaSuccess);
    for (cudaError_t err : e) EXPECT_EQ(err, cudaSuccess);
    std::vector<float> out = to_host(x_d.data(), H, DType::kF32);
    const std::vector<float> c = to_host(cache_d.data(), cache0.size(), DType::kBF16);
    out.insert(out.end(), c.begin(), c.end());
    return out;
  };
  const std::vector<float> want = run(true);
  EXPECT_GT(rel_l2(std::vector<float>(want.begin(), want.begin() + H), x0), 1e-3)
      << "the chain changed x";
  for (int rep = 0; rep < 3; ++rep) EXPECT_EQ(run(false), want) << "run " << rep;
}

INSTANTIATE_TEST_SUITE_P(HeadDims, CudaAttentionTest,
                         ::testing::Values(std::make_pair(DType::kF32, 64),
                                           std::make_pair(DType::kF32, 128),
                                           std::make_pair(DType::kBF16, 128),
                                           std::make_pair(DType::kBF16, 32)));

TEST(CudaArgmaxTest, MatchesHostArgmax) {
  FLEX_SKIP_WITHOUT_GPU();
  std::mt19937 rng(std::random_device{}());
  const float inf = std::numeric_limits<float>::infinity();
  const float nan = std::numeric_limits<float>::quiet_NaN();
  for (int vocab : {1, 7, 4097, 151936}) {
    std::vector<std::vector<float>> rows;
    std::normal_distribution<float> normal(0.f, 3.f);
    std::uniform_int_distribution<int> few(-2, 1);
    for (int r = 0; r < 3; ++r) {  // Random rows.
      rows.emplace_back(vocab);
      for (float& x : rows.back()) x = normal(rng);
    }
    rows.emplace_back(vocab);  // Ties: the maximum repeats across blocks.
    for (float& x : rows.back()) x = static_cast<float>(few(rng));
    rows.emplace_back(vocab, -inf);
    rows.emplace_back(vocab, nan);
    rows.emplace_back(vocab, -0.f);  // -0 and +0 tie: the lowest index wins.
    rows.back()[vocab - 1] = 0.f;
    rows.emplace_back(vocab);  // NaN first, the maximum last.
    for (float& x : rows.back()) x = normal(rng);
    rows.back()[0] = nan;
    rows.back()[vocab - 1] = 100.f;
    std::vector<float> flat;
    for (const auto& r : rows) flat.insert(flat.end(), r.begin(), r.end());
    const int R = static_cast<int>(rows.size());
    cuda::DeviceBuffer logits = to_device(flat, DType::kF32);
    auto keys = cuda::DeviceBuffer::create(R * sizeof(unsigned long long));
    ASSERT_TRUE(keys.ok());
    ASSERT_EQ(cuda::argmax_rows(logits.as<float>(), R, vocab, keys.value().as<unsigned long long>(),
                                nullptr),
              cudaSuccess);
    std::vector<unsigned long long> got(R);
    ASSERT_EQ(cudaMemcpy(got.data(), keys.value().data(), R * sizeof(unsigned long long),
                         cudaMemcpyDeviceToHost),
              cudaSuccess);
    for (int r = 0; r < R; ++r) {
      EXPECT_EQ(cuda::argmax_key_index(got[r]), kernels::argmax(rows[r].data(), vocab))
          << "vocab " << vocab << " row " << r;
    }
  }
}

// sample_rows against the host's sample_softmax on the same logits and draws: several
// 4096-id chunks per row, temperatures from peaked to flat, draws at both ends.
// sample_rows over `logits` (argmax_rows' keys given): draw i from row rows[i].
std::vector<int32_t> sample_on_device(const cuda::DeviceBuffer& logits, int vocab,
                                      const cuda::DeviceBuffer& keys,
                                      const std::vector<int32_t>& rows,
                                      const std::vector<double>& inv_t,
                                      const std::vector<double>& u01,
                                      const std::vector<int32_t>* top_k = nullptr,
                                      const std::vector<float>* top_p = nullptr) {
  const int n = static_cast<int>(rows.size());
  cuda::DeviceBuffer d_rows = to_device_raw(rows), d_inv_t = to_device_raw(inv_t),
                     d_u01 = to_device_raw(u01);
  cuda::DeviceBuffer d_k = top_k != nullptr ? to_device_raw(*top_k) : cuda::DeviceBuffer(),
                     d_p = top_p != nullptr ? to_device_raw(*top_p) : cuda::DeviceBuffer();
  auto partials = cuda::DeviceBuffer::create(n * cuda::sample_rows_chunks(vocab) * sizeof(double));
  auto tokens = cuda::DeviceBuffer::create(n * sizeof(int32_t));
  EXPECT_TRUE(partials.ok() && tokens.ok());
  if (!partials.ok() || !tokens.ok()) return {};
  cuda::SampleRowsArgs a;
  a.logits = logits.as<float>();
  a.vocab = vocab;
  a.keys = keys.as<unsigned long long>();
  a.rows = d_rows.as<int32_t>();
  a.inv_temperature = d_inv_t.as<double>();
  a.u01 = d_u01.as<double>();
  a.n = n;
  a.partials = partials.value().as<double>();
  a.tokens = tokens.value().as<int32_t>();
  a.top_k = d_k.as<int32_t>();
  a.top_p = d_p.as<float>();
  EXPECT_EQ(cuda::sample_rows(a, nullptr), cudaSuccess);
  std::vector<int32_t> got(n);
  EXPECT_EQ(
      cudaMemcpy(got.data(), tokens.value().data(), n * sizeof(int32_t), cudaMemcpyDeviceToHost),
      cudaSuccess);
  return got;
}

TEST(CudaArgmaxTest, SampleRowsMatchesHostSampling) {
  FLEX_SKIP_WITHOUT_GPU();
  std::mt19937 rng(std::random_device{}());
  std::normal_distribution<float> normal(0.f, 3.f);
  std::uniform_real_distribution<double> uniform(0.0, 1.0);
  for (int vocab : {100, 10000, 151936}) {
    const int R = 6;
    std::vector<float> flat(static_cast<size_t>(R) * vocab);
    for (float& x : flat) x = normal(rng);
    cuda::DeviceBuffer logits = to_device(flat, DType::kF32);
    auto keys = cuda::DeviceBuffer::create(R * sizeof(unsigned long long));
    ASSERT_TRUE(keys.ok());
    ASSERT_EQ(cuda::argmax_rows(logits.as<float>(), R, vocab, keys.value().as<unsigned long long>(),
                                nullptr),
              cudaSuccess);
    // Draw i samples row rows[i] (row 4 twice, row 1 not at all).
    const std::vector<int32_t> rows = {0, 2, 3, 4, 4, 5};
    const std::vector<double> temps = {0.05, 0.5, 1.0, 2.0, 2.0, 7.0};
    std::vector<double> inv_t,
        u01 = {0.0, uniform(rng), uniform(rng), uniform(rng), 0.999999, uniform(rng)};
    for (double t : temps) inv_t.push_back(1.0 / static_cast<float>(t));  // As the models do.
    const int n = static_cast<int>(rows.size());
    const std::vector<int32_t> got =
        sample_on_device(logits, vocab, keys.value(), rows, inv_t, u01);
    ASSERT_EQ(got.size(), rows.size());
    for (int i = 0; i < n; ++i) {
      const float* row = flat.data() + static_cast<size_t>(rows[i]) * vocab;
      EXPECT_EQ(got[i], kernels::sample_softmax(row, vocab, static_cast<float>(temps[i]), u01[i]))
          << "vocab " << vocab << " draw " << i << " u " << u01[i];
    }
  }
}

// Draws with top-k / top-p cuts (sample_truncated_kernel) against the host's
// kernels::sample_truncated, beside plain draws in the same launch: normal logits, logits
// with many ties (multiples of 1/8), and rows with NaN, -inf and -0; cuts from 1 to past
// the vocabulary, top_p from 0.05 to 1, each draw by a block and by clusters of 2, 4 and
// 8 blocks; a mismatch is allowed only within rounding of a boundary (then both tokens are
// neighbours in the draw order), and must stay rare.
TEST(CudaArgmaxTest, SampleRowsWithCutsMatchHostSampling) {
  FLEX_SKIP_WITHOUT_GPU();
  std::mt19937 rng(23);
  std::normal_distribution<float> normal(0.f, 3.f);
  std::uniform_real_distribution<double> uniform(0.0, 1.0);
  int draws = 0, mismatches = 0;
  for (int vocab : {7, 100, 5000, 151936}) {
    for (int kind = 0; kind < 3; ++kind) {
      const int R = 4;
      std::vector<float> flat(static_cast<size_t>(R) * vocab);
      for (float& x : flat) {
        x = kind == 1 ? static_cast<float>(static_cast<int>(rng() % 48)) / 8.f : normal(rng);
      }
      if (kind == 2) {
        // Row 3 all NaN (no weight anywhere), the others with a few odd values.
        std::fill(flat.begin() + 3 * static_cast<size_t>(vocab), flat.end(),
                  std::numeric_limits<float>::quiet_NaN());
        for (int r = 0; r < R - 1; ++r) {
          float* row = flat.data() + static_cast<size_t>(r) * vocab;
          row[rng() % vocab] = std::numeric_limits<float>::quiet_NaN();
          row[rng() % vocab] = -std::numeric_limits<float>::infinity();
          row[rng() % vocab] = -0.f;
          row[rng() % vocab] = 0.f;
        }
      }
      cuda::DeviceBuffer logits = to_device(flat, DType::kF32);
      auto keys = cuda::DeviceBuffer::create(R * sizeof(unsigned long long));
      ASSERT_TRUE(keys.ok());
      ASSERT_EQ(cuda::argmax_rows(logits.as<float>(), R, vocab,
                                  keys.value().as<unsigned long long>(), nullptr),
                cudaSuccess);
      std::vector<int32_t> rows, top_k;
      std::vector<float> top_p, temps;
      std::vector<double> inv_t, u01;
      for (int i = 0; i < 24; ++i) {
        rows.push_back(static_cast<int32_t>(rng() % R));
        const int kc = static_cast<int>(rng() % 4);
        top_k.push_back(kc == 0 ? 0 : kc == 1 ? 1 : kc == 2 ? 1 + rng() % 64 : 1 + rng() % vocab);
        const int pc = static_cast<int>(rng() % 3);
        top_p.push_back(pc == 0 ? 1.f : 0.05f + static_cast<float>(rng() % 95) / 100.f);
        const bool cut = (top_k.back() > 0 && top_k.back() < vocab) || top_p.back() < 1.f;
        if (kind == 2 && rows.back() == 3 && !cut) {
          top_k.back() = 1 + static_cast<int32_t>(rng() % 4);  // Plain draws need a number.
        }
        temps.push_back(0.2f + static_cast<float>(rng() % 30) / 10.f);
        inv_t.push_back(1.0 / temps.back());
        u01.push_back(i == 0 ? 0.0 : i == 1 ? 0.999999 : uniform(rng));
      }
      const int n = static_cast<int>(rows.size());
      // The 24 draws in launches of 80, 48, 24 and 12 (draw i at every i + 24 m): fewer
      // draws get more blocks each (on the H200's 132 SMs one block, then clusters of 2,
      // 4 and 8), so every draw is checked every way.
      std::vector<int32_t> want(n);
      for (int i = 0; i < n; ++i) {
        const float* row = flat.data() + static_cast<size_t>(rows[i]) * vocab;
        want[i] = kernels::sample_truncated(row, vocab, temps[i], top_k[i], top_p[i], u01[i]);
      }
      for (int size : {80, 48, 24, 12}) {
        for (int first = 0; first == 0 || first + size <= n; first += size) {
          const int count = size;
          auto take = [&](const auto& v) {
            std::decay_t<decltype(v)> out;
            for (int j = 0; j < count; ++j) out.push_back(v[(first + j) % n]);
            return out;
          };
          const auto k = take(top_k);
          const auto p = take(top_p);
          const std::vector<int32_t> got = sample_on_device(logits, vocab, keys.value(), take(rows),
                                                            take(inv_t), take(u01), &k, &p);
          ASSERT_EQ(got.size(), static_cast<size_t>(count));
          for (int j = 0; j < count; ++j) {
            const int i = (first + j) % n;
            ++draws;
            if (got[j] == want[i]) continue;
            ++mismatches;
            // Only a neighbour within rounding: the host at a nudged draw gives the device's.
            const float* row = flat.data() + static_cast<size_t>(rows[i]) * vocab;
            const int32_t lo = kernels::sample_truncated(row, vocab, temps[i], top_k[i], top_p[i],
                                                         std::max(0.0, u01[i] - 1e-9));
            const int32_t hi = kernels::sample_truncated(row, vocab, temps[i], top_k[i], top_p[i],
                                                         std::min(0.9999999999, u01[i] + 1e-9));
            EXPECT_TRUE(got[j] == lo || got[j] == hi)
                << "vocab " << vocab << " kind " << kind << " draw " << i << " in a launch of "
                << count << ": device " << got[j] << ", host " << want[i] << " (top_k " << top_k[i]
                << ", top_p " << top_p[i] << ", T " << temps[i] << ", u " << u01[i] << ")";
          }
        }
      }
    }
  }
  std::printf("  %d draws with cuts, %d within rounding of a boundary\n", draws, mismatches);
  EXPECT_LE(mismatches, draws / 50);
}

TEST(CudaDeviceTest, ParsesDeviceStrings) {
  EXPECT_EQ(cuda::parse_device("gpu").status().code(), StatusCode::kInvalidArgument);
  EXPECT_EQ(cuda::parse_device("cuda:x").status().code(), StatusCode::kInvalidArgument);
  EXPECT_EQ(cuda::parse_device("cuda:99").status().code(), StatusCode::kInvalidArgument);
  if (cuda::device_available()) {
    EXPECT_EQ(cuda::parse_device("cuda").value(), 0);
    EXPECT_EQ(cuda::parse_device("cuda:0").value(), 0);
  } else {
    EXPECT_EQ(cuda::parse_device("cuda").status().code(), StatusCode::kInvalidArgument);
  }
}

TEST(CudaDeviceTest, RoutingTablesListReplicasInSlotOrder) {
  const cuda::RoutingTables t = cuda::build_routing_tables({2, -1, 0, 2, 1, 0}, 3);
  EXPECT_EQ(t.rep_count, (std::vector<int32_t>{2, 1, 2}));
  EXPECT_EQ(t.rep_start, (std::vector<int32_t>{0, 2, 3}));
  EXPECT_EQ(std::vector<int32_t>(t.rep_slots.begin(), t.rep_slots.begin() + 5),
            (std::vector<int32_t>{2, 5, 4, 0, 3}));
}

}  // namespace
}  // namespace flexpert
