// SPDX-License-Identifier: Apache-2.0
// UcxTransport and device memory: which memory types the UCX loaded supports, FLEXPERT_UCX_CUDA,
// and device buffers registered as regions (ucx_transport.h; docs/ARCHITECTURE.md "GPU ranks
// on different hosts").
#include <cstdlib>
#include <mutex>
#include <string>

#include "flexpert/logging.h"
#include "transport/ucx/ucx_transport.h"

namespace flexpert {

namespace {

// The memory types of a UCX context's mask, by name ("host, cuda, ...").
std::string memory_type_names(uint64_t mask) {
  std::string out;
  for (int t = 0; t < UCS_MEMORY_TYPE_LAST; ++t) {
    if ((mask & (uint64_t{1} << t)) == 0) continue;
    if (!out.empty()) out += ", ";
    out += ucs_memory_type_names[t];
  }
  return out.empty() ? "none" : out;
}

}  // namespace

Status UcxTransport::init_memory_types() {
  ucp_context_attr_t attr{};
  attr.field_mask = UCP_ATTR_FIELD_MEMORY_TYPES;
  if (const ucs_status_t st = ucp_context_query(context_, &attr); st != UCS_OK) {
    return internal_error(std::string("ucp_context_query (memory types): ") +
                          ucs_status_string(st));
  }
  const bool cuda = (attr.memory_types & (uint64_t{1} << UCS_MEMORY_TYPE_CUDA)) != 0;
  // UCX_PROTO_ENABLE=n: the protocols that cannot serve gets of device memory (init()).
  const char* proto = std::getenv("UCX_PROTO_ENABLE");
  const std::string p = proto == nullptr ? "" : proto;
  const bool old_protocols = p == "n" || p == "no" || p == "N" || p == "0" || p == "off";
  const bool supported = cuda && !old_protocols;
  const char* env = std::getenv("FLEXPERT_UCX_CUDA");
  const std::string knob = env == nullptr || *env == '\0' ? "auto" : env;
  if (knob != "auto" && knob != "off" && knob != "on") {
    return invalid_argument("FLEXPERT_UCX_CUDA='" + knob + "': expected auto, off or on");
  }
  const std::string ucx = std::string("UCX ") + ucp_get_version_string();
  if (knob == "on" && !supported) {
    return failed_precondition(
        "FLEXPERT_UCX_CUDA=on, but the UCX loaded, " + ucx +
        (cuda ? ", supports no gets of CUDA memory under UCX_PROTO_ENABLE=" + p
              : ", supports no CUDA memory (memory types: " + memory_type_names(attr.memory_types) +
                    ")") +
        ": use a UCX built with CUDA (LD_LIBRARY_PATH) and a CUDA transport in UCX_TLS, or "
        "FLEXPERT_UCX_CUDA=auto to stage device buffers through host memory");
  }
  cuda_memory_ = supported && knob != "off";
  static std::once_flag logged;  // Once a process: every rank of it loads the same UCX.
  std::call_once(logged, [&] {
    FLEX_LOG(INFO) << "ucx: " << ucx << ", memory types: " << memory_type_names(attr.memory_types)
                   << "; device buffers "
                   << (cuda_memory_ ? "registered with UCX (read directly)"
                                    : "staged through host memory")
                   << " (FLEXPERT_UCX_CUDA=" << knob << ")";
  });
  return Status();
}

Status UcxTransport::register_buffer(int buffer_id, void* data, size_t num_bytes) {
  if (!cuda_memory_) {
    return unimplemented(
        "register_buffer: this UCX does not register CUDA memory (FLEXPERT_UCX_CUDA, "
        "ucp_context_query): device buffers go through host memory");
  }
  if (data == nullptr) return invalid_argument("register_buffer: null data");
  return add_region(buffer_id, data, num_bytes, /*device=*/true).status();
}

}  // namespace flexpert
