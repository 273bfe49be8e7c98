// SPDX-License-Identifier: Apache-2.0
#include "tokenizer/bpe.h"

#include <functional>
#include <queue>

namespace flexpert::tok {

BpeModel::BpeModel(std::array<int32_t, 256> byte_ids, const std::vector<Merge>& merges,
                   std::unordered_map<std::string, int32_t> word_ids)
    : byte_ids_(byte_ids), word_ids_(std::move(word_ids)) {
  merges_.reserve(merges.size());
  for (size_t rank = 0; rank < merges.size(); ++rank) {
    const Merge& m = merges[rank];
    // A repeated pair keeps its first (lowest) rank.
    merges_.emplace(pair_key(m.left, m.right), RankedMerge{static_cast<int32_t>(rank), m.result});
  }
}

void BpeModel::encode_word(std::string_view word, std::vector<int32_t>* out) const {
  if (!word_ids_.empty()) {
    auto it = word_ids_.find(std::string(word));
    if (it != word_ids_.end()) {
      out->push_back(it->second);
      return;
    }
  }
  if (word.size() == 1) {
    const int32_t id = byte_ids_[static_cast<unsigned char>(word[0])];
    if (id >= 0) out->push_back(id);
    return;
  }
  if (word.size() > kMaxCachedBytes) {
    merge_word(word, out);
    return;
  }
  const size_t hash = std::hash<std::string_view>()(word);
  Shard& shard = cache_[hash % kShards];
  {
    std::lock_guard<std::mutex> lock(shard.mu);
    auto it = shard.words.find(std::string(word));
    if (it != shard.words.end()) {
      out->insert(out->end(), it->second.begin(), it->second.end());
      return;
    }
  }
  const size_t first = out->size();
  merge_word(word, out);
  std::lock_guard<std::mutex> lock(shard.mu);
  if (shard.words.size() >= kEntriesPerShard) shard.words.clear();
  shard.words.emplace(std::string(word), std::vector<int32_t>(out->begin() + first, out->end()));
}

void BpeModel::merge_word(std::string_view word, std::vector<int32_t>* out) const {
  struct Symbol {
    int32_t id;
    int32_t prev;
    int32_t next;
    bool alive;
  };
  std::vector<Symbol> symbols;
  symbols.reserve(word.size());
  for (unsigned char b : word) {
    const int32_t id = byte_ids_[b];
    if (id < 0) continue;
    const auto idx = static_cast<int32_t>(symbols.size());
    symbols.push_back({id, idx - 1, idx + 1, true});
  }
  if (symbols.empty()) return;
  symbols.back().next = -1;

  struct Candidate {
    int32_t rank;
    int32_t pos;
    int32_t result;
    bool operator>(const Candidate& o) const {
      return rank != o.rank ? rank > o.rank : pos > o.pos;
    }
  };
  std::priority_queue<Candidate, std::vector<Candidate>, std::greater<Candidate>> queue;
  auto push_pair = [&](int32_t pos) {
    const int32_t next = symbols[pos].next;
    if (next < 0) return;
    auto it = merges_.find(pair_key(symbols[pos].id, symbols[next].id));
    if (it != merges_.end()) queue.push({it->second.rank, pos, it->second.result});
  };
  for (int32_t i = 0; i + 1 < static_cast<int32_t>(symbols.size()); ++i) push_pair(i);

  while (!queue.empty()) {
    const Candidate top = queue.top();
    queue.pop();
    Symbol& left = symbols[top.pos];
    if (!left.alive || left.next < 0) continue;
    const int32_t right_pos = left.next;
    // A stale entry: the pair at this position changed since it was queued.
    auto it = merges_.find(pair_key(left.id, symbols[right_pos].id));
    if (it == merges_.end() || it->second.result != top.result) continue;
    left.id = top.result;
    symbols[right_pos].alive = false;
    left.next = symbols[right_pos].next;
    if (left.next >= 0) symbols[left.next].prev = top.pos;
    if (left.prev >= 0) push_pair(left.prev);
    push_pair(top.pos);
  }
  for (int32_t i = 0; i >= 0; i = symbols[i].next) out->push_back(symbols[i].id);
}

size_t BpeModel::cache_size() const {
  size_t n = 0;
  for (const Shard& shard : cache_) {
    std::lock_guard<std::mutex> lock(shard.mu);
    n += shard.words.size();
  }
  return n;
}

}  // namespace flexpert::tok
