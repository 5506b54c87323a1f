"""Tokenizers for prepared datasets, all through Hugging Face's ``tokenizers`` library (Rust),
so that what a run trained with is one ``tokenizer.json`` that ``transformers`` loads too.

- ``bytes``: byte-level, built here: a BPE with no merges whose ids are the bytes' own values
  (what the byte-level GPT has always used), plus ``<|endoftext|>`` = 256 as the
  end-of-document token (``byte_tokenizer(eod=False)``: the 256 bytes alone, what a
  text-file run trained on).
- ``train:VOCAB``: a byte-level BPE trained here on the corpus itself (``train_bpe``):
  every byte is in its alphabet, so no text is ever unknown.
- a path to a ``tokenizer.json`` the run owner brings (``load_file``); it must have an
  end-of-document token, found among its special tokens or named with ``eod_token``.

Nothing is ever fetched from a hub. ``tokenizers`` is in the ``[data]`` extra: a volunteer
trains on token ids and never needs it.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, Literal

if TYPE_CHECKING:
    from tokenizers import Tokenizer

EOD = "<|endoftext|>"
# end-of-document tokens of well-known tokenizers, in the order they are looked for
EOD_CANDIDATES = (EOD, "</s>", "<|end_of_text|>", "<eos>")
MIN_TRAINED_VOCAB = 258  # the 256 bytes, the end-of-document token, one merge
MAX_TRAINED_VOCAB = 1 << 20


class TokenizerError(ValueError):
    """A tokenizer that cannot be built, loaded or used; the message says why."""


def _lib() -> Any:
    try:
        import tokenizers
    except ImportError:
        raise TokenizerError(
            "tokenizers is not installed: pip install 'diloco-hub[data]'"
        ) from None
    return tokenizers


@dataclass(frozen=True)
class TextTokenizer:
    """A ``tokenizers.Tokenizer`` with its end-of-document id and kind."""

    inner: Tokenizer
    eod_id: int
    kind: Literal["bytes", "bpe"]

    @property
    def vocab_size(self) -> int:
        return int(self.inner.get_vocab_size(with_added_tokens=True))

    def encode_batch(self, texts: list[str]) -> list[list[int]]:
        return [e.ids for e in self.inner.encode_batch(texts, add_special_tokens=False)]

    def encode(self, text: str) -> list[int]:
        return list(self.inner.encode(text, add_special_tokens=False).ids)

    def decode(self, ids: Iterable[int]) -> str:
        return str(self.inner.decode(list(ids), skip_special_tokens=False))

    def to_json(self) -> str:
        return str(self.inner.to_str())

    @property
    def eod_token(self) -> str:
        return str(self.inner.id_to_token(self.eod_id))


def _byte_chars() -> dict[int, str]:
    """GPT-2's byte-to-character table (what the ByteLevel pre-tokenizer emits): printable
    bytes stand for themselves, the others are shifted past 255."""
    printable = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1)]
    printable += range(ord("®"), ord("ÿ") + 1)
    chars, shifted = {b: chr(b) for b in printable}, 0
    for b in range(256):
        if b not in chars:
            chars[b] = chr(256 + shifted)
            shifted += 1
    return chars


def byte_tokenizer(*, eod: bool = True) -> TextTokenizer:
    """Ids are bytes (0..255); with ``eod``, ``<|endoftext|>`` is 256."""
    lib = _lib()
    vocab = {char: byte for byte, char in _byte_chars().items()}
    inner = lib.Tokenizer(lib.models.BPE(vocab=vocab, merges=[]))
    inner.pre_tokenizer = lib.pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    inner.decoder = lib.decoders.ByteLevel()
    if eod:
        inner.add_special_tokens([EOD])
    return TextTokenizer(inner, eod_id=256 if eod else -1, kind="bytes")


def train_bpe(texts: Iterator[str], vocab_size: int) -> TextTokenizer:
    """A byte-level BPE of ``vocab_size`` ids (``<|endoftext|>`` included) trained on
    ``texts`` as they stream by."""
    if not MIN_TRAINED_VOCAB <= vocab_size <= MAX_TRAINED_VOCAB:
        raise TokenizerError(
            f"train:{vocab_size}: the vocabulary must be {MIN_TRAINED_VOCAB}..{MAX_TRAINED_VOCAB} "
            "(the 256 bytes, the end-of-document token and at least one merge)"
        )
    lib = _lib()
    inner = lib.Tokenizer(lib.models.BPE())
    inner.pre_tokenizer = lib.pre_tokenizers.ByteLevel(add_prefix_space=False)
    inner.decoder = lib.decoders.ByteLevel()
    trainer = lib.trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=[EOD],
        initial_alphabet=lib.pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    inner.train_from_iterator(texts, trainer=trainer)
    return TextTokenizer(inner, eod_id=int(inner.token_to_id(EOD)), kind="bpe")


def load_file(path: str | Path, *, eod_token: str | None = None) -> TextTokenizer:
    """A ``tokenizer.json`` as given; its end-of-document token is ``eod_token`` or the
    first of EOD_CANDIDATES it has."""
    lib = _lib()
    path = Path(path)
    try:
        inner = lib.Tokenizer.from_file(str(path))
    except Exception as err:  # tokenizers raises a bare Exception for every kind of failure
        raise TokenizerError(
            f"{path}: not a tokenizer.json the tokenizers library reads ({err})"
        ) from None
    for token in (eod_token,) if eod_token is not None else EOD_CANDIDATES:
        token_id = inner.token_to_id(token)
        if token_id is not None:
            return TextTokenizer(inner, eod_id=int(token_id), kind="bpe")
    if eod_token is not None:
        raise TokenizerError(f"{path}: it has no token {eod_token!r} (--eod-token)")
    raise TokenizerError(
        f"{path}: it has none of the end-of-document tokens {', '.join(EOD_CANDIDATES)}; "
        "name its end-of-document token with --eod-token TOKEN"
    )


def resolve(
    spec: str, texts: Callable[[], Iterator[str]], *, eod_token: str | None = None
) -> TextTokenizer:
    """``bytes``, ``train:VOCAB`` (trained on ``texts()``) or a path to a tokenizer.json."""
    if spec == "bytes":
        return byte_tokenizer()
    if spec.startswith("train:"):
        raw = spec.removeprefix("train:")
        if not raw.isdigit():
            raise TokenizerError(f"--tokenizer {spec}: train:VOCAB needs a number, e.g. train:8192")
        return train_bpe(texts(), int(raw))
    path = Path(spec)
    if path.is_dir():
        path = path / "tokenizer.json"
    if not path.is_file():
        raise TokenizerError(
            f"--tokenizer {spec}: no such file; give bytes, train:VOCAB or a tokenizer.json"
        )
    return load_file(path, eod_token=eod_token)
