"""`longctx-moe report RUN_DIR`: PNG plots of a run's metrics.jsonl.

One PNG per panel, x = optimizer step: loss (total, cross-entropy), the router's aux and z
losses, gradient norm,
tokens/s, MFU, peak memory per step, and the expert load CV of every MoE layer. A panel whose
metric the run did not record (MFU without a FLOP model, memory from runs before it was logged) is
left out with a notice. Plots are drawn on matplotlib Figures with the Agg canvas (no display, no
pyplot global state).
"""

from __future__ import annotations

import json
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import yaml

from longctx_moe.metrics import scalar_series


class ReportError(ValueError):
    """A run directory the report cannot read (one line naming the file and the fix)."""


@dataclass(frozen=True)
class Panel:
    name: str  # the PNG is report_<name>.png
    title: str
    ylabel: str
    keys: tuple[str, ...]  # series to draw; a key ending in "/" takes every per-layer series
    scale: float = 1.0
    log_y: bool = False


PANELS = (
    Panel("loss", "Training loss", "loss", ("loss", "ce_loss")),
    # the router's losses are orders of magnitude below the loss: a panel of their own
    Panel("aux_loss", "Router losses (weighted)", "loss", ("aux_loss", "z_loss")),
    Panel("grad_norm", "Gradient norm (before clipping)", "global L2 norm", ("grad_norm",), log_y=True),
    Panel("tokens_per_s", "Throughput", "tokens / s (all ranks)", ("tokens_per_s",)),
    Panel("mfu", "Model FLOPs utilisation", "MFU (%)", ("mfu",), scale=100.0),
    Panel("memory", "Peak memory per step (busiest rank)", "MiB (CPU: resident set, CUDA: allocated)",
          ("peak_memory_mb",)),
    Panel("expert_load_cv", "Expert load imbalance per MoE layer", "CV of tokens per expert",
          ("expert_load_cv/",)),
    # EP > 1 only: by expert owner, and (expert lending) as the ranks ran them
    Panel("ep_load", "Busiest EP rank per MoE layer", "rows over an even split",
          ("ep_load_max/", "ep_run_max/")),
)


def metrics_path(run_dir: Path) -> Path:
    """The run's metrics file: logging.metrics_file of its config.yaml (default metrics.jsonl)."""
    name = "metrics.jsonl"
    config = run_dir / "config.yaml"
    if config.is_file():
        # Read as plain YAML: a report must not depend on the config still validating.
        logging = (yaml.safe_load(config.read_text()) or {}).get("logging") or {}
        name = logging.get("metrics_file") or name
    return run_dir / name


def read_records(path: Path) -> list[dict[str, Any]]:
    """Every complete JSON record of `path` (a line cut short by a crash is skipped)."""
    if not path.is_file():
        raise ReportError(f"{path} not found: give the train.run_dir of a `longctx-moe train` run")
    records = []
    for line in path.read_text(errors="replace").splitlines():
        try:
            record = json.loads(line)
        except ValueError:
            continue
        if isinstance(record, dict) and isinstance(record.get("step"), int):
            records.append(record)
    if not records:
        raise ReportError(f"{path} holds no step records yet: let the run log at least one step")
    return records


def series(records: list[dict[str, Any]]) -> dict[str, tuple[list[int], list[float]]]:
    """name -> (steps, values) over the records that carry that number."""
    out: dict[str, tuple[list[int], list[float]]] = {}
    for record in records:
        for name, value in scalar_series(record).items():
            steps, values = out.setdefault(name, ([], []))
            steps.append(record["step"])
            values.append(value)
    return out


def _panel_series(panel: Panel, data: dict) -> dict[str, tuple[list[int], list[float]]]:
    picked = {}
    for key in panel.keys:
        if key.endswith("/"):
            layers = sorted((n for n in data if n.startswith(key)), key=lambda n: int(n.rsplit("_", 1)[1]))
            picked.update({n: data[n] for n in layers})
        elif key in data:
            picked[key] = data[key]
    return picked


def draw(panel: Panel, picked: dict, path: Path) -> Path:
    """One panel as a PNG at `path`."""
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure
    from matplotlib.ticker import MaxNLocator

    fig = Figure(figsize=(7, 4), dpi=100)
    FigureCanvasAgg(fig)
    ax = fig.add_subplot()
    colours = _colours(len(picked))
    for (name, (steps, values)), colour in zip(picked.items(), colours, strict=True):
        label = name.rsplit("/", 1)[-1].replace("layer_", "layer ")
        ax.plot(steps, [v * panel.scale for v in values], label=label, color=colour, linewidth=1.2)
    ax.set(title=panel.title, xlabel="step", ylabel=panel.ylabel)
    ax.xaxis.set_major_locator(MaxNLocator(integer=True))
    if panel.log_y:
        ax.set_yscale("log")
    ax.grid(alpha=0.3)
    if 1 < len(picked) <= 12:  # beyond that the colour ramp (dark = first layer) says enough
        ax.legend(fontsize=8, ncol=2 if len(picked) > 6 else 1)
    fig.tight_layout()
    fig.savefig(path)
    return path


def _colours(n: int) -> list:
    from matplotlib import colormaps

    if n <= 10:
        return [colormaps["tab10"](i) for i in range(n)]
    return [colormaps["viridis"](i / (n - 1)) for i in range(n)]


def make_report(run_dir: str | Path, out_dir: str | Path | None = None) -> tuple[list[Path], list[str]]:
    """Write the panels' PNGs for `run_dir` into `out_dir` (default: the run directory);
    return (the PNG paths, a notice per panel left out)."""
    _require_matplotlib()
    run_dir = Path(run_dir)
    data = series(read_records(metrics_path(run_dir)))
    out = Path(out_dir) if out_dir is not None else run_dir
    out.mkdir(parents=True, exist_ok=True)
    paths, notices = [], []
    for panel in PANELS:
        picked = _panel_series(panel, data)
        if not picked:
            notices.append(f"{panel.name}: not recorded by this run, no plot")
            continue
        paths.append(draw(panel, picked, out / f"report_{panel.name}.png"))
    return paths, notices


def _require_matplotlib() -> None:
    try:
        import matplotlib  # noqa: F401
    except ImportError:
        raise ReportError("longctx-moe report needs matplotlib: pip install matplotlib") from None


def main(run_dir: str, out_dir: str | None = None) -> int:
    """Prints each PNG's path; a run it cannot read is one line on stderr, status 2."""
    try:
        paths, notices = make_report(run_dir, out_dir)
    except (ReportError, OSError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    for notice in notices:
        print(f"notice: {notice}", file=sys.stderr)
    print("\n".join(str(p) for p in paths))
    return 0
