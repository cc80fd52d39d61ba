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
    dcp<s>              Dynamic-CP: consecutive runs of s ranks of each dp_cp group, for every
                        power of two 1 < s < dp*cp up to parallel.max_cp (s = dp*cp is dp_cp
                        itself; s = 1 needs no group)
    dcp<s>_outer        Dynamic-CP with the hierarchical backend: the ring of a run of s >
                        cp_inner ranks, every cp_inner-th rank of the run (its all-to-all is the
                        run's cp_inner groups, which are the mesh's: inner is fastest)

This is the ONLY module that creates process groups. `table()` is pure (no process group is
touched), so layouts can be planned and tested on one process (`longctx-moe plan-groups`).
"""

from __future__ import annotations

import gc
from dataclasses import dataclass, field
from enum import Enum
from typing import Any

import numpy as np
import torch.distributed as dist

from longctx_moe.parallel.config import ParallelConfig


class Axis(str, Enum):
    """Group names. A str Enum: `Axis.CP == "cp"`, so plain strings are accepted everywhere."""

    TP = "tp"
    CP = "cp"
    DP = "dp"
    DP_CP = "dp_cp"
    TP_CP = "tp_cp"
    WORLD = "world"
    EP = "ep"
    ETP = "etp"
    EDP = "edp"
    CP_INNER = "cp_inner"
    CP_OUTER = "cp_outer"

    # The value, not "Axis.CP", in messages and f-strings (Python 3.10 to 3.13 differ otherwise).
    def __str__(self) -> str:
        return self.value

    __format__ = str.__format__


# (group name, grid, axes spanned). Grids are the rank orderings above, slowest axis first.
_ATTN_AXES = (Axis.DP, Axis.CP, Axis.TP)
_ATTN_HIER_AXES = (Axis.DP, Axis.CP_OUTER, Axis.CP_INNER, Axis.TP)
_MOE_AXES = (Axis.EDP, Axis.EP, Axis.ETP)
_GROUP_SPECS: tuple[tuple[Axis, str, tuple[Axis, ...]], ...] = (
    (Axis.TP, "attn", (Axis.TP,)),
    (Axis.CP, "attn", (Axis.CP,)),
    (Axis.DP, "attn", (Axis.DP,)),
    (Axis.DP_CP, "attn", (Axis.DP, Axis.CP)),
    (Axis.TP_CP, "attn", (Axis.CP, Axis.TP)),
    (Axis.WORLD, "attn", (Axis.DP, Axis.CP, Axis.TP)),
    (Axis.EP, "moe", (Axis.EP,)),
    (Axis.ETP, "moe", (Axis.ETP,)),
    (Axis.EDP, "moe", (Axis.EDP,)),
)
_HIER_SPECS = ((Axis.CP_INNER, "hier", (Axis.CP_INNER,)), (Axis.CP_OUTER, "hier", (Axis.CP_OUTER,)))
# The fields the group table is computed from: fixed once a ParallelDims exists.
_LAYOUT_FIELDS = frozenset({"world_size", "tp", "cp", "dp", "ep", "etp", "edp", "cp_backend",
                            "cp_inner", "cp_outer", "dynamic_cp_sizes", "dynamic_outer_sizes"})


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


def _check_dynamic_cp(cfg: ParallelConfig, block: int) -> tuple[int, ...]:
    """The Dynamic-CP sub-group sizes that need groups of their own (powers of two 1 < s <
    block = dp*cp, up to max_cp); () without Dynamic-CP."""
    if not cfg.dynamic_cp:
        for key in ("max_cp", "max_tokens_per_rank"):  # dcp_* have defaults: harmless
            if getattr(cfg, key):
                _fail(f"parallel.{key} is set but parallel.dynamic_cp is false; set "
                      "parallel.dynamic_cp=true or remove the key")
        return ()
    max_cp = cfg.dynamic_max_cp
    if max_cp < 1 or max_cp & (max_cp - 1) or max_cp > block:
        _fail(f"parallel.max_cp={max_cp} must be a power of two <= dp*cp={block} (the DP x CP "
              "block the sub-groups are cut from); choose one, or 0 for cp")
    if block & (block - 1):
        _fail(f"Dynamic-CP cuts the DP x CP block into power-of-two runs, but dp*cp={block}; "
              "choose tp, cp and the world size so that world / tp is a power of two")
    if not (cfg.dcp_tflops > 0 and cfg.dcp_bandwidth_gbps > 0):
        _fail("parallel.dcp_tflops and parallel.dcp_bandwidth_gbps must be > 0")
    if cfg.max_tokens_per_rank < 0:
        _fail(f"parallel.max_tokens_per_rank={cfg.max_tokens_per_rank} must be >= 0 (0: "
              "data.micro_batch_tokens)")
    return tuple(s for s in (2 ** i for i in range(1, max_cp.bit_length())) if s < block)


def _dynamic_outer_sizes(cfg: ParallelConfig, inner: int) -> tuple[int, ...]:
    """Run sizes that need ring groups of their own under hierarchical Dynamic-CP: the powers of
    two cp_inner < s <= max_cp (a run of s <= cp_inner ranks runs Ulysses on its own group)."""
    if not (cfg.dynamic_cp and cfg.cp_backend == "hierarchical"):
        return ()
    max_cp = cfg.dynamic_max_cp
    return tuple(2 ** i for i in range(max_cp.bit_length()) if inner < 2 ** i <= max_cp)


def _check_balance(cfg: ParallelConfig, balance: Any) -> None:
    if cfg.aux_loss_scope == "global_batch" and getattr(balance, "aux_loss_type", None) == "seq":
        _fail("parallel.aux_loss_scope=global_batch balances the whole batch but "
              "balance.aux_loss_type=seq balances each document; use balance.aux_loss_type=switch or "
              "parallel.aux_loss_scope=micro_batch")


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
    ffn = getattr(model_cfg, "expert_hidden_size", None)
    if ffn is not None and ffn % cfg.etp:
        _fail(f"expert_hidden_size={ffn} is not divisible by etp={cfg.etp}; choose etp dividing it")


def layout_degrees(cfg: ParallelConfig, world_size: int, model_cfg: Any = None,
                   balance: Any = None) -> dict[str, Any]:
    """Every layout rule of `cfg` on `world_size` ranks (and against the model and the balance
    section, when given); the degrees ParallelDims is made of, or ValueError. No group table is
    computed: judging thousands of layouts (longctx-moe plan) costs the rules alone."""
    _check_degrees(cfg, world_size)
    inner, outer = _check_hierarchical(cfg)
    dyn = _check_dynamic_cp(cfg, world_size // cfg.tp)
    cp_a2a = {"ulysses": max(cfg.cp, cfg.max_cp), "hierarchical": inner}.get(cfg.cp_backend, 1)
    if model_cfg is not None:
        _check_model(cfg, model_cfg, cp_a2a)
    if balance is not None:
        _check_balance(cfg, balance)
    return dict(world_size=world_size, tp=cfg.tp, cp=cfg.cp, dp=world_size // (cfg.tp * cfg.cp),
                ep=cfg.ep, etp=cfg.etp, edp=world_size // (cfg.etp * cfg.ep),
                cp_backend=cfg.cp_backend, cp_inner=inner, cp_outer=outer,
                dynamic_cp_sizes=dyn, dynamic_outer_sizes=_dynamic_outer_sizes(cfg, inner))


def _groups_along(grid: np.ndarray, axes: tuple[str, ...], keep: tuple[str, ...]) -> list[list[int]]:
    """Rank lists of the groups spanning `keep` axes of `grid` (one list per fixed rest)."""
    rest = [i for i, a in enumerate(axes) if a not in keep]
    kept = [axes.index(a) for a in axes if a in keep]  # keep grid order: ranks ascend in a group
    moved = np.transpose(grid, rest + kept)
    size = int(np.prod([grid.shape[i] for i in kept]))
    return [[int(r) for r in row] for row in moved.reshape(-1, size)]


# (default group, {(name, ranks): group}): the groups made so far under this default group.
_made: tuple[Any, dict[tuple[str, tuple[int, ...]], Any]] = (None, {})


def _new_group(name: str, ranks: list[int]):
    """`dist.new_group(ranks)`, made once per name and ranks while the default group lives: each
    gloo group holds its own TCP mesh and loop thread until the process ends, so a process that
    builds a second ParallelDims (another runtime, an RL policy rebuilt) would otherwise open
    them all again. One group per name as before, so two names never share a group's order of
    operations. new_group is collective over the world even for ranks outside `ranks`; every
    rank builds the same tables in the same order, so every rank hits or misses together."""
    global _made
    world, made = _made
    if world is not dist.group.WORLD:
        _made = world, made = dist.group.WORLD, {}
    key = (name, tuple(ranks))
    if key not in made:
        made[key] = dist.new_group(ranks=ranks)
    return made[key]


def destroy_process_groups(collect: bool = True) -> None:
    """End this process's distributed state now: forget the cached groups and destroy the default
    group with all of them. Their gloo worker threads and sockets then close here, while the peer
    ranks still run; left to the interpreter's exit, they were destroyed after a peer had gone and
    now and then aborted the process ("terminate called without an active exception").
    `collect=False` skips the garbage collection that frees groups held in reference cycles:
    for groups that hold no threads or sockets (the rehearsal's fake ones), where a full
    collection (~0.15 s with torch loaded) would be most of a small rehearsal's cost."""
    global _made
    _made = (None, {})
    if collect:
        gc.collect()  # a ParallelDims in a reference cycle would keep its groups alive until exit
    if dist.is_initialized():
        dist.destroy_process_group()


@dataclass
class ParallelDims:
    """Validated degrees and, after `build_groups`, this rank's process group of every name.

    The degree fields are fixed after construction: the group table is computed from them once,
    in __post_init__, because `size`, `ranks`, `rank_in` and `group` run on every attention call
    under CP. Assigning one of them afterwards raises; build a new ParallelDims instead.
    """

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
    dynamic_outer_sizes: tuple[int, ...] = ()
    config: ParallelConfig | None = field(default=None, repr=False)  # what it was built from
    rank: int | None = None
    _groups: dict[str, Any] = field(default_factory=dict, repr=False)
    _table: dict[str, list[list[int]]] = field(init=False, repr=False, compare=False)
    _group_of: dict[str, dict[int, list[int]]] = field(init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        table = self._compute_table()
        self._group_of = {name: {r: g for g in groups for r in g} for name, groups in table.items()}
        self._table = table  # set last: from here on the layout fields are frozen

    def __setattr__(self, name: str, value: Any) -> None:
        if name in _LAYOUT_FIELDS and "_table" in self.__dict__:
            raise AttributeError(f"ParallelDims.{name} is fixed after construction (the group table "
                                 "is computed from it); build a new ParallelDims instead")
        object.__setattr__(self, name, value)

    @classmethod
    def from_config(cls, cfg: ParallelConfig, world_size: int, model_cfg: Any = None,
                    balance: Any = None) -> ParallelDims:
        """Validate `cfg` for `world_size` ranks (and the model and the balance section, when
        given); derive dp and edp."""
        return cls(**layout_degrees(cfg, world_size, model_cfg, balance), config=cfg)

    @property
    def hierarchical(self) -> bool:
        return self.cp_backend == "hierarchical"

    def names(self) -> list[str]:
        """Every group name, in the order `build_groups` creates them."""
        return list(self._table)

    def table(self) -> dict[str, list[list[int]]]:
        """name -> every group's ranks (ascending), computed from the rank orderings; pure.

        A copy: callers may not change the cached table."""
        return {name: [list(g) for g in groups] for name, groups in self._table.items()}

    def _compute_table(self) -> dict[str, list[list[int]]]:
        w = np.arange(self.world_size)
        grids = {
            "attn": (w.reshape(self.dp, self.cp, self.tp), _ATTN_AXES),
            "hier": (w.reshape(self.dp, self.cp_outer, self.cp_inner, self.tp), _ATTN_HIER_AXES),
            "moe": (w.reshape(self.edp, self.ep, self.etp), _MOE_AXES),
        }
        specs = _GROUP_SPECS + (_HIER_SPECS if self.hierarchical else ())
        table = {name.value: _groups_along(*grids[g], keep) for name, g, keep in specs}
        block = self.dp * self.cp
        for s in self.dynamic_cp_sizes:
            table[f"dcp{s}"] = [g[i:i + s] for g in table[Axis.DP_CP] for i in range(0, block, s)]
        for s in self.dynamic_outer_sizes:
            table[f"dcp{s}_outer"] = [g[i + j:i + s:self.cp_inner] for g in table[Axis.DP_CP]
                                      for i in range(0, block, s) for j in range(self.cp_inner)]
        return table

    def dynamic_group(self, size: int) -> tuple[Any, int]:
        """(process group, this rank's position in it) of this rank's Dynamic-CP run of `size`
        consecutive ranks of its dp_cp group: dp_cp itself for the whole block, (None, 0) for 1."""
        if size == 1:
            return None, 0
        name = Axis.DP_CP if size == self.dp * self.cp else f"dcp{size}"
        return self.group(name), self.rank_in(name)

    def dynamic_hierarchical_groups(self, size: int) -> tuple[Any, Any]:
        """(inner all-to-all group, outer ring group) of this rank's hierarchical Dynamic-CP run
        of `size` > cp_inner ranks."""
        return self.group(Axis.CP_INNER), self.group(f"dcp{size}_outer")

    def size(self, name: str) -> int:
        """Number of ranks in each group called `name` (an Axis or its string)."""
        return len(self._table_for(name)[0])

    def ranks(self, name: str, rank: int | None = None) -> list[int]:
        """The ranks of the `name` group that contains `rank` (default: this rank)."""
        self._table_for(name)
        return list(self._group_of[name][self._rank(rank)])

    def rank_in(self, name: str, rank: int | None = None) -> int:
        """Position of `rank` (default: this rank) inside its `name` group."""
        rank = self._rank(rank)
        self._table_for(name)
        return self._group_of[name][rank].index(rank)

    def group(self, name: str):
        """This rank's `name` process group; None when world_size == 1 (no communication)."""
        self._table_for(name)
        if self.world_size == 1:
            return None
        if name not in self._groups:
            raise RuntimeError(f"group {name!r} does not exist yet; call dims.build_groups(rank) "
                               "on every rank after init_process_group")
        return self._groups[name]

    def group_or_none(self, name: str):
        """This rank's `name` group, or None when that group has one rank: the collectives and
        kernels that take a group treat None as "nothing to communicate"."""
        return self.group(name) if self.size(name) > 1 else None

    def build_groups(self, rank: int) -> None:
        """Create every group with `dist.new_group` (or take the one an earlier ParallelDims of
        this process made for the same name and ranks); every rank must call this (same order)."""
        if not 0 <= rank < self.world_size:
            raise ValueError(f"rank={rank} is outside world_size={self.world_size}")
        self.rank = rank
        if self.world_size == 1:
            return
        if not dist.is_initialized() or dist.get_world_size() != self.world_size:
            got = dist.get_world_size() if dist.is_initialized() else "not initialised"
            raise RuntimeError(f"ParallelDims is for world_size={self.world_size} but the default "
                               f"process group is {got}; init_process_group with that many ranks")
        for name, groups in self._table.items():
            for ranks in groups:
                g = _new_group(name, ranks)
                if rank in ranks:
                    self._groups[name] = g

    def _table_for(self, name: str) -> list[list[int]]:
        if name not in self._table:
            raise KeyError(f"unknown group {str(name)!r}; known: {', '.join(self._table)}")
        return self._table[name]

    def _rank(self, rank: int | None) -> int:
        if rank is None:
            if self.rank is None:
                raise RuntimeError("this rank is unknown; pass rank= or call build_groups(rank)")
            return self.rank
        if not 0 <= rank < self.world_size:
            raise ValueError(f"rank={rank} is outside world_size={self.world_size}")
        return rank
