"""Adapter for the brgemm attention forward (`cp_attention/csrc/attention_fwd.cpp`).

The C++ kernel computes causal self-attention over the documents of a packed row (the
`cu_q == cu_k` forward of every layer) as FlashAttention-2 with every product on torch's exported
`cpublas::brgemm`: oneDNN's AVX512-BF16 micro-kernel on CPUs without AMX, its AMX one where
present. It returns aten's (out, lse) contract, so either backward consumes its lse.

It is part of the native extension (cp_attention.native: built on first use, cached on disk,
only where it can run: Linux on x86-64 with AVX512-BF16, a C++ compiler and ninja). `available()`
is whether it is built and self-checked here; a build or self-check that fails, or a later call
that fails, leaves it False and the caller on aten's kernel, with one warning naming the reason.
`disabled()` runs a block on aten's kernel (benchmarks compare the two in one process).
"""

from __future__ import annotations

import torch

from cp_attention import native

KERNEL = "attention_fwd"  # its name in cp_attention.native


def available() -> bool:
    return native.unavailable_reason(KERNEL) is None


def disabled():
    """A context: aten's forward for the block."""
    return native.disabled(KERNEL)


def varlen_causal_forward(q_THD, k_SHD, v_SHD, cu_seqlens, scale):
    """(out_THD bf16, lse_HT float32) of causal self-attention over the documents [cu[i], cu[i+1])
    (queries and keys share the boundaries). q [T, Hq, D], k / v [T, Hkv, D] bf16, D a multiple
    of 16 up to 256. Tokens outside every document get out = 0 and lse = -inf."""
    mod = native.kernel(KERNEL)
    q, k, v = (x.contiguous() for x in (q_THD, k_SHD, v_SHD))
    with torch.profiler.record_function("cp_attention::brgemm_attention_forward"):  # named in profiles
        out, lse = mod.varlen_causal_forward(q, k, v, cu_seqlens.to(torch.long).cpu(), float(scale))
    return out, lse


def try_varlen_causal_forward(*args):
    """varlen_causal_forward, or None (and the kernel off for this process, with one warning)
    if it fails: a training run falls back to aten's kernel rather than dying mid-step."""
    try:
        return varlen_causal_forward(*args)
    except RuntimeError as e:
        native.disable(KERNEL, e)
        return None
