"""Adapter for the fused CPU log-prob head (`cp_attention/csrc/logprobs.cpp`).

Under bf16 autocast on a CPU the log-prob head (model.losses._LinearLogProbs) spends as long on
the softmax work of each [C, V] chunk as on its three products: torch converts the bf16 logits to
float32 for the log-softmax, again for the backward's softmax, and the gradient back to bf16, each
a pass over C x V values. The C++ kernel does the forward's row statistics (log-sum-exp, the
target's log-prob, the entropy) in one pass over the bf16 logits and the backward's gradient in
one more, written as bf16 over the logits, with the torch path's float32 arithmetic.

It serves unsharded heads with bf16 logits on CPUs with AVX512-BF16, as part of cp_attention's
native extension (cp_attention.native: built on first use, cached on disk); a failed build or
self-check warns once and leaves the head on torch. `available()` is whether it is built and
self-checked here; `disabled()` runs a block on torch (the benchmarks compare the two in one
process).
Shape legend: C rows of one chunk, V vocabulary columns.
"""

from __future__ import annotations

import torch

from cp_attention import native

KERNEL = "logprobs"  # its name in cp_attention.native


def available() -> bool:
    return native.unavailable_reason(KERNEL) is None


def disabled():
    """A context: torch's log-softmax for the block."""
    return native.disabled(KERNEL)


def serves(cdtype: torch.dtype, device: torch.device, shard) -> bool:
    """Whether the kernel runs a head: bf16 logits on the CPU, unsharded, where it built."""
    return cdtype == torch.bfloat16 and device.type == "cpu" and shard is None and available()


def forward_stats(z_CV: torch.Tensor, labels_C: torch.Tensor, temperature: float, entropy: bool):
    """(logp_C, ent_C, lse_C) float32 of softmax(z / temperature); ent_C zeros without entropy."""
    with torch.profiler.record_function("longctx_moe::cpu_logprob_stats"):
        return native.kernel(KERNEL).forward_stats(z_CV.contiguous(), labels_C.long(), float(temperature), entropy)


def backward_grad_(z_CV: torch.Tensor, labels_C, lse_C, ent_C, g_logp_C, g_ent_C, temperature: float):
    """d loss / d z (bf16), written over z_CV (contiguous, no longer needed) and returned;
    g_ent_C None: no entropy term."""
    g_ent = g_ent_C.float().contiguous() if g_ent_C is not None else lse_C.new_empty(0)
    with torch.profiler.record_function("longctx_moe::cpu_logprob_grad"):
        return native.kernel(KERNEL).backward_grad_(z_CV, labels_C.long(), lse_C, ent_C,
                                                    g_logp_C.float().contiguous(), g_ent, float(temperature))
