"""Shared pieces of the verl engine tests and bench: a Qwen3-MoE made and saved by transformers,
verl batches built the way verl's trainer builds them, verl's TrainingWorker config from
configs/verl_engine.yaml, and the reference (a model's forward scored by verl's own functions).

Legend: B rows, P padded prompt length, R padded response length, j a row's real tokens.
"""

from __future__ import annotations

from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[2]
VOCAB = 64
# Our model.* must describe the HF model (the engine checks config.json against it); the router's
# balance and z losses are not part of verl's objective, so they are off for exact comparisons.
SETS = ["train.num_threads=1", "train.host_allocator=default", f"model.vocab_size={VOCAB}",
        "model.hidden_size=32", "model.num_layers=2", "model.num_heads=4", "model.num_kv_heads=2",
        "model.head_dim=8", "model.num_experts=4", "model.top_k=2", "model.expert_hidden_size=16",
        "model.init_std=0.2", "balance.aux_loss_coeff=0", "balance.z_loss_coeff=0"]
DTYPES = {"float32": ("fp32", torch.float32), "float64": ("fp64", torch.float64)}
# AdamW with eps far above every gradient entry and no weight decay: the first update is
# -lr * g / (|g| + eps), so with lr = eps it is g / (1 + |g| / eps), about the gradient itself.
LR = EPS = 1e6
SHAPES = [(5, 3), (1, 7), (9, 2), (3, 6), (2, 1), (7, 5), (4, 4), (6, 2)]  # (prompt, response)


def our_sets(dtype: str) -> list[str]:
    return SETS + [f"train.param_dtype={DTYPES[dtype][0]}", "train.autocast_dtype=none"]


def save_hf_model(folder: Path, dtype: str) -> Path:
    """A random Qwen3-MoE of our test architecture, saved by transformers (safetensors)."""
    from transformers import Qwen3MoeForCausalLM

    from longctx_moe.config import load_config
    from longctx_moe.hf.interop import to_hf_config

    torch.manual_seed(0)
    hf = Qwen3MoeForCausalLM(to_hf_config(load_config(None, SETS).model)).to(DTYPES[dtype][1])
    hf.save_pretrained(folder)
    return folder


def hf_model(folder: Path, dtype: str):
    """transformers' Qwen3-MoE from `folder` in `dtype`, eager kernels (its grouped experts
    reject float64)."""
    from transformers import AutoConfig, Qwen3MoeForCausalLM

    cfg = AutoConfig.from_pretrained(folder)
    cfg._attn_implementation = "eager"
    cfg._experts_implementation = "eager"
    return Qwen3MoeForCausalLM.from_pretrained(folder, config=cfg, dtype=DTYPES[dtype][1])


def padded_batch(seed: int = 0):
    """A verl batch as its agent loop leaves it (prompts left-padded, responses right-padded,
    a tool-output hole in one response), converted by verl's own left_right_2_no_padding."""
    from tensordict import TensorDict
    from verl.workers.utils.padding import left_right_2_no_padding

    gen = torch.Generator().manual_seed(seed)
    b, p_max, r_max = len(SHAPES), max(p for p, _ in SHAPES), max(r for _, r in SHAPES)
    ids = torch.zeros(b, p_max + r_max, dtype=torch.long)
    mask = torch.zeros_like(ids)
    resp_mask = torch.zeros(b, r_max, dtype=torch.long)
    for i, (p, r) in enumerate(SHAPES):
        ids[i, p_max - p:p_max + r] = torch.randint(0, VOCAB, (p + r,), generator=gen)
        mask[i, p_max - p:p_max + r] = 1
        resp_mask[i, :r] = 1
    resp_mask[3, 2:4] = 0  # tool output inside a multi-turn response: attended, no loss
    old = (torch.randn(b, r_max, generator=gen) * 0.05 - 4.1) * resp_mask
    adv = torch.randn(b, r_max, generator=gen) * resp_mask
    td = TensorDict({"input_ids": ids, "attention_mask": mask, "prompts": ids[:, :p_max],
                     "responses": ids[:, p_max:], "response_mask": resp_mask,
                     "position_ids": torch.clip(mask.cumsum(1) - 1, min=0),
                     "old_log_probs": old.float(), "advantages": adv.float()}, batch_size=b)
    return left_right_2_no_padding(td)


def actor_config(**over):
    """verl's ActorConfig (its ppo_loss reads clip ratios, loss_agg_mode, KL and entropy keys)."""
    from verl.workers.config import ActorConfig

    keys = dict(strategy="longctx_moe", ppo_mini_batch_size=len(SHAPES), rollout_n=1,
                use_dynamic_bsz=True, ppo_max_token_len_per_gpu=4096, entropy_coeff=0.01,
                clip_ratio_low=0.2, clip_ratio_high=0.28)
    return ActorConfig(**{**keys, **over})


def worker_config(folder: Path, dtype: str, layout: list[str] = (), budget: int = 32):
    """verl's TrainingWorkerConfig from configs/verl_engine.yaml, through verl's own loader."""
    from omegaconf import OmegaConf
    from verl.utils.config import omega_conf_to_dataclass
    from verl.workers.config import TrainingWorkerConfig

    yaml = OmegaConf.load(ROOT / "configs" / "verl_engine.yaml")
    yaml.model_config.path = str(folder)
    yaml.engine_config.config = str(ROOT / "configs" / "tiny_cpu.yaml")
    yaml.engine_config.overrides = our_sets(dtype) + list(layout)
    yaml.engine_config.max_token_len_per_gpu = budget
    yaml.engine_config.infer_max_token_len_per_gpu = budget
    yaml.engine_config.export_dtype = dtype
    yaml.optimizer_config.lr = LR
    yaml.optimizer_config.eps = EPS
    yaml.optimizer_config.weight_decay = 0.0
    yaml.optimizer_config.clip_grad = 0.0
    parts = {k: omega_conf_to_dataclass(yaml[k]) for k in
             ("model_config", "engine_config", "optimizer_config", "checkpoint_config")}
    return TrainingWorkerConfig(model_type=yaml.model_type, **parts)


def share(td, rank: int, world: int):
    """The chunk verl's dispatch hands DP rank `rank` (contiguous, DataProto.chunk)."""
    from verl.utils import tensordict_utils as tu

    n = td.batch_size[0] // world
    return tu.index_select_tensor_dict(td, list(range(rank * n, (rank + 1) * n)))


def reference(logits_of, data, loss_cfg) -> tuple[list, list, torch.Tensor]:
    """Per-row verl log-probs and entropies [j - 1] (position i scores token i + 1) from
    `logits_of(ids_S) -> [S, V]`, and verl's ppo_loss on them over the whole batch (dp_size 1)."""
    import verl.utils.torch_functional as verl_F
    from verl.utils import tensordict_utils as tu
    from verl.workers.utils.losses import ppo_loss

    lps, ents, full_lp, full_ent = [], [], [], []
    for ids in data["input_ids"].unbind():
        logits = logits_of(ids)
        lp = verl_F.logprobs_from_logits(logits[:-1], ids[1:])
        ent = verl_F.entropy_from_logits(logits[:-1])
        lps.append(lp.detach())
        ents.append(ent.detach())
        full_lp.append(torch.cat([lp, lp.new_zeros(1)]))
        full_ent.append(torch.cat([ent, ent.new_zeros(1)]))
    cu = data["input_ids"].offsets()
    nest = lambda xs: torch.nested.nested_tensor_from_jagged(torch.cat(xs), offsets=cu)
    td = data.clone()
    tu.assign_non_tensor(td, dp_size=1, batch_num_tokens=int(data["loss_mask"].sum()),
                         global_batch_size=data.batch_size[0])
    loss, _ = ppo_loss(loss_cfg, {"log_probs": nest(full_lp), "entropy": nest(full_ent)}, td)
    return lps, ents, loss
