"""Ring (p2p) context-parallel attention over a CP plan.

    out_LHDv, lse_HL = ring_attention(q_LHD, k_LHD, v_LHDv, plan, group, causal=True, scale=None,
                                      backend="auto", stats=None, sink=None, window=None)

q [L, Hq, D], k [L, Hkv, D], v [L, Hkv, Dv]: this rank's tokens in the plan's local order
(plan.shard), heads possibly already TP-sharded (Hq % Hkv == 0, GQA). Returns out [L, Hq, Dv] in
q's dtype and lse [Hq, L] (float32; float64 for float64 inputs; rows that see no key: out 0, lse
-inf). Autograd: gradients flow to q, k, v and sink (lse carries none). sink [Hq] (gpt-oss): merged
as one more LSE term after the last ring step, so each row counts it once (kernels/sinks.py); its
gradient is this rank's rows' share (the CP gradient reduction sums the shares). window=W
(sliding window, the single-device semantics: the W latest keys of the query's document, itself
included): each step's blocks are cut by chunk into skipped, full and banded kernel calls, the
banded ones with an offset alignment (cp_attention/window_schedule.py); the messages do not change.
`group` is the CP group; its rank r must hold plan.shard(x, r). `stats` (CommStats) accumulates
what this rank sends.

Schedule (P = group size, Z = the plan's ring tokens per rank: its zigzag pieces; whole documents
never enter the ring). The ring runs towards lower ranks: at step t rank r holds the KV block of
rank s = (r + t) % P. A block (K and V concatenated on the head dim, [Z/2, Hkv, D + Dv] per
half) travels as two halves: A (the first chunks, chunk s of each zigzag
document) and B (the second chunks, chunk 2P-1-s). By causality only the ranks r < s need B (see
cp_attention/schedule.py); the block visits them first (s-1, ..., 0), and after the wrap to P-1
only A travels on. That saves a quarter of the ring bytes of plain zigzag (summed over ranks;
the link from rank 1 to rank 0 still carries both halves at every step).
  forward:  each step posts the next transfer (one batched isend/irecv: A, and B while needed)
            before computing the current block; partial (out, lse) merge in fp32 (merge.py).
  backward: the KV halves circulate again, and dK/dV accumulators (fp32; float64 for float64)
            travel with them: A's round the ring and home; B's through the ranks below the owner,
            and from rank 0 straight back to the owner. The owner adds its own (t = 0) part.
Every kernel call receives the globally merged (out, lse), so each block's gradient is exact.
Message counts and bytes per rank: RingLayout.traffic (tests check the executor against it).
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from cp_attention.comm import CommStats, post_p2p, wait_all
from cp_attention.kernels import accumulate_dtype, add_sink, attn_backward, attn_forward, sink_grad
from cp_attention.kernels._common import check_window
from cp_attention.kernels.sinks import check_sink
from cp_attention.layout import RingLayout
from cp_attention.merge import merge_, new_accumulators
from cp_attention.plan import CPPlan

KV_TAG, DKV_TAG = 0, 2  # KV halves A, B: 0, 1; dK/dV A, B, B home: 2, 3, 4


def ring_attention(q_LHD, k_LHD, v_LHD, plan: CPPlan, group, causal: bool = True,
                   scale: float | None = None, backend: str = "auto",
                   stats: CommStats | None = None, sink=None, window: int | None = None):
    """See the module docstring."""
    size, rank = dist.get_world_size(group), dist.get_rank(group)
    if plan.hierarchical_sizes[0] != 1:
        raise ValueError(f"ring_attention: the plan was made with hierarchical_sizes="
                         f"{list(plan.hierarchical_sizes)}; call hierarchical_attention or plan "
                         "without hierarchical_sizes")
    if size != plan.ring.size:
        raise ValueError(f"ring_attention: group has {size} ranks but the plan is for cp_size="
                         f"{plan.cp_size}; plan with the CP group's size")
    check_local_shapes(q_LHD, k_LHD, v_LHD, plan.local_tokens(rank), "ring_attention")
    if not causal:
        raise ValueError("ring_attention: only causal attention is planned (causal=False is not "
                         "supported); use a single-device kernel for bidirectional attention")
    check_sink(sink, q_LHD.shape[1])
    check_window(window, causal)
    return RingAttention.apply(q_LHD, k_LHD, v_LHD, sink, plan.ring, rank, group, scale, backend,
                               stats, window)


def check_local_shapes(q, k, v, tokens: int, who: str) -> None:
    if q.dim() != 3 or k.dim() != 3 or v.dim() != 3 or k.shape[:2] != v.shape[:2]:
        raise ValueError(f"{who}: expects q [L, Hq, D], k [L, Hkv, D] and v [L, Hkv, Dv]; got q "
                         f"{tuple(q.shape)}, k {tuple(k.shape)}, v {tuple(v.shape)}")
    if q.shape[0] != tokens or k.shape[0] != tokens:
        raise ValueError(f"{who}: this rank holds {tokens} tokens in the plan but q has "
                         f"{q.shape[0]} and k {k.shape[0]}; shard inputs with plan.shard(x, rank)")


class RingAttention(torch.autograd.Function):
    """Autograd wrapper of ring_forward / ring_backward on one ring layout and ring rank."""

    @staticmethod
    def forward(ctx, q, k, v, sink, layout, rank, group, scale, backend, stats, window=None):
        args = (layout, rank, group, scale, backend, stats, window)
        out, lse = ring_forward(q, k, v, *args, sink=sink)
        ctx.save_for_backward(q, k, v, sink, out, lse)
        ctx.args = args
        ctx.mark_non_differentiable(lse)
        return out, lse

    @staticmethod
    def backward(ctx, dout, _dlse):
        q, k, v, sink, out, lse = ctx.saved_tensors
        dout = dout.contiguous()
        dq, dk, dv = ring_backward(dout, q, k, v, out, lse, *ctx.args)
        dsink = None if sink is None else sink_grad(dout, out, lse, sink)
        return dq, dk, dv, dsink, None, None, None, None, None, None, None


def _full(r: int, t: int, p: int) -> bool:
    """Does rank r need half B of the block it holds at step t >= 1 (its owner is above it)?"""
    return (r + t) % p > r


class _Halves:
    """Routing of the KV halves of ring rank r (see the module docstring)."""

    def __init__(self, layout: RingLayout, rank: int, group, stats, kind: str):
        self.p, self.r, self.group, self.stats, self.kind = layout.size, rank, group, stats, kind
        self.down, self.up = (rank - 1) % self.p, (rank + 1) % self.p

    def post(self, t: int, cur: tuple, shape) -> tuple[list, tuple]:
        """At step t send the held halves `cur` = (A, B or None) down, receive step t+1's up."""
        p, r = self.p, self.r
        ops = [(True, cur[0], self.down, KV_TAG, self.kind)]
        if r >= 1 and (t == 0 or _full(r, t, p)):
            ops.append((True, cur[1], self.down, KV_TAG + 1, self.kind))
        nxt_a = cur[0].new_empty(shape)
        nxt_b = cur[0].new_empty(shape) if _full(r, t + 1, p) else None
        ops.append((False, nxt_a, self.up, KV_TAG, self.kind))
        if nxt_b is not None:
            ops.append((False, nxt_b, self.up, KV_TAG + 1, self.kind))
        return post_p2p(ops, self.group, self.stats), (nxt_a, nxt_b)


def _own_halves(k, v, layout: RingLayout, rank: int) -> tuple[torch.Tensor, torch.Tensor]:
    """[Z/2, Hkv, D + Dv] each: K | V of this rank's first chunks (A) and second chunks (B)."""
    rows_a, rows_b = (x.to(k.device, non_blocking=True) for x in layout.chunk_rows(rank))
    kv = torch.cat([k, v], dim=-1)
    return kv.index_select(0, rows_a), kv.index_select(0, rows_b)


def _split_kv(kv, d: int):
    """[.., D + Dv] -> (K [.., D], V [.., Dv]) views."""
    return kv[..., :d], kv[..., d:]


def ring_forward(q, k, v, layout: RingLayout, rank: int, group, scale, backend,
                 stats: CommStats | None, window: int | None = None, sink=None):
    """-> (out [L, Hq, Dv] q.dtype, lse [Hq, L] acc dtype), the sink (if any) merged last."""
    p, z = layout.size, layout.zigzag_tokens
    out_acc, lse_acc = new_accumulators(q, v.shape[-1])
    use_ring = p > 1 and z > 0
    cur = _own_halves(k, v, layout, rank) if use_ring else None
    routes = _Halves(layout, rank, group, stats, "ring_fwd_kv") if use_ring else None
    for t in range(p):
        reqs, nxt = [], None
        if use_ring and t + 1 < p:
            reqs, nxt = routes.post(t, cur, cur[0].shape)
        for _, spec, kv in _calls(layout, rank, t, k, v, cur, window):
            o, lse = attn_forward(q, kv[0], kv[1], spec.cu_q, spec.cu_k, spec.max_q, spec.max_k,
                                  spec.causal, scale, backend, spec.window, spec.offset)
            merge_(out_acc, lse_acc, o, lse)
        wait_all(reqs)
        cur = nxt
    if sink is not None:
        out_acc, lse_acc = add_sink(out_acc, lse_acc, sink)
    return out_acc.to(q.dtype), lse_acc


def _calls(layout: RingLayout, rank: int, t: int, k, v, cur, window: int | None = None):
    """(which, spec, (K, V)) kernel calls of step t that have work; which in local / a / b (a
    sliding window may need several calls per block, see cp_attention/window_schedule.py)."""
    if window is None:
        specs_a, specs_b = ([s] for s in layout.step(rank, t, k.device))
    else:
        specs_a, specs_b = layout.window_step(rank, t, window, k.device)
    if t == 0:
        blocks = [("local", s, (k, v)) for s in specs_a]
    elif cur is None:  # no ring tokens: every step after the first is empty
        return []
    else:
        d = k.shape[-1]
        kv_b = None if cur[1] is None else _split_kv(cur[1], d)
        blocks = ([("a", s, _split_kv(cur[0], d)) for s in specs_a]
                  + [("b", s, kv_b) for s in specs_b])
    return [(w, s, kv) for w, s, kv in blocks if s is not None and not s.empty]


class _Travel:
    """dK/dV accumulators of the foreign blocks passing ring rank r in the backward (fp32 / f64).
    A: started by the block's first visitor, passed down the ring, home after step P-1.
    B: only the ranks below the owner touch it; passed down to rank 0, which sends it home."""

    def __init__(self, layout: RingLayout, rank: int, group, stats, like: torch.Tensor):
        self.p, self.r, self.group, self.stats, self.like = layout.size, rank, group, stats, like
        self.down, self.up = (rank - 1) % self.p, (rank + 1) % self.p
        self.in_a, self.in_b, self.home_b = None, None, None
        self.reqs, self.keep, self.late_reqs, self.late_keep = [], [], [], []

    def _post(self, ops):
        return post_p2p([(*op, "ring_bwd_dkv") for op in ops], self.group, self.stats)

    def step(self, t: int, contrib_a: torch.Tensor, contrib_b: torch.Tensor | None) -> None:
        """Add this rank's contribution at step t >= 1 and pass the accumulators on."""
        wait_all(self.reqs)
        acc_a = contrib_a if t == 1 else self.in_a + contrib_a
        ops, late = [(True, acc_a, self.down, DKV_TAG)], []
        acc_b = None
        if contrib_b is not None:
            acc_b = contrib_b if t == 1 else self.in_b + contrib_b
            if self.r >= 1:
                ops.append((True, acc_b, self.down, DKV_TAG + 1))
            else:  # rank 0 is B's last visitor: straight home, waited only in finish()
                late.append((True, acc_b, (self.r + t) % self.p, DKV_TAG + 2))
        self.in_a = torch.empty_like(self.like)
        ops.append((False, self.in_a, self.up, DKV_TAG))
        self.in_b = None
        if t + 1 < self.p and _full(self.r, t + 1, self.p):
            self.in_b = torch.empty_like(self.like)
            ops.append((False, self.in_b, self.up, DKV_TAG + 1))
        if t == self.p - 1 and self.r >= 1:
            # Posted last so that, per pair of ranks, receives follow the sender's order (NCCL
            # matches point-to-point messages by order, not by tag): rank 0 sends A, then B home.
            self.home_b = torch.empty_like(self.like)
            ops.append((False, self.home_b, 0, DKV_TAG + 2))
        self.keep = [acc_a, acc_b]  # isend buffers must outlive their requests
        self.reqs = self._post(ops)
        if late:
            self.late_reqs += self._post(late)
            self.late_keep.append(acc_b)

    def finish(self) -> tuple[torch.Tensor, torch.Tensor | None]:
        """-> this rank's own block accumulators (A from the last visitor, B from rank 0)."""
        wait_all(self.reqs)
        wait_all(self.late_reqs)
        return self.in_a, self.home_b


def ring_backward(dout, q, k, v, out, lse, layout: RingLayout, rank: int, group, scale, backend,
                  stats: CommStats | None, window: int | None = None):
    """-> (dq, dk, dv) in the input dtypes, accumulated in accumulate_dtype."""
    p, z = layout.size, layout.zigzag_tokens
    adt = accumulate_dtype(q.dtype)
    dq = torch.zeros(q.shape, dtype=adt, device=q.device)
    dk = torch.zeros(k.shape, dtype=adt, device=k.device)
    dv = torch.zeros(v.shape, dtype=adt, device=v.device)
    use_ring = p > 1 and z > 0
    cur = _own_halves(k, v, layout, rank) if use_ring else None
    if use_ring:
        routes = _Halves(layout, rank, group, stats, "ring_bwd_kv")
        travel = _Travel(layout, rank, group, stats, cur[0].to(adt))
    for t in range(p):
        reqs, nxt = [], None
        if use_ring and t + 1 < p:
            reqs, nxt = routes.post(t, cur, cur[0].shape)
        contrib = {}
        for which, spec, kv in _calls(layout, rank, t, k, v, cur, window):
            g = attn_backward(dout, q, kv[0], kv[1], out, lse, spec.cu_q, spec.cu_k, spec.max_q,
                              spec.max_k, spec.causal, scale, backend, spec.window, spec.offset)
            dq += g[0]
            part = torch.cat([g[1], g[2]], dim=-1).to(adt)
            contrib[which] = part if which not in contrib else contrib[which] + part
        if t == 0 and "local" in contrib:
            dk += contrib["local"][..., :k.shape[-1]]
            dv += contrib["local"][..., k.shape[-1]:]
        elif t > 0 and use_ring:
            zeros = torch.zeros_like(travel.like)
            travel.step(t, contrib.get("a", zeros),
                        contrib.get("b", zeros) if _full(rank, t, p) else None)
        wait_all(reqs)
        cur = nxt
    if use_ring:
        _add_home(dk, dv, layout, rank, *travel.finish())
    return dq.to(q.dtype), dk.to(k.dtype), dv.to(v.dtype)


def _add_home(dk, dv, layout: RingLayout, rank: int, home_a, home_b) -> None:
    rows_a, rows_b = (x.to(dk.device, non_blocking=True) for x in layout.chunk_rows(rank))
    for rows, home in ((rows_a, home_a), (rows_b, home_b)):
        if home is not None:
            g_k, g_v = _split_kv(home, dk.shape[-1])
            dk.index_add_(0, rows, g_k)
            dv.index_add_(0, rows, g_v)
