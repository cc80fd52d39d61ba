"""`longctx-moe rehearse`: one optimizer step of chosen ranks of an N-GPU job, run on this
machine's CPU on storage-less tensors (step.py), with what each rank would hold and move.

    longctx-moe rehearse --config configs/tiny_cpu.yaml \\
        --set train.model_config=configs/models/qwen3-30b-a3b.json --set parallel.ep=8 \\
        --world 8 --gpu h100 --lengths lognormal:1500,1.2,32768 --tokens 32768 --out r.json

Each rank runs in a process of its own (torch allows one default process group per process); a
single rank runs in the command's own.
Exit status 0 when every rehearsed rank fits its GPU, 1 when one does not, 2 for a fault the
GPUs would refuse (one line naming the rank and the op) or a bad command line.
"""

from __future__ import annotations

import argparse
import json
import sys
import traceback

from longctx_moe.rehearsal.gpus import GIB, GPUS


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="longctx-moe rehearse", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--config", required=True, help="training config (YAML)")
    p.add_argument("--set", action="append", default=[], metavar="KEY=VALUE", help="config override")
    p.add_argument("--world", type=int, required=True, help="the job's number of GPUs")
    p.add_argument("--rank", type=int, action="append", default=None,
                   help="a rank to rehearse (repeatable); default: the first and the last rank, which hold "
                   "the first and the last coordinate on every axis (every rank holds an even "
                   "share: no pipeline stages, every split even), and whose shared groups are "
                   "checked against each other")
    p.add_argument("--gpu", choices=sorted(GPUS), default="h100")
    p.add_argument("--lengths", default="lognormal:1500,1.2,32768",
                   help="document lengths of a rank's micro-batch: lognormal:MEDIAN,SIGMA,MAX")
    p.add_argument("--tokens", type=int, default=0, help="tokens of a rank's micro-batch (default "
                   "data.micro_batch_tokens)")
    p.add_argument("--rl", nargs="?", const="shards", choices=("shards", "buckets"),
                   help="rehearse an RL policy's step instead of a train step: compute_logprobs, a GRPO "
                   "update and the weight export (shards: each rank's own pieces, the default; buckets: "
                   "whole tensors gathered); provided by the package registered under the "
                   f"{REHEARSALS!r} entry points")
    p.add_argument("--out", help="write the reports as JSON here")
    return p


REHEARSALS = "longctx_moe.rehearsals"


def _policy_step():
    """The RL step's rehearsal: a package above this one (rl_hooks) registers it."""
    from importlib.metadata import entry_points

    found = [ep for ep in entry_points(group=REHEARSALS) if ep.name == "rl"]
    if not found:
        raise ValueError(f"--rl: no package registers an 'rl' rehearsal under the {REHEARSALS!r} entry "
                         "points; install this project with its rl_hooks package (pip install -e .)")
    return found[0].load()


def _lengths(spec: str, tokens: int, seed: int) -> list[int]:
    from longctx_moe.rehearsal.step import lognormal_lengths, parse_lognormal

    return lognormal_lengths(tokens, *parse_lognormal(spec), seed)


def _run_rank(conn, argv: list[str], rank: int) -> None:
    """In a process of its own: rehearse `rank`, send back ("ok", report) or (kind, message)."""
    from longctx_moe.config import ConfigError, load_config
    from longctx_moe.rehearsal.collectives import RehearsalFault
    from longctx_moe.rehearsal.step import rehearse_rank

    args = _parser().parse_args(argv)
    try:
        cfg = load_config(args.config, args.set)
        tokens = args.tokens or cfg.data.micro_batch_tokens
        # the documents are the data-parallel replica's: the ranks of one CP / TP group share
        # its micro-batch, as in the job
        from longctx_moe.build import check_layout

        lengths = _lengths(args.lengths, tokens, check_layout(cfg, args.world).rank_in("dp", rank))
        if args.rl:
            report = _policy_step()(cfg, args.world, rank, GPUS[args.gpu], lengths, export=args.rl)
        else:
            report = rehearse_rank(cfg, args.world, rank, GPUS[args.gpu], lengths)
        conn.send(("ok", report.as_dict()))
    except (ConfigError, ValueError, RehearsalFault) as e:
        conn.send(("fault" if isinstance(e, RehearsalFault) else "error", str(e)))
    except Exception:  # noqa: BLE001 - the program failed on the rehearsed device: where, in full
        conn.send(("crash", traceback.format_exc()))
    finally:
        conn.close()


class _Reply:
    """The end of a pipe `_run_rank` sends its one reply into, for a rank run in this process."""

    def send(self, reply) -> None:
        self.reply = reply

    def close(self) -> None:
        pass


def _rehearse(argv: list[str], rank: int, alone: bool = False) -> tuple[str, object]:
    """Rank `rank` in a process of its own, or in this one when it is the only rank rehearsed
    (`alone`: one default process group is all this process will hold)."""
    if alone:
        reply = _Reply()
        _run_rank(reply, argv, rank)
        return reply.reply
    from longctx_moe.rehearsal.fake_world import in_own_process

    return in_own_process(_run_rank, argv, rank)


def _table(reports: list[dict], gpu: str) -> str:
    lines = [f"{'rank':>5} {'peak GiB':>9} {'params':>7} {'grads':>7} {'optim':>7} {'activ':>7} {'comm':>6} {'rest':>6} "
             f"{'host MiB':>8} {'fits ' + gpu:>9}  peak at / step s (compute, comm) / launches"]
    for r in reports:
        s, t = r["peak_split"], r["step_seconds"]
        lines.append(f"{r['rank']:>5} {r['peak_bytes'] / GIB:>9.2f} {s['parameters'] / GIB:>7.2f} "
                     f"{s['gradients'] / GIB:>7.2f} {s['optimizer state'] / GIB:>7.2f} "
                     f"{s['activations'] / GIB:>7.2f} {s['communication buffers'] / GIB:>6.2f} {s['rest'] / GIB:>6.2f} {r['host_bytes'] / 2**20:>8.1f} "
                     f"{'yes' if r['fits'] else 'NO':>9}  "
                     f"{r['peak_moment']} / {t['total_s']:.3f} ({t['compute_s']:.3f}, {t['comm_s']:.3f}) / "
                     f"{r['launches']}")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    args = _parser().parse_args(argv)
    if args.world < 1:
        print(f"error: --world {args.world} must be >= 1", file=sys.stderr)
        return 2
    ranks = sorted(set(args.rank or [0, args.world - 1]))
    if any(not 0 <= r < args.world for r in ranks):
        print(f"error: --rank {ranks} must lie in [0, {args.world})", file=sys.stderr)
        return 2
    reports = []
    for rank in ranks:
        kind, payload = _rehearse(argv, rank, alone=len(ranks) == 1)
        if kind != "ok":
            print(f"error: {payload}" if kind != "crash" else f"error: rank {rank} failed:\n{payload}",
                  file=sys.stderr)
            return 2
        reports.append(payload)
    from longctx_moe.rehearsal.collectives import RehearsalFault, check_agreement

    try:  # ranks that share a group must run the same collectives in the same dtypes
        check_agreement({r["rank"]: r["calls"] for r in reports})
    except RehearsalFault as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    print(_table(reports, args.gpu))
    for r in reports:
        for group, t in r["traffic"].items():
            print(f"rank {r['rank']}: {group}: {t['calls']} calls, {t['payload_bytes'] / 2**20:.1f} MiB sent")
        for phase, seen in r.get("phases", {}).items():  # an RL step's
            print(f"rank {r['rank']}: {phase}: " + ", ".join(f"{k} {v}" for k, v in seen.items() if k != "traffic")
                  + f", {sum(t['payload_bytes'] for t in seen['traffic'].values()) / 2**20:.1f} MiB sent")
    if args.out:
        with open(args.out, "w") as f:
            json.dump({"world": args.world, "gpu": args.gpu, "ranks": reports}, f, indent=1)
    return 0 if all(r["fits"] for r in reports) else 1
