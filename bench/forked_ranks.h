// SPDX-License-Identifier: Apache-2.0
// For benchmarks whose ranks are forked processes of one parent: where they meet. Each
// rank publishes its transport's address in shared memory (MAP_SHARED before the fork)
// and connects to the others as their addresses appear.
#pragma once

#include <atomic>
#include <chrono>
#include <cstdio>
#include <thread>

#include "transport/transport.h"

namespace flexpert::bench {

template <int kMaxRanks>
struct RankAddresses {
  std::atomic<int> ready[kMaxRanks];
  char address[kMaxRanks][1024];  // ucx addresses carry a worker address (~300 chars).

  // Publishes t's address as rank `rank`'s, then connects t to every other rank below n.
  Status connect_all(Transport& t, int rank, int n) {
    std::snprintf(address[rank], sizeof(address[rank]), "%s", t.address().c_str());
    ready[rank].store(1);
    for (int peer = 0; peer < n; ++peer) {
      if (peer == rank) continue;
      while (ready[peer].load() == 0) std::this_thread::sleep_for(std::chrono::microseconds(100));
      FLEX_RETURN_IF_ERROR(t.connect(peer, address[peer]));
    }
    return Status();
  }
};

}  // namespace flexpert::bench
