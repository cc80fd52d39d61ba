"""Single-device varlen attention with logsumexp, behind one interface and several backends.

    out_THD, lse_HT = attn_forward(q_THD, k_SHD, v_SHD, cu_q, cu_k, max_q, max_k, causal)
    dq_THD, dk_SHD, dv_SHD = attn_backward(dout_THD, q_THD, k_SHD, v_SHD, out_THD, lse_HT, ...)
    out_THD, lse_HT = varlen_attention(q, k, v, cu_q, cu_k, max_q, max_k, causal=True)  # autograd

Shape legend: T query tokens, S key tokens, Hq / Hkv heads (Hq % Hkv == 0, query head h uses kv
head h // (Hq // Hkv)), D head dim of q / k, Dv of v / out (may differ: MLA), N documents.
Options on every backend: window=W (sliding window: the W latest keys, bottom-right aligned;
refused at start-up by a backend that cannot, see check_window_support), offset=O (causal only:
the alignment moved O keys on, so query i of a document sits at key position i + Lk - Lq + O for
the causal bound and the window alike; the ring's zigzag blocks, whose query-key distance in the
document is not their local one, need it; backends without it hand such calls to flex or refuse
them, see offset_backend) and, on
varlen_attention, sink=[Hq] (gpt-oss attention sinks, cp_attention.kernels.sinks).
cu_q / cu_k: int32 [N+1] cumulative boundaries on q's device; max_q / max_k: host ints. Every
backend takes the boundaries where it runs: the CPU ones plan on their values (there the device
is the host), the CUDA ones hand them to the kernel as they are and never read them back. A
caller plans on its own host copy and passes the device copy, made once per micro-batch (the
model's DocLayout.cu_attn_S / cu_attn_host_S, the ring's RingLayout.step). Causal masks are bottom-right aligned per document (flash-attn >= 2.1):
query i of a document with lengths (Lq, Lk) sees keys j <= i + Lk - Lq. Rows that see no key, and
trailing padding past cu_q[-1], return out = 0 and lse = -inf; their gradients are zero.
lse is float32 (float64 for float64 inputs); out has the input dtype.

attn_backward accepts an (out, lse) that came from a larger attention (the merged result of a
ring) and returns this block's exact contribution: dS = P * (dP - rowsum(dout * out)),
P = exp(S - lse).

Backends: "torch_cpu" (torch's CPU flash kernel over buckets of documents), "reference" (dense
float64 maths, for tests), "torch_varlen" (torch's varlen flash kernel, CUDA), "flex"
(flex_attention with a document block mask, CUDA), "flash_attn" (the flash-attn package, CUDA).
"auto" picks torch_cpu on CPU and the best available one on CUDA.
"""

from __future__ import annotations

from dataclasses import replace

import torch

from . import reference as _reference
from ._common import (
    accumulate_dtype,
    check_inputs,
    check_window,
    default_scale,
    doc_lengths,
    pad_head_dims,
)
from ._registry import (
    BACKENDS,
    AttnKernel,
    as_kernel,
    check_window_support,
    load_backend,
    offset_backend,
    resolve_backend,
)
from .sinks import add_sink, check_sink, sink_grad

__all__ = ["BACKENDS", "AttnKernel", "accumulate_dtype", "add_sink", "as_kernel",
           "attn_backward", "attn_forward", "check_window_support", "offset_backend",
           "reference_attention",
           "resolve_backend", "sink_grad", "varlen_attention"]


def _validate(q_THD, k_SHD, v_SHD, cu_q, cu_k, max_q, max_k, causal=True, window=None,
              offset=0) -> None:
    check_inputs(q_THD, k_SHD, v_SHD, cu_q, cu_k, max_q, max_k)
    check_window(window, causal)
    if offset and not causal:
        raise ValueError(f"offset={offset} moves the causal alignment and needs causal=True; "
                         "pass offset=0 for causal=False")
    if cu_q.device.type == "cpu" and cu_k.device.type == "cpu":
        # Boundary values are checked only where reading them costs no device sync.
        doc_lengths(cu_q, cu_k, q_THD.shape[0], k_SHD.shape[0], max_q, max_k)


def _resolve(backend: str | AttnKernel, q_THD, window, offset=0) -> AttnKernel:
    """The kernel with its backend resolved for this call's dtype, window and offset. A backend
    name is checked against the call's device; an AttnKernel naming one was resolved for the run's
    device at start-up (longctx_moe.execution) and is taken as it is."""
    kernel = as_kernel(backend)
    resolved = isinstance(backend, AttnKernel) and kernel.backend != "auto"
    name = kernel.backend if resolved else resolve_backend(kernel.backend, q_THD.device, q_THD.dtype)
    if offset:
        name = offset_backend(name, q_THD.device)
    if window is not None:
        check_window_support(name, q_THD.device)
    return kernel if name == kernel.backend else replace(kernel, backend=name)


def _extra(kernel: AttnKernel, offset: int) -> dict:
    """Keyword arguments only some backends take: the offset, and the kernel's choices for the
    backend that reads them (TAKES_KERNEL)."""
    extra = {"offset": offset} if offset else {}
    if getattr(load_backend(kernel.backend), "TAKES_KERNEL", False):
        extra["kernel"] = kernel
    return extra


def attn_forward(q_THD, k_SHD, v_SHD, cu_q, cu_k, max_q: int, max_k: int, causal: bool,
                 scale: float | None = None, backend: str | AttnKernel = "auto",
                 window: int | None = None, offset: int = 0):
    """q [T, Hq, D], k [S, Hkv, D], v [S, Hkv, Dv] -> (out [T, Hq, Dv] input dtype, lse [Hq, T]
    float32/64). window: each query sees at most the `window` latest keys of its document (its
    own position included; bottom-right aligned like the causal mask); None = all of them.
    offset: the causal alignment moved (see the module docstring). backend: a name or an
    AttnKernel (the choices of a run)."""
    _validate(q_THD, k_SHD, v_SHD, cu_q, cu_k, max_q, max_k, causal, window, offset)
    kernel = _resolve(backend, q_THD, window, offset)
    name = kernel.backend
    scale = default_scale(scale, q_THD.shape[-1])
    dv = v_SHD.shape[-1]
    if name not in _NATIVE_DV and dv != q_THD.shape[-1]:
        q_THD, k_SHD, v_SHD = pad_head_dims(q_THD, k_SHD, v_SHD)
    extra = _extra(kernel, offset)
    out, lse = load_backend(name).forward(q_THD, k_SHD, v_SHD, cu_q, cu_k, max_q, max_k, causal,
                                          scale, window, **extra)
    return out[..., :dv], lse


def attn_backward(dout_THD, q_THD, k_SHD, v_SHD, out_THD, lse_HT, cu_q, cu_k, max_q: int,
                  max_k: int, causal: bool, scale: float | None = None,
                  backend: str | AttnKernel = "auto", window: int | None = None, offset: int = 0):
    """-> (dq [T, Hq, D], dk [S, Hkv, D], dv [S, Hkv, Dv]) in the input dtype, for the passed
    (possibly globally merged) out [T, Hq, Dv] and lse [Hq, T]."""
    _validate(q_THD, k_SHD, v_SHD, cu_q, cu_k, max_q, max_k, causal, window, offset)
    want = (*q_THD.shape[:2], v_SHD.shape[-1])
    if out_THD.shape != want or dout_THD.shape != want:
        raise ValueError(f"out {tuple(out_THD.shape)} and dout {tuple(dout_THD.shape)} must be "
                         f"[T, Hq, Dv] = {list(want)}")
    if lse_HT.shape != (q_THD.shape[1], q_THD.shape[0]):
        raise ValueError(f"lse must be [Hq, T] = {[q_THD.shape[1], q_THD.shape[0]]}; got "
                         f"{list(lse_HT.shape)} (transpose a [T, H] lse)")
    kernel = _resolve(backend, q_THD, window, offset)
    name = kernel.backend
    scale = default_scale(scale, q_THD.shape[-1])
    d, dv = q_THD.shape[-1], v_SHD.shape[-1]
    if name not in _NATIVE_DV and dv != d:
        q_THD, k_SHD, v_SHD, out_THD, dout_THD = pad_head_dims(q_THD, k_SHD, v_SHD, out_THD,
                                                               dout_THD)
    extra = _extra(kernel, offset)
    gq, gk, gv = load_backend(name).backward(dout_THD, q_THD, k_SHD, v_SHD, out_THD, lse_HT, cu_q,
                                             cu_k, max_q, max_k, causal, scale, window, **extra)
    return gq[..., :d], gk[..., :d], gv[..., :dv]


# Backends that take v with its own head dim; the others get q, k, v zero-padded to one width.
_NATIVE_DV = ("reference",)


def reference_attention(q_THD, k_SHD, v_SHD, cu_q, cu_k, max_q: int, max_k: int, causal: bool,
                        scale: float | None = None, window: int | None = None,
                        sink_H: torch.Tensor | None = None, offset: int = 0):
    """Dense masked float64 attention: same contract as attn_forward (out in the input dtype);
    with `sink_H` the sink joins the softmax (see cp_attention.kernels.sinks)."""
    _validate(q_THD, k_SHD, v_SHD, cu_q, cu_k, max_q, max_k, causal, window, offset)
    check_sink(sink_H, q_THD.shape[1])
    out, lse = _reference.reference_forward(q_THD, k_SHD, v_SHD, cu_q, cu_k, max_q, max_k, causal,
                                            scale, window, offset)
    return (out, lse) if sink_H is None else add_sink(out, lse, sink_H)


class _VarlenAttention(torch.autograd.Function):
    @staticmethod
    def forward(ctx, q, k, v, sink, cu_q, cu_k, max_q, max_k, causal, scale, backend, window):
        kernel = _resolve(backend, q, window)
        scale = default_scale(scale, q.shape[-1])
        out, lse = attn_forward(q, k, v, cu_q, cu_k, max_q, max_k, causal, scale, kernel, window)
        if sink is not None:
            out, lse = add_sink(out, lse, sink)
        ctx.save_for_backward(q, k, v, sink, out, lse, cu_q, cu_k)
        ctx.args = (max_q, max_k, causal, scale, kernel, window)
        ctx.set_materialize_grads(False)
        return out, lse

    @staticmethod
    def backward(ctx, dout, dlse):
        q, k, v, sink, out, lse, cu_q, cu_k = ctx.saved_tensors
        max_q, max_k, causal, scale, name, window = ctx.args
        dout = torch.zeros_like(out) if dout is None else dout.contiguous()
        args = (cu_q, cu_k, max_q, max_k, causal, scale, name, window)
        if dlse is None:
            grads = attn_backward(dout, q, k, v, out, lse, *args)
        else:
            grads = _backward_with_lse_grad(dout, dlse, q, k, v, out, lse, *args)
        dsink = None if sink is None else sink_grad(dout, out, lse, sink, dlse)
        return (*grads, dsink, None, None, None, None, None, None, None, None)


def _backward_with_lse_grad(dout, dlse_HT, q, k, v, out, lse, cu_q, cu_k, max_q, max_k, causal,
                            scale, name, window):
    """d lse_i / d S_ij = P_ij, so an lse gradient adds P * dlse to dS = P * (dP - D). Every
    kernel computes D = rowsum(dout * out) itself; appending a column with out = 1, dout = -dlse
    (and zeros in q, k, v, so S and dP are unchanged) turns D into D - dlse. Eight columns keep
    the head dim a multiple of 8 for the GPU kernels; the scale is passed explicitly."""
    pad = lambda x, fill=0.0: torch.nn.functional.pad(x, (0, _EXTRA_COLS), value=fill)
    dout_x = pad(dout)
    dout_x[..., -_EXTRA_COLS] = -dlse_HT.t().to(dout.dtype)
    out_x = pad(out)
    out_x[..., -_EXTRA_COLS] = 1.0
    dq, dk, dv = attn_backward(dout_x, pad(q), pad(k), pad(v), out_x, lse, cu_q, cu_k, max_q, max_k,
                               causal, scale, name, window)
    d = q.shape[-1]
    return dq[..., :d], dk[..., :d], dv[..., :v.shape[-1]]


_EXTRA_COLS = 8


def varlen_attention(q, k, v, cu_q, cu_k, max_q: int, max_k: int, causal: bool = True,
                     scale: float | None = None, backend: str | AttnKernel = "auto",
                     window: int | None = None, sink: torch.Tensor | None = None):
    """Differentiable attn_forward: (out [T, Hq, Dv], lse [Hq, T]); gradients flow through both
    (an lse gradient costs a backward on a head dim padded by 8). sink: [Hq] logits joining each
    row's softmax (gpt-oss; cp_attention.kernels.sinks), with a gradient; lse then includes it."""
    check_sink(sink, q.shape[1])
    return _VarlenAttention.apply(q, k, v, sink, cu_q, cu_k, max_q, max_k, causal, scale, backend,
                                  window)
