"""Adapter for the fused CPU log-prob head (`_cpu_logprobs.cpp`), built on first use.

Under bf16 autocast on a CPU the log-prob head (model.losses._LinearLogProbs) spends as long on
the softmax work of each [C, V] chunk as on its three products: torch converts the bf16 logits to
float32 for the log-softmax, again for the backward's softmax, and the gradient back to bf16, each
a pass over C x V values. The C++ kernel does the forward's row statistics (log-sum-exp, the
target's log-prob, the entropy) in one pass over the bf16 logits and the backward's gradient in
one more, written as bf16 over the logits, with the torch path's float32 arithmetic.

It serves unsharded heads with bf16 logits on CPUs with AVX512-BF16 (the builder of
cp_attention's C++ kernels decides, and builds it on first use, ~20 s, cached on disk); a failed
build or self-check warns once and leaves the head on torch. `LONGCTX_CPU_LOGPROBS=0` turns it
off (the benchmarks compare the two in one process with `disabled()`).
Shape legend: C rows of one chunk, V vocabulary columns.
"""

from __future__ import annotations

from pathlib import Path

import torch

from cp_attention.kernels._cpp_kernel import CppKernel

ENV = "LONGCTX_CPU_LOGPROBS"


def _self_check(mod) -> None:
    """Raise if the kernel disagrees with float32 maths on a small chunk (the vector tail, the
    temperature and both entropy terms included): a wrong build must cost a warning, not a run."""
    with torch.autocast("cpu", enabled=False), torch.no_grad():
        g = torch.Generator().manual_seed(0)
        z = (torch.randn(5, 37, generator=g) * 3).bfloat16()
        labels, gl, ge = torch.randint(0, 37, (5,), generator=g), torch.randn(5, generator=g), torch.randn(5, generator=g)
        logp, ent, lse = mod.forward_stats(z, labels, 0.7, True)
        x = z.float() / 0.7
        ref_lp = x.log_softmax(-1)
        ref_ent = -(ref_lp.exp() * ref_lp).sum(-1)
        p = ref_lp.exp()
        ref_g = -gl[:, None] * p - ge[:, None] * p * (ref_lp + ref_ent[:, None])
        ref_g[torch.arange(5), labels] += gl
        got_g = mod.backward_grad_(z.clone(), labels, lse, ent, gl, ge, 0.7).float()
        # float32 statistics agree to float32 rounding; the gradient is one bf16 rounding off.
        if not (torch.allclose(logp, ref_lp.gather(1, labels[:, None]).squeeze(1), atol=1e-5)
                and torch.allclose(ent, ref_ent, atol=1e-5)
                and torch.allclose(got_g, ref_g / 0.7, rtol=8e-3, atol=1e-6)):
            raise RuntimeError("self-check against float32 maths failed")


KERNEL = CppKernel(str(Path(__file__).with_name("_cpu_logprobs.cpp")), "longctx_cpu_logprobs_", ENV,
                   "fused CPU log-prob head", "torch's log-softmax", _self_check)
available, disabled = KERNEL.available, KERNEL.disabled


def serves(cdtype: torch.dtype, device: torch.device, shard) -> bool:
    """Whether the kernel runs a head: bf16 logits on the CPU, unsharded, where it built."""
    return cdtype == torch.bfloat16 and device.type == "cpu" and shard is None and available()


def forward_stats(z_CV: torch.Tensor, labels_C: torch.Tensor, temperature: float, entropy: bool):
    """(logp_C, ent_C, lse_C) float32 of softmax(z / temperature); ent_C zeros without entropy."""
    with torch.profiler.record_function("longctx_moe::cpu_logprob_stats"):
        return KERNEL.module().forward_stats(z_CV.contiguous(), labels_C.long(), float(temperature), entropy)


def backward_grad_(z_CV: torch.Tensor, labels_C, lse_C, ent_C, g_logp_C, g_ent_C, temperature: float):
    """d loss / d z (bf16), written over z_CV (contiguous, no longer needed) and returned;
    g_ent_C None: no entropy term."""
    g_ent = g_ent_C.float().contiguous() if g_ent_C is not None else lse_C.new_empty(0)
    with torch.profiler.record_function("longctx_moe::cpu_logprob_grad"):
        return KERNEL.module().backward_grad_(z_CV, labels_C.long(), lse_C, ent_C,
                                              g_logp_C.float().contiguous(), g_ent, float(temperature))
