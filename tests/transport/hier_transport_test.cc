// SPDX-License-Identifier: Apache-2.0
// HierTransport's routing, which the conformance suites (same results whichever backend
// carries a pair) cannot see: three ranks in one process, one thread each, ranks 0 and 1 on
// host "a" and rank 2 on host "b" (FLEXPERT_HOST_ID at create). Each rank counts the bytes it
// sent and read per backend; the expected counts follow from the payload sizes alone. Also
// the address format and its errors, and GPU ranks (host_collectives: cuda_ipc within a host),
// whose peers' buffers map on their host only (skipped without a GPU).
#include "transport/hier/hier_transport.h"

#include <gtest/gtest.h>
#include <unistd.h>

#include <cstdlib>
#include <cstring>
#include <functional>
#include <string>
#include <thread>
#include <vector>

#ifdef FLEXPERT_TEST_WITH_CUDA
#include <cuda_runtime.h>
#endif

namespace flexpert {
namespace {

constexpr int kRanks = 3;
constexpr size_t kRegionBytes = 4096;

TransportOptions options(int rank) {
  TransportOptions o;
  o.session = "hierunit" + std::to_string(::getpid());
  o.rank = rank;
  o.max_ranks = 4;  // Rank 3 never joins.
  o.timeout_ms = 5000;
  return o;
}

std::unique_ptr<HierTransport> make(int rank, const char* host, bool gpu = false) {
  ::setenv("FLEXPERT_HOST_ID", host, 1);
  TransportOptions o = options(rank);
  o.host_collectives = gpu;  // As a GPU worker creates it (device 0).
  auto created = HierTransport::create(o);
  ::unsetenv("FLEXPERT_HOST_ID");
  EXPECT_TRUE(created.ok()) << created.status().to_string();
  return created.ok() ? std::move(created).value() : nullptr;
}

// Bytes rank `from` sends rank `to` in exchange round `round`: sizes differ per pair.
std::vector<std::byte> payload(int from, int to, int round) {
  std::vector<std::byte> out(static_cast<size_t>(100 + 37 * from + 11 * to + round));
  for (size_t i = 0; i < out.size(); ++i) {
    out[i] = static_cast<std::byte>((from * 31 + to * 7 + round + static_cast<int>(i)) & 0xff);
  }
  return out;
}

// Runs fn(rank) on one thread per rank; the result of each.
std::vector<Status> on_all(const std::function<Status(int)>& fn) {
  std::vector<Status> results(kRanks);
  std::vector<std::thread> threads;
  for (int r = 0; r < kRanks; ++r) threads.emplace_back([&, r] { results[r] = fn(r); });
  for (auto& t : threads) t.join();
  return results;
}

Status exchange_round(HierTransport& t, const Group& group, int round) {
  const int me = t.rank();
  std::vector<std::vector<std::byte>> bufs(4);
  std::vector<ByteSpan> send(4);
  for (int r : group.ranks) {
    bufs[r] = payload(me, r, round);
    send[r] = {bufs[r].data(), bufs[r].size()};
  }
  FLEX_ASSIGN_OR_RETURN(std::vector<ByteSpan> got, t.exchange(group, send));
  for (int r : group.ranks) {
    const std::vector<std::byte> want = payload(r, me, round);
    if (got[r].num_bytes != want.size() || std::memcmp(got[r].data, want.data(), want.size())) {
      return internal_error("rank " + std::to_string(me) + ": wrong bytes from rank " +
                            std::to_string(r) + " in round " + std::to_string(round));
    }
  }
  return Status();
}

TEST(HierTransportTest, SameHostPairsUseShmOthersUcx) {
  std::vector<std::unique_ptr<HierTransport>> t;
  t.push_back(make(0, "a"));
  t.push_back(make(1, "a"));
  t.push_back(make(2, "b"));
  for (const auto& x : t) ASSERT_NE(x, nullptr);
  for (int r = 0; r < kRanks; ++r) {
    auto region = t[r]->allocate_region(7, kRegionBytes);
    ASSERT_TRUE(region.ok()) << region.status().to_string();
    std::memset(region->data, 0x40 + r, kRegionBytes);
  }
  for (int r = 0; r < kRanks; ++r) {
    for (int p = 0; p < kRanks; ++p) {
      ASSERT_TRUE(t[r]->connect(p, t[p]->address()).ok()) << r << " -> " << p;
    }
  }
  EXPECT_TRUE(t[0]->same_host(1));
  EXPECT_FALSE(t[0]->same_host(2));
  EXPECT_FALSE(t[2]->same_host(1));

  // Epoch 1: all three (spans hosts). Epoch 2: ranks 0 and 1 (one host: shm only).
  const Group all{1, {0, 1, 2}};
  const Group host_a{2, {0, 1}};
  constexpr size_t kReadBytes = 1000;
  for (const Status& s : on_all([&](int r) -> Status {
         HierTransport& me = *t[r];
         for (int round = 0; round < 3; ++round)
           FLEX_RETURN_IF_ERROR(exchange_round(me, all, round));
         // Every rank reads every other's region, at an offset of its rank.
         for (int p = 0; p < kRanks; ++p) {
           if (p == r) continue;
           std::vector<unsigned char> dst(kReadBytes);
           FLEX_RETURN_IF_ERROR(me.read(p, 7, static_cast<size_t>(r), dst.data(), dst.size()));
           for (unsigned char c : dst) {
             if (c != 0x40 + p) return internal_error("read of rank " + std::to_string(p));
           }
         }
         FLEX_RETURN_IF_ERROR(me.barrier(all));  // Owners progress while peers read them.
         if (r == 2) return Status();
         for (int round = 3; round < 5; ++round) {
           FLEX_RETURN_IF_ERROR(exchange_round(me, host_a, round));
         }
         return Status();
       })) {
    EXPECT_TRUE(s.ok()) << s.to_string();
  }

  // Independent of the transport: what each pair sent and read, by the pair's hosts.
  auto same = [](int a, int b) { return (a < 2) == (b < 2); };
  for (int r = 0; r < kRanks; ++r) {
    uint64_t want_shm = 0;
    uint64_t want_ucx = 0;
    for (int p = 0; p < kRanks; ++p) {
      if (p == r) continue;
      uint64_t n = kReadBytes;
      for (int round = 0; round < 3; ++round) n += payload(r, p, round).size();
      if (r < 2 && p < 2) {
        for (int round = 3; round < 5; ++round) n += payload(r, p, round).size();
      }
      (same(r, p) ? want_shm : want_ucx) += n;
    }
    const HierTransport::Stats st = t[r]->stats();
    EXPECT_EQ(st.shm_bytes, want_shm) << "rank " << r;
    EXPECT_EQ(st.ucx_bytes, want_ucx) << "rank " << r;
  }
  for (const Status& s : on_all([&](int r) { return t[r]->shutdown(); })) {
    EXPECT_TRUE(s.ok()) << s.to_string();
  }
}

TEST(HierTransportTest, AddressesAndConnectErrors) {
  std::unique_ptr<HierTransport> t = make(1, "host|x");
  ASSERT_NE(t, nullptr);
  EXPECT_EQ(t->address().rfind("hier:host_x|", 0), 0u) << t->address();  // '|' is the separator.
  EXPECT_TRUE(t->capabilities().cross_host && t->capabilities().one_sided_read);
  // CPU ranks: shm within the host, which maps no peer buffers.
  EXPECT_STREQ(t->local_backend(), "shm");
  EXPECT_FALSE(t->capabilities().mapped_peer_buffers);
  int word = 0;
  EXPECT_EQ(t->register_buffer(100, &word, sizeof(word)).code(), StatusCode::kUnimplemented);
  EXPECT_EQ(t->map_peer_buffer(1, 100, MapMode::kMap).status().code(), StatusCode::kUnimplemented);
  EXPECT_TRUE(t->connect(1, t->address()).ok());  // Itself: a no-op.
  EXPECT_EQ(t->connect(2, "ucx:///r2/i0/p1/t1/wAAAA").code(), StatusCode::kInvalidArgument);
  EXPECT_EQ(t->connect(2, "hier:host_x|/flexpert-s-r2-i0").code(), StatusCode::kInvalidArgument);
  EXPECT_EQ(t->connect(2, "hier:|a|b").code(), StatusCode::kInvalidArgument);
  EXPECT_EQ(t->connect(7, t->address()).code(), StatusCode::kInvalidArgument);
  EXPECT_EQ(t->barrier(Group{1, {1, 2}}).code(), StatusCode::kFailedPrecondition);
  EXPECT_TRUE(t->barrier(Group{1, {1}}).ok());
  ASSERT_TRUE(t->shutdown().ok());
  EXPECT_EQ(t->barrier(Group{1, {1}}).code(), StatusCode::kFailedPrecondition);
}

#ifdef FLEXPERT_TEST_WITH_CUDA
// GPU ranks (as Worker::load makes them): cuda_ipc within a host. Rank 0 maps the buffer rank 1
// (host a) registered and reads what rank 1 wrote there through the mapping; rank 2's (host b)
// answers Unimplemented, which the device exchange and slot copies take as "use the host
// path". Regions, reads and collectives carry host memory on both backends as on CPU ranks.
TEST(HierTransportTest, GpuRanksMapBuffersOfTheirHostOnly) {
  int num_devices = 0;
  if (cudaGetDeviceCount(&num_devices) != cudaSuccess || num_devices == 0) {
    GTEST_SKIP() << "no CUDA device visible: GPU test skipped (runs on a GPU host)";
  }
  constexpr int kBuffer = 100;
  std::vector<std::unique_ptr<HierTransport>> t;
  t.push_back(make(0, "a", true));
  t.push_back(make(1, "a", true));
  t.push_back(make(2, "b", true));
  for (const auto& x : t) ASSERT_NE(x, nullptr);
  std::vector<void*> device(kRanks, nullptr);
  for (int r = 0; r < kRanks; ++r) {
    EXPECT_STREQ(t[r]->local_backend(), "cuda_ipc");
    EXPECT_TRUE(t[r]->capabilities().mapped_peer_buffers);
    EXPECT_FALSE(t[r]->capabilities().device_memory);  // Regions are host memory.
    auto region = t[r]->allocate_region(7, kRegionBytes);
    ASSERT_TRUE(region.ok()) << region.status().to_string();
    std::memset(region->data, 0x40 + r, kRegionBytes);  // A host pointer.
    ASSERT_EQ(cudaMalloc(&device[r], kRegionBytes), cudaSuccess);
    ASSERT_EQ(cudaMemset(device[r], 0x60 + r, kRegionBytes), cudaSuccess);
    ASSERT_TRUE(t[r]->register_buffer(kBuffer, device[r], kRegionBytes).ok());
  }
  ASSERT_EQ(cudaDeviceSynchronize(), cudaSuccess);
  for (int r = 0; r < kRanks; ++r) {
    for (int p = 0; p < kRanks; ++p) {
      ASSERT_TRUE(t[r]->connect(p, t[p]->address()).ok()) << r << " -> " << p;
    }
  }
  auto device_bytes = [](const PeerBuffer& b) {
    std::vector<unsigned char> host(b.num_bytes);
    EXPECT_EQ(cudaMemcpy(host.data(), b.data, host.size(), cudaMemcpyDeviceToHost), cudaSuccess);
    return host;
  };
  for (int r = 0; r < kRanks; ++r) {
    for (int p = 0; p < kRanks; ++p) {
      Result<PeerBuffer> mapped = t[r]->map_peer_buffer(p, kBuffer, MapMode::kMap);
      if ((r < 2) != (p < 2)) {
        EXPECT_EQ(mapped.status().code(), StatusCode::kUnimplemented)
            << r << " -> " << p << ": " << mapped.status().to_string();
        continue;
      }
      ASSERT_TRUE(mapped.ok()) << r << " -> " << p << ": " << mapped.status().to_string();
      ASSERT_EQ(mapped->num_bytes, kRegionBytes);
      for (unsigned char c : device_bytes(*mapped)) ASSERT_EQ(c, 0x60 + p) << r << " -> " << p;
    }
  }
  // Host data as before: an exchange across hosts, reads of a host mate (shm) and of host b.
  const Group all{1, {0, 1, 2}};
  for (const Status& s : on_all([&](int r) -> Status {
         FLEX_RETURN_IF_ERROR(exchange_round(*t[r], all, 0));
         for (int p = 0; p < kRanks; ++p) {
           std::vector<unsigned char> dst(64);
           FLEX_RETURN_IF_ERROR(t[r]->read(p, 7, 0, dst.data(), dst.size()));
           for (unsigned char c : dst) {
             if (c != 0x40 + p) return internal_error("read of rank " + std::to_string(p));
           }
         }
         return t[r]->barrier(all);
       })) {
    EXPECT_TRUE(s.ok()) << s.to_string();
  }
  for (int r = 0; r < kRanks; ++r) {
    const HierTransport::Stats st = t[r]->stats();
    EXPECT_EQ(st.buffers_mapped, r < 2 ? 1u : 0u) << "rank " << r;  // The host mate's.
    EXPECT_EQ(st.buffers_refused, r < 2 ? 1u : 2u) << "rank " << r;
    EXPECT_GT(st.ucx_bytes, 0u) << "rank " << r;
  }
  for (const Status& s : on_all([&](int r) { return t[r]->shutdown(); })) {
    EXPECT_TRUE(s.ok()) << s.to_string();
  }
  for (void* p : device) cudaFree(p);
}
#else
TEST(HierTransportTest, GpuRanksNeedTheCudaIpcBackend) {
  TransportOptions o = options(0);
  o.host_collectives = true;
  EXPECT_EQ(HierTransport::create(o).status().code(), StatusCode::kUnimplemented);
}
#endif

TEST(HierTransportTest, HostIdIsTheEnvironmentsOrHostAndNetworkNamespace) {
  ::setenv("FLEXPERT_HOST_ID", "rack3-node7", 1);
  EXPECT_EQ(local_host_id(), "rack3-node7");
  ::unsetenv("FLEXPERT_HOST_ID");
  char name[256] = {};
  ASSERT_EQ(::gethostname(name, sizeof(name) - 1), 0);
  const std::string id = local_host_id();
  EXPECT_EQ(id.rfind(std::string(name) + "/netns:", 0), 0u) << id;
}

}  // namespace
}  // namespace flexpert
