// SPDX-License-Identifier: Apache-2.0
// FaultInjectingTransport: wraps a Transport and makes chosen calls fail or run late, so
// membership and failure handling can be tested without hardware or real crashes.
//
// Collectives (all_gather, barrier, exchange) are numbered 0, 1, 2, ... in the order they
// reach this wrapper. A fault on collective n either replaces the call (the inner transport
// never runs it: peers see a silent rank) or runs it and then reports the status instead
// (peers see success, this rank an error). A delay sleeps before each collective (a slow
// rank). Other calls (mapped peer buffers too) are forwarded unchanged, except read() when a
// read fault is set.
// Thread safety: as the inner transport; the fault settings are guarded by a mutex and may be
// changed from any thread.
#pragma once

#include <map>
#include <memory>
#include <mutex>
#include <string>
#include <vector>

#include "transport/transport.h"

namespace flexpert {

class FaultInjectingTransport final : public Transport {
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
  Transport& inner() { return *inner_; }

  TransportCapabilities capabilities() const override { return inner_->capabilities(); }
  int rank() const override { return inner_->rank(); }
  int max_ranks() const override { return inner_->max_ranks(); }
  std::string address() const override { return inner_->address(); }
  Status connect(int peer, const std::string& address) override;
  Status disconnect(int peer) override;
  Result<Region> allocate_region(int region_id, size_t num_bytes) override;
  Status read(int peer, int region_id, size_t offset, void* dst, size_t num_bytes) override;
  Result<std::vector<ByteSpan>> all_gather(const Group& group, ByteSpan in) override;
  Status barrier(const Group& group) override;
  Result<std::vector<ByteSpan>> exchange(const Group& group,
                                         const std::vector<ByteSpan>& send) override;
  Status shutdown() override;
  void progress() override { inner_->progress(); }
  Status peer_status(int peer) const override { return inner_->peer_status(peer); }
  Status mark_peer_lost(int peer, const std::string& why) override {
    return inner_->mark_peer_lost(peer, why);
  }
  Status register_buffer(int buffer_id, void* data, size_t num_bytes) override {
    return inner_->register_buffer(buffer_id, data, num_bytes);
  }
  Result<PeerBuffer> map_peer_buffer(int peer, int buffer_id, MapMode mode) override {
    return inner_->map_peer_buffer(peer, buffer_id, mode);
  }
  int timeout_ms() const override { return inner_->timeout_ms(); }

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

  std::unique_ptr<Transport> inner_;
  mutable std::mutex mu_;
  std::map<int64_t, Fault> faults_;  // GUARDED_BY(mu_)
  int delay_ms_ = 0;                 // GUARDED_BY(mu_)
  Status read_fault_;                // GUARDED_BY(mu_)
  int64_t num_collectives_ = 0;      // GUARDED_BY(mu_)
};

}  // namespace flexpert
