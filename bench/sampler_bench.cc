// SPDX-License-Identifier: Apache-2.0
// sampler_bench: host cost of drawing one token with Sampler at a real vocabulary size
// (Qwen3's 151936), against the straightforward form that sorts the whole support first
// (what Sampler did before: a full sort per token without a top-k limit).
//
//   sampler_bench [--vocab 151936] [--draws 50] [--json out.json]
//
// Logits: "flat" ~ N(0, 2) (a top-p prefix spans thousands of tokens) and "peaked" (the
// same plus a head of 40 tokens 2-12 above the rest, as a language model's logits are).
// A second table: the host cost of logit processing and logprobs per token (greedy).
#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <fstream>
#include <nlohmann/json.hpp>
#include <random>
#include <string>
#include <vector>

#include "flexpert/generate.h"

namespace {

using flexpert::Sampler;
using flexpert::SamplingParams;

// The full-sort reference: sort by (logit desc, id asc), top-k, softmax, top-p, walk.
int32_t full_sort_sample(const SamplingParams& p, std::mt19937_64& rng, const float* logits,
                         int64_t vocab) {
  std::vector<std::pair<float, int32_t>> c(static_cast<size_t>(vocab));
  for (int64_t i = 0; i < vocab; ++i) c[i] = {logits[i], static_cast<int32_t>(i)};
  size_t keep = static_cast<size_t>(vocab);
  if (p.top_k > 0) keep = std::min(keep, static_cast<size_t>(p.top_k));
  std::partial_sort(c.begin(), c.begin() + keep, c.end(), [](const auto& a, const auto& b) {
    return a.first > b.first || (a.first == b.first && a.second < b.second);
  });
  std::vector<double> w(keep);
  double sum = 0;
  for (size_t i = 0; i < keep; ++i)
    sum += w[i] = std::exp((c[i].first - c[0].first) / p.temperature);
  size_t cut = keep;
  double acc = 0;
  for (size_t i = 0; i < keep && p.top_p < 1.0f; ++i) {
    if ((acc += w[i] / sum) >= p.top_p) {
      cut = i + 1;
      break;
    }
  }
  double mass = 0;
  for (size_t i = 0; i < cut; ++i) mass += w[i];
  const double u = std::uniform_real_distribution<double>(0.0, mass)(rng);
  acc = 0;
  for (size_t i = 0; i < cut; ++i) {
    if (u < (acc += w[i])) return c[i].second;
  }
  return c[cut - 1].second;
}

template <class F>
double ms_per_draw(int draws, F&& draw) {
  volatile int32_t sink = 0;
  const auto t0 = std::chrono::steady_clock::now();
  for (int i = 0; i < draws; ++i) sink = draw();
  (void)sink;
  return std::chrono::duration<double, std::milli>(std::chrono::steady_clock::now() - t0).count() /
         draws;
}

}  // namespace

int main(int argc, char** argv) {
  int vocab = 151936, draws = 50;
  std::string json;
  for (int i = 1; i + 1 < argc; i += 2) {
    const std::string flag = argv[i];
    if (flag == "--vocab") {
      vocab = std::atoi(argv[i + 1]);
    } else if (flag == "--draws") {
      draws = std::atoi(argv[i + 1]);
    } else if (flag == "--json") {
      json = argv[i + 1];
    } else {
      std::fprintf(stderr, "unknown flag %s\n", flag.c_str());
      return 2;
    }
  }
  if (argc % 2 == 0 || vocab < 64 || draws < 1) {
    std::fprintf(stderr, "usage: sampler_bench [--vocab N>=64] [--draws N>=1] [--json FILE]\n");
    return 2;
  }
  std::mt19937 gen(1);
  std::normal_distribution<float> normal(0.f, 2.f);
  std::vector<float> flat(static_cast<size_t>(vocab));
  for (float& x : flat) x = normal(gen);
  std::vector<float> peaked = flat;
  for (int i = 0; i < 40; ++i) peaked[(i * 7919) % vocab] += 12.f - 0.25f * i;
  struct Case {
    float temperature;
    int top_k;
    float top_p;
  };
  const Case cases[] = {{1.0f, 0, 1.0f}, {0.7f, 0, 0.9f}, {0.7f, 0, 0.95f}, {0.7f, 50, 1.0f}};
  nlohmann::json runs = nlohmann::json::array();
  std::printf("%-7s %5s %6s %6s %12s %12s %8s\n", "logits", "temp", "top_k", "top_p", "sampler ms",
              "full sort ms", "speedup");
  for (const auto& [name, logits] : {std::pair{"flat", &flat}, std::pair{"peaked", &peaked}}) {
    for (const Case& c : cases) {
      SamplingParams p;
      p.temperature = c.temperature;
      p.top_k = c.top_k;
      p.top_p = c.top_p;
      p.seed = 3;
      Sampler sampler(p);
      std::mt19937_64 rng(3);
      const float* l = logits->data();
      const double ours = ms_per_draw(draws, [&] { return sampler.sample(l, vocab); });
      const double ref = ms_per_draw(draws, [&] { return full_sort_sample(p, rng, l, vocab); });
      std::printf("%-7s %5.1f %6d %6.2f %12.3f %12.3f %7.1fx\n", name, c.temperature, c.top_k,
                  c.top_p, ours, ref, ref / ours);
      runs.push_back({{"logits", name},
                      {"temperature", c.temperature},
                      {"top_k", c.top_k},
                      {"top_p", c.top_p},
                      {"sampler_ms", ours},
                      {"full_sort_ms", ref}});
    }
  }
  // Host logit processing and logprobs (the kLogits rows of requests that ask for them),
  // greedy on the peaked logits, with a 1000-token history (2000-token prompt for the
  // repetition penalty). "plain" is the argmax the fast path would otherwise run.
  struct Processing {
    const char* name;
    bool penalties;
    int logprobs;
  };
  const Processing processing[] = {{"plain", false, -1},
                                   {"penalties+bias", true, -1},
                                   {"logprobs 5", false, 5},
                                   {"logprobs 20", false, 20},
                                   {"penalties+bias, logprobs 20", true, 20}};
  nlohmann::json processing_runs = nlohmann::json::array();
  std::printf("\n%-30s %12s\n", "greedy host row", "ms per token");
  for (const Processing& c : processing) {
    SamplingParams p;
    if (c.penalties) {
      p.repetition_penalty = 1.1f;
      p.presence_penalty = 0.5f;
      p.frequency_penalty = 0.25f;
      for (int i = 0; i < 10; ++i) p.logit_bias.emplace_back((i * 104729) % vocab, 5.0f);
    }
    p.logprobs = c.logprobs;
    Sampler sampler(p);
    std::vector<int32_t> history(3000);
    for (size_t i = 0; i < history.size(); ++i) {
      history[i] = static_cast<int32_t>((i * 48271) % static_cast<size_t>(vocab));
    }
    sampler.add_prompt(history, 1000);
    flexpert::TokenLogprob lp;
    const float* l = peaked.data();
    const double ms = ms_per_draw(draws, [&] { return sampler.sample(l, vocab, &lp); });
    std::printf("%-30s %12.3f\n", c.name, ms);
    processing_runs.push_back({{"case", c.name}, {"ms_per_token", ms}});
  }
  if (!json.empty()) {
    std::ofstream f(json);
    f << nlohmann::json{{"benchmark", "sampler"},
                        {"vocab", vocab},
                        {"draws", draws},
                        {"runs", runs},
                        {"processing", processing_runs}}
             .dump(2)
      << "\n";
    if (!f) {
      std::fprintf(stderr, "cannot write %s\n", json.c_str());
      return 1;
    }
  }
  return 0;
}
