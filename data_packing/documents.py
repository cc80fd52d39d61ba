"""Turn raw records into token arrays (and chat loss masks), counting every record that is dropped.

Record kinds (see `sources.Corpus.kind`):
- "text": str, or bytes that must be valid UTF-8 (the stdlib source reads files as bytes);
- "ids": a list of token ids in [0, vocab_size);
- "chat": a list of {"role": str, "content": str} messages, rendered with the model's chat template
  (`chat_template.py`: loss on the tokens the template marks as generated) or, without one, as
  "<|role|>\\n" + content + "\\n" per message, where only the content (and its newline) of
  assistant messages carries a loss: mask 1 there, 0 elsewhere (role headers, user and system
  turns).

Dropped records are counted by reason (DROP_REASONS) so that
docs_in == docs_packed + sum(dropped) always holds, and the first few input indices of each
reason are kept (`Tokenized.first_dropped`) so a warning can point at them. With `strict`, a
record of a STRICT_REASONS kind (input that is broken, not merely empty) raises ValueError.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Iterator
from dataclasses import dataclass, field

import numpy as np

from data_packing.jsonl import Unreadable
from data_packing.tokenizer import encode_texts

DROP_REASONS = ("empty", "invalid_utf8", "missing_value", "bad_record", "malformed", "decode")
STRICT_REASONS = ("invalid_utf8", "bad_record", "malformed", "decode")
DROP_WHY = {"empty": "no tokens", "invalid_utf8": "invalid UTF-8", "bad_record": "wrong type or shape",
            "malformed": "not valid JSON", "decode": "a line that is not UTF-8"}
FIRST_DROPPED = 5  # input indices kept per reason


@dataclass
class Tokenized:
    """Good documents of one chunk, in input order. tokens: int32 [L] each; masks: uint8 [L] each
    (chat corpora only)."""

    index: list[int] = field(default_factory=list)
    tokens: list[np.ndarray] = field(default_factory=list)
    masks: list[np.ndarray] | None = None
    dropped: Counter = field(default_factory=Counter)
    first_dropped: dict[str, list[int]] = field(default_factory=dict)  # reason -> input indices
    strict: bool = False

    def drop(self, reason: str, index: int) -> None:
        """Count input record `index` as dropped for `reason` (or, strict, refuse it)."""
        if self.strict and reason in STRICT_REASONS:
            raise ValueError(f"input record {index + 1} is {DROP_WHY[reason]} ({reason}) and --strict is "
                             "set; fix the input, or leave out --strict to skip and count such records")
        self.dropped[reason] += 1
        first = self.first_dropped.setdefault(reason, [])
        if len(first) < FIRST_DROPPED:
            first.append(index)


def _as_text(value) -> tuple[str | None, str | None]:
    """(text, None) or (None, drop reason)."""
    if value is None:
        return None, "missing_value"
    if isinstance(value, Unreadable):
        return None, value.reason
    if isinstance(value, bytes):
        try:
            value = value.decode("utf-8")
        except UnicodeDecodeError:
            return None, "invalid_utf8"
    if not isinstance(value, str):
        return None, "bad_record"
    return (value, None) if value else (None, "empty")


def _chat_segments(value) -> tuple[list[tuple[str, int]] | None, str | None]:
    """[(text, supervised)] for one chat record, or (None, drop reason)."""
    if value is None:
        return None, "missing_value"
    if isinstance(value, Unreadable):
        return None, value.reason
    if not isinstance(value, list) or not all(
            isinstance(m, dict) and isinstance(m.get("role"), str) and isinstance(m.get("content"), str)
            for m in value):
        return None, "bad_record"
    segs = []
    for m in value:
        segs.append((f"<|{m['role']}|>\n", 0))
        segs.append((m["content"] + "\n", int(m["role"] == "assistant")))
    return (segs, None) if segs else (None, "empty")


def render_chat(value) -> str | None:
    segs, _ = _chat_segments(value)
    return None if segs is None else "".join(s for s, _ in segs)


def _finish(out: Tokenized, i: int, ids: np.ndarray, mask: np.ndarray | None, eos_id: int | None):
    if ids.size == 0:
        out.drop("empty", i)
        return
    if eos_id is not None:
        ids = np.append(ids, np.int32(eos_id))
        mask = None if mask is None else np.append(mask, mask[-1])  # EOS ends the last turn
    out.index.append(i)
    out.tokens.append(ids)
    if mask is not None:
        out.masks.append(mask)


def tokenize_records(records: list, first_index: int, kind: str, tok, eos_id: int | None,
                     vocab_size: int, template=None, strict: bool = False) -> Tokenized:
    """Tokenize one chunk. eos_id: appended to every document when not None; template: a
    chat_template.ChatTemplate for chat records (None: the built-in rendering); strict: a broken
    record (STRICT_REASONS) raises ValueError instead of being counted."""
    out = Tokenized(masks=[] if kind == "chat" else None, strict=strict)
    if kind == "ids":
        for k, value in enumerate(records):
            if value is None or isinstance(value, Unreadable):
                out.drop("missing_value" if value is None else value.reason, first_index + k)
                continue
            ids = np.asarray(value)
            if ids.ndim != 1 or (ids.size and (ids.dtype.kind not in "iu" or ids.min() < 0
                                               or ids.max() >= vocab_size)):
                out.drop("bad_record", first_index + k)
                continue
            _finish(out, first_index + k, ids.astype(np.int32), None, eos_id)
        return out
    if kind == "text":
        good, texts = [], []
        for k, value in enumerate(records):
            text, reason = _as_text(value)
            if reason:
                out.drop(reason, first_index + k)
            else:
                good.append(first_index + k)
                texts.append(text)
        for i, ids in zip(good, encode_texts(tok, texts), strict=True):
            _finish(out, i, ids, None, eos_id)
        return out
    if template is not None:
        return _tokenize_templated(records, first_index, tok, eos_id, out, template)
    return _tokenize_chat(records, first_index, tok, eos_id, out)


def _tokenize_templated(records, first_index, tok, eos_id, out: Tokenized, template) -> Tokenized:
    from jinja2.exceptions import TemplateError

    from data_packing.chat_template import assistant_mask

    docs, texts, spans = [], [], []
    for k, value in enumerate(records):
        _, reason = _chat_segments(value)
        if reason is None:
            try:
                text, gen = template.render(value)
            except TemplateError:  # the template refused the conversation (raise_exception)
                reason = "bad_record"
        if reason:
            out.drop(reason, first_index + k)
            continue
        docs.append(first_index + k)
        texts.append(text)
        spans.append(gen)
    # encode_batch (not _fast): the character offsets map the generation spans onto tokens
    for i, enc, gen in zip(docs, tok.encode_batch(texts, add_special_tokens=False) if texts else [],
                           spans, strict=True):
        _finish(out, i, np.asarray(enc.ids, np.int32), assistant_mask(enc.offsets, gen), eos_id)
    return out


def _tokenize_chat(records, first_index, tok, eos_id, out: Tokenized) -> Tokenized:
    docs, flat = [], []
    for k, value in enumerate(records):
        segs, reason = _chat_segments(value)
        if reason:
            out.drop(reason, first_index + k)
            continue
        docs.append((first_index + k, len(flat), len(segs)))
        flat.extend(segs)
    encoded = encode_texts(tok, [s for s, _ in flat])  # one batched call for all segments
    for i, lo, n in docs:
        parts = encoded[lo:lo + n]
        ids = np.concatenate(parts) if parts else np.zeros(0, np.int32)
        mask = np.concatenate([np.full(len(p), flat[lo + j][1], np.uint8) for j, p in enumerate(parts)])
        _finish(out, i, ids, mask, eos_id)
    return out


def training_texts(corpus, chunk: int = 256) -> Iterator[str]:
    """The texts a tokenizer is trained on: every valid text or rendered chat, in order."""
    if corpus.kind == "ids":
        raise ValueError("--train-tokenizer needs text input, but the corpus is pre-tokenized "
                         "(--ids-key); pass --vocab-size instead")
    for start in range(0, len(corpus), chunk):
        for value in corpus.slice(start, start + chunk):
            text = render_chat(value) if corpus.kind == "chat" else _as_text(value)[0]
            if text:
                yield text
