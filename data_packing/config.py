"""DataConfig: what the trainer's loader reads (owned by data_packing)."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass
class DataConfig:
    path: str = "data/stdlib_tiny"  # a directory written by `longctx-pack`
    global_batch_tokens: int = 8192  # real tokens per optimizer step, summed over DP ranks
    micro_batch_tokens: int = 2048  # token budget of one micro-batch on one rank
    # Estimated cost of a document of length L: cost_a * L + cost_b * L**2 (attention is the L**2).
    cost_a: float = 1.0
    cost_b: float = 0.0
    shuffle: bool = True
    seed: int = 0
    # Each document is padded to a multiple of this (lcm(2*CP, TP)); set by the trainer.
    pad_multiple: int = 1
