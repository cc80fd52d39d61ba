"""Communication hidden behind compute: the overlapped MoE dispatcher (parallel.moe_overlap) on 4
gloo ranks against the synchronous one, same run, same data; and two micro-batches in flight
(parallel.micro_batches_in_flight=2: their forwards interleaved around the all-to-alls) against
one at a time, through the runtime and through the trainer.

The real Transformer with a shared expert, EP4 (and TP2 x EP4, where the TP peers split their
shared tokens; with sequence parallelism, where the shared expert's TP all-gather and
reduce-scatter run while the all-to-all travels; and fp8 payloads), fp32, two micro-batches of gradient accumulation per rank.
Overlap only moves *when* the shared expert, the all-to-alls and the gradient buckets' all-reduces
run, not what they compute, so losses and every gradient must be bitwise equal (torch.equal, no
tolerance) for each bucket size. (Different bucket sizes chunk the all-reduce differently, hence
a different summation order: tests/parallel/test_grad_buckets.py checks those in float64.)
"""

from __future__ import annotations

import threading

import pytest
import torch
import torch.distributed as dist

from longctx_moe.execution import default_ops
from longctx_moe.model import build_model
from longctx_moe.model.config import BalanceConfig
from longctx_moe.parallel import comm
from longctx_moe.parallel.comm import all_to_all_rows, make_codec, start_all_to_all_rows
from longctx_moe.parallel.config import ParallelConfig
from longctx_moe.parallel.dims import ParallelDims
from longctx_moe.parallel.dispatch import AllToAllDispatcher
from longctx_moe.parallel.parallelize import parallelize
from tests.launcher import run_distributed
from tests.model.helpers import packed_batch, tiny_config
from tests.parallel._moe_ref import LoopExperts

DOCS = [[5, 9, 1, 13], [1, 7, 3], [12, 2], [2, 2, 6], [17, 4], [3, 3, 3, 3]]
# The last two recompute blocks in the backward: the all-to-alls (and the overlap) run again there.
LAYOUTS = [dict(ep=4), dict(tp=2, ep=4), dict(ep=4, dispatch_dtype="fp8"),
           dict(ep=4, recompute="full"), dict(tp=2, ep=4, recompute="selective"),
           dict(tp=2, ep=4, sequence_parallel=True),
           # expert lending (every imbalance lent, however small): deterministic, so bitwise too
           dict(ep=4, ep_spare_slots=2, lend_rows=1, recompute="full")]


BALANCE = BalanceConfig(aux_loss_type="seq", aux_loss_coeff=0.1, z_loss_coeff=0.01)


def _model(seed, recompute="none"):
    torch.manual_seed(seed)
    cfg = tiny_config(num_experts=8, top_k=2, shared_expert_hidden_size=16)
    return build_model(cfg, default_ops().replace(recompute=recompute), balance=BALANCE)


def run_steps(rank, world, kw, overlap, bucket_mb, seed, in_flight=1):
    """Losses (one per micro-batch) and {name: grad} after two accumulated micro-batches.
    `overlap`: the overlapped dispatcher, and the gradient buckets launched from the last
    backward's hooks (without: the same buckets all-reduced after the backward). `in_flight` 2:
    both forwards first, interleaved, then the two backwards."""
    kw = dict(kw)
    recompute, lend_rows = kw.pop("recompute", "none"), kw.pop("lend_rows", None)
    cfg = ParallelConfig(moe_overlap=overlap, grad_bucket_mb=bucket_mb, micro_batches_in_flight=in_flight, **kw)
    dims = ParallelDims.from_config(cfg, world, tiny_config())
    dims.build_groups(rank)
    runtime = parallelize(_model(seed, recompute), dims, cfg)
    for layer in runtime.model.moe_layers() if lend_rows else ():
        layer.dispatcher.min_lend_rows = lend_rows
    assert all(m.dispatcher.overlaps_shared == overlap for m in runtime.model.moe_layers())
    gen = torch.Generator().manual_seed(seed + 100 * dims.rank_in("dp"))
    batches = [packed_batch(DOCS[(seed + i) % len(DOCS)], 64, pad_multiple=dims.tp, generator=gen)
               for i in range(2)]
    losses = []
    for i, (_, _, out) in enumerate(runtime.forwards(batches, runtime.shard)):
        loss = out.ce_sum / 64 + out.aux_loss + out.z_loss
        if overlap and i == len(batches) - 1:
            runtime.start_gradient_reduction()  # buckets launch from this backward's hooks
        loss.backward()
        losses.append(loss.detach())
    runtime.reduce_gradients()
    return torch.stack(losses), {n: p.grad.clone() for n, p in runtime.model.named_parameters()}


def _check_bitwise(rank, world):
    for seed, kw in enumerate(LAYOUTS):
        for bucket_mb in (0.0, 25.0, 0.002):
            loss_sync, grads_sync = run_steps(rank, world, kw, False, bucket_mb, seed)
            runs = [(True, 1)] + ([(True, 2)] if bucket_mb == 25.0 else []) + \
                ([(False, 2)] if bucket_mb == 25.0 and seed == 0 else [])
            for overlap, in_flight in runs:
                loss_ovl, grads_ovl = run_steps(rank, world, kw, overlap, bucket_mb, seed, in_flight)
                what = (kw, bucket_mb, overlap, in_flight)
                assert torch.equal(loss_sync, loss_ovl), (what, loss_sync, loss_ovl)
                assert grads_sync.keys() == grads_ovl.keys()
                for name, g in grads_sync.items():
                    assert torch.equal(g, grads_ovl[name]), (what, name, (g - grads_ovl[name]).abs().max())
    _check_start_wait(rank, world)
    _check_schedule(rank, world)
    _check_interleaved_schedule(rank, world)
    _check_trainer_in_flight(rank, world)
    return True


class _Recorder:
    """Stands in for comm._Transfer: records when all-to-alls launch and complete (and, with
    `threads`, in which micro-batch's thread)."""

    events: list = []
    threads = False

    def __init__(self, *args):
        self._log("launch")
        self.inner = _TRANSFER(*args)

    def wait(self):
        out = self.inner.wait()  # hands over to the other micro-batch in flight first
        self._log("wait")
        return out

    def _log(self, what):
        self.events.append((threading.current_thread().name, what) if self.threads else what)


_TRANSFER = comm._Transfer


def _check_schedule(rank, world):
    """The shared expert really runs inside the all-to-all window: forward launch, shared,
    wait; and in the backward the gradients' launch, the shared expert's backward, wait. This
    is the autograd engine's order (higher sequence numbers first), not a timing."""
    gen = torch.Generator().manual_seed(7)
    E, D, T = 8, 6, 5
    w1, w2 = torch.randn(E, D, 4, generator=gen), torch.randn(E, 4, D, generator=gen)
    experts = LoopExperts(w1, w2, rank * (E // world), E // world)
    shared = torch.nn.Linear(D, D)
    events = _Recorder.events
    shared.register_forward_hook(lambda *_: events.append("shared"))
    shared.register_full_backward_hook(lambda *_: events.append("shared_bwd"))
    x = torch.randn(T, D, generator=gen, requires_grad=True)
    idx = torch.stack([torch.randperm(E, generator=gen)[:2] for _ in range(T)])
    disp = AllToAllDispatcher(E, dist.group.WORLD, overlap=True)
    comm._Transfer = _Recorder
    try:
        y = disp(x, idx, torch.full((T, 2), 0.5), experts, shared)
        assert events == ["launch", "shared", "wait"], events
        events.clear()
        y.sum().backward()
        assert events == ["launch", "shared_bwd", "wait"], events
    finally:
        comm._Transfer, _Recorder.events[:] = _TRANSFER, []


def _check_interleaved_schedule(rank, world):
    """Two micro-batches in flight really take turns around the all-to-alls: the second one's
    tokens are launched before the first one's complete, and its experts' combine before the
    first one's (each "wait" is logged after the hand-over, so B's launch sits inside A's
    window). Two MoE layers, EP4: 4 all-to-alls per micro-batch."""
    cfg = ParallelConfig(ep=4, micro_batches_in_flight=2)
    dims = ParallelDims.from_config(cfg, world, tiny_config())
    dims.build_groups(rank)
    runtime = parallelize(_model(0), dims, cfg)
    gen = torch.Generator().manual_seed(rank)
    shards = [runtime.shard(packed_batch(DOCS[i], 64, generator=gen)) for i in range(2)]
    comm._Transfer, _Recorder.threads = _Recorder, True
    try:
        runtime.forward_in_flight(shards)
        a, b = "micro-batch-0", "micro-batch-1"
        turn = [(a, "launch"), (b, "launch"), (a, "wait"), (a, "launch"), (b, "wait"), (b, "launch"),
                (a, "wait")]
        assert _Recorder.events[:7] == turn, _Recorder.events
        assert len(_Recorder.events) == 2 * 2 * 2 * 2  # 2 mbs x 2 layers x 2 a2as x (launch, wait)
    finally:
        comm._Transfer, _Recorder.threads, _Recorder.events[:] = _TRANSFER, False, []


def _check_trainer_in_flight(rank, world):
    """Through the Trainer (autocast off, fp32): three micro-batches (a pair, then one alone)
    with micro_batches_in_flight 2 give bitwise the step of 1: loss, norm, counts, parameters."""
    from longctx_moe.config import load_config
    from longctx_moe.trainer import Trainer

    results = []
    for in_flight in (1, 2):
        cfg = load_config(None, ["train.autocast_dtype=none", "optim.warmup_steps=0", "parallel.ep=4",
                                 f"parallel.micro_batches_in_flight={in_flight}"])
        cfg.model, cfg.balance = _model(0).cfg, BALANCE
        dims = ParallelDims.from_config(cfg.parallel, world, cfg.model, cfg.balance)
        dims.build_groups(rank)
        trainer = Trainer(cfg, parallelize(_model(0), dims, cfg.parallel))
        gen = torch.Generator().manual_seed(rank)
        step = trainer.train_step([packed_batch(DOCS[i], 64, generator=gen) for i in range(3)])
        results.append((step, [p.detach().clone() for p in trainer.model.parameters()]))
    (one, params_one), (two, params_two) = results
    assert (one.loss, one.grad_norm) == (two.loss, two.grad_norm)
    assert torch.equal(one.expert_counts, two.expert_counts)
    assert all(torch.equal(p, q) for p, q in zip(params_one, params_two, strict=True))


def _check_start_wait(rank, world):
    """start + wait equals the synchronous all-to-all rows, forward and backward, for each codec
    (the same encode / collective / decode, so bitwise)."""
    gen = torch.Generator().manual_seed(rank)
    send = [(rank + r) % 3 for r in range(world)]
    recv = [(r + rank) % 3 for r in range(world)]  # rank r sends (r + rank) % 3 rows to me
    x = torch.randn(sum(send), 6, generator=gen)
    g = torch.randn(sum(recv), 6, generator=gen)
    for name in ("none", "bf16", "fp8"):
        results = []
        for start in (False, True):
            xi = x.clone().requires_grad_()
            codec = make_codec(name)
            if start:
                y = start_all_to_all_rows(xi, send, recv, None, codec).wait()
            else:
                y = all_to_all_rows(xi, send, recv, None, codec)
            (y * g).sum().backward()
            results.append((y.detach(), xi.grad))
        assert all(torch.equal(a, b) for a, b in zip(*results, strict=True)), name


@pytest.mark.slow
@pytest.mark.long
def test_overlapped_dispatch_is_bitwise_equal_to_synchronous_ep4_shared_expert():
    assert run_distributed(_check_bitwise, world_size=4, timeout=600) == [True] * 4
