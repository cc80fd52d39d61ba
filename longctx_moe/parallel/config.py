"""ParallelConfig: parallel degrees and strategies (owned by the parallel package).

`validate()` checks what needs no world size (closed sets, the capacity factor), once, when the
value is made; the degrees are checked against the world by `ParallelDims.from_config`.
"""

from __future__ import annotations

from dataclasses import dataclass

from longctx_moe.choices import check_choice

CP_BACKENDS = ("ring", "ulysses", "hierarchical")
DISPATCHERS = ("alltoall", "allgather")
DISPATCH_DTYPES = ("none", "bf16", "fp8")
DROP_POLICIES = ("probs", "position")
AUX_LOSS_SCOPES = ("micro_batch", "global_batch")

# Allowed values of the string fields.
CHOICES = {
    "cp_backend": CP_BACKENDS,
    "dispatcher": DISPATCHERS,
    "dispatch_dtype": DISPATCH_DTYPES,
    "drop_policy": DROP_POLICIES,
    "aux_loss_scope": AUX_LOSS_SCOPES,
}


@dataclass
class ParallelConfig:
    # Attention side: world = tp * cp * dp.  MoE side (Parallel Folding): world = etp * ep * edp.
    tp: int = 1
    # Megatron sequence parallelism: between the TP regions each TP rank holds 1/tp of the tokens
    # (norms and residuals run on them); needs tp > 1 and each rank's tokens divisible by tp.
    sequence_parallel: bool = False
    cp: int = 1
    dp: int = -1  # -1: derived as world // (tp * cp)
    ep: int = 1
    etp: int = 1
    cp_backend: str = "ring"  # ring | ulysses | hierarchical
    hierarchical_sizes: list[int] | None = None  # [inner (a2a), outer (p2p)] for cp_backend=hierarchical
    # Dynamic-CP: each step's sequences are scheduled on power-of-two sub-groups of every
    # DP x CP block (cp_attention.dynamic), each sequence on the smallest CP size whose share
    # fits max_tokens_per_rank, with the ranks' work balanced. `cp` still sets the DP degree of
    # the loader (dp = world / (tp * cp)); the sub-groups span the whole DP x CP block.
    dynamic_cp: bool = False
    max_cp: int = 0  # the largest sub-group (a power of two <= dp * cp); 0: cp
    max_tokens_per_rank: int = 0  # tokens one rank holds in one slot; 0: data.micro_batch_tokens
    # The scheduler's cost model (cp_attention.dynamic_cost.DynamicCPCost.from_model): achieved
    # throughput per rank and ring bandwidth. Defaults are H100/H200-class (about 40% MFU of the
    # 989 TFLOP/s bf16 peak; NCCL send/recv over NVLink 4); only their ratios steer the plan.
    dcp_tflops: float = 400.0
    dcp_bandwidth_gbps: float = 200.0
    # Fixed cost of one ring step (p2p latency, launch, wait), paid 2 * layers * (s - 1) times
    # per slot by a run of s ranks: 12 us is NCCL's own p2p-hop estimate over NVLink (tuning.cc:
    # 8.4 + 3.4 us); ~22 us across nodes. 0: no latency term.
    dcp_ring_latency_us: float = 12.0
    # Attention tile efficiency eff(m) = m / (m + n_half) at m tokens per rank of a sequence:
    # 490 is the fit to FlashAttention-3's H100 fwd+bwd TFLOP/s at 512..16K tokens
    # (docs/PERFORMANCE.md, Dynamic-CP). 0: full efficiency at any length.
    dcp_attn_half_tokens: float = 490.0
    dispatcher: str = "alltoall"  # alltoall | allgather
    dispatch_dtype: str = "none"  # none | bf16 | fp8: payload compression of the expert all-to-all
    # Hide communication behind compute: the shared expert runs while the tokens' all-to-all is
    # in flight (forward and backward), and dense / expert gradients are all-reduced in buckets
    # of grad_bucket_mb launched from the last micro-batch's backward. The overlap computes the
    # same arithmetic (bitwise equal); buckets change only how gloo/NCCL chunk the sum.
    moe_overlap: bool = True
    grad_bucket_mb: float = 25.0  # 0: one buffer per dtype after the backward
    # 2: the forwards of two micro-batches run interleaved, each computing while the other's
    # expert all-to-alls travel (parallel/interleave.py); bitwise the results of 1, with both
    # micro-batches' activations live until their backward. Needs ep > 1 and the all-to-all.
    micro_batches_in_flight: int = 1
    # AdamW state sharded over the replicas of each parameter (dense over dp x cp, experts over
    # edp): gradients reduce-scattered, parameters all-gathered after the step
    # (parallel/distributed_optimizer.py). Same results as the replicated optimizer.
    distributed_optimizer: bool = False
    # Expert lending (parallel/expert_lending.py): each EP rank may run, per MoE layer and
    # micro-batch, up to this many borrowed copies of other ranks' overloaded experts, so every
    # rank processes about its share of the routed rows; results equal no lending up to the order
    # of each expert's gradient sum. 0: off. Needs ep > 1, etp = 1 and the all-to-all dispatcher.
    ep_spare_slots: int = 0
    capacity_factor: float | None = None  # None: dropless
    drop_policy: str = "probs"  # probs | position: which assignments over capacity are dropped
    # Balance statistics of the aux / z losses: over each micro-batch (TP x CP share it), or over
    # the whole data-parallel batch (Megatron's global-batch aux loss; needs balance.aux_loss_type=switch).
    aux_loss_scope: str = "micro_batch"  # micro_batch | global_batch

    @property
    def dynamic_max_cp(self) -> int:
        """The largest Dynamic-CP run size: max_cp, or cp where max_cp is 0."""
        return self.max_cp or self.cp

    def __post_init__(self) -> None:
        # Checked once, when the value is made: by the config loader, or by a library caller
        # building the section itself. The components that take it do not check it again.
        self.validate()

    def validate(self) -> None:
        """Raise ValueError naming the `parallel.<key>`, its value and the fix."""
        for key, allowed in CHOICES.items():
            check_choice(f"parallel.{key}", getattr(self, key), allowed)
        check_capacity_factor(self.capacity_factor)
        if self.micro_batches_in_flight not in (1, 2):
            raise ValueError(f"parallel.micro_batches_in_flight={self.micro_batches_in_flight} must be "
                             "1 or 2 (2: two micro-batches' forwards interleaved around the expert all-to-alls)")
        if not (isinstance(self.ep_spare_slots, int) and self.ep_spare_slots >= 0):
            raise ValueError(f"parallel.ep_spare_slots={self.ep_spare_slots} must be an integer >= 0 "
                             "(0: no expert lending)")
        if not self.grad_bucket_mb >= 0:
            raise ValueError(f"parallel.grad_bucket_mb={self.grad_bucket_mb} must be >= 0 "
                             "(0: one buffer after the backward)")
        for key in ("dcp_ring_latency_us", "dcp_attn_half_tokens"):
            value = getattr(self, key)
            if not (isinstance(value, (int, float)) and 0 <= value < float("inf")):
                raise ValueError(f"parallel.{key}={value} must be a finite number >= 0 (0 turns "
                                 "the Dynamic-CP cost term off)")


def check_capacity_factor(value: float | None) -> None:
    """None (dropless) or a positive factor; shared with the dispatchers' own argument check."""
    if value is not None and not value > 0:
        raise ValueError(f"parallel.capacity_factor={value} must be > 0, or null for dropless")
