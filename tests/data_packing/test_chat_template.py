"""Chat records rendered with the model's Jinja chat template: token ids and the assistant mask
equal `transformers`' apply_chat_template(..., return_assistant_tokens_mask=True)."""

import json

import numpy as np
import pytest

from data_packing.loader import PackedDataset
from tests.data_packing.conftest import run_pack, write_jsonl

transformers = pytest.importorskip("transformers", reason="transformers (dev extra) is the reference")

QWEN = """{%- for message in messages %}
{%- if message['role'] not in ['system', 'user', 'assistant'] %}
{{- raise_exception('unknown role ' + message['role']) }}
{%- endif %}
{{- '<|im_start|>' + message['role'] + '\\n' }}
{%- if message['role'] == 'assistant' %}
{% generation %}{{- message['content'] + '<|im_end|>' }}{% endgeneration %}
{%- else %}
{{- message['content'] + '<|im_end|>' }}
{%- endif %}
{{- '\\n' }}
{%- endfor %}"""

LLAMA = """{{- bos_token }}
{%- for message in messages %}
{{- '<|start_header_id|>' + message['role'] + '<|end_header_id|>\\n\\n' }}
{%- if message['role'] == 'assistant' %}
{%- generation %}{{- message['content'] | trim + '<|eot_id|>' }}{%- endgeneration %}
{%- else %}
{{- message['content'] | trim + eos_token }}
{%- endif %}
{%- endfor %}"""

SPECIALS = ["<|endoftext|>", "<|pad|>", "<|im_start|>", "<|im_end|>", "<|begin_of_text|>",
            "<|start_header_id|>", "<|end_header_id|>", "<|eot_id|>"]


def _chats():
    rng = np.random.default_rng(0)
    words = ["the", "answer", "is", "λ", "数据", "  spaced ", "x=1", "\n", "done."]
    out = []
    for i in range(25):
        turns = [{"role": "system", "content": "be brief"}] if i % 3 == 0 else []
        for _ in range(1 + i % 3):
            turns.append({"role": "user", "content": " ".join(rng.choice(words, 5))})
            turns.append({"role": "assistant", "content": " ".join(rng.choice(words, 1 + i % 7))})
        out.append(turns)
    return out


@pytest.fixture(scope="module")
def hf_dir(tmp_path_factory):
    """A byte-level BPE trained here, saved as a transformers tokenizer directory (no template)."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    texts = [m["content"] for c in _chats() for m in c] * 4
    tok.train_from_iterator(texts, trainers.BpeTrainer(
        vocab_size=400, special_tokens=SPECIALS, show_progress=False,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet()))
    d = tmp_path_factory.mktemp("hf")
    hf = transformers.PreTrainedTokenizerFast(tokenizer_object=tok, bos_token="<|begin_of_text|>",
                                              eos_token="<|endoftext|>", pad_token="<|pad|>")
    hf.save_pretrained(str(d))
    return d


def _with_template(hf_dir, tmp_path, template):
    """A copy of the tokenizer directory whose tokenizer_config.json holds `template`."""
    d = tmp_path / "tok"
    d.mkdir()
    for f in hf_dir.iterdir():
        (d / f.name).write_bytes(f.read_bytes())
    cfg = json.loads((d / "tokenizer_config.json").read_text())
    cfg["chat_template"] = template
    (d / "tokenizer_config.json").write_text(json.dumps(cfg))
    return d


def _packed_docs(out):
    """{input index: (ids, mask)} of a packed output whose documents were not split."""
    ds = PackedDataset(str(out))
    got, base = {}, 0
    for shard in ds._shards:
        for j, (doc, start) in enumerate(shard["doc_source"].tolist()):
            assert start == 0
            got[doc] = (ds.doc_tokens(base + j).tolist(), ds.doc_loss_mask(base + j).astype(int).tolist())
        base += len(shard["doc_source"])
    return got


@pytest.mark.parametrize("template", [QWEN, LLAMA], ids=["qwen", "llama"])
@pytest.mark.parametrize("source", ["beside_tokenizer", "chat_template_file"])
def test_ids_and_mask_equal_apply_chat_template(hf_dir, tmp_path, template, source):
    chats = _chats()
    src = write_jsonl(tmp_path / "c.jsonl", [{"messages": c} for c in chats])
    if source == "beside_tokenizer":
        d = _with_template(hf_dir, tmp_path, template)
        kw = {}
    else:
        d = hf_dir
        (tmp_path / "t.jinja").write_text(template)
        kw = {"chat_template": str(tmp_path / "t.jinja")}
    run_pack(tmp_path / "o", sources=[src], tokenizer=str(d / "tokenizer.json"), seq_len=4096, **kw)
    got = _packed_docs(tmp_path / "o")
    hf = transformers.AutoTokenizer.from_pretrained(str(d))
    assert sorted(got) == list(range(len(chats)))
    for i, chat in enumerate(chats):
        ref = hf.apply_chat_template(chat, chat_template=template, tokenize=True, return_dict=True,
                                     return_assistant_tokens_mask=True)
        assert got[i][0] == list(ref["input_ids"]), i
        assert got[i][1] == list(ref["assistant_masks"]), i
        assert 0 < sum(got[i][1]) < len(got[i][1])


def test_rejected_conversations_are_counted_and_templates_need_generation_tags(hf_dir, tmp_path):
    chats = _chats()[:4] + [[{"role": "robot", "content": "beep"}]]
    src = write_jsonl(tmp_path / "c.jsonl", [{"messages": c} for c in chats])
    d = _with_template(hf_dir, tmp_path, QWEN)
    res = run_pack(tmp_path / "o", sources=[src], tokenizer=str(d / "tokenizer.json"), seq_len=4096)
    assert res["stats"]["docs_dropped_bad_record"] == 1 and res["stats"]["docs_packed"] == 4
    (tmp_path / "plain.jinja").write_text(QWEN.replace("{% generation %}", "").replace("{% endgeneration %}", ""))
    with pytest.raises(ValueError, match="no {% generation %} block"):
        run_pack(tmp_path / "p", sources=[src], tokenizer=str(d / "tokenizer.json"), seq_len=4096,
                 chat_template=str(tmp_path / "plain.jinja"))


def test_without_a_template_the_builtin_rendering_is_used_with_a_notice(hf_dir, tmp_path, capsys):
    src = write_jsonl(tmp_path / "c.jsonl", [{"messages": c} for c in _chats()[:3]])
    run_pack(tmp_path / "o", sources=[src], tokenizer=str(hf_dir / "tokenizer.json"), seq_len=4096)
    err = capsys.readouterr().err
    assert "notice: no chat template" in err and "<|role|>" in err
    ds = PackedDataset(str(tmp_path / "o"))
    from data_packing.tokenizer import load_tokenizer

    text = load_tokenizer(ds.meta["tokenizer_file"]).decode(ds.doc_tokens(0).tolist())
    assert text.startswith("<|system|>\n") or text.startswith("<|user|>\n")
    with pytest.raises(ValueError, match="--chat-template applies to chat records"):
        run_pack(tmp_path / "x", sources=[write_jsonl(tmp_path / "t.jsonl", [{"text": "a b"}])],
                 tokenizer=str(hf_dir / "tokenizer.json"), chat_template=str(tmp_path / "c.jsonl"))
