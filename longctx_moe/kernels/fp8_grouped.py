"""One FP8 GEMM for every expert's forward product: torch's `_scaled_grouped_mm` on Hopper.

With per-tensor scaling (model.fp8_recipe=tensor or delayed), the experts' forward product
x @ w_e^T of every expert e is E4M3 x E4M3, which torch's grouped FP8 GEMM takes in one call
(row-wise float32 scales: the activation's one scale repeated per row, each expert's weight scale
repeated per output column; the groups' row ends as int32 offsets), where the loop of
`fp8.scaled_mm` launches one GEMM (and its slicing) per expert: on a GPU step that is host-bound,
a layer of 32 experts issues 2 calls instead of 64 in its forward. The backward's products keep
the loop: their output gradients are E5M2, which the grouped kernel does not take.

It runs where the run's resolution chose it (execution.py, Ops.fp8_grouped: torch has it and the
GPU has compute capability 9.x; the recipe object carries the choice), for bf16 results; anywhere
else the caller loops. A call that fails turns it off for the process with one warning, and the loop
takes over (the result is the same sum either way). Not run on a GPU yet: the tests check every
call against torch's own meta checks of `_scaled_grouped_mm` (layouts, dtypes, scale shapes).
Shape legend: M rows (sorted by expert), K contraction, N output features, E experts.
"""

from __future__ import annotations

import itertools
import warnings

import torch

_state = {"off": None}  # the reason the grouped call is off for this process, once one failed


def usable(x_MK: torch.Tensor, out_dtype: torch.dtype, groups: int) -> bool:
    """Whether the forward of `groups` experts on E4M3 rows x_MK can be one grouped call, on a
    device the run resolved it for (the device is not asked here: that is Ops.fp8_grouped)."""
    return (groups > 1 and out_dtype == torch.bfloat16 and x_MK.dtype == torch.float8_e4m3fn
            and _state["off"] is None)


def runs_on(device_type: str, capability: tuple[int, int] | None) -> bool:
    """Whether torch's grouped FP8 GEMM serves a `device_type` GPU of compute `capability`
    (None: unknown): this torch has it, and the GPU is a Hopper."""
    return (device_type == "cuda" and capability is not None and capability[0] == 9
            and hasattr(torch, "_scaled_grouped_mm"))


def forward(x: tuple[torch.Tensor, torch.Tensor], ws: list, counts: list[int]) -> torch.Tensor | None:
    """y [M, N] bf16: rows of expert e times w_e^T, for x = (E4M3 rows [M, K], their scale) and ws
    [(E4M3 w_e [N, K], its scale)]; None (the caller loops) if the call fails."""
    try:
        return call(x, ws, counts)
    except RuntimeError as e:
        _state["off"] = f"{type(e).__name__}: {str(e).splitlines()[0][:200]}"
        warnings.warn(f"longctx_moe: torch's grouped FP8 GEMM failed ({_state['off']}); the experts' FP8 "
                      "forward runs one GEMM per expert from now on", stacklevel=2)
        return None


def call(x, ws, counts):
    """The grouped call itself (the tests run it on meta tensors through torch's checks)."""
    x_q, inv_x = x
    a = x_q.contiguous()
    b = torch.stack([w for w, _ in ws]).transpose(1, 2)  # [E, K, N], each expert column-major
    rows, (E, _, N) = a.shape[0], b.shape
    scale_a = inv_x.reshape(1).float().expand(rows).contiguous()
    scale_b = torch.stack([s.reshape(1) for _, s in ws]).float().expand(E, N).contiguous()
    offs = torch.tensor(list(itertools.accumulate(counts)), dtype=torch.int32).to(a.device, non_blocking=True)
    return torch._scaled_grouped_mm(a, b, scale_a, scale_b, offs=offs, out_dtype=torch.bfloat16)
