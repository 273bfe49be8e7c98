// SPDX-License-Identifier: Apache-2.0
// The worker process: one rank of a serving group.
//
// run_worker() connects to the front end's control endpoint, receives its
// configuration, creates its transport and loads its model shard (dense
// weights plus the expert slots its rank holds, in transport regions), then
// steps in lockstep with the other members: each step opens with a small
// header all-gather (token counts, stop flag, epoch acknowledgements), runs
// the model (an empty batch when it has no requests; the MoE layers exchange
// rows with the ranks holding the chosen slots) and streams new tokens back.
// A failed collective (dead peer, timeout) is reported to the front end; the
// worker then waits for a new epoch or a shutdown. Blocking; returns the
// process exit code.
#pragma once

#include <cstdint>
#include <string>

namespace flexpert {

struct WorkerOptions {
  std::string endpoint;  // tcp://HOST:PORT of the front end's control socket.
  int rank = 0;          // kAutoRank: the front end assigns a free id (WorkerConfig::rank).
  int connect_timeout_ms = 30000;  // For the front end's configuration.
  std::string cluster_key;         // Sent in the hello; the front end checks it.
};

inline constexpr int kAutoRank = -1;  // `flexpert worker --rank auto`.

int run_worker(const WorkerOptions& options);

}  // namespace flexpert
