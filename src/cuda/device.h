// SPDX-License-Identifier: Apache-2.0
// The CUDA device runtime: error wrapping and one RAII wrapper per handle.
//
// FLEX_CUDA_TRY / FLEX_CUBLAS_TRY turn a failed call into a Status naming the
// call (ResourceExhausted for out-of-memory, Internal otherwise). DeviceBuffer
// (cudaMalloc), PinnedBuffer (cudaMallocHost), Stream, Event and GraphExec own
// their handle and free it in the destructor; they are move-only. Nothing here
// synchronises implicitly except where a comment says so. Objects are not
// thread-safe; distinct objects may be used from distinct threads.
#pragma once

#include <cuda_runtime_api.h>

#include <cstddef>
#include <cstdint>
#include <string>
#include <utility>
#include <vector>

#include "flexpert/status.h"
#include "flexpert/tensor.h"

namespace flexpert::cuda {

Status cuda_status(cudaError_t err, const char* what);

// Not OK when this process's CUDA context has failed for good: a sticky error (an illegal
// address or instruction, a failed launch, an uncorrectable ECC error, a failed MPS server),
// which every later call returns. Does not block.
Status context_failure();

// Destroys this process's context on the current device (cudaDeviceReset): nothing of it
// may be used after; a process that only used the GPU for a while gives it up.
void release_device();

// Whether a usable CUDA device exists (false without a driver or GPU).
bool device_available();
int device_count();
// "cuda" -> 0, "cuda:N" -> N; InvalidArgument otherwise or when N is not a device.
Result<int> parse_device(const std::string& spec);

// A GPU memory allocation. Contents are uninitialised unless create_zeroed.
class DeviceBuffer {
 public:
  DeviceBuffer() = default;
  ~DeviceBuffer() { reset(); }
  DeviceBuffer(DeviceBuffer&& o) noexcept { *this = std::move(o); }
  DeviceBuffer& operator=(DeviceBuffer&& o) noexcept;
  DeviceBuffer(const DeviceBuffer&) = delete;
  DeviceBuffer& operator=(const DeviceBuffer&) = delete;

  static Result<DeviceBuffer> create(size_t num_bytes);
  static Result<DeviceBuffer> create_zeroed(size_t num_bytes);

  void* data() const { return data_; }
  template <typename T>
  T* as() const {
    return static_cast<T*>(data_);
  }
  size_t num_bytes() const { return num_bytes_; }
  void reset();

 private:
  void* data_ = nullptr;
  size_t num_bytes_ = 0;
};

// Page-locked host memory: the source or target of asynchronous copies.
class PinnedBuffer {
 public:
  PinnedBuffer() = default;
  ~PinnedBuffer() { reset(); }
  PinnedBuffer(PinnedBuffer&& o) noexcept { *this = std::move(o); }
  PinnedBuffer& operator=(PinnedBuffer&& o) noexcept;
  PinnedBuffer(const PinnedBuffer&) = delete;
  PinnedBuffer& operator=(const PinnedBuffer&) = delete;

  static Result<PinnedBuffer> create(size_t num_bytes);
  void* data() const { return data_; }
  template <typename T>
  T* as() const {
    return static_cast<T*>(data_);
  }
  size_t num_bytes() const { return num_bytes_; }
  void reset();

 private:
  void* data_ = nullptr;
  size_t num_bytes_ = 0;
};

class Stream {
 public:
  Stream() = default;
  ~Stream() { reset(); }
  Stream(Stream&& o) noexcept : stream_(std::exchange(o.stream_, nullptr)) {}
  Stream& operator=(Stream&& o) noexcept;
  Stream(const Stream&) = delete;
  Stream& operator=(const Stream&) = delete;

  static Result<Stream> create();  // Non-blocking with respect to the legacy stream.
  cudaStream_t get() const { return stream_; }
  Status synchronize() const;  // Blocks the calling thread.
  void reset();

 private:
  cudaStream_t stream_ = nullptr;
};

class Event {
 public:
  Event() = default;
  ~Event() { reset(); }
  Event(Event&& o) noexcept : event_(std::exchange(o.event_, nullptr)) {}
  Event& operator=(Event&& o) noexcept;
  Event(const Event&) = delete;
  Event& operator=(const Event&) = delete;

  static Result<Event> create();  // With timing.
  cudaEvent_t get() const { return event_; }
  Status record(cudaStream_t stream) const;
  Status synchronize() const;
  // Milliseconds between two recorded, completed events.
  static Result<float> elapsed_ms(const Event& start, const Event& end);
  void reset();

 private:
  cudaEvent_t event_ = nullptr;
};

// An instantiated CUDA graph, captured from a stream.
class GraphExec {
 public:
  GraphExec() = default;
  ~GraphExec() { reset(); }
  GraphExec(GraphExec&& o) noexcept : exec_(std::exchange(o.exec_, nullptr)) {}
  GraphExec& operator=(GraphExec&& o) noexcept;
  GraphExec(const GraphExec&) = delete;
  GraphExec& operator=(const GraphExec&) = delete;

  // Begins capturing `stream`; the work enqueued until end_capture() becomes the graph.
  static Status begin_capture(cudaStream_t stream);
  static Result<GraphExec> end_capture(cudaStream_t stream);
  // Ends a capture that failed half-way, dropping what was captured.
  static void abandon_capture(cudaStream_t stream);

  bool valid() const { return exec_ != nullptr; }
  Status launch(cudaStream_t stream) const;
  void reset();

 private:
  cudaGraphExec_t exec_ = nullptr;
};

// Makes `device` current for the calling thread.
Status set_device(int device);

// Read plus written bytes per second of a device-to-device copy of `num_bytes` on the
// current device (the best of five after a warm-up): the bandwidth a memory-bound
// kernel can reach, measured rather than taken from a datasheet.
Result<double> copy_bytes_per_s(size_t num_bytes);

// New device buffers filled from the host (synchronous: model loading): raw bytes, a
// tensor converted to `dtype`, or tensors of one width stacked along rows.
Result<DeviceBuffer> upload(const void* data, size_t num_bytes);
Result<DeviceBuffer> upload_tensor(const Tensor& t, DType dtype);
Result<DeviceBuffer> upload_rows(const std::vector<const Tensor*>& parts, DType dtype);

}  // namespace flexpert::cuda

#define FLEX_CUDA_TRY(expr)                                        \
  do {                                                             \
    const cudaError_t flex_cuda_err_ = (expr);                     \
    if (flex_cuda_err_ != cudaSuccess)                             \
      return ::flexpert::cuda::cuda_status(flex_cuda_err_, #expr); \
  } while (0)
