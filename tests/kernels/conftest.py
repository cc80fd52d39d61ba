"""The Triton kernels run here under Triton's interpreter (numpy on CPU tensors): it is read when
the kernels' `@triton.jit` decorators run, which happens on their first lazy import, after this
file. With a CUDA device the tests still use CPU tensors and the interpreter; the compiled
kernels are checked by bench/gpu_check.sh."""

import os

os.environ.setdefault("TRITON_INTERPRET", "1")
