// SPDX-License-Identifier: Apache-2.0
#define PCRE2_CODE_UNIT_WIDTH 8
#include "tokenizer/regex.h"

#include <pcre2.h>

#include <string>

namespace flexpert::tok {
namespace {

std::string pcre2_message(int rc) {
  PCRE2_UCHAR buf[256];
  pcre2_get_error_message(rc, buf, sizeof(buf));
  return reinterpret_cast<const char*>(buf);
}

// One match data block and one JIT stack per thread, shared by every pattern: neither is
// tied to a pattern, and neither may be used by two threads at once.
struct ThreadMatchState {
  pcre2_match_data* data = pcre2_match_data_create(1, nullptr);
  pcre2_jit_stack* stack = pcre2_jit_stack_create(32 << 10, 8 << 20, nullptr);
  pcre2_match_context* context = pcre2_match_context_create(nullptr);
  ThreadMatchState() {
    if (context != nullptr && stack != nullptr) pcre2_jit_stack_assign(context, nullptr, stack);
  }
  ~ThreadMatchState() {
    pcre2_match_context_free(context);
    pcre2_jit_stack_free(stack);
    pcre2_match_data_free(data);
  }
};

ThreadMatchState& thread_state() {
  thread_local ThreadMatchState state;
  return state;
}

}  // namespace

struct Regex::Code {
  pcre2_code* code = nullptr;
  ~Code() { pcre2_code_free(code); }
};

Result<std::unique_ptr<Regex>> Regex::compile(std::string_view pattern, bool literal) {
  // PCRE2_LITERAL admits no UCP (it has no classes to apply it to).
  const uint32_t options = PCRE2_UTF | (literal ? PCRE2_LITERAL : PCRE2_UCP);
  int error = 0;
  PCRE2_SIZE offset = 0;
  pcre2_code* code = pcre2_compile(reinterpret_cast<PCRE2_SPTR>(pattern.data()), pattern.size(),
                                   options, &error, &offset, nullptr);
  if (code == nullptr) {
    return invalid_argument("regex /" + std::string(pattern) + "/ does not compile at offset " +
                            std::to_string(offset) + ": " + pcre2_message(error));
  }
  std::unique_ptr<Regex> regex(new Regex());
  regex->code_ = new Code{code};
  // JIT is an optimization: without it (unsupported platform) pcre2_match interprets.
  regex->jit_ = pcre2_jit_compile(code, PCRE2_JIT_COMPLETE) == 0;
  return regex;
}

Regex::~Regex() { delete code_; }

Status Regex::find_all(std::string_view subject,
                       std::vector<std::pair<size_t, size_t>>* out) const {
  ThreadMatchState& state = thread_state();
  if (state.data == nullptr || state.context == nullptr) {
    return resource_exhausted("pcre2: cannot allocate match data");
  }
  const auto* text = reinterpret_cast<PCRE2_SPTR>(subject.data());
  size_t start = 0;
  uint32_t extra = 0;
  while (start < subject.size()) {
    int rc = pcre2_match(code_->code, text, subject.size(), start, PCRE2_NO_UTF_CHECK | extra,
                         state.data, state.context);
    if (rc == PCRE2_ERROR_JIT_STACKLIMIT) {
      // NOTE: a pathological subject for this pattern: the interpreter has no such limit.
      extra = PCRE2_NO_JIT;
      continue;
    }
    if (rc == PCRE2_ERROR_NOMATCH) break;
    if (rc < 0) return internal_error("pcre2_match: " + pcre2_message(rc));
    const PCRE2_SIZE* ovector = pcre2_get_ovector_pointer(state.data);
    const size_t begin = ovector[0], end = ovector[1];
    if (end > begin) {
      out->emplace_back(begin, end);
      start = end;
    } else {
      // An empty match: step over one character.
      start = end + 1;
      while (start < subject.size() &&
             (static_cast<unsigned char>(subject[start]) & 0xC0) == 0x80) {
        ++start;
      }
    }
  }
  return Status();
}

}  // namespace flexpert::tok
