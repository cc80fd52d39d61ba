"""Every parallel layout of a model on N GPUs that the configuration accepts.

A candidate is a choice of TP (with sequence parallelism when TP > 1), CP and its backend (ring,
Ulysses, hierarchical with a node-sized all-to-all inside), EP, ETP, Dynamic-CP, the recompute
mode and the distributed optimizer; DP and EDP follow from the world. Each candidate becomes the
Config a user would write, and `build.check_layout` (with the config's own validation) judges it:
a candidate it refuses is dropped with its one-line reason, never proposed.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterator

from longctx_moe.build import check_layout
from longctx_moe.config import Config, ConfigError, validate
from longctx_moe.model.recompute import MODES as RECOMPUTE_MODES


@dataclasses.dataclass(frozen=True)
class Layout:
    tp: int
    cp: int
    cp_backend: str  # ring | ulysses | hierarchical
    cp_inner: int  # all-to-all size of hierarchical CP (cp otherwise)
    ep: int
    etp: int
    dynamic_cp: bool
    recompute: str
    distributed_optimizer: bool
    world: int

    @property
    def dp(self) -> int:
        return self.world // (self.tp * self.cp)

    @property
    def edp(self) -> int:
        return self.world // (self.ep * self.etp)

    @property
    def model_parallel(self) -> int:
        """Ways one layer's weights are split on a rank (attention's TP times the experts' EP x ETP
        over the attention's): what more memory per GPU lets a layout give up."""
        return self.tp * self.cp * self.ep * self.etp

    def label(self) -> str:
        cp = f"cp{self.cp}"
        if self.cp > 1:
            cp += {"ring": "r", "ulysses": "u"}.get(self.cp_backend, f"h{self.cp_inner}")
        return (f"tp{self.tp} {cp}{'+dyn' if self.dynamic_cp else ''} dp{self.dp} ep{self.ep} "
                f"etp{self.etp} rc={self.recompute}{' dopt' if self.distributed_optimizer else ''}")

    def as_dict(self) -> dict:
        return {**dataclasses.asdict(self), "dp": self.dp, "edp": self.edp}


def _powers(limit: int) -> list[int]:
    return [2**i for i in range(limit.bit_length()) if 2**i <= limit]


def _divisors(n: int) -> list[int]:
    return [d for d in range(1, n + 1) if n % d == 0]


def candidates(world: int, num_experts: int, gpus_per_node: int = 8) -> Iterator[Layout]:
    """Every combination worth judging: TP inside a node (its collectives run every layer), CP and
    EP degrees dividing the world, ETP a power of two inside a node."""
    for tp in [t for t in _powers(gpus_per_node) if world % t == 0]:
        for cp in [c for c in _divisors(world // tp) if c & (c - 1) == 0]:
            backends = [("ring", cp)] if cp == 1 else [("ring", cp), ("ulysses", cp)] + [
                ("hierarchical", i) for i in _powers(gpus_per_node // tp) if 1 < i < cp]
            for backend, inner in backends:
                for ep in [e for e in _divisors(max(num_experts, 1)) if world % e == 0]:
                    for etp in [t for t in _powers(gpus_per_node) if world % (t * ep) == 0]:
                        for dyn in (False, True) if world // tp > 1 else (False,):
                            for rc in RECOMPUTE_MODES:
                                for dopt in (False, True) if world > 1 else (False,):
                                    yield Layout(tp, cp, backend, inner, ep, etp, dyn, rc, dopt, world)


def config_of(base: Config, layout: Layout, max_tokens_per_rank: int = 0) -> Config:
    """`base` with `layout`'s parallel section and recompute mode: the config a user would run."""
    p = dataclasses.replace(
        base.parallel, tp=layout.tp, sequence_parallel=layout.tp > 1, cp=layout.cp, dp=-1,
        ep=layout.ep, etp=layout.etp, cp_backend=layout.cp_backend,
        hierarchical_sizes=[layout.cp_inner, layout.cp // layout.cp_inner]
        if layout.cp_backend == "hierarchical" else None,
        dynamic_cp=layout.dynamic_cp, max_cp=0,
        max_tokens_per_rank=max_tokens_per_rank if layout.dynamic_cp else 0,
        distributed_optimizer=layout.distributed_optimizer)
    return dataclasses.replace(base, parallel=p, train=dataclasses.replace(base.train, recompute=layout.recompute))


def judge(base: Config, layout: Layout) -> str | None:
    """None when the configuration accepts `layout`, else its one-line reason."""
    try:
        cfg = config_of(base, layout)
        validate(cfg)
        check_layout(cfg, layout.world, table=False)
    except (ConfigError, ValueError) as e:
        return str(e)
    return None


def accepted(base: Config, world: int, gpus_per_node: int = 8) -> tuple[list[Layout], dict[str, int]]:
    """(the layouts the configuration accepts, refusal reason -> how many candidates it refused)."""
    ok, refused = [], {}
    for layout in candidates(world, base.model.num_experts, gpus_per_node):
        reason = judge(base, layout)
        if reason is None:
            ok.append(layout)
        else:
            refused[reason] = refused.get(reason, 0) + 1
    return ok, refused
