// Python bindings of the CUDA backend (compiled by the host compiler; the kernels are in cuda.cu).
#include <torch/extension.h>

#include "ops.h"

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  AMP_RUNNER_BIND_OPS(m, amp_runner, "cuda");
}
