// SPDX-License-Identifier: Apache-2.0
// UcxTransport's input errors in one process (UCX running, no peers): what create() and
// connect() refuse, and that a create() that fails half way tears down cleanly. Its device
// memory capability against what UCX itself reports, FLEXPERT_UCX_CUDA, and (CUDA builds, with
// a CUDA-aware UCX) device buffers read device to device.
#include <gtest/gtest.h>
#include <ucp/api/ucp.h>
#include <unistd.h>

#include <atomic>
#include <cstdlib>
#include <optional>
#include <string>
#include <thread>
#include <vector>

#ifdef FLEXPERT_TEST_WITH_CUDA
#include <cuda_runtime.h>
#endif

#include "transport/transport.h"
#include "transport/ucx/ucx_wire.h"

namespace flexpert {
namespace {

TransportOptions options(int rank) {
  TransportOptions o;
  o.session = "ucxunit" + std::to_string(::getpid());
  o.rank = rank;
  o.max_ranks = 4;
  o.timeout_ms = 1000;
  return o;
}

TEST(UcxTransportTest, CreateRefusesBadOptions) {
  TransportOptions o = options(0);
  o.listen_host = "not-an-ip";
  auto bad_host = create_transport("ucx", o);
  ASSERT_FALSE(bad_host.ok());
  EXPECT_EQ(bad_host.status().code(), StatusCode::kInvalidArgument)
      << bad_host.status().to_string();
  o = options(4);
  EXPECT_EQ(create_transport("ucx", o).status().code(), StatusCode::kInvalidArgument);
  o = options(0);
  o.timeout_ms = 0;
  EXPECT_EQ(create_transport("ucx", o).status().code(), StatusCode::kInvalidArgument);
}

TEST(UcxTransportTest, AddressesAndConnectErrors) {
  auto created = create_transport("ucx", options(1));
  ASSERT_TRUE(created.ok()) << created.status().to_string();
  Transport& t = **created;
  auto parsed = ucx::Address::parse(t.address());
  ASSERT_TRUE(parsed.ok()) << parsed.status().to_string();
  EXPECT_EQ(parsed->rank, 1);
  EXPECT_EQ(parsed->pid, ::getpid());
  EXPECT_FALSE(parsed->worker.empty());  // Worker-address mode by default.
  EXPECT_TRUE(t.capabilities().cross_host && t.capabilities().one_sided_read);

  EXPECT_TRUE(t.connect(1, t.address()).ok());  // Itself: a no-op.
  EXPECT_EQ(t.connect(1, "ucx:///r1/i9/p1/t1/wAAAA").code(), StatusCode::kInvalidArgument);
  EXPECT_EQ(t.connect(2, t.address()).code(), StatusCode::kInvalidArgument);  // Rank 1's.
  EXPECT_EQ(t.connect(2, "/flexpert-s-r2-i0").code(), StatusCode::kInvalidArgument);
  EXPECT_EQ(t.connect(7, t.address()).code(), StatusCode::kInvalidArgument);
  EXPECT_EQ(t.mark_peer_lost(1, "x").code(), StatusCode::kInvalidArgument);  // Itself.
  EXPECT_TRUE(t.mark_peer_lost(2, "never connected").ok());
  EXPECT_TRUE(t.peer_status(2).ok());
  Group alone{1, {1}};
  EXPECT_TRUE(t.barrier(alone).ok());
  EXPECT_EQ(t.barrier(Group{1, {1, 2}}).code(), StatusCode::kFailedPrecondition);
  ASSERT_TRUE(t.shutdown().ok());
  EXPECT_TRUE(t.shutdown().ok());
  EXPECT_EQ(t.barrier(alone).code(), StatusCode::kFailedPrecondition);
}

TEST(UcxTransportTest, ListenerModeAddress) {
  TransportOptions o = options(3);
  o.listen_host = "127.0.0.1";
  auto created = create_transport("ucx", o);
  ASSERT_TRUE(created.ok()) << created.status().to_string();
  auto parsed = ucx::Address::parse((*created)->address());
  ASSERT_TRUE(parsed.ok()) << parsed.status().to_string();
  EXPECT_EQ(parsed->host, "127.0.0.1");
  EXPECT_NE(parsed->port, 0);
  EXPECT_TRUE(parsed->worker.empty());
  EXPECT_TRUE((*created)->shutdown().ok());
}

// Whether the UCX this process loaded supports CUDA memory, asked of UCX directly (and not
// under UCX_PROTO_ENABLE=n, whose gets of device memory UCX 1.13 cannot serve).
bool ucx_supports_cuda() {
  if (const char* proto = std::getenv("UCX_PROTO_ENABLE")) {
    const std::string p = proto;  // The spellings ucx_device_memory.cc takes for "no".
    if (p == "n" || p == "no" || p == "N" || p == "0" || p == "off") return false;
  }
  ucp_params_t params{};
  params.field_mask = UCP_PARAM_FIELD_FEATURES;
  params.features = UCP_FEATURE_RMA;
  ucp_context_h context = nullptr;
  if (ucp_init(&params, nullptr, &context) != UCS_OK) return false;
  ucp_context_attr_t attr{};
  attr.field_mask = UCP_ATTR_FIELD_MEMORY_TYPES;
  const bool cuda = ucp_context_query(context, &attr) == UCS_OK &&
                    (attr.memory_types & (uint64_t{1} << UCS_MEMORY_TYPE_CUDA)) != 0;
  ucp_cleanup(context);
  return cuda;
}

// Sets FLEXPERT_UCX_CUDA (nullopt: unsets it) for one scope; restores what it was.
class ScopedKnob {
 public:
  explicit ScopedKnob(std::optional<std::string> value) {
    if (const char* old = std::getenv("FLEXPERT_UCX_CUDA")) old_ = old;
    if (value) {
      setenv("FLEXPERT_UCX_CUDA", value->c_str(), 1);
    } else {
      unsetenv("FLEXPERT_UCX_CUDA");
    }
  }
  ~ScopedKnob() {
    if (old_) {
      setenv("FLEXPERT_UCX_CUDA", old_->c_str(), 1);
    } else {
      unsetenv("FLEXPERT_UCX_CUDA");
    }
  }

 private:
  std::optional<std::string> old_;
};

// Debian's UCX (what CI has) reports no CUDA memory: the capability is off, register_buffer()
// refuses, and FLEXPERT_UCX_CUDA=on fails at creation naming the knob. A CUDA-aware UCX
// (LD_LIBRARY_PATH) turns it on under auto and on.
TEST(UcxTransportTest, DeviceBufferReadsAsUcxReportsThem) {
  const bool cuda = ucx_supports_cuda();
  std::printf("UCX loaded %s CUDA memory\n", cuda ? "supports" : "does not support");
  for (const char* knob : {"", "auto", "off", "on"}) {
    ScopedKnob scoped(*knob == '\0' ? std::nullopt : std::optional<std::string>(knob));
    auto created = create_transport("ucx", options(0));
    const bool want = cuda && std::string(knob) != "off";
    if (std::string(knob) == "on" && !cuda) {
      ASSERT_FALSE(created.ok());
      EXPECT_EQ(created.status().code(), StatusCode::kFailedPrecondition)
          << created.status().to_string();
      EXPECT_NE(created.status().message().find("FLEXPERT_UCX_CUDA=on"), std::string::npos)
          << created.status().to_string();
      EXPECT_NE(created.status().message().find("supports no CUDA memory"), std::string::npos)
          << created.status().to_string();
      continue;
    }
    ASSERT_TRUE(created.ok()) << knob << ": " << created.status().to_string();
    Transport& t = **created;
    EXPECT_EQ(t.capabilities().device_buffer_reads, want) << "FLEXPERT_UCX_CUDA=" << knob;
    EXPECT_FALSE(t.capabilities().mapped_peer_buffers);
    if (!want) {
      std::vector<char> host(64);
      const Status registered = t.register_buffer(1 << 20, host.data(), host.size());
      EXPECT_EQ(registered.code(), StatusCode::kUnimplemented) << registered.to_string();
    }
    EXPECT_EQ(t.map_peer_buffer(0, 1 << 20, MapMode::kLookup).status().code(),
              StatusCode::kUnimplemented);
    EXPECT_TRUE(t.shutdown().ok());
  }
  ScopedKnob bad(std::string("yes"));
  EXPECT_EQ(create_transport("ucx", options(0)).status().code(), StatusCode::kInvalidArgument);
}

#ifdef FLEXPERT_TEST_WITH_CUDA
// Two ranks in one process: rank 0 registers device memory, rank 1 reads parts of it straight
// into its device memory (and into host memory) while rank 0 progresses (over TCP a get is
// messages that the owner answers). Skipped unless the UCX loaded supports CUDA memory (the
// Debian build does not: docs/ARCHITECTURE.md "GPU ranks on different hosts").
TEST(UcxTransportTest, DeviceBuffersReadDeviceToDevice) {
  int devices = 0;
  if (cudaGetDeviceCount(&devices) != cudaSuccess || devices == 0) {
    GTEST_SKIP() << "no CUDA device visible";
  }
  if (!ucx_supports_cuda()) GTEST_SKIP() << "the UCX loaded has no CUDA support";
  ScopedKnob scoped(std::string("on"));
  auto a = create_transport("ucx", options(0));
  auto b = create_transport("ucx", options(1));
  ASSERT_TRUE(a.ok() && b.ok()) << a.status().to_string() << " " << b.status().to_string();
  ASSERT_TRUE((*a)->capabilities().device_buffer_reads);
  constexpr size_t kBytes = (size_t{3} << 20) + 4096;  // Several read chunks and a tail.
  std::vector<uint8_t> pattern(kBytes);
  for (size_t i = 0; i < kBytes; ++i) pattern[i] = static_cast<uint8_t>((i * 131 + 7) >> 3);
  void* src = nullptr;
  void* dst = nullptr;
  ASSERT_EQ(cudaMalloc(&src, kBytes), cudaSuccess);
  ASSERT_EQ(cudaMalloc(&dst, kBytes), cudaSuccess);
  ASSERT_EQ(cudaMemcpy(src, pattern.data(), kBytes, cudaMemcpyHostToDevice), cudaSuccess);
  ASSERT_EQ(cudaMemset(dst, 0, kBytes), cudaSuccess);
  ASSERT_TRUE((*a)->register_buffer(1 << 20, src, kBytes).ok());
  EXPECT_EQ((*a)->read(0, 1 << 20, 0, dst, 16).code(), StatusCode::kUnimplemented);  // Its own.
  ASSERT_TRUE((*a)->connect(1, (*b)->address()).ok());
  ASSERT_TRUE((*b)->connect(0, (*a)->address()).ok());
  std::atomic<bool> done{false};
  std::thread owner([&] {
    while (!done.load()) (*a)->progress();
  });
  constexpr size_t kOffset = 4096 + 64;
  const size_t n = kBytes - kOffset - 100;
  const Status to_device = (*b)->read(0, 1 << 20, kOffset, dst, n);
  std::vector<uint8_t> to_host(n);
  const Status to_host_status = (*b)->read(0, 1 << 20, kOffset, to_host.data(), n);
  const Status past_end = (*b)->read(0, 1 << 20, kBytes - 8, dst, 16);
  done = true;
  owner.join();
  ASSERT_TRUE(to_device.ok()) << to_device.to_string();
  ASSERT_TRUE(to_host_status.ok()) << to_host_status.to_string();
  EXPECT_EQ(past_end.code(), StatusCode::kInvalidArgument) << past_end.to_string();
  std::vector<uint8_t> got(n);
  ASSERT_EQ(cudaMemcpy(got.data(), dst, n, cudaMemcpyDeviceToHost), cudaSuccess);
  const std::vector<uint8_t> want(pattern.begin() + kOffset, pattern.begin() + kOffset + n);
  EXPECT_TRUE(got == want) << "device to device read differs";
  EXPECT_TRUE(to_host == want) << "device to host read differs";
  // Each shutdown waits for the other's goodbye: both at once, each progressing its own.
  Status b_down;
  std::thread closer([&] { b_down = (*b)->shutdown(); });
  EXPECT_TRUE((*a)->shutdown().ok());
  closer.join();
  EXPECT_TRUE(b_down.ok()) << b_down.to_string();
  cudaFree(src);
  cudaFree(dst);
}
#endif

}  // namespace
}  // namespace flexpert
