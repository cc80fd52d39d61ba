"""What the bench programs share: writing the results of `--out FILE`."""

from __future__ import annotations

import json
from pathlib import Path


def write_json(path: str | None, result: dict, indent: int = 1) -> None:
    """`result` as JSON at `path`, its folder made if missing (a run of many minutes must not
    end in a missing directory); nothing when path is None."""
    if path:
        Path(path).parent.mkdir(parents=True, exist_ok=True)
        Path(path).write_text(json.dumps(result, indent=indent) + "\n")
