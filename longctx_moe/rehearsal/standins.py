"""Stand-ins (prototype) that carry one step on meta past each place the program fails there.

Each replaces, for the `with` block only, one program function or torch entry point with what a
seam would provide: the values a GPU computes and the host reads back (routing counts, segment
bounds), or the choice a CUDA device makes that the meta device answers differently. They are
the evidence for /work/notes/rehearsal_findings.md, not the design: the program should route
each of these through one seam of its own.

    with standins(tokens_per_expert="balanced"):
        run_micro_batch(runtime, meta_batch(batch, keep_host=True))

`host_reads` counts, by program file:line, every value read from a meta tensor to the host
(returned as zeros): the host syncs of the step.
"""

from __future__ import annotations

import collections
import contextlib
import dataclasses
import sys
from collections.abc import Iterator
from unittest import mock

import torch

host_reads: collections.Counter = collections.Counter()
_PACKAGES = ("/data_packing/", "/cp_attention/", "/longctx_moe/", "/rl_hooks/")


def _caller() -> str:
    f = sys._getframe(2)
    while f is not None:
        name = f.f_code.co_filename
        if any(p in name for p in _PACKAGES) and "/rehearsal/" not in name:
            return f"{name.rsplit('/', 2)[-2]}/{name.rsplit('/', 1)[-1]}:{f.f_lineno} ({f.f_code.co_name})"
        f = f.f_back
    return "?"


def _balanced(n: int, ranks: int, local: int) -> torch.Tensor:
    """int64 [ranks, local]: n assignments spread evenly over every expert."""
    flat = torch.full((ranks * local,), n // (ranks * local), dtype=torch.long)
    flat[: n % (ranks * local)] += 1
    return flat.view(ranks, local)


@contextlib.contextmanager
def standins(tokens_per_expert: str = "balanced") -> Iterator[None]:
    if tokens_per_expert != "balanced":
        raise ValueError(f"tokens_per_expert={tokens_per_expert!r}: the prototype has 'balanced' only")
    with contextlib.ExitStack() as stack:
        for target, name, value in _replacements():
            stack.enter_context(mock.patch.object(target, name, value))
        yield


def _replacements():
    import longctx_moe.model.attention as attention
    import longctx_moe.model.grouped_gemm as grouped_gemm
    import longctx_moe.model.layers as layers
    import longctx_moe.model.transformer as transformer
    import longctx_moe.parallel.comm as comm
    import longctx_moe.parallel.context_parallel as context_parallel
    import longctx_moe.parallel.dispatch as dispatch
    import longctx_moe.parallel.runtime as runtime
    from cp_attention.kernels import _registry, torch_varlen
    from data_packing.batch import PackedBatch

    layout = _doc_layout_on_host(attention.doc_layout)
    split = _split_table(dispatch.AllToAllDispatcher._split_table)
    gather = _gather_to_host(comm.gather_to_host)
    resolve = _cuda_auto(_registry.resolve_backend, _registry._auto_cuda)
    out = [(m, "doc_layout", layout) for m in (attention, transformer, runtime, context_parallel)]
    out += [
        (PackedBatch, "to", _to_keeping_bounds(PackedBatch.to)),
        (layers, "_autocast_of", _no_meta_autocast(layers._autocast_of)),
        (torch, "autocast", _autocast_off_on_meta(torch.autocast)),
        (torch_varlen, "unavailable_reason", _on_meta(torch_varlen.unavailable_reason, None)),
        (_registry, "resolve_backend", resolve),
        (grouped_gemm, "grouped_mm_works", _grouped_mm_on_meta(grouped_gemm.grouped_mm_works)),
        (torch, "bincount", _bincount(torch.bincount)),
        (dispatch, "_check_inputs", _skip_on_meta(dispatch._check_inputs)),
        (dispatch.AllToAllDispatcher, "_split_table", split),
        (comm, "gather_to_host", gather), (dispatch, "gather_to_host", gather),
    ]
    import cp_attention.kernels as kernels

    out.append((kernels, "resolve_backend", resolve))
    for name in ("cpu", "tolist", "item", "__bool__", "__int__", "__float__", "__index__"):
        out.append((torch.Tensor, name, _host_read(getattr(torch.Tensor, name), name)))
    import torch.fx.experimental._config as fx_config

    out.append((fx_config, "meta_nonzero_assume_all_nonzero", True))  # masks: every token real
    return out


# ---- document bounds: read on the host, where the loader made them


def _to_keeping_bounds(orig):
    def to(self, device):
        moved = orig(self, device)
        if torch.device(device).type != "meta":
            return moved
        return dataclasses.replace(moved, cu_seqlens=self.cu_seqlens, cu_seqlens_padded=self.cu_seqlens_padded)
    return to


def _doc_layout_on_host(orig):
    def doc_layout(batch, **kw):
        if not batch.tokens.is_meta or batch.cu_seqlens.is_meta:
            return orig(batch, **kw)
        t = batch.num_tokens
        zeros = torch.zeros(t, dtype=torch.long)
        host = dataclasses.replace(batch, tokens=zeros, labels=zeros, position_ids=zeros)
        lay = orig(host, **kw)
        meta = lambda x: x if x is None or x.is_meta else x.to("meta")  # noqa: E731
        return dataclasses.replace(lay, position_ids_T=batch.position_ids, cu_attn_S=meta(lay.cu_attn_S),
                                   doc_id_T=meta(lay.doc_id_T), real_mask_T=meta(lay.real_mask_T))
    return doc_layout


# ---- the choices a CUDA device makes, asked of meta tensors


def _no_meta_autocast(orig):
    return lambda dtype, kind: dtype if kind == "meta" else orig(dtype, kind)


def _autocast_off_on_meta(real):
    def autocast(device_type, *args, **kwargs):
        return contextlib.nullcontext() if device_type == "meta" else real(device_type, *args, **kwargs)
    return autocast


def _on_meta(orig, value):
    return lambda device: value if torch.device(device).type == "meta" else orig(device)


def _cuda_auto(orig, auto_cuda):
    def resolve_backend(name, device, dtype=None):
        device = torch.device(device)
        if device.type == "meta" and name == "auto":
            return auto_cuda(device, dtype)
        return orig(name, device, dtype)
    return resolve_backend


def _grouped_mm_on_meta(orig):
    return lambda kind, dtype: dtype in (torch.float32, torch.bfloat16) if kind == "meta" else orig(kind, dtype)


# ---- routing: the counts a GPU computes and the host reads, from an assumption


def _bincount(orig):
    def bincount(x, weights=None, minlength=0):
        if x.is_meta:  # shape [minlength] holds when every value < minlength (counts per expert)
            return torch.zeros(minlength, dtype=torch.long, device="meta")
        return orig(x, weights, minlength)
    return bincount


def _skip_on_meta(orig):
    return lambda x, idx, w, e: None if idx.is_meta else orig(x, idx, w, e)


_rows_per_local: dict[str, torch.Tensor] = {}


def _split_table(orig):
    def split_table(self, routing):
        if not routing.expert_N.is_meta:
            return orig(self, routing)
        send = _balanced(routing.expert_N.numel(), self.ep_size, self.local_experts)
        _rows_per_local["last"] = send.sum(0)  # every peer routes like this rank
        return send, send.clone()
    return split_table


def _gather_to_host(orig):
    def gather_to_host(t, group):
        if not t.is_meta:
            return orig(t, group)
        peers = torch.distributed.get_world_size(group)
        rows = _rows_per_local.get("last")
        if rows is not None and t.dtype == torch.int64 and t.shape == rows.shape:
            return rows.expand(peers, -1).clone()
        host_reads[(_caller(), "gather_to_host (no assumption)")] += 1
        return torch.zeros((peers, *t.shape), dtype=t.dtype)
    return gather_to_host


def _host_read(orig, name):
    zeros = lambda t: torch.zeros(t.shape, dtype=t.dtype)  # noqa: E731
    make = {"cpu": lambda t, *a, **k: zeros(t), "tolist": lambda t: zeros(t).tolist(),
            "item": lambda t: zeros(t).item(), "__bool__": lambda t: False, "__int__": lambda t: 0,
            "__float__": lambda t: 0.0, "__index__": lambda t: 0}[name]

    def read(self, *args, **kwargs):
        if not self.is_meta:
            return orig(self, *args, **kwargs)
        host_reads[(_caller(), name)] += 1
        return make(self, *args, **kwargs)
    return read
