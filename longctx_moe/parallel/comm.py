"""Autograd-aware variable-size collectives for expert parallelism, with payload compression.

Legend: N rows (token copies) of D features; splits are host lists of row counts, one per rank.

- `all_to_all_rows(x_ND, send_splits, recv_splits, group, codec)`: rows [sum(send)] -> rows
  [sum(recv)]; backward is the reverse all-to-all of the gradient.
- `start_all_to_all_rows(...)` -> `AllToAllInFlight`, whose `wait()` gives the same rows: the
  all-to-all runs asynchronously in between, in the forward and (reversed) in the backward, so
  independent work placed between the two calls hides it (see `_StartRows`).
- `all_gather_rows(x_ND, sizes, group)`: every rank's rows concatenated in rank order; backward
  sums each rank's slice of the gradient back to its owner (a reduce-scatter done as an
  all-to-all, because the row counts differ per rank).
- `split_replicated` / `gather_replicated`: rows replicated over a group (TP peers) are split
  into one chunk per rank and put back together; the gradients follow the Megatron rule for
  replicated activations (each rank ends with the full, identical gradient).

Payload codecs (`make_codec`): "none", "bf16", "fp8". The fp8 codec sends e4m3 values with one
fp32 scale per row (s = amax(|x_row|) / 448), or per run of 128 features when the experts run
model.fp8_recipe=block (their own activation tiles: the dispatcher then hands them the received
payload itself, through a `receipt`, as their first GEMM's operand), packed into one uint8 buffer
so a single all-to-all carries both. Round-trip bound per element, s the element's row or run scale (e4m3 has 3
mantissa bits; its smallest subnormal step is 2^-9 in scaled units):

    |decode(encode(x)) - x| <= 2^-4 * |x| + 2^-10 * s        (FP8_REL_BOUND, FP8_ABS_BOUND)

Communication a rank waits for is labelled for the profiler (torch.profiler.record_function):
`comm.a2a` a synchronous all-to-all, `comm.a2a_launch` / `comm.a2a_wait` the two halves of an
asynchronous one, `comm.counts` the routing table's gather and read; bench/moe_overlap.py sums
them. Before blocking on an asynchronous one started with a `turn` (a micro-batch in flight with
another, interleave.py), the forward hands over to the other: the wait then starts after the other's
compute, which it overlapped.

Quantisation is treated as the identity in backward (straight-through); gradients travel in the
codec's `grad` codec (bf16 for the fp8 codec: e4m3 is for activations, as in DeepEP / MegaScale).

Routing counts on the host (`RoutingCounts`, `gather_route_table`): the all-to-all splits, the rows
each expert runs, the capacity's kept assignments and expert lending's plan are host ints that
depend on where the router sent the tokens. They all come from one table per MoE layer,
gathered on the device and read back with one copy (a GPU sync) by `RoutingCounts.read`, the only
place where routing's device values become host values. A rehearsal (tensors without values)
gives `parallelize` another object with the same `read`, which fills the table from an
assumption; `RouteTable` tells it what the table holds.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch.profiler import record_function

from longctx_moe.choices import check_choice
from longctx_moe.parallel.config import DISPATCH_DTYPES
from longctx_moe.parallel.interleave import Turn

# Flat collectives over one buffer: torch 2.13 renamed them (`*_single`) and deprecated the old
# names, which torch 2.11 (the GPU image) has only.
reduce_scatter_flat = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor
all_gather_flat = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor

# Code objects of the functions that issue collectives of host tensors by design (step totals in
# float64, token plans, flags): on a GPU run they go to gloo beside NCCL (process.py's
# "cpu:gloo,cuda:nccl"). A host collective anywhere else is an accident: a device-to-host copy
# and a round trip over the slow path per call.
HOST_COLLECTIVES: set = set()


def host_collective(fn):
    """Mark `fn` as issuing host collectives by design (see HOST_COLLECTIVES)."""
    HOST_COLLECTIVES.add(fn.__code__)
    return fn


FP8_MAX = 448.0  # largest finite torch.float8_e4m3fn
FP8_REL_BOUND = 2.0**-4  # half a unit in the last place of a 3-bit mantissa
FP8_ABS_BOUND = 2.0**-10  # half the subnormal step 2^-9, times the row scale


class Codec:
    """Identity codec: rows travel in their own dtype."""

    name = "none"

    def encode(self, x_ND: torch.Tensor) -> torch.Tensor:
        return x_ND.contiguous()

    def decode(self, buf: torch.Tensor, dtype: torch.dtype, dim: int) -> torch.Tensor:
        return buf.to(dtype)

    def wire_bytes_per_row(self, dim: int, dtype: torch.dtype) -> int:
        return dim * torch.empty((), dtype=dtype).element_size()

    def grad(self) -> Codec:
        return self


class BF16Codec(Codec):
    name = "bf16"

    def encode(self, x_ND):
        return x_ND.to(torch.bfloat16).contiguous()

    def wire_bytes_per_row(self, dim, dtype):
        return 2 * dim


class FP8Codec(Codec):
    """e4m3 values plus fp32 scales in one uint8 buffer: [N, D + 4] with one scale per row, or
    [N, D + 4 D / run] with one per `run` features (run 128: the activation tiles of
    model.fp8_recipe=block, so that the experts' first GEMM takes the rows as they arrive)."""

    name = "fp8"

    def __init__(self, run: int | None = None):
        self.run = run

    def _runs(self, dim: int) -> int:
        return 1 if self.run is None else dim // self.run

    def encode(self, x_ND):
        n, dim = x_ND.shape
        x32 = x_ND.to(torch.float32).reshape(n, self._runs(dim), -1)
        # tiny floor: an all-zero run gets scale > 0 and encodes as zeros.
        scale = (x32.abs().amax(dim=2, keepdim=True) / FP8_MAX).clamp_min(1e-30)
        q_ND = (x32 / scale).clamp(-FP8_MAX, FP8_MAX).to(torch.float8_e4m3fn).reshape(n, dim)
        return torch.cat([q_ND.view(torch.uint8), scale.reshape(n, -1).view(torch.uint8)], dim=1)

    def _split(self, buf, dim):
        """(e4m3 values [N, D], scales [N, runs]) of a received buffer."""
        return buf[:, :dim].contiguous().view(torch.float8_e4m3fn), buf[:, dim:].contiguous().view(torch.float32)

    def decode(self, buf, dtype, dim):
        q_ND, scale = self._split(buf, dim)
        n = q_ND.shape[0]
        return (q_ND.to(torch.float32).reshape(n, scale.shape[1], -1) * scale[:, :, None]).reshape(n, dim).to(dtype)

    def tiles(self, buf, dim):
        """The received rows as the block recipe's FP8 operand (Fp8Tiles, 1 x run tiles)."""
        from longctx_moe.kernels.fp8 import Fp8Tiles

        q_ND, scale = self._split(buf, dim)
        return Fp8Tiles(q_ND, scale, (1, self.run))

    def wire_bytes_per_row(self, dim, dtype):
        return dim + 4 * self._runs(dim)

    def grad(self):
        return BF16Codec()


def make_codec(name: str, run: int | None = None) -> Codec:
    """'none' | 'bf16' | 'fp8' -> codec; `run`: the fp8 codec's scale per that many features."""
    check_choice("parallel.dispatch_dtype", name, DISPATCH_DTYPES)
    return FP8Codec(run) if name == "fp8" else {"none": Codec, "bf16": BF16Codec}[name]()


def _a2a_raw(x_ND, send_splits, recv_splits, group, codec, receipt: list | None = None):
    buf = codec.encode(x_ND)
    out = buf.new_empty((sum(recv_splits),) + tuple(buf.shape[1:]))
    with record_function("comm.a2a"):
        dist.all_to_all_single(out, buf, recv_splits, send_splits, group=group)
    if receipt is not None:
        receipt.append(out)
    return codec.decode(out, x_ND.dtype, x_ND.shape[1])


class _AllToAllRows(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x_ND, send_splits, recv_splits, group, codec, receipt):
        ctx.meta = (send_splits, recv_splits, group, codec)
        return _a2a_raw(x_ND, send_splits, recv_splits, group, codec, receipt)

    @staticmethod
    def backward(ctx, grad_ND):
        send_splits, recv_splits, group, codec = ctx.meta
        grad = _a2a_raw(grad_ND.contiguous(), recv_splits, send_splits, group, codec.grad())
        return grad, None, None, None, None, None


def all_to_all_rows(x_ND: torch.Tensor, send_splits: list[int], recv_splits: list[int],
                    group, codec: Codec | None = None, receipt: list | None = None) -> torch.Tensor:
    """Send rows [sum(send_splits), D] in rank order; return received rows [sum(recv_splits), D].
    `receipt`: a list the received wire buffer (the codec's payload, before decoding) is appended
    to, for a consumer that reads the payload itself (the FP8 experts)."""
    return _AllToAllRows.apply(x_ND, list(send_splits), list(recv_splits), group, codec or Codec(), receipt)


class _Transfer:
    """One asynchronous all-to-all in flight: the work handle, the buffers it must keep alive
    until it completes, and how to decode what arrives."""

    def __init__(self, x_ND, send_splits, recv_splits, group, codec, turn: Turn | None = None,
                 receipt: list | None = None):
        self.send_buf, self.turn, self.receipt = codec.encode(x_ND), turn, receipt
        self.out = self.send_buf.new_empty((sum(recv_splits),) + tuple(self.send_buf.shape[1:]))
        with record_function("comm.a2a_launch"):
            self.work = dist.all_to_all_single(self.out, self.send_buf, recv_splits,
                                               send_splits, group=group, async_op=True)
        self.dtype, self.dim, self.codec = x_ND.dtype, x_ND.shape[1], codec

    def wait(self) -> torch.Tensor:
        if self.turn is not None:  # two micro-batches in flight: the other one computes meanwhile
            self.turn.hand_over()
        with record_function("comm.a2a_wait"):
            self.work.wait()
        self.send_buf = None
        if self.receipt is not None:
            self.receipt.append(self.out)
        return self.codec.decode(self.out, self.dtype, self.dim)


class _Link:
    """What the start and wait halves of one all-to-all share: its layout, and the transfer in
    flight in each direction."""

    def __init__(self, send_splits, recv_splits, group, codec, turn: Turn | None, receipt: list | None = None):
        self.send, self.recv, self.group, self.codec = send_splits, recv_splits, group, codec
        self.turn = turn  # the forward's; the backward runs one micro-batch at a time
        self.receipt = receipt  # the forward's received payload goes here (all_to_all_rows)
        self.forward: _Transfer | None = None
        self.backward: _Transfer | None = None


class _StartRows(torch.autograd.Function):
    """Forward: launch the all-to-all and return an empty token that `_WaitRows` consumes.
    Backward: wait for the reverse all-to-all that `_WaitRows.backward` launched.

    The token makes the autograd graph start -> wait, so the backward runs wait.backward
    (launch) before start.backward (wait). Between them the engine runs the ready nodes with
    higher sequence numbers first, i.e. the work the forward placed between start and wait (the
    shared expert): it hides the gradients' all-to-all as its forward hid the tokens'."""

    @staticmethod
    def forward(ctx, x_ND, link):
        ctx.link = link
        link.forward = _Transfer(x_ND, link.send, link.recv, link.group, link.codec, link.turn, link.receipt)
        return x_ND.new_empty(0)

    @staticmethod
    def backward(ctx, _grad_token):
        transfer, ctx.link.backward = ctx.link.backward, None
        return transfer.wait(), None


class _WaitRows(torch.autograd.Function):
    @staticmethod
    def forward(ctx, token, link):
        ctx.link = link
        transfer, link.forward = link.forward, None
        return transfer.wait()

    @staticmethod
    def backward(ctx, grad_MD):
        link = ctx.link
        link.backward = _Transfer(grad_MD.contiguous(), link.recv, link.send, link.group,
                                  link.codec.grad())
        return grad_MD.new_empty(0), None


class AllToAllInFlight:
    """An all-to-all of rows started by `start_all_to_all_rows`; `wait()` returns the received
    rows [sum(recv_splits), D], exactly what `all_to_all_rows` returns."""

    def __init__(self, token, link):
        self._token, self._link = token, link

    def wait(self) -> torch.Tensor:
        return _WaitRows.apply(self._token, self._link)


def start_all_to_all_rows(x_ND: torch.Tensor, send_splits: list[int], recv_splits: list[int],
                          group, codec: Codec | None = None, turn: Turn | None = None,
                          receipt: list | None = None) -> AllToAllInFlight:
    """Launch `all_to_all_rows` asynchronously; call `.wait()` on the result, once, on every
    rank of `group` before the next collective that must follow it. `turn`: this micro-batch's
    Turn when two are in flight (the forward's wait hands over first); `receipt`: as in
    all_to_all_rows, filled at the wait."""
    link = _Link(list(send_splits), list(recv_splits), group, codec or Codec(), turn, receipt)
    return AllToAllInFlight(_StartRows.apply(x_ND, link), link)


def _all_gather_raw(x_ND, sizes, group):
    # dist.all_gather needs equal shapes: pad every rank's rows to the largest count.
    padded = x_ND.new_zeros((max(sizes),) + tuple(x_ND.shape[1:]))
    padded[: x_ND.shape[0]] = x_ND
    parts = [torch.empty_like(padded) for _ in sizes]
    dist.all_gather(parts, padded, group=group)
    return torch.cat([p[:n] for p, n in zip(parts, sizes, strict=True)])


class _AllGatherRows(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x_ND, sizes, rank, group):
        ctx.meta = (sizes, rank, group)
        return _all_gather_raw(x_ND, sizes, group)

    @staticmethod
    def backward(ctx, grad_MD):
        sizes, rank, group = ctx.meta
        n = sizes[rank]
        # Slice r of the gradient belongs to rank r: send it there and sum what arrives.
        recv = _a2a_raw(grad_MD.contiguous(), sizes, [n] * len(sizes), group, Codec())
        return recv.view(len(sizes), n, *grad_MD.shape[1:]).sum(0), None, None, None


def all_gather_rows(x_ND: torch.Tensor, sizes: list[int], group) -> torch.Tensor:
    """Concatenate every rank's rows ([sizes[r], ...] on rank r) in rank order; autograd-aware."""
    return _AllGatherRows.apply(x_ND, list(sizes), dist.get_rank(group), group)


class _SplitRows(torch.autograd.Function):
    """Forward: this rank's chunk of rows replicated over `group`. Backward: the full gradient,
    assembled from every rank's chunk (the input is replicated, so each rank needs all of it)."""

    @staticmethod
    def forward(ctx, x_TD, sizes, rank, group):
        ctx.meta = (sizes, group)
        start = sum(sizes[:rank])
        return x_TD[start:start + sizes[rank]].clone()

    @staticmethod
    def backward(ctx, grad_ND):
        sizes, group = ctx.meta
        return _all_gather_raw(grad_ND.contiguous(), sizes, group), None, None, None


class _GatherReplicatedRows(torch.autograd.Function):
    """Forward: all ranks' chunks concatenated (the result is replicated over `group`).
    Backward: this rank's slice of the gradient, which is the same on every rank of the group."""

    @staticmethod
    def forward(ctx, x_ND, sizes, rank, group):
        ctx.meta = (sizes, rank)
        return _all_gather_raw(x_ND, sizes, group)

    @staticmethod
    def backward(ctx, grad_TD):
        sizes, rank = ctx.meta
        start = sum(sizes[:rank])
        return grad_TD[start:start + sizes[rank]], None, None, None


class _SumOverGroup(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, group):
        out = x.contiguous().clone()
        dist.all_reduce(out, group=group)
        return out

    @staticmethod
    def backward(ctx, grad):
        return grad, None


def sum_over_group(x: torch.Tensor, group) -> torch.Tensor:
    """All-reduce (sum) of `x` over `group`; backward: the identity. Right where each rank holds
    a part whose gradient is complete on every rank already: a row-parallel layer's partial
    output (every TP rank then runs the same function of the sum), or a rank's share of a loss
    that depends on its own rows only (d sum / d share = 1)."""
    return _SumOverGroup.apply(x, group)


def chunk_sizes(n: int, parts: int) -> list[int]:
    """Row counts of `parts` near-equal contiguous chunks of `n` rows (earlier chunks larger)."""
    return [n // parts + (1 if i < n % parts else 0) for i in range(parts)]


def split_replicated(x_TD: torch.Tensor, group) -> torch.Tensor:
    """This rank's contiguous chunk of rows that are replicated over `group` (e.g. TP peers)."""
    sizes = chunk_sizes(x_TD.shape[0], dist.get_world_size(group))
    return _SplitRows.apply(x_TD, sizes, dist.get_rank(group), group)


def gather_replicated(x_ND: torch.Tensor, total: int, group) -> torch.Tensor:
    """Inverse of `split_replicated`: every chunk concatenated, replicated over `group`."""
    sizes = chunk_sizes(total, dist.get_world_size(group))
    return _GatherReplicatedRows.apply(x_ND, sizes, dist.get_rank(group), group)


@dataclass(frozen=True)
class RouteTable:
    """What a routing table holds, all known on the host before its values are.

    The table, int64 [P, R, E + 1]: for each ETP peer p (P = 1 without ETP) and each rank r of
    that peer's EP group (R = 1 without EP), the (token, expert) assignments r kept for each of
    the E experts, then r's token count. Each rank has T tokens and T * K assignments, of which
    at most `capacity` per expert are kept (all of them when it is None)."""

    num_experts: int  # E
    tokens: int  # T of the rank that reads the table
    top_k: int  # K
    capacity: int | None = None  # kept assignments per expert from one rank (None: dropless)


class RoutingCounts:
    """Turns routing's device counts into host values: the one place in the program that does.

    The dispatchers size everything that depends on routing (all-to-all splits, rows per
    expert, capacity drops, lending plans) from what `read` returns, at most once per MoE layer
    and forward. To run the dispatchers without device values (a rehearsal on meta tensors),
    pass `parallelize(..., counts=...)` an object whose `read` returns a table of the same shape
    from an assumption; `spec` says what the table holds."""

    def read(self, table: torch.Tensor, spec: RouteTable) -> torch.Tensor:
        """`table` (int64 [P, R, E + 1], on the device) on the host: one device-to-host copy,
        which on a GPU waits for every kernel queued before it (a sync)."""
        with record_function("comm.counts"):
            return table.cpu()


def gather_route_table(row_E1: torch.Tensor, ep_group=None, etp_group=None) -> torch.Tensor:
    """Every rank's row (int64 [E + 1]: kept assignments per expert, then tokens) as the
    RouteTable [P, R, E + 1], on the row's device: gathered over the EP group, then the EP
    tables over the ETP group (a missing group gives a dimension of 1). Collectives on the
    device (NCCL needs GPU tensors); nothing is read back here."""
    with record_function("comm.counts"):
        return _stacked_over(_stacked_over(row_E1, ep_group), etp_group)


def _stacked_over(t: torch.Tensor, group) -> torch.Tensor:
    """[G, *t.shape]: every rank of `group`'s t in rank order ([1, ...] for no group)."""
    if group is None:
        return t[None]
    out = t.new_empty((dist.get_world_size(group), *t.shape))
    all_gather_flat(out.view(-1), t.reshape(-1), group=group)  # flat: gloo takes no stacked form
    return out


def gather_to_host(t: torch.Tensor, group) -> torch.Tensor:
    """Every rank's `t` (same shape on all), stacked in rank order [P, ...] on the host; the
    collective runs on t's device (NCCL needs GPU tensors). Not for routing counts (those go
    through RoutingCounts)."""
    parts = [torch.empty_like(t) for _ in range(dist.get_world_size(group))]
    dist.all_gather(parts, t.contiguous(), group=group)
    return torch.stack(parts).cpu()


def gather_sizes(n: int, group, device: torch.device | str = "cpu") -> list[int]:
    """Every rank's host int `n`, in rank order (collective on `device`)."""
    return gather_to_host(torch.tensor(n, dtype=torch.int64, device=device), group).tolist()
