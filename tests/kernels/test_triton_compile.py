"""The SwiGLU and RoPE kernels compile for a Hopper GPU (sm_90) on this machine, with no GPU:
Triton's front end, its passes and ptxas run ahead of time for the variants the model launches
(every bf16 one; fp32 once per kernel and direction).
The interpreter tests check the arithmetic; this checks what only a GPU compile would reject
(constructs the interpreter runs as plain Python). One subprocess without TRITON_INTERPRET and
with an empty cache (the kernels are compiled, not loaded)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.triton
ROOT = Path(__file__).resolve().parents[2]

_SCRIPT = r"""
import itertools, json, sys
import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource
from longctx_moe.kernels import triton_rope, triton_swiglu

def ptrs(names, dt):
    return {n: "*" + dt for n in names}

def ints(names):
    return {n: "i32" for n in names}

def compiled(fn, sig, consts):
    sig = {**sig, **{k: "constexpr" for k in consts}}
    return len(triton.compile(ASTSource(fn=fn, signature=sig, constexprs=consts),
                              target=GPUTarget("cuda", 90, 32)).asm["ptx"]) > 0

out = {}
# bf16 (what autocast runs) in every variant; fp32 in the plain one of each direction: its
# constructs are the bf16 ones with other pointer types, a compile of each is enough
for dt, clamped in (("bf16", False), ("bf16", True), ("fp32", False)):
    tile = dict(CLAMPED=clamped, ACC=32, ROWS=16, BLOCK_F=256)
    out[f"swiglu_fwd {dt} clamped={clamped}"] = compiled(
        triton_swiglu._fwd_kernel, {**ptrs(("g_ptr", "u_ptr", "a_ptr"), dt),
                                    **ints(("N", "F", "sg", "su")), "limit": "fp32"}, tile)
    out[f"swiglu_bwd {dt} clamped={clamped}"] = compiled(
        triton_swiglu._bwd_kernel, {**ptrs(("g_ptr", "u_ptr", "d_ptr", "a_ptr", "dh_ptr"), dt),
                                    **ints(("N", "F", "sg", "su", "sd")), "limit": "fp32"}, tile)
variants = [("bf16", *v) for v in itertools.product((False, True), (False, True), (0, 64))]
for dt, backward, interleaved, pass_through in variants + [("fp32", False, False, 0), ("fp32", True, False, 0)]:
    out[f"rope {dt} backward={backward} interleaved={interleaved} P={pass_through}"] = compiled(
        triton_rope._rope_kernel,
        {**ptrs(("q_ptr", "k_ptr", "qo_ptr", "ko_ptr", "cos_ptr", "sin_ptr"), dt),
         **ints(("H", "G", "T", "q_progs", "sqt", "sqh", "skt", "skh", "R", "D"))},
        dict(BACKWARD=backward, INTERLEAVED=interleaved, ACC=32, ROWS=32, HALF=64,
             BLOCK_P=pass_through))
print(json.dumps(out))
"""


def compile_ahead(script: str, cache_dir) -> dict:
    """Run `script` (it prints {variant: compiled} as its last line) in a subprocess without the
    interpreter and with an empty Triton cache `cache_dir`; its JSON."""
    env = {**os.environ, "TRITON_INTERPRET": "0", "TRITON_CACHE_DIR": str(cache_dir),
           "TRITON_DEFAULT_FP_FUSION": "1"}
    done = subprocess.run([sys.executable, "-c", script], cwd=ROOT, env=env, capture_output=True,
                          text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    return json.loads(done.stdout.strip().splitlines()[-1])


def test_kernels_compile_for_hopper(tmp_path):
    compiled = compile_ahead(_SCRIPT, tmp_path)
    assert len(compiled) == 6 + 10 and all(compiled.values()), compiled
