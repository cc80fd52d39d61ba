"""A modeled step time for a rehearsed rank, from what the rank's step ran.

- Device work: each op at its roofline, max(FLOPs / peak FLOP/s, bytes / HBM bandwidth), summed
  (DeviceRules.work: FLOPs by torch's flop counter rules for matmuls and attention, bytes as the
  op's inputs and outputs). Peaks are the datasheet's (gpus.py): real kernels reach 50-80% of them
  on large GEMMs, so this is a lower bound of the compute time.
- Host: each launch costs `launch_s` of the host's time; the device waits where the launches
  take longer than the work they issue (a host-bound step).
- Communication: each collective call costs the link latency plus its bus bytes (nccl-tests'
  convention, collectives.py) over the link it crosses: NVLink inside a node, the network when
  its group spans nodes (ranks numbered node by node). Counted as exposed: the overlap the
  dispatchers achieve is not modelled, so this is an upper bound of the exposed time.
"""

from __future__ import annotations

from longctx_moe.rehearsal.gpus import GPU


def _spans_nodes(ranks: list[int], per_node: int) -> bool:
    return len({r // per_node for r in ranks}) > 1


def model_step_time(flops: float, tracker, rules, gpu: GPU, group_ranks: dict[str, list[int]]) -> dict:
    """{"compute_s", "host_s", "comm_s", "total_s"} of one rank's step."""
    compute = sum(max(f / gpu.bf16_flops, b / gpu.hbm_bytes_per_s) for f, b in rules.work)
    host = sum(rules.launches.values()) * gpu.launch_s
    comm = 0.0
    for (label, _kind), t in rules.traffic.items():
        ranks = group_ranks.get(label, [])
        bandwidth = gpu.network_bytes_per_s if _spans_nodes(ranks, gpu.gpus_per_node) else gpu.nvlink_bytes_per_s
        comm += t.calls * gpu.collective_latency_s + t.bus_bytes / bandwidth
    return {"compute_s": compute, "host_s": host, "comm_s": comm, "total_s": max(compute, host) + comm,
            "flops": flops}
