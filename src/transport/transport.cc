// SPDX-License-Identifier: Apache-2.0
#include "transport/transport.h"

#include <algorithm>

#include "transport/shm/shm_transport.h"

namespace flexpert {

bool Group::contains(int rank) const {
  // Linear on purpose: groups are small, and it stays right for an unsorted (invalid) group.
  return std::find(ranks.begin(), ranks.end(), rank) != ranks.end();
}

Result<std::unique_ptr<Transport>> create_transport(const std::string& backend,
                                                    const TransportOptions& options) {
  // Adding a backend: one branch here, one folder under src/transport/, one CMake line.
  if (backend == "shm") {
    FLEX_ASSIGN_OR_RETURN(std::unique_ptr<ShmTransport> t, ShmTransport::create(options));
    return std::unique_ptr<Transport>(std::move(t));
  }
  return invalid_argument("unknown transport backend '" + backend + "'; known: shm");
}

}  // namespace flexpert
