// SPDX-License-Identifier: Apache-2.0
#include "cluster/zmq_socket.h"

#include <zmq.h>

#include <cerrno>

#include "flexpert/logging.h"

// Wraps a ZeroMQ call: on failure returns a Status naming the call and errno text.
#define FLEX_ZMQ_TRY(call)                                                                  \
  do {                                                                                      \
    if ((call) < 0) {                                                                       \
      const int flex_errno_ = zmq_errno();                                                  \
      return Status(                                                                        \
          flex_errno_ == EAGAIN ? StatusCode::kDeadlineExceeded : StatusCode::kUnavailable, \
          std::string(#call) + ": " + zmq_strerror(flex_errno_));                           \
    }                                                                                       \
  } while (0)

namespace flexpert {

ZmqContext::ZmqContext() : ctx_(zmq_ctx_new()) { FLEX_CHECK(ctx_ != nullptr); }

ZmqContext::~ZmqContext() { zmq_ctx_term(ctx_); }

ZmqSocket::ZmqSocket(ZmqContext& ctx, int type) : socket_(zmq_socket(ctx.get(), type)) {
  FLEX_CHECK(socket_ != nullptr) << zmq_strerror(zmq_errno());
  const int linger_ms = 0;  // Never block process exit on undelivered messages.
  zmq_setsockopt(socket_, ZMQ_LINGER, &linger_ms, sizeof(linger_ms));
  // Control messages are few and must not be dropped: no high-water mark.
  const int unlimited = 0;
  zmq_setsockopt(socket_, ZMQ_SNDHWM, &unlimited, sizeof(unlimited));
  zmq_setsockopt(socket_, ZMQ_RCVHWM, &unlimited, sizeof(unlimited));
  if (type == ZMQ_ROUTER) {
    const int mandatory = 1;  // Sending to an unknown peer fails instead of dropping silently.
    zmq_setsockopt(socket_, ZMQ_ROUTER_MANDATORY, &mandatory, sizeof(mandatory));
  }
}

ZmqSocket::~ZmqSocket() { zmq_close(socket_); }

Status ZmqSocket::set_routing_id(const std::string& id) {
  FLEX_ZMQ_TRY(zmq_setsockopt(socket_, ZMQ_ROUTING_ID, id.data(), id.size()));
  return Status();
}

Status ZmqSocket::bind(const std::string& endpoint) {
  FLEX_ZMQ_TRY(zmq_bind(socket_, endpoint.c_str()));
  return Status();
}

Status ZmqSocket::connect(const std::string& endpoint) {
  FLEX_ZMQ_TRY(zmq_connect(socket_, endpoint.c_str()));
  return Status();
}

Result<std::string> ZmqSocket::last_endpoint() const {
  char buf[256];
  size_t len = sizeof(buf);
  FLEX_ZMQ_TRY(zmq_getsockopt(socket_, ZMQ_LAST_ENDPOINT, buf, &len));
  return std::string(buf);
}

Status ZmqSocket::send(const std::vector<std::string>& parts) {
  for (size_t i = 0; i < parts.size(); ++i) {
    const int flags = (i + 1 < parts.size() ? ZMQ_SNDMORE : 0) | ZMQ_DONTWAIT;
    FLEX_ZMQ_TRY(zmq_send(socket_, parts[i].data(), parts[i].size(), flags));
  }
  return Status();
}

Result<std::vector<std::string>> ZmqSocket::recv(int timeout_ms) {
  FLEX_CHECK(timeout_ms >= 0);
  zmq_pollitem_t item{socket_, 0, ZMQ_POLLIN, 0};
  if (zmq_poll(&item, 1, timeout_ms) < 0) {
    // A signal (SIGTERM asking a worker to leave): nothing received, the caller looks at
    // its flags and polls again.
    if (zmq_errno() == EINTR) return deadline_exceeded("interrupted by a signal");
    return unavailable(std::string("zmq_poll: ") + zmq_strerror(zmq_errno()));
  }
  if (!(item.revents & ZMQ_POLLIN)) return deadline_exceeded("no message within timeout");
  std::vector<std::string> parts;
  int more = 1;
  while (more) {
    zmq_msg_t msg;
    zmq_msg_init(&msg);
    if (zmq_msg_recv(&msg, socket_, 0) < 0) {
      const int err = zmq_errno();
      zmq_msg_close(&msg);
      return unavailable(std::string("zmq_msg_recv: ") + zmq_strerror(err));
    }
    parts.emplace_back(static_cast<const char*>(zmq_msg_data(&msg)), zmq_msg_size(&msg));
    more = zmq_msg_more(&msg);
    zmq_msg_close(&msg);
  }
  return parts;
}

Result<std::vector<int>> zmq_poll_readable(const std::vector<ZmqSocket*>& sockets, int timeout_ms) {
  std::vector<zmq_pollitem_t> items;
  for (ZmqSocket* s : sockets) items.push_back({s->handle(), 0, ZMQ_POLLIN, 0});
  std::vector<int> ready;
  if (zmq_poll(items.data(), static_cast<int>(items.size()), timeout_ms) < 0) {
    if (zmq_errno() == EINTR) return ready;  // A signal: none readable yet.
    return unavailable(std::string("zmq_poll: ") + zmq_strerror(zmq_errno()));
  }
  for (size_t i = 0; i < items.size(); ++i) {
    if (items[i].revents & ZMQ_POLLIN) ready.push_back(static_cast<int>(i));
  }
  return ready;
}

}  // namespace flexpert
