// SPDX-License-Identifier: Apache-2.0
#include "expert_slots.h"

#include <cstring>

#include "flexpert/logging.h"

namespace flexpert {

ExpertSlots::ExpertSlots(DType dtype, int num_slots, int hidden, int intermediate)
    : num_slots_(num_slots),
      hidden_(hidden),
      intermediate_(intermediate),
      storage_(Tensor::zeros(dtype, {num_slots, 3 * static_cast<int64_t>(hidden) * intermediate})) {
}

ExpertSlots::ExpertSlots(DType dtype, int num_slots, int hidden, int intermediate, void* external)
    : num_slots_(num_slots),
      hidden_(hidden),
      intermediate_(intermediate),
      storage_(Tensor::borrow(external, dtype,
                              {num_slots, 3 * static_cast<int64_t>(hidden) * intermediate})) {}

size_t ExpertSlots::bytes_for(DType dtype, int num_slots, int hidden, int intermediate) {
  return 3 * static_cast<size_t>(num_slots) * hidden * intermediate * dtype_size(dtype);
}

ExpertSlots ExpertSlots::opaque(int num_slots, int hidden, int intermediate, size_t slot_bytes,
                                void* external) {
  FLEX_CHECK(slot_bytes > 0);
  ExpertSlots s;
  s.num_slots_ = num_slots;
  s.hidden_ = hidden;
  s.intermediate_ = intermediate;
  s.opaque_slot_bytes_ = slot_bytes;
  const Shape shape = {num_slots, static_cast<int64_t>(slot_bytes)};
  s.storage_ = external != nullptr ? Tensor::borrow(external, DType::kF8E4M3, shape)
                                   : Tensor::zeros(DType::kF8E4M3, shape);
  return s;
}

size_t ExpertSlots::slot_bytes() const {
  if (opaque_slot_bytes_ > 0) return opaque_slot_bytes_;
  return 3 * static_cast<size_t>(hidden_) * intermediate_ * dtype_size(dtype());
}

void* ExpertSlots::slot_data(int slot) const {
  FLEX_CHECK(slot >= 0 && slot < num_slots_) << slot;
  return static_cast<char*>(storage_.raw()) + slot * slot_bytes();
}

Tensor ExpertSlots::part(int slot, int index, Shape shape) const {
  FLEX_CHECK(!is_opaque()) << "the projections of an opaque slot";
  const size_t part_bytes = slot_bytes() / 3;
  return Tensor::borrow(static_cast<char*>(slot_data(slot)) + index * part_bytes, dtype(),
                        std::move(shape));
}

Tensor ExpertSlots::gate(int slot) const { return part(slot, 0, {intermediate_, hidden_}); }
Tensor ExpertSlots::up(int slot) const { return part(slot, 1, {intermediate_, hidden_}); }
Tensor ExpertSlots::down(int slot) const { return part(slot, 2, {hidden_, intermediate_}); }

Status ExpertSlots::load(int slot, const Tensor& gate_w, const Tensor& up_w, const Tensor& down_w) {
  if (slot < 0 || slot >= num_slots_) {
    return invalid_argument("slot " + std::to_string(slot) + " out of range");
  }
  if (is_opaque()) return failed_precondition("opaque slots take no expert weights");
  const Tensor* src[3] = {&gate_w, &up_w, &down_w};
  for (int i = 0; i < 3; ++i) {
    Tensor dst = i == 0 ? gate(slot) : i == 1 ? up(slot) : down(slot);
    if (src[i]->shape() != dst.shape() || !src[i]->is_contiguous()) {
      return invalid_argument("expert weight " + shape_to_string(src[i]->shape()) +
                              " does not fit slot part " + shape_to_string(dst.shape()));
    }
    if (src[i]->dtype() == dst.dtype()) {
      std::memcpy(dst.raw(), src[i]->raw(), dst.num_bytes());
    } else {
      Tensor converted = src[i]->to(dst.dtype());
      std::memcpy(dst.raw(), converted.raw(), dst.num_bytes());
    }
  }
  return Status();
}

}  // namespace flexpert
