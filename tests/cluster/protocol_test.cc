// SPDX-License-Identifier: Apache-2.0
// SamplingParams and TokenLogprob as msgpack structures inside control messages: every
// field survives the round trip, and a field a sender leaves out keeps its default.
#include <gtest/gtest.h>

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

}  // namespace
}  // namespace flexpert
