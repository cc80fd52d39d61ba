"""Adapter for torch's varlen flash kernel (CUDA, fp16/bf16): torch.nn.attention.varlen.

The forward uses the public `varlen_attn`, whose signature changed across torch 2.11-2.14
(`is_causal=` became `window_size=(-1, 0)`; `return_aux=AuxRequest(lse=True)` returns the lse),
so keyword arguments are chosen from the installed signature. The public function has no way to
run the backward against an externally merged (out, lse), so the backward calls the aten kernel
it wraps, `aten._flash_attention_backward`, directly (present since torch 2.1).
Causal masks are bottom-right aligned (torch vendors flash-attn 2 >= 2.1).
Shape legend: T query tokens, S key tokens, Hq / Hkv heads, D head dim.
"""

from __future__ import annotations

import inspect

import torch

from .flash_attn import _fix_padding, kernel_lse, tail_rows


def _varlen_module():
    try:
        from torch.nn.attention import varlen  # noqa: PLC0415 - lazy: absent in older torch
    except ImportError:
        return None
    return varlen if hasattr(varlen, "varlen_attn") else None


def unavailable_reason(device: torch.device) -> str | None:
    if _varlen_module() is None:
        return f"torch {torch.__version__} has no torch.nn.attention.varlen; upgrade torch or use 'flex'"
    if device.type != "cuda":
        return f"torch's varlen flash kernel runs on CUDA tensors, not {device.type}; use backend='auto'"
    return None


def window_unsupported_reason(device: torch.device) -> str | None:
    """None when both the public forward and aten's backward take a window (torch >= 2.10)."""
    mod = _varlen_module()
    if mod is None:
        return None  # resolve_backend already refused the backend itself
    schema = str(torch.ops.aten._flash_attention_backward.default._schema)
    if "window_size" in inspect.signature(mod.varlen_attn).parameters and "window_size_left" in schema:
        return None
    return (f"torch {torch.__version__} varlen_attn has no window_size; upgrade torch or use "
            "attention_backend=flex")


def _check_dtype(q):
    if q.dtype not in (torch.float16, torch.bfloat16):
        raise ValueError(f"torch_varlen supports float16/bfloat16, not {q.dtype}; use backend='flex' "
                         "or 'reference' for this dtype")


def _expand_kv(x_SHD, groups):
    return x_SHD if groups == 1 else x_SHD.repeat_interleave(groups, dim=1)


def forward(q_THD, k_SHD, v_SHD, cu_q, cu_k, max_q, max_k, causal, scale=None, window=None):
    """-> (out [T, Hq, D] input dtype, lse [Hq, T] float32)."""
    _check_dtype(q_THD)
    mod = _varlen_module()
    params = inspect.signature(mod.varlen_attn).parameters
    groups = q_THD.shape[1] // k_SHD.shape[1]
    kwargs = {"scale": scale}
    if "window_size" in params:
        # (left, right) keys around the bottom-right diagonal: W keys = W-1 before the query.
        left = -1 if window is None else window - 1
        kwargs["window_size"] = (left, 0) if causal else (-1, -1)
    else:
        kwargs["is_causal"] = bool(causal)
    if "enable_gqa" in params:
        kwargs["enable_gqa"] = groups > 1
    else:
        k_SHD, v_SHD = _expand_kv(k_SHD, groups), _expand_kv(v_SHD, groups)
    if "return_aux" not in params:
        raise RuntimeError(f"torch {torch.__version__} varlen_attn cannot return the lse; "
                           "use backend='flash_attn' or 'flex'")
    out, lse = mod.varlen_attn(q_THD, k_SHD, v_SHD, cu_q.int(), cu_k.int(), max_q, max_k,
                               return_aux=mod.AuxRequest(lse=True), **kwargs)
    if lse.shape != (q_THD.shape[1], q_THD.shape[0]):
        lse = lse.transpose(0, 1)  # some releases document [T, H]; the kernel writes [H, T]
    return _fix_padding(out, lse.float(), cu_q)


def backward(dout_THD, q_THD, k_SHD, v_SHD, out_THD, lse_HT, cu_q, cu_k, max_q, max_k, causal,
             scale=None, window=None):
    """Block gradients for a passed (possibly merged) out / lse; -> (dq, dk, dv)."""
    _check_dtype(q_THD)
    groups = q_THD.shape[1] // k_SHD.shape[1]
    # Where torch's varlen takes GQA, aten's flash backward takes the KV heads as they are (torch's
    # own varlen backward passes them so) and returns dk / dv per KV head: no copy of k and v at
    # the query heads' count, no sum after.
    native_gqa = "enable_gqa" in inspect.signature(_varlen_module().varlen_attn).parameters
    k, v = (k_SHD, v_SHD) if native_gqa else (_expand_kv(k_SHD, groups), _expand_kv(v_SHD, groups))
    # dropout_p is 0, so the kernel reads no RNG state: an unfilled one launches nothing.
    rng_state = torch.empty(2, dtype=torch.uint64, device=q_THD.device)
    unused = torch.empty(0, device=q_THD.device)
    dq, dk, dv = torch.ops.aten._flash_attention_backward(
        dout_THD.contiguous(), q_THD, k, v, out_THD.contiguous(),
        kernel_lse(lse_HT).contiguous(), cu_q.int(), cu_k.int(), max_q, max_k, 0.0,
        bool(causal), rng_state, unused, scale=scale,
        **({} if window is None else {"window_size_left": window - 1, "window_size_right": 0}))
    if groups > 1 and not native_gqa:
        s, _, d = dk.shape
        dk = dk.view(s, -1, groups, d).sum(2)
        dv = dv.view(s, -1, groups, d).sum(2)
    # Padding past cu_q[-1] / cu_k[-1] may be left unwritten by the kernel.
    rows_q, rows_k = tail_rows(cu_q, dq.shape[0]), tail_rows(cu_k, dk.shape[0])
    return (dq.masked_fill(rows_q[:, None, None], 0), dk.masked_fill(rows_k[:, None, None], 0),
            dv.masked_fill(rows_k[:, None, None], 0))
