// The Python module: every kernel family's entry points in one extension (kernels.h).

// pybind11 with torch's casters for tensors and dtypes: what <torch/extension.h> includes for its
// bindings, without the C++ frontend (torch/all.h), which is most of its compile time.
#include <torch/csrc/utils/pybind.h>

#include "kernels.h"

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("varlen_causal_forward", &longctx::varlen_causal_forward);
  m.def("varlen_causal_backward", &longctx::varlen_causal_backward);
  m.def("forward_stats", &longctx::forward_stats);
  m.def("backward_grad_", &longctx::backward_grad_);
  m.def("rmsnorm_forward", &longctx::rmsnorm_forward);
  m.def("rmsnorm_backward", &longctx::rmsnorm_backward);
  m.def("swiglu_forward", &longctx::swiglu_forward);
  m.def("swiglu_backward", &longctx::swiglu_backward);
}
