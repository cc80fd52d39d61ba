"""PackedDataset and StepLoader: layout, coverage, balance, determinism, exact resume."""

import collections
import re

import numpy as np
import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

from data_packing.balance import balance_step, doc_cost
from data_packing.batch import IGNORE_INDEX, labels_from_tokens, position_ids_from_cu
from data_packing.config import DataConfig
from data_packing.loader import PackedDataset, StepLoader, build_micro_batch, build_step_loader
from tests.data_packing.conftest import run_pack, write_jsonl
from tests.launcher import run_distributed


def _cfg(path, **kw):
    base = dict(path=path, global_batch_tokens=2048, micro_batch_tokens=512, cost_per_token=1.0,
                cost_per_token_pair=0.02, pad_multiple=4, seed=7)
    return DataConfig(**{**base, **kw})


def _doc_keys(batches, ds):
    """(input doc, start) of every document piece in the micro-batches, via token equality."""
    keys = []
    for b in batches:
        lens = b.doc_lengths()
        for start, n in zip(b.cu_seqlens_padded[:-1].tolist(), lens, strict=True):
            keys.append(tuple(b.tokens[start:start + n].tolist()))
    return keys


def test_rows_hold_the_input_documents(ids_dataset):
    path, docs = ids_dataset
    ds = PackedDataset(path)
    seen = collections.defaultdict(list)
    src = np.concatenate([s["doc_source"] for s in ds._shards])
    d = 0
    for r in range(len(ds)):
        tokens, lens, mask = ds.row(r)
        assert mask is None and tokens.dtype == np.int64 and int(lens.sum()) == len(tokens)
        assert int((-(-lens // 4) * 4).sum()) <= 256  # padded to the CP multiple, within seq_len
        for piece in np.split(tokens, np.cumsum(lens)[:-1]):
            doc, start = src[d]
            seen[int(doc)].append((int(start), piece.tolist()))
            d += 1
    assert sorted(seen) == list(range(len(docs)))
    for i, pieces in seen.items():
        assert sum((p for _, p in sorted(pieces)), []) == docs[i]


def test_micro_batch_matches_reference_helpers(ids_dataset):
    ds = PackedDataset(ids_dataset[0])
    docs = [0, 5, 17, 3]
    b = build_micro_batch(ds, docs, pad_multiple=6)
    b.validate()
    assert b.cu_seqlens.dtype == torch.int32 and b.tokens.dtype == torch.int64
    assert torch.equal(b.labels, labels_from_tokens(b.tokens, b.cu_seqlens, b.cu_seqlens_padded))
    assert torch.equal(b.position_ids, position_ids_from_cu(b.cu_seqlens, b.cu_seqlens_padded, b.num_tokens))
    assert (b.tokens[~b.real_token_mask()] == ds.meta["pad_id"]).all()
    assert b.num_tokens == sum(-(-int(ds.doc_lengths[d]) // 6) * 6 for d in docs)
    assert b.max_seqlen == max(int(ds.doc_lengths[d]) for d in docs) and b.loss_weight is None


def _run_epoch(path, dp_size, **kw):
    loaders = [StepLoader(_cfg(path, **kw), r, dp_size) for r in range(dp_size)]
    steps = []
    for _ in range(loaders[0].steps_per_epoch):
        steps.append([ld.next_step() for ld in loaders])
    return loaders, steps


def test_epoch_covers_every_piece_once_with_equal_micro_counts(ids_dataset):
    path, _ = ids_dataset
    ds = PackedDataset(path)
    loaders, steps = _run_epoch(path, 3)
    all_keys = []
    for per_rank in steps:
        counts = {len(mbs) for mbs in per_rank}
        assert len(counts) == 1  # same number of micro-batches on every rank
        for mbs in per_rank:
            for b in mbs:
                b.validate()
                assert 0 < b.num_tokens <= 512
                assert (b.cu_seqlens_padded.diff() % 4 == 0).all()
            all_keys += _doc_keys(mbs, ds)
    expected = [tuple(ds.doc_tokens(d).tolist()) for d in range(ds.num_docs)]
    assert collections.Counter(all_keys) == collections.Counter(expected)
    real = [sum(int(b.cu_seqlens[-1]) for mbs in per_rank for b in mbs) for per_rank in steps]
    assert abs(np.mean(real) - 2048) < 0.25 * 2048  # "about" global_batch_tokens per step
    assert loaders[0].epoch == 0
    loaders[0].next_step()
    assert loaders[0].epoch == 1  # epochs advance by themselves


def test_deterministic_and_reshuffled_per_epoch(ids_dataset):
    path, _ = ids_dataset
    a, b = StepLoader(_cfg(path), 1, 2), StepLoader(_cfg(path), 1, 2)
    assert np.array_equal(a._doc_order(0), b._doc_order(0))
    assert not np.array_equal(a._doc_order(0), a._doc_order(1))
    for _ in range(3):
        for x, y in zip(a.next_step(), b.next_step(), strict=True):
            assert torch.equal(x.tokens, y.tokens) and torch.equal(x.cu_seqlens_padded, y.cu_seqlens_padded)
    assert not np.array_equal(StepLoader(_cfg(path, seed=8), 1, 2)._doc_order(0), a._doc_order(0))


def test_resume_mid_epoch_equals_uninterrupted(ids_dataset):
    path, _ = ids_dataset
    ref = StepLoader(_cfg(path), 0, 2)
    n_epoch = ref.steps_per_epoch
    total = n_epoch + 3  # crosses an epoch boundary after the resume point
    ref_steps = [ref.next_step() for _ in range(total)]
    for k in (1, n_epoch - 1, n_epoch):
        first = StepLoader(_cfg(path), 0, 2)
        for _ in range(k):
            first.next_step()
        sd = first.state_dict()
        resumed = build_step_loader(_cfg(path), 0, 2)
        resumed.load_state_dict(sd)
        for want in ref_steps[k:]:
            got = resumed.next_step()
            assert len(got) == len(want)
            for x, y in zip(got, want, strict=True):
                for f in ("tokens", "labels", "cu_seqlens", "cu_seqlens_padded", "position_ids"):
                    assert torch.equal(getattr(x, f), getattr(y, f)), (k, f)
    with pytest.raises(ValueError, match="seed"):
        StepLoader(_cfg(path, seed=1), 0, 2).load_state_dict(sd)


def test_balance_on_many_documents(ids_dataset):
    path, _ = ids_dataset
    loader = StepLoader(_cfg(path, global_batch_tokens=8192, micro_batch_tokens=1024), 0, 4)
    ratios = []
    for _ in range(loader.steps_per_epoch):
        loader.next_step()
        ratios.append(loader.last_assignment.rank_max_over_mean)
    assert np.median(ratios) <= 1.05, ratios


@given(st.lists(st.integers(1, 64), min_size=1, max_size=80), st.integers(1, 4),
       st.sampled_from([64, 100]), st.sampled_from([0.0, 0.05]))
def test_balance_step_properties(sizes, dp, budget, per_pair):
    sizes = np.asarray(sizes)
    costs = doc_cost(sizes, 1.0, per_pair)
    try:
        a = balance_step(sizes, costs, dp, budget)
    except ValueError as e:  # only when there are fewer documents than micro-batches
        m = re.search(r"has (\d+) documents .* for (\d+) DP ranks x (\d+) micro-batches", str(e))
        n, ranks, per_rank = map(int, m.groups())
        assert n == len(sizes) < ranks * per_rank and ranks == dp
        assert per_rank >= -(-int(sizes.sum()) // (dp * budget))
        return
    m = len(a.micro[0])
    assert all(len(r) == m for r in a.micro)
    placed = [i for r in a.micro for mb in r for i in mb]
    assert sorted(placed) == list(range(len(sizes)))
    for r in a.micro:
        for mb in r:
            assert mb and int(sizes[mb].sum()) <= budget
    assert np.isclose(a.rank_cost.sum(), costs.sum())


def test_chat_masks_become_ignored_labels(tmp_path):
    chats = [[{"role": "system", "content": "be brief"}, {"role": "user", "content": f"q{i}"},
              {"role": "assistant", "content": f"a{i} " * (3 + i)}] for i in range(10)]
    src = write_jsonl(tmp_path / "c.jsonl", [{"messages": c} for c in chats])
    run_pack(tmp_path / "o", sources=[src], train_tokenizer=300, seq_len=128)
    ds = PackedDataset(str(tmp_path / "o"))
    b = build_micro_batch(ds, list(range(ds.num_docs)), pad_multiple=2)
    b.validate()
    mask = np.concatenate([ds.doc_loss_mask(d) for d in range(ds.num_docs)])
    real = b.real_token_mask().numpy()
    target_sup = np.zeros(b.num_tokens, bool)  # label at j is kept iff token j+1 is supervised
    phys = np.flatnonzero(real)
    target_sup[phys[:-1]] = mask[1:]
    ref = labels_from_tokens(b.tokens, b.cu_seqlens, b.cu_seqlens_padded)
    expect = torch.where(torch.from_numpy(target_sup), ref, torch.full_like(ref, IGNORE_INDEX))
    assert torch.equal(b.labels, expect)
    assert 0 < b.num_target_tokens() < int(b.cu_seqlens[-1]) - ds.num_docs
    assert torch.equal(b.loss_weight, (b.labels != IGNORE_INDEX).float())


def test_loader_errors(ids_dataset, tmp_path):
    path, _ = ids_dataset
    with pytest.raises(ValueError, match="micro_batch_tokens"):
        StepLoader(_cfg(path, micro_batch_tokens=100), 0, 1)
    with pytest.raises(ValueError, match="fewer than dp_size"):
        StepLoader(_cfg(path), 0, 10_000)
    with pytest.raises(ValueError, match="dp_rank"):
        StepLoader(_cfg(path), 2, 2)
    with pytest.raises(ValueError, match=r"data.cost_per_token=1.0 and data.cost_per_token_pair=-0.1"):
        StepLoader(_cfg(path, cost_per_token_pair=-0.1), 0, 1)
    with pytest.raises(ValueError, match="no packed dataset"):
        StepLoader(_cfg(str(tmp_path / "nothing")), 0, 1)
    with pytest.raises(ValueError, match="micro-batch would be empty"):
        balance_step(np.asarray([64, 64, 64]), np.ones(3), 2, 64)


def _distributed_loader(rank, world_size, path):
    import torch.distributed as dist

    loader = build_step_loader(_cfg(path), rank, world_size)
    mine = []
    for _ in range(loader.steps_per_epoch):
        step = loader.next_step()
        counts = [None] * world_size
        dist.all_gather_object(counts, len(step))
        assert len(set(counts)) == 1, counts
        mine += [b.tokens[s:s + n].tolist() for b in step
                 for s, n in zip(b.cu_seqlens_padded[:-1].tolist(), b.doc_lengths(), strict=True)]
    return mine


@pytest.mark.slow
def test_ranks_in_separate_processes_agree(ids_dataset):
    path, _ = ids_dataset
    per_rank = run_distributed(_distributed_loader, world_size=2, args=(path,), timeout=300)
    ds = PackedDataset(path)
    got = collections.Counter(tuple(t) for r in per_rank for t in r)
    assert got == collections.Counter(tuple(ds.doc_tokens(d).tolist()) for d in range(ds.num_docs))


def test_pair_cost_balances_attention_not_tokens():
    # One 4096-token document and 64 of 128 tokens over 2 ranks: by tokens alone the long one's
    # rank also takes 16 short ones; with the default pair cost (long: 4096 + 5202, short:
    # 128 + 5) the long one's attention outweighs all 64 short ones, so it stays alone.
    sizes = np.asarray([4096] + [128] * 64)
    cfg = DataConfig()
    by_tokens = balance_step(sizes, doc_cost(sizes, 1.0, 0.0), 2, 8192)
    by_cost = balance_step(sizes, doc_cost(sizes, cfg.cost_per_token, cfg.cost_per_token_pair), 2, 8192)
    long_rank = lambda a: next(r for r, mbs in enumerate(a.micro) if any(0 in mb for mb in mbs))
    tokens_with_long = lambda a: int(sum(sizes[mb].sum() for mb in a.micro[long_rank(a)]))
    assert tokens_with_long(by_tokens) > 4096 and tokens_with_long(by_cost) == 4096
