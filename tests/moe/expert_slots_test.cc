// SPDX-License-Identifier: Apache-2.0
// ExpertSlots: typed slots (gate | up | down in the weight dtype) and opaque slots (a device's
// byte images, e.g. FP8 with block scales), which only move as bytes.
#include "moe/expert_slots.h"

#include <gtest/gtest.h>

#include <cstring>
#include <vector>

namespace flexpert {
namespace {

TEST(ExpertSlotsTest, TypedSlotsAreThreeProjectionsInTheirDtype) {
  ExpertSlots slots(DType::kBF16, 3, 16, 8);
  EXPECT_FALSE(slots.is_opaque());
  EXPECT_EQ(slots.slot_bytes(), 3u * 16 * 8 * 2);
  EXPECT_EQ(ExpertSlots::bytes_for(DType::kBF16, 3, 16, 8), 3 * slots.slot_bytes());
  EXPECT_EQ(static_cast<char*>(slots.slot_data(2)) - static_cast<char*>(slots.slot_data(0)),
            static_cast<std::ptrdiff_t>(2 * slots.slot_bytes()));
}

// An opaque slot is sized by its byte count, not by dtype * 3 * H * I: an FP8 slot of
// DeepSeek's layout holds 3 I H e4m3 bytes plus scales, rounded up to 256.
TEST(ExpertSlotsTest, OpaqueSlotsAreSizedByTheirBytes) {
  const int num_slots = 3, H = 256, I = 128;
  const size_t slot_bytes = 3 * H * I + 4096 + 256;  // Not a multiple of 3 * H * I.
  std::vector<uint8_t> memory(num_slots * slot_bytes, 0xAB);
  ExpertSlots slots = ExpertSlots::opaque(num_slots, H, I, slot_bytes, memory.data());
  EXPECT_TRUE(slots.is_opaque());
  EXPECT_EQ(slots.num_slots(), num_slots);
  EXPECT_EQ(slots.hidden(), H);
  EXPECT_EQ(slots.intermediate(), I);
  EXPECT_EQ(slots.slot_bytes(), slot_bytes);
  for (int s = 0; s < num_slots; ++s) {
    EXPECT_EQ(slots.slot_data(s), memory.data() + s * slot_bytes) << s;
  }
  // The last slot ends at the buffer's end: a byte copy moves all of it.
  std::memset(slots.slot_data(num_slots - 1), 7, slots.slot_bytes());
  EXPECT_EQ(memory.back(), 7);
  EXPECT_EQ(memory[(num_slots - 1) * slot_bytes - 1], 0xAB);
  // No projections to load into.
  Tensor w = Tensor::zeros(DType::kF32, {I, H});
  Tensor d = Tensor::zeros(DType::kF32, {H, I});
  EXPECT_EQ(slots.load(0, w, w, d).code(), StatusCode::kFailedPrecondition);

  ExpertSlots heap = ExpertSlots::opaque(2, H, I, slot_bytes);
  EXPECT_EQ(heap.slot_bytes(), slot_bytes);
  const auto* bytes = static_cast<const uint8_t*>(heap.slot_data(1));
  EXPECT_EQ(bytes[slot_bytes - 1], 0);  // Zeroed, and the whole slot is there.
}

}  // namespace
}  // namespace flexpert
