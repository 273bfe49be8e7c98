// SPDX-License-Identifier: Apache-2.0
// release_later: drops a reference on a background thread, for objects whose destruction is
// slow and must not hold the caller (a peer's shared-memory mappings: unmapping gigabytes
// of touched host mirrors took a GPU rank's stepping thread 20-80 ms at a scale-down's
// commit, docs/benchmarks.md "Losing a rank"). One thread per process, started at the first
// call and never joined (what it still holds at exit goes with the process). Thread-safe.
#pragma once

#include <memory>

namespace flexpert {

void release_later(std::shared_ptr<const void> object);

}  // namespace flexpert
