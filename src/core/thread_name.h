// SPDX-License-Identifier: Apache-2.0
// Names the calling thread (at most 15 characters) as /proc/PID/task/TID/comm, top -H, perf
// and bench/kill_probe.py show it.
#pragma once

#include <pthread.h>

namespace flexpert {

inline void name_this_thread(const char* name) { (void)pthread_setname_np(pthread_self(), name); }

}  // namespace flexpert
