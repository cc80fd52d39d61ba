"""Offload and onload: the device memory a PolicyTrainer holds goes to host memory and comes back.

Colocated RL (verl's hybrid engine, NeMo-RL's and slime's colocated modes) lends the trainer's
GPUs to a rollout engine between updates. What a trainer holds on its device, in three parts a
caller picks:

  params     the model's parameters and buffers; the distributed optimizer's slabs are views of
             the parameters and move with them
  grads      the gradients of the parameters and of the tensors the optimizer steps (the reduced
             slab gradients between a backward and its update)
  optimizer  the optimizer's state (AdamW's moments, a step count kept on the device) and the
             tensors it steps that are not parameters (fp32 master weights)

The move is by storage, not by tensor: each distinct device storage is copied byte for byte into
a host buffer (pinned under CUDA, so that the copies run asynchronously: all are issued, then one
synchronize) and then resized to 0 bytes. Every tensor over it (a parameter, its slab views, the
optimizer's keys and state, autograd hooks) stays the same Python object with the same shape and
strides; onload() resizes each storage back and copies its bytes in. Nothing is rebuilt or
re-registered, so training after the round trip is bitwise that without it. A storage comes back
at a new address: code that keeps raw device pointers across an offload (CUDA graphs, registered
NCCL buffers) would have to be re-captured; the trainer keeps none.

On a CPU run the device is the host: offload() and onload() move nothing and say so once; what is
marked offloaded, and the refusals, are the same as on a GPU. `Residency(moves=True)` runs the
copies anyway (into unpinned host buffers): the tests exercise the whole path on the CPU that way.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterable, Iterator

import torch
import torch.distributed as dist

from rl_hooks.export import ExportGate

PARTS = ("params", "grads", "optimizer")


@dataclasses.dataclass
class _Held:
    storage: torch.UntypedStorage  # the device storage, 0 bytes while offloaded
    host: torch.Tensor | None  # uint8 [its bytes] (None where nothing moves: a CPU run)


def _bytes(storage: torch.UntypedStorage) -> torch.Tensor:
    """The storage's bytes as a uint8 tensor over it."""
    return torch.empty(0, dtype=torch.uint8, device=storage.device).set_(storage)


def _copy(dst_B: torch.Tensor, src_B: torch.Tensor, host_B: torch.Tensor) -> None:
    """dst <- src between the device and the host buffer `host_B` (one of them), asynchronous
    where that buffer is pinned."""
    dst_B.copy_(src_B, non_blocking=host_B.is_pinned())


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _optimizers(trainer) -> list:
    """The trainer's optimizer and those it wraps (the distributed optimizer holds a torch
    optimizer over its slabs)."""
    out, opt = [], trainer.optimizer
    while opt is not None and opt not in out:
        out.append(opt)
        opt = getattr(opt, "optimizer", None)
    return out


def _stepped(trainer) -> Iterator[torch.Tensor]:
    for opt in _optimizers(trainer):
        for group in opt.param_groups:
            yield from group["params"]


def part_tensors(trainer, part: str) -> Iterator[torch.Tensor | None]:
    """The tensors of one part (see the module docstring)."""
    model = trainer.model
    if part == "params":
        yield from model.parameters()
        yield from model.buffers()
    elif part == "grads":
        yield from (p.grad for p in model.parameters())
        yield from (t.grad for t in _stepped(trainer))
        for opt in _optimizers(trainer):  # optim.offload=cpu: those its host step will read
            yield from getattr(opt, "device_grads", list)()
    elif not host_optimizer(trainer):
        yield from _stepped(trainer)
        for opt in _optimizers(trainer):
            for state in opt.state.values():
                yield from (v for v in state.values() if torch.is_tensor(v))


def host_optimizer(trainer) -> bool:
    """optim.offload=cpu: the optimizer's state is in host memory, its part has nothing here."""
    return trainer.cfg.optim.offload == "cpu"


def trainer_storages(trainer, device: torch.device) -> dict[str, list[torch.UntypedStorage]]:
    """{part: its distinct storages on `device`}, each storage in the first part of PARTS that
    reaches it (a slab is a view of its parameter: params)."""
    seen: set[int] = set()
    out: dict[str, list[torch.UntypedStorage]] = {}
    for part in PARTS:
        out[part] = []
        for t in part_tensors(trainer, part):
            if t is None or t.device.type != device.type:
                continue
            storage = t.untyped_storage()
            if storage._cdata not in seen:
                seen.add(storage._cdata)
                out[part].append(storage)
    return out


def storage_bytes(storages: Iterable[torch.UntypedStorage]) -> int:
    return sum(s.nbytes() for s in storages)


class Residency:
    """Where a Trainer's device memory is: `offload(parts)` moves parts to the host, `onload(parts)`
    brings them back, `check(update)` refuses a call that needs what is away."""

    def __init__(self, trainer, device: torch.device | str, moves: bool | None = None):
        self.trainer, self.device = trainer, torch.device(device)
        # On a CPU run the device's memory is the host's: there is nothing to move.
        self.moves = self.device.type != "cpu" if moves is None else moves
        self.held: dict[str, list[_Held]] = {}
        self._said: set[str] = set()

    def offload(self, parts: Iterable[str]) -> dict[str, int]:
        """Move `parts` (not yet away) to the host; {part: bytes moved}."""
        self._say()
        found = trainer_storages(self.trainer, self.device)
        todo = [p for p in parts if p not in self.held]
        if "optimizer" in todo and host_optimizer(self.trainer):
            self._say_once("offload: optim.offload=cpu keeps the optimizer's state in host memory; "
                           "its part has nothing on the device to move")
        # A storage that cannot be freed in place (file-backed or shared host memory; on a GPU, one
        # from outside the caching allocator) stays where it is and counts in device_bytes().
        moved = {p: [_Held(s, None) for s in found[p] if s.resizable()] for p in todo}
        if self.moves:
            pin = self.device.type == "cuda"
            for held in (h for hs in moved.values() for h in hs):
                held.host = torch.empty(held.storage.nbytes(), dtype=torch.uint8, pin_memory=pin)
                _copy(held.host, _bytes(held.storage), held.host)
            _sync(self.device)  # every copy has landed before its storage is freed
            for held in (h for hs in moved.values() for h in hs):
                held.storage.resize_(0)
        self.held.update(moved)
        return {p: sum(0 if h.host is None else h.host.numel() for h in hs) for p, hs in moved.items()}

    def onload(self, parts: Iterable[str]) -> dict[str, int]:
        """Bring `parts` back (each must be away); {part: bytes moved}."""
        parts = list(parts)
        away = [p for p in parts if p not in self.held]
        if away:
            raise RuntimeError(f"onload({', '.join(away)}): not offloaded (offloaded now: "
                               f"{', '.join(self.held) or 'nothing'}); call offload() first")
        back = {p: self.held.pop(p) for p in parts}
        for held in (h for hs in back.values() for h in hs if h.host is not None):
            held.storage.resize_(held.host.numel())
            _copy(_bytes(held.storage), held.host, held.host)
        _sync(self.device)  # the host buffers are released below
        return {p: sum(0 if h.host is None else h.host.numel() for h in hs) for p, hs in back.items()}

    def check(self, update: bool) -> None:
        """Refuse a call while what it needs is offloaded: every call reads the parameters, an
        update everything."""
        away = [p for p in self.held if update or p == "params"]
        if away:
            what = "an update" if update else "a call that reads the parameters"
            raise RuntimeError(f"{what} while the trainer's {', '.join(away)} are offloaded; call "
                               "onload() first")

    def device_bytes(self) -> int:
        """Bytes of the trainer's storages on its device now (0-byte ones while offloaded)."""
        return sum(storage_bytes(s) for s in trainer_storages(self.trainer, self.device).values())

    def _say(self) -> None:
        if not self.moves:
            self._say_once(f"offload: the trainer runs on the host ({self.device}); offload() and "
                           "onload() move nothing")

    def _say_once(self, line: str) -> None:
        if line in self._said:
            return
        self._said.add(line)
        if not dist.is_initialized() or dist.get_rank() == 0:
            print(line, flush=True)


class ResidentGate(ExportGate):
    """The policy's gate before each of its calls (ExportGate.settle: an open export is closed),
    which also refuses a call while what it needs is offloaded (`update`: the call steps the
    optimizer or adds gradients)."""

    def __init__(self, residency: Residency):
        super().__init__()
        self.residency = residency

    def settle(self, update: bool = False) -> None:
        self.residency.check(update)
        super().settle()


class Offloading:
    """PolicyTrainer's offload() and onload() (its gate is a ResidentGate)."""

    def offload(self, params: bool = True, grads: bool = True, optimizer: bool = True) -> dict[str, int]:
        """Move the trainer's device memory of the chosen parts (module docstring) to pinned host
        memory, until `onload()`; local to this rank. A part already offloaded stays so.
        {part: bytes moved}. While the parameters are away every call but onload() is refused,
        while anything is away every update."""
        ExportGate.settle(self.export_gate)  # an open export reads the parameters: close it
        chosen = (p for p, on in zip(PARTS, (params, grads, optimizer), strict=True) if on)
        return self.export_gate.residency.offload(chosen)

    def onload(self, params: bool = True, grads: bool = True, optimizer: bool = True) -> dict[str, int]:
        """Bring back what `offload()` moved (of the chosen parts; one that was not offloaded is
        refused), bitwise. {part: bytes moved}."""
        held = self.export_gate.residency.held
        chosen = [p for p, on in zip(PARTS, (params, grads, optimizer), strict=True) if on and p in held]
        if not chosen:
            raise RuntimeError("onload() without offload(): those parts are on the device "
                               f"(offloaded now: {', '.join(held) or 'nothing'}); call offload() first")
        return self.export_gate.residency.onload(chosen)

    @property
    def offloaded(self) -> tuple[str, ...]:
        """The parts offloaded now."""
        return tuple(self.export_gate.residency.held)
