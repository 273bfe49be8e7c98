// SPDX-License-Identifier: Apache-2.0
// HttpServer over a real LocalEngine on testdata/qwen3moe-tiny, through a real
// HTTP client: greedy answers match Hugging Face, streamed or not, alone or 32 at
// once; every bad request gets its 4xx JSON error and the server keeps serving;
// health, status and metrics; disconnecting clients; shutdown under load.
#include <arpa/inet.h>
#include <netinet/in.h>
#include <sys/socket.h>
#include <unistd.h>

#include <set>

#include "serve/http_server.h"
#include "serve/local_engine.h"
#include "serve_test_util.h"

namespace flexpert::testing {
namespace {

class HttpTest : public ::testing::Test {
 protected:
  static void SetUpTestSuite() {
    auto engine = LocalEngine::create(kTinyModelDir, LocalEngineOptions{});
    ASSERT_TRUE(engine.ok()) << engine.status().to_string();
    engine_ = std::move(engine).value().release();
    HttpOptions options;
    options.port = 0;
    options.model_name = "qwen3moe-tiny";
    options.max_body_bytes = 64 << 10;
    server_ = new HttpServer(*engine_, options);
    ASSERT_TRUE(server_->start().ok());
  }
  static void TearDownTestSuite() {
    delete server_;
    delete engine_;
  }
  std::unique_ptr<httplib::Client> client() { return make_client(server_->port()); }
  std::string metrics_text() { return get(*client(), "/metrics").text; }

  static LocalEngine* engine_;
  static HttpServer* server_;
};
LocalEngine* HttpTest::engine_ = nullptr;
HttpServer* HttpTest::server_ = nullptr;

json greedy_request(const RefPrompt& p) {
  return {
      {"model", "qwen3moe-tiny"}, {"prompt", p.input_ids}, {"max_tokens", 16}, {"temperature", 0}};
}

TEST_F(HttpTest, GreedyCompletionsMatchReference) {
  auto c = client();
  for (const RefPrompt& p : load_reference()) {
    HttpReply r = post(*c, "/v1/completions", greedy_request(p));
    ASSERT_EQ(r.status, 200) << r.text;
    EXPECT_EQ(r.content_type, "application/json");
    EXPECT_EQ(r.body["object"], "text_completion");
    EXPECT_EQ(r.body["model"], "qwen3moe-tiny");
    EXPECT_EQ(r.body["id"].get<std::string>().rfind("cmpl-", 0), 0u);
    EXPECT_GT(r.body["created"].get<int64_t>(), 1600000000);
    const json& choice = r.body["choices"][0];
    EXPECT_EQ(choice["index"], 0);
    EXPECT_EQ(choice["text"], "");
    EXPECT_EQ(choice["token_ids"].get<std::vector<int32_t>>(), p.greedy);
    EXPECT_EQ(choice["finish_reason"], "length");
    EXPECT_EQ(r.body["usage"]["prompt_tokens"], p.input_ids.size());
    EXPECT_EQ(r.body["usage"]["completion_tokens"], 16);
    EXPECT_EQ(r.body["usage"]["total_tokens"], p.input_ids.size() + 16);
  }
  // The batched form with one prompt is the same request.
  const RefPrompt p = load_reference()[1];
  json body = greedy_request(p);
  body["prompt"] = json::array({p.input_ids});
  HttpReply r = post(*c, "/v1/completions", body);
  ASSERT_EQ(r.status, 200) << r.text;
  EXPECT_EQ(r.body["choices"][0]["token_ids"].get<std::vector<int32_t>>(), p.greedy);
}

TEST_F(HttpTest, StreamingMatchesReferenceAndEndsWithDone) {
  auto c = client();
  for (const RefPrompt& p : load_reference()) {
    StreamReply s = stream(*c, greedy_request(p));
    ASSERT_EQ(s.status, 200) << s.raw;
    EXPECT_EQ(s.content_type, "text/event-stream");
    EXPECT_EQ(s.tokens, p.greedy);
    EXPECT_TRUE(s.done_last) << s.raw;
    ASSERT_FALSE(s.chunks.empty());
    for (size_t i = 0; i + 1 < s.chunks.size(); ++i) {
      EXPECT_TRUE(s.chunks[i]["choices"][0]["finish_reason"].is_null()) << s.chunks[i];
      EXPECT_EQ(s.chunks[i]["id"], s.chunks.back()["id"]);
    }
    EXPECT_EQ(s.chunks.back()["choices"][0]["finish_reason"], "length");
    EXPECT_EQ(s.chunks.back()["object"], "text_completion");
  }
  // stream_options.include_usage adds a usage chunk before [DONE].
  json body = greedy_request(load_reference()[0]);
  body["stream_options"] = {{"include_usage", true}};
  StreamReply s = stream(*c, body);
  ASSERT_TRUE(s.done_last);
  EXPECT_EQ(s.chunks.back()["usage"]["completion_tokens"], 16);
  EXPECT_TRUE(s.chunks.back()["choices"].empty());
}

TEST_F(HttpTest, ThirtyTwoConcurrentRequestsAreAllCorrect) {
  const std::vector<RefPrompt> ref = load_reference();
  constexpr int kClients = 32;
  std::vector<std::vector<int32_t>> got(kClients);
  std::vector<int> status(kClients, 0);
  std::vector<std::thread> threads;
  for (int i = 0; i < kClients; ++i) {
    threads.emplace_back([&, i] {
      auto c = client();
      const json body = greedy_request(ref[i % ref.size()]);
      if (i % 2 == 0) {
        HttpReply r = post(*c, "/v1/completions", body);
        status[i] = r.status;
        if (r.status == 200) got[i] = r.body["choices"][0]["token_ids"].get<std::vector<int32_t>>();
      } else {
        StreamReply s = stream(*c, body);
        status[i] = s.done_last ? s.status : -1;
        got[i] = s.tokens;
      }
    });
  }
  for (auto& t : threads) t.join();
  for (int i = 0; i < kClients; ++i) {
    EXPECT_EQ(status[i], 200) << "client " << i;
    EXPECT_EQ(got[i], ref[i % ref.size()].greedy) << "client " << i;
  }
}

TEST_F(HttpTest, BadRequestsGetJsonErrorsAndTheServerKeepsServing) {
  auto c = client();
  const std::vector<std::pair<std::string, std::string>> bad = {
      {"{not json", ""},
      {R"({"prompt": []})", "prompt"},
      {R"({"max_tokens": 3})", "prompt"},
      {R"({"prompt": [1, 2.5]})", "prompt"},
      {R"({"prompt": ["a", "b"]})", "prompt"},
      {R"({"prompt": [512]})", "prompt"},                        // vocab_size is 512.
      {R"({"prompt": [1], "max_tokens": 1024})", "max_tokens"},  // Context is 1024.
      {R"({"prompt": [1], "max_tokens": -1})", "max_tokens"},
      {R"({"prompt": [1], "temperature": -1})", "temperature"},
      {R"({"prompt": [1], "top_p": 2})", "top_p"},
      {R"({"prompt": [1], "stream": 1})", "stream"},
      {R"({"prompt": [1], "logit_bias": {"512": 1}})", "logit_bias"},  // Outside the vocabulary.
      {R"({"prompt": [1], "presence_penalty": 2.5})", "presence_penalty"},
      {R"({"prompt": [1], "frobnicate": true})", "frobnicate"},
  };
  for (const auto& [body, param] : bad) {
    HttpReply r = post(*c, "/v1/completions", body);
    EXPECT_EQ(r.status, 400) << body;
    ASSERT_TRUE(r.body.is_object()) << r.text;
    EXPECT_EQ(r.body["error"]["type"], "invalid_request_error") << body;
    EXPECT_EQ(r.body["error"]["param"], param.empty() ? json(nullptr) : json(param)) << body;
    EXPECT_TRUE(r.body["error"]["code"].is_null());
    EXPECT_FALSE(r.body["error"]["message"].get<std::string>().empty());
  }
  // A model this server does not serve: 404, as OpenAI answers.
  HttpReply r = post(*c, "/v1/completions", json{{"model", "gpt-4"}, {"prompt", {1}}});
  EXPECT_EQ(r.status, 404) << r.text;
  EXPECT_EQ(r.body["error"]["code"], "model_not_found");
  EXPECT_EQ(r.body["error"]["param"], "model");
  r = get(*c, "/nope");
  EXPECT_EQ(r.status, 404);
  EXPECT_EQ(r.body["error"]["type"], "not_found_error");
  r = post(*c, "/v1/nope", std::string("{}"));
  EXPECT_EQ(r.status, 404) << r.text;
  EXPECT_TRUE(r.body.contains("error"));
  auto wrong_method = c->Get("/v1/completions");
  ASSERT_TRUE(wrong_method);
  EXPECT_EQ(wrong_method->status, 405);
  EXPECT_EQ(wrong_method->get_header_value("Allow"), "POST");
  EXPECT_TRUE(json::parse(wrong_method->body, nullptr, false).contains("error"));
  r = post(*c, "/health", std::string("{}"));
  EXPECT_EQ(r.status, 405);
  r = post(*c, "/v1/completions", std::string(100 << 10, ' '));
  EXPECT_EQ(r.status, 413);
  EXPECT_TRUE(r.body.contains("error")) << r.text;

  // A request that is not HTTP at all.
  const int fd = ::socket(AF_INET, SOCK_STREAM, 0);
  sockaddr_in addr{};
  addr.sin_family = AF_INET;
  addr.sin_port = htons(static_cast<uint16_t>(server_->port()));
  addr.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
  ASSERT_EQ(::connect(fd, reinterpret_cast<sockaddr*>(&addr), sizeof(addr)), 0);
  const std::string garbage = "\x01\x02 NOT HTTP\r\n\r\n";
  ASSERT_EQ(::write(fd, garbage.data(), garbage.size()), static_cast<ssize_t>(garbage.size()));
  char buf[512] = {};
  const ssize_t n = ::read(fd, buf, sizeof(buf) - 1);
  ::close(fd);
  EXPECT_GT(n, 0);
  EXPECT_EQ(std::string(buf).rfind("HTTP/1.1 400", 0), 0u) << buf;

  // Still serving, on a new and on the old connection.
  const RefPrompt p = load_reference()[0];
  auto fresh = client();
  for (httplib::Client* cl : {c.get(), fresh.get()}) {
    r = post(*cl, "/v1/completions", greedy_request(p));
    ASSERT_EQ(r.status, 200) << r.text;
    EXPECT_EQ(r.body["choices"][0]["token_ids"].get<std::vector<int32_t>>(), p.greedy);
  }
}

TEST_F(HttpTest, HealthStatusModels) {
  auto c = client();
  HttpReply r = get(*c, "/health");
  EXPECT_EQ(r.status, 200);
  EXPECT_EQ(r.body, json({{"status", "ok"}}));
  r = get(*c, "/v1/status");
  ASSERT_EQ(r.status, 200);
  EXPECT_EQ(r.body["mode"], "local");
  EXPECT_EQ(r.body["phase"], "serving");
  EXPECT_EQ(r.body["epoch"], 0);
  EXPECT_EQ(r.body["vocab_size"], 512);
  EXPECT_EQ(r.body["max_context"], 1024);
  ASSERT_EQ(r.body["ranks"].size(), 1u);
  const json& rank = r.body["ranks"][0];
  EXPECT_EQ(rank["rank"], 0);
  EXPECT_EQ(rank["state"], "serving");
  for (const char* key : {"running", "waiting", "step_ms"}) EXPECT_TRUE(rank[key].is_number());
  r = get(*c, "/v1/models");
  ASSERT_EQ(r.status, 200);
  EXPECT_EQ(r.body["data"][0]["id"], "qwen3moe-tiny");
}

TEST_F(HttpTest, MetricsCountRequestsAndTokens) {
  auto c = client();
  const std::string before = metrics_text();
  ASSERT_EQ(post(*c, "/v1/completions", greedy_request(load_reference()[0])).status, 200);
  ASSERT_EQ(stream(*c, greedy_request(load_reference()[1])).status, 200);
  ASSERT_EQ(post(*c, "/v1/completions", std::string("{}")).status, 400);
  auto res = c->Get("/metrics");
  ASSERT_TRUE(res);
  EXPECT_EQ(res->status, 200);
  EXPECT_EQ(res->get_header_value("Content-Type").rfind("text/plain", 0), 0u);
  const std::string after = res->body;

  auto delta = [&](const std::string& series) {
    return metric_value(after, series) - std::max(0.0, metric_value(before, series));
  };
  EXPECT_EQ(delta("flexpert_requests_total{status=\"ok\"}"), 2);
  EXPECT_EQ(delta("flexpert_requests_total{status=\"invalid\"}"), 1);
  EXPECT_EQ(delta("flexpert_generated_tokens_total"), 32);
  EXPECT_EQ(delta("flexpert_prompt_tokens_total"),
            load_reference()[0].input_ids.size() + load_reference()[1].input_ids.size());
  EXPECT_EQ(metric_value(after, "flexpert_requests_in_flight"), 0);
  EXPECT_EQ(delta("flexpert_time_to_first_token_seconds_count"), 2);
  EXPECT_EQ(delta("flexpert_inter_token_latency_seconds_count"), 30);
  EXPECT_EQ(delta("flexpert_request_duration_seconds_count"), 2);
  EXPECT_GT(metric_value(after, "flexpert_engine_steps_total{rank=\"0\"}"), 0);
  EXPECT_NE(after.find("# TYPE flexpert_time_to_first_token_seconds histogram"), std::string::npos);

  // Histogram buckets are cumulative: monotone in `le`, ending at _count.
  for (const std::string name :
       {"flexpert_time_to_first_token_seconds", "flexpert_inter_token_latency_seconds",
        "flexpert_request_duration_seconds"}) {
    std::istringstream lines(after);
    std::string line;
    double prev = 0;
    int buckets = 0;
    while (std::getline(lines, line)) {
      if (line.rfind(name + "_bucket{", 0) != 0) continue;
      const double v = std::stod(line.substr(line.rfind(' ') + 1));
      EXPECT_GE(v, prev) << line;
      prev = v;
      ++buckets;
    }
    EXPECT_EQ(buckets, 16) << name;  // 15 bounds and +Inf.
    EXPECT_EQ(prev, metric_value(after, name + "_count"));
  }
}

TEST_F(HttpTest, ClientDisconnectMidStreamCancelsTheRequest) {
  const std::string before = metrics_text();
  {
    auto c = client();
    json body = {
        {"prompt", {1, 2, 3}}, {"max_tokens", 1000}, {"temperature", 0}, {"ignore_eos", true}};
    StreamReply s = stream(*c, body, /*stop_after_chunks=*/2);
    EXPECT_FALSE(s.done);
  }
  // The server notices at its next write and cancels the request in the engine.
  EXPECT_TRUE(eventually([&] {
    return metric_value(metrics_text(), "flexpert_requests_total{status=\"cancelled\"}") >=
           std::max(0.0, metric_value(before, "flexpert_requests_total{status=\"cancelled\"}")) + 1;
  }));
  EXPECT_TRUE(eventually([&] {
    HttpReply r = get(*client(), "/v1/status");
    return r.body["ranks"][0]["running"] == 0 && r.body["ranks"][0]["waiting"] == 0;
  }));
  EXPECT_LT(metric_value(metrics_text(), "flexpert_generated_tokens_total") -
                metric_value(before, "flexpert_generated_tokens_total"),
            1000);
  const RefPrompt p = load_reference()[2];
  HttpReply r = post(*client(), "/v1/completions", greedy_request(p));
  ASSERT_EQ(r.status, 200);
  EXPECT_EQ(r.body["choices"][0]["token_ids"].get<std::vector<int32_t>>(), p.greedy);
}

// Its own engine and server: the engine is shut down while requests run.
TEST(HttpShutdownTest, EngineShutdownGivesInFlightRequestsAFinalResponse) {
  auto engine = LocalEngine::create(kTinyModelDir, LocalEngineOptions{});
  ASSERT_TRUE(engine.ok());
  HttpOptions options;
  options.port = 0;
  HttpServer server(**engine, options);
  ASSERT_TRUE(server.start().ok());

  constexpr int kClients = 8;
  std::atomic<int> num_streaming{0};
  std::vector<std::string> reasons(kClients);
  std::vector<int> status(kClients, 0);
  std::vector<std::thread> threads;
  for (int i = 0; i < kClients; ++i) {
    threads.emplace_back([&, i] {
      auto c = make_client(server.port());
      const json body = {
          {"prompt", {5, 6, 7, i}}, {"max_tokens", 1000}, {"temperature", 0}, {"ignore_eos", true}};
      if (i % 2 == 0) {
        HttpReply r = post(*c, "/v1/completions", body);
        status[i] = r.status;
        if (r.status == 200) reasons[i] = r.body["choices"][0]["finish_reason"];
        if (r.status == 503 && r.body["error"]["code"] == "UNAVAILABLE") reasons[i] = "abort";
      } else {
        ++num_streaming;
        StreamReply s = stream(*c, body);
        status[i] = s.done_last ? s.status : -1;
        if (!s.chunks.empty()) reasons[i] = s.chunks.back()["choices"][0]["finish_reason"];
      }
    });
  }
  // Wait until every client's request is admitted (4 prompt tokens each) and tokens
  // flow, then pull the plug: a request still on its way would rightly get a 503.
  ASSERT_TRUE(eventually([&] {
    const std::string metrics = get(*make_client(server.port()), "/metrics").text;
    const std::string key = "\nflexpert_prompt_tokens_total ";
    const size_t at = metrics.find(key);
    if (at == std::string::npos || std::stod(metrics.substr(at + key.size())) < 4 * kClients) {
      return false;
    }
    HttpReply r = get(*make_client(server.port()), "/v1/status");
    return r.body["ranks"][0]["running"].get<int>() > 0;
  }));
  ASSERT_TRUE((*engine)->shutdown().ok());
  for (auto& t : threads) t.join();
  int aborted = 0;
  for (int i = 0; i < kClients; ++i) {
    // A stream ends with a final "abort" event (200); a non-streaming request cut
    // short is an error (503 + JSON), never a 200 carrying "abort".
    const bool streaming = i % 2 == 1;
    if (streaming || reasons[i] == "length") {
      EXPECT_EQ(status[i], 200) << "client " << i;
    } else {
      EXPECT_EQ(status[i], 503) << "client " << i;
    }
    EXPECT_TRUE(reasons[i] == "abort" || reasons[i] == "length") << i << ": " << reasons[i];
    aborted += reasons[i] == "abort";
  }
  EXPECT_GT(aborted, 0);

  auto c = make_client(server.port());
  HttpReply r = get(*c, "/health");
  EXPECT_EQ(r.status, 503);
  EXPECT_EQ(r.body["status"], "degraded");
  r = post(*c, "/v1/completions", json{{"prompt", {1}}, {"max_tokens", 2}});
  EXPECT_EQ(r.status, 503);
  EXPECT_EQ(r.body["error"]["code"], "UNAVAILABLE");
  EXPECT_TRUE((*engine)->shutdown().ok());  // Idempotent.
  server.stop();
}

}  // namespace
}  // namespace flexpert::testing
