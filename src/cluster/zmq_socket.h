// SPDX-License-Identifier: Apache-2.0
// RAII wrappers for ZeroMQ contexts and sockets, returning Status.
//
// Messages are multipart: [routing id (ROUTER only)] [type] [msgpack body].
// A ZmqSocket is used by one thread at a time (ZeroMQ's rule); the context is
// thread-safe. Receive calls take a timeout and return DeadlineExceeded, never block forever.
#pragma once

#include <cstdint>
#include <string>
#include <vector>

#include "flexpert/status.h"

namespace flexpert {

class ZmqContext {
 public:
  ZmqContext();
  ~ZmqContext();
  ZmqContext(const ZmqContext&) = delete;
  ZmqContext& operator=(const ZmqContext&) = delete;
  void* get() const { return ctx_; }

 private:
  void* ctx_;
};

class ZmqSocket {
 public:
  // type: ZMQ_ROUTER, ZMQ_DEALER, ZMQ_PAIR, ...
  ZmqSocket(ZmqContext& ctx, int type);
  ~ZmqSocket();
  ZmqSocket(const ZmqSocket&) = delete;
  ZmqSocket& operator=(const ZmqSocket&) = delete;

  Status set_routing_id(const std::string& id);
  Status bind(const std::string& endpoint);
  Status connect(const std::string& endpoint);
  // The endpoint actually bound (resolves "tcp://127.0.0.1:*" to the port chosen).
  Result<std::string> last_endpoint() const;

  Status send(const std::vector<std::string>& parts);
  // Waits up to timeout_ms (0: poll, -1: forever is not allowed) for a message;
  // DeadlineExceeded when none came, or a signal interrupted the wait.
  Result<std::vector<std::string>> recv(int timeout_ms);
  void* handle() const { return socket_; }

 private:
  void* socket_;
};

// Waits until one of `sockets` is readable or timeout_ms passes; returns the
// readable ones' indices (empty on timeout, or when a signal interrupted the wait).
Result<std::vector<int>> zmq_poll_readable(const std::vector<ZmqSocket*>& sockets, int timeout_ms);

}  // namespace flexpert
