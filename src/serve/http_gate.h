// SPDX-License-Identifier: Apache-2.0
// HttpGate: the accept side of HttpServer, which slow or numerous clients cannot
// starve (docs/ARCHITECTURE.md, "Trust boundaries").
//
// One event-loop thread (epoll) accepts connections and reads each request whole,
// headers and body, under a deadline, holding no thread per connection while it
// waits. Only a complete request is handed to a pool: "light" routes (/health,
// /metrics, GET status routes) to a small pool of their own, everything else to the
// inference pool. So a thread is never held by a client that sends slowly, and the
// light routes answer however many streams hold the inference pool. Connections
// over a cap (in total, or per client address) get 503 at once; a request not read
// within the deadline gets 408 (a few connections beyond a cap are still read, and
// served if they ask for a light route, so /health answers a client at its cap); oversized headers
// 431, bodies 413, chunked request bodies 411. After a response the connection returns to the loop
// (keep-alive), with a fresh deadline for its next request.
//
// start(), stop() belong to one controlling thread; the serve callback runs on pool
// threads. Thread-safe otherwise.
#pragma once

#include <sys/types.h>

#include <atomic>
#include <cstddef>
#include <functional>
#include <map>
#include <memory>
#include <string>
#include <thread>
#include <vector>

#include "core/mutex.h"
#include "flexpert/status.h"

namespace httplib {
class TaskQueue;
}

namespace flexpert {

struct HttpGateOptions {
  int request_timeout_ms = 10000;  // From a connection's arming to its request read whole.
  size_t max_header_bytes = 16 << 10;
  size_t max_body_bytes = 1 << 20;
  int max_connections = 1024;            // Open connections in all, gated or served.
  int max_connections_per_client = 256;  // Per peer address.
  int num_threads = 64;                  // Inference pool.
  int num_light_threads = 4;             // /health, /metrics, status.
};

// One complete request as read by the gate.
struct GatedRequest {
  int fd = -1;
  std::string bytes;  // Request line, headers and the whole body, exactly.
  std::string peer;   // Client address.
};

class HttpGate {
 public:
  // Answers one complete request on `fd` (blocking, on a pool thread); returns true
  // to keep the connection for another request.
  using Serve = std::function<bool(const GatedRequest& request)>;
  // Whether a request goes to the light pool.
  using IsLight = std::function<bool(const std::string& method, const std::string& path)>;

  HttpGate(HttpGateOptions options, Serve serve, IsLight is_light);
  ~HttpGate();  // stop().
  HttpGate(const HttpGate&) = delete;
  HttpGate& operator=(const HttpGate&) = delete;

  // Serves connections accepted on `listen_fd` (bound and listening; not owned).
  Status start(int listen_fd);
  // Stops accepting, closes waiting connections, lets the pools finish what they
  // hold (their handlers see the server stopping) and joins. Idempotent.
  void stop();

  int num_open_connections() const;

 private:
  struct Conn;
  void loop();
  void accept_all();
  void on_readable(Conn* conn);
  void dispatch(Conn* conn, std::string request, bool light);
  void release(Conn* conn);  // Closes and forgets a connection (any thread).
  void close_with(Conn* conn, int status, const std::string& message);
  void wake();
  std::string over_cap_message(int total, int by_peer) const;

  const HttpGateOptions options_;
  const Serve serve_;
  const IsLight is_light_;
  int listen_fd_ = -1;
  int epoll_fd_ = -1;
  int wake_fd_ = -1;
  std::thread thread_;
  std::atomic<bool> stopping_{false};
  std::unique_ptr<httplib::TaskQueue> pool_;
  std::unique_ptr<httplib::TaskQueue> light_pool_;

  mutable Mutex mu_;
  int num_open_ GUARDED_BY(mu_) = 0;
  std::map<std::string, int> open_by_peer_ GUARDED_BY(mu_);
  std::vector<Conn*> rearm_ GUARDED_BY(mu_);  // Back from a pool.
  // Owned by the loop thread: connections it is reading (the key is the fd).
  std::map<int, std::unique_ptr<Conn>> waiting_;
};

}  // namespace flexpert
