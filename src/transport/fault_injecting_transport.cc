// SPDX-License-Identifier: Apache-2.0
#include "transport/fault_injecting_transport.h"

#include <chrono>
#include <thread>

#include "flexpert/logging.h"

namespace flexpert {

FaultInjectingTransport::FaultInjectingTransport(std::unique_ptr<Transport> inner)
    : ForwardingTransport(std::move(inner)) {}

void FaultInjectingTransport::fail_collective(int64_t collective_idx, Status status,
                                              bool run_inner) {
  FLEX_CHECK(!status.ok()) << "a fault needs an error status";
  std::lock_guard<std::mutex> lock(mu_);
  faults_[collective_idx] = Fault{std::move(status), run_inner};
}

void FaultInjectingTransport::set_collective_delay_ms(int delay_ms) {
  std::lock_guard<std::mutex> lock(mu_);
  delay_ms_ = delay_ms > 0 ? delay_ms : 0;
}

void FaultInjectingTransport::set_read_fault(Status status) {
  std::lock_guard<std::mutex> lock(mu_);
  read_fault_ = std::move(status);
}

void FaultInjectingTransport::clear_faults() {
  std::lock_guard<std::mutex> lock(mu_);
  faults_.clear();
  delay_ms_ = 0;
  read_fault_ = Status();
}

int64_t FaultInjectingTransport::num_collectives() const {
  std::lock_guard<std::mutex> lock(mu_);
  return num_collectives_;
}

FaultInjectingTransport::Decision FaultInjectingTransport::before_collective(const char* op) {
  Decision d;
  int delay_ms = 0;
  {
    std::lock_guard<std::mutex> lock(mu_);
    const int64_t idx = num_collectives_++;
    delay_ms = delay_ms_;
    auto it = faults_.find(idx);
    if (it != faults_.end()) {
      d.inject = true;
      d.fault = std::move(it->second);
      faults_.erase(it);
      FLEX_LOG(INFO) << "fault injection: " << op << " #" << idx << " -> "
                     << d.fault.status.to_string();
    }
  }
  if (delay_ms > 0) std::this_thread::sleep_for(std::chrono::milliseconds(delay_ms));
  return d;
}

Status FaultInjectingTransport::read(int peer, int region_id, size_t offset, void* dst,
                                     size_t num_bytes) {
  {
    std::lock_guard<std::mutex> lock(mu_);
    if (!read_fault_.ok()) return read_fault_;
  }
  return inner().read(peer, region_id, offset, dst, num_bytes);
}

Result<std::vector<ByteSpan>> FaultInjectingTransport::all_gather(const Group& group, ByteSpan in) {
  Decision d = before_collective("all_gather");
  if (!d.inject) return inner().all_gather(group, in);
  if (d.fault.run_inner) (void)inner().all_gather(group, in);
  return d.fault.status;
}

Status FaultInjectingTransport::barrier(const Group& group) {
  Decision d = before_collective("barrier");
  if (!d.inject) return inner().barrier(group);
  if (d.fault.run_inner) (void)inner().barrier(group);
  return d.fault.status;
}

Result<std::vector<ByteSpan>> FaultInjectingTransport::exchange(const Group& group,
                                                                const std::vector<ByteSpan>& send) {
  Decision d = before_collective("exchange");
  if (!d.inject) return inner().exchange(group, send);
  if (d.fault.run_inner) (void)inner().exchange(group, send);
  return d.fault.status;
}

}  // namespace flexpert
