"""Ring (p2p) context-parallel attention over a CP plan.

    out_LHD, lse_HL = ring_attention(q_LHD, k_LHD, v_LHD, plan, group, causal=True, scale=None,
                                     backend="auto", stats=None)

q [L, Hq, D], k / v [L, Hkv, D]: this rank's tokens in the plan's local order (plan.shard), heads
possibly already TP-sharded (Hq % Hkv == 0, GQA). Returns out [L, Hq, D] in q's dtype and lse
[Hq, L] (float32; float64 for float64 inputs; rows that see no key: out 0, lse -inf). Autograd:
gradients flow to q, k, v (lse carries none). `group` is the CP group; its rank r must hold
plan.shard(x, r). `stats` (CommStats) accumulates what this rank sends.

Schedule (P = group size, Z = the plan's ring tokens per rank: the zigzag pieces; whole documents
never enter the ring):
  forward:  at step t the rank holds the KV block of rank (r - t) % P; the transfer of the next
            block (one batched isend/irecv of K and V packed in one buffer) is posted before the
            current block computes. Partial (out, lse) merge in fp32 (cp_attention.merge).
            Sends P-1 messages of 2*Z*Hkv*D elements.
  backward: the KV blocks circulate again, and a dK/dV accumulator (fp32; float64 for float64)
            travels with them: started by the first rank that sees a foreign block (t = 1) and sent
            on after each step, it reaches the block's owner after step P-1, where the owner adds
            its own (t = 0) contribution. Sends P-1 KV messages and P-1 dK/dV messages.
Every kernel call receives the globally merged (out, lse), so each block's gradient is exact.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from cp_attention.comm import CommStats, ring_exchange, wait_all
from cp_attention.kernels import attn_backward, attn_forward
from cp_attention.merge import acc_dtype, merge_, new_accumulators
from cp_attention.plan import CPPlan, RingLayout

KV_TAG, DKV_TAG = 0, 1


def ring_attention(q_LHD, k_LHD, v_LHD, plan: CPPlan, group, causal: bool = True,
                   scale: float | None = None, backend: str = "auto",
                   stats: CommStats | None = None):
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
    return RingAttention.apply(q_LHD, k_LHD, v_LHD, plan.ring, rank, group, causal, scale,
                               backend, stats)


def check_local_shapes(q, k, v, tokens: int, who: str) -> None:
    if q.dim() != 3 or k.dim() != 3 or k.shape != v.shape:
        raise ValueError(f"{who}: expects q [L, Hq, D], k and v [L, Hkv, D]; got q "
                         f"{tuple(q.shape)}, k {tuple(k.shape)}, v {tuple(v.shape)}")
    if q.shape[0] != tokens or k.shape[0] != tokens:
        raise ValueError(f"{who}: this rank holds {tokens} tokens in the plan but q has "
                         f"{q.shape[0]} and k {k.shape[0]}; shard inputs with plan.shard(x, rank)")


class RingAttention(torch.autograd.Function):
    """Autograd wrapper of ring_forward / ring_backward on one ring layout and ring rank."""

    @staticmethod
    def forward(ctx, q, k, v, layout, rank, group, causal, scale, backend, stats):
        args = (layout, rank, group, causal, scale, backend, stats)
        out, lse = ring_forward(q, k, v, *args)
        ctx.save_for_backward(q, k, v, out, lse)
        ctx.args = args
        ctx.mark_non_differentiable(lse)
        return out, lse

    @staticmethod
    def backward(ctx, dout, _dlse):
        q, k, v, out, lse = ctx.saved_tensors
        dq, dk, dv = ring_backward(dout.contiguous(), q, k, v, out, lse, *ctx.args)
        return dq, dk, dv, None, None, None, None, None, None, None


def _kv_block(k, v, z: int) -> torch.Tensor:
    """[2, Z, Hkv, D]: K and V of the ring tokens, one contiguous buffer (one message)."""
    return torch.stack([k[:z], v[:z]])


def ring_forward(q, k, v, layout: RingLayout, rank: int, group, causal: bool, scale, backend,
                 stats: CommStats | None):
    """-> (out [L, Hq, D] q.dtype, lse [Hq, L] acc dtype)."""
    p, z = layout.size, layout.zigzag_tokens
    out_acc, lse_acc = new_accumulators(q)
    use_ring = p > 1 and z > 0
    cur = _kv_block(k, v, z) if use_ring else None
    for t in range(p):
        reqs, nxt = [], None
        if use_ring and t + 1 < p:
            nxt = torch.empty_like(cur)
            reqs = ring_exchange(cur, nxt, group, stats, "ring_fwd_kv", KV_TAG)
        spec = layout.step(rank, t, causal).to(q.device)
        if not spec.empty:
            kk, vv = (k, v) if t == 0 else (cur[0], cur[1])
            o, lse = attn_forward(q, kk, vv, spec.cu_q, spec.cu_k, spec.max_q, spec.max_k,
                                  spec.causal, scale, backend)
            merge_(out_acc, lse_acc, o, lse)
        wait_all(reqs)
        cur = nxt
    return out_acc.to(q.dtype), lse_acc


def _block_grads(dout, q, kk, vv, out, lse, spec, scale, backend):
    return attn_backward(dout, q, kk, vv, out, lse, spec.cu_q, spec.cu_k, spec.max_q,
                         spec.max_k, spec.causal, scale, backend)


def ring_backward(dout, q, k, v, out, lse, layout: RingLayout, rank: int, group, causal: bool,
                  scale, backend, stats: CommStats | None):
    """-> (dq, dk, dv) in the input dtypes, accumulated in acc_dtype."""
    p, z = layout.size, layout.zigzag_tokens
    adt = acc_dtype(q.dtype)
    dq = torch.zeros(q.shape, dtype=adt, device=q.device)
    dk = torch.zeros(k.shape, dtype=adt, device=k.device)
    dv = torch.zeros(v.shape, dtype=adt, device=v.device)
    use_ring = p > 1 and z > 0
    cur = _kv_block(k, v, z) if use_ring else None
    travel_reqs, travel_in = [], None
    for t in range(p):
        reqs, nxt = [], None
        if use_ring and t + 1 < p:
            nxt = torch.empty_like(cur)
            reqs = ring_exchange(cur, nxt, group, stats, "ring_bwd_kv", KV_TAG)
        spec = layout.step(rank, t, causal).to(q.device)
        kk, vv = (k, v) if t == 0 else (cur[0], cur[1]) if use_ring else (None, None)
        grads = None if spec.empty else _block_grads(dout, q, kk, vv, out, lse, spec, scale,
                                                     backend)
        if grads is not None:
            dq += grads[0]
        if t == 0 and grads is not None:
            dk += grads[1]
            dv += grads[2]
        elif t > 0 and use_ring:
            contrib = (torch.stack([grads[1], grads[2]]).to(adt) if grads is not None
                       else torch.zeros(cur.shape, dtype=adt, device=cur.device))
            wait_all(travel_reqs)
            travel = contrib if t == 1 else travel_in + contrib
            travel_in = torch.empty_like(travel)
            travel_reqs = ring_exchange(travel, travel_in, group, stats, "ring_bwd_dkv", DKV_TAG)
        wait_all(reqs)
        cur = nxt
    if use_ring:
        wait_all(travel_reqs)  # the accumulator of this rank's own block is back home
        dk[:z] += travel_in[0]
        dv[:z] += travel_in[1]
    return dq.to(q.dtype), dk.to(k.dtype), dv.to(v.dtype)
