// SPDX-License-Identifier: Apache-2.0
// The /v1/completions body parser: any bytes give OK or InvalidArgument, never a crash.
#include <cstddef>
#include <cstdint>
#include <string>

#include "flexpert/logging.h"
#include "serve/completion_api.h"

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  const std::string body(reinterpret_cast<const char*>(data), size);
  flexpert::ParsedCompletion parsed;
  std::string param;
  const flexpert::Status s = flexpert::parse_completion_request(
      body, /*vocab_size=*/1000, /*max_context=*/4096, &parsed, &param);
  FLEX_CHECK(s.ok() || s.code() == flexpert::StatusCode::kInvalidArgument) << s.to_string();
  if (s.ok()) {
    FLEX_CHECK(!parsed.request.prompt.empty());
    for (int32_t id : parsed.request.prompt) FLEX_CHECK(id >= 0 && id < 1000);
    FLEX_CHECK(parsed.request.params.top_p > 0.0f && parsed.request.params.top_p <= 1.0f);
  }
  return 0;
}
