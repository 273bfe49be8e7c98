// SPDX-License-Identifier: Apache-2.0
// Which device each rank of a serving group runs on (`serve --device cuda --gpus N`).
#include <gtest/gtest.h>

#include "serve/cluster_engine.h"

namespace flexpert {
namespace {

TEST(RankDeviceTest, SpreadsCudaRanksOverTheGpus) {
  ClusterOptions options;
  EXPECT_EQ(rank_device(options, 3), "cpu");
  options.device = "cuda";
  EXPECT_EQ(rank_device(options, 3), "cuda") << "one GPU: every rank on the default one";
  options.gpus = 2;
  EXPECT_EQ(rank_device(options, 0), "cuda:0");
  EXPECT_EQ(rank_device(options, 1), "cuda:1");
  EXPECT_EQ(rank_device(options, 2), "cuda:0");
  EXPECT_EQ(rank_device(options, 7), "cuda:1");
  options.gpus = 8;
  EXPECT_EQ(rank_device(options, 13), "cuda:5");
  options.device = "cuda:1";  // A fixed device stays as given.
  EXPECT_EQ(rank_device(options, 0), "cuda:1");
}

}  // namespace
}  // namespace flexpert
