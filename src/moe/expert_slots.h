// SPDX-License-Identifier: Apache-2.0
// ExpertSlots: the weight storage of one MoE layer's physical slots.
//
// One contiguous buffer [num_slots][gate | up | down] in the weight dtype,
// allocated once at start for every slot the layer will ever have (capacity,
// not current use), so a transport can register it and weights can be moved
// into free slots without reallocation. gate and up are [I, H], down is [H, I].
// Writes to a slot must not race with reads of the same slot (the caller's
// protocol guarantees it); distinct slots are independent.
// Opaque slots (opaque()) are byte images of a device's own layout (a GPU's FP8 slots with
// their block scales, docs/cuda.md "FP8 experts"): only their bytes are read and moved.
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
  // Opaque slots of slot_bytes each, in `external` (at least num_slots * slot_bytes bytes,
  // alive as long as this), or on the heap, zeroed, when it is null. gate/up/down/load of
  // such slots are bugs (FLEX_CHECK); dtype() is kF8E4M3 (bytes).
  static ExpertSlots opaque(int num_slots, int hidden, int intermediate, size_t slot_bytes,
                            void* external = nullptr);
  bool is_opaque() const { return opaque_slot_bytes_ > 0; }

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
  size_t opaque_slot_bytes_ = 0;  // > 0: opaque slots of this size.
  Tensor storage_;                // [num_slots, 3 * I * H], or opaque [num_slots, slot bytes]
};

}  // namespace flexpert
