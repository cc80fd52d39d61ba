"""PolicyTrainer: the calls an RL framework makes on the trainer (log-probs, policy updates).

One iteration of PPO / GRPO, on every trainer rank (each call is collective; every rank passes
the same RolloutBatch, the trainer splits it over its data-parallel ranks):

    policy = PolicyTrainer(load_config("configs/tiny_cpu.yaml"))
    out = policy.compute_logprobs(batch, record_routes=True)     # old log-probs, routes (R3)
    batch = dataclasses.replace(batch, old_logprobs=out.logprobs, routed_experts=out.routes)
    metrics = policy.train_step(batch, make_loss(PolicyLossConfig(kind="ppo")), mini_batches=2)

Exactness: the loss of a mini-batch is normalised by global counts (its loss tokens and
sequences over every DP rank, rl_hooks/losses.py), so the gradient does not depend on how the
sequences were split into micro-batches or ranks. Under context parallelism each rank's
per-token log-probs are gathered back to whole sequences before the loss (sequence-level losses
such as GSPO need them whole): every CP rank computes the same loss, and the gather's backward
keeps each rank's own tokens (ParallelRuntime.gather_tokens).

Dynamic-CP (parallel.dynamic_cp): each mini-batch's sequences are scheduled on power-of-two
sub-groups of the DP x CP block (cp_attention.dynamic; every rank holds the whole batch, so
nothing is gathered), each micro-batch runs on its run's CPGroup (Trainer.train_step's
`cp_groups`), and the first rank of each group keeps the gathered log-probs before the sum over
dp_cp.

On-policy ratio: `compute_logprobs` packs sequences exactly as the training pass does for the
same `mini_batches` (the plan depends on lengths only, and both passes score every token), so
the first mini-batch's ratio is exactly 1 in any precision. train_step computes the old
log-probs this way itself when the batch carries none.

Legend: T rollout tokens, P physical tokens of a micro-batch, N loss tokens, L MoE layers,
K top-k.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from longctx_moe.config import Config, ConfigError, load_config
from longctx_moe.hf.weights import weights_spec
from longctx_moe.model.transformer import LogProbHead
from longctx_moe.precision import announce
from longctx_moe.trainer import Trainer
from rl_hooks import export as weights_out
from rl_hooks.advantages import compute_advantages, token_advantages
from rl_hooks.batch import RolloutBatch
from rl_hooks.losses import LossFn
from rl_hooks.microbatch import MicroBatch, build_micro_batch, plan_micro_batches, replay_routes
from rl_hooks.objective import PolicyObjective, normalizers
from rl_hooks.offload import Offloading, Residency, ResidentGate


@dataclass
class LogProbs:
    """Per-token outputs of `compute_logprobs`, in the caller's token order."""

    # float32 [T] (float64 for a float64 model); 0 at each sequence's first token
    logprobs: torch.Tensor
    entropy: torch.Tensor | None  # same dtype [T] when asked for
    routes: torch.Tensor | None  # int16 [T, L, K] experts of every token when asked for


class PolicyTrainer(Offloading):
    """The policy side of RL, built from the same Config as `longctx-moe train` (model, parallel
    layout, optimizer). Runs under torchrun like the trainer (or on one process).

    `micro_batch_tokens`: the token budget of one micro-batch per rank (default
    data.micro_batch_tokens); `advantage_estimator`: grpo | drgrpo | rloo | grpo_verl, used when a batch
    brings rewards instead of advantages; `batch_invariant` (None: execution.batch_invariant, whose
    default is on for a policy): attention runs each sequence in a kernel call of its own, so a
    sequence's log-probs are bitwise the same whatever it is packed with (one call per sequence).

    `sharded` (default off): each data-parallel rank passes its own share of the batch, as verl
    and NeMo-RL dispatch it (every CP and TP rank of a DP replica the same share). The plan and
    the micro-batches are then per rank, and the loss normalisers (loss tokens, sequences, longest
    sequence) are summed over DP once per mini-batch, so the gradient is the same as the whole
    batch's. Every rank needs the same number of sequences per mini-batch split (give each the
    same `mini_batches`). Under Dynamic-CP, which schedules the whole batch of the DP x CP block,
    the shares are gathered over DP in DP-rank order (`shares`) and the batch is scheduled whole;
    `compute_logprobs` still returns the rank's own share, and a per-sequence loss is called with
    sequence indices into the gathered batch (gather its own data with `shares`)."""

    def __init__(self, cfg: Config, *, micro_batch_tokens: int | None = None,
                 advantage_estimator: str = "grpo", batch_invariant: bool | None = None,
                 sharded: bool = False):
        from data_packing.batch import pad_multiple
        from longctx_moe.build import build_dims, build_runtime, resolve_ops
        from longctx_moe.process import make_context

        cfg = _with_invariance(cfg, batch_invariant)
        self.cfg = cfg
        # An RL framework made this process (a verl engine, a NeMo-RL worker, a Ray actor): it
        # keeps its host settings but for those the config names (train.host_tuning).
        self.ctx = make_context(cfg, owned=False)
        if self.ctx.rank == 0 and self.ctx.host:
            print(self.ctx.host, flush=True)
        self.dims = build_dims(cfg, self.ctx)
        self.runtime = build_runtime(cfg, self.dims, self.ctx.device, resolve_ops(cfg, self.ctx.device, rl=True))
        self.trainer = Trainer(cfg, self.runtime, self.ctx.device)
        announce(self.trainer.compute, self.ctx.rank)
        self.pad_multiple = pad_multiple(cfg.parallel.cp, cfg.parallel.tp,
                                         cfg.parallel.sequence_parallel)
        self.dynamic = self.runtime.dynamic  # DynamicCP, or None for the static CP group
        self.budget = micro_batch_tokens or cfg.data.micro_batch_tokens
        if self.dynamic is not None:
            # Under Dynamic-CP the budget is what one rank holds in one slot of a run.
            limit = cfg.parallel.max_tokens_per_rank
            if micro_batch_tokens and limit and micro_batch_tokens != limit:
                raise ConfigError(f"micro_batch_tokens={micro_batch_tokens} and parallel."
                                  f"max_tokens_per_rank={limit} both set the tokens one rank holds "
                                  "under Dynamic-CP; set one of them")
            self.budget = micro_batch_tokens or self.dynamic.capacity
        self.estimator = advantage_estimator
        self.batch_invariant = self.runtime.model.ops.batch_invariant
        # before each call: an export left open is settled, an offloaded trainer refused
        self.export_gate = ResidentGate(Residency(self.trainer, self.ctx.device))
        self.sharded = sharded
        # Dynamic-CP schedules the whole batch of the DP x CP block: a sharded trainer gathers the
        # DP shares first (`shares`), and only without it does each rank plan its own share.
        self.plans_own_share = sharded and self.dynamic is None
        if self.budget < self.pad_multiple:
            raise ConfigError(f"micro_batch_tokens={self.budget} is below the padding multiple "
                              f"{self.pad_multiple} of this layout; raise it")

    @classmethod
    def from_pretrained(cls, hf_dir: str, overrides: list[str] | dict | None = None, **kwargs) -> PolicyTrainer:
        """A policy starting from a Hugging Face directory: its config.json fills model.* (hf/families.py)
        and each rank reads only its slices; `overrides` ("key=value" or {key: value}) set the rest."""
        sets = [f"{k}={v}" for k, v in overrides.items()] if isinstance(overrides, dict) else list(overrides or [])
        return cls(load_config(None, [f"train.init_from={hf_dir}", *sets]), **kwargs)

    # ------------------------------------------------------------------ info

    def info(self) -> dict[str, Any]:
        """Vocabulary, layout, world size and model FLOPs per token (for MFU)."""
        from longctx_moe.model.flops import active_matmul_params

        m, d = self.cfg.model, self.dims
        return {"vocab_size": m.vocab_size, "num_moe_layers": m.num_moe_layers, "top_k": m.top_k,
                "num_experts": m.num_experts, "world_size": d.world_size,
                "layout": {"tp": d.tp, "cp": d.cp, "dp": d.dp, "ep": d.ep, "etp": d.etp,
                           "edp": d.edp, "cp_backend": d.cp_backend},
                # fwd + bwd matmul FLOPs per token; attention adds 12 * H * R * L per causal pair
                "flops_per_token": 6.0 * active_matmul_params(m),
                "micro_batch_tokens": self.budget, "step": self.trainer.step}

    def validate(self, batch: RolloutBatch) -> None:
        """The batch's contract against this model (one-line RolloutBatchError); no state changes."""
        m = self.cfg.model
        batch.validate(m.vocab_size, m.num_moe_layers, m.top_k, m.num_experts)

    # ------------------------------------------------------------------ log-probs

    def compute_logprobs(self, batch: RolloutBatch, temperature: float = 1.0,
                         return_entropy: bool = False, record_routes: bool = False,
                         mini_batches: int = 1) -> LogProbs:
        """log p(token t | its prefix) for every token (0 at first tokens) in the caller's order,
        float32 (float64 for a float64 model). Give the `mini_batches` that train_step will use
        for bitwise-equal old log-probs. A batch with `routed_experts` is scored with those
        routes replayed (as train_step does); `record_routes` returns the routes used."""
        self.validate(batch)
        self.export_gate.settle()
        whole, mine = self._whole(batch)
        with torch.no_grad():
            out = self._logprobs(whole, temperature, return_entropy, record_routes, mini_batches)
        # A worker that only scores (a reference policy) never runs train_step, whose trim would
        # hand back the free heap pages its new shapes leave behind.
        self.trainer.heap_trim.after_step()
        if mine is None:
            return out
        pick = lambda x: None if x is None else x[mine].clone()
        return LogProbs(pick(out.logprobs), pick(out.entropy), pick(out.routes))

    def shares(self, obj: Any) -> list[Any]:
        """Every data-parallel rank's `obj` in DP-rank order (a collective over DP; [obj] without
        DP): how a sharded trainer under Dynamic-CP assembles the whole batch."""
        return self.runtime.all_gather_object(obj, "dp")

    def _whole(self, batch: RolloutBatch) -> tuple[RolloutBatch, slice | None]:
        """The batch the plan covers and, for a sharded trainer under Dynamic-CP, the token span
        of this rank's share in it (None: the batch as given)."""
        if not self.sharded or self.plans_own_share:
            return batch, None
        parts = self.shares(batch)
        start = sum(p.num_tokens for p in parts[:self.dims.rank_in("dp")])
        return RolloutBatch.concat(parts), slice(start, start + batch.num_tokens)

    def _logprobs(self, batch, temperature, return_entropy, record_routes, mini_batches) -> LogProbs:
        t = batch.num_tokens
        logp = torch.zeros(t, dtype=torch.float64)
        ent = torch.zeros(t, dtype=torch.float64) if return_entropy else None
        routes, dtype = None, torch.float32
        head = LogProbHead(temperature, return_entropy, balance_losses=False)  # scoring: nothing reads them
        # Given routes are replayed here as in train_step, so old log-probs and the first
        # mini-batch's forward route every token alike (ratio exactly 1).
        def shard_of(item):
            mb, cp = item
            return self.runtime.shard(mb.packed.to(self.ctx.device), cp, replay_TLK=replay_routes(batch, mb),
                                      num_targets=mb.packed.num_target_tokens())
        for seqs in _split(batch.num_seqs, mini_batches):
            _, mine, groups, _ = self._my_micro_batches(batch, seqs)
            for (mb, _), shard, out in self.runtime.forwards(list(zip(mine, groups, strict=True)),
                                                             shard_of, head, self.trainer.autocast):
                dtype = out.logprobs_T.dtype
                # the gathers are collective over the CP group; its first rank keeps the values
                keep = shard.cp.rank == 0
                _scatter(logp, mb.target_src_P, self.runtime.gather_tokens(shard, out.logprobs_T), keep)
                if ent is not None:
                    _scatter(ent, mb.target_src_P, self.runtime.gather_tokens(shard, out.entropy_T), keep)
                if record_routes:
                    routes = self._record(routes, mb, shard, out, t, keep)
        for x in (logp, ent, routes):
            if x is not None:
                # each token was kept by one rank (of its CP group, when each DP rank has its own)
                self.runtime.all_reduce_host(x, "cp" if self.plans_own_share else "dp_cp")
        return LogProbs(logp.to(dtype), None if ent is None else ent.to(dtype),
                        None if routes is None else (routes - 1).to(torch.int16))

    def _record(self, routes, mb: MicroBatch, shard, out, t: int, keep: bool) -> torch.Tensor:
        """Accumulate routes + 1 (so that a sum over ranks keeps them) at the micro-batch's tokens
        where `keep` (the gather is collective over the CP group either way)."""
        r_PLK = self.runtime.gather_tokens(shard, out.routes_TLK).cpu()
        if routes is None:
            routes = torch.zeros(t, *r_PLK.shape[1:], dtype=torch.int64)
        if not keep:
            return routes
        src = mb.token_src_P
        keep = src >= 0
        routes[src[keep]] = r_PLK[keep] + 1
        return routes

    # ------------------------------------------------------------------ policy update

    def train_step(self, batch: RolloutBatch, loss: LossFn, mini_batches: int = 1, epochs: int = 1,
                   lr: float | None = None, temperature: float = 1.0) -> dict[str, Any]:
        """Optimizer steps over `batch`: `epochs` passes of `mini_batches` mini-batches (one step
        each). Returns the metrics of every step ("steps") and their means.

        `loss` is a LossFn, or a framework's own loss over whole sequences: a callable with
        `per_sequence = True`, called once per micro-batch as `loss(seqs, logprobs_T, entropy_T,
        group) -> LossOutput` with the micro-batch's sequence indices and their tokens' log-probs
        (and entropies when it has `needs_entropy = True`, else None) back to back in the batch's
        alignment, attached to the graph. Every rank of the CP group that ran the micro-batch makes
        the same call; `group` is (this rank's index in that group, its size), so that a loss that
        records values can keep them once. It brings its own advantages and old log-probs (the
        verl engine, rl_hooks/plugins/verl, runs verl's loss function this way)."""
        batch = self._for_update(batch, loss, temperature, mini_batches)
        entropy = _wants_entropy(loss)
        steps = []
        for _ in range(epochs):
            for seqs in _split(batch.num_seqs, mini_batches):
                steps.append(self._pass(batch, seqs, loss, lr, temperature, entropy, update=True))
        return _summarise(steps)

    def forward_backward(self, batch: RolloutBatch, loss: LossFn, temperature: float = 1.0) -> dict[str, float]:
        """Split training (a framework's forward_backward, then its optimizer step): forward and
        backward over `batch` as one mini-batch, its gradients reduced and added to those of
        earlier calls since the last `optimizer_step`, no update. `loss` as in train_step; each
        call normalises by its own batch's counts. Returns this call's metrics."""
        batch = self._for_update(batch, loss, temperature, 1)
        return self._pass(batch, list(range(batch.num_seqs)), loss, None, temperature,
                          _wants_entropy(loss), update=False)

    def optimizer_step(self, lr: float | None = None) -> dict[str, float]:
        """Clip and apply the gradients of the forward_backward calls since the last step, at `lr`
        (default: the optimizer's learning rate now). {grad_norm, skipped, lr, peak_memory_mb_max}."""
        self.export_gate.settle(update=True)
        grad_norm, skipped, peak_mb = self.trainer.update(lr)
        out = {"grad_norm": grad_norm, "skipped": float(skipped),
               "lr": self.trainer.optimizer.param_groups[0]["lr"]}
        if peak_mb is not None:
            out["peak_memory_mb_max"] = peak_mb
        return out

    def zero_grad(self) -> None:
        """Drop the gradients of forward_backward calls not yet applied by optimizer_step."""
        self.trainer.discard_gradients()

    def _for_update(self, batch: RolloutBatch, loss: LossFn, temperature: float,
                    mini_batches: int) -> RolloutBatch:
        """The batch a policy update runs on: validated, with old log-probs (computed as the
        update's passes pack it where absent and the loss needs them), the DP shares gathered
        where Dynamic-CP schedules them, and advantages from rewards."""
        self.validate(batch)
        self.export_gate.settle(update=True)
        own = getattr(loss, "per_sequence", False)
        if batch.old_logprobs is None and not own:
            old = self.compute_logprobs(batch, temperature, mini_batches=mini_batches).logprobs
            batch = dataclasses.replace(batch, old_logprobs=old)
        batch, _ = self._whole(batch)
        return batch if own else self._with_advantages(batch)

    def _pass(self, batch, seqs, loss, lr, temperature, entropy, update: bool) -> dict[str, float]:
        """One mini-batch's forward / backward, and with `update` its optimizer step."""
        tokens, mine, groups, sizes = self._my_micro_batches(batch, seqs)
        norm = normalizers(batch, seqs, self.runtime if self.plans_own_share else None)
        objective = PolicyObjective(batch, mine, loss, norm, LogProbHead(temperature, entropy),
                                     self.runtime)
        micro = [mb.packed for mb in mine]
        res = (self.trainer.train_step(micro, objective, lr=lr, cp_groups=groups) if update
               else self.trainer.backward(micro, objective, cp_groups=groups))
        m = dict(res.metrics)
        out = {"loss": res.loss, "policy_loss": res.ce_loss, "aux_loss": res.aux_loss,
               "z_loss": res.z_loss, "loss_tokens": float(norm.num_tokens), "sequences": float(norm.num_seqs)}
        if update:
            out.update(grad_norm=res.grad_norm, lr=res.lr, skipped=float(res.skipped))
        if sizes is not None:  # sequences per CP size (every size, for _summarise)
            for size in (1 << k for k in range(self.dynamic.max_cp.bit_length())):
                out[f"sequences_cp{size}"] = float(sizes.get(size, 0))
        if res.peak_memory_mb is not None:  # the step's peak on the busiest rank
            out["peak_memory_mb_max"] = res.peak_memory_mb
        n = max(norm.num_tokens, 1)
        for key, value in m.items():
            if key.startswith("route_"):
                continue
            out[key] = value if key.endswith(("_max", "_min")) else value / n
        if m.get("route_known"):
            out["route_agreement"] = m["route_agree"] / m["route_known"]
        out["tokens_per_dp_rank_max"], out["tokens_per_dp_rank_min"] = max(tokens), min(tokens)
        return out

    def _with_advantages(self, batch: RolloutBatch) -> RolloutBatch:
        if batch.advantages is not None:
            return batch
        adv_S = compute_advantages(batch.rewards, batch.group_ids, self.estimator)
        return dataclasses.replace(batch, advantages=token_advantages(batch, adv_S), rewards=None,
                                   group_ids=None)

    # ------------------------------------------------------------------ plans

    def _plan(self, batch: RolloutBatch, seqs: list[int]) -> list[list[list[int]]]:
        lengths = batch.seq_lengths()
        data = self.cfg.data
        local = plan_micro_batches([lengths[i] for i in seqs], self.dims.dp, self.budget,
                                   self.pad_multiple, data.cost_per_token,
                                   data.cost_per_token_pair)
        return [[[seqs[i] for i in mb] for mb in rank] for rank in local]

    def _my_micro_batches(self, batch, seqs) -> tuple[list[float], list[MicroBatch], list,
                                                      dict[int, int] | None]:
        """(the tokens every rank runs, this rank's micro-batches, their CP groups (None: the
        static group), Dynamic-CP's {CP size: sequences} or None). Under Dynamic-CP the
        mini-batch's sequences are scheduled on the DP x CP block's sub-groups (every rank holds
        the whole batch: nothing to gather) and a rank's tokens are its share of each run."""
        lengths = batch.seq_lengths()
        if self.plans_own_share:
            return self._my_share(batch, seqs)
        if self.dynamic is None:
            plan = self._plan(batch, seqs)
            tokens = [sum(lengths[i] for mb in rank for i in mb) for rank in plan]
            mine = [build_micro_batch(batch, s, self.pad_multiple) for s in plan[self.dims.rank_in("dp")]]
            return tokens, mine, [None] * len(mine), None
        plan = self.dynamic.plan([lengths[i] for i in seqs], self.budget)
        tokens = [0.0] * len(plan.rank_cost)
        for slot in plan.slots:
            for run in slot:
                for r in run.ranks:
                    tokens[r] += sum(lengths[seqs[i]] for i in run.seq_indices) / run.size
        runs = self.dynamic.my_runs(plan)
        mine = [build_micro_batch(batch, [seqs[i] for i in idx], multiple) for idx, multiple, _ in runs]
        return tokens, mine, [cp for _, _, cp in runs], dict(plan.cp_sizes_used)

    def _my_share(self, batch, seqs) -> tuple[list[float], list[MicroBatch], list, None]:
        """sharded=True: this rank's sequences planned alone, split (or padded with empty
        micro-batches) to the largest count over DP (the expert all-to-alls and gradient
        reduction line up)."""
        lengths = batch.seq_lengths()
        data = self.cfg.data
        local = plan_micro_batches([lengths[i] for i in seqs], 1, self.budget, self.pad_multiple,
                                   data.cost_per_token, data.cost_per_token_pair)[0]
        local = [[seqs[i] for i in mb] for mb in local if mb]
        dp, me = self.dims.dp, self.dims.rank_in("dp")
        counts = torch.zeros(2 * dp, dtype=torch.float64)
        counts[me], counts[dp + me] = len(local), sum(lengths[i] for i in seqs)
        self.runtime.all_reduce_host(counts, "dp")
        local = _split_to(local, int(counts[:dp].max()))
        mine = [build_micro_batch(batch, s, self.pad_multiple) for s in local]
        return counts[dp:].tolist(), mine, [None] * len(mine), None

    # ------------------------------------------------------------------ weights out

    def weights_spec(self, dtype: torch.dtype = torch.bfloat16):
        """Names (the model's Hugging Face family, per expert), global shapes and dtypes of the export."""
        return weights_spec(self.runtime.model, dtype)

    def export_weights(self, bucket_bytes: int = 512 << 20, dtype: torch.dtype = torch.bfloat16):
        """Buckets of (HF name, tensor) of at most `bucket_bytes`, gathered over TP, ETP and EP;
        collective: every rank iterates it to the end, or leaves it early on every rank (a rank
        that leaves stops the others at the same bucket; see rl_hooks/export.py)."""
        return weights_out.export_weights(self.runtime.model, self.dims, bucket_bytes, dtype, self.export_gate)

    def export_weight_shards(self, dtype: torch.dtype = torch.bfloat16):
        """This rank's own pieces of the HF tensors, each element once over all ranks, no
        communication (ShardRecords, longctx_moe/hf/shards.py); read it before the next update."""
        return weights_out.export_weight_shards(self.runtime.model, self.dims, dtype, self.export_gate)

    def push_weights(self, sink, bucket_bytes: int = 512 << 20,
                     dtype: torch.dtype = torch.bfloat16) -> dict[str, float]:
        """Stream the export to `sink(bucket)`, e.g. a rollout engine's weight loader."""
        return weights_out.push_weights(self.runtime.model, self.dims, sink, bucket_bytes, dtype, self.export_gate)

    # ------------------------------------------------------------------ state

    def set_lr(self, lr: float) -> None:
        """Learning rate for the following steps (until the next call or a per-call `lr`)."""
        self.trainer._set_lr(lr)

    def save(self, path: str) -> str:
        """A checkpoint of model, optimizer and schedule (the project's format) under `path`, and
        `path`/config.yaml, so that `longctx-moe export-hf PATH OUT` exports it (data.path made
        absolute there: the tokenizer is found wherever the export runs)."""
        from longctx_moe.checkpoint.trainer_state import save_trainer
        from longctx_moe.config import write_config

        self.export_gate.settle()
        step_dir = save_trainer(self.trainer, None, Path(path), self.ctx.rank, self.ctx.world_size, keep_last=0)
        if self.ctx.rank == 0:
            data = self.cfg.data
            if data.path and Path(data.path).exists():
                data = dataclasses.replace(data, path=str(Path(data.path).resolve()))
            write_config(dataclasses.replace(self.cfg, data=data), Path(path) / "config.yaml")
        return str(step_dir)

    def load(self, path: str) -> None:
        """Load the newest checkpoint under `path` (or the step directory `path`), written under
        any parallel layout."""
        from longctx_moe.checkpoint.steps import find_resume_dir
        from longctx_moe.checkpoint.trainer_state import load_trainer

        self.export_gate.settle()
        step_dir = find_resume_dir(Path(path), "auto") or Path(path)
        load_trainer(self.trainer, None, step_dir, self.ctx.rank, self.ctx.world_size)


def _with_invariance(cfg: Config, batch_invariant: bool | None) -> Config:
    """cfg with execution.batch_invariant set by the constructor's argument, which may not
    contradict an explicit true / false of the config."""
    setting = cfg.execution.batch_invariant
    if batch_invariant is None or setting == batch_invariant:
        return cfg
    if setting is not None:
        raise ConfigError(f"PolicyTrainer(batch_invariant={batch_invariant}) contradicts "
                          f"execution.batch_invariant={str(setting).lower()}; drop one of them")
    return dataclasses.replace(cfg, execution=dataclasses.replace(cfg.execution, batch_invariant=batch_invariant))


def _split(num_seqs: int, parts: int) -> list[list[int]]:
    """`parts` contiguous, near-equal groups of sequence indices (the mini-batches)."""
    if not 1 <= parts <= num_seqs:
        raise ValueError(f"mini_batches={parts} must be in [1, number of sequences={num_seqs}]")
    bounds = [num_seqs * i // parts for i in range(parts + 1)]
    return [list(range(a, b)) for a, b in zip(bounds[:-1], bounds[1:], strict=True)]


def _split_to(micro: list[list[int]], count: int) -> list[list[int]]:
    """`count` micro-batches: the ones with the most sequences halved while there are fewer
    (a framework's loss may expect as many calls on every rank, as verl's metrics do), then
    empty stand-ins when no micro-batch has two sequences left."""
    micro = [list(mb) for mb in micro]
    while len(micro) < count:
        big = max(range(len(micro)), key=lambda i: len(micro[i]), default=None)
        if big is None or len(micro[big]) < 2:
            return micro + [[]] * (count - len(micro))
        half = len(micro[big]) // 2
        micro[big:big + 1] = [micro[big][:half], micro[big][half:]]
    return micro


def _scatter(dst_T: torch.Tensor, src_P: torch.Tensor, val_P: torch.Tensor, keep: bool) -> None:
    """dst[src[p]] = val[p] at the scored positions p, where this rank keeps the values."""
    if not keep:
        return
    scored = src_P >= 0
    dst_T[src_P[scored]] = val_P.detach().cpu()[scored].to(dst_T.dtype)


def _wants_entropy(loss: LossFn) -> bool:
    """Entropies cost a second pass over each vocabulary chunk: computed only for a loss that asks
    (make_loss with entropy_coef > 0, or a callable with `needs_entropy = True`)."""
    if hasattr(loss, "needs_entropy"):
        return bool(loss.needs_entropy)
    cfg = getattr(loss, "keywords", {}).get("cfg")
    return bool(cfg is not None and getattr(cfg, "entropy_coef", 0.0) > 0)


def _summarise(steps: list[dict[str, float]]) -> dict[str, Any]:
    """Every step's metrics, and over the steps: the maximum / minimum of "_max" / "_min" keys,
    the mean of the others."""
    keys = steps[0].keys() if steps else ()
    out = {}
    for k in keys:
        values = [s[k] for s in steps]
        reduce = {"_max": max, "_min": min}.get(k[-4:], lambda v: sum(v) / len(v))
        out[k] = reduce(values)
    return {"steps": steps, **out}
