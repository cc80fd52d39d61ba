"""ParallelDims: validates the parallel degrees and creates every process group (Parallel Folding).

The same ranks are factored twice, each time with TP fastest (Megatron-Core MoE Parallel Folding):

    attention:  rank = tp  + TP  * (cp + CP * dp)        world = TP  * CP * DP
    MoE:        rank = etp + ETP * (ep + EP * edp)       world = ETP * EP * EDP

With the hierarchical CP backend the CP coordinate itself is split, inner fastest:
cp = cp_inner + CP_INNER * cp_outer (inner = all-to-all inside a node, outer = ring across nodes).

Group names (each rank belongs to exactly one group of each name):
    tp, cp, dp          one attention axis each
    dp_cp               DP x CP: dense-gradient reduction and the loss token count
    tp_cp               TP x CP: one sequence (aux-loss token counts)
    world               every rank (gradients of replicated weights that TP leaves partial)
    ep, etp, edp        the MoE axes; edp reduces expert gradients
    cp_inner, cp_outer  only with cp_backend = "hierarchical"
    cp_sub<s>           Dynamic-CP: consecutive runs of s ranks of each CP group, for each s in
                        parallel.dynamic_cp_sizes

This is the ONLY module that creates process groups. `table()` is pure (no process group is
touched), so layouts can be planned and tested on one process (`longctx-moe plan-groups`).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch.distributed as dist

from longctx_moe.parallel.config import ParallelConfig

CP_BACKENDS = ("ring", "ulysses", "hierarchical")
DISPATCHERS = ("alltoall", "allgather")
DISPATCH_DTYPES = ("none", "bf16", "fp8")
DROP_POLICIES = ("probs", "position")
AUX_LOSS_SCOPES = ("micro_batch", "global_batch")

# (group name, grid, axes spanned). Grids are the rank orderings above, slowest axis first.
_ATTN_AXES = ("dp", "cp", "tp")
_ATTN_HIER_AXES = ("dp", "cp_outer", "cp_inner", "tp")
_MOE_AXES = ("edp", "ep", "etp")
_GROUP_SPECS: tuple[tuple[str, str, tuple[str, ...]], ...] = (
    ("tp", "attn", ("tp",)),
    ("cp", "attn", ("cp",)),
    ("dp", "attn", ("dp",)),
    ("dp_cp", "attn", ("dp", "cp")),
    ("tp_cp", "attn", ("cp", "tp")),
    ("world", "attn", ("dp", "cp", "tp")),
    ("ep", "moe", ("ep",)),
    ("etp", "moe", ("etp",)),
    ("edp", "moe", ("edp",)),
)
_HIER_SPECS = (("cp_inner", "hier", ("cp_inner",)), ("cp_outer", "hier", ("cp_outer",)))


def _fail(msg: str) -> None:
    raise ValueError(msg)


def _check_degrees(cfg: ParallelConfig, world_size: int) -> None:
    if world_size < 1:
        _fail(f"world_size={world_size} must be >= 1")
    for name in ("tp", "cp", "ep", "etp"):
        if getattr(cfg, name) < 1:
            _fail(f"parallel.{name}={getattr(cfg, name)} must be >= 1; set it to a positive degree")
    if cfg.dp != -1 and cfg.dp < 1:
        _fail(f"parallel.dp={cfg.dp} must be >= 1, or -1 to derive it as world // (tp*cp)")
    if world_size % (cfg.tp * cfg.cp):
        _fail(f"world_size={world_size} is not divisible by tp*cp={cfg.tp}*{cfg.cp}="
              f"{cfg.tp * cfg.cp}; choose tp and cp whose product divides the world")
    if cfg.dp != -1 and cfg.tp * cfg.cp * cfg.dp != world_size:
        _fail(f"tp*cp*dp={cfg.tp}*{cfg.cp}*{cfg.dp}={cfg.tp * cfg.cp * cfg.dp} != world_size="
              f"{world_size}; set parallel.dp=-1 to derive dp={world_size // (cfg.tp * cfg.cp)}")
    if world_size % (cfg.etp * cfg.ep):
        _fail(f"world_size={world_size} is not divisible by etp*ep={cfg.etp}*{cfg.ep}="
              f"{cfg.etp * cfg.ep}; choose etp and ep whose product divides the world")


def _check_options(cfg: ParallelConfig) -> None:
    for name, allowed in (("cp_backend", CP_BACKENDS), ("dispatcher", DISPATCHERS),
                          ("dispatch_dtype", DISPATCH_DTYPES), ("drop_policy", DROP_POLICIES),
                          ("aux_loss_scope", AUX_LOSS_SCOPES)):
        value = getattr(cfg, name)
        if value not in allowed:
            _fail(f"parallel.{name}={value!r} is unknown; use one of {allowed}")
    if cfg.capacity_factor is not None and not cfg.capacity_factor > 0:
        _fail(f"parallel.capacity_factor={cfg.capacity_factor} must be > 0, or null for dropless")


def _check_hierarchical(cfg: ParallelConfig) -> tuple[int, int]:
    """Return (cp_inner, cp_outer); (cp, 1) when the backend is not hierarchical."""
    sizes = cfg.hierarchical_sizes
    if cfg.cp_backend != "hierarchical":
        if sizes is not None:
            _fail(f"parallel.hierarchical_sizes={sizes} is set but cp_backend={cfg.cp_backend!r}; "
                  "set cp_backend=hierarchical or remove hierarchical_sizes")
        return cfg.cp, 1
    if sizes is None or len(sizes) != 2 or min(sizes) < 1:
        _fail(f"cp_backend=hierarchical needs hierarchical_sizes=[inner, outer] of two positive "
              f"ints with inner*outer == cp={cfg.cp}; got {sizes}")
    if sizes[0] * sizes[1] != cfg.cp:
        _fail(f"hierarchical_sizes={list(sizes)} multiply to {sizes[0] * sizes[1]} != cp={cfg.cp}; "
              "choose [inner, outer] with inner*outer == cp")
    return int(sizes[0]), int(sizes[1])


def _check_dynamic_cp(cfg: ParallelConfig) -> tuple[int, ...]:
    sizes = tuple(sorted(set(cfg.dynamic_cp_sizes or ())))
    for size in sizes:
        if size < 1 or cfg.cp % size:
            _fail(f"parallel.dynamic_cp_sizes holds {size}, which does not divide cp={cfg.cp}; "
                  "use divisors of cp")
    return sizes


def _check_model(cfg: ParallelConfig, model_cfg: Any, cp_a2a: int) -> None:
    """Checks against the model; any attribute the model config lacks is skipped."""
    num_experts = getattr(model_cfg, "num_experts", None)
    if num_experts is not None and num_experts % cfg.ep:
        _fail(f"num_experts={num_experts} is not divisible by ep={cfg.ep}; choose ep dividing "
              "the number of experts")
    heads = getattr(model_cfg, "num_heads", None)
    if heads is not None and heads % cfg.tp:
        _fail(f"num_heads={heads} is not divisible by tp={cfg.tp}; choose tp dividing num_heads")
    kv = getattr(model_cfg, "num_kv_heads", None)
    # KV rule (Megatron): kv heads are split when tp divides them, replicated tp/kv times when
    # kv divides tp; anything else would give a rank a fraction of a head.
    if kv is not None and kv % cfg.tp and cfg.tp % kv:
        _fail(f"num_kv_heads={kv} and tp={cfg.tp}: one must divide the other (KV heads are "
              "split, or replicated tp/num_kv_heads times); change tp or num_kv_heads")
    if heads is not None and cp_a2a > 1 and (heads // cfg.tp) % cp_a2a:
        _fail(f"the all-to-all CP axis ({cfg.cp_backend}, size {cp_a2a}) splits heads: "
              f"num_heads/tp={heads // cfg.tp} is not divisible by {cp_a2a}; use cp_backend=ring "
              "or a smaller all-to-all size")
    if cfg.aux_loss_scope == "global_batch" and getattr(model_cfg, "aux_loss_type", None) == "seq":
        _fail("parallel.aux_loss_scope=global_batch balances the whole batch but "
              "model.aux_loss_type=seq balances each document; use aux_loss_type=switch or "
              "aux_loss_scope=micro_batch")
    ffn = getattr(model_cfg, "expert_hidden_size", None)
    if ffn is not None and ffn % cfg.etp:
        _fail(f"expert_hidden_size={ffn} is not divisible by etp={cfg.etp}; choose etp dividing it")


def _groups_along(grid: np.ndarray, axes: tuple[str, ...], keep: tuple[str, ...]) -> list[list[int]]:
    """Rank lists of the groups spanning `keep` axes of `grid` (one list per fixed rest)."""
    rest = [i for i, a in enumerate(axes) if a not in keep]
    kept = [axes.index(a) for a in axes if a in keep]  # keep grid order: ranks ascend in a group
    moved = np.transpose(grid, rest + kept)
    size = int(np.prod([grid.shape[i] for i in kept]))
    return [[int(r) for r in row] for row in moved.reshape(-1, size)]


@dataclass
class ParallelDims:
    """Validated degrees and, after `build_groups`, this rank's process group of every name."""

    world_size: int
    tp: int
    cp: int
    dp: int
    ep: int
    etp: int
    edp: int
    cp_backend: str = "ring"
    cp_inner: int = 1
    cp_outer: int = 1
    dynamic_cp_sizes: tuple[int, ...] = ()
    config: ParallelConfig | None = field(default=None, repr=False)  # what it was built from
    rank: int | None = None
    _groups: dict[str, Any] = field(default_factory=dict, repr=False)

    @classmethod
    def from_config(cls, cfg: ParallelConfig, world_size: int, model_cfg: Any = None) -> ParallelDims:
        """Validate `cfg` for `world_size` ranks (and the model, when given); derive dp and edp."""
        _check_degrees(cfg, world_size)
        _check_options(cfg)
        inner, outer = _check_hierarchical(cfg)
        dyn = _check_dynamic_cp(cfg)
        cp_a2a = {"ulysses": cfg.cp, "hierarchical": inner}.get(cfg.cp_backend, 1)
        if model_cfg is not None:
            _check_model(cfg, model_cfg, cp_a2a)
        return cls(world_size=world_size, tp=cfg.tp, cp=cfg.cp, dp=world_size // (cfg.tp * cfg.cp),
                   ep=cfg.ep, etp=cfg.etp, edp=world_size // (cfg.etp * cfg.ep),
                   cp_backend=cfg.cp_backend, cp_inner=inner, cp_outer=outer,
                   dynamic_cp_sizes=dyn, config=cfg)

    @property
    def hierarchical(self) -> bool:
        return self.cp_backend == "hierarchical"

    def names(self) -> list[str]:
        """Every group name, in the order `build_groups` creates them."""
        extra = [n for n, _, _ in _HIER_SPECS] if self.hierarchical else []
        dynamic = [f"cp_sub{s}" for s in self.dynamic_cp_sizes]
        return [n for n, _, _ in _GROUP_SPECS] + extra + dynamic

    def table(self) -> dict[str, list[list[int]]]:
        """name -> every group's ranks (ascending), computed from the rank orderings; pure."""
        w = np.arange(self.world_size)
        grids = {
            "attn": (w.reshape(self.dp, self.cp, self.tp), _ATTN_AXES),
            "hier": (w.reshape(self.dp, self.cp_outer, self.cp_inner, self.tp), _ATTN_HIER_AXES),
            "moe": (w.reshape(self.edp, self.ep, self.etp), _MOE_AXES),
        }
        specs = _GROUP_SPECS + (_HIER_SPECS if self.hierarchical else ())
        table = {name: _groups_along(*grids[g], keep) for name, g, keep in specs}
        for s in self.dynamic_cp_sizes:
            table[f"cp_sub{s}"] = [g[i:i + s] for g in table["cp"] for i in range(0, self.cp, s)]
        return table

    def size(self, name: str) -> int:
        """Number of ranks in each group called `name`."""
        return len(self._table_for(name)[0])

    def ranks(self, name: str, rank: int | None = None) -> list[int]:
        """The ranks of the `name` group that contains `rank` (default: this rank)."""
        rank = self._rank(rank)
        return next(g for g in self._table_for(name) if rank in g)

    def rank_in(self, name: str, rank: int | None = None) -> int:
        """Position of `rank` (default: this rank) inside its `name` group."""
        rank = self._rank(rank)
        return self.ranks(name, rank).index(rank)

    def group(self, name: str):
        """This rank's `name` process group; None when world_size == 1 (no communication)."""
        self._table_for(name)
        if self.world_size == 1:
            return None
        if name not in self._groups:
            raise RuntimeError(f"group {name!r} does not exist yet; call dims.build_groups(rank) "
                               "on every rank after init_process_group")
        return self._groups[name]

    def build_groups(self, rank: int) -> None:
        """Create every group with `dist.new_group`; every rank must call this (same order)."""
        if not 0 <= rank < self.world_size:
            raise ValueError(f"rank={rank} is outside world_size={self.world_size}")
        self.rank = rank
        if self.world_size == 1:
            return
        if not dist.is_initialized() or dist.get_world_size() != self.world_size:
            got = dist.get_world_size() if dist.is_initialized() else "not initialised"
            raise RuntimeError(f"ParallelDims is for world_size={self.world_size} but the default "
                               f"process group is {got}; init_process_group with that many ranks")
        table = self.table()
        for name in self.names():
            for ranks in table[name]:
                # new_group is collective over the world even for ranks outside `ranks`.
                g = dist.new_group(ranks=ranks)
                if rank in ranks:
                    self._groups[name] = g

    def _table_for(self, name: str) -> list[list[int]]:
        table = self.table()
        if name not in table:
            raise KeyError(f"unknown group {name!r}; known: {', '.join(table)}")
        return table[name]

    def _rank(self, rank: int | None) -> int:
        if rank is None:
            if self.rank is None:
                raise RuntimeError("this rank is unknown; pass rank= or call build_groups(rank)")
            return self.rank
        return rank
