// SPDX-License-Identifier: Apache-2.0
// tokenizer_bench: encode throughput (MB of UTF-8 text per second, one thread) of the
// published Qwen3 and DeepSeek-V3 tokenizers, beside Hugging Face's JS tokenizer on the same
// text in the same run, and the cost per streamed token of IncrementalDecoder::push, alone and
// inside the server's TextStream with stop strings.
// Prints a table; --json FILE writes the figures. The corpus: the strings of
// tests/tokenizer/testdata/strings.json (many scripts, emoji, code, whitespace) cut and mixed
// by a seeded generator up to --mib MiB, so that words repeat as in real text but not in one
// fixed order.
#include <chrono>
#include <cstdio>
#include <fstream>
#include <nlohmann/json.hpp>
#include <random>
#include <string>
#include <vector>

#include "../tests/tokenizer/js_reference.h"
#include "flexpert/tokenizer.h"
#include "serve/text_stream.h"

namespace {

using nlohmann::json;
using Clock = std::chrono::steady_clock;

double seconds_since(Clock::time_point start) {
  return std::chrono::duration<double>(Clock::now() - start).count();
}

std::string make_corpus(size_t bytes) {
  std::ifstream in(std::string(FLEXPERT_TOKENIZER_TESTDATA_DIR) + "/strings.json");
  const auto strings = json::parse(in)["strings"].get<std::vector<std::string>>();
  std::mt19937 rng(7);
  const std::vector<std::string> joins = {" ", "\n", "\n\n", " ", ". ", ", "};
  std::string corpus;
  while (corpus.size() < bytes) {
    const std::string& s = strings[rng() % strings.size()];
    size_t begin = s.empty() ? 0 : rng() % s.size();
    while (begin > 0 && (static_cast<unsigned char>(s[begin]) & 0xC0) == 0x80) --begin;
    corpus += rng() % 3 == 0 ? s.substr(begin) : s;
    corpus += joins[rng() % joins.size()];
  }
  return corpus;
}

}  // namespace

int main(int argc, char** argv) {
  std::string json_path;
  double mib = 2.0;
  for (int i = 1; i < argc; ++i) {
    const std::string arg = argv[i];
    if (arg == "--json" && i + 1 < argc) {
      json_path = argv[++i];
    } else if (arg == "--mib" && i + 1 < argc) {
      mib = std::stod(argv[++i]);
    } else {
      std::fprintf(stderr, "usage: tokenizer_bench [--mib 2] [--json FILE]\n");
      return 2;
    }
  }
  const std::string corpus = make_corpus(static_cast<size_t>(mib * (1 << 20)));
  const double mb = static_cast<double>(corpus.size()) / 1e6;
  json results = json::array();
  std::printf("corpus: %.2f MB of mixed-script text (tests/tokenizer/testdata/strings.json)\n", mb);
  std::printf("%-12s %10s %12s %12s %10s %14s %14s %14s\n", "tokenizer", "ids", "cold MB/s",
              "warm MB/s", "JS MB/s", "push ns/token", "+stops ns/tok", "decode ns/tok");
  for (const std::string family : {"qwen3", "deepseek_v3"}) {
    auto loaded = flexpert::Tokenizer::load(flexpert_test::model_dir(family));
    if (!loaded.ok()) {
      std::fprintf(stderr, "%s (run bash scripts/setup.sh --deps-only)\n",
                   loaded.status().to_string().c_str());
      return 1;
    }
    const flexpert::Tokenizer& tokenizer = **loaded;
    // Cold: the first pass fills the per-word BPE cache; warm: the best of three later passes.
    auto start = Clock::now();
    std::vector<int32_t> ids = tokenizer.encode(corpus).value();
    const double cold_s = seconds_since(start);
    double warm_s = 1e30;
    for (int rep = 0; rep < 3; ++rep) {
      start = Clock::now();
      ids = tokenizer.encode(corpus).value();
      warm_s = std::min(warm_s, seconds_since(start));
    }
    // Streaming: one push per token, as a server relays them.
    flexpert::IncrementalDecoder stream(tokenizer);
    size_t streamed_bytes = 0;
    start = Clock::now();
    for (int32_t id : ids) streamed_bytes += stream.push(id).value().size();
    streamed_bytes += stream.flush().size();
    const double push_s = seconds_since(start);
    // The server's streaming path (src/serve/text_stream.h): the same pushes plus four stop
    // strings that never match but whose first characters are common, so text is held back.
    flexpert::TextStream stops(
        tokenizer, {{"\n\n<<stop>>", "The end.\x01", "。。。\x01", "</answer>\x01"}, false});
    size_t stopped_bytes = 0;
    start = Clock::now();
    for (int32_t id : ids) stopped_bytes += stops.push(id).value().size();
    stopped_bytes += stops.finish().size();
    const double stop_s = seconds_since(start);
    start = Clock::now();
    const std::string decoded = tokenizer.decode(ids).value();
    const double decode_s = seconds_since(start);
    // TextStream skips special tokens, as the server does.
    if (decoded.size() != streamed_bytes ||
        tokenizer.decode(ids, /*skip_special_tokens=*/true).value().size() != stopped_bytes) {
      std::fprintf(stderr, "streamed text differs from decode\n");
      return 1;
    }
    double js_mbps = 0;
    if (flexpert_test::have_node()) {
      std::string error;
      const json answer = flexpert_test::run_reference(
          "bench", {{"family", family}, {"text", corpus}, {"repeats", 3}}, &error);
      if (error.empty()) {
        js_mbps = answer["bytes"].get<double>() / 1e6 / answer["seconds"].get<double>();
      } else {
        std::fprintf(stderr, "JS reference: %s\n", error.c_str());
      }
    }
    const double n = static_cast<double>(ids.size());
    std::printf("%-12s %10zu %12.2f %12.2f %10.2f %14.1f %14.1f %14.1f\n", family.c_str(),
                ids.size(), mb / cold_s, mb / warm_s, js_mbps, push_s / n * 1e9, stop_s / n * 1e9,
                decode_s / n * 1e9);
    results.push_back({{"tokenizer", family},
                       {"corpus_bytes", corpus.size()},
                       {"num_ids", ids.size()},
                       {"encode_cold_mb_per_s", mb / cold_s},
                       {"encode_warm_mb_per_s", mb / warm_s},
                       {"js_encode_mb_per_s", js_mbps},
                       {"stream_push_ns_per_token", push_s / n * 1e9},
                       {"stream_with_stop_strings_ns_per_token", stop_s / n * 1e9},
                       {"decode_ns_per_token", decode_s / n * 1e9}});
  }
  if (!json_path.empty()) {
    std::ofstream(json_path) << json{{"benchmark", "tokenizer_bench"}, {"results", results}}.dump(2)
                             << "\n";
    std::printf("wrote %s\n", json_path.c_str());
  }
  return 0;
}
