// SPDX-License-Identifier: Apache-2.0
// ForwardingTransport: a Transport that hands every call to an inner one it owns. Wrappers
// derive from it and override only what they change (FaultInjectingTransport; tests that make
// a backend look like another).
// Thread safety: as the inner transport.
#pragma once

#include <memory>
#include <string>
#include <utility>
#include <vector>

#include "flexpert/logging.h"
#include "transport/transport.h"

namespace flexpert {

class ForwardingTransport : public Transport {
 public:
  explicit ForwardingTransport(std::unique_ptr<Transport> inner) : inner_(std::move(inner)) {
    FLEX_CHECK(inner_ != nullptr);
  }
  Transport& inner() { return *inner_; }
  const Transport& inner() const { return *inner_; }

  TransportCapabilities capabilities() const override { return inner_->capabilities(); }
  int rank() const override { return inner_->rank(); }
  int max_ranks() const override { return inner_->max_ranks(); }
  std::string address() const override { return inner_->address(); }
  Status connect(int peer, const std::string& address) override {
    return inner_->connect(peer, address);
  }
  Status disconnect(int peer) override { return inner_->disconnect(peer); }
  Result<Region> allocate_region(int region_id, size_t num_bytes) override {
    return inner_->allocate_region(region_id, num_bytes);
  }
  Status read(int peer, int region_id, size_t offset, void* dst, size_t num_bytes) override {
    return inner_->read(peer, region_id, offset, dst, num_bytes);
  }
  Result<std::vector<ByteSpan>> all_gather(const Group& group, ByteSpan in) override {
    return inner_->all_gather(group, in);
  }
  Status barrier(const Group& group) override { return inner_->barrier(group); }
  Result<std::vector<ByteSpan>> exchange(const Group& group,
                                         const std::vector<ByteSpan>& send) override {
    return inner_->exchange(group, send);
  }
  Status shutdown() override { return inner_->shutdown(); }
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
  std::unique_ptr<Transport> inner_;
};

}  // namespace flexpert
