// SPDX-License-Identifier: Apache-2.0
// The process's descriptor table, grown once at start. Linux grows a process's table to the
// next power of two when a new descriptor does not fit, and in a multi-threaded process
// that growth waits for an RCU grace period (synchronize_rcu: 18-35 ms measured on the GPU
// machine). A worker opens descriptors on its stepping thread when a peer dies (its
// /proc entries, docs/benchmarks.md "Losing a rank"), so the table is grown while the
// process has one thread, when growing costs nothing.
#pragma once

namespace flexpert {

// Raises the soft RLIMIT_NOFILE towards `fds` (never above the hard limit) and grows the
// descriptor table to hold that many; returns the size reserved (0 if it could not).
int reserve_fd_table(int fds);

}  // namespace flexpert
