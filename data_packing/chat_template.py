"""Chat records rendered with the model's own Jinja chat template, with an assistant-only mask.

The template comes from `--chat-template FILE` (a Jinja file, or a `tokenizer_config.json` holding
a "chat_template") or, by default, from the `tokenizer_config.json` beside `--tokenizer`. It is
rendered the way `transformers`' `apply_chat_template` renders it (a sandboxed Jinja environment
with trim_blocks / lstrip_blocks, loop controls, `raise_exception`, `strftime_now` and a `tojson`
that does not escape HTML; the tokenizer's special tokens as variables; no generation prompt), so
the ids are the model's. The loss mask is `return_assistant_tokens_mask`'s: a token is supervised
when its character span overlaps text the template wrapped in `{% generation %}...{% endgeneration
%}`. A template without those tags supervises nothing, so it is refused. Without any template the
built-in `<|role|>` rendering of `documents.py` is used, with a notice.
"""

from __future__ import annotations

import json
import os
import re
import sys
from dataclasses import dataclass, field
from datetime import datetime

import numpy as np

_SPECIAL = ("bos_token", "eos_token", "unk_token", "sep_token", "pad_token", "cls_token", "mask_token")
_GENERATION_TAG = re.compile(r"\{%-?\s*generation\s*-?%\}")


def _token_text(value) -> str | None:
    """A special token as tokenizer_config.json writes it: a string or {"content": ...}."""
    if isinstance(value, dict):
        value = value.get("content")
    return value if isinstance(value, str) else None


@dataclass
class ChatTemplate:
    source: str
    origin: str  # the file it was read from
    variables: dict = field(default_factory=dict)  # special tokens the template may use
    _compiled: object = None

    def render(self, messages: list[dict]) -> tuple[str, list[tuple[int, int]]]:
        """(rendered text, character spans of the {% generation %} blocks, in order)."""
        template = self._template()
        blocks, spans = [], []
        with template.environment.activate_tracker(blocks, spans):
            for block in template.generate(messages=messages, tools=None, documents=None,
                                           add_generation_prompt=False, **self.variables):
                blocks.append(block)
        return "".join(blocks), spans

    def _template(self):
        if self._compiled is None:
            self._compiled = compile_template(self.source)
        return self._compiled


def compile_template(source: str):
    """A sandboxed Jinja template with the `generation` tag recording the spans it renders."""
    import jinja2
    from jinja2.ext import Extension, loopcontrols
    from jinja2.sandbox import ImmutableSandboxedEnvironment

    class GenerationTracker(Extension):
        tags = {"generation"}

        def __init__(self, environment):
            super().__init__(environment)
            environment.extend(activate_tracker=self.activate_tracker)
            self._tracking = None

        def parse(self, parser):
            lineno = next(parser.stream).lineno
            body = parser.parse_statements(["name:endgeneration"], drop_needle=True)
            return jinja2.nodes.CallBlock(self.call_method("_span"), [], [], body).set_lineno(lineno)

        def _span(self, caller):
            text = caller()
            if self._tracking is not None:
                blocks, spans = self._tracking
                start = sum(len(b) for b in blocks)
                spans.append((start, start + len(text)))
            return text

        def activate_tracker(self, blocks, spans):
            ext = self

            class _Active:
                def __enter__(self):
                    ext._tracking = (blocks, spans)

                def __exit__(self, *exc):
                    ext._tracking = None

            return _Active()

    def raise_exception(message):
        raise jinja2.exceptions.TemplateError(message)

    def tojson(x, ensure_ascii=False, indent=None, separators=None, sort_keys=False):
        return json.dumps(x, ensure_ascii=ensure_ascii, indent=indent, separators=separators,
                          sort_keys=sort_keys)

    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True,
                                        extensions=[GenerationTracker, loopcontrols])
    env.filters["tojson"] = tojson
    env.globals["raise_exception"] = raise_exception
    env.globals["strftime_now"] = lambda fmt: datetime.now().strftime(fmt)
    return env.from_string(source)


def _read_template(path: str) -> tuple[str, dict]:
    """(template source, tokenizer_config.json contents or {}) of a Jinja or config file."""
    try:
        with open(path, encoding="utf-8") as f:
            text = f.read()
    except OSError as e:
        raise ValueError(f"cannot read --chat-template {path!r} ({e.strerror}); pass a Jinja "
                         "file or a tokenizer_config.json") from None
    if not path.endswith(".json"):
        return text, {}
    config = json.loads(text)
    source = config.get("chat_template")
    if isinstance(source, list):  # named templates: the default one
        source = next((t.get("template") for t in source if t.get("name") == "default"), None)
    if not isinstance(source, str):
        raise ValueError(f"{path} has no chat_template; pass a Jinja file with --chat-template")
    return source, config


def resolve(args, kind: str, tok, eos_token: str | None, pad_token: str | None) -> ChatTemplate | None:
    """The template chat records are rendered with, or None for the built-in rendering.
    args: PackArgs (chat_template, tokenizer)."""
    if kind != "chat":
        if args.chat_template:
            raise ValueError("--chat-template applies to chat records, but the input holds "
                             f"{kind} records; drop --chat-template or pass --messages-key")
        return None
    path = args.chat_template
    beside = os.path.join(os.path.dirname(os.path.abspath(args.tokenizer)), "tokenizer_config.json") \
        if args.tokenizer else None
    if path is None and beside and os.path.exists(beside) and "chat_template" in _load_json(beside):
        path = beside
    if path is None:
        print("longctx-pack: notice: no chat template (none beside --tokenizer, no "
              "--chat-template FILE); chat records use the built-in <|role|> rendering, which "
              "is not your model's format", file=sys.stderr)
        return None
    source, config = _read_template(path)
    if not _GENERATION_TAG.search(source):
        raise ValueError(f"the chat template in {path} has no {{% generation %}} block, so no "
                         "token would carry a loss; wrap assistant content in {% generation %}"
                         "...{% endgeneration %}")
    if not config and beside and os.path.exists(beside):
        config = _load_json(beside)
    variables = {k: _token_text(config.get(k)) for k in _SPECIAL}
    variables.setdefault("eos_token", None)
    variables["eos_token"] = variables["eos_token"] or eos_token
    variables["pad_token"] = variables["pad_token"] or pad_token
    return ChatTemplate(source, path, {k: v for k, v in variables.items() if v is not None})


def _load_json(path: str) -> dict:
    try:
        with open(path, encoding="utf-8") as f:
            return json.load(f)
    except (OSError, ValueError):
        return {}


def assistant_mask(offsets: list[tuple[int, int]], spans: list[tuple[int, int]]) -> np.ndarray:
    """uint8 [L]: 1 where a token's character span overlaps a generation span."""
    if not offsets:
        return np.zeros(0, np.uint8)
    off = np.asarray(offsets, np.int64).reshape(-1, 2)
    mask = np.zeros(len(off), bool)
    for s0, s1 in spans:
        mask |= (off[:, 1] > s0) & (off[:, 0] < s1)
    return mask.astype(np.uint8)
