"""One self-check per kernel of the native extension (cp_attention.native): each raises if its
kernel disagrees with float32 / float64 maths on a tiny input. A wrong build (or, for the
attention kernels, a oneDNN bf16 brgemm path that is wrong on this CPU) must cost a warning and
the torch path, not a training run; a check runs once per process, the first time its kernel is
asked for.

The first ask may come from inside a model's bf16 autocast region, a backward pass, no_grad or
inference mode: every reference is written out in closed form with autocast off.
"""

from __future__ import annotations

import torch


def attention_fwd(mod) -> None:
    with torch.autocast("cpu", enabled=False), torch.no_grad():
        g = torch.Generator().manual_seed(0)
        q, k, v = (torch.randn(70, h, 16, generator=g).bfloat16() for h in (2, 1, 1))
        out, lse = mod.varlen_causal_forward(q, k, v, torch.tensor([0, 3, 70]), 0.25)
        for a, b in ((0, 3), (3, 70)):
            s = torch.einsum("thd,shd->hts", q[a:b].float(), k[a:b].float().expand(-1, 2, -1)) * 0.25
            s = s.masked_fill(torch.ones(b - a, b - a, dtype=torch.bool).triu(1), float("-inf"))
            ref = torch.einsum("hts,shd->thd", s.softmax(-1), v[a:b].float().expand(-1, 2, -1))
            # bf16 P and output: 2e-2 is ~4 bf16 ulps at these magnitudes; a wrong kernel is O(1) off.
            if not (torch.allclose(out[a:b].float(), ref, atol=2e-2)
                    and torch.allclose(lse[:, a:b], s.logsumexp(-1), atol=1e-3)):
                raise RuntimeError("self-check against float32 maths failed (oneDNN's bf16 brgemm path)")


def attention_bwd(mod) -> None:
    from cp_attention.kernels.amx_backward import BLOCK_K, BLOCK_Q  # the tiles the adapter runs

    with torch.autocast("cpu", enabled=False), torch.no_grad():
        # Two documents, the second straddling a 64-row tile, two query heads on one KV head.
        g = torch.Generator().manual_seed(0)
        q, k, v, dout = (torch.randn(70, h, 16, generator=g).bfloat16() for h in (2, 1, 1, 2))
        cu, scale = torch.tensor([0, 3, 70]), 0.25
        outs, lses, refs = [], [], []
        for a, b in ((0, 3), (3, 70)):
            qf, do = q[a:b].float(), dout[a:b].float()
            kf, vf = (x[a:b].float().expand(-1, 2, -1) for x in (k, v))
            s = torch.einsum("thd,shd->hts", qf, kf) * scale
            s = s.masked_fill(torch.ones(b - a, b - a, dtype=torch.bool).triu(1), float("-inf"))
            p = s.softmax(-1)
            o = torch.einsum("hts,shd->thd", p, vf).bfloat16()  # the kernel reads a bf16 out
            ds = p * (torch.einsum("thd,shd->hts", do, vf) - (do * o.float()).sum(-1).T[..., None]) * scale
            refs.append((torch.einsum("hts,shd->thd", ds, kf), torch.einsum("hts,thd->sd", ds, qf)[:, None],
                         torch.einsum("hts,thd->sd", p, do)[:, None]))
            outs.append(o)
            lses.append(s.logsumexp(-1))
        got = mod.varlen_causal_backward(dout, q, k, v, torch.cat(outs), torch.cat(lses, 1).contiguous(),
                                         cu, scale, BLOCK_Q, BLOCK_K)
        per_grad = (torch.cat(r) for r in zip(*refs, strict=True))  # (dq, dk, dv) over both documents
        for grad, ref in zip(got, per_grad, strict=True):
            # bf16 P, dS and gradients: 2e-2 of the gradient's scale is several bf16 ulps (the tests
            # measure 0.3-0.6%); a wrong kernel is O(1) off.
            if not (grad.float() - ref).abs().max() <= 2e-2 * ref.abs().max():
                raise RuntimeError("self-check against float32 maths failed (oneDNN's bf16 brgemm path)")


def logprobs(mod) -> None:
    """A small chunk with a vector tail, a temperature and both entropy terms."""
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


def rmsnorm(mod) -> None:
    """A few float32 rows with a vector tail against float64 maths."""
    with torch.autocast("cpu", enabled=False), torch.no_grad():
        g = torch.Generator().manual_seed(0)
        x, dy = (torch.randn(5, 37, generator=g, dtype=torch.float64) for _ in range(2))
        w = torch.randn(37, generator=g, dtype=torch.float64)
        r = torch.rsqrt(x.square().mean(-1, keepdim=True) + 1e-6)
        xh, gw = x * r, dy * w
        refs = (xh * w, r * (gw - xh * (gw * xh).mean(-1, keepdim=True)), (dy * xh).sum(0))
        y, r32 = mod.rmsnorm_forward(x.float(), w.float(), 1e-6, torch.float32)
        dx, dw = mod.rmsnorm_backward(dy.float(), x.float(), w.float(), r32)
        for got, ref in zip((y, dx, dw), refs, strict=True):
            if not torch.allclose(got.double(), ref, rtol=1e-5, atol=1e-5):
                raise RuntimeError("self-check against float64 maths failed")


def swiglu(mod) -> None:
    """A few float32 rows with a vector tail against float64 maths."""
    with torch.autocast("cpu", enabled=False), torch.no_grad():
        g = torch.Generator().manual_seed(0)
        h = torch.randn(5, 2 * 37, generator=g, dtype=torch.float64) * 3
        dact = torch.randn(5, 37, generator=g, dtype=torch.float64)
        gate, up = h.chunk(2, -1)
        s = torch.sigmoid(gate)
        act = gate * s * up
        dh = torch.cat([dact * up * s * (1 + gate * (1 - s)), dact * gate * s], -1)
        got = (mod.swiglu_forward(h.float()), *mod.swiglu_backward(h.float(), dact.float()))
        for x, ref in zip(got, (act, act, dh), strict=True):
            if not torch.allclose(x.double(), ref, rtol=1e-5, atol=1e-5):
                raise RuntimeError("self-check against float64 maths failed")


CHECKS = {"attention_fwd": attention_fwd, "attention_bwd": attention_bwd, "logprobs": logprobs,
          "rmsnorm": rmsnorm, "swiglu": swiglu}
