"""DeepSeek's Engram: the compressed tokenizer as a ``token_map`` for `PLEConfig.engram` (docs/engram.md).

::

    from transformers import AutoTokenizer
    import ple
    from ple.integrations.engram import token_map

    tok = AutoTokenizer.from_pretrained("deepseek-ai/DeepSeek-V3")
    config = ple.PLEConfig.preset("engram-demo", token_map=token_map(tok, vocab_size=129280))

The Engram demo (``engram_demo_v1.py``, class ``CompressedTokenizer``) hashes n-grams of *compressed*
token ids: token ids whose texts differ only in case, accents, Unicode form or surrounding whitespace share
one id. `token_map` builds that lookup, one int64 a token id, from a ``tokenizers.Tokenizer`` or a
transformers tokenizer. `normalize` is the text rule it keys by.

Decoding needs the tokenizer's library; the text rule needs nothing but ``unicodedata`` when
``normalizer="python"``. The default (``"auto"``) uses the ``tokenizers`` library's normalizers when it is
installed (the demo's own, so the map is the demo's exactly) and the plain-Python rule otherwise. The two
agree except on characters whose Unicode data the two libraries read from different Unicode versions (marks
and compatibility forms added in recent versions); see `normalize`. ``pip install 'ple[engram]'`` adds
``tokenizers``.
"""

from __future__ import annotations

import functools
import re
import unicodedata
from collections.abc import Callable
from typing import Any

import torch

from .._checks.args import choice_arg, int_arg
from .._progress import progress

__all__ = ["token_map", "normalize", "NORMALIZERS"]

NORMALIZERS = ("auto", "tokenizers", "python")
"""`normalize`'s implementations: ``"tokenizers"`` (the ``tokenizers`` library's normalizers, as the demo runs
them), ``"python"`` (plain Python, ``unicodedata``), ``"auto"`` (the first when ``tokenizers`` imports, else the
second)."""

_REPLACEMENT = "\ufffd"
"""U+FFFD: a token whose text holds it (a piece of a UTF-8 character) is keyed by its token string."""

_SENTINEL = "\ue000"              # the demo's stand-in for a text that is one space while it strips
_RUNS = re.compile(r"[ \t\r\n]+")
# What the tokenizers library's Strip removes: Rust's char::is_whitespace (the White_Space property). Python's
# str.strip also removes U+001C..U+001F, so it is not used.
_WHITE_SPACE = frozenset("\t\n\x0b\x0c\r \x85\xa0\u1680\u2000\u2001\u2002\u2003\u2004\u2005\u2006\u2007\u2008"
                         "\u2009\u200a\u2028\u2029\u202f\u205f\u3000")
_BATCH = 4096                     # ids decoded per decode_batch call (a tokenizers.Tokenizer)


def _python_normalize(text: str) -> str:
    s = unicodedata.normalize("NFD", unicodedata.normalize("NFKC", text))
    s = "".join(c for c in s if not unicodedata.category(c).startswith("M"))   # StripAccents: drop marks
    s = "".join(c.lower() for c in s)          # char by char, as tokenizers' Lowercase (no final-sigma rule)
    s = _RUNS.sub(" ", s)
    if s == " ":
        s = _SENTINEL
    start, end = 0, len(s)
    while start < end and s[start] in _WHITE_SPACE:
        start += 1
    while end > start and s[end - 1] in _WHITE_SPACE:
        end -= 1
    return s[start:end].replace(_SENTINEL, " ")


@functools.lru_cache(maxsize=1)
def _tokenizers_normalize() -> Callable[[str], str]:
    from tokenizers import Regex, normalizers

    seq = normalizers.Sequence([
        normalizers.NFKC(), normalizers.NFD(), normalizers.StripAccents(), normalizers.Lowercase(),
        normalizers.Replace(Regex(r"[ \t\r\n]+"), " "), normalizers.Replace(Regex(r"^ $"), _SENTINEL),
        normalizers.Strip(), normalizers.Replace(_SENTINEL, " "),
    ])
    return seq.normalize_str


def _have_tokenizers() -> bool:
    try:
        import tokenizers  # noqa: F401
    except ImportError:
        return False
    return True


def _normalizer(normalizer: str) -> Callable[[str], str]:
    choice_arg("normalizer", normalizer, NORMALIZERS)
    if normalizer == "python" or (normalizer == "auto" and not _have_tokenizers()):
        return _python_normalize
    try:
        return _tokenizers_normalize()
    except ImportError as e:
        raise ImportError("normalizer='tokenizers' needs the tokenizers library: pip install 'ple[engram]' "
                          "(or pass normalizer='python')") from e


def normalize(text: str, *, normalizer: str = "auto") -> str:
    """The Engram demo's text rule: the key of a token whose text holds no U+FFFD.

    In order: NFKC, then NFD; combining marks (general category M) dropped; lowercase, character by character
    (no final-sigma rule: ``"ΟΔΟΣ"`` gives ``"οδοσ"``); each run of space, tab, CR and LF made one space; a
    text that is then exactly one space is kept as one space, any other is stripped of white space (Unicode's
    White_Space property). Then every U+E000 (the demo's stand-in for the kept space) becomes a space, one in
    the text included. `token_map` keys a text that this leaves empty by the text itself.

    ``normalizer`` picks the implementation (`NORMALIZERS`): ``"tokenizers"`` runs the tokenizers library's
    normalizers as the demo does, ``"python"`` the same steps in plain Python (``unicodedata``), ``"auto"``
    the first when ``tokenizers`` is installed. They differ where the two read different Unicode versions:
    tokenizers' NFKC, NFD and marks are older than Python's ``unicodedata``, its lowercase newer (442 code
    points with tokenizers 0.23 and Python 3.11, none of them below U+07FD). ``TypeError`` for a non-str
    ``text``; ``ImportError`` for ``"tokenizers"`` without the library.
    """
    if not isinstance(text, str):
        raise TypeError(f"text: expected a str, got {type(text).__name__}")
    return _normalizer(normalizer)(text)


def _reader(tokenizer: Any) -> tuple[int, Callable[[list[int]], list[str]], Callable[[int], Any]]:
    """``(length, decode each id alone, the token string of an id)`` of a tokenizer, or ``TypeError``."""
    if isinstance(tokenizer, (str, bytes)) or hasattr(tokenizer, "__fspath__"):
        raise TypeError(f"tokenizer: expected a tokenizers.Tokenizer or a transformers tokenizer, got "
                        f"{type(tokenizer).__name__} {tokenizer!r} (load it first, e.g. "
                        f"transformers.AutoTokenizer.from_pretrained(name))")
    has = functools.partial(hasattr, tokenizer)
    if has("convert_ids_to_tokens") and has("decode") and has("__len__"):              # transformers
        def decode_t(ids: list[int]) -> list[str]:
            return [tokenizer.decode([i], skip_special_tokens=False) for i in ids]
        return len(tokenizer), decode_t, tokenizer.convert_ids_to_tokens
    if has("id_to_token") and has("decode") and has("get_vocab_size"):                 # tokenizers.Tokenizer
        if has("decode_batch"):
            def decode_k(ids: list[int]) -> list[str]:
                return list(tokenizer.decode_batch([[i] for i in ids], skip_special_tokens=False))
        else:
            def decode_k(ids: list[int]) -> list[str]:
                return [tokenizer.decode([i], skip_special_tokens=False) for i in ids]
        return int(tokenizer.get_vocab_size(with_added_tokens=True)), decode_k, tokenizer.id_to_token
    raise TypeError(f"tokenizer: expected a tokenizers.Tokenizer or a transformers tokenizer (decode with "
                    f"convert_ids_to_tokens or id_to_token), got {type(tokenizer).__name__}")


def token_map(tokenizer: Any, *, vocab_size: int | None = None, normalizer: str = "auto") -> torch.Tensor:
    """The Engram demo's compressed tokenizer as a lookup: int64 ``[vocab_size]``, token id -> compressed id.

    ``tokenizer`` is a ``tokenizers.Tokenizer`` or a transformers tokenizer (anything with ``decode``,
    ``convert_ids_to_tokens`` and ``len``). Each id ``0 .. len(tokenizer) - 1`` (a ``tokenizers.Tokenizer``:
    ``get_vocab_size(with_added_tokens=True)``) is decoded alone, special tokens kept
    (``decode([id], skip_special_tokens=False)``), and gets a key:

    - a text holding U+FFFD (a piece of a UTF-8 character) is keyed by the id's token string
      (``convert_ids_to_tokens(id)`` / ``id_to_token(id)``);
    - any other by its text normalised (`normalize`: NFKC, NFD, marks dropped, lowercase, white space runs made
      one space, a lone space kept, stripped), or by the text itself when that leaves nothing.

    Ids with one key share one compressed id; compressed ids are numbered ``0, 1, ...`` in the order their
    key first appears, reading the ids in order. Token strings and normalised texts are keys of one kind, as
    in the demo.

    Pass it to the config: ``PLEConfig.engram(..., vocab_size=V, token_map=token_map(tok, vocab_size=V))``.
    The hash then sees V' = ``int(map.max()) + 1`` distinct ids (the demo's ``len(CompressedTokenizer)``,
    ``config.token_vocab_size``), which sets the hash multipliers' bound.

    ``vocab_size`` (default: the tokenizer's length) is the model's vocabulary when it is padded past the
    tokenizer's (the demo's backbone has 129,280 ids; the config's ``vocab_size`` must equal the map's
    length): the ids the tokenizer does not have (which it never produces, and the demo's lookup cannot take)
    map to 0, so V' stays the demo's. A ``vocab_size`` below the
    tokenizer's length is a ``ValueError``. ``normalizer`` is `normalize`'s (``"auto"``: the tokenizers
    library's normalizers when installed, the demo's exactly).

    One decode a token: under a second for 129K ids (a 2-core CPU), with a progress bar on a terminal.
    ``TypeError`` names ``tokenizer`` when it is not a tokenizer (a name or a path: load it first).
    """
    length, decode, token_of = _reader(tokenizer)
    size = length if vocab_size is None else int_arg("vocab_size", vocab_size, minimum=1)
    if size < length:
        raise ValueError(f"vocab_size: expected at least the tokenizer's {length} ids, got {size}")
    norm = _normalizer(normalizer)
    keys: dict[Any, int] = {}
    out: list[int] = []
    starts = range(0, length, _BATCH)
    for start in progress(starts, total=len(starts), desc="token_map"):
        ids = list(range(start, min(start + _BATCH, length)))
        for i, text in zip(ids, decode(ids)):
            if not isinstance(text, str):
                raise TypeError(f"tokenizer: its decode([{i}]) gave {type(text).__name__}, not a str")
            key = token_of(i) if _REPLACEMENT in text else (norm(text) or text)
            out.append(keys.setdefault(key, len(keys)))
    out.extend([0] * (size - length))
    return torch.tensor(out, dtype=torch.int64)
