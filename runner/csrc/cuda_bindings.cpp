// Python bindings of the CUDA backend (compiled by the host compiler; the kernels are in cuda.cu).
// ATen and the Python bindings' type casters only: torch/extension.h adds torch's C++ frontend
// (torch::nn, torch::optim), unused here, and 7-18 s to a build of the file (g++ -O3)
#include <ATen/ATen.h>
#include <torch/python.h>

#include "ops.h"

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  AMP_RUNNER_BIND_OPS(m, amp_runner, "cuda");
}
