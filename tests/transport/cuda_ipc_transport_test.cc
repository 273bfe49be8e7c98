// SPDX-License-Identifier: Apache-2.0
// What only the cuda_ipc backend promises: Unavailable without a GPU (so callers and the
// conformance suite can skip), option checks, its capabilities and layout arithmetic, and
// ranks that share one process (pointers used directly, no IPC import). In-process, two
// transports on two threads where a collective needs a peer. Built with FLEXPERT_WITH_CUDA.
#include <cuda_runtime_api.h>
#include <gtest/gtest.h>
#include <unistd.h>

#include <atomic>
#include <string>
#include <thread>
#include <vector>

#include "transport/cuda_ipc/cuda_ipc_layout.h"
#include "transport/transport.h"

namespace flexpert {
namespace {

std::string unique_session() {
  static std::atomic<int> counter{0};
  return "cipc" + std::to_string(::getpid()) + "x" + std::to_string(counter.fetch_add(1));
}

TransportOptions options_for(const std::string& session, int rank) {
  TransportOptions o;
  o.session = session;
  o.rank = rank;
  o.max_ranks = 2;
  o.max_gather_bytes = 100;
  o.max_exchange_bytes = 5000;
  o.timeout_ms = 5000;
  return o;
}

// Null (and the test skipped by the caller) when this machine has no usable GPU.
std::unique_ptr<Transport> make_or_skip_reason(const TransportOptions& o, std::string* why) {
  auto t = create_transport("cuda_ipc", o);
  if (t.ok()) return std::move(t).value();
  EXPECT_EQ(t.status().code(), StatusCode::kUnavailable) << t.status().to_string();
  *why = t.status().to_string();
  return nullptr;
}

TEST(CudaIpcLayoutTest, SlotsAreAlignedAndDisjoint) {
  auto layout = cuda_ipc::Layout::compute(3, 100, 5000);
  ASSERT_TRUE(layout.ok()) << layout.status().to_string();
  const cuda_ipc::Layout& l = *layout;
  EXPECT_EQ(l.gather_stride, 256u);
  EXPECT_EQ(l.exchange_stride, 5120u);
  EXPECT_EQ(l.slot_offset(false, 2, 7), 5 * 256u);
  EXPECT_EQ(l.exchange_offset, 6 * 256u);
  EXPECT_EQ(l.slot_offset(true, 2, 7) + l.exchange_stride, l.recv_bytes);
  EXPECT_EQ(l.info_offset, l.mailboxes.total_bytes);
  EXPECT_GE(l.total_bytes,
            l.regions_offset + cuda_ipc::kMaxRegions * sizeof(cuda_ipc::RegionEntry));
  EXPECT_EQ(cuda_ipc::Layout::compute(0, 1, 1).status().code(), StatusCode::kInvalidArgument);
}

TEST(CudaIpcTransportTest, UnavailableWithoutGpuElseDeviceMemoryCapabilities) {
  std::string why;
  auto t = make_or_skip_reason(options_for(unique_session(), 0), &why);
  if (t == nullptr) GTEST_SKIP() << "no usable GPU: " << why;
  EXPECT_TRUE(t->capabilities().device_memory);
  EXPECT_TRUE(t->capabilities().one_sided_read);
  EXPECT_FALSE(t->capabilities().cross_host);
  EXPECT_TRUE(t->capabilities().mapped_peer_buffers);
  TransportOptions bad = options_for(unique_session(), 0);
  bad.device = 4096;
  EXPECT_EQ(create_transport("cuda_ipc", bad).status().code(), StatusCode::kInvalidArgument);
  // A shm rank's address is refused (another backend's segment).
  TransportOptions shm_options = options_for(unique_session(), 1);
  auto shm = create_transport("shm", shm_options);
  ASSERT_TRUE(shm.ok());
  EXPECT_EQ(t->connect(1, shm.value()->address()).code(), StatusCode::kInvalidArgument);
  EXPECT_TRUE(shm.value()->shutdown().ok());
  EXPECT_TRUE(t->shutdown().ok());
}

// Two ranks in one process: exchange, all_gather and read through plain device pointers.
TEST(CudaIpcTransportTest, RanksOfOneProcess) {
  const std::string session = unique_session();
  std::string why;
  auto t0 = make_or_skip_reason(options_for(session, 0), &why);
  if (t0 == nullptr) GTEST_SKIP() << "no usable GPU: " << why;
  auto t1 = make_or_skip_reason(options_for(session, 1), &why);
  ASSERT_NE(t1, nullptr);
  ASSERT_TRUE(t0->connect(1, t1->address()).ok());
  ASSERT_TRUE(t1->connect(0, t0->address()).ok());
  std::vector<std::unique_ptr<Transport>*> ts = {&t0, &t1};
  std::vector<std::string> errors(2);
  auto run = [&](int rank) {
    Transport& t = **ts[rank];
    auto fail = [&](const std::string& what) { errors[rank] = what; };
    auto region = t.allocate_region(3, 4000);
    if (!region.ok()) return fail(region.status().to_string());
    std::vector<uint8_t> bytes(4000, static_cast<uint8_t>(0x40 + rank));
    if (cudaMemcpy(region->data, bytes.data(), bytes.size(), cudaMemcpyHostToDevice) != 0) {
      return fail("cudaMemcpy");
    }
    const Group g{1, {0, 1}};
    std::vector<uint8_t> host(3000, static_cast<uint8_t>(rank + 1));
    std::vector<ByteSpan> send(2);
    send[1 - rank] = ByteSpan{host.data(), host.size()};  // Host input: cudaMemcpyDefault.
    auto got = t.exchange(g, send);
    if (!got.ok()) return fail(got.status().to_string());
    if ((*got)[1 - rank].num_bytes != 3000 || (*got)[rank].num_bytes != 0) {
      return fail("exchange sizes");
    }
    std::vector<uint8_t> back(3000);
    if (cudaMemcpy(back.data(), (*got)[1 - rank].data, 3000, cudaMemcpyDeviceToHost) != 0 ||
        back != std::vector<uint8_t>(3000, static_cast<uint8_t>(2 - rank))) {
      return fail("exchange contents");
    }
    if (Status s = t.barrier(g); !s.ok()) return fail(s.to_string());
    std::vector<uint8_t> peer_bytes(10);
    if (Status s = t.read(1 - rank, 3, 3990, peer_bytes.data(), 10); !s.ok()) {
      return fail(s.to_string());
    }
    if (peer_bytes != std::vector<uint8_t>(10, static_cast<uint8_t>(0x41 - rank))) {
      return fail("read contents");
    }
    if (Status s = t.barrier(g); !s.ok()) return fail(s.to_string());
  };
  std::thread other(run, 1);
  run(0);
  other.join();
  EXPECT_EQ(errors[0], "");
  EXPECT_EQ(errors[1], "");
  EXPECT_TRUE(t0->shutdown().ok());
  EXPECT_TRUE(t1->shutdown().ok());
}

// Mapped peer buffers between ranks of one process: the peer's own pointer comes back (CUDA
// cannot import a handle into the process that exported it), host memory is refused, and a
// disconnected peer's buffers are refused while a held mapping stays usable.
TEST(CudaIpcTransportTest, MappedBuffersOfRanksOfOneProcess) {
  const std::string session = unique_session();
  std::string why;
  auto t0 = make_or_skip_reason(options_for(session, 0), &why);
  if (t0 == nullptr) GTEST_SKIP() << "no usable GPU: " << why;
  auto t1 = make_or_skip_reason(options_for(session, 1), &why);
  ASSERT_NE(t1, nullptr);
  ASSERT_TRUE(t0->connect(1, t1->address()).ok());
  void* device = nullptr;
  ASSERT_EQ(cudaMalloc(&device, 1000), cudaSuccess);
  const std::vector<uint8_t> bytes(1000, 0x5a);
  ASSERT_EQ(cudaMemcpy(device, bytes.data(), bytes.size(), cudaMemcpyHostToDevice), cudaSuccess);
  std::vector<uint8_t> host(1000);
  EXPECT_EQ(t1->register_buffer(7, host.data(), host.size()).code(), StatusCode::kInvalidArgument);
  ASSERT_TRUE(t1->register_buffer(7, device, 1000).ok());
  EXPECT_EQ(t0->map_peer_buffer(1, 8, MapMode::kMap).status().code(), StatusCode::kNotFound);
  auto mapped = t0->map_peer_buffer(1, 7, MapMode::kLookup);  // Same process: no import.
  ASSERT_TRUE(mapped.ok()) << mapped.status().to_string();
  EXPECT_EQ(mapped->data, device);
  EXPECT_EQ(mapped->num_bytes, 1000u);
  EXPECT_EQ(mapped->incarnation, 0u);
  ASSERT_EQ(cudaMemcpy(host.data(), mapped->data, host.size(), cudaMemcpyDeviceToHost),
            cudaSuccess);
  EXPECT_EQ(host, bytes);
  ASSERT_TRUE(t0->disconnect(1).ok());
  EXPECT_EQ(t0->map_peer_buffer(1, 7, MapMode::kMap).status().code(), StatusCode::kUnavailable);
  EXPECT_NE(mapped->mapping, nullptr);  // Still held by the caller.
  EXPECT_TRUE(t0->shutdown().ok());
  EXPECT_TRUE(t1->shutdown().ok());
  EXPECT_EQ(cudaFree(device), cudaSuccess);
}

}  // namespace
}  // namespace flexpert
