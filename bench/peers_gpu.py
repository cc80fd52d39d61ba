"""Our training step beside two peers' on the same GPU: the bench MoE's shape (gpu_check.MOE_1B),
the same packed row of 32,768 tokens (gpu_check's heavy-tailed documents, seed 6), one process
per model, timed as gpu_check times ours (warm-up steps, then the median of the timed ones).

    python bench/peers_gpu.py --model ours|torchtitan|transformers --out F.json [--quick]

A step is forward + backward + AdamW (fused on cuda) under bf16 autocast with fp32 parameters
for all three: our trainer's default, and on one GPU the stand-in for torchtitan's FSDP mixed
precision (bf16 compute, fp32 masters) and transformers' Trainer with bf16=True. The peers'
loss is the mean cross-entropy of full logits over the row's targets (the labels of our packed
batch: no target across a document end); their routers' balance terms are left out (ours adds
its aux and z losses: a few small ops per layer).

Document boundaries: ours masks attention per document (cu_seqlens); torchtitan's Qwen3 masks
per document from the positions (each document's restart at 0) with its default attention
backend, compiled flex attention (its varlen backend turns on FlashAttention-3 on Hopper, which
needs the flash_attn_interface package the image lacks); transformers masks per document when
the model is given the position ids and no attention mask (masking_utils.
find_packed_sequence_indices), and otherwise runs plain causal over the row. Each peer's MFU counts the attention pairs it computes: per document
when it masks, the whole row's causal pairs when it does not (`document_mask` in the JSON).

torchtitan is not in the GPU image: `make gpu-wheels` downloads its wheel and the pure-Python
ones it imports that the image lacks into bench/wheels/, and gpu_check.sh installs them into a
temporary directory on PYTHONPATH; an import that fails there (a module missing, a torch too old
for it) is recorded in one line instead of timings. `--quick` runs a tiny shape on CPU, where
flex attention has no backward: torchtitan's model is built and runs one forward there, its
record saying why no step was timed.
"""

from __future__ import annotations

import argparse
import gc
import importlib.util
import statistics
import sys
import traceback
from pathlib import Path

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench import gpu_check  # noqa: E402
from bench.bench_io import write_json  # noqa: E402

MODELS = ("ours", "torchtitan", "transformers")
# What torchtitan's qwen3 package imports beyond torch (its wheel's Requires-Dist that the model
# path reaches): the stock GPU image has none of them, bench/wheels carries them.
TORCHTITAN_IMPORTS = ("torchtitan", "spmd_types", "tyro", "docstring_parser", "typeguard")


def _model_config(sizes: gpu_check.TrainerSizes):
    from longctx_moe.model import ModelConfig

    return ModelConfig(**sizes.model)


def _row(sizes: gpu_check.TrainerSizes, vocab: int):
    """The packed row gpu_check's trainer section times: its lengths and its PackedBatch (host)."""
    lens = gpu_check._doc_lengths(sizes.step_tokens, seed=6)
    return lens, gpu_check._batch(lens, vocab, "cpu")


def _causal_pairs_flops(cfg, lens: list[int], document_mask: bool) -> float:
    from longctx_moe.model.flops import model_flops

    return model_flops(cfg, lens if document_mask else [sum(lens)])


def _missing_modules(names) -> list[str]:
    return [n for n in names if importlib.util.find_spec(n) is None]


# ---------------------------------------------------------------- the peers' models


def build_torchtitan(m: dict, max_seq: int, device):
    """torchtitan 0.3.0's Qwen3 MoE (torchtitan.models.qwen3, the layer builder its 30B-A3B flavor
    uses: softmax router, normalised top-k weights, fused qkv, qk-norm) at our shape."""
    from torchtitan.models.common import CosSinRoPE, Embedding, Linear
    from torchtitan.models.qwen3 import Qwen3Model, _build_qwen3_moe_layers, _qwen3_norm

    init = {"weight": lambda w: torch.nn.init.normal_(w, std=0.02)}
    cfg = Qwen3Model.Config(
        vocab_size=m["vocab_size"], dim=m["hidden_size"], norm=_qwen3_norm(m["hidden_size"]),
        tok_embeddings=Embedding.Config(num_embeddings=m["vocab_size"], embedding_dim=m["hidden_size"],
                                        param_init=init),
        lm_head=Linear.Config(in_features=m["hidden_size"], out_features=m["vocab_size"], param_init=init),
        layers=_build_qwen3_moe_layers(
            n_layers=m["num_layers"], dim=m["hidden_size"], n_heads=m["num_heads"], n_kv_heads=m["num_kv_heads"],
            head_dim=m["head_dim"], moe_hidden_dim=m["expert_hidden_size"], num_experts=m["num_experts"],
            top_k=m["top_k"], attn_backend="flex", moe_comm_backend="standard",
            rope=CosSinRoPE.Config(dim=m["head_dim"], max_seq_len=max_seq, theta=1000000.0)))
    with torch.device(device):
        model = cfg.build()
    model.init_states(buffer_device=device)
    return model


def torchtitan_step_fn(model, batch, device):
    positions = batch.position_ids.to(device)[None]
    tokens, labels = batch.tokens.to(device)[None], batch.labels.to(device)

    def forward():  # the block mask per step, as torchtitan's trainer builds it (positions restart at 0)
        return model(tokens, positions, model.get_attention_masks(positions))[0]

    return forward, labels


def build_transformers(m: dict, max_seq: int, device):
    """transformers' Qwen3MoeForCausalLM from a Qwen3MoeConfig of our shape, random init, SDPA."""
    from transformers import Qwen3MoeConfig, Qwen3MoeForCausalLM

    cfg = Qwen3MoeConfig(
        vocab_size=m["vocab_size"], hidden_size=m["hidden_size"], num_hidden_layers=m["num_layers"],
        num_attention_heads=m["num_heads"], num_key_value_heads=m["num_kv_heads"], head_dim=m["head_dim"],
        num_experts=m["num_experts"], num_experts_per_tok=m["top_k"], moe_intermediate_size=m["expert_hidden_size"],
        intermediate_size=m["expert_hidden_size"], decoder_sparse_step=1, mlp_only_layers=[], norm_topk_prob=True,
        output_router_logits=False, tie_word_embeddings=False, max_position_embeddings=max_seq,
        use_cache=False, attn_implementation="sdpa")
    torch.manual_seed(0)
    with torch.device(device):  # initialised where it trains: a billion host-side draws would cost the section
        return Qwen3MoeForCausalLM(cfg)


def transformers_document_mask() -> bool:
    """Whether this transformers builds a per-document mask from packed position ids."""
    from transformers import masking_utils

    return hasattr(masking_utils, "find_packed_sequence_indices")


def transformers_step_fn(model, batch, device):
    tokens, labels = batch.tokens.to(device)[None], batch.labels.to(device)
    positions = batch.position_ids.to(device)[None]

    def forward():
        return model(input_ids=tokens, position_ids=positions, use_cache=False).logits[0]

    return forward, labels


# ---------------------------------------------------------------- the timed step


def time_peer(forward, labels, model, device, sizes: gpu_check.TrainerSizes) -> dict:
    """forward + cross-entropy + backward + AdamW under bf16 autocast (CPU: the trainer's own
    choice of gpu_check.autocast_setting), medians after warm-up as gpu_check._times."""
    from longctx_moe.precision import resolve_compute_dtype

    compute = resolve_compute_dtype(gpu_check.autocast_setting(device), torch.float32, device)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4, fused=device.type == "cuda")
    losses = []

    def step():
        with torch.autocast(device.type, dtype=compute.dtype, enabled=compute.dtype != torch.float32):
            logits = forward()
        loss = F.cross_entropy(logits.float(), labels, ignore_index=-100)
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        losses.append(loss.detach())

    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)
    times = gpu_check._times(step, sizes.warmup, sizes.iters, device)
    return {"times": times, "loss": float(losses[-1]), "compute_dtype": compute.name,
            "total_params": sum(p.numel() for p in model.parameters())}


def _torchtitan_unavailable() -> str | None:
    """Why torchtitan's qwen3 model cannot be imported here, in one line (None: it can)."""
    missing = _missing_modules(TORCHTITAN_IMPORTS)
    if missing:
        return (f"torchtitan's qwen3 model needs {', '.join(missing)}, not importable here: run "
                "`make gpu-wheels` and put the wheels installed from bench/wheels on PYTHONPATH")
    try:
        importlib.import_module("torchtitan.models.qwen3")
    except ImportError as exc:
        return f"torchtitan.models.qwen3 does not import with torch {torch.__version__}: {exc}"
    return None


def _forward_only(forward, labels) -> float:
    """One forward's loss without a graph: the CPU check of a model whose attention has no backward there."""
    with torch.no_grad():
        return float(F.cross_entropy(forward().float(), labels, ignore_index=-100))


def run_peer(name: str, device, sizes: gpu_check.TrainerSizes, peak: dict | None) -> dict:
    """One peer's figures, or {"skipped": why} where it cannot run here."""
    cfg = _model_config(sizes)
    lens, batch = _row(sizes, cfg.vocab_size)
    max_seq = max(40960, sizes.step_tokens)
    if name == "torchtitan":
        why = _torchtitan_unavailable()
        if why:
            return {"skipped": why}
        model = build_torchtitan(sizes.model, max_seq, device)
        forward, labels = torchtitan_step_fn(model, batch, device)
        if device.type == "cpu":
            return {"skipped": "flex attention has no backward on CPU: built the model and ran one forward",
                    "forward_loss": _forward_only(forward, labels),
                    "total_params": sum(p.numel() for p in model.parameters())}
        document_mask, how = True, "compiled flex attention, a block mask of the documents (positions restart at 0)"
    else:
        model = build_transformers(sizes.model, max_seq, device)
        forward, labels = transformers_step_fn(model, batch, device)
        document_mask = transformers_document_mask()
        how = ("sdpa with the per-document mask transformers builds from packed position ids" if document_mask
               else "sdpa, plain causal over the row (this transformers builds no mask from position ids)")
    res = time_peer(forward, labels, model, device, sizes)
    sec = statistics.median(res["times"])
    flops = _causal_pairs_flops(cfg, lens, document_mask)
    return {"step_ms": sec * 1e3, "tokens_per_s": sum(lens) / sec,
            **gpu_check._mfu(flops, sec, peak, res["compute_dtype"]), **gpu_check._gpu_memory(device),
            "model_tflop_per_step": flops / 1e12, "document_mask": document_mask, "attention": how,
            "step_ms_all": [t * 1e3 for t in res["times"]], "loss": res["loss"], "total_params": res["total_params"],
            "tokens": sum(lens), "docs": len(lens), "warmup_steps": sizes.warmup, "timed_steps": sizes.iters,
            "params": "fp32", "compute_dtype": res["compute_dtype"], "optimizer": "AdamW"}


OURS_KEYS = ("step_ms", "tokens_per_s", "model_tflops", "mfu", "mfu_skipped", "peak_gpu_memory_gib",
             "model_tflop_per_step", "step_ms_all", "loss", "total_params", "tokens", "docs", "warmup_steps",
             "timed_steps", "compute_dtype")


def run_ours(device, sizes: gpu_check.TrainerSizes, peak: dict | None) -> dict:
    """gpu_check's trainer section (Trainer.train_step, fp32 parameters, bf16 autocast on cuda)."""
    out = gpu_check.time_trainer_step(device, sizes, peak)
    return {**{k: out[k] for k in OURS_KEYS if k in out}, "document_mask": True, "params": "fp32",
            "attention": "per document (cu_seqlens)", "optimizer": "AdamW"}


def _parser() -> argparse.ArgumentParser:
    ap = gpu_check.device_parser(__doc__.splitlines()[0], "a tiny shape and a 2,048-token row (the CPU smoke run)")
    ap.add_argument("--model", required=True, choices=MODELS)
    return ap


def main(argv=None) -> int:
    ap = _parser()
    args = ap.parse_args(argv)
    device = gpu_check.device_of(ap, args)
    sizes = gpu_check.QUICK if args.quick else gpu_check.FULL
    res: dict = {"model": args.model, "torch": torch.__version__, "device": str(device), "quick": args.quick,
                 "gpu": torch.cuda.get_device_name(device) if device.type == "cuda" else None,
                 "shape": sizes.model, "step_tokens": sizes.step_tokens}
    peak = gpu_check.measure_peak(device, sizes.peak_size)  # the MFU denominator of this process
    res["peak_matmul"] = peak
    gc.collect()
    try:
        res["step"] = run_ours(device, sizes, peak) if args.model == "ours" else run_peer(args.model, device, sizes, peak)
    except Exception as exc:  # the record says what failed; the traceback goes to the section's log
        traceback.print_exc()
        res["step"] = {"ok": False, "error": f"{type(exc).__name__}: {exc}".splitlines()[0][:300]}
    write_json(args.out, res, indent=2)
    step = res["step"]
    if "error" in step:
        print(f"{args.model}: FAILED: {step['error']}", flush=True)
        return 1
    print(f"{args.model}: " + (f"skipped: {step['skipped']}" if "skipped" in step else
                               f"{step['tokens_per_s']:.0f} tokens/s, MFU {step['mfu']}, "
                               f"peak {step['peak_gpu_memory_gib']} GiB"), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
