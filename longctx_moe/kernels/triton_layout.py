"""The MoE dispatcher's row layout in three launches: each routed copy's row among the T*K rows
sorted by expert (ties in token order) and the rows per expert.

    route_layout(idx_TK, num_experts) -> (slot_TK int64, counts_E int64)

The torch path is moe.permute_layout without padding: a stable argsort of the flat ids, the
counts by scatter_add, and the inverse permutation by index_copy (six launches with its fills
and arange). Here a counting sort, stable and deterministic (no atomics):
- per block of copies, how many go to each expert;
- one program: the running sums of those counts over the blocks and over the experts, giving
  each (block, expert) its first row, and the counts per expert;
- per block, each copy's row: its (block, expert)'s first row plus the copies of the same
  expert before it in the block (a cumulative sum of the block's one-hot ids).
Legend: T tokens, K top-k, E experts, M = T*K copies in token-major order, B blocks of copies.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

_BLOCK_M = 128  # copies per program: a program holds a [128, E] one-hot tile
_BLOCK_B = 32  # blocks the scan adds per iteration


@triton.jit
def _hist_kernel(idx_ptr, hist_ptr, M, E, BLOCK_M: tl.constexpr, BLOCK_E: tl.constexpr):
    b = tl.program_id(0)
    offs = b * BLOCK_M + tl.arange(0, BLOCK_M)
    cols = tl.arange(0, BLOCK_E)
    ids = tl.load(idx_ptr + offs, mask=offs < M, other=-1)
    hot = (ids[:, None] == cols[None, :]).to(tl.int32)
    tl.store(hist_ptr + b.to(tl.int64) * E + cols, tl.sum(hot, axis=0), mask=cols < E)


@triton.jit
def _scan_kernel(hist_ptr, base_ptr, counts_ptr, NB, E, BLOCK_B: tl.constexpr, BLOCK_E: tl.constexpr):
    cols = tl.arange(0, BLOCK_E)
    rows = tl.arange(0, BLOCK_B)
    # pass 1: rows per expert
    total = tl.zeros([BLOCK_E], dtype=tl.int64)
    for start in range(0, NB, BLOCK_B):
        mask = ((start + rows) < NB)[:, None] & (cols < E)[None, :]
        h = tl.load(hist_ptr + (start + rows)[:, None].to(tl.int64) * E + cols[None, :], mask=mask, other=0)
        total += tl.sum(h.to(tl.int64), axis=0)
    tl.store(counts_ptr + cols, total, mask=cols < E)
    # pass 2: first row of each (block, expert): the expert's first row plus the earlier blocks'
    run = tl.cumsum(total, axis=0) - total
    for start in range(0, NB, BLOCK_B):
        mask = ((start + rows) < NB)[:, None] & (cols < E)[None, :]
        offs = (start + rows)[:, None].to(tl.int64) * E + cols[None, :]
        h = tl.load(hist_ptr + offs, mask=mask, other=0).to(tl.int64)
        tl.store(base_ptr + offs, run[None, :] + tl.cumsum(h, axis=0) - h, mask=mask)
        run += tl.sum(h, axis=0)


@triton.jit
def _slot_kernel(idx_ptr, base_ptr, slot_ptr, M, E, BLOCK_M: tl.constexpr, BLOCK_E: tl.constexpr):
    b = tl.program_id(0)
    offs = b * BLOCK_M + tl.arange(0, BLOCK_M)
    cols = tl.arange(0, BLOCK_E)
    ok = offs < M
    ids = tl.load(idx_ptr + offs, mask=ok, other=-1)
    hot = (ids[:, None] == cols[None, :]).to(tl.int32)
    before = tl.cumsum(hot, axis=0) - hot  # copies of the same expert earlier in the block
    base = tl.load(base_ptr + b.to(tl.int64) * E + cols, mask=cols < E, other=0)
    slot = tl.sum(tl.where(hot != 0, base[None, :] + before.to(tl.int64), 0), axis=1)
    tl.store(slot_ptr + offs, slot, mask=ok)


def _outputs(idx_TK, num_experts):
    dev = idx_TK.device
    return (torch.empty(idx_TK.shape, dtype=torch.int64, device=dev),
            torch.empty(num_experts, dtype=torch.int64, device=dev))


@torch.library.custom_op("longctx::route_layout", mutates_args=())
def route_layout_op(idx_TK: torch.Tensor, num_experts: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(slot_TK int64, counts_E int64); see the module docstring."""
    flat_M = idx_TK.contiguous().view(-1)
    m, e = flat_M.numel(), num_experts
    slot_TK, counts_E = _outputs(idx_TK, e)
    nb = triton.cdiv(m, _BLOCK_M)
    hist = torch.empty(nb, e, dtype=torch.int32, device=idx_TK.device)
    base = torch.empty(nb, e, dtype=torch.int64, device=idx_TK.device)
    block_e = triton.next_power_of_2(e)
    if m:
        _hist_kernel[(nb,)](flat_M, hist, m, e, BLOCK_M=_BLOCK_M, BLOCK_E=block_e)
    _scan_kernel[(1,)](hist, base, counts_E, nb, e, BLOCK_B=_BLOCK_B, BLOCK_E=block_e)
    if m:
        _slot_kernel[(nb,)](flat_M, base, slot_TK, m, e, BLOCK_M=_BLOCK_M, BLOCK_E=block_e)
    return slot_TK, counts_E


@route_layout_op.register_fake
def _(idx_TK, num_experts):
    return _outputs(idx_TK, num_experts)


def route_layout(idx_TK: torch.Tensor, num_experts: int):
    """(slot_TK, counts_E): moe.permute_layout's unpadded layout of the [T, K] expert ids (each
    in [0, num_experts)), its total rows being T*K."""
    if idx_TK.dim() != 2 or idx_TK.dtype not in (torch.int32, torch.int64):
        raise ValueError(f"idx_TK must be int32 or int64 [T, K], got {idx_TK.dtype} {tuple(idx_TK.shape)}; "
                         "pass the router's top-k ids")
    return route_layout_op(idx_TK, num_experts)
