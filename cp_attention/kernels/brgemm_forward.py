"""Adapter for the brgemm attention forward (`_cpu_attention_fwd.cpp`), built on first use.

The C++ kernel computes causal self-attention over the documents of a packed row (the
`cu_q == cu_k` forward of every layer) as FlashAttention-2 with every product on torch's exported
`cpublas::brgemm`: oneDNN's AVX512-BF16 micro-kernel on CPUs without AMX, its AMX one where
present. It returns aten's (out, lse) contract, so either backward consumes its lse.

It is built with torch.utils.cpp_extension the first time a bf16 causal forward asks for it
(~30 s; cached on disk per Python environment) and only where it can run: Linux on x86-64 with
AVX512-BF16, a C++ compiler and ninja. A build, a self-check on a tiny input, or a later call that
fails leaves `available()` False and the caller on aten's kernel, with one warning naming the
reason. `LONGCTX_CPU_ATTENTION_FWD=0` turns it off (separately from the backward's
`LONGCTX_AMX_ATTENTION`, so either half can be compared with aten's alone).
"""

from __future__ import annotations

import torch

from ._cpp_kernel import CppKernel

ENV = "LONGCTX_CPU_ATTENTION_FWD"


def _self_check(mod) -> None:
    """Raise if the kernel disagrees with float32 maths on a tiny row: brgemm's bf16 path is
    oneDNN's choice per CPU, and a wrong one must cost a warning, not a training run."""
    # The first use may come from inside a model's autocast region: the float32 reference must
    # not be autocast to bf16 (its einsums would then mix dtypes and fail).
    with torch.autocast("cpu", enabled=False), torch.no_grad():
        _check_tiny_row(mod)


def _check_tiny_row(mod) -> None:
    g = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(70, h, 16, generator=g).bfloat16() for h in (2, 1, 1))
    out, lse = mod.varlen_causal_forward(q, k, v, torch.tensor([0, 3, 70]), 0.25)
    for a, b in ((0, 3), (3, 70)):
        s = torch.einsum("thd,shd->hts", q[a:b].float(), k[a:b].float().expand(-1, 2, -1)) * 0.25
        s = s.masked_fill(torch.ones(b - a, b - a, dtype=torch.bool).triu(1), float("-inf"))
        ref = torch.einsum("hts,shd->thd", s.softmax(-1), v[a:b].float().expand(-1, 2, -1))
        # bf16 P and output: 2e-2 is ~4 bf16 ulps at these magnitudes; a wrong kernel is O(1) off.
        if not (torch.allclose(out[a:b].float(), ref, atol=2e-2)
                and torch.allclose(lse[:, a:b], s.logsumexp(-1), atol=1e-3)):
            raise RuntimeError("self-check against float32 maths failed (oneDNN's bf16 brgemm path)")


KERNEL = CppKernel("_cpu_attention_fwd.cpp", "longctx_cpu_attention_fwd_", ENV,
                   "brgemm attention forward", "aten's CPU flash forward", _self_check)
available, disabled, _module = KERNEL.available, KERNEL.disabled, KERNEL.module


def varlen_causal_forward(q_THD, k_SHD, v_SHD, cu_seqlens, scale):
    """(out_THD bf16, lse_HT float32) of causal self-attention over the documents [cu[i], cu[i+1])
    (queries and keys share the boundaries). q [T, Hq, D], k / v [T, Hkv, D] bf16, D a multiple
    of 16 up to 256. Tokens outside every document get out = 0 and lse = -inf."""
    mod = _module()
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
        KERNEL.disable(e)
        return None
