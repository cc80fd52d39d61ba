"""What NCCL and the GPU would refuse, checked at every op of a rehearsed step, and the bytes
every process group moves.

torch's `fake` process group returns at once and checks nothing: a host tensor passed to an
all-reduce, an all-to-all whose input and output dtypes differ, or an op that mixes a host tensor
into device work all run. On a cluster the first two fail inside NCCL and the third in the CUDA
dispatcher. `DeviceRules` is a dispatch mode that sees every aten and c10d op of the step and
refuses them the same way, in one line naming the op, the rank and the program's line:

- a collective's tensors are device tensors (NCCL takes no host memory). A collective of host
  tensors only is the program's by design when a function marked `host_collective`
  (longctx_moe.parallel.comm) issues it: it runs on gloo beside NCCL (process.py's
  "cpu:gloo,cuda:nccl"); anywhere else it is an accidental host round trip;
- one dtype per collective, input and output alike; contiguous tensors; sizes that agree with
  the group (all-gather output = input x group size, and so on);
- no op mixes a host tensor (other than a 0-dim scalar, which CUDA kernels take) with device
  tensors.

The fake group hands each rank its own input back. For the host collectives (values the
program reads: step totals, loss sums, flags) that is not what a job would return, so
`DeviceRules` answers them as a job whose ranks are alike: every peer contributes what this rank
contributes (a sum over n ranks is n times this rank's value; max, min and mean are its value;
an all-gather holds n copies). The rehearsal's job is that: each DP replica runs a micro-batch
like this rank's, and the program shares host totals evenly over the ranks that hold one.

`traffic` sums, per process group and collective, the bytes each rank sends (`payload`, the
tensor a rank contributes) and the bus bytes NCCL's ring / all-to-all algorithms move per rank
(`bus`: 2(n-1)/n x payload for an all-reduce, (n-1)/n x the gathered size for all-gather and
reduce-scatter, (n-1)/n x payload for all-to-all; the convention of nccl-tests' PERFORMANCE.md).
"""

from __future__ import annotations

import collections
import sys
from dataclasses import dataclass, field

import torch
import torch.distributed as dist
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves
from torch.utils.weak import WeakTensorKeyDictionary

from longctx_moe.kernels import LAUNCHES_PER_CALL
from longctx_moe.rehearsal.cost import is_fp8_gemm, op_flops

# the largest host tensor whose values a copy to the device keeps (document boundaries of a
# micro-batch: one entry per document)
_HOST_VALUES_MAX = 1 << 20
_PACKAGES = ("/data_packing/", "/cp_attention/", "/longctx_moe/", "/rl_hooks/")


class RehearsalFault(RuntimeError):
    """What a GPU run would fail on; the message is one line: rank, op, the program's line, why."""


@dataclass
class Traffic:
    calls: int = 0
    payload_bytes: int = 0
    bus_bytes: float = 0.0


@dataclass
class DeviceRules(TorchDispatchMode):
    """See the module docstring. `rank`: the rehearsed rank (in messages); `device`: the type of
    the tensors that stand for the GPU's ("meta"); `group_names`: ProcessGroup.group_name -> our
    name of the group (ParallelDims' axes), for the traffic table."""

    rank: int
    device: str = "meta"
    group_names: dict[str, str] = field(default_factory=dict)
    traffic: dict = field(default_factory=lambda: collections.defaultdict(Traffic))
    host_collectives: collections.Counter = field(default_factory=collections.Counter)
    launches: collections.Counter = field(default_factory=collections.Counter)
    # per group: (collective, dtype, elements) of each call in order, to compare across ranks
    calls: dict = field(default_factory=lambda: collections.defaultdict(list))
    # per device op: (FLOPs, bytes read and written, an FP8 GEMM), for the roofline of cost.py
    work: list = field(default_factory=list)
    # device tensor -> the host tensor it was copied from (small integer tensors: document
    # boundaries), so that cost.op_flops can read the lengths an attention kernel works on
    host_values: WeakTensorKeyDictionary = field(default_factory=WeakTensorKeyDictionary)
    # called with the buffers each device collective writes (memtrack's mark_comm)
    on_buffers: object = None
    # each op's checks and counts (host tensors mixed into device work, launches, FLOPs and
    # bytes for the roofline); off where only memory is wanted (the planner's probes: a quarter
    # of a rehearsal's time), collectives are checked and counted either way
    accounting: bool = True

    def __post_init__(self) -> None:
        super().__init__()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func.namespace == "c10d":
            host = self._collective(func, args)
            out = func(*args, **kwargs)
            if host:
                _as_alike_peers(func, args)
            elif self.on_buffers is not None and not func.__name__.startswith("send"):
                # the first argument is what the collective writes (a send's is what it reads)
                self.on_buffers([t for t in tree_leaves(args[0]) if isinstance(t, torch.Tensor)])
            return out
        if not self.accounting:
            return func(*args, **kwargs)
        tensors = [t for t in tree_leaves((args, kwargs)) if isinstance(t, torch.Tensor)]
        self._mixing(func, tensors)
        out = func(*args, **kwargs)
        self._keep_host_value(func, args, out)
        outs = [t for t in tree_leaves(out) if isinstance(t, torch.Tensor)]
        launches = launches_of(func, tensors, outs, self.device)
        if launches:
            ins = [t for t in tensors if t.device.type == self.device]
            self.launches[func.namespace] += launches
            unreturned = [t for t in _written_in_place(func, args, kwargs) if not any(t is o for o in outs)]
            moved = sum(_nbytes(t) for t in ins + outs + unreturned)
            self.work.append((op_flops(func, args, kwargs, out, self.host_values), moved, is_fp8_gemm(func)))
        return out

    def _keep_host_value(self, func, args, out) -> None:
        """Remember the values of a small integer host tensor copied to the device (or of such a
        copy converted to another integer dtype on the device)."""
        if func not in (torch.ops.aten._to_copy.default, torch.ops.aten.clone.default) or not args:
            return
        src = args[0]
        if not (isinstance(src, torch.Tensor) and isinstance(out, torch.Tensor) and out.device.type == self.device
                and not src.is_floating_point() and src.numel() <= _HOST_VALUES_MAX):
            return
        host = src if src.device.type == "cpu" else self.host_values.get(src)
        if host is not None:
            self.host_values[out] = host

    # ---- every op

    def _mixing(self, func, tensors: list) -> None:
        if func is torch.ops.aten.copy_.default:  # between host and device: a CUDA memcpy, allowed
            return
        on_device = any(t.device.type == self.device for t in tensors)
        host = [t for t in tensors if t.device.type == "cpu" and t.dim() > 0]
        if on_device and host:
            self._refuse(func, f"mixes a host tensor {tuple(host[0].shape)} {host[0].dtype} into device "
                               "work (a CUDA kernel refuses it: move it to the device where it is made)")

    # ---- collectives

    def _collective(self, func, args) -> bool:
        """Check and count a collective; True for a host collective (by design, on gloo)."""
        name = func.__name__.split(".")[0]
        tensors = [t for t in tree_leaves(args) if isinstance(t, torch.Tensor)]
        group = next((dist.ProcessGroup.unbox(a) for a in args if isinstance(a, torch.ScriptObject)), None)
        if name == "barrier" or not tensors:
            return False
        kinds = {t.device.type for t in tensors}
        if kinds == {"cpu"}:
            where = _host_collective_site()
            if where is None:
                self._refuse(func, "sends host tensors (NCCL takes device tensors; on gloo this is a "
                                   "host round trip per call: make them on the device, or mark the "
                                   "function longctx_moe.parallel.comm.host_collective if it is by design)")
            self.host_collectives[where] += 1
            return True
        if kinds != {self.device}:
            self._refuse(func, f"mixes {' and '.join(sorted(kinds))} tensors in one collective "
                               "(NCCL takes device tensors only)")
        dtypes = {t.dtype for t in tensors}
        if len(dtypes) > 1 and name not in ("allreduce_coalesced_",):
            self._refuse(func, f"has tensors of {len(dtypes)} dtypes ({', '.join(sorted(map(str, dtypes)))}): "
                               "NCCL moves one dtype per call")
        if any(not t.is_contiguous() for t in tensors):
            self._refuse(func, "has a non-contiguous tensor (NCCL needs contiguous buffers)")
        size = group.size() if group is not None else 1
        self._check_sizes(func, name, args, size)
        self._count(name, group, tensors, args, size)
        return False

    def _check_sizes(self, func, name: str, args, size: int) -> None:
        if name in ("_allgather_base_", "_reduce_scatter_base_"):
            out, inp = args[0], args[1]
            small, big = (inp, out) if name == "_allgather_base_" else (out, inp)
            if big.numel() != small.numel() * size:
                self._refuse(func, f"has {big.numel()} elements for {small.numel()} x {size} ranks")
        elif name == "alltoall_base_":
            out, inp, _, out_splits, in_splits = args[:5]
            for t, splits in ((out, out_splits), (inp, in_splits)):
                rows = t.shape[0] if t.dim() else 1
                if splits and (len(splits) != size or sum(splits) != rows):
                    self._refuse(func, f"splits {list(splits)[:4]}... do not cover {rows} rows over {size} ranks")
                if not splits and rows % size:
                    self._refuse(func, f"has {rows} rows, not a multiple of the {size} ranks")

    def _count(self, name: str, group, tensors, args, size: int) -> None:
        label = self.group_names.get(getattr(group, "group_name", ""), "world" if group is None else
                                     f"group {group.group_name}")
        kind = _COLLECTIVE.get(name, name)
        entry = self.traffic[(label, kind)]
        entry.calls += 1
        payload = _payload_bytes(name, args, tensors)
        elements = sum(t.numel() for t in tensors) if kind in ("send", "recv") else payload // tensors[0].element_size()
        self.calls[_sequence(label, kind, group, args)].append((_P2P.get(kind, kind), str(tensors[0].dtype), elements))
        entry.payload_bytes += payload
        entry.bus_bytes += payload * _bus_factor(name, size)

    def _refuse(self, func, why: str) -> None:
        raise RehearsalFault(f"rank {self.rank}: {func} at {program_line()} {why}")


# NCCL pairs point-to-point messages by order per (sender, receiver): a send and the peer's
# receive are entries of one sequence, compared across ranks like a group's collectives
_P2P = {"send": "p2p", "recv": "p2p"}


def _sequence(label: str, kind: str, group, args) -> str:
    """The sequence of calls a call belongs to: its group's, or for a send / receive the
    sender -> receiver pair's (group ranks)."""
    if kind not in _P2P or len(args) < 4:  # recv_any_source_ names no peer
        return label
    me, peer = group.rank(), int(args[2])
    src, dst = (me, peer) if kind == "send" else (peer, me)
    return f"{label} p2p {src}->{dst}"


def _as_alike_peers(func, args) -> None:
    """Set a host collective's result to what it gives when every peer contributes this rank's
    input (the fake group left this rank's own input, or copies of it, in place)."""
    name = func.__name__.split(".")[0]
    if name not in ("allreduce_", "allreduce_coalesced_"):
        return  # gathers: the fake group already fills every slot with this rank's input
    size, op = dist.ProcessGroup.unbox(args[1]).size(), args[2].op()
    for t in args[0]:
        if op == int(dist.ReduceOp.RedOpType.SUM):
            t.mul_(size)
        elif op == int(dist.ReduceOp.RedOpType.PRODUCT):
            t.pow_(size)


def check_agreement(calls_by_rank: dict[int, dict[str, list]]) -> None:
    """RehearsalFault where two rehearsed ranks disagree on a collective of a group they share:
    another collective, dtype or size at the same position of the group's sequence (NCCL then
    hangs or reads garbage). A group is named by its ranks (`group_names`), so peers match; a
    send and its receive meet in the sequence of their (sender, receiver) pair."""
    seen: dict[str, tuple[int, list]] = {}
    for rank, calls in sorted(calls_by_rank.items()):
        for label, seq in calls.items():
            if label not in seen:
                seen[label] = (rank, seq)
                continue
            other, ref = seen[label]
            for i, (a, b) in enumerate(zip(ref, seq, strict=False)):
                if a[:2] != b[:2]:
                    raise RehearsalFault(f"rank {rank}: call {i + 1} on {label} is {b[0]} of {b[1]} where rank "
                                         f"{other} runs {a[0]} of {a[1]} (NCCL moves one dtype per collective)")
            if len(ref) != len(seq):
                raise RehearsalFault(f"rank {rank}: {len(seq)} collectives on {label} where rank {other} runs "
                                     f"{len(ref)} (a rank would wait forever)")


class _ViewTable(dict):
    """Ops that launch no kernel (views, metadata): not counted as launches or traffic."""

    def __missing__(self, func) -> bool:
        value = bool(getattr(func, "is_view", False)) or func.__name__.split(".")[0] in ("view", "_unsafe_view", "as_strided", "detach",
                                                            "alias", "t", "transpose", "permute", "expand",
                                                            "unsqueeze", "squeeze", "slice", "select",
                                                            "split", "split_with_sizes", "unbind", "chunk",
                                                            "narrow", "reshape", "_reshape_alias",
                                                            "empty", "empty_strided", "empty_like")
        self[func] = value
        return value


_VIEWS = _ViewTable()


def launches_of(func, tensors: list, outputs: list, device: str) -> int:
    """The kernels `func` on `tensors` (its tensor arguments) giving `outputs` launches on the
    device whose tensors have type `device`: none for a view / metadata op, an op that touches no
    device tensor, or a copy between host and device memory (a memcpy, not a kernel); else one,
    or as many as an operator of several kernels runs (kernels.LAUNCHES_PER_CALL: the count sees
    each call once, through its fake implementation). A fill or an arange writes a device tensor
    with no device input and launches. The one rule for DeviceRules' launch count and for
    counts.py's table."""
    if _VIEWS[func]:
        return 0
    if not any(t.device.type == device for t in (*tensors, *outputs)):
        return 0
    base = func.__name__.split(".")[0]
    if base in ("_to_copy", "copy_") and any(t.device.type == "cpu" and t.dim() > 0 for t in tensors):
        return 0
    return LAUNCHES_PER_CALL.get(f"{func.namespace}.{base}", 1)


_COLLECTIVE = {"allreduce_": "all_reduce", "allreduce_coalesced_": "all_reduce", "alltoall_base_": "all_to_all",
               "alltoall_": "all_to_all", "_allgather_base_": "all_gather", "allgather_": "all_gather",
               "allgather_into_tensor_coalesced_": "all_gather", "_reduce_scatter_base_": "reduce_scatter",
               "reduce_scatter_": "reduce_scatter", "reduce_scatter_tensor_coalesced_": "reduce_scatter",
               "broadcast_": "broadcast", "send": "send", "recv_": "recv", "recv_any_source_": "recv"}


def _written_in_place(func, args, kwargs) -> list:
    """The tensors an op writes through its arguments (`_fused_adamw_`, `_foreach_add_`, `add_`,
    `out=`): read as inputs and written too; `_fused_adamw_` and the foreach ops return none."""
    schema = getattr(func, "_schema", None)
    if schema is None:
        return []
    written = []
    for i, a in enumerate(schema.arguments):
        if a.alias_info is None or not a.alias_info.is_write:
            continue
        value = kwargs.get(a.name) if a.kwarg_only or i >= len(args) else args[i]
        written += [t for t in tree_leaves(value) if isinstance(t, torch.Tensor)]
    return written


def _nbytes(t: torch.Tensor) -> int:
    return t.numel() * t.element_size()


def _payload_bytes(name: str, args, tensors) -> int:
    """The bytes this rank contributes: the input of gathers and all-to-alls, the reduced
    tensor of reductions (the whole input of a reduce-scatter)."""
    if name in ("_allgather_base_", "alltoall_base_", "_reduce_scatter_base_"):
        return _nbytes(args[1])
    if name in ("allgather_", "alltoall_", "reduce_scatter_", "allgather_into_tensor_coalesced_",
                "reduce_scatter_tensor_coalesced_"):
        return sum(_nbytes(t) for t in tree_leaves(args[1]) if isinstance(t, torch.Tensor))
    if name == "recv_":
        return 0
    return sum(_nbytes(t) for t in tensors)


def _bus_factor(name: str, n: int) -> float:
    if n <= 1:
        return 0.0
    kind = _COLLECTIVE.get(name, name)
    if kind == "all_reduce":
        return 2 * (n - 1) / n
    if kind == "all_gather":
        return n - 1  # (n-1)/n of the gathered size n x payload
    if kind in ("reduce_scatter", "all_to_all"):
        return (n - 1) / n
    return 1.0


# ---- where in the program


def _host_collective_site() -> str | None:
    """The program's function that issued this collective, when it is marked host_collective
    (only the innermost program frame counts: a marked function does not license the
    collectives of what it calls)."""
    from longctx_moe.parallel.comm import HOST_COLLECTIVES

    f = sys._getframe(1)
    while f is not None:
        name = f.f_code.co_filename
        if (any(p in name for p in _PACKAGES) and "/rehearsal/" not in name) or f.f_code in HOST_COLLECTIVES:
            break
        f = f.f_back
    if f is None or f.f_code not in HOST_COLLECTIVES:
        return None
    return f"{_short(f.f_code.co_filename)} ({f.f_code.co_name})"


def _short(filename: str) -> str:
    """package/file.py of a path."""
    return "/".join(filename.split("/")[-2:])


def program_line() -> str:
    """file:line (function) of the innermost frame of our packages (outside the rehearsal)."""
    f = sys._getframe(1)
    while f is not None:
        name = f.f_code.co_filename
        if any(p in name for p in _PACKAGES) and "/rehearsal/" not in name:
            return f"{_short(name)}:{f.f_lineno} ({f.f_code.co_name})"
        f = f.f_back
    return "?"
