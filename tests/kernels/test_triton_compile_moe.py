"""The MoE routing kernels (balance statistics, route layout, the un-permute with fp32 weights)
compile for a Hopper GPU (sm_90) on this machine, with no GPU: Triton's front end, its passes
and ptxas run ahead of time for each variant the model launches (what the interpreter runs as
plain Python a GPU compile may reject: int64 atomics, scans, mixed-dtype casts). One subprocess
without TRITON_INTERPRET and with an empty cache."""

from __future__ import annotations

import pytest

from tests.kernels.test_triton_compile import compile_ahead

pytestmark = pytest.mark.triton

_SCRIPT = r"""
import json
import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource
from longctx_moe.kernels import triton_balance as B, triton_layout as L, triton_permute as P

def compiled(fn, sig, consts):
    sig = {**sig, **{k: "constexpr" for k in consts}}
    return len(triton.compile(ASTSource(fn=fn, signature=sig, constexprs=consts),
                              target=GPUTarget("cuda", 90, 32)).asm["ptx"]) > 0

i32 = lambda *names: {n: "i32" for n in names}
out = {}
out["balance counts"] = compiled(B._counts_kernel, {"idx_ptr": "*i64", "doc_ptr": "*i64", "cnt_ptr": "*i64",
                                                     **i32("T", "E", "N")}, dict(K=8, BLOCK_T=16))
for has_z in (False, True):
    out[f"balance loss z={has_z}"] = compiled(
        B._loss_kernel, {"s_ptr": "*fp32", "z_ptr": "*fp32", "doc_ptr": "*i64", "cnt_ptr": "*i64",
                         "part_ptr": "*fp32", **i32("T", "E", "N"), "tiny": "fp32"},
        dict(K=8, HAS_Z=has_z, BLOCK_T=16, BLOCK_E=64))
    out[f"balance finish z={has_z}"] = compiled(
        B._finish_kernel, {"part_ptr": "*fp32", "cnt_ptr": "*i64", "aux_ptr": "*fp32", "zl_ptr": "*fp32",
                           "tok_ptr": "*fp32", **i32("P", "N", "E"), "aux_scale": "fp32", "z_coeff": "fp32"},
        dict(HAS_Z=has_z, BLOCK_P=1024))
    out[f"balance bwd z={has_z}"] = compiled(
        B._bwd_kernel, {"g_aux_ptr": "*fp32", "g_z_ptr": "*fp32", "s_ptr": "*fp32", "z_ptr": "*fp32",
                        "doc_ptr": "*i64", "cnt_ptr": "*i64", "tok_ptr": "*fp32", "gs_ptr": "*fp32",
                        "gz_ptr": "*fp32", **i32("T", "E", "N"), "tiny": "fp32", "aux_scale": "fp32",
                        "z_coeff": "fp32"},
        dict(K=8, HAS_GA=True, HAS_GZ=has_z, BLOCK_T=16, BLOCK_E=64))
out["layout hist"] = compiled(L._hist_kernel, {"idx_ptr": "*i64", "hist_ptr": "*i32", **i32("M", "E")},
                              dict(BLOCK_M=128, BLOCK_E=64))
out["layout scan"] = compiled(L._scan_kernel, {"hist_ptr": "*i32", "base_ptr": "*i64", "counts_ptr": "*i64",
                                               **i32("NB", "E")}, dict(BLOCK_B=32, BLOCK_E=64))
out["layout slot"] = compiled(L._slot_kernel, {"idx_ptr": "*i64", "base_ptr": "*i64", "slot_ptr": "*i64",
                                               **i32("M", "E")}, dict(BLOCK_M=128, BLOCK_E=64))
out["unpermute fp32 w"] = compiled(P._gather_kernel, {"src_ptr": "*bf16", "slot_ptr": "*i64", "w_ptr": "*fp32",
                                                      "out_ptr": "*bf16", **i32("T", "D")},
                                   dict(K=8, HAS_W=True, BLOCK_T=16, BLOCK_D=256))
out["unpermute bwd fp32 w"] = compiled(
    P._unpermute_bwd_kernel, {"g_ptr": "*bf16", "y_ptr": "*bf16", "slot_ptr": "*i64", "w_ptr": "*fp32",
                              "gy_ptr": "*bf16", "gw_ptr": "*fp32", **i32("T", "D")},
    dict(K=8, BLOCK_T=16, BLOCK_D=256))
print(json.dumps(out))
"""


def test_routing_kernels_compile_for_hopper(tmp_path):
    compiled = compile_ahead(_SCRIPT, tmp_path)
    assert len(compiled) == 1 + 3 * 2 + 3 + 2 and all(compiled.values()), compiled
