// SPDX-License-Identifier: Apache-2.0
// HttpServer: lifecycle, routing, error bodies and the small GET routes.
// The completions route is in http_completions.cc.
#include "serve/http_server.h"

#include <httplib.h>
#include <poll.h>
#include <sys/socket.h>

#include <algorithm>
#include <cerrno>
#include <chrono>
#include <cstring>
#include <random>
#include <string_view>
#include <thread>

#include "core/json_limits.h"
#include "core/secret.h"
#include "flexpert/logging.h"
#include "serve/completion_api.h"
#include "serve/http_gate.h"

namespace flexpert {
namespace {

using nlohmann::json;

constexpr int kListenBacklog = 512;
// How long stop() waits for requests to get their final answer out.
constexpr auto kStopGrace = std::chrono::seconds(2);

}  // namespace

// NOTE: httplib listens with a backlog of 5 (a compile-time constant of the
// Debian library). A burst of concurrent clients then overflows the accept queue
// and their SYNs are retried after a second, which shows up as 1 s latency
// outliers. Linux lets listen() on a listening socket raise the backlog.
//
// httplib's own accept loop holds a pool thread per connection from its first
// byte, with no deadline for the request (docs/ARCHITECTURE.md, "Trust
// boundaries"); HttpGate accepts instead and hands over complete requests, which
// httplib's request processing (routing, handlers, responses) then answers.
class ListenServer : public httplib::Server {
 public:
  void raise_backlog(int backlog) { (void)::listen(svr_sock_, backlog); }
  int listen_socket() const { return svr_sock_; }
  // Answers one request read from `stream`; false when the connection must close.
  bool serve(httplib::Stream& stream) {
    bool connection_closed = false;
    const bool ok = process_request(stream, /*close_connection=*/false, connection_closed,
                                    [](httplib::Request&) {});
    return ok && !connection_closed;
  }
  // Stream providers poll whether the listener is open: this ends them.
  void mark_stopped() { svr_sock_ = INVALID_SOCKET; }
};

namespace {

// A connection as httplib reads and writes it: the request comes from the bytes the
// gate read whole (so no read waits on the client), the response goes to the socket
// with a timeout per write.
class GatedStream : public httplib::Stream {
 public:
  GatedStream(const GatedRequest& request, int write_timeout_ms)
      : request_(request), write_timeout_ms_(write_timeout_ms) {}

  bool is_readable() const override { return pos_ < request_.bytes.size(); }
  bool is_writable() const override {
    pollfd p{request_.fd, POLLOUT, 0};
    return ::poll(&p, 1, write_timeout_ms_) > 0 && (p.revents & (POLLERR | POLLHUP)) == 0;
  }
  ssize_t read(char* ptr, size_t size) override {
    const size_t n = std::min(size, request_.bytes.size() - pos_);
    std::memcpy(ptr, request_.bytes.data() + pos_, n);
    pos_ += n;
    return static_cast<ssize_t>(n);  // 0 past the request: httplib sees its end.
  }
  ssize_t write(const char* ptr, size_t size) override {
    size_t done = 0;
    while (done < size) {
      const ssize_t n = ::send(request_.fd, ptr + done, size - done, MSG_NOSIGNAL);
      if (n > 0) {
        done += static_cast<size_t>(n);
      } else if (n < 0 && errno == EINTR) {
        continue;
      } else if (n < 0 && (errno == EAGAIN || errno == EWOULDBLOCK) && is_writable()) {
        continue;
      } else {
        return -1;  // A reader slower than the write timeout, or gone.
      }
    }
    return static_cast<ssize_t>(size);
  }
  void get_remote_ip_and_port(std::string& ip, int& port) const override {
    ip = request_.peer;
    port = 0;
  }
  void get_local_ip_and_port(std::string& ip, int& port) const override {
    ip.clear();
    port = 0;
  }
  socket_t socket() const override { return request_.fd; }

 private:
  const GatedRequest& request_;
  const int write_timeout_ms_;
  size_t pos_ = 0;
};

// Exact-match regex for a literal route path (httplib routes by std::regex).
std::string literal_pattern(const std::string& path) {
  std::string out;
  for (char c : path) {
    if (std::string_view("\\^$.|?*+()[]{}").find(c) != std::string_view::npos) out += '\\';
    out += c;
  }
  return out;
}

}  // namespace

HttpServer::HttpServer(ServingEngine& engine, HttpOptions options)
    : engine_(engine),
      options_(std::move(options)),
      seed_base_((static_cast<uint64_t>(std::random_device()()) << 32) ^ std::random_device()()),
      generated_tokens_(metrics_.counter("flexpert_generated_tokens_total",
                                         "Completion tokens sent to clients.")),
      prompt_tokens_(
          metrics_.counter("flexpert_prompt_tokens_total", "Prompt tokens of accepted requests.")),
      in_flight_(metrics_.gauge("flexpert_requests_in_flight",
                                "Accepted completion requests not yet answered.")),
      ttft_seconds_(metrics_.histogram("flexpert_time_to_first_token_seconds",
                                       "From request arrival to its first token.",
                                       metrics::latency_buckets_seconds())),
      itl_seconds_(metrics_.histogram("flexpert_inter_token_latency_seconds",
                                      "Between consecutive tokens of one request.",
                                      metrics::latency_buckets_seconds())),
      duration_seconds_(metrics_.histogram("flexpert_request_duration_seconds",
                                           "From request arrival to its last byte.",
                                           metrics::latency_buckets_seconds())) {
  requests_counter("ok");  // Creates the family, so that it renders first and before any request.
  add_route("POST", "/v1/completions", [this](const httplib::Request& req, httplib::Response& res) {
    if (check_api_key(req, res)) handle_generation(/*chat=*/false, req, res);
  });
  add_route("POST", "/v1/chat/completions",
            [this](const httplib::Request& req, httplib::Response& res) {
              if (check_api_key(req, res)) handle_generation(/*chat=*/true, req, res);
            });
  add_route("POST", "/tokenize", [this](const httplib::Request& req, httplib::Response& res) {
    if (check_api_key(req, res)) handle_tokenize(/*detokenize=*/false, req, res);
  });
  add_route("POST", "/detokenize", [this](const httplib::Request& req, httplib::Response& res) {
    if (check_api_key(req, res)) handle_tokenize(/*detokenize=*/true, req, res);
  });
  add_route("GET", "/health", [this](const auto&, auto& res) { handle_health(res); });
  add_route("GET", "/v1/status",
            [this](const httplib::Request& req, auto& res) { handle_status(req, res); });
  add_route("GET", "/v1/models", [this](const httplib::Request& req, auto& res) {
    if (check_api_key(req, res)) handle_models(res);
  });
  add_route("GET", "/metrics", [this](const auto&, auto& res) { handle_metrics(res); });
}

HttpServer::~HttpServer() { stop(); }

void HttpServer::send_json(httplib::Response& res, int status, const json& body) const {
  res.status = status;
  // 503: the group is recovering, shutting down or degraded; clients retry after the
  // engine's estimate (a degraded group: the healer's next attempt, docs/ARCHITECTURE.md).
  if (status == 503) {
    res.set_header("Retry-After", std::to_string(std::max(1, engine_.retry_after_s())));
  }
  res.set_content(dump_json(body), "application/json");
}

metrics::Counter& HttpServer::requests_counter(const std::string& outcome) {
  return metrics_.counter("flexpert_requests_total",
                          "Completion requests by outcome: ok, abort (engine shut down), "
                          "cancelled (client went away), error, invalid, unavailable.",
                          {{"status", outcome}});
}

void HttpServer::add_route(const std::string& method, const std::string& path, Handler handler) {
  FLEX_CHECK(!server_) << "routes must be added before start()";
  routes_[path][method] = std::move(handler);
}

void HttpServer::add_post_route(const std::string& path, AdminHandler handler) {
  add_route(
      "POST", path,
      [this, handler = std::move(handler)](const httplib::Request& req, httplib::Response& res) {
        handle_admin(handler, req, res);
      });
}

void HttpServer::add_get_route(const std::string& path,
                               std::function<Result<nlohmann::json>()> handler) {
  add_route("GET", path,
            [this, handler = std::move(handler)](const httplib::Request&, httplib::Response& res) {
              Result<json> result = handler();
              if (!result.ok()) {
                send_json(res, http_status_for(result.status()),
                          status_error_json(result.status()));
              } else {
                send_json(res, 200, result.value());
              }
            });
}

Status HttpServer::start() {
  FLEX_CHECK(!server_) << "start() called twice";
  auto server = std::make_unique<ListenServer>();
  server->set_payload_max_length(options_.max_body_bytes);
  server->set_keep_alive_timeout(options_.keep_alive_timeout_s);
  server->set_keep_alive_max_count(10000);
  // NOTE: httplib's default sets SO_REUSEPORT, which lets a second server bind the
  // same port and silently take half the traffic. SO_REUSEADDR alone still allows
  // a quick restart but makes a busy port an error.
  server->set_socket_options([](socket_t sock) {
    int yes = 1;
    (void)::setsockopt(sock, SOL_SOCKET, SO_REUSEADDR, &yes, sizeof(yes));
  });

  for (const auto& [path, methods] : routes_) {
    for (const auto& [method, handler] : methods) {
      // Every handler catches here: nothing thrown may reach httplib's worker loop.
      httplib::Server::Handler guarded = [this, &h = handler](const httplib::Request& req,
                                                              httplib::Response& res) {
        try {
          h(req, res);
        } catch (const std::exception& e) {
          FLEX_LOG(ERROR) << req.method << " " << req.path << ": " << e.what();
          send_json(res, 500,
                    error_json(std::string("internal error: ") + e.what(), "server_error", "",
                               "INTERNAL"));
        } catch (...) {
          send_json(res, 500, error_json("internal error", "server_error", "", "INTERNAL"));
        }
      };
      const std::string pattern = literal_pattern(path);
      if (method == "GET") server->Get(pattern, guarded);
      if (method == "POST") server->Post(pattern, guarded);
    }
  }
  server->set_error_handler(httplib::Server::HandlerWithResponse(
      [this](const httplib::Request& req, httplib::Response& res) {
        return fill_error_body(req, res) ? httplib::Server::HandlerResponse::Handled
                                         : httplib::Server::HandlerResponse::Unhandled;
      }));
  server->set_exception_handler(
      [this](const httplib::Request&, httplib::Response& res, std::exception_ptr) {
        send_json(res, 500, error_json("internal error", "server_error", "", "INTERNAL"));
      });

  const std::string where = options_.host + ":" + std::to_string(options_.port);
  int port = options_.port;
  if (port == 0) {
    port = server->bind_to_any_port(options_.host);
    if (port < 0) return unavailable("cannot bind an ephemeral port on " + options_.host);
  } else if (!server->bind_to_port(options_.host, port)) {
    return unavailable("cannot bind " + where + " (in use, or not a local address)");
  }
  server->raise_backlog(kListenBacklog);

  HttpGateOptions gate;
  gate.request_timeout_ms = options_.request_timeout_ms;
  gate.max_body_bytes = options_.max_body_bytes;
  gate.max_connections = options_.max_connections;
  gate.max_connections_per_client = options_.max_connections_per_client;
  gate.num_threads = options_.num_threads;
  gate.num_light_threads = options_.num_light_threads;
  ListenServer* raw = server.get();
  const int write_timeout_ms = options_.write_timeout_ms;
  auto gate_server = std::make_unique<HttpGate>(
      gate,
      [raw, write_timeout_ms](const GatedRequest& request) {
        GatedStream stream(request, write_timeout_ms);
        return raw->serve(stream);
      },
      [this](const std::string& method, const std::string& path) {
        return is_light_route(method, path);
      });
  if (Status s = gate_server->start(raw->listen_socket()); !s.ok()) {
    ::close(raw->listen_socket());
    return s.annotate("starting the HTTP accept loop on " + where);
  }
  server_ = std::move(server);
  gate_ = std::move(gate_server);
  port_ = port;
  FLEX_LOG(INFO) << "serving on http://" << options_.host << ":" << port_;
  return Status();
}

bool HttpServer::fill_error_body(const httplib::Request& req, httplib::Response& res) {
  // Responses httplib makes itself (no route, body too large, unparsable request)
  // have no body yet; ours always do.
  if (!res.body.empty()) return false;
  try {
    std::string message = "HTTP " + std::to_string(res.status);
    std::string type = "invalid_request_error";
    if (res.status == 404) {
      auto route = routes_.find(req.path);
      if (route == routes_.end()) {
        message = "no route for " + req.method + " " + req.path;
        type = "not_found_error";
      } else {  // httplib says 404 when only the method is wrong.
        std::string allow;
        for (const auto& [method, h] : route->second) allow += (allow.empty() ? "" : ", ") + method;
        res.status = 405;
        res.set_header("Allow", allow);
        message =
            "method " + req.method + " is not allowed on " + req.path + " (allowed: " + allow + ")";
      }
    } else if (res.status == 413) {
      message = "the request body exceeds " + std::to_string(options_.max_body_bytes) + " bytes";
    } else if (res.status == 400) {
      message = "malformed HTTP request";
    }
    send_json(res, res.status, error_json(message, type));
    return true;
  } catch (...) {
    return false;  // httplib sends its own (empty) error response.
  }
}

void HttpServer::stop() {
  if (!server_) return;
  // Handlers waiting for the engine give up within a poll interval. Let them send
  // their final response or event first: once the listener closes, httplib stops
  // calling stream providers and a stream would just end without [DONE].
  stopping_ = true;
  const auto deadline = std::chrono::steady_clock::now() + kStopGrace;
  while (num_open_exchanges_.load() > 0 && std::chrono::steady_clock::now() < deadline) {
    std::this_thread::sleep_for(std::chrono::milliseconds(5));
  }
  server_->mark_stopped();  // Stream providers end (they have sent their final event).
  gate_->stop();            // Closes the listener; joins the pools.
  gate_.reset();
  server_.reset();
}

bool HttpServer::is_light_route(const std::string& method, const std::string& path) const {
  // Quick, read-only routes, answered by their own pool whatever holds the other.
  if (method != "GET") return false;
  return path == "/health" || path == "/metrics" || path == "/v1/models" || path == "/v1/status";
}

bool HttpServer::authorized(const httplib::Request& req) const {
  return options_.admin_key.empty() ||
         same_secret(req.get_header_value("Authorization"), "Bearer " + options_.admin_key);
}

bool HttpServer::check_api_key(const httplib::Request& req, httplib::Response& res) const {
  if (options_.api_key.empty() ||
      same_secret(req.get_header_value("Authorization"), "Bearer " + options_.api_key)) {
    return true;
  }
  res.set_header("WWW-Authenticate", "Bearer");
  // As OpenAI answers a missing or wrong key.
  send_json(res, 401,
            error_json("missing or wrong API key (Authorization: Bearer <key>)",
                       "invalid_request_error", "", "invalid_api_key"));
  return false;
}

bool HttpServer::check_model(const std::string& model, httplib::Response& res) const {
  if (model.empty() || model == options_.model_name) return true;
  // As OpenAI answers a model it does not serve.
  send_json(res, 404,
            error_json("The model '" + model.substr(0, 128) +
                           "' does not exist: this server serves '" + options_.model_name + "'",
                       "invalid_request_error", "model", "model_not_found"));
  return false;
}

void HttpServer::handle_tokenize(bool detokenize, const httplib::Request& req,
                                 httplib::Response& res) {
  std::string model, param;
  Result<json> result =
      detokenize ? detokenize_request(req.body, options_.text, &model, &param)
                 : tokenize_request(req.body, options_.text, engine_.max_context(), &model, &param);
  if (!result.ok()) {
    send_json(res, http_status_for(result.status()),
              error_json(result.status().message(), "invalid_request_error", param));
    return;
  }
  if (!check_model(model, res)) return;
  send_json(res, 200, result.value());
}

// What anyone may see of the engine's status: no pids, errors or per-rank detail.
json HttpServer::public_status() const {
  const json full = engine_.status();
  json out = json::object();
  if (full.is_object()) {
    for (const char* key : {"mode", "phase", "epoch", "members", "max_ranks"}) {
      if (full.contains(key)) out[key] = full[key];
    }
  }
  out["vocab_size"] = engine_.vocab_size();
  out["max_context"] = engine_.max_context();
  out["model"] = options_.model_name;
  return out;
}

void HttpServer::handle_health(httplib::Response& res) {
  if (engine_.healthy() && !stopping_) {
    send_json(res, 200, {{"status", "ok"}});
  } else {
    send_json(res, 503, {{"status", "degraded"}, {"detail", public_status()}});
  }
}

void HttpServer::handle_status(const httplib::Request& req, httplib::Response& res) {
  // With an admin key, pids, errors and per-rank detail are for its holders only;
  // others get the limits clients need (bench serve reads them).
  if (!authorized(req)) {
    send_json(res, 200, public_status());
    return;
  }
  json status = engine_.status();
  // Clients such as `bench serve` need the limits whatever the engine reports.
  if (status.is_object()) {
    if (!status.contains("vocab_size")) status["vocab_size"] = engine_.vocab_size();
    if (!status.contains("max_context")) status["max_context"] = engine_.max_context();
    if (!status.contains("model")) status["model"] = options_.model_name;
  }
  send_json(res, 200, status);
}

void HttpServer::handle_models(httplib::Response& res) {
  json model = {{"id", options_.model_name},
                {"object", "model"},
                {"created", unix_seconds()},
                {"owned_by", "flexpert"},
                {"max_model_len", engine_.max_context()}};
  send_json(res, 200, {{"object", "list"}, {"data", json::array({model})}});
}

void HttpServer::handle_metrics(httplib::Response& res) {
  res.status = 200;
  res.set_content(metrics_.render() + engine_.metrics_text(), "text/plain; version=0.0.4");
}

void HttpServer::handle_admin(const AdminHandler& handler, const httplib::Request& req,
                              httplib::Response& res) {
  if (!authorized(req)) {
    res.set_header("WWW-Authenticate", "Bearer");
    send_json(res, 401, error_json("missing or wrong admin key", "authentication_error"));
    return;
  }
  json body = nullptr;
  if (!req.body.empty()) {
    if (Status s = check_json_nesting(req.body, "the request body"); !s.ok()) {
      send_json(res, 400, status_error_json(s));
      return;
    }
    body = json::parse(req.body, nullptr, /*allow_exceptions=*/false);
    if (body.is_discarded()) {
      send_json(res, 400,
                error_json("the request body is not valid JSON", "invalid_request_error"));
      return;
    }
  }
  Result<json> result = handler(body);
  if (!result.ok()) {
    send_json(res, http_status_for(result.status()), status_error_json(result.status()));
    return;
  }
  send_json(res, 200, result.value());
}

}  // namespace flexpert
