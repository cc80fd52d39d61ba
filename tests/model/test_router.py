"""Router and balance-loss tests: score functions, renormalisation, top-k = E, the aux-loss-free
expert bias, the Switch and per-sequence aux losses, and the router z-loss."""

import pytest
import torch

from longctx_moe.model.attention import doc_layout
from longctx_moe.model.config import BalanceConfig
from longctx_moe.model.losses import router_z_loss, sequence_aux_loss, switch_aux_loss
from longctx_moe.model.moe import MoE, Router
from tests.model.helpers import packed_batch, tiny_config

TOL64 = 1e-12  # float64 sums of a few dozen O(1) terms


def _router(**overrides):
    torch.manual_seed(0)
    r = Router(tiny_config(**overrides))
    torch.nn.init.normal_(r.weight, std=1.0)
    return r


@pytest.mark.parametrize("score", ["softmax", "sigmoid"])
@pytest.mark.parametrize("renormalize", [True, False])
def test_router_scores_topk_and_renormalisation(score, renormalize):
    r = _router(router_score=score, router_renormalize=renormalize, num_experts=6, top_k=3)
    x = torch.randn(10, 32, dtype=torch.float64)
    idx, w, aux = r(x)
    logits = x @ r.weight.double().t()
    scores = logits.softmax(-1) if score == "softmax" else logits.sigmoid()
    ref_w, ref_idx = scores.topk(3, dim=-1)
    assert torch.equal(idx, ref_idx)
    if renormalize:
        ref_w = ref_w / ref_w.sum(-1, keepdim=True)
        torch.testing.assert_close(w.sum(-1), torch.ones(10, dtype=torch.float64), atol=TOL64, rtol=0)
    torch.testing.assert_close(w, ref_w, atol=TOL64, rtol=0)
    torch.testing.assert_close(aux.scores_TE, scores, atol=TOL64, rtol=0)


def test_router_math_is_fp32_under_autocast_and_topk_equals_e():
    r = _router(num_experts=4, top_k=4)
    x = torch.randn(6, 32)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        idx, w, aux = r(x)
    assert aux.logits_TE.dtype == torch.float32 and w.dtype == torch.float32
    assert torch.equal(idx.sort(-1).values, torch.arange(4).expand(6, 4))
    torch.testing.assert_close(w.sum(-1), torch.ones(6), atol=1e-6, rtol=0)


def test_expert_bias_affects_selection_only():
    r = _router(expert_bias=True, router_renormalize=False)
    x = torch.randn(20, 32, dtype=torch.float64)
    r.expert_bias.copy_(torch.tensor([10.0, 0, 0, 0]))  # forces expert 0 into every top-k
    idx, w, aux = r(x)
    assert (idx == 0).any(-1).all()
    torch.testing.assert_close(w, aux.scores_TE.gather(1, idx), atol=0, rtol=0)  # unbiased weights


def test_group_limited_routing_matches_transformers_deepseek_v3_with_negative_selection_scores():
    """A bias that makes kept experts' selection scores negative: they must still beat every
    expert of a dropped group (transformers masks dropped groups with -inf)."""
    transformers = pytest.importorskip("transformers")
    from transformers.models.deepseek_v3.modeling_deepseek_v3 import DeepseekV3MoE

    r = _router(num_experts=8, top_k=2, router_score="sigmoid", expert_bias=True, router_groups=4,
                router_topk_groups=1, router_renormalize=True).double()
    with torch.no_grad():
        r.expert_bias.copy_(torch.tensor([-0.9, 0.3] * 4))
    hf = DeepseekV3MoE(transformers.DeepseekV3Config(
        hidden_size=32, n_routed_experts=8, num_experts_per_tok=2, n_group=4, topk_group=1,
        norm_topk_prob=True, routed_scaling_factor=1.0, moe_intermediate_size=4)).double()
    with torch.no_grad():
        hf.gate.e_score_correction_bias.copy_(r.expert_bias)
        x = torch.randn(64, 32, dtype=torch.float64)
        idx, w, aux = r(x)
        ref_idx, ref_w = hf.route_tokens_to_experts(aux.logits_TE)
    assert (aux.scores_TE[torch.arange(64)[:, None], idx] + r.expert_bias[idx] < 0).any()  # the case at stake
    order, ref_order = idx.argsort(-1), ref_idx.argsort(-1)
    assert torch.equal(idx.gather(1, order), ref_idx.gather(1, ref_order))
    torch.testing.assert_close(w.gather(1, order), ref_w.gather(1, ref_order), atol=TOL64, rtol=0)


def test_expert_bias_updates_balance_load_on_skewed_input():
    cfg = tiny_config(expert_bias=True, num_experts=8, top_k=2)
    torch.manual_seed(0)
    moe = MoE(cfg, balance=BalanceConfig(expert_bias_update_rate=0.02, aux_loss_type="none")).double()
    for p in moe.parameters():
        torch.nn.init.normal_(p, std=0.2)
    batch = packed_batch([256], cfg.vocab_size)
    layout = doc_layout(batch)
    # Skew: every token shares a component that the router maps onto experts 0 and 1.
    x = torch.randn(256, 32, dtype=torch.float64) + 1.0 * moe.router.weight[:2].sum(0).double()
    loads = []
    for _ in range(60):
        with torch.no_grad():
            counts = moe(x, layout)[1].counts_E
        loads.append(counts.double())
        moe.router.update_bias(counts)
    cv = [c.std() / c.mean() for c in loads]
    assert loads[0][:2].sum() > 0.5 * 512  # 2 of 8 experts take most of the load at the start
    # Sign updates settle into a small oscillation around balance: judge the last 10 steps.
    assert max(cv[-10:]) < 0.4 * cv[0]
    assert max(c.max() for c in loads[-10:]) < 0.6 * loads[0].max()


def _naive_seq_aux(scores_TE, idx_TK):
    t, e = scores_TE.shape
    k = idx_TK.shape[1]
    p = scores_TE / scores_TE.sum(-1, keepdim=True)
    f = torch.stack([(idx_TK == i).sum() for i in range(e)]).double() * e / (k * t)
    return (f * p.mean(0)).sum()


@pytest.mark.parametrize("score", ["softmax", "sigmoid"])
def test_sequence_aux_loss_of_packed_row_is_sum_over_documents(score):
    r = _router(router_score=score, num_experts=6, top_k=2)
    lens = [7, 1, 12, 4]
    batch = packed_batch(lens, 64, pad_multiple=4, trailing_pad=2)
    layout = doc_layout(batch)
    x = torch.randn(batch.num_tokens, 32, dtype=torch.float64)
    idx, _, aux = r(x)
    packed = sequence_aux_loss(aux.scores_TE, idx, layout.doc_id_T, layout.num_docs)
    separate = []
    for d, (s, n) in enumerate(zip(batch.cu_seqlens_padded[:-1].tolist(), lens, strict=True)):
        i_d, _, a_d = r(x[s:s + n])
        one = sequence_aux_loss(a_d.scores_TE, i_d, torch.zeros(n, dtype=torch.long), 1)
        torch.testing.assert_close(one[0], _naive_seq_aux(a_d.scores_TE, i_d), atol=TOL64, rtol=0)
        torch.testing.assert_close(packed[d], one[0], atol=TOL64, rtol=0)
        separate.append(one[0])
    torch.testing.assert_close(packed.sum(), torch.stack(separate).sum(), atol=TOL64, rtol=0)


def test_sequence_aux_loss_skips_the_sort_on_one_device(monkeypatch):
    """Without `reduce` (one device) a packed row's doc ids are already in order and the segment
    sums run as they are; with one (CP) the ids are sorted first. Both give the same losses, and
    the model passes None on one device, so the sort must not run there."""
    r = _router(num_experts=6, top_k=2)
    layout = doc_layout(packed_batch([7, 1, 12, 4], 64, pad_multiple=4, trailing_pad=2))
    x = torch.randn(layout.doc_id_T.numel(), 32, dtype=torch.float64)
    idx, _, aux = r(x)
    sorts = []
    argsort = torch.argsort
    monkeypatch.setattr(torch, "argsort", lambda *a, **k: sorts.append(1) or argsort(*a, **k))
    fast = sequence_aux_loss(aux.scores_TE, idx, layout.doc_id_T, layout.num_docs)
    assert sorts == []
    sorted_path = sequence_aux_loss(aux.scores_TE, idx, layout.doc_id_T, layout.num_docs, lambda t: t)
    assert sorts == [1]
    # A stable sort of ids already in order keeps every row in place: the same sums, bitwise.
    assert torch.equal(fast, sorted_path)
    assert doc_layout(packed_batch([3], 8)).reduce_stats is None  # what MoE passes on one device


def test_switch_aux_loss_and_z_loss_formulas():
    r = _router(num_experts=4, top_k=2)
    x = torch.randn(9, 32, dtype=torch.float64)
    idx, _, aux = r(x)
    counts = torch.bincount(idx.flatten(), minlength=4).double()
    ref = 4 * (counts / 18 * aux.scores_TE.mean(0)).sum()
    torch.testing.assert_close(switch_aux_loss(aux.scores_TE, idx), ref, atol=TOL64, rtol=0)
    # Perfect balance gives exactly 1: uniform scores, every expert picked equally often.
    uniform = torch.full((4, 4), 0.25, dtype=torch.float64)
    even = torch.tensor([[0, 1], [2, 3], [0, 1], [2, 3]])
    assert abs(float(switch_aux_loss(uniform, even)) - 1.0) < TOL64
    ref_z = torch.logsumexp(aux.logits_TE, -1).pow(2).mean()
    torch.testing.assert_close(router_z_loss(aux.logits_TE), ref_z, atol=TOL64, rtol=0)


class _TwoPassAllReduce:
    """Simulates an all-reduce (sum) between shards run one after another: pass 1 records each
    shard's statistics in call order, pass 2 returns the sum over shards of the i-th statistic."""

    def __init__(self, shards: int):
        self.calls = [[] for _ in range(shards)]
        self.shard, self.i, self.summing = 0, 0, False

    def __call__(self, t):
        if not self.summing:
            self.calls[self.shard].append(t.clone())
            return t
        self.i += 1
        return sum(c[self.i - 1] for c in self.calls)

    def start(self, shard, summing):
        self.shard, self.i, self.summing = shard, 0, summing


def test_sharded_statistics_sum_to_the_whole_batch():
    """CP-style split of a packed row (a document spans the cut): shares sum to the global losses,
    and so do their gradients."""
    e, k = 5, 2
    torch.manual_seed(0)
    logits = torch.randn(21, e, dtype=torch.float64, requires_grad=True)
    idx = torch.topk(logits.detach(), k, dim=-1).indices
    doc = torch.tensor([0] * 6 + [1] * 9 + [-1] * 2 + [2] * 4)
    cuts = [slice(0, 10), slice(10, 21)]

    def losses(sl, red):
        lg, sc = logits[sl], logits[sl].softmax(-1)
        return torch.cat([switch_aux_loss(sc, idx[sl], red)[None],
                          sequence_aux_loss(sc, idx[sl], doc[sl], 3, red),
                          router_z_loss(lg, red)[None]])

    whole = losses(slice(None), None)
    g_whole = torch.autograd.grad(whole.sum(), logits)[0]
    red = _TwoPassAllReduce(2)
    for s, sl in enumerate(cuts):
        red.start(s, summing=False)
        losses(sl, red)
    shares = []
    for s, sl in enumerate(cuts):
        red.start(s, summing=True)
        shares.append(losses(sl, red))
    total = torch.stack(shares).sum(0)
    torch.testing.assert_close(total, whole, atol=TOL64, rtol=0)
    g_shards = torch.autograd.grad(total.sum(), logits)[0]
    torch.testing.assert_close(g_shards, g_whole, atol=TOL64, rtol=0)
