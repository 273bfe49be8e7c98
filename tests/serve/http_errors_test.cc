// SPDX-License-Identifier: Apache-2.0
// HttpServer over FakeEngine: engine failures after a request was accepted,
// refusals, a degraded engine, exceptions in a handler, admin routes, and stop()
// with requests that would never finish.
#include "serve/http_server.h"
#include "serve_test_util.h"

namespace flexpert::testing {
namespace {

class HttpErrorsTest : public ::testing::Test {
 protected:
  void start(HttpOptions options = {}) {
    options.port = 0;
    server_ = std::make_unique<HttpServer>(engine_, options);
    for (auto& [path, handler] : admin_routes_) server_->add_post_route(path, handler);
    ASSERT_TRUE(server_->start().ok());
    client_ = make_client(server_->port());
  }
  void TearDown() override {
    if (server_) server_->stop();
    (void)engine_.shutdown();
  }

  FakeEngine engine_;
  std::vector<std::pair<std::string, HttpServer::AdminHandler>> admin_routes_;
  std::unique_ptr<HttpServer> server_;
  std::unique_ptr<httplib::Client> client_;
};

const json kRequest = {{"prompt", {1, 2, 3}}, {"max_tokens", 8}};

TEST_F(HttpErrorsTest, EngineUnavailableIsA503NamingTheCause) {
  // Unavailable (a rank lost, no capacity left): 503, which clients retry, never 500.
  engine_.mode = FakeEngine::Mode::kFailMidway;
  start();
  HttpReply r = post(*client_, "/v1/completions", kRequest);
  EXPECT_EQ(r.status, 503);
  EXPECT_EQ(r.body["error"]["message"], "rank 2 died");
  EXPECT_EQ(r.body["error"]["type"], "server_error");
  EXPECT_EQ(r.body["error"]["code"], "UNAVAILABLE");
}

TEST_F(HttpErrorsTest, EngineFailureEndsAStreamWithAnErrorEvent) {
  engine_.mode = FakeEngine::Mode::kFailMidway;
  start();
  StreamReply s = stream(*client_, kRequest);
  EXPECT_EQ(s.status, 200);
  EXPECT_EQ(s.tokens, (std::vector<int32_t>{1, 2}));
  EXPECT_TRUE(s.done_last) << s.raw;
  ASSERT_FALSE(s.chunks.empty());
  EXPECT_EQ(s.chunks.back()["error"]["message"], "rank 2 died");
  EXPECT_EQ(s.chunks.back()["choices"][0]["finish_reason"], "error");
  // The error event carries no tokens: the openai client throws on it, and would lose them.
  EXPECT_TRUE(s.chunks.back()["choices"][0]["token_ids"].empty()) << s.raw;
  const std::string metrics = get(*client_, "/metrics").text;
  EXPECT_EQ(metric_value(metrics, "flexpert_requests_total{status=\"error\"}"), 1);
  EXPECT_EQ(metric_value(metrics, "flexpert_generated_tokens_total"), 2);
}

TEST_F(HttpErrorsTest, EngineRefusalsMapToHttpCodes) {
  start();
  engine_.submit_status = unavailable("the engine is shutting down");
  HttpReply r = post(*client_, "/v1/completions", kRequest);
  EXPECT_EQ(r.status, 503);
  EXPECT_EQ(r.body["error"]["code"], "UNAVAILABLE");
  engine_.submit_status = invalid_argument("prompt too odd");
  r = post(*client_, "/v1/completions", kRequest);
  EXPECT_EQ(r.status, 400);
  EXPECT_EQ(r.body["error"]["type"], "invalid_request_error");
  engine_.submit_status = Status();
  r = post(*client_, "/v1/completions", kRequest);
  ASSERT_EQ(r.status, 200);
  EXPECT_EQ(r.body["choices"][0]["token_ids"], json({1, 2, 3}));
}

TEST_F(HttpErrorsTest, Every503SaysWhenToRetryAsTheEngineDoes) {
  start();
  auto retry_after = [&](const httplib::Result& res) {
    return res ? res->get_header_value("Retry-After") : std::string("no answer");
  };
  // Refused at submit, failed after acceptance, and /health of a degraded engine.
  engine_.submit_status = unavailable("degraded");
  auto refused = client_->Post("/v1/completions", kRequest.dump(), "application/json");
  EXPECT_EQ(retry_after(refused), "1");
  engine_.retry_after = 17;  // A degraded group whose healer retries in 17 s.
  refused = client_->Post("/v1/completions", kRequest.dump(), "application/json");
  ASSERT_TRUE(refused);
  EXPECT_EQ(refused->status, 503);
  EXPECT_EQ(retry_after(refused), "17");
  engine_.submit_status = Status();
  engine_.mode = FakeEngine::Mode::kFailMidway;
  auto failed = client_->Post("/v1/completions", kRequest.dump(), "application/json");
  ASSERT_TRUE(failed);
  EXPECT_EQ(failed->status, 503);
  EXPECT_EQ(retry_after(failed), "17");
  engine_.is_healthy = false;
  auto health = client_->Get("/health");
  ASSERT_TRUE(health);
  EXPECT_EQ(health->status, 503);
  EXPECT_EQ(retry_after(health), "17");
  // An engine's 0 would invite a spin: the header says at least 1. Other answers carry none.
  engine_.retry_after = 0;
  EXPECT_EQ(retry_after(client_->Get("/health")), "1");
  engine_.is_healthy = true;
  auto ok = client_->Get("/health");
  ASSERT_TRUE(ok);
  EXPECT_EQ(ok->status, 200);
  EXPECT_FALSE(ok->has_header("Retry-After"));
}

TEST_F(HttpErrorsTest, ApiKeyGuardsTheInferenceRoutesOnly) {
  HttpOptions options;
  options.api_key = "sesame";
  start(options);
  for (const char* path : {"/v1/completions", "/v1/chat/completions", "/tokenize", "/detokenize"}) {
    HttpReply r = post(*client_, path, kRequest);
    EXPECT_EQ(r.status, 401) << path;
    EXPECT_EQ(r.body["error"]["code"], "invalid_api_key") << path;
  }
  EXPECT_EQ(get(*client_, "/v1/models").status, 401);
  const httplib::Headers wrong = {{"Authorization", "Bearer sesamE"}};
  EXPECT_EQ(client_->Post("/v1/completions", wrong, kRequest.dump(), "application/json")->status,
            401);
  const httplib::Headers right = {{"Authorization", "Bearer sesame"}};
  auto ok = client_->Post("/v1/completions", right, kRequest.dump(), "application/json");
  ASSERT_TRUE(ok);
  EXPECT_EQ(ok->status, 200) << ok->body;
  EXPECT_EQ(client_->Get("/v1/models", right)->status, 200);
  // Without a tokenizer the text routes say so (with the key).
  auto chat =
      client_->Post("/v1/chat/completions", right,
                    R"({"messages": [{"role": "user", "content": "hi"}]})", "application/json");
  EXPECT_EQ(chat->status, 400);
  EXPECT_NE(chat->body.find("tokenizer"), std::string::npos) << chat->body;
  // Probes and metrics stay open.
  EXPECT_EQ(get(*client_, "/health").status, 200);
  EXPECT_EQ(get(*client_, "/metrics").status, 200);
}

TEST_F(HttpErrorsTest, DegradedEngineFailsHealth) {
  start();
  engine_.is_healthy = false;
  HttpReply r = get(*client_, "/health");
  EXPECT_EQ(r.status, 503);
  EXPECT_EQ(r.body["status"], "degraded");
  EXPECT_EQ(r.body["detail"]["mode"], "fake");
  engine_.is_healthy = true;
  EXPECT_EQ(get(*client_, "/health").status, 200);
  EXPECT_NE(get(*client_, "/metrics").text.find("fake_engine_up 1\n"), std::string::npos);
}

TEST_F(HttpErrorsTest, AnExceptionInAHandlerIsA500AndTheServerLives) {
  start();
  engine_.throw_in_status = true;
  HttpReply r = get(*client_, "/v1/status");
  EXPECT_EQ(r.status, 500);
  EXPECT_NE(r.body["error"]["message"].get<std::string>().find("status exploded"),
            std::string::npos);
  engine_.throw_in_status = false;
  EXPECT_EQ(get(*client_, "/v1/status").status, 200);
}

TEST_F(HttpErrorsTest, AdminRoutesCheckTheKey) {
  admin_routes_.push_back({"/admin/echo", [](const json& body) -> Result<json> {
                             if (body.is_object() && body.contains("fail")) {
                               return invalid_argument("told to fail");
                             }
                             return json{{"got", body}};
                           }});
  HttpOptions options;
  options.admin_key = "s3cret";
  start(options);
  HttpReply r = post(*client_, "/admin/echo", json{{"x", 1}});
  EXPECT_EQ(r.status, 401);
  EXPECT_EQ(r.body["error"]["type"], "authentication_error");
  httplib::Headers wrong = {{"Authorization", "Bearer nope"}};
  EXPECT_EQ(client_->Post("/admin/echo", wrong, "{}", "application/json")->status, 401);
  httplib::Headers right = {{"Authorization", "Bearer s3cret"}};
  auto ok = client_->Post("/admin/echo", right, R"({"x": 1})", "application/json");
  ASSERT_TRUE(ok);
  EXPECT_EQ(ok->status, 200);
  EXPECT_EQ(json::parse(ok->body)["got"]["x"], 1);
  EXPECT_EQ(client_->Post("/admin/echo", right, R"({"fail": 1})", "application/json")->status, 400);
  EXPECT_EQ(client_->Post("/admin/echo", right, "{bad", "application/json")->status, 400);
  EXPECT_EQ(client_->Get("/admin/echo", right)->status, 405);
}

TEST_F(HttpErrorsTest, AdminRoutesAreOpenWithoutAKey) {
  admin_routes_.push_back({"/admin/ping", [](const json&) -> Result<json> {
                             return json{{"pong", true}};
                           }});
  start();
  HttpReply r = post(*client_, "/admin/ping", std::string());
  EXPECT_EQ(r.status, 200);
  EXPECT_EQ(r.body["pong"], true);
}

TEST_F(HttpErrorsTest, StopEndsRequestsTheEngineNeverFinishes) {
  engine_.mode = FakeEngine::Mode::kHang;
  start();
  HttpReply plain;
  StreamReply streamed;
  std::thread a([&] { plain = post(*make_client(server_->port()), "/v1/completions", kRequest); });
  std::thread b([&] { streamed = stream(*make_client(server_->port()), kRequest); });
  ASSERT_TRUE(eventually([&] {
    return metric_value(get(*client_, "/metrics").text, "flexpert_requests_in_flight") == 2;
  }));
  client_.reset();  // Its idle keep-alive connection would hold stop() for a while.
  const auto t0 = std::chrono::steady_clock::now();
  server_->stop();
  EXPECT_LT(std::chrono::steady_clock::now() - t0, std::chrono::seconds(3));
  a.join();
  b.join();
  EXPECT_EQ(plain.status, 503);
  EXPECT_EQ(plain.body["error"]["code"], "UNAVAILABLE");
  EXPECT_EQ(streamed.tokens, (std::vector<int32_t>{7}));
  EXPECT_TRUE(streamed.done_last) << streamed.raw;
  ASSERT_FALSE(streamed.chunks.empty());
  EXPECT_EQ(streamed.chunks.back()["choices"][0]["finish_reason"], "abort");
  EXPECT_TRUE(streamed.chunks.back().contains("error"));
  EXPECT_EQ(engine_.num_cancelled, 2);
}

TEST_F(HttpErrorsTest, StopIsPromptWithIdleKeepAliveConnections) {
  start();
  ASSERT_EQ(get(*client_, "/health").status, 200);  // Leaves the connection open.
  const auto t0 = std::chrono::steady_clock::now();
  server_->stop();
  EXPECT_LT(std::chrono::steady_clock::now() - t0, std::chrono::seconds(2));
  EXPECT_EQ(get(*client_, "/health").status, 0);  // Nobody listens any more.
}

TEST_F(HttpErrorsTest, StartFailsOnABusyPort) {
  start();
  HttpOptions options;
  options.port = server_->port();
  HttpServer second(engine_, options);
  Status s = second.start();
  EXPECT_EQ(s.code(), StatusCode::kUnavailable) << s.to_string();
}

}  // namespace
}  // namespace flexpert::testing
