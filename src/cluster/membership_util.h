// SPDX-License-Identifier: Apache-2.0
// Small helpers shared by the membership's translation units (membership.cc,
// membership_recovery.cc, membership_requests.cc). Internal to src/cluster.
#pragma once

#include <algorithm>
#include <vector>

#include "cluster/membership.h"

namespace flexpert::cluster::detail {

inline Action act(ActionKind kind, int rank = -1) {
  Action a;
  a.kind = kind;
  a.rank = rank;
  return a;
}

inline bool contains(const std::vector<int>& v, int x) {
  return std::find(v.begin(), v.end(), x) != v.end();
}

inline std::vector<int> sorted_union(std::vector<int> a, const std::vector<int>& b) {
  a.insert(a.end(), b.begin(), b.end());
  std::sort(a.begin(), a.end());
  a.erase(std::unique(a.begin(), a.end()), a.end());
  return a;
}

}  // namespace flexpert::cluster::detail
