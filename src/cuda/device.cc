// SPDX-License-Identifier: Apache-2.0
#include "cuda/device.h"

#include <cuda_runtime.h>

#include <algorithm>
#include <string>

#include "flexpert/logging.h"

namespace flexpert::cuda {

Status cuda_status(cudaError_t err, const char* what) {
  if (err == cudaSuccess) return Status();
  std::string msg =
      std::string(what) + ": " + cudaGetErrorName(err) + " (" + cudaGetErrorString(err) + ")";
  if (err == cudaErrorMemoryAllocation) return resource_exhausted(std::move(msg));
  return internal_error(std::move(msg));
}

int device_count() {
  int n = 0;
  if (cudaGetDeviceCount(&n) != cudaSuccess) {
    (void)cudaGetLastError();  // Clear the sticky "no device" error.
    return 0;
  }
  return n;
}

namespace {

bool sticky(cudaError_t e) {
  switch (e) {
    case cudaErrorIllegalAddress:
    case cudaErrorLaunchFailure:
    case cudaErrorIllegalInstruction:
    case cudaErrorMisalignedAddress:
    case cudaErrorInvalidAddressSpace:
    case cudaErrorInvalidPc:
    case cudaErrorHardwareStackError:
    case cudaErrorAssert:
    case cudaErrorLaunchTimeout:
    case cudaErrorECCUncorrectable:
    case cudaErrorMpsServerNotReady:
    case cudaErrorMpsConnectionFailed:
    case cudaErrorMpsRpcFailure:
    case cudaErrorMpsClientTerminated:
    case cudaErrorContextIsDestroyed:
    case cudaErrorDevicesUnavailable:
      return true;
    default:
      return false;
  }
}

}  // namespace

Status context_failure() {
  // The last error may be an ordinary one (a bad argument) while the context has failed
  // since: the stream query returns a sticky error whatever came before.
  for (const cudaError_t e : {cudaPeekAtLastError(), cudaStreamQuery(nullptr)}) {
    if (sticky(e)) return cuda_status(e, "the CUDA context");
  }
  return Status();
}

void release_device() { (void)cudaDeviceReset(); }

bool device_available() { return device_count() > 0; }

Result<int> parse_device(const std::string& spec) {
  int index = 0;
  if (spec == "cuda") {
    index = 0;
  } else if (spec.rfind("cuda:", 0) == 0 && spec.size() > 5) {
    const std::string digits = spec.substr(5);
    if (digits.find_first_not_of("0123456789") != std::string::npos || digits.size() > 4) {
      return invalid_argument("device '" + spec + "': expected cuda or cuda:N");
    }
    index = std::stoi(digits);
  } else {
    return invalid_argument("device '" + spec + "': expected cpu, cuda or cuda:N");
  }
  const int n = device_count();
  if (index >= n) {
    return invalid_argument("device '" + spec + "': " + std::to_string(n) +
                            " CUDA device(s) visible");
  }
  return index;
}

Status set_device(int device) { return cuda_status(cudaSetDevice(device), "cudaSetDevice"); }

Result<double> copy_bytes_per_s(size_t num_bytes) {
  FLEX_ASSIGN_OR_RETURN(DeviceBuffer a, DeviceBuffer::create_zeroed(num_bytes));
  FLEX_ASSIGN_OR_RETURN(DeviceBuffer b, DeviceBuffer::create(num_bytes));
  FLEX_ASSIGN_OR_RETURN(Stream stream, Stream::create());
  FLEX_ASSIGN_OR_RETURN(Event start, Event::create());
  FLEX_ASSIGN_OR_RETURN(Event end, Event::create());
  double best = 0;
  for (int i = 0; i < 6; ++i) {
    FLEX_RETURN_IF_ERROR(start.record(stream.get()));
    FLEX_CUDA_TRY(
        cudaMemcpyAsync(b.data(), a.data(), num_bytes, cudaMemcpyDeviceToDevice, stream.get()));
    FLEX_RETURN_IF_ERROR(end.record(stream.get()));
    FLEX_RETURN_IF_ERROR(end.synchronize());
    FLEX_ASSIGN_OR_RETURN(float ms, Event::elapsed_ms(start, end));
    if (i > 0 && ms > 0) best = std::max(best, 2.0 * static_cast<double>(num_bytes) / (ms * 1e-3));
  }
  return best;
}

DeviceBuffer& DeviceBuffer::operator=(DeviceBuffer&& o) noexcept {
  if (this != &o) {
    reset();
    data_ = std::exchange(o.data_, nullptr);
    num_bytes_ = std::exchange(o.num_bytes_, 0);
  }
  return *this;
}

Result<DeviceBuffer> DeviceBuffer::create(size_t num_bytes) {
  DeviceBuffer b;
  if (num_bytes > 0) {
    FLEX_CUDA_TRY(cudaMalloc(&b.data_, num_bytes));
  }
  b.num_bytes_ = num_bytes;
  return b;
}

Result<DeviceBuffer> DeviceBuffer::create_zeroed(size_t num_bytes) {
  FLEX_ASSIGN_OR_RETURN(DeviceBuffer b, create(num_bytes));
  if (num_bytes > 0) {
    FLEX_CUDA_TRY(cudaMemset(b.data_, 0, num_bytes));
    // NOTE: cudaMemset is asynchronous on the legacy stream, which non-blocking
    // streams do not wait for: finish it before the buffer is handed out.
    FLEX_CUDA_TRY(cudaStreamSynchronize(nullptr));
  }
  return b;
}

void DeviceBuffer::reset() {
  if (data_ != nullptr) {
    const cudaError_t err = cudaFree(data_);
    if (err != cudaSuccess) FLEX_LOG(WARN) << "cudaFree: " << cudaGetErrorString(err);
  }
  data_ = nullptr;
  num_bytes_ = 0;
}

PinnedBuffer& PinnedBuffer::operator=(PinnedBuffer&& o) noexcept {
  if (this != &o) {
    reset();
    data_ = std::exchange(o.data_, nullptr);
    num_bytes_ = std::exchange(o.num_bytes_, 0);
  }
  return *this;
}

Result<PinnedBuffer> PinnedBuffer::create(size_t num_bytes) {
  PinnedBuffer b;
  if (num_bytes > 0) FLEX_CUDA_TRY(cudaMallocHost(&b.data_, num_bytes));
  b.num_bytes_ = num_bytes;
  return b;
}

void PinnedBuffer::reset() {
  if (data_ != nullptr) (void)cudaFreeHost(data_);
  data_ = nullptr;
  num_bytes_ = 0;
}

Stream& Stream::operator=(Stream&& o) noexcept {
  if (this != &o) {
    reset();
    stream_ = std::exchange(o.stream_, nullptr);
  }
  return *this;
}

Result<Stream> Stream::create() {
  Stream s;
  FLEX_CUDA_TRY(cudaStreamCreateWithFlags(&s.stream_, cudaStreamNonBlocking));
  return s;
}

Status Stream::synchronize() const {
  return cuda_status(cudaStreamSynchronize(stream_), "cudaStreamSynchronize");
}

void Stream::reset() {
  if (stream_ != nullptr) (void)cudaStreamDestroy(stream_);
  stream_ = nullptr;
}

Event& Event::operator=(Event&& o) noexcept {
  if (this != &o) {
    reset();
    event_ = std::exchange(o.event_, nullptr);
  }
  return *this;
}

Result<Event> Event::create() {
  Event e;
  FLEX_CUDA_TRY(cudaEventCreate(&e.event_));
  return e;
}

Status Event::record(cudaStream_t stream) const {
  return cuda_status(cudaEventRecord(event_, stream), "cudaEventRecord");
}

Status Event::synchronize() const {
  return cuda_status(cudaEventSynchronize(event_), "cudaEventSynchronize");
}

Result<float> Event::elapsed_ms(const Event& start, const Event& end) {
  float ms = 0.f;
  FLEX_CUDA_TRY(cudaEventElapsedTime(&ms, start.event_, end.event_));
  return ms;
}

void Event::reset() {
  if (event_ != nullptr) (void)cudaEventDestroy(event_);
  event_ = nullptr;
}

GraphExec& GraphExec::operator=(GraphExec&& o) noexcept {
  if (this != &o) {
    reset();
    exec_ = std::exchange(o.exec_, nullptr);
  }
  return *this;
}

Status GraphExec::begin_capture(cudaStream_t stream) {
  return cuda_status(cudaStreamBeginCapture(stream, cudaStreamCaptureModeThreadLocal),
                     "cudaStreamBeginCapture");
}

Result<GraphExec> GraphExec::end_capture(cudaStream_t stream) {
  cudaGraph_t graph = nullptr;
  FLEX_CUDA_TRY(cudaStreamEndCapture(stream, &graph));
  GraphExec g;
  const cudaError_t err = cudaGraphInstantiate(&g.exec_, graph, 0);
  (void)cudaGraphDestroy(graph);
  if (err != cudaSuccess) {
    g.exec_ = nullptr;
    return cuda_status(err, "cudaGraphInstantiate");
  }
  return g;
}

void GraphExec::abandon_capture(cudaStream_t stream) {
  cudaGraph_t graph = nullptr;
  if (cudaStreamEndCapture(stream, &graph) == cudaSuccess && graph != nullptr) {
    (void)cudaGraphDestroy(graph);
  }
  (void)cudaGetLastError();
}

Status GraphExec::launch(cudaStream_t stream) const {
  return cuda_status(cudaGraphLaunch(exec_, stream), "cudaGraphLaunch");
}

void GraphExec::reset() {
  if (exec_ != nullptr) (void)cudaGraphExecDestroy(exec_);
  exec_ = nullptr;
}

Result<DeviceBuffer> upload(const void* data, size_t num_bytes) {
  FLEX_ASSIGN_OR_RETURN(DeviceBuffer b, DeviceBuffer::create(num_bytes));
  if (num_bytes > 0) {
    FLEX_CUDA_TRY(cudaMemcpy(b.data(), data, num_bytes, cudaMemcpyHostToDevice));
  }
  return b;
}

Result<DeviceBuffer> upload_tensor(const Tensor& t, DType dtype) {
  if (t.dtype() == dtype && t.is_contiguous()) return upload(t.raw(), t.num_bytes());
  Tensor c = t.to(dtype);
  return upload(c.raw(), c.num_bytes());
}

// Tensors of one width stacked along rows, converted to `dtype`.
Result<DeviceBuffer> upload_rows(const std::vector<const Tensor*>& parts, DType dtype) {
  size_t total = 0;
  for (const Tensor* t : parts) total += static_cast<size_t>(t->numel()) * dtype_size(dtype);
  FLEX_ASSIGN_OR_RETURN(DeviceBuffer b, DeviceBuffer::create(total));
  size_t at = 0;
  for (const Tensor* t : parts) {
    Tensor c = t->to(dtype);
    FLEX_CUDA_TRY(cudaMemcpy(b.as<char>() + at, c.raw(), c.num_bytes(), cudaMemcpyHostToDevice));
    at += c.num_bytes();
  }
  return b;
}

}  // namespace flexpert::cuda
