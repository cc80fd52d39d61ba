"""A tiny model and step loader that follow the trainer's contracts, for fast exact tests.

ToyMoE: embedding -> softmax router over E experts (top-1, each a [D, D] matrix) -> output head.
Its auxiliary losses are token means (router entropy and a z-loss), so accumulating micro-batches
with the trainer's normalisation must equal one big batch exactly. Legend: T tokens, D model dim,
E experts, V vocabulary.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from data_packing.batch import IGNORE_INDEX, PackedBatch, labels_from_tokens, position_ids_from_cu


@dataclass
class ToyOutput:
    ce_sum: torch.Tensor
    aux_loss: torch.Tensor
    z_loss: torch.Tensor
    expert_counts: torch.Tensor  # [1, E]


class ToyMoE(torch.nn.Module):
    def __init__(self, vocab: int = 64, dim: int = 16, experts: int = 4):
        super().__init__()
        self.embed = torch.nn.Embedding(vocab, dim)
        self.router_DE = torch.nn.Parameter(torch.randn(dim, experts) * 0.3)
        self.experts_EDD = torch.nn.Parameter(torch.randn(experts, dim, dim) * dim**-0.5)
        self.norm = torch.nn.Parameter(torch.ones(dim))
        self.head = torch.nn.Linear(dim, vocab, bias=False)
        self.register_buffer("expert_bias_E", torch.zeros(experts))
        self.bias_updates = 0

    def forward(self, batch: PackedBatch) -> ToyOutput:
        x_TD = self.embed(batch.tokens)
        acc = torch.promote_types(x_TD.dtype, torch.float32)  # fp32 router math, fp64 in tests
        probs_TE = torch.softmax((x_TD @ self.router_DE).to(acc), dim=-1)
        idx_T = (probs_TE.detach() + self.expert_bias_E).argmax(dim=-1)
        w_T = probs_TE.gather(1, idx_T[:, None])[:, 0].to(x_TD.dtype)
        y_TD = torch.einsum("td,tdf->tf", x_TD, self.experts_EDD[idx_T]) * w_T[:, None]
        h_TD = (x_TD + y_TD) * self.norm
        logits_TV = self.head(h_TD).to(acc)
        mask_T = batch.labels != IGNORE_INDEX
        ce_sum = F.cross_entropy(logits_TV, batch.labels, ignore_index=IGNORE_INDEX, reduction="sum")
        n = max(1, int(mask_T.sum()))
        entropy_T = -(probs_TE * probs_TE.clamp_min(1e-30).log()).sum(-1)
        aux = 0.01 * torch.where(mask_T, entropy_T, torch.zeros_like(entropy_T)).sum() / n
        z_T = torch.logsumexp(logits_TV, dim=-1) ** 2
        z = 1e-3 * torch.where(mask_T, z_T, torch.zeros_like(z_T)).sum() / n
        counts = torch.bincount(idx_T, minlength=self.router_DE.shape[1])[None].to(torch.float64)
        return ToyOutput(ce_sum, aux, z, counts)

    def update_expert_bias(self, counts_LE: torch.Tensor) -> None:
        load = counts_LE[0].to(self.expert_bias_E.dtype)
        self.expert_bias_E += 1e-3 * torch.sign(load.mean() - load)
        self.bias_updates += 1


def make_batch(doc_lengths: list[int], vocab: int, gen: torch.Generator) -> PackedBatch:
    """One packed micro-batch of random documents (no padding)."""
    lens = torch.tensor([0] + doc_lengths)
    cu = torch.cumsum(lens, 0).to(torch.int32)
    total = int(cu[-1])
    tokens = torch.randint(0, vocab, (total,), generator=gen)
    return PackedBatch(tokens=tokens, labels=labels_from_tokens(tokens, cu, cu),
                       cu_seqlens=cu, cu_seqlens_padded=cu.clone(),
                       position_ids=position_ids_from_cu(cu, cu, total), max_seqlen=max(doc_lengths))


class ToyStepLoader:
    """Deterministic steps of `micro` micro-batches; step i depends only on (seed, i, rank)."""

    def __init__(self, vocab: int = 64, micro: int = 2, seed: int = 0, rank: int = 0):
        self.vocab, self.micro, self.seed, self.rank = vocab, micro, seed, rank
        self.position = 0
        self.epoch = 0

    def step_batches(self, i: int) -> list[PackedBatch]:
        gen = torch.Generator().manual_seed(1000 * self.seed + 97 * i + self.rank)
        out = []
        for _ in range(self.micro):
            n_docs = int(torch.randint(1, 4, (1,), generator=gen))
            lens = torch.randint(1, 12, (n_docs,), generator=gen).tolist()
            out.append(make_batch(lens, self.vocab, gen))
        return out

    def __iter__(self):
        while True:
            batches = self.step_batches(self.position)
            self.position += 1
            yield batches

    def state_dict(self) -> dict:
        return {"position": self.position}

    def load_state_dict(self, state: dict) -> None:
        self.position = int(state["position"])
