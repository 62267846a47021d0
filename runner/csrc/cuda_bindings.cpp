// Python bindings of the CUDA backend (compiled by the host compiler; the kernels are in cuda.cu).
// The tensor and pybind11 with torch's type casters only (ATen/ATen.h and torch/python.h would
// add every operator and torch's C++ frontend, seconds of compile time, unused here)
#include <ATen/core/Tensor.h>
#include <torch/csrc/utils/pybind.h>

#include "ops.h"

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  AMP_RUNNER_BIND_OPS(m, amp_runner, "cuda");
}
