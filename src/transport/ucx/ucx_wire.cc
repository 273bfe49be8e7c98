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

namespace {
constexpr char kAlphabet[] = "ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz0123456789-_";
}  // namespace

std::string base64url_encode(std::string_view bytes) {
  std::string out;
  out.reserve((bytes.size() + 2) / 3 * 4);
  uint32_t acc = 0;
  int bits = 0;
  for (unsigned char c : bytes) {
    acc = (acc << 8) | c;
    bits += 8;
    while (bits >= 6) {
      bits -= 6;
      out.push_back(kAlphabet[(acc >> bits) & 63]);
    }
  }
  if (bits > 0) out.push_back(kAlphabet[(acc << (6 - bits)) & 63]);
  return out;
}

bool base64url_decode(std::string_view text, std::string* out) {
  if (text.size() % 4 == 1) return false;
  out->clear();
  uint32_t acc = 0;
  int bits = 0;
  for (char c : text) {
    const char* at = std::char_traits<char>::find(kAlphabet, 64, c);
    if (at == nullptr) return false;
    acc = (acc << 6) | static_cast<uint32_t>(at - kAlphabet);
    bits += 6;
    if (bits >= 8) {
      bits -= 8;
      out->push_back(static_cast<char>((acc >> bits) & 0xff));
    }
  }
  return true;
}

std::string Address::to_string() const {
  const bool v6 = host.find(':') != std::string::npos;
  std::string out = "ucx://";
  if (!host.empty()) out += (v6 ? "[" + host + "]" : host) + ":" + std::to_string(port);
  out += "/r" + std::to_string(rank) + "/i" + std::to_string(incarnation) + "/p" +
         std::to_string(pid) + "/t" + std::to_string(start_time);
  if (!worker.empty()) out += "/w" + base64url_encode(worker);
  return out;
}

Result<Address> Address::parse(std::string_view text) {
  auto bad = [&](const char* why) {
    // NOTE: appended piece by piece: GCC 12 warns (-Wrestrict, a false positive) on
    // "literal" + std::string&& here.
    std::string message(1, '\'');
    message.append(text)
        .append("' is not a ucx transport address (")
        .append(why)
        .append(
            "; expected ucx://HOST:PORT/r<rank>/i<incarnation>/p<pid> or "
            "ucx:///r<rank>/i<incarnation>/p<pid>/w<worker address>)");
    return invalid_argument(message);
  };
  constexpr std::string_view kPrefix = "ucx://";
  if (text.substr(0, kPrefix.size()) != kPrefix) return bad("no ucx:// prefix");
  std::string_view rest = text.substr(kPrefix.size());
  const size_t slash = rest.find('/');
  if (slash == std::string_view::npos) return bad("no rank");
  std::string_view host_port = rest.substr(0, slash);
  rest.remove_prefix(slash);
  Address a;
  if (!host_port.empty()) {
    const size_t colon = host_port.rfind(':');
    if (colon == std::string_view::npos || colon == 0) return bad("no HOST:PORT");
    std::string_view host = host_port.substr(0, colon);
    if (host.front() == '[') {
      if (host.size() < 3 || host.back() != ']') return bad("unbalanced [IPv6]");
      host = host.substr(1, host.size() - 2);
    }
    a.host = std::string(host);
    if (!parse_number(host_port.substr(colon + 1), &a.port) || a.port == 0) return bad("bad port");
  }
  if (!consume_field(rest, 'r', &a.rank) || a.rank < 0) return bad("bad rank");
  if (!consume_field(rest, 'i', &a.incarnation)) return bad("bad incarnation");
  if (!consume_field(rest, 'p', &a.pid)) return bad("bad pid");
  if (!consume_field(rest, 't', &a.start_time)) return bad("bad start time");
  if (!rest.empty()) {
    if (rest.size() < 3 || rest.substr(0, 2) != "/w" ||
        !base64url_decode(rest.substr(2), &a.worker))
      return bad("bad worker address");
  }
  if (a.host.empty() == a.worker.empty()) return bad("needs exactly one of HOST:PORT and /w");
  return a;
}

}  // namespace flexpert::ucx
