// SPDX-License-Identifier: Apache-2.0
// CudaMoeModel: weights as the checkpoint stores them (block FP8 dequantized at load) and
// the routed experts' slot images, bf16 or kept in FP8 (docs/cuda.md, "FP8 experts"), for
// every CUDA MoE model.
#include <string>
#include <vector>

#include "cuda/cuda_moe_model.h"
#include "cuda/fp8_experts.h"

namespace flexpert::cuda {
namespace {

// One projection of an FP8 expert as the checkpoint stores it: e4m3 codes and f32 scales.
Status read_fp8(const Checkpoint& ck, const std::string& name, int64_t rows, int64_t cols,
                Tensor* codes, std::vector<float>* scales) {
  FLEX_ASSIGN_OR_RETURN(*codes, ck.get(name, {rows, cols}));
  if (codes->dtype() != DType::kF8E4M3) {
    return invalid_argument(name + " is " + std::string(dtype_name(codes->dtype())) +
                            ", not F8_E4M3 (--quantization fp8)");
  }
  const int64_t n = fp8_blocks(rows) * fp8_blocks(cols);
  FLEX_ASSIGN_OR_RETURN(Tensor s,
                        ck.get(name + "_scale_inv", {fp8_blocks(rows), fp8_blocks(cols)}));
  const Tensor s32 = s.to(DType::kF32);
  scales->assign(s32.data<float>(), s32.data<float>() + n);
  return Status();
}

// The slot image of one expert straight from the checkpoint when it stores `dtype`: gate and
// up read in blocks of 8 rows into their interleaved rows, down whole (pack_expert's layout,
// one pread per block and no conversion: pack_expert's round trip through f32 keeps every
// value of an equal dtype). False, having read nothing, when a dtype differs.
Result<bool> read_expert_image(const Checkpoint& ck, const std::string& ep, int64_t H, int64_t I,
                               DType dtype, uint8_t* image) {
  const std::string names[3] = {ep + "gate_proj.weight", ep + "up_proj.weight",
                                ep + "down_proj.weight"};
  const Shape shapes[3] = {{I, H}, {I, H}, {H, I}};
  for (int p = 0; p < 3; ++p) {
    FLEX_ASSIGN_OR_RETURN(SafetensorsFile::Entry e, ck.entry(names[p], shapes[p]));
    if (e.dtype != dtype) return false;
  }
  const uint64_t row_bytes = static_cast<uint64_t>(H) * dtype_size(dtype);
  const int64_t num_blocks = I / 8;  // MoeDims::validate(): I % 8 == 0.
  std::vector<SafetensorsFile::ReadPiece> gate(num_blocks), up(num_blocks);
  for (int64_t b = 0; b < num_blocks; ++b) {
    gate[b] = {8 * b * row_bytes, 8 * row_bytes, image + 16 * b * row_bytes};
    up[b] = {8 * b * row_bytes, 8 * row_bytes, image + (16 * b + 8) * row_bytes};
  }
  FLEX_RETURN_IF_ERROR(ck.read_into(names[0], gate));
  FLEX_RETURN_IF_ERROR(ck.read_into(names[1], up));
  const uint64_t down_bytes = static_cast<uint64_t>(H) * I * dtype_size(dtype);
  FLEX_RETURN_IF_ERROR(ck.read_into(names[2], {{0, down_bytes, image + 2 * I * row_bytes}}));
  return true;
}

}  // namespace

Result<Tensor> CudaMoeModel::weight(const std::string& name, const Shape& shape) const {
  return checkpoint_->get_weight(name, shape, config_.weight_block_size);
}

Status CudaMoeModel::init_fp8_experts(const ModelOptions& options) {
  if (options.quantization != "fp8") return Status();
  const ModelConfig& c = config_;
  const std::vector<int> block =
      c.weight_block_size.empty() ? std::vector<int>{128, 128} : c.weight_block_size;
  if (c.quant_method != "fp8") {
    return invalid_argument(
        "--quantization fp8: the checkpoint is not block-FP8 (config.json "
        "has no fp8 quantization_config)");
  }
  if (block != std::vector<int>{kFp8BlockSize, kFp8BlockSize}) {
    return unimplemented("--quantization fp8: FP8 experts need 128 x 128 scale blocks");
  }
  if (dtype_ != DType::kBF16) {
    return invalid_argument("--quantization fp8 computes in bf16 (not --cuda-dtype f32)");
  }
  if (!fp8_device_supported(device_)) {
    return failed_precondition(
        "--quantization fp8 needs a GPU of compute capability 8.9 or newer (Ada, Hopper); use "
        "--quantization bf16 on this one");
  }
  moe_dims_.fp8 = true;
  return moe_dims_.validate();
}

Status CudaMoeModel::pack_slot(int layer, int expert, uint8_t* image) const {
  const int64_t H = config_.hidden_size, I = config_.moe_intermediate_size;
  const std::string ep =
      "model.layers." + std::to_string(layer) + ".mlp.experts." + std::to_string(expert) + ".";
  if (moe_dims_.fp8) {  // The checkpoint's bytes, not dequantized.
    Tensor gate, up, down;
    std::vector<float> gs, us, ds;
    FLEX_RETURN_IF_ERROR(read_fp8(*checkpoint_, ep + "gate_proj.weight", I, H, &gate, &gs));
    FLEX_RETURN_IF_ERROR(read_fp8(*checkpoint_, ep + "up_proj.weight", I, H, &up, &us));
    FLEX_RETURN_IF_ERROR(read_fp8(*checkpoint_, ep + "down_proj.weight", H, I, &down, &ds));
    pack_expert_fp8(Fp8Expert{gate.data<uint8_t>(), up.data<uint8_t>(), down.data<uint8_t>(),
                              gs.data(), us.data(), ds.data()},
                    static_cast<int>(H), static_cast<int>(I), image);
    return Status();
  }
  FLEX_ASSIGN_OR_RETURN(bool read, read_expert_image(*checkpoint_, ep, H, I, dtype_, image));
  if (read) return Status();
  // FP8 experts come back dequantized to BF16; pack_expert converts to the compute dtype.
  FLEX_ASSIGN_OR_RETURN(Tensor gate, weight(ep + "gate_proj.weight", {I, H}));
  FLEX_ASSIGN_OR_RETURN(Tensor up, weight(ep + "up_proj.weight", {I, H}));
  FLEX_ASSIGN_OR_RETURN(Tensor down, weight(ep + "down_proj.weight", {H, I}));
  const Tensor g32 = gate.to(DType::kF32), u32 = up.to(DType::kF32), d32 = down.to(DType::kF32);
  pack_expert(g32.data<float>(), u32.data<float>(), d32.data<float>(), static_cast<int>(H),
              static_cast<int>(I), dtype_, image);
  return Status();
}

}  // namespace flexpert::cuda
