// SPDX-License-Identifier: Apache-2.0
// CUDA plumbing of the cuda_ipc transport: CUDA errors as Status, and one RAII wrapper per
// handle (a device allocation, an imported IPC mapping, a stream, the current device).
//
// Kept apart from src/cuda on purpose: the transport depends on the CUDA runtime only, never
// on the model's GPU module. Objects are thread-compatible; every call that needs a device
// selects it itself (ScopedDevice), so they may be used from any thread.
#pragma once

#include <cuda_runtime_api.h>

#include <cstddef>
#include <memory>
#include <string>

#include "flexpert/status.h"

namespace flexpert::cuda_ipc {

// "<what>: <CUDA's message> (<error name>)". Out of memory -> ResourceExhausted; no device,
// driver or peer access -> Unavailable; invalid value -> InvalidArgument; else Internal.
Status cuda_status(cudaError_t err, const std::string& what);
inline Status cuda_check(cudaError_t err, const char* what) {
  return err == cudaSuccess ? Status() : cuda_status(err, what);
}

// OK when `device` is a usable CUDA device; Unavailable without a GPU or driver,
// InvalidArgument for an ordinal out of range.
Status check_device(int device);

// Makes `device` the calling thread's current device, and restores the previous one at scope
// exit (callers of the transport keep their own current device).
class ScopedDevice {
 public:
  explicit ScopedDevice(int device);
  ~ScopedDevice();
  ScopedDevice(const ScopedDevice&) = delete;
  ScopedDevice& operator=(const ScopedDevice&) = delete;
  const Status& status() const { return status_; }

 private:
  int previous_ = -1;
  Status status_;
};

// cudaMalloc'd memory on one device, zeroed, exportable to other processes.
class DeviceAllocation {
 public:
  // Synchronous: the memory is zero when this returns.
  static Result<std::unique_ptr<DeviceAllocation>> create(int device, size_t num_bytes);
  ~DeviceAllocation();
  DeviceAllocation(const DeviceAllocation&) = delete;
  DeviceAllocation& operator=(const DeviceAllocation&) = delete;

  std::byte* data() const { return data_; }
  size_t num_bytes() const { return num_bytes_; }
  const cudaIpcMemHandle_t& ipc_handle() const { return handle_; }

 private:
  DeviceAllocation(int device, std::byte* data, size_t num_bytes)
      : device_(device), data_(data), num_bytes_(num_bytes) {}

  int device_;
  std::byte* data_;
  size_t num_bytes_;
  cudaIpcMemHandle_t handle_{};
};

// Another process's allocation mapped into this one (cudaIpcOpenMemHandle); closed on
// destruction. Peer access to another device is enabled lazily by the driver.
class IpcMapping {
 public:
  static Result<std::unique_ptr<IpcMapping>> open(int device, const cudaIpcMemHandle_t& handle);
  ~IpcMapping();
  IpcMapping(const IpcMapping&) = delete;
  IpcMapping& operator=(const IpcMapping&) = delete;

  std::byte* data() const { return data_; }

 private:
  IpcMapping(int device, std::byte* data) : device_(device), data_(data) {}

  int device_;
  std::byte* data_;
};

class Stream {
 public:
  // non_blocking: not ordered with the legacy default stream (cudaStreamNonBlocking).
  static Result<std::unique_ptr<Stream>> create(int device, bool non_blocking);
  ~Stream();
  Stream(const Stream&) = delete;
  Stream& operator=(const Stream&) = delete;

  cudaStream_t get() const { return stream_; }

 private:
  Stream(int device, cudaStream_t stream) : device_(device), stream_(stream) {}

  int device_;
  cudaStream_t stream_;
};

}  // namespace flexpert::cuda_ipc
