"""HFSampler: a rollout engine on transformers' Qwen3-MoE (KV-cached `generate`) that receives the
policy's weights only through `PolicyTrainer.push_weights`, never by sharing modules.

    sampler = HFSampler(policy.cfg.model, eos_id=EOS, pad_id=PAD)
    policy.push_weights(sampler.load_bucket, dtype=torch.float32)   # after every policy update
    rollouts = sampler.generate(prompts, max_new_tokens=8, temperature=1.0)
    # rollouts[i].tokens, .logprobs (float32, for TIS and the trainer-vs-sampler gap),
    # .routed_experts (int16 [P + R, L, K], for router replay)

Weights arrive as the export names them (longctx_moe/hf/weights.py): one tensor per expert and
projection, `model.layers.{i}.mlp.experts.{e}.{gate,up,down}_proj.weight`. transformers 5 keeps
a layer's experts fused, `mlp.experts.gate_up_proj` [E, 2F, D] (gate rows, then up) and
`down_proj` [E, D, F]; `load_bucket` copies each expert's tensors into its slice of those.

Log-probs: `generate`'s processed scores are the distribution each token was drawn from
(logits / temperature; top-k / top-p masks only when asked for, off by default), so
log_softmax(scores) at the drawn token is the sampler's own log-prob, in the model's dtype
(float32). Greedy decoding applies no warper: its log-probs are at temperature 1.

Router choices: `generate` does not return router logits (GenerateDecoderOnlyOutput has no such
field in transformers 5; `output_router_logits` only reaches each forward's own output), so the
sampler records each MoE layer's top-k expert ids with a forward hook on its own router modules
(registered for one `generate` call, then removed). The prompt's tokens are routed in the
prefill, every generated token but the last in the step that consumes it; the last token is
never fed back, so its routes are -1 (unknown, routed live on replay, and it scores nothing).

Prompts of equal length run as one batch (no padding, so nothing depends on a pad mask or on
position ids derived from it); different lengths run as separate `generate` calls.

vLLM on CPU instead (not installed, not depended on): its CPU backend is built from source
(`VLLM_TARGET_DEVICE=cpu pip install -e .` from a clone, gcc >= 12) or run from its CPU Docker
image, each against the torch build vLLM pins, not this project's torch 2.13, so it would live in
its own environment or process. It serves Qwen3-MoE with its own fused MoE kernels, loads weights
through the model's `load_weights(iterable of (name, tensor))` with these same per-expert names
(its Qwen3-MoE loader fuses them), returns the sampled tokens' log-probs with
`SamplingParams(logprobs=0)` (of the raw or processed distribution, per `logprobs_mode`), and
routes with `enable_return_routed_experts=True` (vllm-project/vllm#28284: `routed_experts` int16
[tokens - 1, layers, top_k]). On 2 cores its start-up and scheduler overhead would dominate a
model this small; `load_bucket` is the seam where its `load_weights` would plug in.

Legend: B sequences of one generate call, P prompt tokens, R response tokens, S steps of one
forward (P at prefill, 1 per decode step), L MoE layers, K top-k, E experts, D hidden, F expert
hidden, V vocabulary.
"""

from __future__ import annotations

import contextlib
import re
from collections import defaultdict
from dataclasses import dataclass

import torch

from longctx_moe.hf.interop import to_hf_config
from longctx_moe.model.config import ModelConfig

_EXPERT_NAME = re.compile(r"model\.layers\.(\d+)\.mlp\.experts\.(\d+)\.(gate|up|down)_proj\.weight")


@dataclass
class Rollout:
    """One sampled response."""

    tokens: list[int]  # the response: up to and including EOS (or max_new_tokens tokens)
    logprobs: list[float]  # log-prob of each response token under the sampling distribution
    routed_experts: torch.Tensor  # int16 [P + R, L, K], prompt and response tokens; -1 unknown
    finished: bool  # ended with EOS


class HFSampler:
    """transformers' Qwen3MoeForCausalLM of `model_cfg` (to_hf_config), in `dtype`, on CPU.

    Its weights start random: push the policy's before sampling. `eos_id` ends a response;
    `pad_id` fills finished rows of a batch (never returned)."""

    def __init__(self, model_cfg: ModelConfig, *, eos_id: int, pad_id: int,
                 dtype: torch.dtype = torch.float32, attn_implementation: str = "sdpa"):
        from transformers import Qwen3MoeForCausalLM

        self.cfg, self.eos_id, self.pad_id = model_cfg, eos_id, pad_id
        hf_cfg = to_hf_config(model_cfg)
        hf_cfg._attn_implementation = attn_implementation
        self.model = Qwen3MoeForCausalLM(hf_cfg).to(dtype).eval()
        self.model.requires_grad_(False)
        self._params = dict(self.model.named_parameters())
        moe = [layer.mlp for layer in self.model.model.layers[model_cfg.first_k_dense:]]
        if not all(hasattr(m, "experts") and hasattr(m.experts, "gate_up_proj") for m in moe):
            import transformers

            raise RuntimeError(f"HFSampler needs transformers >= 5 (fused Qwen3-MoE experts); "
                               f"this is {transformers.__version__}: pip install 'transformers>=5'")
        self._routers = [m.gate for m in moe]

    # ------------------------------------------------------------------ weights in

    def names(self) -> list[str]:
        """Every name a full push must bring (per-expert names, as the export sends them)."""
        out = []
        for name in self._params:
            if name.endswith("mlp.experts.gate_up_proj"):
                base = name.removesuffix("gate_up_proj")
                out += [f"{base}{e}.{proj}_proj.weight" for e in range(self.cfg.num_experts)
                        for proj in ("gate", "up", "down")]
            elif not name.endswith("mlp.experts.down_proj"):
                out.append(name)
        return out

    def weight(self, name: str) -> torch.Tensor:
        """The sampler's tensor under an export name (a view: per-expert slices of the fused
        tensors). KeyError with the fix for a name this model does not have."""
        m = _EXPERT_NAME.fullmatch(name)
        layer, expert = (int(m[1]), int(m[2])) if m else (-1, -1)
        known = (name in self._params if m is None else
                 self.cfg.first_k_dense <= layer < self.cfg.num_layers
                 and expert < self.cfg.num_experts)
        if not known:
            raise KeyError(f"{name!r} is not a weight of this Qwen3-MoE sampler; push from a "
                           "PolicyTrainer built with the same model config")
        if m is None:
            return self._params[name]
        proj = m[3]
        experts = self.model.model.layers[layer].mlp.experts
        f = experts.down_proj.shape[-1]
        if proj == "down":
            return experts.down_proj[expert]  # [D, F]
        rows = slice(0, f) if proj == "gate" else slice(f, 2 * f)
        return experts.gate_up_proj[expert, rows]  # [F, D]

    def load_bucket(self, bucket: list[tuple[str, torch.Tensor]]) -> None:
        """Copy one bucket of (export name, tensor) into the model (the push_weights sink).
        Tensors are copied (converted to the sampler's dtype), never kept: nothing is shared."""
        with torch.no_grad():
            for name, tensor in bucket:
                dst = self.weight(name)
                if tuple(dst.shape) != tuple(tensor.shape):
                    raise ValueError(f"{name}: pushed shape {tuple(tensor.shape)}, the sampler's "
                                     f"is {tuple(dst.shape)}; build both from one model config")
                dst.copy_(tensor)

    # ------------------------------------------------------------------ sampling

    def generate(self, prompts: list[list[int]], max_new_tokens: int, *, temperature: float = 1.0,
                 top_k: int = 0, top_p: float = 1.0, greedy: bool = False) -> list[Rollout]:
        """One response per prompt (in order), sampled at `temperature` (top-k / top-p off
        unless set) or greedy; torch's global RNG draws the samples."""
        if max_new_tokens < 1 or not temperature > 0:
            raise ValueError(f"max_new_tokens={max_new_tokens} must be >= 1 and "
                             f"temperature={temperature} > 0")
        by_length: dict[int, list[int]] = defaultdict(list)
        for i, prompt in enumerate(prompts):
            by_length[len(prompt)].append(i)
        out: list[Rollout | None] = [None] * len(prompts)
        for idx in by_length.values():
            rows = self._generate_batch(torch.tensor([prompts[i] for i in idx], dtype=torch.long),
                                        max_new_tokens, temperature, top_k, top_p, greedy)
            for i, rollout in zip(idx, rows, strict=True):
                out[i] = rollout
        return out

    def _generate_batch(self, prompt_BP, max_new_tokens, temperature, top_k, top_p, greedy):
        from transformers import GenerationConfig

        sampling = {} if greedy else {"temperature": temperature, "top_k": top_k, "top_p": top_p}
        gen_cfg = GenerationConfig(do_sample=not greedy, max_new_tokens=max_new_tokens,
                                   eos_token_id=self.eos_id, pad_token_id=self.pad_id,
                                   use_cache=True, output_scores=True,
                                   return_dict_in_generate=True, **sampling)
        with torch.no_grad(), self._record_routes() as calls:
            res = self.model.generate(input_ids=prompt_BP, generation_config=gen_cfg,
                                      attention_mask=torch.ones_like(prompt_BP))
        new_BR = res.sequences[:, prompt_BP.shape[1]:]
        logp_BR = torch.stack(res.scores, 1).float().log_softmax(-1)
        logp_BR = logp_BR.gather(-1, new_BR[..., None]).squeeze(-1)
        routes_BTLK = self._routes(calls, prompt_BP.shape, new_BR.shape[1])
        return [self._rollout(new_BR[b], logp_BR[b], routes_BTLK[b], prompt_BP.shape[1])
                for b in range(prompt_BP.shape[0])]

    def _rollout(self, new_R, logp_R, routes_TLK, p: int) -> Rollout:
        ends = (new_R == self.eos_id).nonzero()
        n = int(ends[0, 0]) + 1 if len(ends) else new_R.numel()
        return Rollout(tokens=new_R[:n].tolist(), logprobs=logp_R[:n].tolist(),
                       routed_experts=routes_TLK[:p + n].clone(), finished=bool(len(ends)))

    @contextlib.contextmanager
    def _record_routes(self):
        """Yield a list that collects, per forward call, each MoE layer's top-k ids [B*S, K]."""
        calls: list[list[torch.Tensor]] = []

        def hook(router, args, output):
            # Qwen3MoeTopKRouter returns (router_logits, router_scores, router_indices).
            if router is self._routers[0]:
                calls.append([])
            calls[-1].append(output[2].detach())

        handles = [r.register_forward_hook(hook) for r in self._routers]
        try:
            yield calls
        finally:
            for h in handles:
                h.remove()

    def _routes(self, calls, prompt_shape, r: int) -> torch.Tensor:
        """int16 [B, P + R, L, K]: the prefill's P tokens, then one token per decode step; the
        last generated token was never fed back (-1)."""
        b, p = prompt_shape
        layers, k = len(self._routers), self.cfg.top_k
        out = torch.full((b, p + r, layers, k), -1, dtype=torch.int16)
        if layers == 0:
            return out
        if len(calls) != r or any(len(c) != layers for c in calls):
            raise RuntimeError(f"recorded {len(calls)} forward calls for {r} generated tokens; "
                               "this transformers version's generate loop differs from the one "
                               "the sampler expects (one prefill, then one token per step)")
        pos = 0
        for per_layer in calls:
            ids_BSLK = torch.stack([x.view(b, -1, k) for x in per_layer], 2)
            out[:, pos:pos + ids_BSLK.shape[1]] = ids_BSLK.to(torch.int16)
            pos += ids_BSLK.shape[1]
        return out
