// SPDX-License-Identifier: Apache-2.0
// Control messages (src/cluster/protocol.h) as a peer could send them: the first
// byte picks the type, the rest is the msgpack body. decode() gives a value or
// DataLoss, never a crash or an unbounded allocation; a value it gives (placements
// included: the seeds config, epoch and map carry one) re-encodes and decodes again.
#include <cstddef>
#include <cstdint>
#include <string>

#include "cluster/protocol.h"
#include "flexpert/logging.h"

namespace {

template <typename T>
void decode_as(const std::string& body) {
  auto msg = flexpert::proto::decode<T>(body);
  FLEX_CHECK(msg.ok() || msg.status().code() == flexpert::StatusCode::kDataLoss);
  if (msg.ok()) FLEX_CHECK(flexpert::proto::decode<T>(flexpert::proto::encode(*msg)).ok());
}

}  // namespace

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  if (size == 0) return 0;
  namespace p = flexpert::proto;
  const std::string body(reinterpret_cast<const char*>(data) + 1, size - 1);
  switch (data[0] % 18) {
    case 0:
      decode_as<p::Hello>(body);
      break;
    case 1:
      decode_as<p::WorkerConfig>(body);
      break;
    case 2:
      decode_as<p::Ready>(body);
      break;
    case 3:
      decode_as<p::EpochCommand>(body);
      break;
    case 4:
      decode_as<p::AddRequest>(body);
      break;
    case 5:
      decode_as<p::CancelRequest>(body);
      break;
    case 6:
      decode_as<p::TokenBatch>(body);
      break;
    case 7:
      decode_as<p::StepReport>(body);
      break;
    case 8:
      decode_as<p::PullCommand>(body);
      break;
    case 9:
      decode_as<p::PullDone>(body);
      break;
    case 10:
      decode_as<p::MapCommand>(body);
      break;
    case 11:
      decode_as<p::MapApplied>(body);
      break;
    case 12:
      decode_as<p::ConnectCommand>(body);
      break;
    case 13:
      decode_as<p::Connected>(body);
      break;
    case 14:
      decode_as<p::EpochApplied>(body);
      break;
    case 15:
      decode_as<p::WorkerError>(body);
      break;
    case 16:
      decode_as<p::LeaveRequest>(body);
      break;
    default:
      decode_as<p::Shutdown>(body);
      break;
  }
  return 0;
}
