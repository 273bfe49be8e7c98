// SPDX-License-Identifier: Apache-2.0
#include "transport/ucx/ucx_wire.h"

#include <charconv>

namespace flexpert::ucx {

namespace {

template <typename T>
bool parse_number(std::string_view text, T* out) {
  if (text.empty()) return false;
  const auto [end, ec] = std::from_chars(text.data(), text.data() + text.size(), *out);
  return ec == std::errc() && end == text.data() + text.size();
}

// Consumes "/<tag><number>" from the front of `rest`.
template <typename T>
bool consume_field(std::string_view& rest, char tag, T* out) {
  if (rest.size() < 3 || rest[0] != '/' || rest[1] != tag) return false;
  rest.remove_prefix(2);
  const size_t end = rest.find('/');
  const std::string_view number = rest.substr(0, end);
  rest.remove_prefix(end == std::string_view::npos ? rest.size() : end);
  return parse_number(number, out);
}

}  // namespace

const char* op_kind_name(OpKind kind) {
  switch (kind) {
    case OpKind::kNone:
      return "none";
    case OpKind::kAllGather:
      return "all_gather";
    case OpKind::kBarrier:
      return "barrier";
    case OpKind::kExchange:
      return "exchange";
  }
  return "unknown";
}

std::string Address::to_string() const {
  const bool v6 = host.find(':') != std::string::npos;
  return "ucx://" + (v6 ? "[" + host + "]" : host) + ":" + std::to_string(port) + "/r" +
         std::to_string(rank) + "/i" + std::to_string(incarnation) + "/p" + std::to_string(pid);
}

Result<Address> Address::parse(std::string_view text) {
  auto bad = [&](const char* why) {
    return invalid_argument("'" + std::string(text) + "' is not a ucx transport address (" + why +
                            "; expected ucx://HOST:PORT/r<rank>/i<incarnation>/p<pid>)");
  };
  constexpr std::string_view kPrefix = "ucx://";
  if (text.substr(0, kPrefix.size()) != kPrefix) return bad("no ucx:// prefix");
  std::string_view rest = text.substr(kPrefix.size());
  const size_t slash = rest.find('/');
  if (slash == std::string_view::npos) return bad("no rank");
  std::string_view host_port = rest.substr(0, slash);
  rest.remove_prefix(slash);
  const size_t colon = host_port.rfind(':');
  if (colon == std::string_view::npos || colon == 0) return bad("no HOST:PORT");
  Address a;
  std::string_view host = host_port.substr(0, colon);
  if (host.front() == '[') {
    if (host.size() < 3 || host.back() != ']') return bad("unbalanced [IPv6]");
    host = host.substr(1, host.size() - 2);
  }
  a.host = std::string(host);
  if (!parse_number(host_port.substr(colon + 1), &a.port) || a.port == 0) return bad("bad port");
  if (!consume_field(rest, 'r', &a.rank) || a.rank < 0) return bad("bad rank");
  if (!consume_field(rest, 'i', &a.incarnation)) return bad("bad incarnation");
  if (!consume_field(rest, 'p', &a.pid) || !rest.empty()) return bad("bad pid");
  return a;
}

}  // namespace flexpert::ucx
