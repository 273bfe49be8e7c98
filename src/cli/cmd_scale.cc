// SPDX-License-Identifier: Apache-2.0
// `flexpert scale`: asks a running server to change its membership (POST /v1/scale)
// and prints the report once the change has committed.
#include <httplib.h>

#include <cstdio>
#include <nlohmann/json.hpp>

#include "cli/commands.h"
#include "cli/flags.h"

namespace flexpert::cli {
namespace {

Status run_scale(const Flags& flags) {
  const std::string url = flags.str("url");
  if (url.rfind("http://", 0) != 0) return invalid_argument("--url must be http://HOST:PORT");
  if (flags.has("to") == flags.has("remove")) {
    return invalid_argument("give exactly one of --to N or --remove R1,R2");
  }
  nlohmann::json body;
  if (flags.has("to")) {
    FLEX_ASSIGN_OR_RETURN(int64_t n, flags.integer("to"));
    if (n < 1) return invalid_argument("--to must be >= 1");
    body["ranks"] = n;
  } else {
    FLEX_ASSIGN_OR_RETURN(auto list, flags.int_list("remove"));
    if (list.empty()) return invalid_argument("--remove needs at least one rank");
    body["remove"] = list;
  }
  httplib::Client client(url);
  client.set_connection_timeout(5, 0);
  client.set_read_timeout(600, 0);  // Returns when the change has committed.
  httplib::Headers headers;
  FLEX_ASSIGN_OR_RETURN(const std::string key, admin_key_from(flags));
  if (!key.empty()) headers.emplace("Authorization", "Bearer " + key);
  auto res = client.Post("/v1/scale", headers, body.dump(), "application/json");
  if (!res) return unavailable("no answer from " + url + ": " + httplib::to_string(res.error()));
  if (res->status != 200) {
    const std::string what = "HTTP " + std::to_string(res->status) + ": " + res->body;
    return res->status >= 400 && res->status < 500 && res->status != 409 ? invalid_argument(what)
                                                                         : unavailable(what);
  }
  auto report = nlohmann::json::parse(res->body, nullptr, false);
  std::printf("%s\n", report.is_discarded() ? res->body.c_str() : report.dump(2).c_str());
  return Status();
}

}  // namespace

int cmd_scale(const Args& args) {
  Flags flags;
  flags.value("url", "http://127.0.0.1:8000", "the server")
      .value("to", "", "the number of ranks to have")
      .value("remove", "", "rank ids to remove, comma-separated")
      .value("admin-key", "", "the server's admin key (visible in ps: prefer the next two)")
      .value("admin-key-file", "", "a file whose first line is the admin key")
      .boolean("help", "show this help");
  if (Status s = flags.parse(args); !s.ok()) return report_error("scale", s);
  if (flags.flag("help")) {
    std::printf("usage: flexpert scale --url URL (--to N | --remove R1,R2)\n%s",
                flags.help().c_str());
    return 0;
  }
  if (Status s = run_scale(flags); !s.ok()) return report_error("scale", s);
  return 0;
}

}  // namespace flexpert::cli
