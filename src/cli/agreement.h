// SPDX-License-Identifier: Apache-2.0
// `bench generate --agreement N`: greedy tokens of N prompts from one model, and how those
// of two models (or two quantizations of one checkpoint) agree, prompt by prompt.
// Blocking (runs the model on the caller's thread); no shared state.
#pragma once

#include <cstdint>
#include <vector>

#include "flexpert/model.h"
#include "flexpert/status.h"

namespace flexpert::cli {

using TokenRows = std::vector<std::vector<int32_t>>;

// num_prompts prompts of prompt_len ids in [0, vocab_size), a pure function of seed.
TokenRows agreement_prompts(int num_prompts, int prompt_len, int vocab_size, uint64_t seed);

// gen_tokens greedy tokens per prompt (the first from the prefill), every prompt in one
// batch: the model must hold prompts.size() sequences of prompt + gen_tokens positions.
Result<TokenRows> greedy_tokens(Model& model, const TokenRows& prompts, int gen_tokens);

struct Agreement {
  int num_prompts = 0;
  int num_equal = 0;              // Prompts whose tokens are all equal.
  double mean_common_prefix = 0;  // Leading tokens equal, averaged over the prompts.
};

// Compares row i of `tokens` with row i of `reference` (rows of equal lengths).
Agreement compare_tokens(const TokenRows& tokens, const TokenRows& reference);

}  // namespace flexpert::cli
