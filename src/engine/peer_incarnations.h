// SPDX-License-Identifier: Apache-2.0
// Which incarnation of each peer rank id a worker is attached to, learnt from the front
// end's EpochCommand and ConnectCommand (their `incarnations`), so that a PeerLost naming an
// earlier incarnation does not mark a newer one lost: PeerLost travels on the heartbeat
// socket, the attach of the id's next incarnation on the control socket, and either may
// arrive first (docs/ARCHITECTURE.md, "Membership, epochs, failure"). Pure; thread-compatible
// (the worker keeps it under the mutex its heartbeat thread marks peers lost under).
#pragma once

#include <cstdint>
#include <map>

#include "cluster/protocol.h"

namespace flexpert {

class PeerIncarnations {
 public:
  // `rank` is (about to be) attached as `incarnation`; 0 (a command without incarnations)
  // keeps what is known. Incarnations only grow: an older one changes nothing.
  void attach(int rank, uint64_t incarnation);
  // Every peer a command attaches (a member with an address; a ConnectCommand's ranks).
  void attach(const proto::EpochCommand& cmd);
  void attach(const proto::ConnectCommand& cmd);
  // The incarnation of `rank` attached last (0: none known).
  uint64_t attached(int rank) const;
  // Whether `lost` concerns the attached incarnation of its rank (or a later one, not
  // attached yet, which leaves the attached one lost too). False for an earlier one. True
  // when either side does not know (incarnation 0, or nothing attached yet).
  bool applies(const proto::PeerLost& lost) const;

 private:
  std::map<int, uint64_t> attached_;
};

}  // namespace flexpert
