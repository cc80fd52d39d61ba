"""The `longctx-moe` command: `train` (one process, or N local ranks with --nproc), `export-hf`
(a run's checkpoint as a Hugging Face directory of its family, longctx_moe.hf.export), `report` (PNG
plots of a run's metrics.jsonl, longctx_moe.report),
`plan-groups` (provided by longctx_moe.parallel.plan_groups, imported lazily), and the commands
packages above this one register under the `longctx_moe.commands` entry-point group (rl_hooks
registers `rl`, its GRPO demo): this package never imports them."""

from __future__ import annotations

import argparse
import logging
import os
import signal
import sys


def _train_parser(sub) -> None:
    p = sub.add_parser("train", help="train a model from a YAML config")
    p.add_argument("--config", required=True, help="YAML file, e.g. configs/tiny_cpu.yaml")
    p.add_argument("--set", dest="overrides", action="append", default=[], metavar="KEY=VALUE",
                   help="dotted override, repeatable: --set model.num_experts=16 --set train.steps=50")
    p.add_argument("--nproc", type=int, default=1,
                   help="local ranks to launch through torch's elastic launcher (gloo on CPU, nccl on GPU)")
    p.add_argument("--max-restarts", type=int, default=0, metavar="N",
                   help="when a rank dies, stop the others and relaunch all of them from the latest complete "
                        "checkpoint, up to N times (elastic launcher, also with --nproc 1)")


def _export_parser(sub) -> None:
    p = sub.add_parser("export-hf", help="write a run's checkpoint as a Hugging Face directory of its model.hf_family")
    p.add_argument("run_dir", help="the run directory (holds config.yaml and checkpoints/)")
    p.add_argument("out", help="output directory (safetensors shards, config.json, tokenizer)")
    p.add_argument("--step", type=int, default=None, help="checkpoint step to export (default: latest)")
    p.add_argument("--dtype", choices=("fp32", "bf16"), default="fp32", help="tensor dtype of the export")
    p.add_argument("--max-shard-size", type=float, default=2.0, metavar="GB",
                   help="cap of one safetensors file in GB (an expert's tensors stay in one file)")


def cmd_export_hf(args: argparse.Namespace) -> int:
    """User errors (a model its HF family lacks, a missing or corrupt checkpoint): one line, status 2."""
    from longctx_moe.checkpoint.errors import CheckpointError
    from longctx_moe.hf.export import export_run

    try:
        lines = export_run(args.run_dir, args.out, args.step, args.dtype, int(args.max_shard_size * 1e9))
    except (CheckpointError, ValueError) as e:  # ConfigError is a ValueError
        print(f"error: {e}", file=sys.stderr)
        return 2
    print("\n".join(lines))
    return 0


def _report_parser(sub) -> None:
    p = sub.add_parser("report", help="PNG plots of a run's metrics.jsonl (loss, grad norm, tokens/s, "
                                      "MFU, memory, expert load CV per layer)")
    p.add_argument("run_dir", help="the run directory (train.run_dir: holds metrics.jsonl)")
    p.add_argument("--out", default=None, metavar="DIR", help="write the PNGs here (default: RUN_DIR)")


def cmd_report(args: argparse.Namespace) -> int:
    from longctx_moe.report import main as report_main

    return report_main(args.run_dir, args.out)


def _train_argv(args: argparse.Namespace) -> list[str]:
    argv = ["--config", args.config]
    for item in args.overrides:
        argv += ["--set", item]
    return argv


def launch_local(nproc: int, train_argv: list[str], max_restarts: int = 0) -> int:
    """Run `python -m longctx_moe.train` on `nproc` local ranks (torchrun --standalone); when a
    rank fails, torchrun stops the others and starts all again, up to `max_restarts` times (the
    ranks resume from the latest complete checkpoint: checkpoint.resume.maybe_resume).

    Exit status: 0; 2 when the ranks stopped on a user error (rank 0 printed it); 128 + the
    signal when this launcher was stopped (its ranks are stopped with it); 1 otherwise.
    """
    from torch.distributed.elastic.multiprocessing.api import SignalException
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError
    from torch.distributed.run import get_args_parser, run

    from longctx_moe.process import LAUNCHER_PID_ENV

    launcher_args = get_args_parser().parse_args(
        ["--standalone", "--nnodes", "1", "--nproc-per-node", str(nproc), "--max-restarts", str(max_restarts),
         "--module", "longctx_moe.train",
         *train_argv])
    os.environ[LAUNCHER_PID_ENV] = str(os.getpid())  # the ranks end with this process (die_with_launcher)
    _quiet_launcher_logs()
    try:
        run(launcher_args)
    except ChildFailedError as e:
        return _report_failures(e.failures)
    except Exception as e:
        stop = _signal_behind(e, SignalException)
        if stop is None:
            raise
        print(f"error: stopped by {stop.sigval.name}; the ranks were stopped too", file=sys.stderr)
        return 128 + int(stop.sigval)
    return 0


def _signal_behind(e: BaseException, signal_exception: type) -> BaseException | None:
    """The torchrun SignalException that `e` is, or that was being handled when `e` was raised.

    torchrun's agent raises it from its signal handler wherever the main thread is; caught in a
    frame whose clean-up then fails (its metrics wrapper's `finally` reads a local the signal
    interrupted before it was set: UnboundLocalError), it surfaces as that error's context, and
    the launcher must still report the signal (the agent's own `finally` stopped the ranks)."""
    seen = set()
    while e is not None and id(e) not in seen:
        if isinstance(e, signal_exception):
            return e
        seen.add(id(e))
        e = e.__cause__ or e.__context__
    return None


def _quiet_launcher_logs() -> None:
    """torchrun's agent logs a thread-count banner and, when a rank fails, a report of its own;
    the ranks print their one-line errors and _report_failures names a rank that died otherwise."""
    for name, logger in list(logging.root.manager.loggerDict.items()):
        if isinstance(logger, logging.Logger) and name.startswith(("torch.distributed.elastic", "torch.distributed.run")):
            logger.setLevel(logging.CRITICAL)


def _report_failures(failures: dict) -> int:
    """Exit status for failed ranks ({rank: ProcessFailure}): 2 when they stopped on a user error
    (rank 0 printed it) and the others were only stopped by torchrun's SIGTERM after it."""
    codes = {f.exitcode for f in failures.values()}
    if 2 in codes and codes <= {2, -signal.SIGTERM}:
        return 2
    # The cause, rather than a rank torchrun stopped after it, or one that lost that peer (status
    # 1, train.lost_peer): a rank killed by a signal first.
    ranked = sorted(failures.items(), key=lambda rf: (rf[1].exitcode in (2, -signal.SIGTERM), rf[1].exitcode >= 0, rf[0]))
    rank, failure = ranked[0]
    how = (f"was killed by {signal.Signals(-failure.exitcode).name}" if failure.exitcode < 0
           else f"exited with status {failure.exitcode}")
    print(f"error: rank {rank} (pid {failure.pid}) {how}; see its output above", file=sys.stderr)
    return 1


def check_before_launch(args: argparse.Namespace) -> int:
    """Config and layout errors, found here once rather than by every rank: 0 or exit status 2."""
    from longctx_moe.build import check_layout
    from longctx_moe.config import ConfigError, load_config

    try:
        check_layout(load_config(args.config, args.overrides), args.nproc)
    except ConfigError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    return 0


def cmd_train(args: argparse.Namespace) -> int:
    if args.nproc < 1 or args.max_restarts < 0:
        bad = f"--nproc={args.nproc} must be >= 1" if args.nproc < 1 else f"--max-restarts={args.max_restarts} must be >= 0"
        print(f"error: {bad}", file=sys.stderr)
        return 2
    if args.nproc > 1 or args.max_restarts > 0:
        return check_before_launch(args) or launch_local(args.nproc, _train_argv(args), args.max_restarts)
    from longctx_moe.train import main as train_main

    return train_main(_train_argv(args))


def cmd_plan_groups(rest: list[str]) -> int:
    try:
        from longctx_moe.parallel.plan_groups import main as plan_main
    except ImportError as e:
        print(f"error: plan-groups is unavailable ({e}); it lives in longctx_moe.parallel.plan_groups",
              file=sys.stderr)
        return 2
    return int(plan_main(rest) or 0)


COMMANDS_GROUP = "longctx_moe.commands"


def plugin_commands() -> dict:
    """name -> entry point of the commands other installed packages register (each takes the
    arguments after its name and returns an exit code)."""
    from importlib.metadata import entry_points

    return {ep.name: ep for ep in entry_points(group=COMMANDS_GROUP)}


def _describe(ep) -> str:
    # Not loaded here: building the parser must not import every plugin (rl_hooks pulls in
    # transformers) for a `longctx-moe train`.
    return f"provided by {ep.value}; `longctx-moe {ep.name} --help` lists its options"


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv and argv[0] == "plan-groups":  # its own parser owns every flag after the name
        return cmd_plan_groups(argv[1:])
    if argv and argv[0] == "plan":
        from longctx_moe.plan.cli import main as plan_main

        return plan_main(argv[1:])
    if argv and argv[0] == "rehearse":
        from longctx_moe.rehearsal.cli import main as rehearse_main

        return rehearse_main(argv[1:])
    plugins = plugin_commands()
    if argv and argv[0] in plugins:  # each plugin's own parser owns every flag after its name
        return int(plugins[argv[0]].load()(argv[1:]) or 0)
    parser = argparse.ArgumentParser(prog="longctx-moe", description=__doc__)
    sub = parser.add_subparsers(dest="command", required=True)
    _train_parser(sub)
    _export_parser(sub)
    _report_parser(sub)
    sub.add_parser("plan-groups", help="print the process groups of a parallel layout", add_help=False)
    sub.add_parser("plan", help="the fastest parallel layouts of a model on N GPUs that fit, with memory "
                   "and step time", add_help=False)
    sub.add_parser("rehearse", help="one step of chosen ranks of an N-GPU job, on this CPU: memory, "
                   "traffic, launches, modeled time", add_help=False)
    for name, ep in sorted(plugins.items()):
        sub.add_parser(name, help=_describe(ep), add_help=False)
    args = parser.parse_args(argv)
    if args.command == "report":
        return cmd_report(args)
    return cmd_export_hf(args) if args.command == "export-hf" else cmd_train(args)


if __name__ == "__main__":
    sys.exit(main())
