"""Adapter for the AMX attention backward (`_amx_attention_bwd.cpp`), built on first use.

The C++ kernel computes the backward of causal self-attention over the documents of a packed row
with oneDNN's AMX micro-kernel (torch's exported `cpublas::brgemm`) and fp32 accumulators. On a
2048-token document (8 query / 4 KV heads of 64, bf16) it took 59 ms against aten's 99 ms on one
core of the dev VM, and 0.6 ms against 3.9 ms at 128 tokens; it is also more accurate (dK/dV are
accumulated in fp32, not rounded to bf16 tile by tile).

It is built with torch.utils.cpp_extension the first time a bf16 causal backward asks for it
(30-40 s; cached on disk afterwards) and only where it can run: Linux on x86-64 with AMX-bf16,
a C++ compiler and ninja. Anything else, including a failed build or a failed call, leaves
`available()` False and the caller on aten's kernel, with one warning naming the reason.
`LONGCTX_AMX_ATTENTION=0` turns it off. Head dims must be multiples of 16: 16 to 128 are tested,
and a head dim of 8 failed inside oneDNN when tried.
"""

from __future__ import annotations

import contextlib
import hashlib
import os
import platform
import sys
import time
import warnings
from pathlib import Path

import torch

BLOCK_Q = 64  # queries per tile: the column count of the per-tile packed B operands (<= 64)
BLOCK_K = 64  # keys per tile (128 measured no faster on 2048 tokens, slower on short documents)
_SOURCE = Path(__file__).with_name("_amx_attention_bwd.cpp")
_state: dict = {}


def _cpu_has_amx() -> bool:
    try:
        flags = Path("/proc/cpuinfo").read_text()
    except OSError:
        return False
    return all(f in flags for f in ("amx_bf16", "amx_tile", "avx512_bf16", "avx512bw"))


# One build cache entry per Python environment: two venvs (other torch headers) sharing one name
# would rebuild over each other on every switch.
_NAME = "longctx_amx_attention_bwd_" + hashlib.sha1(sys.prefix.encode()).hexdigest()[:10]


def _build():
    from torch.utils.cpp_extension import load

    flags = ["-O3", "-DCPU_CAPABILITY=AVX512", "-DCPU_CAPABILITY_AVX512", "-mavx512f", "-mavx512bw",
             "-mavx512vl", "-mavx512dq", "-mavx512bf16", "-mfma", "-fopenmp"]
    t0 = time.perf_counter()
    mod = load(name=_NAME, sources=[str(_SOURCE)], extra_cflags=flags, extra_ldflags=["-fopenmp"],
               verbose=False)
    if time.perf_counter() - t0 > 5:  # a compile, not a cache hit: say where the pause went
        print(f"cp_attention: built the AMX attention backward in {time.perf_counter() - t0:.0f} s "
              "(cached for later runs)", file=sys.stderr, flush=True)
    return mod


def _disable(e: Exception) -> None:
    why = f"{type(e).__name__}: {(str(e).splitlines() or [''])[0][:200]}"
    warnings.warn(f"AMX attention backward unavailable ({why}); using aten's CPU flash backward. "
                  "A C++ compiler and ninja enable it; LONGCTX_AMX_ATTENTION=0 silences this.", stacklevel=4)
    _state["mod"] = None


def _module():
    """The built extension, or None where it cannot be built or used here (decided once)."""
    if "mod" in _state:
        return _state["mod"]
    mod = None
    wanted = os.environ.get("LONGCTX_AMX_ATTENTION", "1") != "0"
    if wanted and platform.system() == "Linux" and platform.machine() == "x86_64" and _cpu_has_amx():
        try:
            mod = _build()
            if not mod.usable():
                mod = None
        except Exception as e:  # no compiler, no ninja, a header change in another torch release
            _disable(e)
            return None
    _state["mod"] = mod
    return mod


def available() -> bool:
    return _module() is not None


@contextlib.contextmanager
def disabled():
    """Run the block on aten's backward (benchmarks compare the two in one process)."""
    mod = _module()
    _state["mod"] = None
    try:
        yield
    finally:
        _state["mod"] = mod


def varlen_causal_backward(dout_THD, q_THD, k_SHD, v_SHD, out_THD, lse_HT, cu_seqlens, scale):
    """(dq_THD, dk_SHD, dv_SHD) in bf16 for causal self-attention over the documents
    [cu[i], cu[i+1]) (queries and keys share the boundaries). Inputs bf16, lse float32 [Hq, T];
    tokens outside every document get zero gradients."""
    mod = _module()
    args = [x.contiguous() for x in (dout_THD, q_THD, k_SHD, v_SHD, out_THD)]
    with torch.profiler.record_function("cp_attention::amx_attention_backward"):  # named in profiles
        return tuple(mod.varlen_causal_backward(*args, lse_HT.float().contiguous(),
                                                cu_seqlens.to(torch.long).cpu(), float(scale),
                                                BLOCK_Q, BLOCK_K))


def try_varlen_causal_backward(*args):
    """varlen_causal_backward, or None (and the kernel off for this process, with one warning)
    if it fails: a training run falls back to aten's kernel rather than dying mid-step."""
    try:
        return varlen_causal_backward(*args)
    except RuntimeError as e:
        _disable(e)
        return None
