"""--split-positions: pieces of a document longer than --seq-len keep (continue) or restart their
positions; the loader's batches carry them and resume exactly."""

import numpy as np
import pytest
import torch

from data_packing.config import DataConfig
from data_packing.loader import StepLoader
from tests.data_packing.conftest import ids_corpus, run_pack

SEQ = 64


@pytest.fixture(scope="module")
def packed(tmp_path_factory):
    """The same corpus (many documents longer than SEQ) packed with both modes."""
    d = tmp_path_factory.mktemp("pos")
    src, docs = ids_corpus(d, n=120, mean=4.2, vocab=500)
    assert sum(len(x) > SEQ for x in docs) > 20
    out = {}
    for mode in ("restart", "continue"):
        out[mode] = str(d / mode)
        run_pack(out[mode], sources=[src], ids_key="ids", vocab_size=500, seq_len=SEQ, cp_size=2,
                 split_positions=mode, num_shards=2)
    return out, docs


def _epoch(path, dp_rank=0, dp_size=1):
    loader = StepLoader(DataConfig(path=path, micro_batch_tokens=2 * SEQ, global_batch_tokens=4 * SEQ,
                                   pad_multiple=4), dp_rank, dp_size)
    return loader, [loader.next_step() for _ in range(loader.steps_per_epoch)]


def _positions_by_token(steps):
    """Every real token of the epoch as (token id, position id) per document piece."""
    pieces = []
    for step in steps:
        for b in step:
            for start, n in zip(b.cu_seqlens_padded[:-1].tolist(), b.doc_lengths(), strict=True):
                pieces.append((b.tokens[start:start + n].numpy(), b.position_ids[start:start + n].numpy()))
    return pieces


def test_continue_gives_the_unsplit_documents_positions(packed):
    out, docs = packed
    _, steps = _epoch(out["continue"])
    by_doc = {}
    for tokens, pos in _positions_by_token(steps):
        # Which input document: the one whose tokens at these positions are exactly these.
        matches = [i for i, d in enumerate(docs) if len(d) > pos[-1]
                   and np.array_equal(np.asarray(d)[pos], tokens)]
        assert matches, "a piece's positions do not index its own document"
        by_doc.setdefault(matches[0], []).append(pos)
    split = [i for i, d in enumerate(docs) if len(d) > SEQ]
    for i in split:  # all pieces together: positions 0..len-1 once each, as unsplit
        got = np.sort(np.concatenate(by_doc[i]))
        assert np.array_equal(got, np.arange(len(docs[i]))), i


def test_restart_starts_every_piece_at_zero(packed):
    out, _ = packed
    _, steps = _epoch(out["restart"])
    for _, pos in _positions_by_token(steps):
        assert np.array_equal(pos, np.arange(len(pos)))
    _, cont = _epoch(out["continue"])
    assert any(pos[0] > 0 for _, pos in _positions_by_token(cont))


def test_tokens_and_labels_do_not_depend_on_the_mode(packed):
    out, _ = packed
    (_, a), (_, b) = _epoch(out["restart"]), _epoch(out["continue"])
    for sa, sb in zip(a, b, strict=True):
        for x, y in zip(sa, sb, strict=True):
            assert torch.equal(x.tokens, y.tokens) and torch.equal(x.labels, y.labels)


def test_resume_mid_epoch_keeps_stored_positions(packed):
    out, _ = packed
    _, steps = _epoch(out["continue"], 1, 2)
    first, _ = _epoch(out["continue"], 1, 2)
    first.epoch, first.step_in_epoch = 0, 3  # as if stopped after three steps
    fresh = _epoch(out["continue"], 1, 2)[0]
    fresh.load_state_dict(first.state_dict())
    for want in steps[3:]:
        got = fresh.next_step()
        assert all(torch.equal(g.position_ids, w.position_ids) and torch.equal(g.tokens, w.tokens)
                   for g, w in zip(got, want, strict=True))
