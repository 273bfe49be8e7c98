// SPDX-License-Identifier: Apache-2.0
#include "cli/agreement.h"

#include <random>

#include "flexpert/logging.h"

namespace flexpert::cli {

TokenRows agreement_prompts(int num_prompts, int prompt_len, int vocab_size, uint64_t seed) {
  std::mt19937_64 rng(seed);
  TokenRows prompts(static_cast<size_t>(num_prompts));
  for (auto& p : prompts) {
    for (int t = 0; t < prompt_len; ++t) {
      p.push_back(static_cast<int32_t>(rng() % static_cast<uint64_t>(vocab_size)));
    }
  }
  return prompts;
}

Result<TokenRows> greedy_tokens(Model& model, const TokenRows& prompts, int gen_tokens) {
  const size_t n = prompts.size();
  std::vector<SequenceChunk> batch(n);
  for (size_t i = 0; i < n; ++i) {
    batch[i].kv_slot = static_cast<int>(i);
    batch[i].start_pos = 0;
    batch[i].tokens = prompts[i];
  }
  const std::vector<RowOutput> rows(n);  // kGreedy.
  TokenRows out(n);
  Tensor logits;
  std::vector<int32_t> tokens;
  for (int s = 0; s < gen_tokens; ++s) {
    FLEX_RETURN_IF_ERROR(model.forward_step(batch, rows, &logits, &tokens));
    FLEX_CHECK(tokens.size() == n);
    for (size_t i = 0; i < n; ++i) {
      out[i].push_back(tokens[i]);
      batch[i].start_pos = static_cast<int>(prompts[i].size()) + s;
      batch[i].tokens = {tokens[i]};
    }
  }
  return out;
}

Agreement compare_tokens(const TokenRows& tokens, const TokenRows& reference) {
  FLEX_CHECK(tokens.size() == reference.size());
  Agreement a;
  a.num_prompts = static_cast<int>(tokens.size());
  double prefix_sum = 0;
  for (size_t i = 0; i < tokens.size(); ++i) {
    FLEX_CHECK(tokens[i].size() == reference[i].size());
    size_t prefix = 0;
    while (prefix < tokens[i].size() && tokens[i][prefix] == reference[i][prefix]) ++prefix;
    prefix_sum += static_cast<double>(prefix);
    if (prefix == tokens[i].size()) ++a.num_equal;
  }
  if (a.num_prompts > 0) a.mean_common_prefix = prefix_sum / a.num_prompts;
  return a;
}

}  // namespace flexpert::cli
