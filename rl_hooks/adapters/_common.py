"""The two moves every adapter makes: padded rows [B, S] -> the flat RolloutBatch layout [T], and
per-token outputs [T] -> padded rows [B, S] again.

A row's real tokens are the True entries of a bool mask keep_BS (left or right padding, or both,
as long as each row's tokens read in order); boolean indexing is row-major, so x_BS[keep_BS] is
every row's real tokens, one row after another: exactly the flat layout. The inverse writes a
[T] vector back through the same mask, zeros elsewhere.

Legend: B rows, S padded positions, T real tokens, L MoE layers, K top-k.
"""

from __future__ import annotations

from collections.abc import Hashable, Mapping, Sequence

import torch

from rl_hooks.batch import FLOAT_DTYPES, RolloutBatch


class AdapterError(ValueError):
    """A framework batch cannot be adapted; the one-line message names the framework field."""


def fail(framework: str, field: str, message: str) -> None:
    raise AdapterError(f"{framework} field '{field}': {message}")


def get(fields: Mapping, framework: str, name: str, required: bool = True):
    """fields[name] as a tensor, None when absent and not required."""
    if name not in fields or fields[name] is None:
        if required:
            fail(framework, name, "is missing; the adapter needs it (see rl_hooks/adapters)")
        return None
    value = fields[name]
    if not torch.is_tensor(value):
        fail(framework, name, f"is a {type(value).__name__}; pass a torch.Tensor")
    return value


def check_shape(framework: str, name: str, x: torch.Tensor, shape: tuple[int, ...]) -> None:
    if tuple(x.shape[:len(shape)]) != shape or x.ndim < len(shape):
        fail(framework, name, f"has shape {tuple(x.shape)}, expected {shape} (leading dims)")


def check_float(framework: str, name: str, x: torch.Tensor) -> None:
    # Same rule as RolloutBatch, but the message names the framework's own field.
    if x.dtype not in FLOAT_DTYPES:
        fail(framework, name, f"is {x.dtype}; pass float32 or float64 (a bf16 log-prob near -5 "
                              "is only good to 0.03, a 3% error in the importance ratio)")


def check_binary(framework: str, name: str, x: torch.Tensor) -> torch.Tensor:
    """x as bool, refusing values other than 0 / 1."""
    if x.dtype != torch.bool and bool(((x != 0) & (x != 1)).any()):
        fail(framework, name, "holds values other than 0 and 1; it must be a 0/1 mask")
    return x.bool()


def group_index(framework: str, group_ids: Sequence[Hashable], rows: int) -> torch.Tensor:
    """int64 [B]: arbitrary hashable group ids (verl's uid strings, ints) as small integers."""
    if len(group_ids) != rows:
        fail(framework, "group_ids", f"has {len(group_ids)} entries for {rows} rows; give one each")
    index: dict[Hashable, int] = {}
    return torch.tensor([index.setdefault(g, len(index)) for g in group_ids], dtype=torch.int64)


def flatten(keep_BS: torch.Tensor, tokens_BS: torch.Tensor, loss_BS: torch.Tensor,
            floats_BS: Mapping[str, torch.Tensor | None], routes_BSLK: torch.Tensor | None,
            rewards: Sequence[float] | torch.Tensor | None,
            group_ids: torch.Tensor | None) -> RolloutBatch:
    """The RolloutBatch of the real tokens of each row (keep_BS), every row non-empty.

    floats_BS maps RolloutBatch float fields to [B, S] tensors already aligned like ours (the
    value at a position scores that position's token); routes are cast to int16."""
    lengths_B = keep_BS.sum(1)
    cu = torch.zeros(keep_BS.shape[0] + 1, dtype=torch.int64, device=keep_BS.device)
    cu[1:] = lengths_B.cumsum(0)
    extra = {name: x_BS[keep_BS] for name, x_BS in floats_BS.items() if x_BS is not None}
    if routes_BSLK is not None:
        extra["routed_experts"] = routes_BSLK[keep_BS].to(torch.int16)
    if rewards is not None:
        extra["rewards"] = torch.as_tensor(rewards, device=keep_BS.device)
        if not extra["rewards"].is_floating_point():
            extra["rewards"] = extra["rewards"].float()
    if group_ids is not None:
        extra["group_ids"] = group_ids.to(keep_BS.device)
    # Our first token of a row never carries loss (nothing scores it).
    loss_BS = loss_BS & keep_BS
    first = cu[:-1]
    loss_T = loss_BS[keep_BS]
    loss_T[first[lengths_B > 0]] = False
    return RolloutBatch(tokens=tokens_BS[keep_BS].long(), cu_seqlens=cu, loss_mask=loss_T,
                        **extra)


def unflatten(framework: str, name: str, values_T: torch.Tensor,
              keep_BS: torch.Tensor, fill: float = 0) -> torch.Tensor:
    """[B, S, ...]: values_T [T, ...] written back at the real positions, `fill` elsewhere."""
    expected = int(keep_BS.sum())
    if values_T.shape[0] != expected:
        fail(framework, name, f"has {values_T.shape[0]} tokens but the batch has {expected} real "
                              "tokens; pass the output of compute_logprobs on this batch's adapted "
                              "RolloutBatch")
    keep_BS = keep_BS.to(values_T.device)
    out = torch.full((*keep_BS.shape, *values_T.shape[1:]), fill, dtype=values_T.dtype,
                     device=values_T.device)
    out[keep_BS] = values_T
    return out
