"""DataConfig: what the trainer's loader reads (owned by data_packing), and its validation."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass
class DataConfig:
    path: str = "data/stdlib_tiny"  # a directory written by `longctx-pack`
    global_batch_tokens: int = 8192  # real tokens per optimizer step, summed over DP ranks
    micro_batch_tokens: int = 2048  # token budget of one micro-batch on one rank
    # Estimated training cost of a document of padded length L, used to balance the DP ranks
    # (balance.doc_cost, the project's one a*tokens + b*pairs shape, balance.token_pair_cost):
    #     cost_per_token * L + cost_per_token_pair * L * (L + 1) / 2   (causal query-key pairs)
    # in units of one token's dense work. Per token the dense layers cost 6 * N FLOPs (fwd + bwd,
    # N active matmul parameters); per causal pair attention costs 12 * H * D * layers (QK^T and
    # PV, 2 FLOPs per head dim each, the backward twice the forward; longctx_moe.model.flops).
    # The pair cost is their ratio, 2 * H * D * layers / N: for the default model (H=4, D=32,
    # 2 layers, N = 821,248 with the lm head) 512 / 821,248 = 6.2e-4: attention adds a third to the
    # dense cost of a 1024-token document and 2.6 times it at 8192 tokens. Recompute it for
    # another model.
    cost_per_token: float = 1.0
    cost_per_token_pair: float = 6.2e-4
    shuffle: bool = True
    seed: int = 0
    # Each document is padded to a multiple of this and of what the parallel layout needs
    # (data_packing.batch.pad_multiple, which the trainer adds: their lcm).
    pad_multiple: int = 1
    # Check of the packed files at start-up against their shard.json: "full" recomputes every
    # checksum (reads all data once), "sizes" compares file sizes only (instant).
    verify: str = "full"

    def __post_init__(self) -> None:
        # Checked once, when the value is made: by the config loader, or by a library caller
        # building the section itself. The components that take it do not check it again.
        self.validate()

    def validate(self) -> None:
        """Raise ValueError naming the `data.<key>`, its value and the fix."""
        checks = [
            (self.micro_batch_tokens >= 1, f"data.micro_batch_tokens={self.micro_batch_tokens} must be >= 1"),
            (self.global_batch_tokens >= self.micro_batch_tokens,
             f"data.global_batch_tokens={self.global_batch_tokens} must be >= data.micro_batch_tokens="
             f"{self.micro_batch_tokens}; raise it or lower micro_batch_tokens"),
            (self.pad_multiple >= 1, f"data.pad_multiple={self.pad_multiple} must be >= 1"),
            (self.verify in ("full", "sizes"), f"data.verify={self.verify!r} must be 'full' or 'sizes'"),
            (self.cost_per_token >= 0 and self.cost_per_token_pair >= 0,
             f"data.cost_per_token={self.cost_per_token} and data.cost_per_token_pair="
             f"{self.cost_per_token_pair} must be >= 0"),
        ]
        for ok, msg in checks:
            if not ok:
                raise ValueError(msg)
