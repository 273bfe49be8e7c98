// SPDX-License-Identifier: Apache-2.0
#include "cuda/knobs.h"

#include <cstdlib>
#include <cstring>

namespace flexpert::cuda {
namespace {

bool on(const char* name) {
  const char* v = std::getenv(name);
  return v != nullptr && v[0] != '\0' && std::strcmp(v, "0") != 0;
}

int integer(const char* name) {
  const char* v = std::getenv(name);
  return v != nullptr ? std::atoi(v) : 0;
}

}  // namespace

const Knobs& knobs() {
  static const Knobs k = [] {
    Knobs r;
    r.no_pdl = on("FLEXPERT_NO_PDL");
    r.no_route_cluster = on("FLEXPERT_NO_ROUTE_CLUSTER");
    r.no_decode_moe = on("FLEXPERT_NO_DECODE_MOE");
    r.no_shared_fusion = on("FLEXPERT_NO_SHARED_FUSION");
    r.no_norm_fusion = on("FLEXPERT_NO_NORM_FUSION");
    r.no_swiglu_fusion = on("FLEXPERT_NO_SWIGLU_FUSION");
    r.no_gemv = on("FLEXPERT_NO_GEMV");
    r.no_head_gemv = on("FLEXPERT_NO_HEAD_GEMV");
    r.no_mla_mma = on("FLEXPERT_NO_MLA_MMA");
    r.no_gqa_attention = on("FLEXPERT_NO_GQA_ATTENTION");
    r.no_attention_tiles = on("FLEXPERT_NO_ATTENTION_TILES");
    r.no_fp8_wgmma = on("FLEXPERT_NO_FP8_WGMMA");
    r.fp8_wgmma_rows = integer("FLEXPERT_FP8_WGMMA_ROWS");
    r.ep_kernel_waits = on("FLEXPERT_EP_KERNEL_WAITS");
    r.gemm_max_ctas = integer("FLEXPERT_GEMM_MAX_CTAS");
    if (const char* v = std::getenv("FLEXPERT_STEP_LOG_MS"); v != nullptr && v[0] != '\0') {
      r.step_log_ms = std::atof(v);
    }
    return r;
  }();
  return k;
}

bool ep_exchange_host() {
  const char* v = std::getenv("FLEXPERT_EP_EXCHANGE");
  return v != nullptr && std::strcmp(v, "host") == 0;
}

}  // namespace flexpert::cuda
