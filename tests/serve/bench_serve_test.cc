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
