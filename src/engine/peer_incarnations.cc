// SPDX-License-Identifier: Apache-2.0
#include "engine/peer_incarnations.h"

#include <algorithm>

namespace flexpert {

void PeerIncarnations::attach(int rank, uint64_t incarnation) {
  if (incarnation == 0) return;
  uint64_t& known = attached_[rank];
  known = std::max(known, incarnation);
}

void PeerIncarnations::attach(const proto::EpochCommand& cmd) {
  for (int r : cmd.members) {
    if (r >= 0 && static_cast<size_t>(r) < cmd.incarnations.size()) attach(r, cmd.incarnations[r]);
  }
}

void PeerIncarnations::attach(const proto::ConnectCommand& cmd) {
  for (size_t i = 0; i < cmd.ranks.size() && i < cmd.incarnations.size(); ++i) {
    if (i < cmd.addresses.size() && !cmd.addresses[i].empty()) {
      attach(cmd.ranks[i], cmd.incarnations[i]);
    }
  }
}

uint64_t PeerIncarnations::attached(int rank) const {
  auto it = attached_.find(rank);
  return it == attached_.end() ? 0 : it->second;
}

bool PeerIncarnations::applies(const proto::PeerLost& lost) const {
  const uint64_t known = attached(lost.rank);
  return lost.incarnation == 0 || known == 0 || lost.incarnation >= known;
}

}  // namespace flexpert
