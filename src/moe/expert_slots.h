// SPDX-License-Identifier: Apache-2.0
// ExpertSlots: the weight storage of one MoE layer's physical slots.
//
// One contiguous buffer [num_slots][gate | up | down] in the weight dtype,
// allocated once at start for every slot the layer will ever have (capacity,
// not current use), so a transport can register it and weights can be moved
// into free slots without reallocation. gate and up are [I, H], down is [H, I].
// Writes to a slot must not race with reads of the same slot (the caller's
// protocol guarantees it); distinct slots are independent.
#pragma once

#include <cstdint>

#include "flexpert/status.h"
#include "flexpert/tensor.h"

namespace flexpert {

class ExpertSlots {
 public:
  ExpertSlots() = default;
  // Heap storage, zeroed.
  ExpertSlots(DType dtype, int num_slots, int hidden, int intermediate);
  // Storage borrowed from `external` (at least bytes_for() bytes, alive as long as this).
  ExpertSlots(DType dtype, int num_slots, int hidden, int intermediate, void* external);
  static size_t bytes_for(DType dtype, int num_slots, int hidden, int intermediate);

  DType dtype() const { return storage_.dtype(); }
  int num_slots() const { return num_slots_; }
  int hidden() const { return hidden_; }
  int intermediate() const { return intermediate_; }
  size_t slot_bytes() const;  // Bytes of one slot (all three projections).
  void* slot_data(int slot) const;

  Tensor gate(int slot) const;  // Borrowed views into the slot.
  Tensor up(int slot) const;
  Tensor down(int slot) const;

  // Copies one expert's weights (any dtype, converted) into `slot`.
  Status load(int slot, const Tensor& gate, const Tensor& up, const Tensor& down);

 private:
  Tensor part(int slot, int index, Shape shape) const;

  int num_slots_ = 0;
  int hidden_ = 0;
  int intermediate_ = 0;
  Tensor storage_;  // [num_slots, 3 * I * H]
};

}  // namespace flexpert
