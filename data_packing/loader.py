"""Read a `longctx-pack` output lazily and feed cost-balanced PackedBatch micro-batches.

- `read_metadata(path)`: metadata.json of a finished output (absolute `tokenizer_file`).
- `PackedDataset(path)`: memory-mapped rows and document pieces.
- `StepLoader(cfg, dp_rank, dp_size)`: an endless iterator over optimizer steps. Each epoch the
  packed rows are shuffled by (seed, epoch); their documents, in that order, are cut into steps of
  about cfg.global_batch_tokens real tokens; `balance.balance_step` splits each step into
  dp_size x M micro-batches of at most cfg.micro_batch_tokens physical tokens. Every rank computes
  the same global plan (no communication) and keeps its own share, so the result is deterministic
  given (seed, epoch, rank) and every rank gets the same M.

Shapes in PackedBatch: T physical tokens of one micro-batch, N documents in it.
"""

from __future__ import annotations

import math
import os

import numpy as np
import torch

from data_packing import storage
from data_packing.balance import StepAssignment, balance_step, doc_cost
from data_packing.batch import IGNORE_INDEX, PackedBatch, pack_documents, pad_to
from data_packing.config import DataConfig
from data_packing.tokenizer import sha256

STATE_VERSION = 1


def read_metadata(path: str) -> dict:
    """metadata.json of a finished output; raises ValueError for a missing or unfinished one."""
    if not os.path.isdir(path):
        raise ValueError(f"no packed dataset at {path!r}; build one with `longctx-pack --output {path}`")
    meta_path = os.path.join(path, storage.METADATA)
    if not os.path.exists(meta_path):
        raise ValueError(f"{path!r} has no metadata.json, so it is not a finished longctx-pack "
                         "output (interrupted run?); rerun longctx-pack with the same --output")
    meta = storage.read_json(meta_path)
    if meta.get("format_version") not in storage.READABLE_VERSIONS:
        raise ValueError(f"{path!r} has format version {meta.get('format_version')}, this code "
                         f"reads {storage.FORMAT_VERSION}; repack it with this version of longctx-pack")
    if meta.get("tokenizer_file"):
        meta["tokenizer_file"] = os.path.abspath(os.path.join(path, meta["tokenizer_file"]))
    meta["path"] = os.path.abspath(path)
    return meta


class PackedDataset:
    """Lazy view of a packed output. Rows: len(self); document pieces: self.num_docs."""

    def __init__(self, path: str, verify_tokenizer: bool = True, verify: str = "full"):
        """verify: "full" checks every file's checksum, "sizes" its size only (storage.py)."""
        self.meta = read_metadata(path)
        if verify_tokenizer and self.meta.get("tokenizer_file"):
            self._verify_tokenizer()
        self._shards = [storage.load_shard(os.path.join(path, s), self.meta["token_dtype"],
                                           verify=verify) for s in self.meta["shards"]]
        # --split-positions continue: a piece's positions start at its offset in the document
        self.continue_positions = self.meta.get("split_positions") == "continue"
        self.has_loss_mask = bool(self.meta.get("has_loss_mask"))
        lens = [s["doc_lengths"].astype(np.int64) for s in self._shards]
        self.doc_lengths = np.concatenate(lens) if lens else np.zeros(0, np.int64)  # int64 [D]
        self._doc_shard = np.concatenate([np.full(len(x), k, np.int32) for k, x in enumerate(lens)])
        self._doc_offset = np.concatenate([np.cumsum(x) - x for x in lens])  # token offset in shard
        doc_base = np.cumsum([0] + [len(x) for x in lens])
        self.row_doc_start = np.concatenate(  # int64 [R+1]: pieces of row r are [start[r], start[r+1])
            [s["row_docs"][:-1] + doc_base[k] for k, s in enumerate(self._shards)] + [[doc_base[-1]]])
        starts = [s["doc_source"][:, 1] for s in self._shards]
        self.doc_first_position = (np.concatenate(starts) if starts and self.continue_positions
                                   else np.zeros(self.num_docs, np.int64))  # int64 [D]

    def _verify_tokenizer(self) -> None:
        with open(self.meta["tokenizer_file"], "rb") as f:
            got = sha256(f.read())
        if got != self.meta["tokenizer_sha256"]:
            raise ValueError(f"{self.meta['tokenizer_file']} differs from the tokenizer recorded in "
                             f"metadata.json (sha256 {got[:12]} vs {self.meta['tokenizer_sha256'][:12]}); "
                             "restore it or rebuild the data with longctx-pack")

    def __len__(self) -> int:
        return len(self.row_doc_start) - 1

    @property
    def num_docs(self) -> int:
        return len(self.doc_lengths)

    def doc_tokens(self, d: int) -> np.ndarray:
        """int64 [L] tokens of document piece d."""
        k, off, n = int(self._doc_shard[d]), int(self._doc_offset[d]), int(self.doc_lengths[d])
        return np.asarray(self._shards[k]["tokens"][off:off + n], dtype=np.int64)

    def doc_loss_mask(self, d: int) -> np.ndarray | None:
        """bool [L] (True = supervised) or None for corpora without chat masks."""
        if not self.has_loss_mask:
            return None
        k, off, n = int(self._doc_shard[d]), int(self._doc_offset[d]), int(self.doc_lengths[d])
        return np.asarray(self._shards[k]["loss_mask"][off:off + n]) != 0

    def row(self, i: int):
        """(tokens int64 [n], doc_lengths int64 [k], loss_mask bool [n] or None) of row i."""
        if not 0 <= i < len(self):
            raise IndexError(f"row {i} out of range for {len(self)} rows")
        docs = range(int(self.row_doc_start[i]), int(self.row_doc_start[i + 1]))
        tokens = np.concatenate([self.doc_tokens(d) for d in docs])
        mask = np.concatenate([self.doc_loss_mask(d) for d in docs]) if self.has_loss_mask else None
        return tokens, self.doc_lengths[docs.start:docs.stop].copy(), mask


def build_micro_batch(ds: PackedDataset, docs: list[int], pad_multiple: int) -> PackedBatch:
    """A PackedBatch of the given document pieces, each padded to pad_multiple (batch.pack_documents).
    A token's label is the next token of its piece where that token is a target (the chat loss
    mask), with loss weight 1 on exactly those where the packed data has a loss mask."""
    tokens, labels, positions, weights = [], [], [], []
    for d in docs:
        tok = torch.from_numpy(ds.doc_tokens(d).astype(np.int64))
        nxt = torch.ones(tok.numel(), dtype=torch.bool)
        nxt[-1] = False  # the last token of a piece has no next token inside it
        if ds.has_loss_mask:
            nxt[:-1] &= torch.from_numpy(ds.doc_loss_mask(d)[1:].astype(bool))
        lab = torch.where(nxt, tok.roll(-1), torch.full_like(tok, IGNORE_INDEX))
        tokens.append(tok)
        labels.append(lab)
        positions.append(torch.arange(tok.numel(), dtype=torch.int64) + int(ds.doc_first_position[d]))
        weights.append((lab != IGNORE_INDEX).to(torch.float32) if ds.has_loss_mask else None)
    return pack_documents(tokens, labels, pad_multiple, positions=positions, weights=weights,
                          pad_id=int(ds.meta["pad_id"]))


class StepLoader:
    """Endless iterator over optimizer steps; each step is this rank's list[PackedBatch]."""

    def __init__(self, cfg: DataConfig, dp_rank: int, dp_size: int,
                 dataset: PackedDataset | None = None, layout_multiple: int = 1):
        """`layout_multiple`: what the parallel layout needs every document padded to
        (data_packing.batch.pad_multiple); documents are padded to its lcm with the user's
        data.pad_multiple, which is read, never written."""
        if not (dp_size >= 1 and 0 <= dp_rank < dp_size):
            raise ValueError(f"dp_rank={dp_rank} must be in [0, dp_size={dp_size})")
        self.cfg, self.dp_rank, self.dp_size = cfg, dp_rank, dp_size
        self.ds = dataset if dataset is not None else PackedDataset(cfg.path, verify=cfg.verify)
        self.pad_multiple = math.lcm(cfg.pad_multiple, layout_multiple)
        self.padded = pad_to(self.ds.doc_lengths, self.pad_multiple)
        if self.ds.num_docs < dp_size:
            raise ValueError(f"{cfg.path} has {self.ds.num_docs} documents, fewer than dp_size="
                             f"{dp_size}: every rank needs one; use fewer DP ranks or more data")
        longest = int(self.padded.max())
        if longest > cfg.micro_batch_tokens:
            raise ValueError(f"{cfg.path} holds a document of {longest} tokens (padded to "
                             f"{self.pad_multiple}) > data.micro_batch_tokens={cfg.micro_batch_tokens}; "
                             f"raise data.micro_batch_tokens or repack with --seq-len <= {cfg.micro_batch_tokens}")
        self.costs = doc_cost(self.padded, cfg.cost_per_token, cfg.cost_per_token_pair)
        self.epoch, self.step_in_epoch = 0, 0
        self._plan_epoch, self._plan = -1, []
        self.last_assignment: StepAssignment | None = None

    def _doc_order(self, epoch: int) -> np.ndarray:
        """Document pieces of the epoch: rows shuffled by (seed, epoch), pieces in row order."""
        n_rows = len(self.ds)
        rows = (np.random.default_rng([self.cfg.seed, epoch]).permutation(n_rows)
                if self.cfg.shuffle else np.arange(n_rows))
        lo, hi = self.ds.row_doc_start[rows], self.ds.row_doc_start[rows + 1]
        counts = hi - lo
        return np.repeat(lo - (np.cumsum(counts) - counts), counts) + np.arange(int(counts.sum()))

    def _epoch_plan(self, epoch: int) -> list[np.ndarray]:
        """Document pieces of each step, cut near multiples of the per-step token target."""
        order = self._doc_order(epoch)
        cum = np.cumsum(self.ds.doc_lengths[order])
        n_steps = max(1, round(int(cum[-1]) / self.cfg.global_batch_tokens))
        targets = cum[-1] * np.arange(1, n_steps) / n_steps
        ends = np.searchsorted(cum, targets)  # first doc reaching the target
        before = np.where(ends > 0, cum[np.maximum(ends - 1, 0)], 0)
        ends = np.where(cum[ends] - targets <= targets - before, ends + 1, ends)
        cuts = [0] + sorted(set(ends.tolist()) - {0, len(order)}) + [len(order)]
        return self._merge_small(order, cuts)

    def _merge_small(self, order: np.ndarray, cuts: list[int]) -> list[np.ndarray]:
        """Merge a step into the next (the last into the previous) while it has too few
        documents to give each of dp_size x M micro-batches one."""
        budget, steps, i = self.cfg.micro_batch_tokens, [], 0
        bounds = list(zip(cuts[:-1], cuts[1:], strict=True))
        while i < len(bounds):
            lo, hi = bounds[i]
            while (hi - lo < self.dp_size * math.ceil(int(self.padded[order[lo:hi]].sum())
                                                      / (self.dp_size * budget))
                   or hi - lo < self.dp_size) and i + 1 < len(bounds):
                i += 1
                hi = bounds[i][1]
            steps.append(order[lo:hi])
            i += 1
        if len(steps) > 1 and len(steps[-1]) < self.dp_size:
            steps[-2:] = [np.concatenate(steps[-2:])]
        return steps

    @property
    def steps_per_epoch(self) -> int:
        return len(self._plan_for(self.epoch))

    def _plan_for(self, epoch: int) -> list[np.ndarray]:
        if self._plan_epoch != epoch:
            self._plan, self._plan_epoch = self._epoch_plan(epoch), epoch
        return self._plan

    def next_step(self) -> list[PackedBatch]:
        """This rank's micro-batches of the next optimizer step (advances epochs by itself)."""
        if self.step_in_epoch >= len(self._plan_for(self.epoch)):
            self.epoch, self.step_in_epoch = self.epoch + 1, 0
        docs = self._plan_for(self.epoch)[self.step_in_epoch]
        assign = balance_step(self.padded[docs], self.costs[docs], self.dp_size,
                              self.cfg.micro_batch_tokens)
        self.step_in_epoch += 1
        self.last_assignment = assign
        return [build_micro_batch(self.ds, docs[m].tolist(), self.pad_multiple)
                for m in assign.micro[self.dp_rank]]

    def __iter__(self):
        while True:
            yield self.next_step()

    def state_dict(self) -> dict:
        return {"version": STATE_VERSION, "epoch": self.epoch, "step_in_epoch": self.step_in_epoch,
                "seed": self.cfg.seed, "dp_size": self.dp_size, "num_docs": self.ds.num_docs,
                "global_batch_tokens": self.cfg.global_batch_tokens,
                "micro_batch_tokens": self.cfg.micro_batch_tokens}

    def load_state_dict(self, sd: dict) -> None:
        """Resume exactly where `state_dict()` was taken (same data and batch settings)."""
        mine = self.state_dict()
        for key in ("version", "seed", "dp_size", "num_docs", "global_batch_tokens", "micro_batch_tokens"):
            if sd.get(key) != mine[key]:
                raise ValueError(f"loader state has {key}={sd.get(key)} but this loader has "
                                 f"{mine[key]}; resume with the same data and data.* settings")
        self.epoch, self.step_in_epoch = int(sd["epoch"]), int(sd["step_in_epoch"])


def build_step_loader(cfg: DataConfig, dp_rank: int, dp_size: int, layout_multiple: int = 1) -> StepLoader:
    return StepLoader(cfg, dp_rank, dp_size, layout_multiple=layout_multiple)
