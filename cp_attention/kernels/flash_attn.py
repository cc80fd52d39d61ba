"""Adapter for the flash-attn package (CUDA, fp16/bf16): the only module that imports it.

Uses flash_attn.flash_attn_interface._flash_attn_varlen_forward / _backward, whose positional
signatures changed across releases (window_size tuple in 2.5, window_size_left/right and softcap
from 2.6), so arguments are bound by name against the installed signature.
Shape legend: T query tokens, S key tokens, Hq / Hkv heads, D head dim.
"""

from __future__ import annotations

import functools
import importlib.util
import inspect

import torch
from torch.utils.weak import WeakIdKeyDictionary

from ._common import default_scale

_NEG_INF, _INF = float("-inf"), float("inf")


@functools.cache
def _installed() -> bool:
    # asked once a process: the layout planner resolves the execution choices of thousands of
    # layouts, and a search of sys.path each time was a tenth of its walk
    return importlib.util.find_spec("flash_attn") is not None


def unavailable_reason(device: torch.device) -> str | None:
    if not _installed():
        return "the flash-attn package is not installed (pip install 'longctx-moe[gpu]' on a CUDA machine)"
    if device.type != "cuda":
        return f"flash-attn kernels run on CUDA tensors, not {device.type}; use backend='auto'"
    return None


def window_unsupported_reason(device: torch.device) -> str | None:
    """None when the installed flash-attn takes a sliding window (2.3+: window_size)."""
    if unavailable_reason(device) is not None:
        return None  # resolve_backend already refused the backend itself
    params = _params(_interface()._flash_attn_varlen_forward)
    if "window_size" in params or "window_size_left" in params:
        return None
    return ("the installed flash-attn has no window_size; install flash-attn >= 2.3 or use "
            "attention_backend=flex")


def _interface():
    from flash_attn import flash_attn_interface  # lazy: GPU-only package

    return flash_attn_interface


def _params(fn) -> dict:
    """The named parameters of a flash-attn function (see _call_by_name)."""
    params = inspect.signature(getattr(fn, "_init_fn", fn)).parameters
    named = (inspect.Parameter.POSITIONAL_OR_KEYWORD, inspect.Parameter.KEYWORD_ONLY)
    return {p: spec for p, spec in params.items() if spec.kind in named}


def _call_by_name(fn, values: dict):
    """Call fn with the entries of `values` its signature names (version-proof binding).
    flash-attn >= 2.7 wraps these functions as torch custom ops (`CustomOpDef`, signature
    (*args, **kwargs)); the original function's signature is on `_init_fn`."""
    params = _params(fn)
    missing = [p for p, spec in params.items() if p not in values and spec.default is inspect._empty]
    if missing:
        raise RuntimeError(f"unsupported flash-attn version: {fn.__name__} needs {missing}; "
                           "install flash-attn >= 2.5")
    return fn(**{p: values[p] for p in params if p in values})


def _common_args(q, k, v, cu_q, cu_k, max_q, max_k, causal, scale, window=None):
    if q.dtype not in (torch.float16, torch.bfloat16):
        raise ValueError(f"flash_attn supports float16/bfloat16, not {q.dtype}; use backend='flex' "
                         "or 'reference' for this dtype")
    # flash-attn's window (left, right) is bottom-right aligned like ours: W keys = W-1 before.
    left, right = (-1, -1) if window is None else (window - 1, 0)
    return dict(q=q, k=k, v=v, cu_seqlens_q=cu_q.int(), cu_seqlens_k=cu_k.int(),
                max_seqlen_q=max_q, max_seqlen_k=max_k, dropout_p=0.0,
                softmax_scale=default_scale(scale, q.shape[-1]), causal=bool(causal),
                window_size=(left, right), window_size_left=left, window_size_right=right,
                softcap=0.0, alibi_slopes=None, return_softmax=False, deterministic=True,
                rng_state=None)


# Trailing-padding masks by boundary tensor: the model hands every layer the same device bounds
# (its DocLayout's), the ring each step's (RingLayout.step), so a mask costs its launches once per
# micro-batch and a layer's attention launches only the kernel and the fix-ups below.
_TAILS: WeakIdKeyDictionary = WeakIdKeyDictionary()


def tail_rows(cu: torch.Tensor, rows: int) -> torch.Tensor:
    """bool [rows]: True at the rows past cu[-1] (trailing padding), made on cu's device once per
    boundary tensor and row count (and again if the tensor is written in place)."""
    version = 0 if cu.is_inference() else cu._version
    masks = _TAILS.setdefault(cu, {})
    if (rows, version) not in masks:
        masks[(rows, version)] = torch.arange(rows, device=cu.device) >= cu[-1]
    return masks[(rows, version)]


def _fix_padding(out_THD, lse_HT, cu_q):
    """Rows past cu_q[-1] are untouched by the kernel; rows that see no key get lse = +inf from
    flash-attn. Both become out 0, lse -inf (device-side, no host sync): four launches."""
    lse_HT = lse_HT.nan_to_num(nan=_NEG_INF, posinf=_NEG_INF, neginf=_NEG_INF)
    lse_HT = lse_HT.masked_fill_(tail_rows(cu_q, out_THD.shape[0]), _NEG_INF)
    out_THD = out_THD.masked_fill((lse_HT == _NEG_INF).t()[..., None], 0)
    return out_THD, lse_HT


def kernel_lse(lse_HT: torch.Tensor) -> torch.Tensor:
    """_common.kernel_lse (-inf -> +inf, so a kernel's backward gives rows that see no key no
    gradient) in one launch instead of three."""
    return lse_HT.float().nan_to_num(nan=float("nan"), posinf=_INF, neginf=_INF)


def forward(q_THD, k_SHD, v_SHD, cu_q, cu_k, max_q, max_k, causal, scale=None, window=None):
    """-> (out [T, Hq, D] input dtype, lse [Hq, T] float32). GQA is native to flash-attn; a v
    head dim != D arrives zero-padded (attn_forward), as flash-attn 2 wants one head dim."""
    args = _common_args(q_THD, k_SHD, v_SHD, cu_q, cu_k, max_q, max_k, causal, scale, window)
    res = _call_by_name(_interface()._flash_attn_varlen_forward, args)
    # 2.6+: (out, lse, S_dmask, rng_state); 2.5: (out, q, k, v, out_padded, lse, S_dmask, rng).
    out, lse = (res[0], res[1]) if len(res) == 4 else (res[0], res[5])
    if lse.dim() != 2:
        raise RuntimeError(f"flash-attn returned a padded lse {tuple(lse.shape)}; install flash-attn >= 2.5")
    return _fix_padding(out, lse.float(), cu_q)


def backward(dout_THD, q_THD, k_SHD, v_SHD, out_THD, lse_HT, cu_q, cu_k, max_q, max_k, causal,
             scale=None, window=None):
    """Block gradients for a passed (possibly merged) out / lse; -> (dq, dk, dv)."""
    args = _common_args(q_THD, k_SHD, v_SHD, cu_q, cu_k, max_q, max_k, causal, scale, window)
    dq, dk, dv = torch.zeros_like(q_THD), torch.zeros_like(k_SHD), torch.zeros_like(v_SHD)
    args.update(dout=dout_THD.contiguous(), out=out_THD.contiguous(),
                softmax_lse=kernel_lse(lse_HT).contiguous(), dq=dq, dk=dk, dv=dv)
    _call_by_name(_interface()._flash_attn_varlen_backward, args)
    return dq, dk, dv
