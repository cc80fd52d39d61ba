"""Every RNG stream a run draws from (torch, CUDA, Python, NumPy), as JSON-ready values."""

from __future__ import annotations

import base64
import random
from typing import Any

import numpy as np
import torch


def _tensor_b64(t: torch.Tensor) -> str:
    return base64.b64encode(t.numpy().tobytes()).decode()


def _b64_tensor(text: str) -> torch.Tensor:
    return torch.frombuffer(bytearray(base64.b64decode(text)), dtype=torch.uint8)


def rng_state() -> dict[str, Any]:
    """Every RNG the run draws from, as JSON-ready values (torch's states base64-encoded)."""
    kind, keys, pos, has_gauss, gauss = np.random.get_state()
    version, internal, py_gauss = random.getstate()
    state = {"torch": _tensor_b64(torch.get_rng_state()), "python": [version, list(internal), py_gauss],
             "numpy": [kind, keys.tolist(), pos, has_gauss, gauss]}
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        state["cuda"] = [_tensor_b64(s) for s in torch.cuda.get_rng_state_all()]
    return state


def set_rng_state(state: dict[str, Any]) -> None:
    torch.set_rng_state(_b64_tensor(state["torch"]))
    version, internal, py_gauss = state["python"]
    random.setstate((version, tuple(internal), py_gauss))
    kind, keys, pos, has_gauss, gauss = state["numpy"]
    np.random.set_state((kind, np.asarray(keys, dtype=np.uint32), pos, has_gauss, gauss))
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state_all([_b64_tensor(s) for s in state["cuda"]])
