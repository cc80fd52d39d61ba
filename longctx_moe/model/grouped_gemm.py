"""Grouped GEMM over experts: y[rows of expert e] = x[rows of expert e] @ w[e].

`torch._grouped_mm` runs forward and backward for fp32/bf16 on CPU and GPU (torch >= 2.9); where it
is missing, for float64, or for strides it rejects (rows must be 16-byte aligned), we loop over the
experts. The capability is probed once per (device type, dtype) and cached.

Host reads of the counts: `torch._grouped_mm` takes them on the device (its offsets), so the path
a GPU run takes reads none. Only the loop fallback (one GEMM per expert: float64, rows that are
not 16-byte aligned) and the per-group row padding (CPU only, `wants_padding`) need them as host
ints (`host_counts`): on CPU they are host values already; on a GPU the fallback pays a sync
per GEMM. The FP8 experts loop by host counts too, handed down by the dispatcher (or read once
per layer forward, model/experts.py GroupedExperts). The dispatchers' routing counts reach the host elsewhere, once per MoE layer
(parallel/comm.py, RoutingCounts).

Shapes: M rows sorted by expert, D in features, F out features, E experts.
"""

from __future__ import annotations

import functools
from itertools import accumulate

import torch
from torch.utils.weak import WeakIdKeyDictionary

from data_packing.batch import pad_to
from longctx_moe.choices import check_choice

IMPLS = ("auto", "grouped_mm", "loop")


class _ContiguousGrad(torch.autograd.Function):
    """Identity whose backward makes the incoming gradient contiguous: `_grouped_mm`'s backward
    rejects expanded or strided grad_outputs (e.g. the one `y.sum().backward()` produces)."""

    @staticmethod
    def forward(ctx, x):
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad):
        return grad.contiguous()


@functools.cache
def grouped_mm_works(device_type: str, dtype: torch.dtype) -> bool:
    """True when torch._grouped_mm runs forward and backward for this device type and dtype."""
    if not hasattr(torch, "_grouped_mm") or dtype not in (torch.float32, torch.bfloat16):
        return False
    try:
        # The first call may come from inside an activation-recompute region: identity hooks keep
        # the probe's saved tensors out of that region's bookkeeping (else the forward saves more
        # tensors than the recomputation, which has the cached answer, and the backward fails).
        # A generator of its own: a draw from the global one would make the RNG state of a
        # resumed run (which probes at its first step) differ from the uninterrupted run's.
        g = torch.Generator(device=device_type).manual_seed(0)
        with torch.autograd.graph.saved_tensors_hooks(lambda t: t, lambda t: t), torch.enable_grad():
            x = torch.randn(8, 8, device=device_type, dtype=dtype, generator=g, requires_grad=True)
            w = torch.randn(2, 8, 8, device=device_type, dtype=dtype, generator=g, requires_grad=True)
            offs = torch.tensor([3, 8], device=device_type, dtype=torch.int32)
            y = torch._grouped_mm(x, w, offs=offs)
            y.backward(torch.ones_like(y))
        return True
    except (RuntimeError, NotImplementedError):
        return False


def _aligned(*tensors: torch.Tensor) -> bool:
    return all(t.shape[-1] * t.element_size() % 16 == 0 for t in tensors)


def resolve_impl(impl: str, x_MD: torch.Tensor, w_EDF: torch.Tensor) -> str:
    """The implementation `grouped_matmul` will use for these operands (raises for a bad request).
    Whether the device runs torch._grouped_mm for the run's dtype is the start-up resolution's
    question (longctx_moe.execution, which resolves "loop" where it does not); here only what the
    operands themselves rule out: a dtype it has no kernel for, rows that are not 16-byte aligned."""
    check_choice("execution.grouped_gemm", impl, IMPLS)
    usable = (hasattr(torch, "_grouped_mm") and x_MD.dtype in (torch.float32, torch.bfloat16)
              and _aligned(x_MD, w_EDF))
    if impl == "grouped_mm" and not usable:
        raise ValueError(f"execution.grouped_gemm='grouped_mm' cannot run {x_MD.dtype} on {x_MD.device.type} "
                         f"with D={x_MD.shape[-1]}, F={w_EDF.shape[-1]} (needs torch._grouped_mm, "
                         "fp32/bf16 and 16-byte rows); use grouped_gemm='auto'")
    return "grouped_mm" if impl == "grouped_mm" or (impl == "auto" and usable) else "loop"


def grouped_matmul(x_MD: torch.Tensor, w_EDF: torch.Tensor, counts_E: torch.Tensor,
                   impl: str = "auto") -> torch.Tensor:
    """y_MF: rows sorted by expert, counts_E (int64 [E]) rows per expert; experts may have 0 rows.

    x and w must share a dtype (callers cast once per forward). Returns x's dtype."""
    if resolve_impl(impl, x_MD, w_EDF) == "grouped_mm":
        return _ContiguousGrad.apply(torch._grouped_mm(x_MD, w_EDF, offs=_group_ends(counts_E)))
    # Loop fallback (float64 tests, old torch): one GEMM per expert; the host read is the price.
    pieces = torch.split(x_MD, host_counts(counts_E))
    return torch.cat([p @ w_EDF[e] for e, p in enumerate(pieces)])


def host_counts(counts_E: torch.Tensor) -> list[int]:
    """The rows per expert as host ints, for the loop fallback, the CPU padding and the FP8
    experts (once per layer forward, where no dispatcher handed them over): a read back from the
    counts' device (a sync on a GPU; the grouped_mm path never comes here)."""
    return counts_E.tolist()


# A layer's four grouped GEMMs (two forward, two in the backward) take the same counts tensor:
# its group ends are formed once (a launch each on a GPU otherwise), held while the counts live.
_ENDS = WeakIdKeyDictionary()


def _group_ends(counts_E: torch.Tensor) -> torch.Tensor:
    """`_grouped_mm`'s offs: int32 end row of each group (memoised per counts tensor and its
    version: an in-place change of the counts forms them again)."""
    hit = _ENDS.get(counts_E)
    if hit is not None and hit[0] == counts_E._version:
        return hit[1]
    ends_E = torch.cumsum(counts_E, 0, dtype=torch.int32)
    _ENDS[counts_E] = (counts_E._version, ends_E)
    return ends_E


def grouped_weight_grad(x_MD: torch.Tensor, g_MF: torch.Tensor, counts_E: torch.Tensor,
                        impl: str) -> torch.Tensor:
    """dw_EDF[e] = x[rows of e]^T @ g[rows of e], the weight gradient of grouped_matmul(x, w) for
    an output gradient g: the product `_grouped_mm`'s own backward forms (zeros for an expert with
    no rows). `impl` as resolved for the forward."""
    if impl == "grouped_mm":
        return torch._grouped_mm(x_MD.t(), g_MF, offs=_group_ends(counts_E))
    counts = host_counts(counts_E)
    pieces = zip(torch.split(x_MD, counts), torch.split(g_MF, counts), strict=True)
    return torch.stack([p.t() @ q for p, q in pieces])


# ---------------------------------------------------------------------- row padding per group
#
# On CPU, torch's bf16 GEMMs go through oneDNN, which JIT-builds and caches a kernel per operand
# shape. Expert row counts change every step, so an unpadded grouped GEMM meets new shapes all the
# time: each new one costs about 1.3 ms and ~240 KB of kernel cache on our Xeon (16 experts x 6
# GEMMs per layer), which ate the whole bf16 speed-up over fp32 and grew the process by ~2 GB as
# the cache filled. Padding each group to one of a few sizes (8 per octave, multiples of 16) makes
# the shapes repeat after warm-up, for at most 1/8 extra rows (about 6% on average).

PAD_MIN_ROWS = 16  # AMX tiles are 16 rows; smaller quanta only add shapes
PAD_STEPS_PER_OCTAVE = 8


def padded_size(rows: int) -> int:
    """The smallest size of the form k * max(16, 2^floor(log2 rows) / 8) that holds `rows`."""
    if rows <= 0:
        return 0
    quantum = max(PAD_MIN_ROWS, (1 << (rows.bit_length() - 1)) // PAD_STEPS_PER_OCTAVE)
    return pad_to(rows, quantum)


def pad_layout(counts_E: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, int]:
    """-> (slot_M: padded row of each of the M sorted rows, padded counts_E, padded total P).

    The counts are read on the host (the padded total sizes a tensor): CPU only (wants_padding)."""
    counts = host_counts(counts_E)
    padded = [padded_size(c) for c in counts]
    # Expert e's rows move down by the padding of the experts before it.
    shift_E = torch.tensor(list(accumulate((p - c for p, c in zip(padded, counts, strict=True)), initial=0))[:-1],
                           dtype=torch.int64)
    m = sum(counts)
    shift_M = torch.repeat_interleave(shift_E, torch.tensor(counts, dtype=torch.int64), output_size=m)
    slot_M = torch.arange(m, dtype=torch.int64) + shift_M
    dev = counts_E.device
    return slot_M.to(dev), torch.tensor(padded, dtype=counts_E.dtype, device=dev), sum(padded)


class _ScatterRows(torch.autograd.Function):
    """out[P, D] zeros with out[slot] = x; the backward gathers (never a scatter-add)."""

    @staticmethod
    def forward(ctx, x_MD, slot_M, total):
        ctx.save_for_backward(slot_M)
        return x_MD.new_zeros(total, x_MD.shape[-1]).index_copy_(0, slot_M, x_MD)

    @staticmethod
    def backward(ctx, g_PD):
        (slot_M,) = ctx.saved_tensors
        return g_PD.index_select(0, slot_M), None, None


class _GatherSlots(torch.autograd.Function):
    """y[slot]; the backward writes into zeros (padding rows get no gradient)."""

    @staticmethod
    def forward(ctx, y_PD, slot_M):
        ctx.save_for_backward(slot_M)
        ctx.total = y_PD.shape[0]
        return y_PD.index_select(0, slot_M)

    @staticmethod
    def backward(ctx, g_MD):
        (slot_M,) = ctx.saved_tensors
        return g_MD.new_zeros(ctx.total, g_MD.shape[-1]).index_copy_(0, slot_M, g_MD), None


def wants_padding(x_MD: torch.Tensor, batch_invariant: bool = False) -> bool:
    """Pad groups where oneDNN builds a kernel per shape: bf16/fp16 GEMMs on CPU; and fp32 ones
    in batch-invariant mode, since MKL's fp32 GEMM takes another path for 1-3 rows, so an
    expert's rows would differ with how many tokens its group holds (padded groups hold >= 16)."""
    if x_MD.device.type != "cpu":
        return False
    return x_MD.dtype in (torch.bfloat16, torch.float16) or (
        x_MD.dtype == torch.float32 and batch_invariant)


def with_padded_groups(fn, x_MD: torch.Tensor, counts_E: torch.Tensor,
                       batch_invariant: bool = False) -> torch.Tensor:
    """fn(x, counts) -> y (row-wise per group, zero rows map to rows nobody reads), run on rows
    padded per group where that pays (wants_padding), else called as is."""
    if not wants_padding(x_MD, batch_invariant):
        return fn(x_MD, counts_E)
    slot_M, padded_E, total = pad_layout(counts_E)
    y_PD = fn(_ScatterRows.apply(x_MD, slot_M, total), padded_E)
    return _GatherSlots.apply(y_PD, slot_M)
