"""ParallelDims: group tables against hand-computed layouts, validation errors, real groups on gloo."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch
import torch.distributed as dist

from longctx_moe.model.config import BalanceConfig
from longctx_moe.parallel.config import ParallelConfig
from longctx_moe.parallel.dims import Axis, ParallelDims
from longctx_moe.parallel.plan_groups import main as plan_groups_main


def _dims(world, **kw):
    return ParallelDims.from_config(ParallelConfig(**kw), world)


def test_world8_tp2_cp2_dp2_attention_and_ep4_edp2_moe_group_ranks():
    # Folding: world 8, TP2 CP2 DP2 attention, ETP1 EP4 EDP2 MoE over the same ranks.
    t = _dims(8, tp=2, cp=2, ep=4).table()
    assert t["tp"] == [[0, 1], [2, 3], [4, 5], [6, 7]]
    assert t["cp"] == [[0, 2], [1, 3], [4, 6], [5, 7]]
    assert t["dp"] == [[0, 4], [1, 5], [2, 6], [3, 7]]
    assert t["ep"] == [[0, 1, 2, 3], [4, 5, 6, 7]]
    assert t["edp"] == [[0, 4], [1, 5], [2, 6], [3, 7]]
    assert t["etp"] == [[r] for r in range(8)]
    assert t["dp_cp"] == [[0, 2, 4, 6], [1, 3, 5, 7]]
    assert t["tp_cp"] == [[0, 1, 2, 3], [4, 5, 6, 7]]


def test_pure_data_parallel_and_ep_with_etp():
    t = _dims(4, ep=2).table()
    assert t["tp"] == [[0], [1], [2], [3]] and t["cp"] == [[0], [1], [2], [3]]
    assert t["dp"] == [[0, 1, 2, 3]] and t["dp_cp"] == [[0, 1, 2, 3]]
    assert t["ep"] == [[0, 1], [2, 3]] and t["edp"] == [[0, 2], [1, 3]]
    # world 8, ETP2 EP2 EDP2: rank = etp + 2*(ep + 2*edp).
    t = _dims(8, tp=4, etp=2, ep=2).table()
    assert t["etp"] == [[0, 1], [2, 3], [4, 5], [6, 7]]
    assert t["ep"] == [[0, 2], [1, 3], [4, 6], [5, 7]]
    assert t["edp"] == [[0, 4], [1, 5], [2, 6], [3, 7]]
    assert t["tp"] == [[0, 1, 2, 3], [4, 5, 6, 7]] and t["dp"] == [[0, 4], [1, 5], [2, 6], [3, 7]]


def test_hierarchical_cp_world4_and_16():
    # world 4, CP4 as hierarchical 2x2 (inner fastest), EP2 EDP2.
    d = _dims(4, cp=4, ep=2, cp_backend="hierarchical", hierarchical_sizes=[2, 2])
    t = d.table()
    assert t["cp"] == [[0, 1, 2, 3]] and t["dp"] == [[0], [1], [2], [3]]
    assert t["cp_inner"] == [[0, 1], [2, 3]] and t["cp_outer"] == [[0, 2], [1, 3]]
    assert t["ep"] == [[0, 1], [2, 3]] and t["edp"] == [[0, 2], [1, 3]]
    # world 16, TP2 x CP(2 inner x 2 outer) x DP2: cp = inner + 2*outer, rank = tp + 2*(cp + 4*dp).
    t = _dims(16, tp=2, cp=4, ep=8, cp_backend="hierarchical", hierarchical_sizes=[2, 2]).table()
    assert t["cp"] == [[0, 2, 4, 6], [1, 3, 5, 7], [8, 10, 12, 14], [9, 11, 13, 15]]
    assert t["cp_inner"][:3] == [[0, 2], [1, 3], [4, 6]] and t["cp_outer"][:2] == [[0, 4], [1, 5]]
    assert t["ep"] == [list(range(8)), list(range(8, 16))] and t["edp"][0] == [0, 8]


def test_dynamic_cp_subgroups():
    # world 16, TP2: each dp_cp block has 8 ranks (CP4 x DP2); max_cp 8 = the whole block
    d = _dims(16, tp=2, cp=4, dynamic_cp=True, max_cp=8)
    t = d.table()
    assert t["dp_cp"] == [[0, 2, 4, 6, 8, 10, 12, 14], [1, 3, 5, 7, 9, 11, 13, 15]]
    assert t["dcp2"][:4] == [[0, 2], [4, 6], [8, 10], [12, 14]]
    assert t["dcp4"] == [[0, 2, 4, 6], [8, 10, 12, 14], [1, 3, 5, 7], [9, 11, 13, 15]]
    assert "dcp8" not in t and "dcp1" not in t  # the block is dp_cp; one rank needs no group
    assert d.dynamic_cp_sizes == (2, 4)
    # max_cp defaults to cp; sub-groups may cross CP groups (runs of the DP x CP block)
    assert _dims(8, cp=2, dynamic_cp=True).dynamic_cp_sizes == (2,)
    assert _dims(8, cp=2, dynamic_cp=True, max_cp=4).table()["dcp4"] == [[0, 1, 2, 3], [4, 5, 6, 7]]


def test_hierarchical_dynamic_cp_rings():
    """A hierarchical run of s > cp_inner ranks is whole cp_inner groups (inner fastest) joined by
    a ring of every cp_inner-th rank of the run; smaller runs need no ring of their own."""
    # world 16, TP2, CP4 = inner 2 x outer 2, DP2: blocks of 8 ranks (even and odd ranks)
    d = _dims(16, tp=2, cp=4, dynamic_cp=True, max_cp=8, cp_backend="hierarchical",
              hierarchical_sizes=[2, 2])
    t = d.table()
    assert d.dynamic_outer_sizes == (4, 8) and "dcp2_outer" not in t
    assert t["cp_inner"][:2] == [[0, 2], [1, 3]]
    assert t["dcp4"][:2] == [[0, 2, 4, 6], [8, 10, 12, 14]]
    assert t["dcp4_outer"][:4] == [[0, 4], [2, 6], [8, 12], [10, 14]]
    assert t["dcp8_outer"][:2] == [[0, 4, 8, 12], [2, 6, 10, 14]]
    for s in (4, 8):  # each ring holds one rank of each of the run's inner groups
        inner_of = {r: i for i, g in enumerate(t["cp_inner"]) for r in g}
        assert all(len({inner_of[r] for r in ring}) == s // 2 for ring in t[f"dcp{s}_outer"])
    assert _dims(8, cp=4, dynamic_cp=True, cp_backend="hierarchical",
                 hierarchical_sizes=[4, 1]).dynamic_outer_sizes == ()


def test_every_rank_in_exactly_one_group_per_name():
    d = _dims(16, tp=2, cp=4, ep=4, dynamic_cp=True, max_cp=4)
    for name, groups in d.table().items():
        flat = sorted(r for g in groups for r in g)
        assert flat == list(range(16)), name
        assert all(len(g) == d.size(name) for g in groups), name
    assert (d.dp, d.edp) == (2, 4)
    assert d.ranks("dp_cp", rank=5) == [1, 3, 5, 7, 9, 11, 13, 15] and d.rank_in("dp_cp", 5) == 2


@pytest.mark.parametrize("world,kw,model,needle", [
    (8, dict(tp=3), None, "not divisible by tp*cp=3*1"),
    (8, dict(ep=3), None, "not divisible by etp*ep=1*3"),
    (8, dict(tp=2, dp=3), None, "tp*cp*dp=2*1*3=6 != world_size=8"),
    (8, dict(ep=4), dict(num_experts=6), "num_experts=6 is not divisible by ep=4"),
    (8, dict(tp=8), dict(num_heads=4), "num_heads=4 is not divisible by tp=8"),
    (12, dict(tp=3), dict(num_heads=6, num_kv_heads=2), "num_kv_heads=2 and tp=3"),
    (4, dict(cp=4, cp_backend="hierarchical", hierarchical_sizes=[2, 3]), None,
     "multiply to 6 != cp=4"),
    (4, dict(cp=4, cp_backend="hierarchical"), None, "needs hierarchical_sizes"),
    (4, dict(cp=4, hierarchical_sizes=[2, 2]), None, "cp_backend='ring'"),
    (4, dict(cp=4, cp_backend="ulysses"), dict(num_heads=6), "num_heads/tp=6 is not divisible by 4"),
    (4, dict(dispatch_dtype="fp16"), None, "parallel.dispatch_dtype='fp16' is not allowed"),
    (4, dict(capacity_factor=0.0), None, "capacity_factor=0.0 must be > 0"),
    (4, dict(etp=2), dict(expert_hidden_size=9), "expert_hidden_size=9 is not divisible by etp=2"),
    (4, dict(cp=4, dynamic_cp=True, max_cp=3), None, "parallel.max_cp=3 must be a power of two"),
    (4, dict(cp=2, dynamic_cp=True, max_cp=8), None, "must be a power of two <= dp*cp=4"),
    (6, dict(cp=2, dynamic_cp=True), None, "dp*cp=6"),
    (4, dict(cp=2, max_cp=2), None, "parallel.max_cp is set but parallel.dynamic_cp is false"),
    (4, dict(cp=2, dynamic_cp=True, max_cp=4, cp_backend="ulysses"), dict(num_heads=2),
     "num_heads/tp=2 is not divisible by 4"),
    (4, dict(aux_loss_scope="global"), None, "parallel.aux_loss_scope='global' is not allowed"),
])
def test_validation_errors_name_the_numbers(world, kw, model, needle):
    with pytest.raises(ValueError) as e:
        ParallelDims.from_config(ParallelConfig(**kw), world, SimpleNamespace(**(model or {})))
    assert needle in str(e.value) and "\n" not in str(e.value)


def test_global_batch_aux_loss_needs_the_switch_loss():
    layout = ParallelConfig(aux_loss_scope="global_batch")
    with pytest.raises(ValueError, match="use balance.aux_loss_type=switch") as e:
        ParallelDims.from_config(layout, 4, None, BalanceConfig(aux_loss_type="seq"))
    assert "\n" not in str(e.value)
    assert ParallelDims.from_config(layout, 4, None, BalanceConfig(aux_loss_type="switch")).dp == 4


def test_kv_replication_allowed():
    d = ParallelDims.from_config(ParallelConfig(tp=4), 4, SimpleNamespace(num_heads=8, num_kv_heads=2))
    assert d.tp == 4


def test_plan_groups_cli(capsys):
    assert plan_groups_main(["--world", "16", "--tp", "2", "--cp", "2", "--ep", "4"]) == 0
    out = capsys.readouterr().out
    assert "ep        {0,1,2,3} {4,5,6,7} {8,9,10,11} {12,13,14,15}" in out
    assert plan_groups_main(["--world", "8", "--ep", "4", "--num-experts", "6"]) == 2
    assert "num_experts=6" in capsys.readouterr().err


def test_world_size_one_has_no_groups():
    d = _dims(1)
    d.build_groups(0)
    assert d.group("ep") is None and d.size("dp_cp") == 1 and d.rank_in("tp") == 0


def test_axis_names_are_plain_strings():
    d = _dims(8, tp=2, cp=2, ep=4)
    assert Axis.CP == "cp" and f"{Axis.DP_CP}" == "dp_cp"
    assert d.size(Axis.CP) == d.size("cp") == 2 and d.ranks(Axis.TP, 5) == d.ranks("tp", 5) == [4, 5]
    assert set(d.names()) == {a.value for a in Axis} - {"cp_inner", "cp_outer"}


def test_table_is_computed_once_and_the_layout_is_fixed(monkeypatch):
    d = _dims(8, tp=2, cp=2, ep=4)
    monkeypatch.setattr(ParallelDims, "_compute_table", lambda self: pytest.fail("table rebuilt"))
    assert d.size("cp") == 2 and d.rank_in("dp_cp", 6) == 3 and d.ranks("ep", 6) == [4, 5, 6, 7]
    d.table()["cp"][0][0] = 99  # callers get a copy
    assert d.ranks("cp", 0) == [0, 2]
    with pytest.raises(AttributeError, match="ParallelDims.cp is fixed after construction"):
        d.cp = 4
    d.rank = 3  # this rank is set by build_groups, not part of the layout
    assert d.rank_in("tp") == 1


def test_group_or_none_is_none_for_a_one_rank_group():
    d = _dims(1)
    d.build_groups(0)
    assert d.group_or_none(Axis.EP) is None and d.group_or_none("dp_cp") is None
    with pytest.raises(KeyError, match="unknown group 'pp'"):
        d.group_or_none("pp")


def check_groups_on_gloo(rank, world):
    """Real groups on gloo (called from test_grad_reduce's 4-rank worker: one spawn fewer)."""
    d = _dims(world, cp=2, ep=2, dynamic_cp=True, max_cp=4)
    assert "dcp2" in d.names() and world == 4
    d.build_groups(rank)
    for name in d.names():
        g = d.group(name)
        # The sum of global ranks over a group equals the sum of the table's ranks for it.
        t = torch.tensor([float(rank)])
        dist.all_reduce(t, group=g)
        assert t.item() == sum(d.ranks(name)), name
        assert dist.get_rank(g) == d.rank_in(name) and dist.get_world_size(g) == d.size(name)
        assert d.group_or_none(name) is (g if d.size(name) > 1 else None), name
    # A second ParallelDims of the same layout in this process takes the groups made above
    # (no new TCP mesh per group); one group per name still, even where two names share ranks.
    again = _dims(world, cp=2, ep=2, dynamic_cp=True, max_cp=4)
    again.build_groups(rank)
    assert all(again.group(name) is d.group(name) for name in d.names())
    assert len({id(d.group(name)) for name in d.names()}) == len(d.names())
