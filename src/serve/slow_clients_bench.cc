// SPDX-License-Identifier: Apache-2.0
#include "serve/slow_clients_bench.h"

#include <arpa/inet.h>
#include <netinet/in.h>
#include <poll.h>
#include <sys/resource.h>
#include <sys/socket.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <cstring>
#include <thread>

#include "core/clock.h"

namespace flexpert {
namespace {

using Clock = std::chrono::steady_clock;

// `source`: the local address to connect from ("" for any).
int connect_to(const SlowClientsOptions& o, const std::string& source = "") {
  const int fd = ::socket(AF_INET, SOCK_STREAM | SOCK_CLOEXEC, 0);
  if (fd < 0) return -1;
  if (!source.empty()) {
    sockaddr_in local{};
    local.sin_family = AF_INET;
    if (::inet_pton(AF_INET, source.c_str(), &local.sin_addr) != 1 ||
        ::bind(fd, reinterpret_cast<sockaddr*>(&local), sizeof(local)) != 0) {
      ::close(fd);
      return -1;
    }
  }
  sockaddr_in addr{};
  addr.sin_family = AF_INET;
  addr.sin_port = htons(static_cast<uint16_t>(o.port));
  if (::inet_pton(AF_INET, o.host.c_str(), &addr.sin_addr) != 1 ||
      ::connect(fd, reinterpret_cast<sockaddr*>(&addr), sizeof(addr)) != 0) {
    ::close(fd);
    return -1;
  }
  return fd;
}

bool send_text(int fd, const std::string& text) {
  return ::send(fd, text.data(), text.size(), MSG_NOSIGNAL | MSG_DONTWAIT) ==
         static_cast<ssize_t>(text.size());
}

// GET /health on a fresh connection: milliseconds to the whole answer, or -1.
double probe_health(const SlowClientsOptions& o, int* status) {
  const auto t0 = Clock::now();
  *status = 0;
  const int fd = connect_to(o, o.probe_source);
  if (fd < 0) return -1;
  std::string reply;
  if (send_text(fd, "GET /health HTTP/1.1\r\nHost: bench\r\nConnection: close\r\n\r\n")) {
    char buf[4096];
    for (;;) {
      pollfd p{fd, POLLIN, 0};
      const int left = o.probe_timeout_ms - static_cast<int>(ms_since(t0));
      if (left <= 0 || ::poll(&p, 1, left) <= 0) break;
      const ssize_t n = ::recv(fd, buf, sizeof(buf), 0);
      if (n <= 0) break;
      reply.append(buf, static_cast<size_t>(n));
    }
  }
  ::close(fd);
  if (reply.rfind("HTTP/1.1 ", 0) != 0) return -1;
  *status = std::atoi(reply.c_str() + 9);
  return ms_since(t0);
}

struct Slow {
  int fd = -1;
};

double percentile(std::vector<double> v, double q) {
  if (v.empty()) return 0;
  std::sort(v.begin(), v.end());
  return v[std::min(v.size() - 1, static_cast<size_t>(q * static_cast<double>(v.size())))];
}

}  // namespace

Result<nlohmann::json> bench_slow_clients(const SlowClientsOptions& o) {
  if (o.steps.empty() || o.hold_s <= 0 || o.trickle_ms <= 0 || o.probe_interval_ms <= 0) {
    return invalid_argument("steps, hold_s, trickle_ms and probe_interval_ms must be positive");
  }
  rlimit limit{};  // Each slow client is a descriptor here too.
  if (::getrlimit(RLIMIT_NOFILE, &limit) == 0 && limit.rlim_cur < limit.rlim_max) {
    limit.rlim_cur = limit.rlim_max;
    (void)::setrlimit(RLIMIT_NOFILE, &limit);
  }
  int status = 0;
  if (probe_health(o, &status) < 0) {
    return unavailable("no answer to GET /health on " + o.host + ":" + std::to_string(o.port));
  }

  // Streaming completions, read and dropped by a thread of their own.
  std::vector<int> streams;
  for (int i = 0; i < o.num_streams; ++i) {
    const int fd = connect_to(o);
    if (fd < 0) break;
    const std::string body = R"({"prompt": [1, 2, 3], "max_tokens": )" +
                             std::to_string(o.stream_max_tokens) +
                             R"(, "temperature": 0, "ignore_eos": true, "stream": true})";
    send_text(fd,
              "POST /v1/completions HTTP/1.1\r\nHost: bench\r\nContent-Type: "
              "application/json\r\nContent-Length: " +
                  std::to_string(body.size()) + "\r\n\r\n" + body);
    streams.push_back(fd);
  }
  std::atomic<bool> done{false};
  std::thread drain([&] {
    std::vector<pollfd> fds;
    for (int fd : streams) fds.push_back({fd, POLLIN, 0});
    char buf[16384];
    while (!done && !fds.empty()) {
      if (::poll(fds.data(), fds.size(), 50) <= 0) continue;
      for (pollfd& p : fds) {
        if (p.fd >= 0 && (p.revents & (POLLIN | POLLHUP | POLLERR)) != 0 &&
            ::recv(p.fd, buf, sizeof(buf), MSG_DONTWAIT) == 0) {
          p.fd = -1;  // Finished: poll ignores negative descriptors.
        }
      }
    }
  });

  nlohmann::json steps = nlohmann::json::array();
  std::vector<Slow> slow;
  int tolerated = 0;
  const std::string head = "POST /v1/completions HTTP/1.1\r\nHost: bench\r\nX-Slow: ";
  for (int target : o.steps) {
    int refused = 0, timed_out = 0, other = 0;
    // Reads what the server said on a closed connection and reopens it.
    auto reopen = [&](Slow& s) {
      char buf[512];
      const ssize_t n = ::recv(s.fd, buf, sizeof(buf) - 1, MSG_DONTWAIT);
      const std::string said = n > 0 ? std::string(buf, static_cast<size_t>(n)) : "";
      if (said.rfind("HTTP/1.1 503", 0) == 0) {
        ++refused;
      } else if (said.rfind("HTTP/1.1 408", 0) == 0) {
        ++timed_out;
      } else {
        ++other;
      }
      ::close(s.fd);
      s.fd = connect_to(o);
      if (s.fd >= 0) send_text(s.fd, head);
    };
    while (static_cast<int>(slow.size()) < target) {
      Slow s{connect_to(o)};
      if (s.fd < 0) break;  // Out of ports or descriptors: report what is held.
      send_text(s.fd, head);
      slow.push_back(s);
    }
    std::vector<double> health_ms;
    int probes = 0, failures = 0;
    double held_sum = 0;
    const auto t0 = Clock::now();
    auto next_trickle = t0;
    while (ms_since(t0) < o.hold_s * 1000) {
      if (Clock::now() >= next_trickle) {
        for (Slow& s : slow) {
          if (s.fd < 0 || !send_text(s.fd, "x")) reopen(s);
        }
        next_trickle = Clock::now() + std::chrono::milliseconds(o.trickle_ms);
      }
      // Connections the server closed (a 408 or 503 is readable) are reopened.
      std::vector<pollfd> fds;
      for (const Slow& s : slow) fds.push_back({s.fd, POLLIN, 0});
      if (::poll(fds.data(), fds.size(), 0) > 0) {
        for (size_t i = 0; i < fds.size(); ++i) {
          if (fds[i].revents != 0) reopen(slow[i]);
        }
      }
      int held = 0;
      for (const Slow& s : slow) held += s.fd >= 0;
      held_sum += held;
      ++probes;
      const double ms = probe_health(o, &status);
      if (ms < 0 || status != 200) {
        ++failures;
      } else {
        health_ms.push_back(ms);
      }
      std::this_thread::sleep_for(std::chrono::milliseconds(o.probe_interval_ms));
    }
    const double max_ms = health_ms.empty() ? 0 : percentile(health_ms, 1.0);
    const bool within = failures == 0 && max_ms <= o.health_target_ms;
    if (within) tolerated = target;
    steps.push_back({{"slow_target", target},
                     {"slow_held", probes ? held_sum / probes : 0.0},
                     {"refused_503", refused},
                     {"timed_out_408", timed_out},
                     {"closed_other", other},
                     {"probes", probes},
                     {"probe_failures", failures},
                     {"health_ms",
                      {{"p50", percentile(health_ms, 0.5)},
                       {"p99", percentile(health_ms, 0.99)},
                       {"max", max_ms}}},
                     {"within_target", within}});
  }
  done = true;
  drain.join();
  for (const Slow& s : slow) {
    if (s.fd >= 0) ::close(s.fd);
  }
  for (int fd : streams) ::close(fd);
  return nlohmann::json{{"host", o.host},
                        {"port", o.port},
                        {"hold_s", o.hold_s},
                        {"trickle_ms", o.trickle_ms},
                        {"num_streams", static_cast<int>(streams.size())},
                        {"health_target_ms", o.health_target_ms},
                        {"steps", steps},
                        {"tolerated", tolerated}};
}

}  // namespace flexpert
