"""ParallelConfig: parallel degrees and strategies (owned by the parallel package)."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass
class ParallelConfig:
    # Attention side: world = tp * cp * dp.  MoE side (Parallel Folding): world = etp * ep * edp.
    tp: int = 1
    cp: int = 1
    dp: int = -1  # -1: derived as world // (tp * cp)
    ep: int = 1
    etp: int = 1
    cp_backend: str = "ring"  # ring | ulysses | hierarchical
    hierarchical_sizes: list[int] | None = None  # [inner (a2a), outer (p2p)] for cp_backend=hierarchical
    # Dynamic-CP: also build CP subgroups of these sizes (each divides cp), for micro-batches
    # that run on fewer CP ranks; named cp_sub<size>.
    dynamic_cp_sizes: list[int] | None = None
    dispatcher: str = "alltoall"  # alltoall | allgather
    dispatch_dtype: str = "none"  # none | bf16 | fp8: payload compression of the expert all-to-all
    capacity_factor: float | None = None  # None: dropless
    drop_policy: str = "probs"  # probs | position: which assignments over capacity are dropped
    # Balance statistics of the aux / z losses: over each micro-batch (TP x CP share it), or over
    # the whole data-parallel batch (Megatron's global-batch aux loss; needs aux_loss_type=switch).
    aux_loss_scope: str = "micro_batch"  # micro_batch | global_batch
