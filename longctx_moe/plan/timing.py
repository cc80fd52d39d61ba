"""Modeled step time of a layout: one cost shape, a*tokens + b*attention pairs (the Dynamic-CP
scheduler's, cp_attention.dynamic_cost.DynamicCPCost), at achieved throughputs per GPU kind,
plus each collective the layout runs, over the link its group crosses.

Efficiencies (achieved / datasheet peak, gpus.py's peaks):
- GEMMs 0.68: the H200 run's profile of the ~1B bench model's step (docs/PERFORMANCE.md, the GPU
  check): 70.5 ms of dense and grouped GEMMs for its 6 x 239.7M x 32,768 = 47.1 TFLOP (0.68 of
  989 TFLOP/s; its 8192^3 matmul reached 0.78). H100 has the same tensor cores and clocks; B200
  assumed the same fraction (unmeasured).
- Attention on long tiles, with the tile efficiency m / (m + 490) at m tokens per rank
  (cp_attention.dynamic_cost.H100_ATTN_HALF_TOKENS): 0.5 of peak on H100 / B200 with
  FlashAttention-3 (its published H100 forward + backward figures); 0.24 on H200, measured with
  the backend that run had (torch_varlen, no FlashAttention in its image): 36.8 ms for 7.1 TFLOP
  at a mean tile efficiency of 0.83.
- Everything else on the device (norms, RoPE, routing, permutes, casts, copies, the loss, the
  launch gaps): HBM traffic of OTHER_BYTES per token, layer and (hidden x (1 + top-k)) element
  (the rows a layer's elementwise ops touch: the residual stream and the top-k expert rows),
  fit on the same profile: the 282 ms step less its GEMMs, attention and optimizer (166 ms),
  less the weight casts (below) since they are counted apart.
  One fit, so the H200 check of that step checks the GEMM and attention constants, not this one;
  bench/planner.py also reports the small bench model's step on that GPU, which it was not fit on.
- Optimizer: a fused AdamW step reads and writes each fp32 parameter, its two moments and reads
  its gradient, 28 bytes per parameter a rank updates, at 0.8 of HBM bandwidth (8.0 ms modeled
  for the profile's 8.7 ms). With bf16 parameters (train.param_dtype=bf16, optim.MasterAdamW)
  the step runs on fp32 masters and then rounds each into its bf16 weight (4 read + 2 written),
  and without the distributed optimizer first widens each bf16 gradient to fp32 (2 + 4; the
  distributed optimizer's reduce-scatter leaves fp32 gradients on the masters): 40 bytes, 34
  with the distributed optimizer.
- AdamW on the host (optim.offload=cpu, optim_offload.HostAdamW): the device's AdamW is replaced
  by rehearsal.cost.host_optimizer_seconds of the rank's optimizer shard (every gradient over
  PCIe, the host's AdamW, every weight back, in the weights' dtype). HostAdamW runs them one
  after the other between the backward and the next forward and the device waits: none of it
  overlaps, and it is counted in compute_s where the device's AdamW was.
- Casts: with fp32 parameters autocast casts every weight a rank computes with to bf16 in each
  forward (a full recompute's too): 6 bytes an element (4 read, 2 written) at 0.8 of HBM
  bandwidth; bf16 parameters skip it. The embedding's rows are counted with the rest (a lookup,
  not cast: a few % of a model's weights). On the profile's ~1B model: 1.7 ms of the step,
  taken out of OTHER_BYTES' fit (2.7 of its 270 bytes).
- FP8 (execution.fp8=torch, tensor recipe): the GEMMs model/fp8.py makes FP8, every block's
  nn.Linear (attention and dense-MLP projections, shared experts) and the routed experts,
  forward and both backward products, run at FP8_GEMM_EFFICIENCY of the FP8 peak; the router,
  the LM head and attention's own products stay bf16. 0.59: DeepGEMM's published H800 table
  (github.com/deepseek-ai/DeepGEMM README, Feb 2025: H800 SXM has the H100's FP8 tensor cores;
  1,979 TFLOP/s dense peak) over its training-sized shapes, the dense M=4096 GEMMs of K >= 1536
  (990-1,358 TFLOP/s) and the contiguous grouped GEMMs (1,093-1,297 TFLOP/s): 1,168 TFLOP/s on
  average, 1.74x our bf16 GEMMs' 0.68 of 989. Our GEMMs are torch._scaled_mm (cuBLAS) and a
  loop over experts in the backward, not DeepGEMM: unmeasured here (the GPU check's fp8.json
  will time the ~1B step with execution.fp8=torch); B200 assumed the same fraction. Plus the
  traffic kernels/fp8.py runs around them, eagerly, at 0.8 of HBM bandwidth: quantizing an
  operand costs FP8_QUANTIZE_BYTES = 33 bytes an element (abs, amax, widen to fp32, scale,
  clamp, narrow to E4M3 / E5M2: 33 bytes for a bf16 activation or gradient and for an fp32
  weight alike), and copying an FP8 operand into the layout cuBLAS wants 2 (the weight for
  the input gradient, the gradient and the input for the weight gradient). Each forward
  quantizes each FP8 GEMM's input and weight (every expert a rank holds, whatever its rows, in
  each micro-batch); each backward its output gradient. At these rates an FP8 GEMM of K x N
  pays back the quantizing of its activations only when K N / (K + N) exceeds ~2,700 (both
  widths above ~5,500 on H100), before its weights' share: FP8 speeds up wide models and slows
  down narrow ones. MFU stays over the bf16 peak.
- Recompute: a full recompute runs each block's forward again (a third of the GEMMs, 1/3.5 of
  attention, a third of the rest); a selective one the routed experts' gate / up grouped GEMM
  (model/recompute.py), at the FP8 rate where the layout runs FP8 (its input's FP8 quantize is
  not counted again).
- Links: NCCL reaches ~45% of NVLink 4's 450 GB/s per direction for send/recv and all-to-all
  inside a node (dynamic_cost.DynamicCPCost.h100's 200 GB/s), 80% of the 50 GB/s of one IB NDR
  port across nodes (assumed); 20 us per collective call (gpus.py).
Communication counted per step on one rank (bus bytes, nccl-tests' convention):
- TP with sequence parallelism: per layer an all-gather and a reduce-scatter around attention and
  around the MLP / experts, forward and backward (a full recompute repeats the forward's);
- ETP: per MoE layer an all-gather of the routed rows and a reduce-scatter of the output;
- EP: per MoE layer the dispatch and combine all-to-alls, forward and backward (and recompute);
- CP: DynamicCPCost.comm_seconds per document on its run (ring K/V, Ulysses heads);
- gradients: all-reduce (or reduce-scatter) over DP x CP for dense weights, EDP for experts,
  overlapped with the backward except what exceeds it; the distributed optimizer's all-gather
  after the step is exposed.
TP and EP collectives are counted as exposed (the shared expert's overlap is not modelled), as
the rehearsal's cost.py does.
"""

from __future__ import annotations

import heapq
import math
from dataclasses import dataclass, field

import numpy as np

from cp_attention.dynamic_cost import H100_ATTN_HALF_TOKENS, DynamicCPCost
from data_packing.balance import causal_pairs, token_pair_cost
from longctx_moe.model.flops import active_matmul_params, attention_flops_per_pair
from longctx_moe.plan.layouts import Layout
from longctx_moe.rehearsal.cost import HostStep, host_optimizer_seconds
from longctx_moe.rehearsal.gpus import GPU

GEMM_EFFICIENCY = {"h100": 0.68, "h200": 0.68, "b200": 0.68}
FP8_GEMM_EFFICIENCY = {"h100": 0.59, "h200": 0.59, "b200": 0.59}  # of gpu.fp8_flops
ATTENTION_EFFICIENCY = {"h100": 0.5, "h200": 0.24, "b200": 0.5}
# the profile's fit (above): 270 bytes, less the weight casts' 1.7 ms (2.7 of them)
OTHER_BYTES = 267.3
ADAMW_BYTES_PER_PARAM = 28
BF16_MASTER_BYTES = 6  # a master rounded into its bf16 weight, or a bf16 gradient widened
CAST_BYTES = 6  # an fp32 weight cast to bf16 by autocast
FP8_QUANTIZE_BYTES = 33
FP8_TRANSPOSE_BYTES = 2
HBM_EFFICIENCY = 0.8
NVLINK_EFFICIENCY = 0.45
NETWORK_EFFICIENCY = 0.8
ACT_BYTES = 2  # bf16 activations on the wire
GRAD_BYTES = 4  # gradients reduced in fp32


@dataclass(frozen=True)
class Workload:
    lengths: np.ndarray  # document lengths of one step (all replicas together)
    rank_tokens: int  # tokens one rank holds of a micro-batch (the longest document's share)
    # per-document sums shared by the layouts of one plan (attention, its imbalance and CP
    # traffic depend on a few of a layout's degrees, not all): tens of thousands of layouts are
    # timed, and the per-document loops are what costs
    memo: dict = field(default_factory=dict, compare=False, repr=False)

    @property
    def tokens(self) -> int:
        if "tokens" not in self.memo:
            self.memo["tokens"] = int(self.lengths.sum())
        return self.memo["tokens"]


@dataclass(frozen=True)
class _ModelSums:
    """What step_time needs of a model's shapes, the same for every layout of a plan."""
    active: float  # active_matmul_params
    fp8: tuple[float, float, float, float]  # fp8_gemms
    pair_flops: float  # attention_flops_per_pair


def _sums(model, work: Workload) -> _ModelSums:
    key = ("model", id(model))
    if key not in work.memo:
        work.memo[key] = _ModelSums(float(active_matmul_params(model)), fp8_gemms(model),
                                    float(attention_flops_per_pair(model)))
    return work.memo[key]


def _link(gpu: GPU, spans_nodes: bool) -> float:
    return gpu.network_bytes_per_s * NETWORK_EFFICIENCY if spans_nodes else gpu.nvlink_bytes_per_s * NVLINK_EFFICIENCY


def _runs(layout: Layout, lengths: np.ndarray, rank_tokens: int) -> np.ndarray:
    """The CP run size of each document: the layout's CP, or under Dynamic-CP the smallest power
    of two whose share fits a rank's tokens."""
    if not layout.dynamic_cp:
        return np.full(len(lengths), layout.cp)
    need = np.maximum(1, np.ceil(lengths / rank_tokens))
    return np.minimum(2 ** np.ceil(np.log2(need)), layout.cp).astype(int)


def _cp_cost(model, gpu: GPU, gpu_kind: str, layout: Layout, a2a: int) -> DynamicCPCost:
    heads, kv_heads, qk, v = model.attention_dims()
    spans = layout.tp * layout.cp > gpu.gpus_per_node and layout.cp_backend != "hierarchical" \
        or layout.cp_backend == "hierarchical"
    return DynamicCPCost.from_model(
        num_layers=model.num_layers, num_heads=max(1, heads // layout.tp),
        num_kv_heads=max(1, kv_heads // layout.tp), head_dim=qk, v_head_dim=v,
        active_params_per_token=active_matmul_params(model),
        flops_per_s=gpu.bf16_flops * GEMM_EFFICIENCY[gpu_kind],
        attention_flops_per_s=gpu.bf16_flops * ATTENTION_EFFICIENCY[gpu_kind],
        bandwidth=_link(gpu, spans), attn_half_tokens=H100_ATTN_HALF_TOKENS, a2a_size=a2a,
        ring_latency=gpu.collective_latency_s)


def _attention(model, gpu: GPU, gpu_kind: str, layout: Layout, work: Workload) -> tuple[float, float, float]:
    """(device seconds of the step's attention, its FLOPs, the busiest replica's excess seconds),
    memoised on what they depend on: CP, Dynamic-CP, DP and the rank's tokens."""
    key = ("attn", id(model), id(gpu), gpu_kind, layout.cp, layout.dynamic_cp, layout.dp, work.rank_tokens)
    if key not in work.memo:
        lengths = work.lengths.astype(float)
        pair_flops = attention_flops_per_pair(model) * causal_pairs(lengths)
        runs = _runs(layout, lengths, work.rank_tokens)
        eff = (lengths / runs) / (lengths / runs + H100_ATTN_HALF_TOKENS)
        attn_device_s = pair_flops / (gpu.bf16_flops * ATTENTION_EFFICIENCY[gpu_kind] * eff)
        # imbalance: the busiest data-parallel replica's attention over the mean (documents dealt
        # longest first to the least loaded replica, as the loader balances cost)
        imbalance = _imbalance(attn_device_s * runs / layout.cp, layout.dp) / (layout.world / layout.dp)
        work.memo[key] = (float(attn_device_s.sum()), float(pair_flops.sum()), imbalance)
    return work.memo[key]


def _cp_comm(model, gpu: GPU, gpu_kind: str, layout: Layout, work: Workload) -> float:
    """Seconds of CP traffic one rank spends per step (each document's run), memoised."""
    key = ("cp", id(model), id(gpu), gpu_kind, layout.tp, layout.cp, layout.cp_backend, layout.cp_inner,
           layout.dynamic_cp, layout.dp, work.rank_tokens)
    if key not in work.memo:
        a2a = {"ring": 1, "ulysses": layout.cp, "hierarchical": layout.cp_inner}[layout.cp_backend]
        cost = _cp_cost(model, gpu, gpu_kind, layout, a2a)
        lengths = work.lengths.astype(float)
        runs = _runs(layout, lengths, work.rank_tokens)
        # a document's seconds are linear in its tokens at a run size: one call per size
        per_size = sum(s * cost.comm_seconds(float(lengths[runs == s].sum()), int(s)) for s in np.unique(runs) if s > 1)
        rank_tokens_step = lengths.sum() / (layout.dp * layout.cp)
        micro_batches = max(1, math.ceil(rank_tokens_step / work.rank_tokens))
        work.memo[key] = float(per_size / (layout.dp * layout.cp)) + micro_batches * cost.ring_step_seconds
    return work.memo[key]


def fp8_gemms(model) -> tuple[float, float, float, float]:
    """The GEMMs model/fp8.py puts in FP8, from the model's shapes: (their weights a token
    multiplies with, the input elements and the output elements a token brings to them, summed
    over them; the weights of the non-expert ones). Every block's nn.Linear (attention and the
    dense and shared-expert MLPs) and the routed experts' two grouped GEMMs (top-k rows a token)."""
    d, heads = model.hidden_size, model.num_heads
    if model.attention_type == "mla":
        qk = model.qk_nope_head_dim + model.qk_rope_head_dim
        q = [(d, model.q_lora_rank), (model.q_lora_rank, heads * qk)] if model.q_lora_rank else [(d, heads * qk)]
        attention = q + [(d, model.kv_lora_rank + model.qk_rope_head_dim),
                         (model.kv_lora_rank, heads * (model.qk_nope_head_dim + model.v_head_dim)),
                         (heads * model.v_head_dim, d)]
    else:
        hd, kv = model.head_dim, model.num_kv_heads
        attention = [(d, heads * hd), (d, kv * hd), (d, kv * hd), (heads * hd, d)]
    moe = model.num_moe_layers
    # (K, N, rows a token, layers, whether an expert's)
    gemms = [(k, n, 1, model.num_layers, False) for k, n in attention]
    gemms += [(k, n, 1, model.first_k_dense, False) for k, n in _mlp(d, model.dense_hidden_size)]
    if model.shared_expert_hidden_size:
        gemms += [(k, n, 1, moe, False) for k, n in _mlp(d, model.shared_expert_hidden_size)]
    f = model.expert_hidden_size
    gemms += [(d, 2 * f, model.top_k, moe, True), (f, d, model.top_k, moe, True)]
    params = sum(k * n * rows * layers for k, n, rows, layers, _ in gemms)
    inputs = sum(k * rows * layers for k, n, rows, layers, _ in gemms)
    outputs = sum(n * rows * layers for k, n, rows, layers, _ in gemms)
    dense = sum(k * n * layers for k, n, _, layers, expert in gemms if not expert)
    return float(params), float(inputs), float(outputs), float(dense)


def _mlp(d: int, hidden: int) -> list[tuple[int, int]]:
    """A SwiGLU MLP's three projections (gate, up, down) as (K, N)."""
    return [(d, hidden), (d, hidden), (hidden, d)]


def _gemm_seconds(sums: _ModelSums, gpu: GPU, gpu_kind: str, layout: Layout, tokens: float) -> float:
    """Device seconds of the step's GEMMs (forward and backward, all ranks): the FP8 ones at the
    FP8 rate where the layout runs FP8."""
    fp8 = sums.fp8[0] if layout.fp8 else 0.0
    return 6.0 * tokens * ((sums.active - fp8) / _gemm_rate(gpu, gpu_kind, False) + fp8 / _gemm_rate(gpu, gpu_kind, True))


def _gemm_rate(gpu: GPU, gpu_kind: str, fp8: bool) -> float:
    """FLOP/s a GEMM achieves: bf16, or FP8 (module docstring: FP8)."""
    return gpu.fp8_flops * FP8_GEMM_EFFICIENCY[gpu_kind] if fp8 else gpu.bf16_flops * GEMM_EFFICIENCY[gpu_kind]


def _recompute_seconds(model, gpu: GPU, gpu_kind: str, layout: Layout, tokens: float, gemm_s: float,
                       attn_s: float, other: float) -> float:
    """Device seconds (all ranks) a step's recompute adds (module docstring: Recompute)."""
    if layout.recompute == "full":
        return gemm_s / 3 + attn_s / 3.5 + other / 3
    if layout.recompute == "selective":
        flops = 2.0 * tokens * model.top_k * model.hidden_size * 2 * model.expert_hidden_size * model.num_moe_layers
        return flops / _gemm_rate(gpu, gpu_kind, layout.fp8)
    return 0.0


def _precision_traffic(sums: _ModelSums, gpu: GPU, layout: Layout, tokens: float,
                       rank_weights: tuple[float, float], micro_batches: int) -> tuple[float, float]:
    """(device seconds of all ranks' FP8 quantizing of activations and gradients, one rank's
    seconds of casting and quantizing its weights) of a step (module docstring: Casts, FP8).
    `rank_weights`: the (dense, expert) weights the rank computes with."""
    rate = gpu.hbm_bytes_per_s * HBM_EFFICIENCY
    forwards = 2 if layout.recompute == "full" else 1
    dense, expert = rank_weights
    fp8_weights = act_bytes = 0.0
    if layout.fp8:
        _, inputs, outputs, fp8_dense = sums.fp8
        fp8_weights = fp8_dense / layout.tp + expert
        act_bytes = tokens * (inputs * (FP8_QUANTIZE_BYTES * forwards + FP8_TRANSPOSE_BYTES)
                              + outputs * (FP8_QUANTIZE_BYTES + FP8_TRANSPOSE_BYTES))
    cast = CAST_BYTES * (dense + expert - fp8_weights) if layout.param_dtype == "fp32" else 0.0
    weight_bytes = forwards * (cast + FP8_QUANTIZE_BYTES * fp8_weights) + FP8_TRANSPOSE_BYTES * fp8_weights
    return act_bytes / rate, micro_batches * weight_bytes / rate


def optimizer_seconds(gpu: GPU, layout: Layout, updated: float) -> dict:
    """{"optimizer_s", "offload_s", "pcie_s", "host_adamw_s"} of one rank's AdamW step over the
    `updated` parameters of its shard: on the device (offload_s 0) or on the host."""
    param_bytes = 2 if layout.param_dtype == "bf16" else 4
    if layout.optimizer == "host":
        n = int(updated)
        host = host_optimizer_seconds(HostStep(n, 4 * n, param_bytes * n), gpu)
        return {"optimizer_s": host["offload_s"], **host}
    per_param = ADAMW_BYTES_PER_PARAM
    if layout.param_dtype == "bf16":
        per_param += BF16_MASTER_BYTES * (1 if layout.distributed_optimizer else 2)
    seconds = updated * per_param / (gpu.hbm_bytes_per_s * HBM_EFFICIENCY)
    return {"optimizer_s": seconds, "offload_s": 0.0, "pcie_s": 0.0, "host_adamw_s": 0.0}


def step_time(model, gpu: GPU, gpu_kind: str, layout: Layout, work: Workload,
              param_counts: tuple[int, int]) -> dict:
    """{"compute_s", "comm_s", "imbalance_s", "total_s", "mfu", "tokens_per_s_per_gpu"} of one
    optimizer step of `work` on `layout`, with the optimizer's part of compute_s
    (optimizer_seconds' keys); `param_counts`: the model's (dense, expert) parameters."""
    world, tp, d = layout.world, layout.tp, model.hidden_size
    tokens, sums = float(work.tokens), _sums(model, work)
    gemm_s = _gemm_seconds(sums, gpu, gpu_kind, layout, tokens)
    attn_s, pair_flops, imbalance = _attention(model, gpu, gpu_kind, layout, work)
    other = OTHER_BYTES * tokens * model.num_layers * d * (1 + model.top_k) / gpu.hbm_bytes_per_s
    rank_tokens_step = tokens / (layout.dp * layout.cp)
    micro_batches = max(1, math.ceil(rank_tokens_step / work.rank_tokens))
    dense, expert = param_counts
    ep_size = layout.ep * layout.etp
    quant_s, weights_s = _precision_traffic(sums, gpu, layout, tokens, (dense / tp, expert / ep_size), micro_batches)
    recompute_s = _recompute_seconds(model, gpu, gpu_kind, layout, tokens, gemm_s, attn_s, other)
    compute = (gemm_s + attn_s + other + quant_s + recompute_s) / world + weights_s
    passes = 3 if layout.recompute == "full" else 2  # forward (again), backward
    comm = 0.0
    if tp > 1:
        bus = (tp - 1) / tp * rank_tokens_step * d * ACT_BYTES
        calls = 4 * passes * model.num_layers * micro_batches
        comm += calls * gpu.collective_latency_s + 4 * passes * model.num_layers * bus / _link(gpu, tp > gpu.gpus_per_node)
    if layout.ep > 1:
        rows = rank_tokens_step / tp * model.top_k
        bus = (layout.ep - 1) / layout.ep * rows * d * ACT_BYTES
        inside = min(1.0, gpu.gpus_per_node / ep_size)
        link = 1 / (inside / _link(gpu, False) + (1 - inside) / _link(gpu, True))
        n = 2 * passes * model.num_moe_layers
        comm += n * micro_batches * gpu.collective_latency_s + n * bus / link
    if layout.etp > 1:  # ETP gathers the routed rows and reduce-scatters the experts' output
        rows = rank_tokens_step / tp * model.top_k * layout.etp
        bus = (layout.etp - 1) / layout.etp * rows * d * ACT_BYTES
        n = 2 * passes * model.num_moe_layers
        comm += n * micro_batches * gpu.collective_latency_s + n * bus / _link(gpu, ep_size > gpu.gpus_per_node)
    if layout.cp > 1:
        comm += _cp_comm(model, gpu, gpu_kind, layout, work)
    grads = 0.0
    for n, group, spans in ((dense / tp, layout.dp * layout.cp, world > tp * 1 and world > gpu.gpus_per_node),
                            (expert / ep_size, layout.edp, world > gpu.gpus_per_node)):
        if group > 1:
            grads += 2 * (group - 1) / group * n * GRAD_BYTES / _link(gpu, spans)
    backward = compute * 2 / 3
    # the optimizer updates the rank's shard: all of its weights, or 1 / (DP x CP) and 1 / EDP of
    # them under the distributed optimizer
    updated = dense / tp / (layout.dp * layout.cp if layout.distributed_optimizer else 1) \
        + expert / ep_size / (layout.edp if layout.distributed_optimizer else 1)
    optimizer = optimizer_seconds(gpu, layout, updated)
    compute += optimizer["optimizer_s"]
    # the distributed optimizer's all-gather of the updated weights: half the all-reduce's bus
    # bytes, in the weights' dtype
    param_bytes = 2 if layout.param_dtype == "bf16" else 4
    gather = grads / 2 * param_bytes / GRAD_BYTES if layout.distributed_optimizer else 0.0
    comm += max(0.0, grads - backward) + gather
    total = compute + comm + imbalance
    model_flops = token_pair_cost(tokens, pair_flops / sums.pair_flops, 6.0 * sums.active, sums.pair_flops)
    return {"compute_s": compute, "comm_s": comm, "imbalance_s": imbalance, "total_s": total,
            "mfu": model_flops / (total * world * gpu.bf16_flops),
            "tokens_per_s_per_gpu": tokens / total / world, **optimizer}


def _imbalance(cost: np.ndarray, replicas: int) -> float:
    """Seconds the busiest of `replicas` bins holds above the mean, documents dealt longest first
    to the least loaded bin."""
    if replicas <= 1 or len(cost) == 0:
        return 0.0
    bins = [0.0] * replicas  # a heap of the bins' loads: the least loaded on top
    for c in np.sort(cost)[::-1].tolist():
        heapq.heapreplace(bins, bins[0] + c)
    return max(bins) - sum(bins) / replicas
