// SPDX-License-Identifier: Apache-2.0
// UcxTransport: setup, connections, regions, read() and teardown. Messages and collectives are
// in ucx_collectives.cc.
#include "transport/ucx/ucx_transport.h"

#include <netdb.h>
#include <sched.h>
#include <sys/mman.h>
#include <time.h>
#include <unistd.h>

#include <algorithm>
#include <cstdlib>
#include <cstring>

#include "core/clock.h"
#include "flexpert/logging.h"
#include "transport/collective_checks.h"

namespace flexpert {

namespace {

constexpr int kMaxReadsInFlight = 8;
constexpr int64_t kCloseWaitNs = 200'000'000;  // How long shutdown lets graceful closes run.
// How long shutdown waits for live peers to take its kBye. A send that completed has only left
// for UCX's buffers (over TCP: not even the socket's), and closing the endpoint discards what
// is still on its way, so a rank that returned from its last collective and shut down at once
// could take its share of that op with it.
constexpr int64_t kByeWaitNs = 1'000'000'000;

int64_t env_int(const char* name, int64_t fallback) {
  const char* value = std::getenv(name);
  if (value == nullptr || *value == '\0') return fallback;
  char* end = nullptr;
  const long long parsed = std::strtoll(value, &end, 10);
  return (end != nullptr && *end == '\0' && parsed >= 0) ? parsed : fallback;
}

Status ucs_error(ucs_status_t status, const std::string& what) {
  const std::string message = what + ": " + ucs_status_string(status);
  switch (status) {
    case UCS_ERR_UNREACHABLE:
    case UCS_ERR_CONNECTION_RESET:
    case UCS_ERR_ENDPOINT_TIMEOUT:
    case UCS_ERR_REJECTED:
    case UCS_ERR_NOT_CONNECTED:
    case UCS_ERR_CANCELED:
    case UCS_ERR_BUSY:
      return unavailable(message);
    case UCS_ERR_TIMED_OUT:
      return deadline_exceeded(message);
    case UCS_ERR_NO_MEMORY:
    case UCS_ERR_NO_RESOURCE:
    case UCS_ERR_EXCEEDS_LIMIT:
      return resource_exhausted(message);
    case UCS_ERR_INVALID_PARAM:
      return invalid_argument(message);
    case UCS_ERR_UNSUPPORTED:
      return unimplemented(message);
    default:
      return internal_error(message);
  }
}

#define FLEX_UCS_TRY(expr, what)                             \
  do {                                                       \
    const ucs_status_t flex_ucs_status_ = (expr);            \
    if (flex_ucs_status_ != UCS_OK) {                        \
      return ucs_error(flex_ucs_status_, std::string(what)); \
    }                                                        \
  } while (0)

Result<sockaddr_storage> resolve(const std::string& host, uint16_t port, socklen_t* len) {
  addrinfo hints{};
  hints.ai_flags = AI_NUMERICHOST | AI_NUMERICSERV;
  hints.ai_socktype = SOCK_STREAM;
  addrinfo* found = nullptr;
  const int rc = ::getaddrinfo(host.c_str(), std::to_string(port).c_str(), &hints, &found);
  if (rc != 0 || found == nullptr) {
    return invalid_argument("'" + host + "' is not a numeric IP address: " + gai_strerror(rc));
  }
  sockaddr_storage out{};
  std::memcpy(&out, found->ai_addr, found->ai_addrlen);
  *len = found->ai_addrlen;
  ::freeaddrinfo(found);
  return out;
}

// Lets UCX allocate `num_bytes` (registered with every memory domain that can: over shared
// memory that is a segment peers map, so their gets need nothing from us; gets of memory we
// mmap'd ourselves waited for our progress in UCX 1.13), zeroed.
Status allocate_registered(ucp_context_h context, size_t num_bytes, void** data, ucp_mem_h* memh) {
  ucp_mem_map_params_t params{};
  params.field_mask = UCP_MEM_MAP_PARAM_FIELD_ADDRESS | UCP_MEM_MAP_PARAM_FIELD_LENGTH |
                      UCP_MEM_MAP_PARAM_FIELD_FLAGS;
  params.address = nullptr;
  params.length = num_bytes;
  params.flags = UCP_MEM_MAP_ALLOCATE;
  const ucs_status_t st = ucp_mem_map(context, &params, memh);
  if (st != UCS_OK)
    return ucs_error(st, "ucp_mem_map (allocate) of " + std::to_string(num_bytes) + " bytes");
  ucp_mem_attr_t attr{};
  attr.field_mask = UCP_MEM_ATTR_FIELD_ADDRESS | UCP_MEM_ATTR_FIELD_LENGTH;
  if (ucp_mem_query(*memh, &attr) != UCS_OK || attr.length < num_bytes) {
    ucp_mem_unmap(context, *memh);
    return internal_error("ucp_mem_query of a fresh allocation failed");
  }
  std::memset(attr.address, 0, num_bytes);
  *data = attr.address;
  return Status();
}

// Registers memory the caller allocated (and keeps until the transport is destroyed): host
// memory, or CUDA device memory (said, not left to UCX's detection).
Status register_memory(ucp_context_h context, void* data, size_t num_bytes, bool device,
                       ucp_mem_h* memh) {
  ucp_mem_map_params_t params{};
  params.field_mask = UCP_MEM_MAP_PARAM_FIELD_ADDRESS | UCP_MEM_MAP_PARAM_FIELD_LENGTH;
  params.address = data;
  params.length = num_bytes;
  if (device) {
    params.field_mask |= UCP_MEM_MAP_PARAM_FIELD_MEMORY_TYPE;
    params.memory_type = UCS_MEMORY_TYPE_CUDA;
  }
  const ucs_status_t st = ucp_mem_map(context, &params, memh);
  if (st != UCS_OK) {
    return ucs_error(st, std::string("ucp_mem_map (register ") + (device ? "CUDA" : "host") +
                             " memory) of " + std::to_string(num_bytes) + " bytes");
  }
  return Status();
}

size_t round_up(size_t n, size_t align) { return (n + align - 1) / align * align; }

}  // namespace

UcxTransport::UcxTransport(TransportOptions options)
    : options_(std::move(options)),
      spin_ns_(env_int("FLEXPERT_UCX_SPIN_US", 10) * 1000),
      yield_ns_(env_int("FLEXPERT_UCX_YIELD_US", 50) * 1000),
      read_chunk_bytes_(static_cast<size_t>(
          std::max<int64_t>(4, env_int("FLEXPERT_UCX_READ_CHUNK_KB", 1024)) * 1024)) {
  pool_bytes_[0] = round_up(std::max<size_t>(options_.max_gather_bytes, 1), 64);
  pool_bytes_[1] = round_up(std::max<size_t>(options_.max_exchange_bytes, 1), 64);
}

Result<std::unique_ptr<UcxTransport>> UcxTransport::create(const TransportOptions& options) {
  if (options.rank < 0 || options.rank >= options.max_ranks || options.max_ranks > 4096) {
    return invalid_argument("rank " + std::to_string(options.rank) + " not in [0, max_ranks=" +
                            std::to_string(options.max_ranks) + "), or max_ranks above 4096");
  }
  if (options.timeout_ms <= 0) {
    return invalid_argument("timeout_ms must be > 0, got " + std::to_string(options.timeout_ms));
  }
  if (options.max_gather_bytes > (size_t{1} << 32) ||
      options.max_exchange_bytes > (size_t{1} << 36)) {
    return invalid_argument("max_gather_bytes / max_exchange_bytes too large for ucx mailboxes");
  }
  std::unique_ptr<UcxTransport> t(new UcxTransport(options));
  FLEX_RETURN_IF_ERROR(t->init());
  return t;
}

Status UcxTransport::create_context(bool proto_v2) {
  ucp_config_t* config = nullptr;
  FLEX_UCS_TRY(ucp_config_read(nullptr, nullptr, &config), "ucp_config_read");
  // Deaths over shared memory (no socket to reset) are found by UCX's keepalive: check often
  // enough that a dead rank is reported within about a second. UCX_KEEPALIVE_INTERVAL wins.
  if (std::getenv("UCX_KEEPALIVE_INTERVAL") == nullptr) {
    (void)ucp_config_modify(config, "KEEPALIVE_INTERVAL", "250ms");
  }
  if (proto_v2) (void)ucp_config_modify(config, "PROTO_ENABLE", "y");
  ucp_params_t params{};
  params.field_mask = UCP_PARAM_FIELD_FEATURES | UCP_PARAM_FIELD_NAME;
  params.features = UCP_FEATURE_AM | UCP_FEATURE_RMA;
  params.name = "flexpert";
  const ucs_status_t st = ucp_init(&params, config, &context_);
  ucp_config_release(config);
  FLEX_UCS_TRY(st, "ucp_init");
  return Status();
}

Status UcxTransport::init() {
  FLEX_RETURN_IF_ERROR(create_context(/*proto_v2=*/false));
  FLEX_RETURN_IF_ERROR(init_memory_types());
  if (cuda_memory_ && std::getenv("UCX_PROTO_ENABLE") == nullptr) {
    // NOTE: UCX 1.13's default protocols emulate a get over TCP by a CPU copy of the owner's
    // memory (ucp/rma/rma_sw.c: host memory only), so a peer's get of a device buffer killed
    // the owner (SIGSEGV, H200); its newer protocols (UCX_PROTO_ENABLE=y, later releases'
    // default) copy device memory through cuda_copy. Only where device buffers are used: the
    // staged path keeps the protocols it was tested with.
    ucp_cleanup(context_);
    context_ = nullptr;
    FLEX_RETURN_IF_ERROR(create_context(/*proto_v2=*/true));
  }

  ucp_worker_params_t wp{};
  wp.field_mask = UCP_WORKER_PARAM_FIELD_THREAD_MODE | UCP_WORKER_PARAM_FIELD_CLIENT_ID;
  wp.thread_mode = UCS_THREAD_MODE_SERIALIZED;  // mu_ serializes every call.
  wp.client_id = ucx::client_id(options_.rank, options_.incarnation);
  FLEX_UCS_TRY(ucp_worker_create(context_, &wp, &worker_), "ucp_worker_create");

  ucp_worker_attr_t wattr{};
  wattr.field_mask = UCP_WORKER_ATTR_FIELD_MAX_AM_HEADER;
  FLEX_UCS_TRY(ucp_worker_query(worker_, &wattr), "ucp_worker_query");
  if (wattr.max_am_header < sizeof(ucx::WireHeader)) {
    return unimplemented("UCX allows AM headers of " + std::to_string(wattr.max_am_header) +
                         " bytes, this backend needs " + std::to_string(sizeof(ucx::WireHeader)));
  }
  ucp_am_handler_param_t am{};
  am.field_mask = UCP_AM_HANDLER_PARAM_FIELD_ID | UCP_AM_HANDLER_PARAM_FIELD_FLAGS |
                  UCP_AM_HANDLER_PARAM_FIELD_CB | UCP_AM_HANDLER_PARAM_FIELD_ARG;
  am.id = ucx::kAmId;
  am.flags = UCP_AM_FLAG_WHOLE_MSG;
  am.cb = &UcxTransport::on_am;
  am.arg = this;
  FLEX_UCS_TRY(ucp_worker_set_am_recv_handler(worker_, &am), "ucp_worker_set_am_recv_handler");

  ucx::Address self;
  self.rank = options_.rank;
  self.incarnation = options_.incarnation;
  self.pid = static_cast<int32_t>(::getpid());
  self.start_time = shm::process_start_time(self.pid);
  std::string host = options_.listen_host;
  if (host.empty()) {
    if (const char* env = std::getenv("FLEXPERT_UCX_LISTEN_HOST")) host = env;
  }
  if (host.empty()) {
    // Peers connect by our worker address (UCX's own wireup: any UCX_TLS).
    ucp_address_t* worker_address = nullptr;
    size_t worker_address_bytes = 0;
    FLEX_UCS_TRY(ucp_worker_get_address(worker_, &worker_address, &worker_address_bytes),
                 "ucp_worker_get_address");
    self.worker.assign(reinterpret_cast<const char*>(worker_address), worker_address_bytes);
    ucp_worker_release_address(worker_, worker_address);
  } else {
    // Peers connect to our socket (UCX's client-server wireup: needs tcp in UCX_TLS).
    socklen_t len = 0;
    FLEX_ASSIGN_OR_RETURN(sockaddr_storage sa, resolve(host, 0, &len));
    ucp_listener_params_t lp{};
    lp.field_mask = UCP_LISTENER_PARAM_FIELD_SOCK_ADDR | UCP_LISTENER_PARAM_FIELD_CONN_HANDLER;
    lp.sockaddr.addr = reinterpret_cast<const sockaddr*>(&sa);
    lp.sockaddr.addrlen = len;
    lp.conn_handler.cb = &UcxTransport::on_conn_request;
    lp.conn_handler.arg = this;
    FLEX_UCS_TRY(ucp_listener_create(worker_, &lp, &listener_), "ucp_listener_create on " + host);
    ucp_listener_attr_t la{};
    la.field_mask = UCP_LISTENER_ATTR_FIELD_SOCKADDR;
    FLEX_UCS_TRY(ucp_listener_query(listener_, &la), "ucp_listener_query");
    self.host = host;
    self.port = la.sockaddr.ss_family == AF_INET
                    ? ntohs(reinterpret_cast<const sockaddr_in*>(&la.sockaddr)->sin_port)
                    : ntohs(reinterpret_cast<const sockaddr_in6*>(&la.sockaddr)->sin6_port);
  }
  address_ = self.to_string();

  const size_t ranks = static_cast<size_t>(options_.max_ranks);
  mailboxes_bytes_ = round_up(ranks * kBoxesPerPool * (pool_bytes_[0] + pool_bytes_[1]), 4096);
  FLEX_RETURN_IF_ERROR(
      allocate_registered(context_, mailboxes_bytes_, &mailboxes_, &mailboxes_memh_));
  staging_bytes_ = round_up(ranks * 2 * (pool_bytes_[0] + pool_bytes_[1]), 4096);
  FLEX_RETURN_IF_ERROR(allocate_registered(context_, staging_bytes_, &staging_, &staging_memh_));
  staging_pending_.assign(kNumPools * ranks * 2, 0);

  inboxes_.resize(ranks);
  auto* base = static_cast<std::byte*>(mailboxes_);
  for (size_t r = 0; r < ranks; ++r) {
    for (int p = 0; p < kNumPools; ++p) {
      for (int b = 0; b < kBoxesPerPool; ++b) {
        const size_t pool_base = p == 0 ? 0 : ranks * kBoxesPerPool * pool_bytes_[0];
        Box& box = inboxes_[r].pools[p][b];
        box.data = base + pool_base + (r * kBoxesPerPool + static_cast<size_t>(b)) * pool_bytes_[p];
        box.owner = this;
      }
    }
  }
  peers_.assign(ranks, nullptr);
  auto me = std::make_shared<Peer>();
  me->rank = options_.rank;
  me->address = address_;
  me->parsed = self;
  peers_[options_.rank] = std::move(me);
  return Status();
}

UcxTransport::~UcxTransport() {
  // Peers hear it and what we sent reaches them (not when create() failed half way).
  if (worker_ != nullptr && !peers_.empty()) (void)shutdown();
  {
    std::lock_guard<std::mutex> lock(mu_);
    shut_down_ = true;
  }
  for (auto& c : conns_) {
    if (c->ep != nullptr) close_ep(c.get(), /*force=*/true);
  }
  if (worker_ != nullptr) {
    // Forced closes complete their requests (with errors) within a few progress calls.
    const int64_t deadline = now_ns() + kCloseWaitNs;
    while (inflight_ > 0 && now_ns() < deadline) ucp_worker_progress(worker_);
  }
  for (auto& p : peers_) {
    if (p != nullptr)
      for (auto& [id, rkey] : p->rkeys) ucp_rkey_destroy(rkey);
  }
  for (auto& p : retired_) {
    for (auto& [id, rkey] : p->rkeys) ucp_rkey_destroy(rkey);
  }
  if (listener_ != nullptr) ucp_listener_destroy(listener_);
  if (inflight_ == 0) {
    // Else a request may still write into them: leak them rather than corrupt memory.
    // UCX allocated them, or (register_region) only registered them: unmap frees or deregisters.
    for (auto& [id, r] : own_regions_) ucp_mem_unmap(context_, r.memh);
    // UCX allocated them. Null when create() failed before.
    if (mailboxes_memh_ != nullptr) ucp_mem_unmap(context_, mailboxes_memh_);
    if (staging_memh_ != nullptr) ucp_mem_unmap(context_, staging_memh_);
  } else {
    // Sends to a dead peer over an endpoint without error handling never complete.
    FLEX_LOG(WARN) << "ucx rank " << options_.rank << ": " << inflight_
                   << " requests still in flight at teardown; UCX state and buffers are leaked";
  }
  if (inflight_ > 0) return;  // UCX asserts on a teardown with requests in use: leak it all.
  if (worker_ != nullptr) ucp_worker_destroy(worker_);
  if (context_ != nullptr) ucp_cleanup(context_);
}

TransportCapabilities UcxTransport::capabilities() const {
  TransportCapabilities c;
  c.one_sided_read = true;
  c.device_memory = false;
  c.device_buffer_reads = cuda_memory_;
  c.cross_host = true;
  c.max_gather_bytes = options_.max_gather_bytes;
  c.max_exchange_bytes = options_.max_exchange_bytes;
  return c;
}

void UcxTransport::on_conn_request(ucp_conn_request_h request, void* arg) {
  auto* self = static_cast<UcxTransport*>(arg);
  ucp_conn_request_attr_t attr{};
  attr.field_mask = UCP_CONN_REQUEST_ATTR_FIELD_CLIENT_ID;
  auto conn = std::make_unique<Conn>();
  conn->self = self;
  if (ucp_conn_request_query(request, &attr) == UCS_OK) {
    conn->rank = ucx::client_id_rank(attr.client_id);
    conn->incarnation = ucx::client_id_incarnation(attr.client_id);
  }
  if (self->shut_down_) {
    ucp_listener_reject(self->listener_, request);
    return;
  }
  ucp_ep_params_t ep{};
  ep.field_mask = UCP_EP_PARAM_FIELD_CONN_REQUEST | UCP_EP_PARAM_FIELD_ERR_HANDLING_MODE |
                  UCP_EP_PARAM_FIELD_ERR_HANDLER;
  ep.conn_request = request;
  ep.err_mode = UCP_ERR_HANDLING_MODE_PEER;
  ep.err_handler.cb = &UcxTransport::on_ep_error;
  ep.err_handler.arg = conn.get();
  if (ucp_ep_create(self->worker_, &ep, &conn->ep) != UCS_OK) {
    FLEX_LOG(WARN) << "ucx rank " << self->options_.rank << ": accepting rank " << conn->rank
                   << " failed";
    return;
  }
  self->conns_.push_back(std::move(conn));
}

void UcxTransport::on_ep_error(void* arg, ucp_ep_h ep, ucs_status_t status) {
  auto* conn = static_cast<Conn*>(arg);
  UcxTransport* self = conn->self;
  self->to_close_.push_back(conn);
  if (conn->rank < 0 || conn->rank >= self->options_.max_ranks) return;
  Peer* p = self->peers_[conn->rank].get();
  if (p == nullptr || p->parsed.incarnation != conn->incarnation || p->lost) return;
  const Inbox& in = self->inboxes_[conn->rank];
  const bool said_bye = in.seen && in.incarnation == conn->incarnation && in.bye;
  p->lost = true;
  p->dead = !said_bye;
  p->lost_why = said_bye
                    ? "shut down"
                    : std::string("died (UCX endpoint error: ") + ucs_status_string(status) + ")";
}

void UcxTransport::close_ep(Conn* conn, bool force) {
  if (conn->ep == nullptr) return;
  ucp_request_param_t param{};
  param.op_attr_mask = UCP_OP_ATTR_FIELD_FLAGS;
  // Forced closes need UCP_ERR_HANDLING_MODE_PEER; the others flush (and may never complete
  // towards a dead peer: the request is released and left to UCX).
  param.flags = force && conn->peer_errors ? UCP_EP_CLOSE_FLAG_FORCE : 0;
  void* request = ucp_ep_close_nbx(conn->ep, &param);
  if (request != nullptr && !UCS_PTR_IS_ERR(request)) ucp_request_free(request);
  conn->ep = nullptr;
}

void UcxTransport::progress_locked() {
  while (ucp_worker_progress(worker_) != 0) {
  }
  // Endpoints that failed are closed here, outside their callbacks.
  for (Conn* c : to_close_) close_ep(c, /*force=*/true);
  to_close_.clear();
  for (int r : acks_due_) {
    const Peer* p = peers_[r].get();
    const Inbox& in = inboxes_[r];
    if (p == nullptr || p->conn == nullptr || p->conn->ep == nullptr || p->lost ||
        in.incarnation != p->parsed.incarnation) {
      continue;
    }
    (void)post_send(*p, header_for(ucx::MessageType::kByeAck), nullptr, 0, nullptr);
  }
  acks_due_.clear();
  const int64_t now = now_ns();
  if (now < next_watch_ns_) return;
  next_watch_ns_ = now + shm::kLivenessSliceNs;
  for (const auto& p : peers_) {
    if (p == nullptr || p->lost || !p->watch.watching() || !p->watch.ended()) continue;
    const Inbox& in = inboxes_[p->rank];
    const bool said_bye = in.seen && in.incarnation == p->parsed.incarnation && in.bye;
    p->lost = true;
    p->dead = !said_bye;
    p->lost_why = said_bye ? "shut down" : "died (its process ended)";
  }
}

Status UcxTransport::peer_error(const Peer& peer) const {
  const std::string who =
      "rank " + std::to_string(peer.rank) + " (pid " + std::to_string(peer.parsed.pid) + ")";
  if (peer.lost) {
    const Status s = unavailable(who + " " + peer.lost_why);
    return peer.dead ? s.with_dead_rank(peer.rank) : s;
  }
  const Inbox& in = inboxes_[peer.rank];
  if (in.seen && in.incarnation == peer.parsed.incarnation && in.bye) {
    return unavailable(who + " shut down");
  }
  if (in.seen && in.incarnation > peer.parsed.incarnation) {
    return unavailable(who + " was replaced by incarnation " + std::to_string(in.incarnation));
  }
  return Status();
}

Status UcxTransport::connect(int peer, const std::string& address) {
  if (peer < 0 || peer >= options_.max_ranks) {
    return invalid_argument("connect: rank " + std::to_string(peer) + " not in [0, " +
                            std::to_string(options_.max_ranks) + ")");
  }
  std::unique_lock<std::mutex> lock(mu_);
  if (shut_down_) return failed_precondition("connect after shutdown");
  if (peer == options_.rank) {
    return address == address_ ? Status()
                               : invalid_argument("connect: '" + address +
                                                  "' is not this rank's address " + address_);
  }
  if (peers_[peer] != nullptr && peers_[peer]->address == address) return Status();
  FLEX_ASSIGN_OR_RETURN(ucx::Address parsed, ucx::Address::parse(address));
  if (parsed.rank != peer) {
    return invalid_argument("connect: " + address + " belongs to rank " +
                            std::to_string(parsed.rank) + ", not " + std::to_string(peer));
  }
  sockaddr_storage sa{};
  socklen_t len = 0;
  if (!parsed.host.empty()) {
    FLEX_ASSIGN_OR_RETURN(sa, resolve(parsed.host, parsed.port, &len));
  }
  if (peers_[peer] != nullptr) {
    // A new incarnation: the old endpoint is closed, never reused; its rkeys go with it.
    Peer& old = *peers_[peer];
    if (old.conn != nullptr) close_ep(old.conn, /*force=*/true);
    retired_.push_back(std::move(peers_[peer]));
  }
  auto p = std::make_shared<Peer>();
  p->rank = peer;
  p->address = address;
  p->parsed = parsed;
  auto conn = std::make_unique<Conn>();
  conn->self = this;
  conn->rank = peer;
  conn->incarnation = parsed.incarnation;
  ucp_ep_params_t ep{};
  ep.field_mask = UCP_EP_PARAM_FIELD_ERR_HANDLING_MODE | UCP_EP_PARAM_FIELD_ERR_HANDLER;
  if (parsed.host.empty()) {
    ep.field_mask |= UCP_EP_PARAM_FIELD_REMOTE_ADDRESS;
    ep.address = reinterpret_cast<const ucp_address_t*>(parsed.worker.data());
  } else {
    ep.field_mask |= UCP_EP_PARAM_FIELD_FLAGS | UCP_EP_PARAM_FIELD_SOCK_ADDR;
    ep.flags = UCP_EP_PARAMS_FLAGS_CLIENT_SERVER | UCP_EP_PARAMS_FLAGS_SEND_CLIENT_ID;
    ep.sockaddr.addr = reinterpret_cast<const sockaddr*>(&sa);
    ep.sockaddr.addrlen = len;
  }
  ep.err_mode = UCP_ERR_HANDLING_MODE_PEER;
  ep.err_handler.cb = &UcxTransport::on_ep_error;
  ep.err_handler.arg = conn.get();
  ucs_status_t created = UCS_ERR_UNREACHABLE;
  if (!no_peer_errors_ || !parsed.host.empty()) created = ucp_ep_create(worker_, &ep, &conn->ep);
  if (created == UCS_ERR_UNREACHABLE && parsed.host.empty()) {
    no_peer_errors_ = true;  // Do not ask again (UCX logs an error each time).
    // UCX 1.13's shared-memory transports have no peer-failure handling: such a peer is on
    // this host, so its death is found by watching its process instead.
    ep.err_mode = UCP_ERR_HANDLING_MODE_NONE;
    conn->peer_errors = false;
    created = ucp_ep_create(worker_, &ep, &conn->ep);
    if (created == UCS_OK) {
      p->watch = shm::ProcessWatch::watch(parsed.pid, parsed.start_time);
      if (!p->watch.watching()) {
        FLEX_LOG(WARN) << "ucx rank " << options_.rank << ": rank " << peer << " (pid "
                       << parsed.pid << ") is reached without UCX error handling and its "
                       << "process is not visible from here: its death is noticed by timeouts";
      }
    }
  }
  FLEX_UCS_TRY(created, "connecting to rank " + std::to_string(peer) + " at " + address);
  p->conn = conn.get();
  conns_.push_back(std::move(conn));
  Inbox& in = inboxes_[peer];
  if (in.seen && in.incarnation < parsed.incarnation) reset_inbox(in, parsed.incarnation);
  peers_[peer] = p;
  // What the peer needs from us: our regions' keys and, if we are in an epoch, that epoch.
  announce_regions(*p, nullptr, -1);
  if (has_epoch_) {
    const ucx::WireHeader h = header_for(ucx::MessageType::kEpoch);
    (void)post_send(*p, h, nullptr, 0, nullptr);
  }
  progress_locked();
  return Status();
}

Status UcxTransport::disconnect(int peer) {
  if (peer < 0 || peer >= options_.max_ranks || peer == options_.rank) {
    return invalid_argument("disconnect: bad peer rank " + std::to_string(peer));
  }
  std::lock_guard<std::mutex> lock(mu_);
  if (peers_.empty() || peers_[peer] == nullptr) return Status();
  if (peers_[peer]->conn != nullptr) close_ep(peers_[peer]->conn, /*force=*/true);
  retired_.push_back(std::move(peers_[peer]));
  return Status();
}

Status UcxTransport::mark_peer_lost(int peer, const std::string& why) {
  if (peer < 0 || peer >= options_.max_ranks || peer == options_.rank) {
    return invalid_argument("mark_peer_lost: bad peer rank " + std::to_string(peer));
  }
  std::lock_guard<std::mutex> lock(mu_);
  if (shut_down_) return failed_precondition("mark_peer_lost after shutdown");
  Peer* p = peers_[peer].get();
  if (p == nullptr) return Status();
  if (!p->lost) {
    p->lost = true;
    p->lost_why = "lost: " + why;
  }
  // Its requests complete (cancelled) at the next progress; the endpoint is never reused.
  if (p->conn != nullptr) close_ep(p->conn, /*force=*/true);
  return Status();
}

void UcxTransport::progress() {
  std::lock_guard<std::mutex> lock(mu_);
  if (!shut_down_) progress_locked();
}

Status UcxTransport::peer_status(int peer) const {
  if (peer < 0 || peer >= options_.max_ranks) {
    return invalid_argument("rank " + std::to_string(peer) + " out of range");
  }
  std::lock_guard<std::mutex> lock(mu_);
  if (shut_down_ || peer == options_.rank) return Status();
  // Deaths are events of the worker: let it deliver them.
  const_cast<UcxTransport*>(this)->progress_locked();
  const Peer* p = peers_[peer].get();
  return p == nullptr ? Status() : peer_error(*p);
}

Result<Region> UcxTransport::allocate_region(int region_id, size_t num_bytes) {
  return add_region(region_id, nullptr, num_bytes, /*device=*/false);
}

Status UcxTransport::register_region(int region_id, void* data, size_t num_bytes) {
  if (data == nullptr) return invalid_argument("register_region: null data");
  return add_region(region_id, data, num_bytes, /*device=*/false).status();
}

Result<Region> UcxTransport::add_region(int region_id, void* data, size_t num_bytes, bool device) {
  if (region_id < 0) return invalid_argument("region id must be >= 0");
  if (num_bytes == 0) return invalid_argument("region " + std::to_string(region_id) + ": 0 bytes");
  std::lock_guard<std::mutex> lock(mu_);
  if (shut_down_) return failed_precondition("allocate_region after shutdown");
  if (own_regions_.count(region_id) != 0) {
    return invalid_argument("region " + std::to_string(region_id) + " already allocated");
  }
  OwnRegion r;
  r.num_bytes = num_bytes;
  if (data == nullptr) {
    FLEX_RETURN_IF_ERROR(allocate_registered(context_, num_bytes, &r.data, &r.memh));
  } else {
    FLEX_RETURN_IF_ERROR(register_memory(context_, data, num_bytes, device, &r.memh));
    r.data = data;
    r.device = device;
  }
  void* packed = nullptr;
  size_t packed_bytes = 0;
  const ucs_status_t st = ucp_rkey_pack(context_, r.memh, &packed, &packed_bytes);
  if (st != UCS_OK) {
    ucp_mem_unmap(context_, r.memh);
    return ucs_error(st, "ucp_rkey_pack of region " + std::to_string(region_id));
  }
  r.packed_rkey.assign(static_cast<std::byte*>(packed),
                       static_cast<std::byte*>(packed) + packed_bytes);
  ucp_rkey_buffer_release(packed);
  OwnRegion& stored = own_regions_[region_id] = std::move(r);
  for (const auto& p : peers_) {
    if (p != nullptr && p->conn != nullptr) announce_regions(*p, &stored, region_id);
  }
  return Region{region_id, stored.data, num_bytes};
}

Status UcxTransport::read(int peer, int region_id, size_t offset, void* dst, size_t num_bytes) {
  FLEX_RETURN_IF_ERROR(validate_read(peer, dst, num_bytes, options_));
  const std::string what =
      "read of rank " + std::to_string(peer) + " region " + std::to_string(region_id);
  auto bounds = [&](size_t size) { return check_read_range(what, offset, num_bytes, size); };
  std::unique_lock<std::mutex> lock(mu_);
  if (shut_down_) return failed_precondition(what + " after shutdown");
  if (peer == options_.rank) {
    auto it = own_regions_.find(region_id);
    if (it == own_regions_.end()) return not_found(what + ": not allocated");
    FLEX_RETURN_IF_ERROR(bounds(it->second.num_bytes));
    if (it->second.device) return unimplemented(what + ": device memory of this rank");
    const std::byte* src = static_cast<const std::byte*>(it->second.data) + offset;
    lock.unlock();  // Own regions stay mapped until shutdown, which is not concurrent with us.
    if (num_bytes > 0) std::memcpy(dst, src, num_bytes);
    return Status();
  }
  std::shared_ptr<Peer> p = peers_[peer];  // Keeps its rkeys alive if connect() replaces it.
  if (p == nullptr || p->conn == nullptr) return unavailable(what + ": rank not connected");
  FLEX_RETURN_IF_ERROR(peer_error(*p).annotate(what));
  const int64_t deadline = now_ns() + int64_t{options_.timeout_ms} * 1'000'000;
  const Inbox& in = inboxes_[peer];
  auto region_known = [&] { return in.seen && in.regions.count(region_id) != 0; };
  if (!region_known()) {
    // Announced but not here yet (the peer's messages count its announcements)? Until the
    // first message of its incarnation arrives nothing is known: a peer told to connect to us
    // at the same time as we to it (a scale-up's ConnectCommands) announces once it has.
    auto heard = [&] { return in.seen && in.heard; };
    progress_until(lock, deadline, [&] {
      return region_known() || !peer_error(*p).ok() ||
             (heard() &&
              (in.incarnation != p->parsed.incarnation || in.regions.size() >= in.regions_claimed));
    });
    if (!region_known()) {
      FLEX_RETURN_IF_ERROR(peer_error(*p).annotate(what));
      if (!heard()) {
        return unavailable(what + ": no message from it within " +
                           std::to_string(options_.timeout_ms) + " ms");
      }
      return not_found(what + ": no such region");
    }
  }
  if (in.incarnation != p->parsed.incarnation) {
    return unavailable(what + ": rank " + std::to_string(peer) + " was replaced");
  }
  const RemoteRegion& region = in.regions.at(region_id);
  FLEX_RETURN_IF_ERROR(bounds(region.num_bytes));
  if (num_bytes == 0) return Status();
  auto rk = p->rkeys.find(region_id);
  if (rk == p->rkeys.end()) {
    ucp_rkey_h rkey = nullptr;
    FLEX_UCS_TRY(ucp_ep_rkey_unpack(p->conn->ep, region.packed_rkey.data(), &rkey),
                 what + ": ucp_ep_rkey_unpack");
    rk = p->rkeys.emplace(region_id, rkey).first;
  }
  const ucp_rkey_h rkey = rk->second;
  const uint64_t remote = region.addr + offset;

  struct ReadState {
    int in_flight = 0;
    ucs_status_t error = UCS_OK;
  } state;
  ucp_request_param_t param{};
  param.op_attr_mask = UCP_OP_ATTR_FIELD_CALLBACK | UCP_OP_ATTR_FIELD_USER_DATA;
  param.cb.send = [](void* request, ucs_status_t status, void* user_data) {
    auto* s = static_cast<ReadState*>(user_data);
    if (status != UCS_OK && s->error == UCS_OK) s->error = status;
    --s->in_flight;
    ucp_request_free(request);
  };
  param.user_data = &state;
  size_t posted = 0;
  auto post_more = [&] {
    while (posted < num_bytes && state.in_flight < kMaxReadsInFlight && state.error == UCS_OK &&
           p->conn->ep != nullptr) {
      const size_t n = std::min(read_chunk_bytes_, num_bytes - posted);
      void* request = ucp_get_nbx(p->conn->ep, static_cast<std::byte*>(dst) + posted, n,
                                  remote + posted, rkey, &param);
      if (UCS_PTR_IS_ERR(request)) {
        state.error = UCS_PTR_STATUS(request);
      } else if (request != nullptr) {
        ++state.in_flight;
      }
      posted += n;
    }
  };
  const bool done = progress_until(lock, deadline, [&] {
    post_more();
    if (!peer_error(*p).ok() && state.in_flight > 0 && p->conn->ep != nullptr) {
      close_ep(p->conn, /*force=*/true);  // Dead peer: cancel what is still in flight.
    }
    return state.in_flight == 0 &&
           (posted >= num_bytes || state.error != UCS_OK || p->conn->ep == nullptr);
  });
  if (!done) {
    // A silent peer: close the endpoint so that no get lands in `dst` after we return.
    if (!p->lost) {
      p->lost = true;
      p->lost_why = "did not answer a read within " + std::to_string(options_.timeout_ms) + " ms";
    }
    if (p->conn->ep != nullptr) close_ep(p->conn, /*force=*/true);
    // A forced close completes them within a few progress calls. An endpoint without error
    // handling cannot be forced; its gets (shared memory) are one-sided and long done.
    const int64_t give_up = now_ns() + kCloseWaitNs;
    while (state.in_flight > 0 && now_ns() < give_up) progress_locked();
    if (state.in_flight > 0) {
      // NOTE: `state` lives on this stack frame: the callbacks must not outlive it.
      FLEX_CHECK(false) << what << ": " << state.in_flight
                        << " gets still in flight after the endpoint was closed";
    }
    return deadline_exceeded(what + " timed out after " + std::to_string(options_.timeout_ms) +
                             " ms");
  }
  FLEX_RETURN_IF_ERROR(peer_error(*p).annotate(what));
  if (state.error != UCS_OK) return ucs_error(state.error, what);
  if (posted < num_bytes) return unavailable(what + ": endpoint closed");
  return Status();
}

Status UcxTransport::shutdown() {
  std::unique_lock<std::mutex> lock(mu_);
  if (shut_down_) return Status();
  // Peers waiting on us hear it now instead of at their deadline.
  const ucx::WireHeader bye = header_for(ucx::MessageType::kBye);
  std::vector<const Peer*> told;
  for (const auto& p : peers_) {
    if (p != nullptr && p->rank != options_.rank && p->conn != nullptr && p->conn->ep != nullptr &&
        !p->lost && post_send(*p, bye, nullptr, 0, nullptr).ok()) {
      told.push_back(p.get());
    }
  }
  // Until every live peer has taken the bye (and with it all we sent before), or briefly for
  // one that does not progress; then close everything.
  progress_until(lock, now_ns() + kByeWaitNs, [&] {
    if (inflight_ > 0) return false;
    for (const Peer* p : told) {
      const Inbox& in = inboxes_[p->rank];
      const bool acked = in.seen && in.incarnation == p->parsed.incarnation && in.bye_acked;
      if (!acked && !p->lost && peers_[p->rank].get() == p) return false;
    }
    return true;
  });
  shut_down_ = true;
  for (auto& c : conns_) {
    if (c->ep != nullptr) close_ep(c.get(), /*force=*/true);
  }
  const int64_t deadline = now_ns() + kCloseWaitNs;
  while (inflight_ > 0 && now_ns() < deadline) progress_locked();
  held_.clear();
  return Status();
}

}  // namespace flexpert
