"""Triton kernels for the steps of a GPU step spent outside GEMMs and attention, and C++ kernels
of the same ops for the CPU.

This package is the Triton adapter: `triton` is imported only by its kernel modules
(`triton_*.py`), and those are imported only through `triton_ops()`, lazily, once a call site has
decided to use them. Each kernel has a torch fallback, which is the code path the model runs
without this package:

| kernel | Triton module | torch path |
|---|---|---|
| MoE permute / unpermute (per-expert padded rows) | triton_permute | moe.LocalDispatcher |
| MoE row layout (counting sort by expert) | triton_layout | moe.permute_layout |
| router scores + top-k + weights | triton_router | moe.Router |
| balance statistics (seq aux loss, z-loss, counts) | triton_balance | moe.MoE.stats |
| log-prob + entropy statistics per vocabulary chunk | triton_logprobs | losses._LinearLogProbs |
| RMSNorm, and residual add + RMSNorm | triton_rmsnorm | layers._RMSNormFn |
| SwiGLU activation (experts, dense MLPs) | triton_swiglu | experts._SwiGLUDown, layers._GatedDown |
| rotary embedding of q and k | triton_rope | layers.apply_rope, rope.apply_partial_rope |

CPU-side modules live here too: three C++ (AVX512) kernels, the ops' `cpp` paths -
`cpu_logprobs`, the log-prob head's softmax work on bf16 logits; `cpu_rmsnorm`, RMSNorm in one
pass per row each way; `cpu_swiglu`, the experts' SwiGLU activation in one pass each way - and
`logits_cache`, the rule by which both log-prob heads keep their forward's logits for the
backward (`execution.loss_logits_cache_mb`).

Which path each op takes is not decided here: longctx_moe.execution resolves it once at start-up
(`execution.kernels` and the per-op settings) and the modules take their path as a constructor
argument.
"""

from __future__ import annotations

import functools
import importlib
from types import SimpleNamespace

# GPU launches of one call of the operators that issue more than one kernel (a fill, then
# their kernels), by name as the dispatcher names them: a count of the ops a step issues (the
# rehearsal's, longctx_moe.rehearsal.counts) sees each call once, through its fake implementation.
LAUNCHES_PER_CALL = {"longctx.balance_fwd": 4, "longctx.route_layout": 3,
                     # the kernel, then the sum of the weight gradient's per-program partials
                     "longctx.rmsnorm_bwd": 2, "longctx.add_rmsnorm_bwd": 2}


@functools.cache
def triton_ops() -> SimpleNamespace:
    """The Triton entry points (imports triton on first call)."""
    mods = {name: importlib.import_module(f"{__package__}.triton_{name}")
            for name in ("permute", "layout", "router", "balance", "logprobs", "rmsnorm", "swiglu", "rope")}
    return SimpleNamespace(
        permute=mods["permute"].permute, unpermute=mods["permute"].unpermute,
        route_layout=mods["layout"].route_layout,
        router_topk=mods["router"].router_topk, balance_losses=mods["balance"].balance_losses,
        linear_logprobs=mods["logprobs"].linear_logprobs, cross_entropy_rows=mods["logprobs"].cross_entropy_rows,
        rmsnorm=mods["rmsnorm"].rmsnorm, add_rmsnorm=mods["rmsnorm"].add_rmsnorm,
        swiglu=mods["swiglu"].swiglu, swiglu_fwd=mods["swiglu"].swiglu_fwd,
        swiglu_bwd=mods["swiglu"].swiglu_bwd,
        rope=mods["rope"].rope,
    )


__all__ = ["LAUNCHES_PER_CALL", "triton_ops"]
