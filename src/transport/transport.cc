// SPDX-License-Identifier: Apache-2.0
#include "transport/transport.h"

#include <algorithm>

#include "transport/shm/shm_transport.h"
#ifdef FLEXPERT_WITH_CUDA_IPC
#include "transport/cuda_ipc/cuda_ipc_transport.h"
#endif
#ifdef FLEXPERT_WITH_UCX
#include "transport/ucx/ucx_transport.h"
#endif
#ifdef FLEXPERT_WITH_HIER
#include "transport/hier/hier_transport.h"
#endif

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
  if (backend == "cuda_ipc") {
#ifdef FLEXPERT_WITH_CUDA_IPC
    FLEX_ASSIGN_OR_RETURN(std::unique_ptr<CudaIpcTransport> t, CudaIpcTransport::create(options));
    return std::unique_ptr<Transport>(std::move(t));
#else
    return unimplemented(
        "transport backend 'cuda_ipc' is not in this build (configure with "
        "-DFLEXPERT_WITH_CUDA=ON)");
#endif
  }
  if (backend == "ucx") {
#ifdef FLEXPERT_WITH_UCX
    FLEX_ASSIGN_OR_RETURN(std::unique_ptr<UcxTransport> t, UcxTransport::create(options));
    return std::unique_ptr<Transport>(std::move(t));
#else
    return unimplemented(
        "transport backend 'ucx' is not in this build (CMake did not find UCX: install "
        "libucx-dev, see scripts/setup.sh)");
#endif
  }
  if (backend == "hier") {
#ifdef FLEXPERT_WITH_HIER
    FLEX_ASSIGN_OR_RETURN(std::unique_ptr<HierTransport> t, HierTransport::create(options));
    return std::unique_ptr<Transport>(std::move(t));
#else
    return unimplemented(
        "transport backend 'hier' is not in this build (it needs the ucx backend: install "
        "libucx-dev, see scripts/setup.sh)");
#endif
  }
  return invalid_argument("unknown transport backend '" + backend +
                          "'; known: shm, cuda_ipc, ucx, hier");
}

}  // namespace flexpert
