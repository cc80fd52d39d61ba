"""The rehearsal's FLOP count per device op (cost.op_flops), which its modeled step time divides by
the GPU's peak: varlen attention counted from the documents' real lengths with the causal mask and
the sliding window, the experts' grouped GEMMs (torch's flop counter has no rule for them), and
the other matmuls by torch's rules. Checked against counts made by hand."""

import torch

from longctx_moe.rehearsal.collectives import DeviceRules
from longctx_moe.rehearsal.cost import _pairs

aten = torch.ops.aten


def _meta(*shape, dtype=torch.bfloat16):
    return torch.empty(*shape, device="meta", dtype=dtype)


def _brute_pairs(lq, lk, causal, left):
    n = 0
    for i in range(lq):
        last = lk - lq + i
        n += sum(1 for j in range(lk) if not causal or (j <= last and (left is None or j >= last - left)))
    return n


def test_pairs_match_a_count_of_every_query_and_key():
    for lq, lk in ((1, 1), (3, 7), (7, 7), (10, 12), (12, 10)):
        for causal, left in ((False, None), (True, None), (True, 0), (True, 2), (True, 50)):
            assert _pairs(lq, lk, causal, left) == _brute_pairs(lq, lk, causal, left), (lq, lk, causal, left)


def test_attention_is_counted_from_the_documents_on_the_host():
    """Two documents of 100 and 200 tokens, causal, 4 heads of 64: the pairs under the mask, not
    two documents of the longest length without it (torch's rule on meta: 2.7x more here)."""
    rules = DeviceRules(rank=0)
    with rules:
        cu = torch.tensor([0, 100, 300], dtype=torch.int32).to("meta")
        q, k, v = _meta(300, 4, 64), _meta(300, 4, 64), _meta(300, 4, 64)
        aten._flash_attention_forward(q, k, v, cu, cu, 200, 200, 0.0, True, False)
        aten._flash_attention_forward(q, k, v, cu, cu, 200, 200, 0.0, True, False, window_size_left=9)
    pairs = 100 * 101 // 2 + 200 * 201 // 2
    window = (10 * 11 // 2 + 90 * 10) + (10 * 11 // 2 + 190 * 10)
    assert [w[0] for w in rules.work[-2:]] == [2.0 * pairs * 4 * 128, 2.0 * window * 4 * 128]


def test_grouped_gemms_count_every_row_once():
    rules = DeviceRules(rank=0)
    offs = torch.tensor([4, 4, 10], dtype=torch.int32).to("meta")
    with rules:
        torch._grouped_mm(_meta(10, 8), _meta(3, 8, 16), offs=offs)  # rows x experts' weights
        torch._grouped_mm(_meta(8, 10).t().contiguous().t(), _meta(10, 16), offs=offs)  # weights' grad
        _meta(10, 8) @ _meta(8, 16)
    assert [w[0] for w in rules.work if w[0]] == [2.0 * 10 * 8 * 16, 2.0 * 8 * 16 * 10, 2.0 * 10 * 8 * 16]


def test_fp8_gemms_are_counted_and_timed_at_the_fp8_peak():
    from longctx_moe.rehearsal.cost import model_step_time
    from longctx_moe.rehearsal.gpus import GPUS

    rules = DeviceRules(rank=0)
    one = torch.ones((), device="meta")
    with rules:
        torch._scaled_mm(_meta(64, 32, dtype=torch.float8_e4m3fn), _meta(16, 32, dtype=torch.float8_e4m3fn).t(),
                         one, one, out_dtype=torch.bfloat16)
    flops, nbytes, fp8 = rules.work[-1]
    assert (flops, fp8) == (2.0 * 64 * 16 * 32, True)
    h100 = GPUS["h100"]
    rules.work = [(1e15, 0, True), (1e15, 0, False)]
    compute = model_step_time(0.0, None, rules, h100, {})["compute_s"]
    assert compute == 1e15 / h100.fp8_flops + 1e15 / h100.bf16_flops


def test_torch_varlen_attn_and_views():
    """torch.nn.attention.varlen's own op (what the torch_varlen backend calls) is counted from the
    documents too, with its [left, right] window; views launch nothing and move no bytes."""
    from torch.nn.attention import varlen  # noqa: F401  (registers torch_attn's ops)

    rules = DeviceRules(rank=0)
    with rules:
        cu = torch.tensor([0, 100, 300], dtype=torch.int32).to("meta")
        q = _meta(300, 4, 64)
        torch.ops.torch_attn._varlen_attn(q, q, q, cu, cu, 200, 200, True)
        before = len(rules.work)
        q.view(300, 256).t()
    assert rules.work[before - 1][0] == 2.0 * (100 * 101 // 2 + 200 * 201 // 2) * 4 * 128
    assert len(rules.work) == before and sum(rules.launches.values()) == before


def test_optim_offload_cpu_is_priced_by_its_copies_and_the_hosts_adamw():
    """One rank of a node of 8 H100s steps 1G elements on the host: 8 GB over PCIe (4 GB of fp32
    gradients down, 4 GB of fp32 weights up) at 40 GB/s, and 36 GB of host memory traffic over an
    eighth of the node's 614 GB/s (slower than the arithmetic: 1G elements on 14 cores at 0.84 G
    elements/s a core); the step waits on both."""
    from longctx_moe.rehearsal.cost import HostStep, host_optimizer_seconds, model_step_time
    from longctx_moe.rehearsal.gpus import GPUS

    h100 = GPUS["h100"]
    got = host_optimizer_seconds(HostStep(10**9, 4 * 10**9, 4 * 10**9), h100)
    assert got["pcie_s"] == 8e9 / 40e9
    assert got["host_adamw_s"] == 36e9 / (614e9 / 8) > 1e9 / (0.84e9 * 14)
    assert got["offload_s"] == got["pcie_s"] + got["host_adamw_s"]
    rules = DeviceRules(rank=0)
    rules.work = [(1e15, 0, False)]
    without = model_step_time(0.0, None, rules, h100, {})
    with_offload = model_step_time(0.0, None, rules, h100, {}, HostStep(10**9, 4 * 10**9, 4 * 10**9))
    assert without["offload_s"] == 0 and with_offload["compute_s"] == without["compute_s"]
    assert with_offload["total_s"] == without["total_s"] + got["offload_s"]


def test_the_host_step_is_read_from_the_trainers_host_optimizer():
    """host_step_of: the masters the host AdamW steps (every parameter element on one rank), their
    fp32 gradients down and the weights up in the parameters' dtype; no host step without
    optim.offload=cpu."""
    from longctx_moe.build import build_runtime
    from longctx_moe.config import load_config
    from longctx_moe.rehearsal.cost import host_step_of
    from longctx_moe.trainer import Trainer

    def trainer(*sets):
        cfg = load_config(None, ["model.vocab_size=64", "model.hidden_size=32", "model.num_layers=1",
                                 "model.num_heads=2", "model.num_kv_heads=1", "model.head_dim=16",
                                 "model.num_experts=4", "model.expert_hidden_size=16", *sets])
        return Trainer(cfg, build_runtime(cfg, None, torch.device("cpu")))

    assert host_step_of(trainer().optimizer) is None
    for dtype in ("fp32", "bf16"):
        t = trainer("optim.offload=cpu", f"train.param_dtype={dtype}", "train.autocast_dtype=bf16")
        params = list(t.model.parameters())
        step = host_step_of(t.optimizer)
        assert step.elements == sum(p.numel() for p in params) and step.grad_bytes == 4 * step.elements
        assert step.weight_bytes == sum(p.numel() * p.element_size() for p in params)
        assert (step.weight_bytes < step.grad_bytes) == (dtype == "bf16")


def test_an_op_that_writes_its_arguments_counts_those_writes():
    """`_foreach_add_` returns nothing and writes its first list: the roofline's bytes read both
    lists and write the first; `add_` returns what it writes, counted once as written."""
    rules = DeviceRules(rank=0)
    xs, ys = [_meta(100, 4) for _ in range(3)], [_meta(100, 4) for _ in range(3)]
    with rules:
        torch._foreach_add_(xs, ys)
        xs[0].add_(ys[0])
    each = 100 * 4 * 2  # bf16
    assert [w[1] for w in rules.work[-2:]] == [9 * each, 3 * each]
