// SPDX-License-Identifier: Apache-2.0
// FaultInjectingTransport: wraps a Transport and makes chosen calls fail or run late, so
// membership and failure handling can be tested without hardware or real crashes.
//
// Collectives (all_gather, barrier, exchange) are numbered 0, 1, 2, ... in the order they
// reach this wrapper. A fault on collective n either replaces the call (the inner transport
// never runs it: peers see a silent rank) or runs it and then reports the status instead
// (peers see success, this rank an error). A delay sleeps before each collective (a slow
// rank). Other calls (mapped peer buffers too) are forwarded unchanged (ForwardingTransport),
// except read() when a read fault is set.
// Thread safety: as the inner transport; the fault settings are guarded by a mutex and may be
// changed from any thread.
#pragma once

#include <map>
#include <memory>
#include <mutex>
#include <string>
#include <vector>

#include "transport/forwarding_transport.h"

namespace flexpert {

class FaultInjectingTransport final : public ForwardingTransport {
 public:
  explicit FaultInjectingTransport(std::unique_ptr<Transport> inner);

  // Collective number `collective_idx` (counted from the first one this wrapper saw) returns
  // `status`. run_inner: run the real collective first (its result is discarded).
  void fail_collective(int64_t collective_idx, Status status, bool run_inner = false);
  // Every collective from now on sleeps delay_ms before it runs (0 turns it off).
  void set_collective_delay_ms(int delay_ms);
  // Every read() from now on returns `status` (OK turns it off).
  void set_read_fault(Status status);
  void clear_faults();
  // How many collectives reached this wrapper so far.
  int64_t num_collectives() const;

  Status read(int peer, int region_id, size_t offset, void* dst, size_t num_bytes) override;
  Result<std::vector<ByteSpan>> all_gather(const Group& group, ByteSpan in) override;
  Status barrier(const Group& group) override;
  Result<std::vector<ByteSpan>> exchange(const Group& group,
                                         const std::vector<ByteSpan>& send) override;

 private:
  struct Fault {
    Status status;
    bool run_inner = false;
  };
  struct Decision {
    bool inject = false;
    Fault fault;
  };
  // Numbers this collective, sleeps the delay, and says whether it is faulted.
  Decision before_collective(const char* op);

  mutable std::mutex mu_;
  std::map<int64_t, Fault> faults_;  // GUARDED_BY(mu_)
  int delay_ms_ = 0;                 // GUARDED_BY(mu_)
  Status read_fault_;                // GUARDED_BY(mu_)
  int64_t num_collectives_ = 0;      // GUARDED_BY(mu_)
};

}  // namespace flexpert
