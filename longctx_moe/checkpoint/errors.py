"""CheckpointError, and agreement across ranks on whether a collective step succeeded."""

from __future__ import annotations

from typing import Any

import torch.distributed as dist


class CheckpointError(RuntimeError):
    """A checkpoint that cannot be used: the message is one line naming the file and the fix."""



def _all_gather(obj: Any, group=None) -> list[Any]:
    if not (dist.is_available() and dist.is_initialized() and dist.get_world_size(group) > 1):
        return [obj]
    out: list[Any] = [None] * dist.get_world_size(group)
    dist.all_gather_object(out, obj, group=group)
    return out


def agree(error: str | None, payload: Any = None, cls: type[Exception] = CheckpointError, group=None) -> list[Any]:
    """Collective over `group`: every rank's payload, in rank order, when no rank passed an error.

    When some rank did, every rank raises `cls` with the lowest such rank's message, marked
    `agreed` (so only rank 0 needs to print it). Call this wherever a failing rank would
    otherwise skip a collective that its peers then wait in forever.
    """
    gathered = _all_gather((error, payload), group)
    first = next((e for e, _ in gathered if e is not None), None)
    if first is not None:
        exc = cls(first)
        exc.agreed = True  # type: ignore[attr-defined]
        raise exc
    return [p for _, p in gathered]
