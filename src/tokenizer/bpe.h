// SPDX-License-Identifier: Apache-2.0
// The BPE model of a byte-level tokenizer: a pre-token's bytes start as one symbol each (the
// vocabulary id of the byte's ByteLevel char) and adjacent pairs merge lowest rank first,
// leftmost among equal ranks, as the Rust `tokenizers` BPE does. Results are cached per word.
// Immutable after build except the cache, which is locked per shard: encode_word is
// thread-safe.
#pragma once

#include <array>
#include <cstdint>
#include <mutex>
#include <string>
#include <string_view>
#include <unordered_map>
#include <vector>

#include "flexpert/status.h"

namespace flexpert::tok {

class BpeModel {
 public:
  struct Merge {
    int32_t left = 0, right = 0, result = 0;
  };
  // `byte_ids[b]`: the id of byte b's ByteLevel char, or -1 (such bytes are dropped, as Rust
  // does without an unk token). `merges` in rank order. `word_ids` maps whole words (raw
  // bytes) to ids for `ignore_merges`; empty otherwise.
  BpeModel(std::array<int32_t, 256> byte_ids, const std::vector<Merge>& merges,
           std::unordered_map<std::string, int32_t> word_ids);

  // Appends the ids of one pre-token (raw bytes).
  void encode_word(std::string_view word, std::vector<int32_t>* out) const;

  size_t cache_size() const;

 private:
  void merge_word(std::string_view word, std::vector<int32_t>* out) const;

  struct RankedMerge {
    int32_t rank;
    int32_t result;
  };
  static uint64_t pair_key(int32_t a, int32_t b) {
    return (static_cast<uint64_t>(static_cast<uint32_t>(a)) << 32) | static_cast<uint32_t>(b);
  }

  std::array<int32_t, 256> byte_ids_;
  std::unordered_map<uint64_t, RankedMerge> merges_;
  std::unordered_map<std::string, int32_t> word_ids_;

  // Words up to kMaxCachedBytes; a full shard is cleared (cheap, and a hot word comes back).
  static constexpr size_t kMaxCachedBytes = 256;
  static constexpr size_t kShards = 16;
  static constexpr size_t kEntriesPerShard = 8192;
  struct Shard {
    mutable std::mutex mu;
    std::unordered_map<std::string, std::vector<int32_t>> words;  // GUARDED_BY(mu)
  };
  mutable std::array<Shard, kShards> cache_;
};

}  // namespace flexpert::tok
