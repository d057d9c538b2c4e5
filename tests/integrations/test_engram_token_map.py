"""``ple.integrations.engram.token_map``: the Engram demo's compressed tokenizer as a lookup (docs/engram.md).

A small byte-level tokenizer is built here offline (``tokenizers``: a WordLevel model over an in-memory
vocabulary, the ByteLevel decoder) with the cases the demo's rule separates: case and accent twins, a
compatibility ligature, white-space-only tokens, a lone UTF-8 lead byte (decodes to U+FFFD), Greek capitals
(no final sigma), a text the rule empties, the U+E000 the demo uses as its sentinel, special tokens. The
oracle applies the demo's rule with the ``tokenizers`` library's normalizers, written out here from the
demo's description; a hand-written map pins a few ids.
"""

from __future__ import annotations

import pytest
import torch

tokenizers = pytest.importorskip("tokenizers")

from tokenizers import AddedToken, Regex, Tokenizer, decoders, models, normalizers  # noqa: E402

import ple  # noqa: E402
from ple.integrations.engram import NORMALIZERS, normalize, token_map  # noqa: E402
from ple.reference import hash_params, ngram_ids  # noqa: E402

# The texts of the vocabulary, id by id, then two lone bytes (0xC3, 0xC2) and two special tokens.
TEXTS = ["Hello", "hello", " hello", "HELLO", "café", "Cafe", "cafe", " ", "  ", "\n", "\t \n", "\ue000",
         "a\ue000", "\ufb01", "fi", "ΟΔΟΣ", "οδοσ", "οδος", "a\x1c", "\u0301", "\xa0", " A ", "\u0300"]
SPECIAL = ["<pad>", "<|END|>"]
# The map the demo's rule gives (worked by hand): hello x4, cafe x3, " " (a lone space, the sentinel, NBSP),
# "a" + space (the sentinel inside a text), fi (the ligature's NFKC), οδοσ x2 (no final sigma), οδος,
# "a\x1c" (U+001C is not White_Space), U+0301 (emptied: its own text), "a", U+0300 (emptied too: its own
# text, not U+0301's), the two lone bytes by their token strings, then "<pad>" and "<|end|>".
EXPECTED = [0, 0, 0, 0, 1, 1, 1, 2, 2, 2, 2, 2, 3, 4, 4, 5, 5, 6, 7, 8, 2, 9, 10, 11, 12, 13, 14]


def _byte_alphabet() -> dict[int, str]:
    """GPT-2's byte-to-character table (the ByteLevel decoder's inverse)."""
    keep = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), ord("ÿ") + 1)]
    extra = [b for b in range(256) if b not in keep]
    return {**{b: chr(b) for b in keep}, **{b: chr(256 + n) for n, b in enumerate(extra)}}


BYTES = _byte_alphabet()


def _token(raw: bytes) -> str:
    return "".join(BYTES[b] for b in raw)


def build_tokenizer() -> Tokenizer:
    vocab = {_token(t.encode()): i for i, t in enumerate(TEXTS)}
    for raw in (b"\xc3", b"\xc2"):                          # lead bytes alone: U+FFFD when decoded
        vocab[_token(raw)] = len(vocab)
    tok = Tokenizer(models.WordLevel(vocab, unk_token=None))
    tok.decoder = decoders.ByteLevel()
    tok.add_special_tokens([AddedToken(s, special=True) for s in SPECIAL])
    return tok


# ---- the oracle: the demo's rule, with the tokenizers library's normalizers ----------------------------
SENTINEL = "\ue000"
DEMO_RULE = normalizers.Sequence([
    normalizers.NFKC(), normalizers.NFD(), normalizers.StripAccents(), normalizers.Lowercase(),
    normalizers.Replace(Regex(r"[ \t\r\n]+"), " "), normalizers.Replace(Regex(r"^ $"), SENTINEL),
    normalizers.Strip(), normalizers.Replace(SENTINEL, " "),
])


def oracle(n: int, decode, token_of) -> list[int]:
    """Each id decoded alone; U+FFFD: its token string; else the normalised text (empty: the text); ids
    numbered by first appearance."""
    first: dict = {}
    out = []
    for i in range(n):
        text = decode(i)
        key = token_of(i) if "\ufffd" in text else (DEMO_RULE.normalize_str(text) or text)
        if key not in first:
            first[key] = len(first)
        out.append(first[key])
    return out


@pytest.fixture(scope="module")
def tok() -> Tokenizer:
    return build_tokenizer()


def test_the_tokenizer_has_the_cases(tok):
    """The fixture decodes as the cases say (so the tests below test what they claim)."""
    n = tok.get_vocab_size(with_added_tokens=True)
    texts = [tok.decode([i], skip_special_tokens=False) for i in range(n)]
    assert texts == [*TEXTS, "\ufffd", "\ufffd", *SPECIAL]
    assert tok.id_to_token(23) != tok.id_to_token(24)


@pytest.mark.parametrize("normalizer", NORMALIZERS)
def test_token_map_is_the_demo_rule(tok, normalizer):
    n = tok.get_vocab_size(with_added_tokens=True)
    got = token_map(tok, normalizer=normalizer)
    assert got.dtype == torch.int64 and got.shape == (n,)
    want = oracle(n, lambda i: tok.decode([i], skip_special_tokens=False), tok.id_to_token)
    assert got.tolist() == want
    assert got.tolist() == EXPECTED


def test_a_transformers_tokenizer_gives_the_same_map(tok):
    transformers = pytest.importorskip("transformers")
    hf = transformers.PreTrainedTokenizerFast(tokenizer_object=build_tokenizer())
    assert len(hf) == tok.get_vocab_size(with_added_tokens=True)
    want = oracle(len(hf), lambda i: hf.decode([i], skip_special_tokens=False), hf.convert_ids_to_tokens)
    assert token_map(hf).tolist() == want == EXPECTED


class DuckTokenizer:
    """A transformers-like tokenizer by its methods only; records decode's keyword arguments."""

    def __init__(self, texts, tokens):
        self.texts, self.tokens, self.calls = texts, tokens, []

    def __len__(self):
        return len(self.texts)

    def decode(self, ids, **kwargs):
        self.calls.append(kwargs)
        return "".join(self.texts[i] for i in ids)

    def convert_ids_to_tokens(self, i):
        return self.tokens[i]


def test_any_tokenizer_with_the_methods_special_tokens_kept():
    texts = ["\ufffd", "\ufffd", "X", "x", "", "<s>", "\ufffd"]
    tokens = ["<0xC3>", "<0xC2>", "X", "x", "", "<s>", "<0xC3>"]
    duck = DuckTokenizer(texts, tokens)
    # ids 0 and 6 share a token string; "" is its own key (normalised empty: the text itself)
    assert token_map(duck).tolist() == [0, 1, 2, 2, 3, 4, 0]
    assert duck.calls and all(c == {"skip_special_tokens": False} for c in duck.calls)


def test_token_strings_and_texts_share_one_key_space():
    """As in the demo: a U+FFFD token keyed by token string "ab" shares an id with a text normalised to "ab"."""
    duck = DuckTokenizer(["AB", "\ufffd"], ["AB", "ab"])
    assert token_map(duck).tolist() == [0, 0]


def test_vocab_size_pads_with_zero_and_keeps_v_prime(tok):
    n = tok.get_vocab_size(with_added_tokens=True)
    base = token_map(tok)
    padded = token_map(tok, vocab_size=n + 3)
    assert padded.tolist() == base.tolist() + [0, 0, 0]
    assert int(padded.max()) == int(base.max())
    with pytest.raises(ValueError, match="vocab_size"):
        token_map(tok, vocab_size=n - 1)
    with pytest.raises(TypeError, match="vocab_size"):
        token_map(tok, vocab_size=float(n))


def test_the_map_feeds_the_engram_config(tok):
    """``PLEConfig.engram(..., token_map=token_map(tok))``: V' is the map's max + 1, and ids that share a
    compressed id hash alike."""
    tmap = token_map(tok)
    n = tmap.numel()
    config = ple.PLEConfig.engram(vocab_size=n, hidden_size=8, hc_count=2, engram_vocab_size=(31, 37),
                                  n_embed_per_ngram=8, n_head_per_ngram=2, layer_ids=(0, 2), pad_id=25,
                                  token_map=tmap)
    assert config.token_vocab_size == int(tmap.max()) + 1 == 15
    params = hash_params(config, 0)
    assert params.token_map.tolist() == tmap.tolist()
    rows = ngram_ids(torch.tensor([0, 4, 7]), params, heads_per_ngram=2, eos_token_id=config.eos_token_id)
    twins = ngram_ids(torch.tensor([3, 6, 20]), params, heads_per_ngram=2, eos_token_id=config.eos_token_id)
    assert torch.equal(rows, twins)                          # HELLO cafe NBSP hash as Hello café " "


@pytest.mark.parametrize("normalizer", NORMALIZERS)
@pytest.mark.parametrize(("text", "key"), [
    ("Ünïcödé", "unicode"), ("ΟΔΟΣ", "οδοσ"), ("  a \t\r\n b  ", "a b"), (" ", " "), ("\r\n", " "),
    ("\xa0", " "), ("\ue000", " "), ("x\ue000y", "x y"), ("a\x1c", "a\x1c"), ("\u0301", ""), ("\ufb03", "ffi"),
    ("\u3000a\u3000", "a"), ("İ", "i"), ("", ""),
])
def test_normalize(text, key, normalizer):
    assert normalize(text, normalizer=normalizer) == key


def test_the_python_rule_matches_tokenizers_on_old_characters():
    """The plain-Python rule equals the tokenizers library's below U+07FD (characters the two read alike),
    alone and between letters and white space."""
    for cp in range(0x7FD):
        c = chr(cp)
        for text in (c, "a" + c, c + "B", " " + c + "\n", "A" + c + c):
            assert normalize(text, normalizer="python") == DEMO_RULE.normalize_str(text), hex(cp)


def test_silent_off_a_terminal(tok, capsys):
    token_map(tok)
    assert capsys.readouterr() == ("", "")


@pytest.mark.parametrize("bad", ["deepseek-ai/DeepSeek-V3", None, 3, object(), {"a": 1}])
def test_not_a_tokenizer_is_a_type_error(bad):
    with pytest.raises(TypeError, match="tokenizer"):
        token_map(bad)


def test_bad_arguments(tok):
    with pytest.raises(ValueError, match="normalizer"):
        token_map(tok, normalizer="nfkc")
    with pytest.raises(TypeError, match="normalizer"):
        normalize("a", normalizer=None)
    with pytest.raises(TypeError, match="text"):
        normalize(b"a")
