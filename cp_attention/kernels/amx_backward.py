"""Adapter for the brgemm attention backward (`cp_attention/csrc/attention_bwd.cpp`).

The C++ kernel computes the backward of causal self-attention over the documents of a packed row
with every product on torch's exported `cpublas::brgemm` and fp32 accumulators: oneDNN's AMX
micro-kernel where the CPU has AMX, its AVX512-BF16 one elsewhere (B operands are packed by hand,
so `cpublas::could_pack`, False without AMX, is not needed). The module keeps its AMX name, the
kernel's first target. Backward alone, 8 query / 4 KV heads of 64, bf16, medians, against aten's
kernel in the same run: with AMX, 59 ms against 99 ms on a 2048-token document (one core of the
dev VM) and 0.6 against 3.9 ms at 128 tokens. On an AMD EPYC with AVX512-BF16 and no AMX
(bench/attention_kernels.py --backward-only --lengths 8192, 8 query / 4 KV heads of 64, quiet
machine, 2026-12-05): one 8192-token document 966 / 489 ms on 1 / 2 threads against aten's 1765 /
905 (1.8x); the bench's 2048-token row of six documents (102-731 tokens) 14.4 / 8.1 ms against
49.9 / 32.9 (3.5 / 4.0x, measured before the 512-query chunks of dV / dK). It is also more accurate (dK/dV are accumulated in
fp32, not rounded to bf16 tile by tile).

It is part of the native extension (cp_attention.native: built on first use, cached on disk,
only where it can run: Linux on x86-64 with AVX512-BF16 (AMX included), a C++ compiler and ninja).
`available()` is whether it is built and self-checked here; a failed build or self-check, or a
failed call, leaves it False and the caller on aten's kernel, with one warning naming the reason.
`disabled()` runs a block on aten's kernel. Head dims must be multiples of 16: 16 to 128 are
tested, and a head dim of 8 failed inside oneDNN when tried.
"""

from __future__ import annotations

import torch

from cp_attention import native

KERNEL = "attention_bwd"  # its name in cp_attention.native
BLOCK_Q = 64  # queries per tile: the column count of the per-tile packed B operands (<= 64)
BLOCK_K = 64  # keys per tile (128 measured no faster on 2048 tokens, slower on short documents)


def available() -> bool:
    return native.unavailable_reason(KERNEL) is None


def disabled():
    """A context: aten's backward for the block."""
    return native.disabled(KERNEL)


def varlen_causal_backward(dout_THD, q_THD, k_SHD, v_SHD, out_THD, lse_HT, cu_seqlens, scale):
    """(dq_THD, dk_SHD, dv_SHD) in bf16 for causal self-attention over the documents
    [cu[i], cu[i+1]) (queries and keys share the boundaries). Inputs bf16, lse float32 [Hq, T];
    tokens outside every document get zero gradients."""
    mod = native.kernel(KERNEL)
    args = [x.contiguous() for x in (dout_THD, q_THD, k_SHD, v_SHD, out_THD)]
    with torch.profiler.record_function("cp_attention::amx_attention_backward"):  # named in profiles
        return tuple(mod.varlen_causal_backward(*args, lse_HT.float().contiguous(),
                                                cu_seqlens.to(torch.long).cpu(), float(scale),
                                                BLOCK_Q, BLOCK_K))


def try_varlen_causal_backward(*args):
    """varlen_causal_backward, or None (and the kernel off for this process, with one warning)
    if it fails: a training run falls back to aten's kernel rather than dying mid-step."""
    try:
        return varlen_causal_backward(*args)
    except RuntimeError as e:
        native.disable(KERNEL, e)
        return None
