"""Tokenizers for `longctx-pack`: load a `tokenizers` JSON file or train a byte-level BPE.

The tokenizer is stored next to the packed data as `tokenizer.json`; its SHA-256 (of the exact
bytes written) goes into `metadata.json` so a loader or a rerun can detect a different tokenizer.
"""

from __future__ import annotations

import hashlib
from collections.abc import Iterable

import numpy as np

EOS_TOKEN = "<|endoftext|>"
PAD_TOKEN = "<|pad|>"
# Tried in order when a user-supplied tokenizer names no end-of-document token.
_EOS_CANDIDATES = (EOS_TOKEN, "</s>", "<eos>", "<|eos|>", "[SEP]")
_PAD_CANDIDATES = (PAD_TOKEN, "<pad>", "[PAD]")


def thread_env(workers: int) -> dict[str, str]:
    """The environment that sizes the Rust thread pool `tokenizers` uses for `workers` (its only
    control: the pool reads RAYON_NUM_THREADS once, at its first parallel call). Library code
    returns it; the process's owner applies it (`longctx-pack`'s entry point, a Ray task's
    runtime_env), never a process someone else made."""
    return {"RAYON_NUM_THREADS": str(max(1, workers)),
            "TOKENIZERS_PARALLELISM": "true" if workers > 1 else "false"}


def train_bpe(texts: Iterable[str], vocab_size: int):
    """A byte-level BPE trained on `texts` with EOS_TOKEN and PAD_TOKEN as special tokens."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    if vocab_size < 256 + 2:
        raise ValueError(f"--train-tokenizer {vocab_size} is too small: a byte-level BPE needs at "
                         "least 258 entries (256 bytes + 2 special tokens)")
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size, special_tokens=[EOS_TOKEN, PAD_TOKEN], show_progress=False,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), min_frequency=2,
    )
    tok.train_from_iterator(texts, trainer=trainer)
    return tok


def load_tokenizer(path: str):
    from tokenizers import Tokenizer

    try:
        return Tokenizer.from_file(path)
    except Exception as e:  # noqa: BLE001 - tokenizers raises bare Exception subclasses
        raise ValueError(f"cannot load tokenizer {path!r} ({type(e).__name__}: {str(e)[:120]}); "
                         "pass a `tokenizers` JSON file (tokenizer.json)") from None


def tokenizer_bytes(tok) -> bytes:
    """The exact bytes stored as tokenizer.json (hashing these makes the hash reproducible)."""
    return tok.to_str(pretty=False).encode("utf-8")


def sha256(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


def special_ids(tok, eos_token: str | None, pad_token: str | None) -> tuple[int | None, int]:
    """(eos_id or None, pad_id). Falls back to common names; pad falls back to eos, then 0."""
    def find(name, candidates, flag):
        if name is not None:
            tid = tok.token_to_id(name)
            if tid is None:
                raise ValueError(f"{flag} {name!r} is not in the tokenizer's vocabulary; "
                                 f"pass a token that is, or omit {flag}")
            return tid
        for cand in candidates:
            if tok.token_to_id(cand) is not None:
                return tok.token_to_id(cand)
        return None

    eos = find(eos_token, _EOS_CANDIDATES, "--eos-token")
    pad = find(pad_token, _PAD_CANDIDATES, "--pad-token")
    return eos, (pad if pad is not None else (eos if eos is not None else 0))


def encode_texts(tok, texts: list[str]) -> list[np.ndarray]:
    """int32 arrays, one per text, in input order (encode_batch keeps order for any thread count)."""
    if not texts:
        return []
    encodings = tok.encode_batch_fast(texts, add_special_tokens=False)
    return [np.asarray(e.ids, dtype=np.int32) for e in encodings]
