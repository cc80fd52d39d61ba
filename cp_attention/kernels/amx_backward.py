"""Adapter for the brgemm attention backward (`_amx_attention_bwd.cpp`), built on first use.

The C++ kernel computes the backward of causal self-attention over the documents of a packed row
with every product on torch's exported `cpublas::brgemm` and fp32 accumulators: oneDNN's AMX
micro-kernel where the CPU has AMX, its AVX512-BF16 one elsewhere (B operands are packed by hand,
so `cpublas::could_pack`, False without AMX, is not needed). The file keeps its AMX name, the
kernel its first target. Backward alone, 8 query / 4 KV heads of 64, bf16, medians, against aten's
kernel in the same run: with AMX, 59 ms against 99 ms on a 2048-token document (one core of the
dev VM) and 0.6 against 3.9 ms at 128 tokens. On an AMD EPYC with AVX512-BF16 and no AMX
(bench/attention_kernels.py --backward-only --lengths 8192, 8 query / 4 KV heads of 64, quiet
machine, 2026-12-05): one 8192-token document 966 / 489 ms on 1 / 2 threads against aten's 1765 /
905 (1.8x); the bench's 2048-token row of six documents (102-731 tokens) 14.4 / 8.1 ms against
49.9 / 32.9 (3.5 / 4.0x, measured before the 512-query chunks of dV / dK). It is also more accurate (dK/dV are accumulated in
fp32, not rounded to bf16 tile by tile).

It is built with torch.utils.cpp_extension the first time a bf16 causal backward asks for it
(20-40 s; cached on disk afterwards) and only where it can run: Linux on x86-64 with AVX512-BF16
(AMX included), a C++ compiler and ninja. Anything else, including a failed build, a failed
self-check against float32 maths on a tiny row, or a failed call, leaves `available()` False and
the caller on aten's kernel, with one warning naming the reason. `LONGCTX_AMX_ATTENTION=0` turns
it off. Head dims must be multiples of 16: 16 to 128 are tested, and a head dim of 8 failed inside
oneDNN when tried.
"""

from __future__ import annotations

import torch

from ._cpp_kernel import CppKernel

BLOCK_Q = 64  # queries per tile: the column count of the per-tile packed B operands (<= 64)
BLOCK_K = 64  # keys per tile (128 measured no faster on 2048 tokens, slower on short documents)


def _self_check(mod) -> None:
    """Raise if the kernel disagrees with float32 maths on a tiny row: brgemm's bf16 path is
    oneDNN's choice per CPU (AMX or AVX512-BF16), and a wrong one must cost a warning, not a run."""
    # The first use may come from inside a model's autocast region (or a backward pass): the
    # float32 reference must not be autocast to bf16, where its einsums would mix dtypes and fail.
    with torch.autocast("cpu", enabled=False), torch.no_grad():
        _check_tiny_row(mod)


def _check_tiny_row(mod) -> None:
    # Two documents, the second straddling a 64-row tile, two query heads on one KV head.
    g = torch.Generator().manual_seed(0)
    q, k, v, dout = (torch.randn(70, h, 16, generator=g).bfloat16() for h in (2, 1, 1, 2))
    cu, scale = torch.tensor([0, 3, 70]), 0.25
    outs, lses, refs = [], [], []
    for a, b in ((0, 3), (3, 70)):
        qf, do = q[a:b].float(), dout[a:b].float()
        kf, vf = (x[a:b].float().expand(-1, 2, -1) for x in (k, v))
        s = torch.einsum("thd,shd->hts", qf, kf) * scale
        s = s.masked_fill(torch.ones(b - a, b - a, dtype=torch.bool).triu(1), float("-inf"))
        p = s.softmax(-1)
        o = torch.einsum("hts,shd->thd", p, vf).bfloat16()  # the kernel reads a bf16 out
        ds = p * (torch.einsum("thd,shd->hts", do, vf) - (do * o.float()).sum(-1).T[..., None]) * scale
        refs.append((torch.einsum("hts,shd->thd", ds, kf), torch.einsum("hts,thd->sd", ds, qf)[:, None],
                     torch.einsum("hts,thd->sd", p, do)[:, None]))
        outs.append(o)
        lses.append(s.logsumexp(-1))
    got = mod.varlen_causal_backward(dout, q, k, v, torch.cat(outs), torch.cat(lses, 1).contiguous(),
                                     cu, scale, BLOCK_Q, BLOCK_K)
    per_grad = (torch.cat(r) for r in zip(*refs, strict=True))  # (dq, dk, dv) over both documents
    for g, ref in zip(got, per_grad, strict=True):
        # bf16 P, dS and gradients: 2e-2 of the gradient's scale is several bf16 ulps (the tests
        # measure 0.3-0.6%); a wrong kernel is O(1) off.
        if not (g.float() - ref).abs().max() <= 2e-2 * ref.abs().max():
            raise RuntimeError("self-check against float32 maths failed (oneDNN's bf16 brgemm path)")


KERNEL = CppKernel("_amx_attention_bwd.cpp", "longctx_amx_attention_bwd_", "LONGCTX_AMX_ATTENTION",
                   "brgemm (AMX or AVX512-BF16) attention backward", "aten's CPU flash backward",
                   _self_check)
available, disabled, _module = KERNEL.available, KERNEL.disabled, KERNEL.module


def varlen_causal_backward(dout_THD, q_THD, k_SHD, v_SHD, out_THD, lse_HT, cu_seqlens, scale):
    """(dq_THD, dk_SHD, dv_SHD) in bf16 for causal self-attention over the documents
    [cu[i], cu[i+1]) (queries and keys share the boundaries). Inputs bf16, lse float32 [Hq, T];
    tokens outside every document get zero gradients."""
    mod = _module()
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
        KERNEL.disable(e)
        return None
