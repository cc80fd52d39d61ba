"""train.compile and the host allocator: compiled blocks give the eager model's numbers; the
allocator tuning is applied and a bad value is refused."""

import shutil
import subprocess
import sys

import pytest
import torch
from torch._dynamo.utils import counters

from longctx_moe.build import model_of
from longctx_moe.compile import apply_compile
from longctx_moe.config import ConfigError, load_config
from longctx_moe.host import configure_cpu
from longctx_moe.model.config import BalanceConfig
from longctx_moe.parallel.parallelize import parallelize
from longctx_moe.trainer import Trainer
from tests.model.helpers import packed_batch, tiny_config


def _trainer(compiled: bool):
    cfg = load_config(None, ["train.param_dtype=fp64", "train.autocast_dtype=none", "optim.warmup_steps=0",
                             "optim.grad_clip=1.0"])
    cfg.model = tiny_config(expert_bias=True)
    cfg.balance = BalanceConfig(aux_loss_type="seq", z_loss_coeff=1e-3)
    torch.manual_seed(0)
    runtime = parallelize(model_of(cfg).double(), None, cfg.parallel)
    if compiled:
        apply_compile(runtime.model)
    return Trainer(cfg, runtime)


# torch.compile runs the C++ compiler in subprocesses (inductor's workers): minutes on 2 cores.
@pytest.mark.slow
@pytest.mark.skipif(not any(shutil.which(c) for c in ("g++", "c++", "clang++")),
                    reason="inductor's CPU backend needs a C++ compiler")
def test_compiled_blocks_match_eager_float64():
    """Two optimizer steps on packed rows with padding (which sends MoE.stats down its masked,
    data-dependent path, kept eager): float64, so inductor's reordering of float ops can only move
    results by rounding (~1e-16 relative); 1e-10 is the suite's float64 tolerance."""
    gen = torch.Generator().manual_seed(3)
    # Both micro-batches 34 rows long, as the trainer's fixed-length rows are: a second length
    # would compile every graph again (and then once more with dynamic shapes), tripling the cost.
    steps = [[packed_batch([9, 3, 14], 64, pad_multiple=4, trailing_pad=2, generator=gen),
              packed_batch([20, 5], 64, pad_multiple=4, trailing_pad=6, generator=gen)] for _ in range(2)]
    assert {b.tokens.numel() for batches in steps for b in batches} == {34}
    eager, compiled = _trainer(False), _trainer(True)
    counters.clear()
    for batches in steps:
        a, b = eager.train_step(batches), compiled.train_step(batches)
        assert abs(a.loss - b.loss) < 1e-10 and abs(a.grad_norm - b.grad_norm) < 1e-10
    assert counters["stats"]["unique_graphs"] > 0  # inductor really ran (no silent eager fallback)
    sd_e, sd_c = eager.model.state_dict(), compiled.model.state_dict()
    assert list(sd_e) == list(sd_c)  # compiled in place: checkpoints keep their parameter names
    for k in sd_e:
        torch.testing.assert_close(sd_e[k], sd_c[k], atol=1e-10, rtol=0)


_MMAPPED_BYTES = """
import ctypes, ctypes.util, sys
import torch
from longctx_moe.host import tune_host_allocator

class MallInfo2(ctypes.Structure):
    _fields_ = [(n, ctypes.c_size_t) for n in ("arena", "ordblks", "smblks", "hblks", "hblkhd",
                                                "usmblks", "fsmblks", "uordblks", "fordblks", "keepcost")]

libc = ctypes.CDLL(ctypes.util.find_library("c"))
libc.mallinfo2.restype = MallInfo2
assert tune_host_allocator(sys.argv[1])
before = libc.mallinfo2().hblkhd
x = torch.empty(int(sys.argv[2]), dtype=torch.uint8)
print(libc.mallinfo2().hblkhd - before)
"""


def _mmapped_bytes(mode: str, nbytes: int) -> int:
    """How much glibc's mmapped bytes (mallinfo2().hblkhd) grow when a fresh process with the
    allocator `mode` allocates one tensor of `nbytes` (a fresh heap has no free top to serve it)."""
    out = subprocess.run([sys.executable, "-c", _MMAPPED_BYTES, mode, str(nbytes)], check=True,
                         capture_output=True, text=True)
    return int(out.stdout)


@pytest.mark.slow
def test_host_allocator_modes_move_the_mmap_threshold_on_glibc():
    # this project's CI and dev machines run glibc; torch's CPU tensors come from its malloc
    assert _mmapped_bytes("lean", 4 << 20) >= 4 << 20  # above 1 MiB: a block of its own
    assert _mmapped_bytes("tuned", 4 << 20) == 0  # up to 32 MiB: from the heap
    assert _mmapped_bytes("tuned", 64 << 20) >= 64 << 20


def test_bad_host_allocator_value_is_refused():
    with pytest.raises(ConfigError, match="train.host_allocator"):
        load_config(None, ["train.host_allocator=jemalloc"])
    with pytest.raises(ValueError, match="host_allocator"):
        configure_cpu(1, "jemalloc")
