// SPDX-License-Identifier: Apache-2.0
#include "flexpert/placement.h"

#include <algorithm>
#include <cstdio>
#include <fstream>
#include <nlohmann/json.hpp>
#include <random>
#include <sstream>
#include <string>

#include "core/json_limits.h"

namespace flexpert {

int expert_slots_per_rank(int num_experts, int extra_replicas, int ranks, int min_ranks,
                          int spare_slots) {
  const int smallest = min_ranks > 0 ? std::min(min_ranks, ranks) : ranks;
  const int64_t experts =
      static_cast<int64_t>(std::max(num_experts, 1)) + std::max(extra_replicas, 0);
  return static_cast<int>((experts + smallest - 1) / std::max(smallest, 1)) +
         std::max(0, spare_slots);
}

int auto_min_replicas(int num_experts, int members, int slots_per_rank, int spare_slots) {
  const int64_t usable =
      static_cast<int64_t>(members) * std::max(0, slots_per_rank - std::max(0, spare_slots));
  return members >= 2 && usable >= 2 * static_cast<int64_t>(std::max(num_experts, 1)) ? 2 : 1;
}

ExpertPlacement ExpertPlacement::identity(int num_layers, int num_experts, int num_slots) {
  std::vector<int> map(static_cast<size_t>(num_slots), kFreeSlot);
  for (int s = 0; s < std::min(num_slots, num_experts); ++s) map[s] = s;
  auto result = from_slot_maps(num_experts, std::vector<std::vector<int>>(num_layers, map));
  return std::move(result).value();
}

Result<ExpertPlacement> ExpertPlacement::from_slot_maps(
    int num_experts, std::vector<std::vector<int>> slot_to_expert) {
  ExpertPlacement p;
  p.num_experts_ = num_experts;
  p.num_slots_ = slot_to_expert.empty() ? 0 : static_cast<int>(slot_to_expert[0].size());
  p.slot_to_expert_ = std::move(slot_to_expert);
  FLEX_RETURN_IF_ERROR(p.build_index());
  return p;
}

Status ExpertPlacement::build_index() {
  expert_to_slots_.assign(slot_to_expert_.size(),
                          std::vector<std::vector<int>>(static_cast<size_t>(num_experts_)));
  for (size_t l = 0; l < slot_to_expert_.size(); ++l) {
    const auto& map = slot_to_expert_[l];
    if (static_cast<int>(map.size()) != num_slots_) {
      return invalid_argument("placement layer " + std::to_string(l) + " has " +
                              std::to_string(map.size()) + " slots, layer 0 has " +
                              std::to_string(num_slots_));
    }
    for (int s = 0; s < num_slots_; ++s) {
      const int e = map[s];
      if (e == kFreeSlot) continue;
      if (e < 0 || e >= num_experts_) {
        return invalid_argument("placement layer " + std::to_string(l) + " slot " +
                                std::to_string(s) + " names expert " + std::to_string(e) +
                                ", the model has " + std::to_string(num_experts_));
      }
      expert_to_slots_[l][e].push_back(s);
    }
    for (int e = 0; e < num_experts_; ++e) {
      if (expert_to_slots_[l][e].empty()) {
        return invalid_argument("placement layer " + std::to_string(l) +
                                " has no replica of expert " + std::to_string(e));
      }
    }
  }
  return Status();
}

Result<ExpertPlacement> ExpertPlacement::spread(int num_layers, int num_experts, int max_ranks,
                                                int slots_per_rank, const std::vector<int>& members,
                                                int extra_replicas, uint64_t seed) {
  const int n = static_cast<int>(members.size());
  if (n == 0 || slots_per_rank <= 0 || extra_replicas < 0) {
    return invalid_argument("spread placement needs members, slots and replicas >= 0");
  }
  if (static_cast<int64_t>(n) * slots_per_rank < num_experts + extra_replicas) {
    return invalid_argument(std::to_string(n) + " ranks x " + std::to_string(slots_per_rank) +
                            " slots cannot hold " + std::to_string(num_experts) + " experts + " +
                            std::to_string(extra_replicas) + " replicas");
  }
  std::mt19937_64 rng(seed);
  std::vector<std::vector<int>> maps(num_layers);
  for (auto& map : maps) {
    map.assign(static_cast<size_t>(max_ranks) * slots_per_rank, kFreeSlot);
    std::vector<int> used(static_cast<size_t>(max_ranks), 0);
    auto place = [&](int expert, int rank) {
      map[static_cast<size_t>(rank) * slots_per_rank + used[rank]++] = expert;
    };
    for (int e = 0; e < num_experts; ++e) place(e, members[e % n]);
    // Whole rounds of extra replicas go to every expert (so replicate:E gives each
    // expert two replicas on different ranks); the remainder to random experts.
    const int whole = extra_replicas / num_experts * num_experts;
    for (int r = 0; r < extra_replicas; ++r) {
      const int expert = r < whole ? r % num_experts : static_cast<int>(rng() % num_experts);
      // The least-filled member that does not hold this expert yet.
      int best = -1;
      for (int m : members) {
        bool holds = false;
        for (int s = 0; s < used[m]; ++s)
          holds |= map[static_cast<size_t>(m) * slots_per_rank + s] == expert;
        if (!holds && used[m] < slots_per_rank && (best < 0 || used[m] < used[best])) best = m;
      }
      if (best >= 0) place(expert, best);
    }
  }
  return from_slot_maps(num_experts, std::move(maps));
}

Result<ExpertPlacement> ExpertPlacement::parse(const std::string& spec, int num_layers,
                                               int num_experts) {
  if (spec.empty() || spec == "identity") return identity(num_layers, num_experts, num_experts);
  if (spec.rfind("replicate:", 0) == 0) {
    int replicas = 0;
    unsigned seed = 0;
    if (std::sscanf(spec.c_str(), "replicate:%d:%u", &replicas, &seed) < 1 || replicas < 0) {
      return invalid_argument("bad placement spec '" + spec + "' (want replicate:R[:SEED])");
    }
    std::mt19937 rng(seed);
    std::vector<std::vector<int>> maps(num_layers);
    for (auto& map : maps) {
      for (int e = 0; e < num_experts; ++e) map.push_back(e);
      for (int r = 0; r < replicas; ++r) map.push_back(static_cast<int>(rng() % num_experts));
      std::shuffle(map.begin(), map.end(), rng);
    }
    return from_slot_maps(num_experts, std::move(maps));
  }
  std::stringstream text;
  if (spec[0] == '{') {
    text << spec;  // Inline JSON (tests write small placements so).
  } else {
    std::ifstream in(spec);
    if (!in) {
      return invalid_argument("placement '" + spec +
                              "' is neither identity, replicate:R[:SEED] nor a readable file");
    }
    text << in.rdbuf();
  }
  std::vector<std::vector<int>> maps;
  FLEX_RETURN_IF_ERROR(check_json_nesting(text.str(), "placement " + spec));
  try {
    auto j = nlohmann::json::parse(text.str());
    const auto& layers = j.at("layers");
    if (!layers.empty() && layers[0].is_number()) {
      maps.assign(num_layers, layers.get<std::vector<int>>());
    } else {
      maps = layers.get<std::vector<std::vector<int>>>();
    }
  } catch (const std::exception& e) {
    return invalid_argument("placement file " + spec + ": " + e.what());
  }
  if (static_cast<int>(maps.size()) != num_layers) {
    return invalid_argument("placement file " + spec + " has " + std::to_string(maps.size()) +
                            " layers, the model has " + std::to_string(num_layers));
  }
  return from_slot_maps(num_experts, std::move(maps));
}

Status ExpertPlacement::check_shape(int num_layers, int num_experts) const {
  if (this->num_layers() != num_layers || num_experts_ != num_experts) {
    return invalid_argument("placement has " + std::to_string(this->num_layers()) +
                            " layers over " + std::to_string(num_experts_) +
                            " experts, the model has " + std::to_string(num_layers) +
                            " layers over " + std::to_string(num_experts) + " experts");
  }
  return Status();
}

std::string ExpertPlacement::to_json() const {
  nlohmann::json j;
  j["layers"] = slot_to_expert_;
  return j.dump();
}

}  // namespace flexpert
