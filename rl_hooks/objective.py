"""The RL loss as the trainer's Objective: one mini-batch of a RolloutBatch turned into the
per-micro-batch loss calls (token-level or per-sequence), and the mini-batch's global normalisers.

Legend: T rollout tokens, P physical tokens of a micro-batch, N loss tokens.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from longctx_moe.model.transformer import LogProbHead
from longctx_moe.trainer import MicroLoss
from rl_hooks.batch import RolloutBatch
from rl_hooks.losses import LossFn, LossInputs, Normalizers
from rl_hooks.microbatch import MicroBatch, replay_routes


class PolicyObjective:
    """The trainer's Objective for one mini-batch of a RolloutBatch (see longctx_moe.trainer)."""

    def __init__(self, batch: RolloutBatch, micro: list[MicroBatch], loss: LossFn,
                 norm: Normalizers, head: LogProbHead, runtime):
        self.batch, self.micro, self.loss_fn, self.norm = batch, micro, loss, norm
        self.head, self.runtime = head, runtime

    def replay(self, i: int) -> torch.Tensor | None:
        return replay_routes(self.batch, self.micro[i])

    def micro_loss(self, i: int, out, shard, g: int) -> MicroLoss:
        mb = self.micro[i]
        logp_P = self.runtime.gather_tokens(shard, out.logprobs_T)
        ent_P = None if out.entropy_T is None else self.runtime.gather_tokens(shard, out.entropy_T)
        if getattr(self.loss_fn, "per_sequence", False):
            res = self.loss_fn(mb.seqs, *_sequence_values(self.batch, mb, logp_P, ent_P),
                               (shard.cp.rank, shard.cp.size))
            return MicroLoss(res.loss, res.loss.detach() / shard.cp.size, res.metrics)
        # Which positions carry a loss token is known on the host (the plan and the batch's mask):
        # chosen there and sent once, so the device is never read back for it.
        src = mb.target_src_P
        pos = torch.nonzero((src >= 0) & self.batch.loss_mask[src.clamp_min(0)]).squeeze(1)
        tok_N, pos_N = src[pos], pos.to(logp_P.device)
        inp = _loss_inputs(self.batch, tok_N, logp_P[pos_N], None if ent_P is None else ent_P[pos_N])
        res = self.loss_fn(inp, self.norm)
        # Every CP rank of the group computed this same loss: its share of the step total is
        # 1/cp (the gradient is not scaled: gather_tokens' backward keeps only own tokens).
        share = 1.0 / shard.cp.size
        metrics = {k: (v if k.endswith(("_max", "_min")) else v * share) for k, v in res.metrics.items()}
        return MicroLoss(res.loss, res.loss.detach() * share, metrics)


def _sequence_values(batch: RolloutBatch, mb: MicroBatch, logp_P: torch.Tensor,
                     ent_P: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor | None]:
    """The micro-batch's sequences back to back (mb.seqs order) as flat [T_mb] tensors in the
    batch's alignment (0 at first tokens), still attached to the graph: log-probs, entropies."""
    cu = batch.cu_seqlens.tolist()
    local_T = torch.full((batch.num_tokens,), -1, dtype=torch.int64)
    offset = 0
    for s in mb.seqs:
        n = cu[s + 1] - cu[s]
        local_T[cu[s]:cu[s + 1]] = torch.arange(offset, offset + n)
        offset += n
    src = mb.target_src_P
    scored_P = (src >= 0).to(logp_P.device)
    index = local_T[src[src >= 0]].to(logp_P.device)
    place = lambda x_P: None if x_P is None else \
        x_P.new_zeros(offset).index_put((index,), x_P[scored_P])
    return place(logp_P), place(ent_P)


def _loss_inputs(batch: RolloutBatch, tok_N: torch.Tensor, logp_N, ent_N) -> LossInputs:
    dev, dtype = logp_N.device, logp_N.dtype
    pick = lambda x: None if x is None else x[tok_N].to(dev, dtype)
    seq_N = batch.seq_of_token()[tok_N]
    _, seq_index = torch.unique_consecutive(seq_N, return_inverse=True)
    return LossInputs(logprobs=logp_N, old_logprobs=pick(batch.old_logprobs),
                      advantages=pick(batch.advantages), seq_index=seq_index.to(dev),
                      num_seqs_local=int(seq_N.unique().numel()),
                      ref_logprobs=pick(batch.ref_logprobs),
                      rollout_logprobs=pick(batch.rollout_logprobs), entropy=ent_N)


def normalizers(batch: RolloutBatch, seqs: list[int], runtime=None) -> Normalizers:
    """Global counts of one mini-batch. Every rank holds the whole batch (no collective), or,
    given the `runtime` of a sharded trainer, its own share: the counts are summed (the longest
    sequence maximised) over DP."""
    mask, cu = batch.loss_mask, batch.cu_seqlens.tolist()
    per_seq = [int(mask[cu[s]:cu[s + 1]].sum()) for s in seqs]
    longest = max((cu[s + 1] - cu[s] for s in seqs), default=1)
    counts = [sum(per_seq), sum(1 for n in per_seq if n)]
    if runtime is not None:
        sums = runtime.all_reduce_host(torch.tensor(counts, dtype=torch.float64), "dp")
        top = runtime.all_reduce_host(torch.tensor([longest], dtype=torch.float64), "dp", dist.ReduceOp.MAX)
        counts, longest = [int(x) for x in sums.tolist()], int(top[0])
    return Normalizers(num_tokens=counts[0], num_seqs=counts[1], constant=float(longest))
