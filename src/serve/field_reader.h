// SPDX-License-Identifier: Apache-2.0
// FieldReader: typed access to the fields of a JSON request body for the OpenAI-style
// routes (completion_api.cc, chat_api.cc), failing with InvalidArgument that names the field.
// The sampling fields are parse_sampling_fields' (sampling_fields.h), not read here.
#pragma once

#include <cstdint>
#include <limits>
#include <nlohmann/json.hpp>
#include <string>
#include <vector>

#include "flexpert/status.h"

namespace flexpert {

// Each getter leaves `*out` alone when the field is absent or null (OpenAI clients
// send explicit nulls for "unset"), and fails naming the field on a wrong type.
struct FieldReader {
  using json = nlohmann::json;
  const json& body;
  std::string* error_param;

  Status fail(const std::string& field, const std::string& message) {
    *error_param = field;
    return invalid_argument(message);
  }
  const json* get(const char* field) {
    auto it = body.find(field);
    return it == body.end() || it->is_null() ? nullptr : &*it;
  }
  Status integer(const char* field, int64_t* out) {
    const json* v = get(field);
    if (v == nullptr) return Status();
    if (v->is_number_unsigned()) {
      const uint64_t u = v->get<uint64_t>();
      *out = u > static_cast<uint64_t>(std::numeric_limits<int64_t>::max())
                 ? std::numeric_limits<int64_t>::max()
                 : static_cast<int64_t>(u);
      return Status();
    }
    if (!v->is_number_integer()) return fail(field, std::string(field) + " must be an integer");
    *out = v->get<int64_t>();
    return Status();
  }
  Status boolean(const char* field, bool* out) {
    const json* v = get(field);
    if (v == nullptr) return Status();
    if (!v->is_boolean()) return fail(field, std::string(field) + " must be true or false");
    *out = v->get<bool>();
    return Status();
  }
  // A list of token ids in [0, vocab_size); `what` names it in messages.
  Status token_ids(const char* field, const json& list, int vocab_size, std::vector<int32_t>* out) {
    for (const json& id : list) {
      if (!id.is_number_integer()) {
        // The type name, not the value: an array may nest deep, and dump() recurses.
        return fail(field,
                    std::string(field) + " must contain only integer token ids, got " +
                        (id.is_primitive() ? id.dump(-1, ' ', false, json::error_handler_t::replace)
                                           : std::string("an ") + id.type_name()));
      }
      // Compare as 64-bit (or unsigned) first so that huge values cannot wrap into range.
      const bool in_range = id.is_number_unsigned()
                                ? id.get<uint64_t>() < static_cast<uint64_t>(vocab_size)
                                : id.get<int64_t>() >= 0 && id.get<int64_t>() < vocab_size;
      if (!in_range) {
        return fail(field, std::string(field) + " contains token id " +
                               id.dump(-1, ' ', false, json::error_handler_t::replace) +
                               " outside the vocabulary [0, " + std::to_string(vocab_size) + ")");
      }
      out->push_back(static_cast<int32_t>(id.get<int64_t>()));
    }
    return Status();
  }
};

}  // namespace flexpert
