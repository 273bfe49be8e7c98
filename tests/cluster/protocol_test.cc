// SPDX-License-Identifier: Apache-2.0
// SamplingParams, TokenLogprob and Placement as msgpack structures inside control messages:
// every field survives the round trip, a field a sender leaves out keeps its default, and a
// placement that is not one (ragged layers, experts out of range, the wrong slot count) is
// refused by decode() with DataLoss naming the fault.
#include <gtest/gtest.h>

#include <string>
#include <vector>

#include "cluster/protocol.h"

namespace flexpert {
namespace {

SamplingParams every_field_set() {
  SamplingParams p;
  p.temperature = 0.7f;
  p.top_k = 5;
  p.top_p = 0.9f;
  p.seed = 0xfedcba9876543210ull;
  p.max_tokens = 33;
  p.stop_token_ids = {4, 8};
  p.ignore_eos = true;
  p.repetition_penalty = 1.3f;
  p.presence_penalty = -0.5f;
  p.frequency_penalty = 1.25f;
  p.logit_bias = {{7, 100.0f}, {2, -3.5f}};
  p.min_tokens = 3;
  p.logprobs = 20;
  return p;
}

TEST(ProtocolTest, AddRequestCarriesSamplingParamsWhole) {
  proto::AddRequest add;
  add.id = 42;
  add.prompt = {1, 2, 3};
  add.params = every_field_set();
  add.num_generated = 2;
  add.attempt = 1;
  ASSERT_FALSE(add.params == SamplingParams());  // Every field differs from the default...
  auto back = proto::decode<proto::AddRequest>(proto::encode(add));
  ASSERT_TRUE(back.ok()) << back.status().to_string();
  EXPECT_EQ(back->id, 42u);
  EXPECT_EQ(back->prompt, add.prompt);
  EXPECT_TRUE(back->params == add.params);  // ...and comes back.
  EXPECT_EQ(back->num_generated, 2);
  EXPECT_EQ(back->attempt, 1u);
  EXPECT_EQ(back->params.seed, 0xfedcba9876543210ull);
  EXPECT_EQ(back->params.logit_bias[1], (std::pair<int32_t, float>{2, -3.5f}));
}

TEST(ProtocolTest, SamplingParamsIsOneMapWithNamedFields) {
  // A sender that knows only some fields: the rest keep their defaults.
  msgpack::sbuffer buf;
  msgpack::packer<msgpack::sbuffer> pk(buf);
  pk.pack_map(2);
  pk.pack(std::string("id"));
  pk.pack(uint64_t{9});
  pk.pack(std::string("params"));
  pk.pack_map(2);
  pk.pack(std::string("max_tokens"));
  pk.pack(5);
  pk.pack(std::string("logprobs"));
  pk.pack(2);
  auto back = proto::decode<proto::AddRequest>(std::string(buf.data(), buf.size()));
  ASSERT_TRUE(back.ok()) << back.status().to_string();
  SamplingParams want;
  want.max_tokens = 5;
  want.logprobs = 2;
  EXPECT_TRUE(back->params == want);
  // A params value that is not a map is malformed.
  msgpack::sbuffer bad;
  msgpack::packer<msgpack::sbuffer> bk(bad);
  bk.pack_map(1);
  bk.pack(std::string("params"));
  bk.pack(7);
  EXPECT_EQ(proto::decode<proto::AddRequest>(std::string(bad.data(), bad.size())).status().code(),
            StatusCode::kDataLoss);
}

TEST(ProtocolTest, TokenBatchCarriesLogprobs) {
  proto::TokenBatch batch;
  batch.ids = {1, 2};
  batch.tokens = {5, 6};
  batch.finish_reasons = {"", "stop"};
  batch.attempts = {0, 3};
  batch.logprobs = {TokenLogprob{5, -0.25f, {{5, -0.25f}, {9, -1.5f}}}, TokenLogprob{}};
  auto back = proto::decode<proto::TokenBatch>(proto::encode(batch));
  ASSERT_TRUE(back.ok()) << back.status().to_string();
  EXPECT_EQ(back->tokens, batch.tokens);
  EXPECT_EQ(back->logprobs, batch.logprobs);
}

// A placement of 3 layers over 4 experts and 2 ranks x 3 slots: replicas, free slots, and
// layers that differ.
proto::Placement three_layers() {
  return proto::Placement{4, {{0, 1, 2, 3, -1, -1}, {3, 2, -1, 1, 0, 3}, {1, -1, 0, 2, 3, 2}}};
}

std::string bytes(const msgpack::sbuffer& buf) { return std::string(buf.data(), buf.size()); }

// A placement map packed by hand, as another implementation would write it.
void pack_placement(msgpack::packer<msgpack::sbuffer>& pk, int num_experts,
                    const std::vector<std::vector<int>>& maps) {
  pk.pack_map(2);
  pk.pack(std::string("num_experts"));
  pk.pack(num_experts);
  pk.pack(std::string("slot_to_expert"));
  pk.pack_array(static_cast<uint32_t>(maps.size()));
  for (const auto& map : maps) {
    pk.pack_array(static_cast<uint32_t>(map.size()));
    for (int e : map) pk.pack(e);
  }
}

// A map message {"version": 7, "placement": <num_experts, maps>}.
std::string map_message(int num_experts, const std::vector<std::vector<int>>& maps) {
  msgpack::sbuffer buf;
  msgpack::packer<msgpack::sbuffer> pk(buf);
  pk.pack_map(2);
  pk.pack(std::string("version"));
  pk.pack(uint64_t{7});
  pk.pack(std::string("placement"));
  pack_placement(pk, num_experts, maps);
  return bytes(buf);
}

TEST(ProtocolTest, PlacementMessagesRoundTrip) {
  const proto::Placement p = three_layers();
  ASSERT_TRUE(p.check().ok());

  proto::WorkerConfig cfg;
  cfg.rank = 1;
  cfg.max_ranks = 2;
  cfg.slots_per_rank = 3;
  cfg.placement = p;
  cfg.device = "cuda:1";
  cfg.quantization = "fp8";
  cfg.step_timing = true;
  auto cfg_back = proto::decode<proto::WorkerConfig>(proto::encode(cfg));
  ASSERT_TRUE(cfg_back.ok()) << cfg_back.status().to_string();
  EXPECT_EQ(cfg_back->placement.num_experts, 4);
  EXPECT_EQ(cfg_back->placement.slot_to_expert, p.slot_to_expert);
  EXPECT_EQ(cfg_back->slots_per_rank, 3);
  EXPECT_EQ(cfg_back->device, "cuda:1");
  EXPECT_EQ(cfg_back->quantization, "fp8");
  EXPECT_EQ(cfg_back->transport, "shm");
  EXPECT_TRUE(cfg_back->step_timing);
  // Without step timing the report says so (-1), not a zero exchange time.
  EXPECT_FALSE(proto::WorkerConfig{}.step_timing);
  EXPECT_EQ(proto::StepReport{}.total_exchange_ms, -1);
  proto::StepReport report;
  report.steps = 7;
  report.total_step_ms = 12.5;
  report.total_header_ms = 0.25;
  report.total_exchange_ms = 3.5;
  auto report_back = proto::decode<proto::StepReport>(proto::encode(report));
  ASSERT_TRUE(report_back.ok()) << report_back.status().to_string();
  EXPECT_EQ(report_back->steps, 7u);
  EXPECT_EQ(report_back->total_step_ms, 12.5);
  EXPECT_EQ(report_back->total_header_ms, 0.25);
  EXPECT_EQ(report_back->total_exchange_ms, 3.5);

  proto::EpochCommand epoch;
  epoch.epoch = 5;
  epoch.members = {0, 1};
  epoch.addresses = {"a", "b"};
  epoch.placement = p;
  epoch.map_version = 9;
  auto epoch_back = proto::decode<proto::EpochCommand>(proto::encode(epoch));
  ASSERT_TRUE(epoch_back.ok()) << epoch_back.status().to_string();
  EXPECT_EQ(epoch_back->placement.num_experts, 4);
  EXPECT_EQ(epoch_back->placement.slot_to_expert, p.slot_to_expert);
  EXPECT_EQ(epoch_back->map_version, 9u);
  // No placement: the epoch keeps the current one.
  epoch.placement = proto::Placement{};
  epoch_back = proto::decode<proto::EpochCommand>(proto::encode(epoch));
  ASSERT_TRUE(epoch_back.ok()) << epoch_back.status().to_string();
  EXPECT_TRUE(epoch_back->placement.empty());

  auto map_back = proto::decode<proto::MapCommand>(proto::encode(proto::MapCommand{3, p}));
  ASSERT_TRUE(map_back.ok()) << map_back.status().to_string();
  EXPECT_EQ(map_back->version, 3u);
  EXPECT_EQ(map_back->placement.slot_to_expert, p.slot_to_expert);
}

TEST(ProtocolTest, PlacementIsOneMapWithNamedFields) {
  // Packed by hand: the field names and nesting are the wire format.
  const proto::Placement p = three_layers();
  auto back = proto::decode<proto::MapCommand>(map_message(4, p.slot_to_expert));
  ASSERT_TRUE(back.ok()) << back.status().to_string();
  EXPECT_EQ(back->version, 7u);
  EXPECT_EQ(back->placement.num_experts, 4);
  EXPECT_EQ(back->placement.slot_to_expert, p.slot_to_expert);
  // And what encode() writes decodes as that map: the same bytes.
  EXPECT_EQ(proto::encode(proto::MapCommand{7, p}), map_message(4, p.slot_to_expert));
}

// DataLoss, and the message says which fault.
void expect_refused(const Result<proto::MapCommand>& got, const std::string& why) {
  ASSERT_FALSE(got.ok()) << "accepted; want refused for " << why;
  EXPECT_EQ(got.status().code(), StatusCode::kDataLoss) << got.status().to_string();
  EXPECT_NE(got.status().message().find("malformed 'map' message"), std::string::npos)
      << got.status().to_string();
  EXPECT_NE(got.status().message().find(why), std::string::npos) << got.status().to_string();
}

TEST(ProtocolTest, MalformedPlacementsAreRefused) {
  using Maps = std::vector<std::vector<int>>;
  // A layer shorter than layer 0.
  expect_refused(proto::decode<proto::MapCommand>(map_message(4, Maps{{0, 1, 2, 3}, {0, 1, 2}})),
                 "placement layer 1 has 3 slots, layer 0 has 4");
  // An expert at or beyond num_experts, or below the free mark.
  expect_refused(proto::decode<proto::MapCommand>(map_message(4, Maps{{0, 1, 2, 3}, {0, 4, 2, 3}})),
                 "placement layer 1 slot 1 names expert 4, outside [0, 4)");
  expect_refused(proto::decode<proto::MapCommand>(map_message(4, Maps{{0, -2, 1, 2, 3}})),
                 "placement layer 0 slot 1 names expert -2");
  // No experts at all.
  expect_refused(proto::decode<proto::MapCommand>(map_message(0, Maps{{-1, -1}})),
                 "names 0 experts");
  // A map command must carry a placement.
  expect_refused(proto::decode<proto::MapCommand>(map_message(4, Maps{})), "no placement");
  // The JSON string the protocol carried before: not a placement.
  msgpack::sbuffer buf;
  msgpack::packer<msgpack::sbuffer> pk(buf);
  pk.pack_map(1);
  pk.pack(std::string("placement"));
  pk.pack(std::string(R"({"layers": [[0, 1]]})"));
  expect_refused(proto::decode<proto::MapCommand>(bytes(buf)), "malformed 'map' message");
  // Slots that are not integers.
  msgpack::sbuffer text;
  msgpack::packer<msgpack::sbuffer> tk(text);
  tk.pack_map(1);
  tk.pack(std::string("placement"));
  tk.pack_map(2);
  tk.pack(std::string("num_experts"));
  tk.pack(2);
  tk.pack(std::string("slot_to_expert"));
  tk.pack_array(1);
  tk.pack_array(2);
  tk.pack(std::string("0"));
  tk.pack(1.5);
  expect_refused(proto::decode<proto::MapCommand>(bytes(text)), "malformed 'map' message");
}

TEST(ProtocolTest, WorkerConfigPlacementMustCoverEveryRanksSlots) {
  proto::WorkerConfig cfg;
  cfg.max_ranks = 2;
  cfg.slots_per_rank = 3;
  cfg.placement = three_layers();
  ASSERT_TRUE(proto::decode<proto::WorkerConfig>(proto::encode(cfg)).ok());
  // 6 slots on the wire, but 2 ranks x 4 slots were promised.
  cfg.slots_per_rank = 4;
  auto got = proto::decode<proto::WorkerConfig>(proto::encode(cfg));
  ASSERT_FALSE(got.ok());
  EXPECT_EQ(got.status().code(), StatusCode::kDataLoss);
  EXPECT_NE(
      got.status().message().find("placement has 6 slots, max_ranks 2 x slots_per_rank 4 is 8"),
      std::string::npos)
      << got.status().to_string();
  // A config without a placement, and one whose placement is ragged.
  cfg.slots_per_rank = 3;
  cfg.placement = proto::Placement{};
  got = proto::decode<proto::WorkerConfig>(proto::encode(cfg));
  ASSERT_FALSE(got.ok());
  EXPECT_NE(got.status().message().find("no placement"), std::string::npos);
  cfg.placement = three_layers();
  cfg.placement.slot_to_expert[2].pop_back();
  got = proto::decode<proto::WorkerConfig>(proto::encode(cfg));
  ASSERT_FALSE(got.ok());
  EXPECT_NE(got.status().message().find("placement layer 2 has 5 slots, layer 0 has 6"),
            std::string::npos)
      << got.status().to_string();
  // An epoch's placement is checked the same way.
  proto::EpochCommand epoch;
  epoch.placement = three_layers();
  epoch.placement.slot_to_expert[0][5] = 9;
  auto bad_epoch = proto::decode<proto::EpochCommand>(proto::encode(epoch));
  ASSERT_FALSE(bad_epoch.ok());
  EXPECT_EQ(bad_epoch.status().code(), StatusCode::kDataLoss);
  EXPECT_NE(bad_epoch.status().message().find("slot 5 names expert 9"), std::string::npos)
      << bad_epoch.status().to_string();
}

}  // namespace
}  // namespace flexpert
