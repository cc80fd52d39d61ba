"""A modeled step time for a rehearsed rank, from what the rank's step ran.

- Device work: each op at its roofline, max(FLOPs / peak FLOP/s, bytes / HBM bandwidth), summed
  (DeviceRules.work: FLOPs by `op_flops`, bytes as the op's inputs and outputs; the FP8 GEMMs at
  the FP8 peak, `is_fp8_gemm`). Peaks are the datasheet's (gpus.py): real kernels reach 50-80% of them on large GEMMs, so this is a lower
  bound of the compute time.
- Host: each launch costs `launch_s` of the host's time; the device waits where the launches
  take longer than the work they issue (a host-bound step).
- Communication: each collective call costs the link latency plus its bus bytes (nccl-tests'
  convention, collectives.py) over the link it crosses: NVLink inside a node, the network when
  its group spans nodes (ranks numbered node by node). Counted as exposed: the overlap the
  dispatchers achieve is not modelled, so this is an upper bound of the exposed time.
- optim.offload=cpu: the gradients' and the weights' copies over the GPU's host link and the
  host's AdamW (`host_optimizer_seconds`), exposed whole: the step waits on them.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from longctx_moe.rehearsal.gpus import GPU

aten = torch.ops.aten


def _spans_nodes(ranks: list[int], per_node: int) -> bool:
    return len({r // per_node for r in ranks}) > 1


def model_step_time(flops: float, tracker, rules, gpu: GPU, group_ranks: dict[str, list[int]],
                    host_step: HostStep | None = None) -> dict:
    """{"compute_s", "host_s", "comm_s", "offload_s" (with its "pcie_s" and "host_adamw_s"),
    "total_s"} of one rank's step; `host_step`: what optim.offload=cpu moves and steps on the
    host (`host_step_of`), None where the optimizer runs on the device."""
    compute = sum(max(f / (gpu.fp8_flops if fp8 else gpu.bf16_flops), b / gpu.hbm_bytes_per_s)
                  for f, b, fp8 in rules.work)
    host = sum(rules.launches.values()) * gpu.launch_s
    comm = 0.0
    for (label, _kind), t in rules.traffic.items():
        ranks = group_ranks.get(label, [])
        bandwidth = gpu.network_bytes_per_s if _spans_nodes(ranks, gpu.gpus_per_node) else gpu.nvlink_bytes_per_s
        comm += t.calls * gpu.collective_latency_s + t.bus_bytes / bandwidth
    offload = host_optimizer_seconds(host_step or HostStep(0, 0, 0), gpu)
    return {"compute_s": compute, "host_s": host, "comm_s": comm, **offload,
            "total_s": max(compute, host) + comm + offload["offload_s"], "flops": flops}


# ---- optim.offload=cpu
#
# HostAdamW (optim_offload.py) runs between the backward and the next forward, one after the
# other: every gradient device -> host, AdamW on the host's fp32 masters, every weight host ->
# device. The device waits on all three.
# - the copies: their bytes over the GPU's host link, each direction in turn (the AdamW between
#   them), at gpu.host_link_bytes_per_s;
# - AdamW: torch's fused CPU kernel reads a master, its gradient and the two moments and writes
#   the master and the moments (28 bytes an fp32 element), and the copies' DMA writes the
#   gradient and reads the master there (8 more): 36 bytes of the host's memory an element, over
#   the rank's share of the node's DRAM bandwidth; or the kernel's arithmetic, over the rank's
#   share of the node's cores, where slower. Fused CPU AdamW measured 0.84 G elements/s on one
#   core of the machine this project is developed on (a recent x86 server core).
HOST_ADAMW_BYTES_PER_ELEMENT = 36
HOST_ADAMW_ELEMENTS_PER_CORE_S = 0.84e9


@dataclass(frozen=True)
class HostStep:
    """What one rank's host optimizer moves and steps per optimizer step."""

    elements: int  # the fp32 masters AdamW updates on the host
    grad_bytes: int  # device -> host: the gradients
    weight_bytes: int  # host -> device: the updated weights, in the device tensors' dtype


def host_optimizer_seconds(step: HostStep, gpu: GPU) -> dict:
    """{"pcie_s", "host_adamw_s", "offload_s" (their sum)} of one rank's optim.offload=cpu step on
    `gpu`'s node, every rank of the node offloading alike. A planner prices a layout with
    HostStep(elements an optimizer rank owns, 4 x elements, weight bytes of those elements)."""
    ranks = gpu.gpus_per_node
    pcie = (step.grad_bytes + step.weight_bytes) / gpu.host_link_bytes_per_s
    memory = step.elements * HOST_ADAMW_BYTES_PER_ELEMENT / (gpu.host_memory_bytes_per_s / ranks)
    arithmetic = step.elements / (HOST_ADAMW_ELEMENTS_PER_CORE_S * gpu.host_cores / ranks)
    adamw = max(memory, arithmetic)
    return {"pcie_s": pcie, "host_adamw_s": adamw, "offload_s": pcie + adamw}


def host_step_of(optimizer) -> HostStep | None:
    """The HostStep of a trainer's optimizer (or of the HostAdamW a distributed optimizer wraps),
    None where none runs on the host."""
    from longctx_moe.optim_offload import HostAdamW

    opt = optimizer
    while opt is not None and not isinstance(opt, HostAdamW):
        opt = getattr(opt, "optimizer", None)
    if opt is None:
        return None
    return HostStep(elements=sum(m.numel() for m in opt.masters),
                    grad_bytes=sum(g.numel() * g.element_size() for g in opt._grads),
                    weight_bytes=sum(t.numel() * t.element_size() for t in opt.tensors))


# ---- FLOPs per op
#
# torch's flop counter (torch.utils.flop_counter) has the rules for dense matmuls. Three of the
# step's big ops it gets wrong on meta, where the rehearsal runs: varlen attention (without the
# values of cu_seqlens it counts every document at the longest length, and never halves for the
# causal mask: 4-5x the real work on RL-like lengths), and the grouped GEMMs of the experts (no
# rule: 0). Their rules are here. Document boundaries reach the device as copies of host tensors;
# DeviceRules keeps those copies' host values (`host_values`) so the attention rule can read them.

# A FlashAttention backward recomputes the scores and runs four more matmuls (dQ, dK, dV, dP)
# against the forward's two: 2.5x the forward's FLOPs (FlashAttention-2 paper, section 3.2).
_ATTN_BACKWARD_OVER_FORWARD = 2.5


def _named(func, args, kwargs) -> dict:
    names = [a.name for a in func._schema.arguments]
    return {**dict(zip(names, args, strict=False)), **kwargs}  # the rest are keywords


def _lengths(cu, host_values) -> list[int] | None:
    host = host_values.get(cu) if cu is not None and host_values is not None else None
    if host is None:
        return None
    return torch.diff(host.long()).tolist()


def _pairs(lq: int, lk: int, causal: bool, left: int | None) -> int:
    """(query, key) pairs a masked attention of one document visits: queries aligned to the end
    of the keys (FlashAttention's causal convention when lq < lk), each seeing at most `left` + 1
    keys when a window is set."""
    if not causal:
        return lq * lk
    cap = left + 1 if left is not None and left >= 0 else lk

    def seen(m: int) -> int:  # sum of min(y, cap) for y = 1..m
        return m * (m + 1) // 2 if m <= cap else cap * (cap + 1) // 2 + (m - cap) * cap

    return seen(lk) - seen(max(lk - lq, 0))


def _attention_flops(kw: dict, backward: bool, host_values) -> float | None:
    """aten's flash attention (cum_seq_*, window_size_left) and torch's varlen_attn op
    (cu_seq_*, window_size = [left, right]) alike."""
    q, v = kw["query"], kw["value"]
    cu_q = kw.get("cum_seq_q", kw.get("cu_seq_q"))
    cu_k = kw.get("cum_seq_k", kw.get("cu_seq_k"))
    lq, lk = _lengths(cu_q, host_values), _lengths(cu_k if cu_k is not None else cu_q, host_values)
    if lq is None or lk is None or len(lq) != len(lk):
        return None
    window = kw.get("window_size")
    causal, left = bool(kw.get("is_causal")), kw.get("window_size_left", window[0] if window else None)
    pairs = sum(_pairs(a, b, causal, left) for a, b in zip(lq, lk, strict=True))
    heads, d_qk, d_v = q.shape[-2], q.shape[-1], v.shape[-1]
    forward = 2.0 * pairs * heads * (d_qk + d_v)
    return forward * (_ATTN_BACKWARD_OVER_FORWARD if backward else 1.0)


def _grouped_mm_flops(kw: dict, out) -> float:
    """2 x output elements x the reduced dimension; for a 2-D x 2-D call (the weights' gradient,
    output [groups, M, N]) each group reduces over its own slice of K, together all of K."""
    a, b = kw["self"], kw["mat2"]
    if a.dim() == 2 and b.dim() == 2:
        return 2.0 * out.shape[-2] * out.shape[-1] * a.shape[-1]
    return 2.0 * out.numel() * a.shape[-1]


# varlen attention ops, by name (torch's varlen_attn registers its ops when its module is first
# imported): aten's flash attention, and torch.nn.attention.varlen's
_ATTENTION_BACKWARD = {"aten::_flash_attention_backward", "torch_attn::_varlen_attn_backward"}
_ATTENTION = {"aten::_flash_attention_forward", "torch_attn::_varlen_attn", *_ATTENTION_BACKWARD}
_FP8_MM = {getattr(aten, n) for n in ("_scaled_mm", "_scaled_mm_v2") if hasattr(aten, n)}
_FP8_GROUPED = {getattr(aten, n) for n in ("_scaled_grouped_mm", "_scaled_grouped_mm_v2") if hasattr(aten, n)}


def is_fp8_gemm(func) -> bool:
    return func._overloadpacket in _FP8_MM | _FP8_GROUPED


def op_flops(func, args, kwargs, out, host_values=None) -> float:
    """The FLOPs of one device op: the rules above, torch's flop counter for the other matmuls,
    0 for the rest (their cost is their bytes)."""
    packet, name = func._overloadpacket, func._schema.name
    if name in _ATTENTION:
        got = _attention_flops(_named(func, args, kwargs), name in _ATTENTION_BACKWARD, host_values)
        if got is not None:
            return got
    if packet is aten._grouped_mm or packet in _FP8_GROUPED:
        return _grouped_mm_flops(_named(func, args, kwargs), out)
    if packet in _FP8_MM:  # torch's rule knows _scaled_mm, not its v2 (the blockwise recipes')
        return 2.0 * out.numel() * args[0].shape[-1]
    from torch.utils.flop_counter import flop_registry

    rule = flop_registry.get(packet)
    if rule is None:
        return 0.0
    try:
        return float(rule(*args, **kwargs, out_val=out))
    except TypeError:  # a rule whose signature this overload does not match
        return 0.0
