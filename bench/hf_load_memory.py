"""Per-rank cost of train.init_from: a random Mixtral-family checkpoint (transformers' config class,
save_pretrained) loaded by 1 rank and by 4 ranks under EP4 (gloo, CPU). Each rank builds the model
on the meta device, parallelizes it and reads only its slices (hf.load.load_hf_sharded). Reported
per rank: the bytes read from the safetensors files, and the RSS growth over the load (the peak
RSS during it, VmHWM reset just before, minus the RSS before it: the interpreter and torch are
not the load's; the file pages mapped by safetensors count).

    python bench/hf_load_memory.py --out bench/results/hf_load_memory.json
"""

from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import argparse  # noqa: E402
import json  # noqa: E402
import os  # noqa: E402
import socket  # noqa: E402
import tempfile  # noqa: E402

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402
import torch.multiprocessing as mp  # noqa: E402


def _status_mb(field: str) -> float:
    """VmRSS (now) or VmHWM (peak since the last reset) of this process, in MiB."""
    with open("/proc/self/status") as f:
        line = next(x for x in f if x.startswith(field + ":"))
    return int(line.split()[1]) / 1024


def _reset_peak() -> None:
    with open("/proc/self/clear_refs", "w") as f:  # "5" resets VmHWM to the current RSS
        f.write("5")


def _load(rank: int, world: int, hf_dir: str, port: int, queue) -> None:
    from longctx_moe.build import model_of
    from longctx_moe.config import load_config
    from longctx_moe.hf.load import load_hf_sharded
    from longctx_moe.parallel.dims import ParallelDims, destroy_process_groups
    from longctx_moe.parallel.parallelize import parallelize

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=world)
    cfg = load_config(None, [f"train.init_from={hf_dir}", f"parallel.ep={world}"])
    dims = ParallelDims.from_config(cfg.parallel, world)
    dims.build_groups(rank)
    with torch.device("meta"):
        model = model_of(cfg, meta=True)
    parallelize(model, dims, cfg.parallel)
    _reset_peak()
    before = _status_mb("VmRSS")
    read = load_hf_sharded(model, hf_dir)
    queue.put((rank, read, _status_mb("VmHWM") - before))
    destroy_process_groups()


def _measure(world: int, hf_dir: str) -> list[tuple[int, int, float]]:
    ctx = mp.get_context("spawn")
    queue = ctx.Queue()
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    procs = [ctx.Process(target=_load, args=(r, world, hf_dir, port, queue)) for r in range(world)]
    for p in procs:
        p.start()
    out = sorted(queue.get(timeout=600) for _ in procs)
    for p in procs:
        p.join()
    return out


def main() -> None:
    import transformers

    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--experts", type=int, default=16)
    parser.add_argument("--expert-hidden", type=int, default=1024)
    parser.add_argument("--out", default="")
    args = parser.parse_args()
    cfg = transformers.MixtralConfig(vocab_size=1024, hidden_size=256, intermediate_size=args.expert_hidden,
                                     num_hidden_layers=4, num_attention_heads=4, num_key_value_heads=2,
                                     num_local_experts=args.experts, num_experts_per_tok=2)
    with tempfile.TemporaryDirectory(prefix="hf_load_memory_") as hf_dir:
        transformers.AutoModelForCausalLM.from_config(cfg).save_pretrained(hf_dir)
        total = sum(p.stat().st_size for p in Path(hf_dir).glob("*.safetensors"))
        rows = {world: _measure(world, hf_dir) for world in (1, 4)}
    one_read, one_rss = rows[1][0][1], rows[1][0][2]
    print(f"checkpoint: {total / 2**20:.1f} MiB of safetensors")
    print(f"{'ranks':>5} {'rank':>4} {'MiB read':>9} {'x 1-rank':>8} {'RSS growth MiB':>15} {'x 1-rank':>8}")
    for world, ranks in rows.items():
        for rank, read, rss in ranks:
            print(f"{world:>5} {rank:>4} {read / 2**20:>9.1f} {read / one_read:>8.2f} {rss:>15.1f} {rss / one_rss:>8.2f}")
    if args.out:
        Path(args.out).parent.mkdir(parents=True, exist_ok=True)
        Path(args.out).write_text(json.dumps({"checkpoint_bytes": total, "ranks": {
            str(w): [{"rank": r, "bytes_read": b, "rss_growth_mb": m} for r, b, m in ranks]
            for w, ranks in rows.items()}}, indent=2) + "\n")


if __name__ == "__main__":
    main()
