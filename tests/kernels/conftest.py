"""The Triton kernels run here under Triton's interpreter (numpy on CPU tensors), switched on by
tests/conftest.py before any module imports triton. With a CUDA device the tests still use CPU
tensors and the interpreter; the compiled kernels are checked by bench/gpu_check.sh."""
