"""The routing a rehearsal assumes, fed to the program's one routing seam
(longctx_moe.parallel.comm.RoutingCounts) in place of the device's counts, which meta tensors
do not have.

- balanced: every rank spreads its T*K assignments evenly over the experts (the aim of the
  balance losses; what a well-trained router does on average);
- skewed: expert i's share is proportional to 1 / (i + 1) (Zipf, s = 1), the same on every rank,
  so EP rank 0 holds the hottest experts (an early or drifting router; the busiest rank's
  memory and time).
Capacity (parallel.capacity_factor) caps each expert's kept rows as the program does.
"""

from __future__ import annotations

import torch

from longctx_moe.parallel.comm import RouteTable, RoutingCounts

KINDS = ("balanced", "skewed")


class AssumedRouting(RoutingCounts):
    def __init__(self, kind: str = "balanced"):
        if kind not in KINDS:
            raise ValueError(f"--routing {kind!r}: choose one of {', '.join(KINDS)}")
        self.kind = kind
        self.reads = 0  # each one a device-to-host copy (a sync) on a GPU

    def read(self, table: torch.Tensor, spec: RouteTable) -> torch.Tensor:
        self.reads += 1
        n, e = spec.tokens * spec.top_k, spec.num_experts
        if self.kind == "balanced":
            share = torch.full((e,), 1.0 / e, dtype=torch.float64)
        else:
            share = 1.0 / torch.arange(1, e + 1, dtype=torch.float64)
            share /= share.sum()
        row = _integer_split(n, share)
        if spec.capacity is not None:
            row = row.clamp(max=spec.capacity)
        return torch.cat([row, torch.tensor([spec.tokens])]).expand(table.shape).clone()


def _integer_split(n: int, share: torch.Tensor) -> torch.Tensor:
    """n split by `share` into int64 parts summing to n (largest remainders first)."""
    exact = share * n
    row = exact.floor().to(torch.int64)
    rest = n - int(row.sum())
    row[torch.argsort(exact - row, descending=True)[:rest]] += 1
    return row
