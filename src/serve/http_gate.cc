// SPDX-License-Identifier: Apache-2.0
#include "serve/http_gate.h"

#include <arpa/inet.h>
#include <fcntl.h>
#include <httplib.h>
#include <netinet/in.h>
#include <netinet/tcp.h>
#include <sys/epoll.h>
#include <sys/eventfd.h>
#include <sys/socket.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <chrono>
#include <cstring>

#include "flexpert/logging.h"
#include "serve/completion_api.h"

namespace flexpert {
namespace {

using Clock = std::chrono::steady_clock;

constexpr size_t kReadChunk = 64 << 10;
constexpr auto kSweepInterval = std::chrono::milliseconds(50);
// Connections accepted beyond a cap for light routes only (see accept_all).
constexpr int kLightReserve = 16;
constexpr auto kReserveTimeout = std::chrono::milliseconds(1000);

std::string peer_address(const sockaddr_storage& addr) {
  char text[INET6_ADDRSTRLEN] = {0};
  if (addr.ss_family == AF_INET) {
    ::inet_ntop(AF_INET, &reinterpret_cast<const sockaddr_in&>(addr).sin_addr, text, sizeof(text));
  } else if (addr.ss_family == AF_INET6) {
    ::inet_ntop(AF_INET6, &reinterpret_cast<const sockaddr_in6&>(addr).sin6_addr, text,
                sizeof(text));
  }
  return text;
}

bool iequals(std::string_view a, std::string_view b) {
  return a.size() == b.size() && std::equal(a.begin(), a.end(), b.begin(), [](char x, char y) {
           return std::tolower(static_cast<unsigned char>(x)) ==
                  std::tolower(static_cast<unsigned char>(y));
         });
}

std::string_view trim(std::string_view s) {
  while (!s.empty() && (s.front() == ' ' || s.front() == '\t')) s.remove_prefix(1);
  while (!s.empty() && (s.back() == ' ' || s.back() == '\t' || s.back() == '\r'))
    s.remove_suffix(1);
  return s;
}

// What the gate needs from a request head (line + headers, up to the blank line).
struct Head {
  std::string method, path;
  uint64_t content_length = 0;
  bool chunked = false;
  bool expect_continue = false;
  bool bad = false;
  size_t expect_line_begin = 0, expect_line_end = 0;  // The Expect header's bytes.
};

Head parse_head(std::string_view head) {
  Head h;
  size_t eol = head.find("\r\n");
  const std::string_view line = head.substr(0, eol);
  const size_t sp1 = line.find(' ');
  const size_t sp2 = sp1 == std::string_view::npos ? sp1 : line.find(' ', sp1 + 1);
  if (sp2 == std::string_view::npos) {
    h.bad = true;
    return h;
  }
  h.method = std::string(line.substr(0, sp1));
  std::string_view target = line.substr(sp1 + 1, sp2 - sp1 - 1);
  h.path = std::string(target.substr(0, target.find('?')));
  bool has_length = false;
  for (size_t at = eol + 2; at < head.size();) {
    size_t end = head.find("\r\n", at);
    if (end == std::string_view::npos) end = head.size();
    const std::string_view header = head.substr(at, end - at);
    const size_t colon = header.find(':');
    if (colon != std::string_view::npos) {
      const std::string_view name = trim(header.substr(0, colon));
      const std::string_view value = trim(header.substr(colon + 1));
      if (iequals(name, "content-length")) {
        uint64_t n = 0;
        const bool digits =
            !value.empty() && value.size() <= 18 &&
            std::all_of(value.begin(), value.end(), [](char c) { return c >= '0' && c <= '9'; });
        for (char c : value) n = n * 10 + static_cast<uint64_t>(c - '0');
        if (!digits || (has_length && n != h.content_length)) h.bad = true;
        h.content_length = n;
        has_length = true;
      } else if (iequals(name, "transfer-encoding")) {
        h.chunked = true;
      } else if (iequals(name, "expect") && iequals(value, "100-continue")) {
        h.expect_continue = true;
        h.expect_line_begin = at;
        h.expect_line_end = end + 2;
      }
    }
    at = end + 2;
  }
  return h;
}

// Best effort on a non-blocking socket: the gate never waits on a client.
void send_all_nonblocking(int fd, const std::string& bytes) {
  size_t done = 0;
  while (done < bytes.size()) {
    const ssize_t n = ::send(fd, bytes.data() + done, bytes.size() - done, MSG_NOSIGNAL);
    if (n <= 0) return;
    done += static_cast<size_t>(n);
  }
}

std::string error_response(int status, const std::string& message) {
  const char* reason = status == 503   ? "Service Unavailable"
                       : status == 408 ? "Request Timeout"
                       : status == 411 ? "Length Required"
                       : status == 413 ? "Payload Too Large"
                       : status == 431 ? "Request Header Fields Too Large"
                                       : "Bad Request";
  const std::string type = status == 503 ? "server_error" : "invalid_request_error";
  const std::string body =
      dump_json(error_json(message, type, "", status == 503 ? "UNAVAILABLE" : ""));
  // A refusal over a connection cap lasts until a connection closes: retry in a second.
  return "HTTP/1.1 " + std::to_string(status) + " " + reason +
         (status == 503 ? "\r\nRetry-After: 1" : "") +
         "\r\nContent-Type: application/json\r\nConnection: close\r\nContent-Length: " +
         std::to_string(body.size()) + "\r\n\r\n" + body;
}

}  // namespace

struct HttpGate::Conn {
  int fd = -1;
  std::string peer;
  std::string buf;  // Bytes read and not yet handed over (a request, or its start).
  Clock::time_point deadline;
  bool sent_continue = false;
  bool over_cap = false;  // Accepted into the reserve: light routes only.
};

std::string HttpGate::over_cap_message(int total, int by_peer) const {
  if (total >= options_.max_connections) {
    return "the server has " + std::to_string(total) +
           " connections open, its limit (--http-max-connections); retry later";
  }
  return "this client has " + std::to_string(by_peer) +
         " connections open, the limit per client (--http-max-connections-per-client); "
         "retry later";
}

HttpGate::HttpGate(HttpGateOptions options, Serve serve, IsLight is_light)
    : options_(options), serve_(std::move(serve)), is_light_(std::move(is_light)) {}

HttpGate::~HttpGate() { stop(); }

Status HttpGate::start(int listen_fd) {
  FLEX_CHECK(listen_fd_ < 0) << "start() called twice";
  listen_fd_ = listen_fd;
  const int flags = ::fcntl(listen_fd, F_GETFL);
  if (flags < 0 || ::fcntl(listen_fd, F_SETFL, flags | O_NONBLOCK) != 0) {
    return internal_error(std::string("fcntl on the listening socket: ") + std::strerror(errno));
  }
  epoll_fd_ = ::epoll_create1(EPOLL_CLOEXEC);
  wake_fd_ = ::eventfd(0, EFD_NONBLOCK | EFD_CLOEXEC);
  if (epoll_fd_ < 0 || wake_fd_ < 0) {
    return resource_exhausted(std::string("epoll/eventfd: ") + std::strerror(errno));
  }
  epoll_event ev{};
  ev.events = EPOLLIN;
  ev.data.fd = listen_fd_;
  ::epoll_ctl(epoll_fd_, EPOLL_CTL_ADD, listen_fd_, &ev);
  ev.data.fd = wake_fd_;
  ::epoll_ctl(epoll_fd_, EPOLL_CTL_ADD, wake_fd_, &ev);
  pool_ =
      std::make_unique<httplib::ThreadPool>(static_cast<size_t>(std::max(1, options_.num_threads)));
  light_pool_ = std::make_unique<httplib::ThreadPool>(
      static_cast<size_t>(std::max(1, options_.num_light_threads)));
  thread_ = std::thread([this] { loop(); });
  return Status();
}

void HttpGate::stop() {
  if (!thread_.joinable()) return;
  stopping_ = true;
  wake();
  thread_.join();
  // Queued requests still run: their handlers see the server stopping and answer 503.
  pool_->shutdown();
  light_pool_->shutdown();
  std::vector<Conn*> rearmed;
  {
    MutexLock lock(mu_);
    rearmed.swap(rearm_);
  }
  for (Conn* c : rearmed) release(c);
  ::close(epoll_fd_);
  ::close(wake_fd_);
}

int HttpGate::num_open_connections() const {
  MutexLock lock(mu_);
  return num_open_;
}

void HttpGate::wake() {
  const uint64_t one = 1;
  (void)!::write(wake_fd_, &one, sizeof(one));
}

void HttpGate::loop() {
  std::vector<epoll_event> events(256);
  auto last_sweep = Clock::now();
  while (!stopping_) {
    // Deadlines are coarse (seconds): checking them every kSweepInterval keeps an
    // event on one of thousands of connections from costing a scan of all of them.
    const int n = ::epoll_wait(epoll_fd_, events.data(), static_cast<int>(events.size()),
                               static_cast<int>(kSweepInterval.count()));
    for (int i = 0; i < n && !stopping_; ++i) {
      const int fd = events[static_cast<size_t>(i)].data.fd;
      if (fd == listen_fd_) {
        accept_all();
      } else if (fd == wake_fd_) {
        uint64_t count;
        (void)!::read(wake_fd_, &count, sizeof(count));
        std::vector<Conn*> back;
        {
          MutexLock lock(mu_);
          back.swap(rearm_);
        }
        for (Conn* c : back) {
          c->deadline = Clock::now() + std::chrono::milliseconds(options_.request_timeout_ms);
          c->sent_continue = false;
          waiting_.emplace(c->fd, std::unique_ptr<Conn>(c));
          epoll_event ev{};
          ev.events = EPOLLIN | EPOLLRDHUP;
          ev.data.fd = c->fd;
          ::epoll_ctl(epoll_fd_, EPOLL_CTL_ADD, c->fd, &ev);
          if (!c->buf.empty()) on_readable(c);  // A pipelined request may be whole already.
        }
      } else if (auto it = waiting_.find(fd); it != waiting_.end()) {
        on_readable(it->second.get());
      }
    }
    const auto t = Clock::now();
    if (t - last_sweep < kSweepInterval) continue;
    last_sweep = t;
    std::vector<Conn*> expired;
    for (const auto& [fd, conn] : waiting_) {
      if (conn->deadline <= t) expired.push_back(conn.get());
    }
    for (Conn* c : expired) {
      if (c->buf.empty()) {  // Idle keep-alive, or connected and silent: just close.
        ::epoll_ctl(epoll_fd_, EPOLL_CTL_DEL, c->fd, nullptr);
        release(waiting_.extract(c->fd).mapped().release());
      } else {
        close_with(c, 408,
                   "the request was not received within " +
                       std::to_string(options_.request_timeout_ms) + " ms");
      }
    }
  }
  ::close(listen_fd_);
  for (auto& [fd, conn] : waiting_) release(conn.release());
  waiting_.clear();
}

void HttpGate::accept_all() {
  for (;;) {
    sockaddr_storage addr{};
    socklen_t len = sizeof(addr);
    const int fd = ::accept4(listen_fd_, reinterpret_cast<sockaddr*>(&addr), &len,
                             SOCK_NONBLOCK | SOCK_CLOEXEC);
    if (fd < 0) {
      if (errno == EINTR || errno == ECONNABORTED) continue;
      if (errno == EMFILE || errno == ENFILE) {
        FLEX_LOG(WARN) << "accept: " << std::strerror(errno) << " (raise the open-file limit)";
      }
      return;  // EAGAIN: none left.
    }
    int yes = 1;
    (void)::setsockopt(fd, IPPROTO_TCP, TCP_NODELAY, &yes, sizeof(yes));
    auto conn = std::make_unique<Conn>();
    conn->fd = fd;
    conn->peer = peer_address(addr);
    conn->deadline = Clock::now() + std::chrono::milliseconds(options_.request_timeout_ms);
    std::string refusal;
    {
      MutexLock lock(mu_);
      const int by_peer = open_by_peer_[conn->peer];
      // Over a cap, a connection is still read (within a small reserve) but served
      // only if it asks for a light route: a client at its cap can still probe /health.
      conn->over_cap =
          num_open_ >= options_.max_connections || by_peer >= options_.max_connections_per_client;
      if (num_open_ >= options_.max_connections + kLightReserve ||
          by_peer >= options_.max_connections_per_client + kLightReserve) {
        refusal = over_cap_message(num_open_, by_peer);
      } else {
        ++num_open_;
        ++open_by_peer_[conn->peer];
      }
      if (!refusal.empty() && open_by_peer_[conn->peer] == 0) open_by_peer_.erase(conn->peer);
    }
    if (conn->over_cap) {  // A reserve place is held briefly: a probe is quick.
      conn->deadline = std::min(conn->deadline, Clock::now() + kReserveTimeout);
    }
    if (!refusal.empty()) {
      send_all_nonblocking(fd, error_response(503, refusal));
      ::shutdown(fd, SHUT_WR);
      ::close(fd);
      continue;
    }
    epoll_event ev{};
    ev.events = EPOLLIN | EPOLLRDHUP;
    ev.data.fd = fd;
    ::epoll_ctl(epoll_fd_, EPOLL_CTL_ADD, fd, &ev);
    waiting_.emplace(fd, std::move(conn));
  }
}

void HttpGate::on_readable(Conn* conn) {
  // Read what is there, never beyond what one request may hold.
  const size_t cap = options_.max_header_bytes + options_.max_body_bytes + kReadChunk;
  bool peer_closed = false;
  while (conn->buf.size() < cap) {
    char chunk[kReadChunk];
    const ssize_t n = ::recv(conn->fd, chunk, std::min(sizeof(chunk), cap - conn->buf.size()), 0);
    if (n > 0) {
      conn->buf.append(chunk, static_cast<size_t>(n));
      continue;
    }
    if (n == 0) peer_closed = true;
    if (n < 0 && errno == EINTR) continue;
    if (n < 0 && errno != EAGAIN && errno != EWOULDBLOCK) peer_closed = true;
    break;
  }
  const size_t head_end = conn->buf.find("\r\n\r\n");
  if (head_end == std::string::npos || head_end + 4 > options_.max_header_bytes) {
    if (head_end != std::string::npos || conn->buf.size() > options_.max_header_bytes) {
      close_with(
          conn, 431,
          "the request headers exceed " + std::to_string(options_.max_header_bytes) + " bytes");
    } else if (peer_closed) {
      ::epoll_ctl(epoll_fd_, EPOLL_CTL_DEL, conn->fd, nullptr);
      release(waiting_.extract(conn->fd).mapped().release());
    }
    return;
  }
  Head head = parse_head(std::string_view(conn->buf).substr(0, head_end + 2));
  if (head.bad) {
    close_with(conn, 400, "malformed HTTP request line or Content-Length");
    return;
  }
  if (head.chunked) {
    close_with(conn, 411, "request bodies must have a Content-Length (no chunked encoding)");
    return;
  }
  if (head.content_length > options_.max_body_bytes) {
    close_with(conn, 413,
               "the request body exceeds " + std::to_string(options_.max_body_bytes) + " bytes");
    return;
  }
  const size_t request_bytes = head_end + 4 + static_cast<size_t>(head.content_length);
  if (conn->buf.size() < request_bytes) {
    if (peer_closed) {
      ::epoll_ctl(epoll_fd_, EPOLL_CTL_DEL, conn->fd, nullptr);
      release(waiting_.extract(conn->fd).mapped().release());
      return;
    }
    if (head.expect_continue && !conn->sent_continue) {
      send_all_nonblocking(conn->fd, "HTTP/1.1 100 Continue\r\n\r\n");
      conn->sent_continue = true;
    }
    return;  // The deadline bounds the wait.
  }
  const bool light = is_light_(head.method, head.path);
  if (conn->over_cap && !light) {
    int total = 0, by_peer = 0;
    {
      MutexLock lock(mu_);
      total = num_open_ - 1;
      by_peer = open_by_peer_[conn->peer] - 1;
    }
    close_with(conn, 503, over_cap_message(total, by_peer));
    return;
  }
  std::string request = conn->buf.substr(0, request_bytes);
  conn->buf.erase(0, request_bytes);  // The start of a pipelined next request, if any.
  // The gate answered (or the body is here): the server must not send 100 again.
  if (head.expect_continue) {
    request.erase(head.expect_line_begin, head.expect_line_end - head.expect_line_begin);
  }
  ::epoll_ctl(epoll_fd_, EPOLL_CTL_DEL, conn->fd, nullptr);
  Conn* raw = waiting_.extract(conn->fd).mapped().release();
  dispatch(raw, std::move(request), light);
}

void HttpGate::dispatch(Conn* conn, std::string request, bool light) {
  auto task = [this, conn, request = std::move(request)]() {
    bool keep = false;
    try {
      keep = serve_(GatedRequest{conn->fd, request, conn->peer});
    } catch (...) {
      keep = false;  // The server answers its own errors; anything else ends the connection.
    }
    if (keep && !stopping_) {
      {
        MutexLock lock(mu_);
        rearm_.push_back(conn);
      }
      wake();
    } else {
      release(conn);
    }
  };
  (light ? light_pool_ : pool_)->enqueue(std::move(task));
}

void HttpGate::release(Conn* conn) {
  ::close(conn->fd);
  {
    MutexLock lock(mu_);
    --num_open_;
    if (--open_by_peer_[conn->peer] <= 0) open_by_peer_.erase(conn->peer);
  }
  delete conn;
}

void HttpGate::close_with(Conn* conn, int status, const std::string& message) {
  send_all_nonblocking(conn->fd, error_response(status, message));
  ::shutdown(conn->fd, SHUT_WR);
  ::epoll_ctl(epoll_fd_, EPOLL_CTL_DEL, conn->fd, nullptr);
  release(waiting_.extract(conn->fd).mapped().release());
}

}  // namespace flexpert
