"""The trainer's state as tensors by global slice, so a checkpoint loads under any layout.

A parallelized model holds pieces of whole tensors: TP ranks keep rows or columns of the
attention and dense-MLP weights, EP ranks a range of experts along dim 0, ETP ranks a range of
each expert's hidden units. The parallelizers declare each cut on the parameter
(parallel/sharding.py); `global_slices` reads those declarations into the global slice of every
state-dict tensor this rank holds, and probes nothing else; the checkpoint
records each piece with its global shape and offsets (save.py), and any other layout reads
back the slices it needs.

Keys: `model.<state-dict name>`, and `optim.<field>.<parameter name>` for AdamW's per-parameter
state (`exp_avg`, `exp_avg_sq`: sliced like the parameter; `step`: a scalar; `master`: the fp32
master weight of a bf16 parameter, train.param_dtype=bf16). Optimizer state is
stored by the parameter's global slice, so the distributed optimizer (each replica holding a
slab of a parameter's state) writes pieces of the same keys, and any replica count reads them.
"""

from __future__ import annotations

from typing import Any

import torch

from longctx_moe.checkpoint.errors import CheckpointError
from longctx_moe.checkpoint.reader import CheckpointReader
from longctx_moe.checkpoint.save import Piece
from longctx_moe.parallel.sharding import global_slice

Slice = tuple[tuple[int, ...], tuple[int, ...]]  # (global shape, offsets of this rank's piece)


def global_slices(model: torch.nn.Module) -> dict[str, Slice]:
    """For every entry of `model.state_dict()`: its global shape and the offsets of the piece
    this rank holds, as the parallelizers declared them (sharding.global_slice)."""
    out = {}
    for name in model.state_dict():
        module_name, _, attr = name.rpartition(".")
        # The module's own tensor: state_dict() returns detached views without the declaration.
        out[name] = global_slice(getattr(model.get_submodule(module_name), attr))
    return out


def _param_names(model: torch.nn.Module) -> dict[int, str]:
    return {id(p): name for name, p in model.named_parameters()}


def optimizer_slices(model: torch.nn.Module, optimizer: Any, slices: dict[str, Slice]) -> list[tuple[torch.Tensor, str, Slice]]:
    """(tensor the optimizer updates, its parameter's name, the global slice it covers) in the
    optimizer's order: a whole parameter, or with the distributed optimizer the slab of it this
    rank updates (`optimizer.slab_of`), whose offset along the split dim adds to the parameter's."""
    names = _param_names(model)
    slab_of = getattr(optimizer, "slab_of", lambda t: None)
    param_of = getattr(optimizer, "param_of", lambda t: t)  # an fp32 master's bf16 tensor
    out = []
    for group in optimizer.param_groups:
        for t in group["params"]:
            slab = slab_of(param_of(t))
            if slab is None:
                name = names[id(param_of(t))]
                out.append((t, name, slices[name]))
                continue
            name = names[id(slab.param)]
            full, offsets = slices[name]
            offsets = tuple(o + slab.start if d == slab.dim else o for d, o in enumerate(offsets))
            out.append((t, name, (full, offsets)))
    return out


def trainer_pieces(model: torch.nn.Module, optimizer: torch.optim.Optimizer) -> dict[str, Piece]:
    """The model's and optimizer's tensors on this rank, each with its global slice."""
    slices = global_slices(model)
    pieces = {f"model.{name}": Piece(t, *slices[name]) for name, t in model.state_dict().items()}
    for tensor, name, where in optimizer_slices(model, optimizer, slices):
        if tensor.numel() == 0:  # an empty slab (a dim smaller than the replica group)
            continue
        for field, value in optimizer.state.get(tensor, {}).items():
            if not isinstance(value, torch.Tensor):
                continue
            if value.ndim == 0:
                pieces[f"optim.{field}.{name}"] = Piece(value, (), ())
            elif value.shape == tensor.shape:
                pieces[f"optim.{field}.{name}"] = Piece(value, *where)
            else:
                raise CheckpointError(f"optimizer state '{field}' of '{name}' has shape {tuple(value.shape)}, "
                                      f"neither a scalar nor the parameter's {tuple(tensor.shape)}; cannot checkpoint it")
    return pieces


def load_trainer_pieces(model: torch.nn.Module, optimizer: torch.optim.Optimizer,
                        reader: CheckpointReader) -> None:
    """Fill `model` and `optimizer` with the slices this rank holds, read from any layout."""
    slices = global_slices(model)
    own = model.state_dict()
    extra = sorted(k for k in reader.keys("model.") if k[len("model."):] not in own)
    if extra:
        raise CheckpointError(f"checkpoint '{reader.step_dir}' has an unexpected tensor '{extra[0][6:]}'; it was "
                              "written for a different model: use the matching model config or set checkpoint.resume=none")
    reader.prefetch([f for name, t in own.items() for f in reader.files_of(f"model.{name}", slices[name][1], tuple(t.shape))])
    # load_state_dict copies into the parameters: the reads need no copy of their own.
    state = {name: reader.read(f"model.{name}", *slices[name], tuple(t.shape), copy=False) for name, t in own.items()}
    model.load_state_dict(state)
    _masters_into_params(model, slices, reader)
    optimizer.load_state_dict(_optimizer_state(model, optimizer, slices, reader))


def _masters_into_params(model, slices: dict[str, Slice], reader: CheckpointReader) -> None:
    """A checkpoint of bf16 parameters resumed with fp32 ones (train.param_dtype changed): each
    fp32 parameter takes its fp32 master, so the run continues from the same weights exactly."""
    saved = set(reader.keys("optim.master."))
    with torch.no_grad():
        for name, p in model.named_parameters():
            key = f"optim.master.{name}"
            if key in saved and p.dtype != torch.bfloat16 and p.numel():
                p.copy_(reader.read(key, *slices[name], tuple(p.shape)))


def _optimizer_state(model, optimizer, slices: dict[str, Slice], reader: CheckpointReader) -> dict:
    """torch's optimizer state_dict (tensors by index) built from the checkpoint's slices."""
    param_of = getattr(optimizer, "param_of", lambda t: t)
    fields: dict[str, list[str]] = {}
    for key in reader.keys("optim."):
        field, name = key[len("optim."):].split(".", 1)
        fields.setdefault(name, []).append(field)
    state, seen = {}, set()
    for index, (tensor, name, where) in enumerate(optimizer_slices(model, optimizer, slices)):
        seen.add(name)
        if tensor.numel() == 0:
            continue
        entry = {}
        if param_of(tensor) is not tensor and "master" not in fields.get(name, []):
            # fp32 parameters saved (another train.param_dtype): they are the masters
            entry["master"] = reader.read(f"model.{name}", *where, tuple(tensor.shape))
        for field in fields.get(name, []):
            if field == "master" and param_of(tensor) is tensor:  # fp32 now: _masters_into_params
                continue
            key = f"optim.{field}.{name}"
            if reader.global_shape(key):  # exp_avg, exp_avg_sq: sliced like the tensor
                # The reader's own tensor (read once per key): the optimizer keeps it, no copy.
                entry[field] = reader.read(key, *where, tuple(tensor.shape), copy=False)
            else:  # step: a scalar
                entry[field] = reader.read(key, (), (), ())
        if entry:
            state[index] = entry
    extra = sorted(set(fields) - seen)
    if extra:
        raise CheckpointError(f"checkpoint '{reader.step_dir}' has optimizer state for '{extra[0]}', "
                              "which this model lacks; use the matching model config or set checkpoint.resume=none")
    return {"state": state, "param_groups": optimizer.state_dict()["param_groups"]}
