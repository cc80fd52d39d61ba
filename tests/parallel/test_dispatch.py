"""Expert-parallel dispatchers on 4 gloo ranks against an unsharded float64 reference.

Every case builds one global batch (same seed on every rank), gives each rank its slice, routes
with forced top-k choices whose weights come from a softmax router (so the router weight gets a
gradient), and compares output, d/dx, d/d(router weight) and d/d(expert weights) with the loop
reference. float64 end to end: the only differences are summation order, so 1e-10 is loose.
The overlapped all-to-all dispatcher (with a shared expert) must equal the synchronous one
bitwise in every case (empty ranks and experts, capacity drops).
"""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist

from longctx_moe.parallel.config import ParallelConfig
from longctx_moe.parallel.dims import ParallelDims
from longctx_moe.parallel.dispatch import AllGatherDispatcher, AllToAllDispatcher, build_dispatcher
from longctx_moe.parallel.parallelize import check_supported
from tests.launcher import run_distributed
from tests.parallel._moe_ref import LoopExperts, kept_assignments, reference_moe

E, D, F, R = 8, 6, 5, 4
TOL = 1e-10


def _case_routing(name, T, K, gen):
    """Forced expert choices [T, K] (distinct per token) for the edge case `name`."""
    if name.startswith("all_to_one"):
        return torch.full((T, 1), 5, dtype=torch.int64)
    if name == "top_e":
        return torch.stack([torch.randperm(E, generator=gen) for _ in range(T)])
    pool = [e for e in range(E) if not (name == "expert_empty" and e == 3)]
    rows = [torch.tensor(pool)[torch.randperm(len(pool), generator=gen)[:K]] for _ in range(T)]
    return torch.stack(rows) if rows else torch.zeros(0, K, dtype=torch.int64)


CASES = [  # name, tokens per rank, top-k, capacity factor, drop policy
    ("random_k2", [5, 3, 6, 4], 2, None, "probs"),
    ("expert_empty", [4, 4, 4, 4], 2, None, "probs"),
    ("rank_empty", [6, 0, 5, 2], 2, None, "probs"),
    ("top1", [5, 7, 1, 3], 1, None, "probs"),
    ("top_e", [3, 2, 4, 1], E, None, "probs"),
    ("all_to_one", [4, 5, 3, 6], 1, None, "probs"),
    ("capacity_probs", [9, 8, 7, 9], 2, 0.75, "probs"),
    ("capacity_position", [9, 8, 7, 9], 2, 0.75, "position"),
    ("all_to_one_capacity", [6, 5, 0, 6], 1, 2.0, "probs"),
]


def _global_data(name, sizes, K, seed):
    gen = torch.Generator().manual_seed(seed)
    T = sum(sizes)
    x = torch.randn(T, D, generator=gen, dtype=torch.float64)
    router = torch.randn(D, E, generator=gen, dtype=torch.float64)
    w1 = torch.randn(E, D, F, generator=gen, dtype=torch.float64) / D**0.5
    w2 = torch.randn(E, F, D, generator=gen, dtype=torch.float64) / F**0.5
    idx = _case_routing(name, T, K, gen)
    grad_out = torch.randn(T, D, generator=gen, dtype=torch.float64)
    return x, router, w1, w2, idx, grad_out


def _run_reference(x, router, w1, w2, idx, g, sizes, cap, policy):
    """Unsharded forward/backward; capacity is applied per source rank, as the dispatchers do."""
    x, router, w1, w2 = (t.clone().requires_grad_() for t in (x, router, w1, w2))
    weight = torch.softmax(x @ router, dim=1).gather(1, idx)
    outs, start = [], 0
    for n in sizes:
        s = slice(start, start + n)
        kept = kept_assignments(idx[s], weight[s].detach(), E, cap, policy)
        outs.append(reference_moe(x[s], idx[s], weight[s], w1, w2, kept))
        start += n
    y = torch.cat(outs)
    (y * g).sum().backward()
    return y.detach(), x.grad, router.grad, w1.grad, w2.grad


def _run_sharded(dispatcher_cls, rank, x, router, w1, w2, idx, g, sizes, cap, policy,
                 overlap=None):
    """Sharded forward / backward. `overlap` (bool): the all-to-all dispatcher with that switch
    and a shared expert (a linear layer; shared(x) added outside the dispatcher when False)."""
    s = slice(sum(sizes[:rank]), sum(sizes[: rank + 1]))
    L = E // R
    experts = LoopExperts(w1, w2, rank * L, L)
    x_loc = x[s].clone().requires_grad_()
    router = router.clone().requires_grad_()
    weight = torch.softmax(x_loc @ router, dim=1).gather(1, idx[s])
    kw = {} if overlap is None else {"overlap": overlap}
    disp = dispatcher_cls(E, dist.group.WORLD, capacity_factor=cap, drop_policy=policy, **kw)
    if overlap is None:
        y = disp(x_loc, idx[s], weight, experts)
    else:
        shared = torch.nn.Linear(D, D, dtype=x.dtype)
        with torch.no_grad():
            shared.weight.copy_(w1[0, :, :1].expand(D, D) + router[:, :1])
            shared.bias.fill_(0.25)
        y = (disp(x_loc, idx[s], weight, experts, shared) if overlap
             else disp(x_loc, idx[s], weight, experts) + shared(x_loc))
    (y * g[s]).sum().backward()
    dist.all_reduce(router.grad)  # the router is replicated: its gradient sums over ranks
    return y.detach(), x_loc.grad, router.grad, experts.w1_LDF.grad, experts.w2_LFD.grad


def _check_all_cases(rank, world):
    L = E // R
    for seed, (name, sizes, K, cap, policy) in enumerate(CASES):
        data = _global_data(name, sizes, K, seed)
        if cap is not None:  # the capacity cases must really drop something on some rank
            kept = kept_assignments(data[4][: sizes[0]], torch.rand(sizes[0], K), E, cap, policy)
            assert len(kept) < sizes[0] * K, name
        ref = _run_reference(*data, sizes, cap, policy)
        s = slice(sum(sizes[:rank]), sum(sizes[: rank + 1]))
        e = slice(rank * L, rank * L + L)
        want = (ref[0][s], ref[1][s], ref[2], ref[3][e], ref[4][e])
        for cls in (AllToAllDispatcher, AllGatherDispatcher):
            got = _run_sharded(cls, rank, *data, sizes, cap, policy)
            for what, a, b in zip(("y", "dx", "drouter", "dw1", "dw2"), got, want, strict=True):
                b = torch.zeros_like(a) if b is None else b  # an expert with no token
                a = torch.zeros_like(b) if a is None else a
                err = (a - b).abs().max().item() if a.numel() else 0.0
                assert err < TOL, f"{name} {cls.__name__} {what}: max err {err}"
        # Overlap moves the shared expert into the all-to-all window, not the arithmetic.
        sync = _run_sharded(AllToAllDispatcher, rank, *data, sizes, cap, policy, overlap=False)
        ovl = _run_sharded(AllToAllDispatcher, rank, *data, sizes, cap, policy, overlap=True)
        for what, a, b in zip(("y", "dx", "drouter", "dw1", "dw2"), ovl, sync, strict=True):
            assert (a is None and b is None) or torch.equal(a, b), f"{name} overlap {what}"
    return True


@pytest.mark.multirank
def test_dispatchers_match_unsharded_reference_float64():
    assert run_distributed(_check_all_cases, world_size=R, timeout=300) == [True] * R


def test_bad_inputs_get_one_line_errors():
    x, w = torch.randn(3, D), torch.rand(3, 2)
    experts = LoopExperts(torch.randn(E, D, F), torch.randn(E, F, D), 0, E)
    cases = [
        (lambda: AllToAllDispatcher(E)(x, torch.zeros(2, 2, dtype=torch.long), w, experts),
         "must both be [T=3, K]"),
        (lambda: AllToAllDispatcher(E)(x, torch.zeros(3, 2, dtype=torch.long), w,
                                       LoopExperts(torch.randn(E, D, F), torch.randn(E, F, D), 0, 2)),
         "experts holds 2 experts"),
        (lambda: AllToAllDispatcher(E, capacity_factor=0.0), "capacity_factor=0.0 must be > 0"),
        (lambda: AllGatherDispatcher(E, drop_policy="random"), "drop_policy='random' is not allowed"),
        (lambda: AllToAllDispatcher(E, dispatch_dtype="int8"), "dispatch_dtype='int8' is not allowed"),
        (lambda: check_supported(ParallelDims.from_config(ParallelConfig(), 1),
                                 ParallelConfig(sequence_parallel=True)), "sequence_parallel=true"),
        (lambda: check_supported(ParallelDims.from_config(ParallelConfig(), 1),
                                 ParallelConfig(micro_batches_in_flight=2)), "micro_batches_in_flight=2 hides"),
        (lambda: ParallelConfig(micro_batches_in_flight=3).validate(), "must be 1 or 2"),
        (lambda: build_dispatcher(ParallelDims.from_config(ParallelConfig(), 1),
                                  ParallelConfig(dispatcher="allgather", dispatch_dtype="fp8"), E),
         "compresses the all-to-all only"),
    ]
    for fn, needle in cases:
        with pytest.raises(ValueError) as e:
            fn()
        assert needle in str(e.value) and "\n" not in str(e.value), str(e.value)


def test_an_expert_id_out_of_range_fails_in_the_count():
    # Not checked up front: that reads the ids back (two GPU syncs per MoE layer). The router
    # cannot make one; the shape-static count fails on it (a device-side assert on a GPU).
    x, w = torch.randn(3, D), torch.rand(3, 2)
    experts = LoopExperts(torch.randn(E, D, F), torch.randn(E, F, D), 0, E)
    for bad in (9, -1):
        with pytest.raises(RuntimeError, match="out of bounds"):
            AllToAllDispatcher(E)(x, torch.tensor([[0, bad]] * 3), w, experts)


def test_combine_keeps_no_copy_of_the_weighted_rows_for_the_backward():
    # combine's backward needs y (for the weights' gradient), the weights and the token index;
    # a second [N, D] tensor kept per MoE layer is activation memory for nothing.
    from longctx_moe.parallel.dispatch import combine, route

    gen = torch.Generator().manual_seed(0)
    idx_TK = torch.randint(0, E, (32, 2), generator=gen)
    w_TK = torch.rand(32, 2, generator=gen, dtype=torch.float64, requires_grad=True)
    routing = route(idx_TK, w_TK, E)
    y_ND = torch.randn(64, 16, generator=gen, dtype=torch.float64, requires_grad=True)
    kept = []
    with torch.autograd.graph.saved_tensors_hooks(lambda t: kept.append(t) or t, lambda t: t):
        out_TD = combine(y_ND, routing, 32)
    rows_saved = [t for t in kept if t.dim() == 2 and t.shape[1] == 16]
    assert len(rows_saved) == 1 and rows_saved[0].data_ptr() == y_ND.data_ptr()
    ref_TD = torch.zeros(32, 16, dtype=torch.float64).index_add(
        0, routing.token_N, y_ND * routing.weight_N[:, None])
    g_TD = torch.randn(32, 16, generator=gen, dtype=torch.float64)
    got = torch.autograd.grad(out_TD, (y_ND, w_TK), g_TD, retain_graph=True)  # routing is shared
    want = torch.autograd.grad(ref_TD, (y_ND, w_TK), g_TD)
    torch.testing.assert_close(out_TD, ref_TD, atol=0, rtol=0)
    for a, b in zip(got, want, strict=True):
        torch.testing.assert_close(a, b, atol=1e-12, rtol=0)
