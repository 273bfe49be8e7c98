// SPDX-License-Identifier: Apache-2.0
#include "transport/cuda_ipc/cuda_ipc_runtime.h"

namespace flexpert::cuda_ipc {

Status cuda_status(cudaError_t err, const std::string& what) {
  std::string message = what + ": " + cudaGetErrorString(err) + " (" + cudaGetErrorName(err) + ")";
  switch (err) {
    case cudaErrorMemoryAllocation:
      return resource_exhausted(std::move(message));
    case cudaErrorNoDevice:
    case cudaErrorInsufficientDriver:
    case cudaErrorDevicesUnavailable:
    case cudaErrorPeerAccessUnsupported:
    case cudaErrorNotSupported:
    case cudaErrorSystemDriverMismatch:
    case cudaErrorCompatNotSupportedOnDevice:
      return unavailable(std::move(message));
    case cudaErrorInvalidValue:
    case cudaErrorInvalidDevice:
      return invalid_argument(std::move(message));
    default:
      return internal_error(std::move(message));
  }
}

Status check_device(int device) {
  int count = 0;
  const cudaError_t err = cudaGetDeviceCount(&count);
  if (err != cudaSuccess) {
    (void)cudaGetLastError();
    return unavailable(std::string("no usable CUDA device: cudaGetDeviceCount: ") +
                       cudaGetErrorString(err) + " (" + cudaGetErrorName(err) + ")");
  }
  if (count == 0) return unavailable("no usable CUDA device: none visible");
  if (device < 0 || device >= count) {
    return invalid_argument("CUDA device " + std::to_string(device) + " not in [0, " +
                            std::to_string(count) + ")");
  }
  return Status();
}

ScopedDevice::ScopedDevice(int device) {
  if (cudaError_t err = cudaGetDevice(&previous_); err != cudaSuccess) {
    status_ = cuda_status(err, "cudaGetDevice");
    previous_ = -1;
    return;
  }
  if (previous_ == device) return;
  status_ = cuda_check(cudaSetDevice(device), "cudaSetDevice");
}

ScopedDevice::~ScopedDevice() {
  int current = -1;
  if (previous_ >= 0 && cudaGetDevice(&current) == cudaSuccess && current != previous_) {
    (void)cudaSetDevice(previous_);
  }
}

Result<std::unique_ptr<DeviceAllocation>> DeviceAllocation::create(int device, size_t num_bytes) {
  ScopedDevice scoped(device);
  FLEX_RETURN_IF_ERROR(scoped.status());
  void* data = nullptr;
  if (cudaError_t err = cudaMalloc(&data, num_bytes); err != cudaSuccess) {
    return cuda_status(err, "cudaMalloc (" + std::to_string(num_bytes) + " bytes)");
  }
  std::unique_ptr<DeviceAllocation> a(
      new DeviceAllocation(device, static_cast<std::byte*>(data), num_bytes));
  // NOTE: synchronized, because peers may read it (through their own streams) at once.
  FLEX_RETURN_IF_ERROR(
      cuda_check(cudaMemsetAsync(data, 0, num_bytes, cudaStreamLegacy), "cudaMemsetAsync"));
  FLEX_RETURN_IF_ERROR(
      cuda_check(cudaStreamSynchronize(cudaStreamLegacy), "cudaStreamSynchronize"));
  FLEX_RETURN_IF_ERROR(cuda_check(cudaIpcGetMemHandle(&a->handle_, data), "cudaIpcGetMemHandle"));
  return a;
}

DeviceAllocation::~DeviceAllocation() {
  ScopedDevice scoped(device_);
  (void)cudaFree(data_);  // Errors (a dying runtime at exit) leave nothing to do.
}

Result<std::unique_ptr<IpcMapping>> IpcMapping::open(int device, const cudaIpcMemHandle_t& handle) {
  ScopedDevice scoped(device);
  FLEX_RETURN_IF_ERROR(scoped.status());
  void* data = nullptr;
  if (cudaError_t err = cudaIpcOpenMemHandle(&data, handle, cudaIpcMemLazyEnablePeerAccess);
      err != cudaSuccess) {
    (void)cudaGetLastError();  // Not sticky: clear it so the next call does not see it.
    return cuda_status(err, "cudaIpcOpenMemHandle");
  }
  return std::unique_ptr<IpcMapping>(new IpcMapping(device, static_cast<std::byte*>(data)));
}

IpcMapping::~IpcMapping() {
  ScopedDevice scoped(device_);
  (void)cudaIpcCloseMemHandle(data_);
}

Result<std::unique_ptr<Stream>> Stream::create(int device, bool non_blocking) {
  ScopedDevice scoped(device);
  FLEX_RETURN_IF_ERROR(scoped.status());
  cudaStream_t stream = nullptr;
  FLEX_RETURN_IF_ERROR(cuda_check(
      cudaStreamCreateWithFlags(&stream, non_blocking ? cudaStreamNonBlocking : cudaStreamDefault),
      "cudaStreamCreateWithFlags"));
  return std::unique_ptr<Stream>(new Stream(device, stream));
}

Stream::~Stream() {
  ScopedDevice scoped(device_);
  (void)cudaStreamSynchronize(stream_);
  (void)cudaStreamDestroy(stream_);
}

}  // namespace flexpert::cuda_ipc
