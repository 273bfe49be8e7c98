// SPDX-License-Identifier: Apache-2.0
// HttpServer: the OpenAI-style HTTP front end over a ServingEngine.
//
// Routes: POST /v1/completions and POST /v1/chat/completions (a JSON response, or
// server-sent events with "stream": true), POST /tokenize and /detokenize, GET /v1/models,
// GET /health, GET /v1/status (per-rank detail only with the admin key, when one is set),
// GET /metrics (Prometheus text), and admin POST routes added with add_post_route(). With
// an API key the inference routes (completions, chat, models, tokenize, detokenize) need
// `Authorization: Bearer <key>` (401 otherwise); /health and /metrics stay open. Every
// error is a JSON body {"error": {...}}; exceptions from httplib or JSON handling
// are caught at the handler edge and never reach the server loop.
//
// start() binds and serves on threads of its own (http_gate.h): one event loop reads
// each request whole under a deadline (HttpOptions::request_timeout_ms), caps open
// connections in total and per client (503 beyond), and hands complete requests to
// a pool: /health, /metrics, /v1/models, /v1/status to a small pool of their own,
// so they answer however busy the other is. A streaming request holds its pool
// thread until it ends (HttpOptions::num_threads). stop() closes the listener, ends requests still
// waiting for the engine (503, or a final error event; cancelled in the engine) and joins. For a
// graceful stop shut the engine down first: requests then end normally with finish_reason "abort".
// add_post_route(), start() and stop() belong to one controlling thread; everything else is
// thread-safe.
#pragma once

#include <atomic>
#include <cstddef>
#include <cstdint>
#include <functional>
#include <map>
#include <memory>
#include <nlohmann/json.hpp>
#include <string>
#include <thread>

#include "flexpert/status.h"
#include "serve/chat_api.h"
#include "serve/metrics.h"
#include "serve/serving_engine.h"

namespace httplib {
class Server;
struct Request;
struct Response;
class DataSink;
}  // namespace httplib

namespace flexpert {

class HttpGate;
class ListenServer;  // http_server.cc: httplib's request processing, fed by the gate.

struct HttpOptions {
  std::string host = "127.0.0.1";
  int port = 8000;                      // 0: an ephemeral port; see HttpServer::port().
  std::string model_name = "flexpert";  // Reported as "model" in responses and /v1/models.
  // Empty: admin routes need no Authorization header. Set: admin routes need
  // `Authorization: Bearer <key>`, and /v1/status shows its per-rank detail only then.
  std::string admin_key;
  // Empty: the inference routes are open. Set: they need `Authorization: Bearer <key>`.
  std::string api_key;
  // The tokenizer and chat template (both may be null: token ids only); they must outlive
  // the server.
  TextModel text;
  size_t max_body_bytes = 1 << 20;       // Larger request bodies get 413.
  int num_threads = 64;                  // Threads answering completions and admin routes.
  int num_light_threads = 4;             // Threads for /health, /metrics, /v1/models, /v1/status.
  int keep_alive_timeout_s = 5;          // Advertised to clients in Keep-Alive.
  int request_timeout_ms = 10000;        // A request (headers and body) not read by then: 408.
  int write_timeout_ms = 5000;           // A client not reading a response this long is dropped.
  int max_connections = 1024;            // Open connections in all; more get 503.
  int max_connections_per_client = 256;  // Per client address; more get 503.
};

class HttpServer {
 public:
  // An admin route: gets the JSON body (null when empty) and returns the response
  // body, or a Status mapped to an HTTP code (400 InvalidArgument, 503 Unavailable...).
  using AdminHandler = std::function<Result<nlohmann::json>(const nlohmann::json& body)>;

  HttpServer(ServingEngine& engine, HttpOptions options);
  ~HttpServer();  // stop().
  HttpServer(const HttpServer&) = delete;
  HttpServer& operator=(const HttpServer&) = delete;

  // Adds POST `path` guarded by `Authorization: Bearer <admin_key>` (401 otherwise,
  // when a key is set). Call before start().
  void add_post_route(const std::string& path, AdminHandler handler);
  // Adds GET `path` answering handler() as JSON (no admin key: read-only). Before start().
  void add_get_route(const std::string& path, std::function<Result<nlohmann::json>()> handler);

  // Binds host:port and starts serving. Unavailable when the address cannot be bound.
  Status start();
  int port() const { return port_; }  // The bound port once start() succeeded.
  void stop();                        // Idempotent; blocks until handlers returned.

  // The server's registry, rendered first on /metrics; callers may add their own.
  metrics::Registry& metrics() { return metrics_; }

 private:
  using Handler = std::function<void(const httplib::Request&, httplib::Response&)>;
  struct Exchange;  // One completion request's state (http_completions.cc).

  void add_route(const std::string& method, const std::string& path, Handler handler);
  // Sets status and the JSON body; a 503 carries Retry-After (the engine's retry_after_s).
  void send_json(httplib::Response& res, int status, const nlohmann::json& body) const;
  bool is_light_route(const std::string& method, const std::string& path) const;
  // The JSON error body for a response httplib made itself; false when it has a body.
  bool fill_error_body(const httplib::Request& req, httplib::Response& res);
  void handle_health(httplib::Response& res);
  void handle_status(const httplib::Request& req, httplib::Response& res);
  bool authorized(const httplib::Request& req) const;  // The admin key, when one is set.
  nlohmann::json public_status() const;
  void handle_models(httplib::Response& res);
  void handle_metrics(httplib::Response& res);
  void handle_admin(const AdminHandler& handler, const httplib::Request& req,
                    httplib::Response& res);

  // The API key, when one is set; false after answering 401.
  bool check_api_key(const httplib::Request& req, httplib::Response& res) const;
  // A request naming another model than the one served; false after answering 404.
  bool check_model(const std::string& model, httplib::Response& res) const;
  void handle_tokenize(bool detokenize, const httplib::Request& req, httplib::Response& res);

  // http_completions.cc
  void handle_generation(bool chat, const httplib::Request& req, httplib::Response& res);
  void absorb(Exchange& ex);             // Takes the engine's events; decides stops.
  void cancel_unfinished(Exchange& ex);  // Cancels choices still running in the engine.
  void respond_when_finished(Exchange& ex, httplib::Response& res);
  bool stream_step(Exchange& ex, httplib::DataSink& sink);
  void observe_tokens(Exchange& ex);  // Moves new latencies into histograms.
  void finish_exchange(Exchange& ex, const std::string& outcome);
  metrics::Counter& requests_counter(const std::string& outcome);
  uint64_t next_seed();

  ServingEngine& engine_;
  const HttpOptions options_;
  std::unique_ptr<ListenServer> server_;
  std::unique_ptr<HttpGate> gate_;
  int port_ = -1;
  std::atomic<bool> stopping_{false};
  std::atomic<int> num_open_exchanges_{0};  // Accepted completions not yet answered.
  // path -> method -> handler. Filled before start(), read-only afterwards.
  std::map<std::string, std::map<std::string, Handler>> routes_;
  const uint64_t seed_base_;
  std::atomic<uint64_t> seed_counter_{0};

  metrics::Registry metrics_;
  metrics::Counter& generated_tokens_;
  metrics::Counter& prompt_tokens_;
  metrics::Gauge& in_flight_;
  metrics::Histogram& ttft_seconds_;
  metrics::Histogram& itl_seconds_;
  metrics::Histogram& duration_seconds_;
};

}  // namespace flexpert
