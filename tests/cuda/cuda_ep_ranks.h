// SPDX-License-Identifier: Apache-2.0
// Two expert-parallel ranks of one process (a thread each), as the CUDA EP tests set them up
// (cuda_ep_test.cc, cuda_fp8_ep_test.cc): per rank a transport with host collectives, as a GPU
// worker's (collectives in host memory, peers' buffers mapped through the transport; ranks of
// one process get each other's pointers), wrapped in a FaultInjectingTransport (collective
// counts, faults); an EpMoeExecutor in epoch 1 of ranks {0, 1}; the model with its half of the
// slots, every graph captured up front (Model::warm_up, as a worker does before serving).
// A failed step of the setup is a test failure and leaves `ready` false.
#pragma once

#include <gtest/gtest.h>
#include <unistd.h>

#include <cstdlib>
#include <functional>
#include <memory>
#include <string>

#include "flexpert/model.h"
#include "flexpert/thread_pool.h"
#include "moe/ep_executor.h"
#include "transport/fault_injecting_transport.h"

namespace flexpert::cuda_test {

// Ranks of one process wait for each other in kernels on their own streams, so (set before
// anything initialises CUDA): kernels load at start-up, not lazily at first launch (loading
// one waits for the kernels running in the context, among them the other rank's spinning
// wait: a deadlock until the timeout, seen on the H200), and the streams get hardware queues
// of their own.
inline const bool kEpQueues = setenv("CUDA_MODULE_LOADING", "EAGER", 0) == 0 &&
                              setenv("CUDA_DEVICE_MAX_CONNECTIONS", "32", 0) == 0;

struct EpRanksOptions {
  std::string session;  // Transport session (the process id is appended).
  int slots_per_rank = 0;
  size_t max_exchange_bytes = 0;
  int timeout_ms = 20000;
  std::string backend = "cuda_ipc";
  // Set: wraps each rank's transport (inside the FaultInjectingTransport).
  std::function<std::unique_ptr<Transport>(std::unique_ptr<Transport>)> wrap = nullptr;
};

struct TwoEpRanks {
  static constexpr int kRanks = 2;

  // Both ranks load `dir` with `model`; rank r holds slots [r * slots_per_rank, ...).
  TwoEpRanks(const std::string& dir, const ModelOptions& model, const EpRanksOptions& o) {
    for (int r = 0; r < kRanks; ++r) {
      TransportOptions t;
      t.session = o.session + "-" + std::to_string(getpid());
      t.rank = r;
      t.max_ranks = kRanks;
      t.max_exchange_bytes = o.max_exchange_bytes;
      t.timeout_ms = o.timeout_ms;
      t.host_collectives = true;
      auto created = create_transport(o.backend, t);
      EXPECT_TRUE(created.ok()) << created.status().to_string();
      if (!created.ok()) return;
      std::unique_ptr<Transport> inner = std::move(created).value();
      if (o.wrap) inner = o.wrap(std::move(inner));
      transports[r] = std::make_unique<FaultInjectingTransport>(std::move(inner));
    }
    for (int r = 0; r < kRanks; ++r) {
      for (int p = 0; p < kRanks; ++p) {
        if (p != r) {
          EXPECT_TRUE(transports[r]->connect(p, transports[p]->address()).ok());
        }
      }
    }
    for (int r = 0; r < kRanks; ++r) {
      executors[r] = std::make_unique<EpMoeExecutor>(*transports[r], o.slots_per_rank, pool);
      executors[r]->set_group(Group{1, {0, 1}});
      ModelOptions options = model;
      options.first_slot = r * o.slots_per_rank;
      options.num_local_slots = o.slots_per_rank;
      options.moe_executor = executors[r].get();
      auto loaded = Model::load(dir, options);
      EXPECT_TRUE(loaded.ok()) << loaded.status().to_string();
      if (!loaded.ok()) return;
      models[r] = std::move(loaded).value();
      const Status warm = models[r]->warm_up();
      EXPECT_TRUE(warm.ok()) << warm.to_string();
      if (!warm.ok()) return;
    }
    ready = kEpQueues;
  }
  ~TwoEpRanks() {
    for (auto& m : models) m.reset();
    for (auto& t : transports) {
      if (t != nullptr) (void)t->shutdown();
    }
  }
  TwoEpRanks(const TwoEpRanks&) = delete;
  TwoEpRanks& operator=(const TwoEpRanks&) = delete;

  ThreadPool pool{1};
  std::unique_ptr<FaultInjectingTransport> transports[kRanks];
  std::unique_ptr<EpMoeExecutor> executors[kRanks];
  std::unique_ptr<Model> models[kRanks];
  bool ready = false;
};

}  // namespace flexpert::cuda_test
