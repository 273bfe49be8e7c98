// SPDX-License-Identifier: Apache-2.0
// bench_serve against a live server over the tiny model: exact token counts, no
// failures, every field of the result present.
#include "serve/bench_serve.h"

#include "serve/http_server.h"
#include "serve/local_engine.h"
#include "serve_test_util.h"

namespace flexpert::testing {
namespace {

TEST(BenchServeTest, RunsAgainstALocalServer) {
  auto engine = LocalEngine::create(kTinyModelDir, LocalEngineOptions{});
  ASSERT_TRUE(engine.ok());
  HttpOptions http;
  http.port = 0;
  HttpServer server(**engine, http);
  ASSERT_TRUE(server.start().ok());

  for (bool streaming : {true, false}) {
    BenchServeOptions options;
    options.url = "http://127.0.0.1:" + std::to_string(server.port());
    options.concurrency = 4;
    options.num_requests = 8;
    options.prompt_len = 8;
    options.max_tokens = 6;
    options.seed = 3;
    options.stream = streaming;
    int last_done = 0;
    auto result = bench_serve(options, [&](int done, int total) {
      EXPECT_EQ(total, 8);
      EXPECT_GE(done, last_done);
      last_done = done;
    });
    ASSERT_TRUE(result.ok()) << result.status().to_string();
    const json& r = result.value();
    EXPECT_EQ(last_done, 8);
    EXPECT_EQ(r["failed"], 0) << r.dump(2);
    EXPECT_EQ(r["completed"], 8);
    EXPECT_EQ(r["vocab_size"], 512);  // Asked from /v1/status.
    EXPECT_EQ(r["output_tokens"], 8 * 6);
    EXPECT_EQ(r["prompt_tokens"], 8 * 8);
    EXPECT_GT(r["requests_per_s"].get<double>(), 0);
    EXPECT_GT(r["output_tokens_per_s"].get<double>(), 0);
    EXPECT_EQ(r["ttft_s"]["count"], 8);
    // One gap per token after the first event; tokens that the server sent in one
    // event with the first token have no gap of their own.
    if (streaming) {
      EXPECT_GT(r["itl_s"]["count"].get<int>(), 0);
      EXPECT_LE(r["itl_s"]["count"].get<int>(), 8 * 5);
    } else {
      EXPECT_EQ(r["itl_s"]["count"], 0);
    }
    for (const char* key : {"ttft_s", "latency_s"}) {
      const json& s = r[key];
      EXPECT_GT(s["mean"].get<double>(), 0) << key;
      EXPECT_LE(s["p50"].get<double>(), s["p90"].get<double>()) << key;
      EXPECT_LE(s["p90"].get<double>(), s["p99"].get<double>()) << key;
      EXPECT_LE(s["p99"].get<double>(), s["max"].get<double>()) << key;
    }
    const std::string table = format_bench_table(r);
    EXPECT_NE(table.find("TTFT"), std::string::npos) << table;
    EXPECT_NE(table.find("8 requests (0 failed)"), std::string::npos) << table;
  }
}

// step_breakdown over two /v1/status answers, against figures worked out by hand.
TEST(BenchServeTest, StepBreakdownPerRankAndOverAll) {
  auto rank = [](int id, uint64_t incarnation, uint64_t steps, double step, double header,
                 double exchange) {
    json r = {{"rank", id},
              {"incarnation", incarnation},
              {"steps", steps},
              {"total_step_ms", step},
              {"total_header_ms", header}};
    if (exchange >= 0) r["total_exchange_ms"] = exchange;
    return r;
  };
  const json before = {{"ranks",
                        {rank(0, 1, 10, 100, 5, 20), rank(1, 1, 10, 120, 6, 30),
                         rank(2, 1, 4, 40, 1, 5), rank(3, 1, 7, 70, 2, 9)}}};
  const json after = {{"ranks",
                       {rank(0, 1, 30, 300, 9, 60), rank(1, 1, 30, 340, 10, 80),
                        rank(2, 2, 9, 90, 2, 10),    // Restarted: left out.
                        rank(3, 1, 7, 70, 2, 9),     // No steps: left out.
                        rank(4, 1, 5, 50, 1, 2)}}};  // Not in `before`: left out.
  const json b = step_breakdown(before, after);
  ASSERT_TRUE(b.is_object()) << b.dump();
  ASSERT_EQ(b["ranks"].size(), 2u) << b.dump(2);
  const json& r0 = b["ranks"][0];
  EXPECT_EQ(r0["rank"], 0);
  EXPECT_EQ(r0["steps"], 20);
  EXPECT_DOUBLE_EQ(r0["step_ms"].get<double>(), 10.0);        // 200 / 20
  EXPECT_DOUBLE_EQ(r0["header_ms"].get<double>(), 0.2);       // 4 / 20
  EXPECT_DOUBLE_EQ(r0["exchange_ms"].get<double>(), 2.0);     // 40 / 20
  EXPECT_DOUBLE_EQ(r0["exchange_share"].get<double>(), 0.2);  // 40 / 200
  const json& r1 = b["ranks"][1];
  EXPECT_DOUBLE_EQ(r1["step_ms"].get<double>(), 11.0);  // 220 / 20
  EXPECT_DOUBLE_EQ(r1["exchange_share"].get<double>(), 50.0 / 220.0);
  const json& all = b["all"];
  EXPECT_EQ(all["steps"], 40);
  EXPECT_DOUBLE_EQ(all["step_ms"].get<double>(), 420.0 / 40);
  EXPECT_DOUBLE_EQ(all["header_ms"].get<double>(), 8.0 / 40);
  EXPECT_DOUBLE_EQ(all["exchange_ms"].get<double>(), 90.0 / 40);
  EXPECT_DOUBLE_EQ(all["exchange_share"].get<double>(), 90.0 / 420);

  // Untimed (no total_exchange_ms): steps only; the table shows dashes.
  const json untimed = step_breakdown({{"ranks", {rank(0, 1, 1, 10, 1, -1)}}},
                                      {{"ranks", {rank(0, 1, 5, 50, 2, -1)}}});
  ASSERT_TRUE(untimed.is_object());
  EXPECT_FALSE(untimed["ranks"][0].contains("exchange_ms"));
  EXPECT_FALSE(untimed["all"].contains("exchange_ms"));
  EXPECT_DOUBLE_EQ(untimed["all"]["step_ms"].get<double>(), 10.0);
  const std::string table = format_bench_table({{"steps", untimed}});
  EXPECT_NE(table.find("step ms"), std::string::npos) << table;
  // Nothing to compare: null (a local engine's status has no totals).
  EXPECT_TRUE(step_breakdown(before, json{{"mode", "local"}}).is_null());
  EXPECT_TRUE(step_breakdown(nullptr, after).is_null());
}

TEST(BenchServeTest, ReportsAnUnreachableServerAndBadOptions) {
  BenchServeOptions options;
  options.url = "http://127.0.0.1:1";  // Nothing listens on port 1.
  auto result = bench_serve(options);
  EXPECT_EQ(result.status().code(), StatusCode::kUnavailable) << result.status().to_string();
  options.concurrency = 0;
  EXPECT_EQ(bench_serve(options).status().code(), StatusCode::kInvalidArgument);
}

}  // namespace
}  // namespace flexpert::testing
