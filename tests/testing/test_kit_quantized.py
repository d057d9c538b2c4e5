"""The kit's lookup checks on quantized tables (docs/spec.md sections 10 and 13): ``check_embedding_lookup``
and ``check_ngram_embedding`` give the user's op an FP8 table's bytes, an int8 table (and its row scales)
and an NF4 table's packed uint8 rows; the op must return the gathered stored rows bit for bit, and the
values they stand for, unpacked, must be the table's. Each passes on every backend and fails, naming the
element (head, byte, nibble, column), on a planted mistake."""

from __future__ import annotations

import collections
import textwrap

import pytest
import torch
from _helpers import assert_planted_mistake_caught
from _tier import examples

import ple
from ple import reference as ref
from ple.__main__ import main
from ple.testing import check_embedding_lookup, check_ngram_embedding, poisoned_empty
from ple.testing.kit.quantized import SCHEMES, as_schemes, check_quantized, quantized_table

LOOKUPS = {"embedding_lookup": check_embedding_lookup, "ngram_embedding": check_ngram_embedding}


def counted(fn, seen: collections.Counter):
    """``fn``, counting the weight dtypes of its calls."""
    def op(weight, *args, **kw):
        seen[weight.dtype] += 1
        return fn(weight, *args, **kw)
    return op


@pytest.mark.parametrize("schemes,dtypes", [(("nf4",), [torch.uint8]), (SCHEMES, [torch.uint8, torch.int8])])
@pytest.mark.parametrize("backend", ["reference", "vectorized"])
@pytest.mark.parametrize("op", list(LOOKUPS))
def test_the_lookups_pass_on_quantized_tables(op, backend, schemes, dtypes):
    seen: collections.Counter = collections.Counter()
    LOOKUPS[op](counted(getattr(getattr(ple, backend), op), seen), max_examples=12, schemes=schemes)
    assert all(seen[d] for d in dtypes), seen                    # the quantized tables ran (NF4 / FP8: uint8)


@pytest.mark.interpreter
@pytest.mark.parametrize("op", list(LOOKUPS))
def test_the_fast_lookups_pass_on_nf4_tables(op):
    from ple import fast
    seen: collections.Counter = collections.Counter()
    LOOKUPS[op](counted(getattr(fast, op), seen), max_examples=examples(4), max_dim=70, schemes=("nf4",),
                grad=False)
    assert seen[torch.uint8], seen


def test_schemes_are_checked():
    assert as_schemes(()) == () and as_schemes(["nf4", "fp8"]) == ("nf4", "fp8")
    for bad, err in (("nf4", TypeError), (["nf4", "q4"], ValueError), ([4], TypeError)):
        with pytest.raises(err, match="^schemes: "):
            check_embedding_lookup(ref.embedding_lookup, schemes=bad)


def test_an_nf4_table_is_packed_rows_of_every_kind():
    table = quantized_table("nf4", 400, 10, torch.Generator().manual_seed(0), strided=True)
    W = table.stored.shape[1]
    assert table.stored.dtype == torch.uint8 and W == 9 and table.stored.stride() == (W + 2, 1)
    assert (table.stored[:, W - 2:] == 0).all()                                    # the zero padding
    scale = ple.quant.nf4_unpack(table.stored.contiguous())[1].float()
    zero = scale == 0
    assert zero.any() and (table.stored[zero, :5] == 0xFF).all()                 # zero rows: codes 15
    assert scale[~zero].min() < 2**-6 and scale.max() > 2**5                      # rows of many magnitudes
    assert torch.equal(ref.nf4_dequantize_rows(table.stored, 10, torch.float32),
                       ple.quant.dequantize(table.stored.contiguous(), None, torch.float32))


def test_poisoned_empty_poisons_the_bytes_of_quantized_rows():
    with poisoned_empty():
        assert (torch.empty(3, dtype=torch.uint8) == 0xF9).all()
        assert (torch.empty_like(torch.zeros(3, dtype=torch.int8)) == -7).all()


# ---- planted mistakes: kernels that get quantized rows wrong ------------------------------------------------

def _split(weight, ids, rows):
    """The gathered rows ``[T, NH * W]`` as ``[T, NH, W]`` (a view)."""
    return rows.view(ids.shape[0], ids.shape[1], weight.shape[1])


def lookup_swaps_nibbles(weight, ids, validate=True):
    rows = ref.embedding_lookup(weight, ids)
    if weight.dtype == torch.uint8:                         # value 2i put in the high nibble of byte i
        r = _split(weight, ids, rows)
        codes = r[..., :weight.shape[1] - 4]
        r[..., :weight.shape[1] - 4] = ((codes & 0x0F) << 4) | (codes >> 4)
    return rows


def lookup_big_endian_scale(weight, ids, validate=True):
    rows = ref.embedding_lookup(weight, ids)
    if weight.dtype == torch.uint8:                         # the float16 scale's bytes the other way round
        r = _split(weight, ids, rows)
        half = weight.shape[1] - 4
        r[..., [half, half + 1]] = r[..., [half + 1, half]].clone()
    return rows


def lookup_drops_the_scale_bytes(weight, ids, validate=True):
    rows = ref.embedding_lookup(weight, ids)
    if weight.dtype != torch.uint8:
        return rows
    r = _split(weight, ids, rows)                           # codes and padding only: D/2 + 2 bytes a row
    half = weight.shape[1] - 4
    return torch.cat([r[..., :half], r[..., half + 2:]], -1).reshape(ids.shape[0], ids.shape[1] * (half + 2))


def _reads_half_rows(weight, ids):
    """Row ``r`` read from byte ``r * D/2`` (a row stride of D/2: the codes only)."""
    W = weight.shape[1]
    strided = torch.as_strided(weight, (weight.shape[0], W), (W - 4, 1))
    return strided[ids.long()].reshape(ids.shape[0], ids.shape[1] * W)


def lookup_row_stride_of_half_d(weight, ids, validate=True):
    return _reads_half_rows(weight, ids) if weight.dtype == torch.uint8 else ref.embedding_lookup(weight, ids)


def lookup_leaves_the_padding_unwritten(weight, ids, validate=True):
    rows = ref.embedding_lookup(weight, ids)
    if weight.dtype != torch.uint8:
        return rows
    out = torch.empty_like(rows)                            # poisoned by the kit: 0xF9
    _split(weight, ids, out)[..., :-2] = _split(weight, ids, rows)[..., :-2]
    return out


def lookup_odd_tail_unwritten(weight, ids, validate=True):
    rows = ref.embedding_lookup(weight, ids)
    if weight.element_size() != 1 or weight.shape[1] % 4 == 0:
        return rows
    out = torch.empty_like(rows)                            # copies whole 4-byte words of each row only
    whole = weight.shape[1] // 4 * 4
    _split(weight, ids, out)[..., :whole] = _split(weight, ids, rows)[..., :whole]
    return out


def lookup_int8_as_bytes(weight, ids, validate=True):
    if weight.dtype == torch.int8:
        return ref.embedding_lookup(weight.view(torch.uint8), ids)
    return ref.embedding_lookup(weight, ids)


def ngram_embedding_row_stride_of_half_d(weight, input_ids, params, **kw):
    if weight.dtype != torch.uint8:
        return ref.ngram_embedding(weight, input_ids, params, **kw)
    kw.pop("validate", None)
    return _reads_half_rows(weight, ref.ngram_ids(input_ids, params, **kw))


def ngram_embedding_unpacks(weight, input_ids, params, **kw):
    rows = ref.ngram_embedding(weight, input_ids, params, **kw)
    if weight.dtype != torch.uint8:
        return rows                                         # a fused kernel that hands back values, not rows
    return ref.nf4_dequantize_rows(rows, 2 * (weight.shape[1] - 4), torch.bfloat16)


NF4 = dict(schemes=("nf4",))
NF4_NGRAM = dict(schemes=("nf4",), max_requests=1, grad=False)      # one request: a quick shrink
PLANTED = [
    (check_embedding_lookup, lookup_swaps_nibbles, NF4,
     ["embedding_lookup: the nf4 output unpacked to float32 differs", "token", "table row", "nibble of byte"]),
    (check_embedding_lookup, lookup_big_endian_scale, NF4, ["the nf4 output unpacked to", "column"]),
    (check_embedding_lookup, lookup_drops_the_scale_bytes, NF4,
     ["embedding_lookup: the nf4 output: got", "uint8", "bytes each", "case:"]),
    (check_embedding_lookup, lookup_row_stride_of_half_d, NF4, ["the nf4 output unpacked to", "table row"]),
    (check_embedding_lookup, lookup_leaves_the_padding_unwritten, NF4,
     ["embedding_lookup: the nf4 output differs", "(padding)", "got 249 (0xf9), expected 0 (0x00)"]),
    (check_embedding_lookup, lookup_odd_tail_unwritten, dict(schemes=("fp8",)), ["the fp8 output unpacked to"]),
    (check_embedding_lookup, lookup_int8_as_bytes, dict(schemes=("int8",)),
     ["the int8 output: got", "uint8, expected", "int8 rows of"]),
    (check_ngram_embedding, ngram_embedding_row_stride_of_half_d, NF4_NGRAM,
     ["ngram_embedding: the nf4 output unpacked to", "n-gram", "table row"]),
    (check_ngram_embedding, ngram_embedding_unpacks, NF4_NGRAM,
     ["ngram_embedding: the nf4 output: got", "bfloat16, expected", "packed NF4 rows"]),
]


@pytest.mark.parametrize("check,fn,kw,words", PLANTED, ids=[p[1].__name__ for p in PLANTED])
def test_a_planted_quantized_mistake_is_caught_and_named(check, fn, kw, words):
    assert_planted_mistake_caught(check, fn, kw, words, max_examples=40)


@pytest.mark.parametrize("check,fn", [(p[0], p[1]) for p in PLANTED], ids=[p[1].__name__ for p in PLANTED])
def test_the_planted_mistakes_pass_on_float_tables(check, fn):
    """Each planted mistake is wrong on quantized tables only: a float-only check passes it."""
    check(fn, max_examples=10, schemes=())


def test_the_int8_row_scales_are_compared_first():
    """An int8 table's row scales are an ``embedding_lookup`` of a float32 ``[rows, 1]`` table (float cases
    of D = 1 check that gather too); a wrong one is named as the scales, before the values they scale."""
    table = quantized_table("int8", 20, 6, torch.Generator().manual_seed(0))
    ids = torch.tensor([[3, 4], [5, 19]])
    rows, scales = table.gather(ref.embedding_lookup, ids)
    wrong = scales.clone()
    wrong[1, 1] *= 2
    with pytest.raises(AssertionError, match=r"the gather of the int8 row scales .* differs at token 1, head 1:"):
        check_quantized(rows, rows, table, ids, dtypes=[torch.float32], name="embedding_lookup", case={},
                        where_head=lambda t, h: f"token {t}, head {h}", scales=(wrong, scales))
    check_quantized(rows, rows, table, ids, dtypes=[torch.float32], name="embedding_lookup", case={},
                    where_head=lambda t, h: f"token {t}, head {h}", scales=(scales.clone(), scales))


# ---- python -m ple check ------------------------------------------------------------------------------------

SWAPS_NIBBLES = textwrap.dedent("""
    import torch

    import ple

    def embedding_lookup(weight, ids, validate=True):      # value 2i put in the high nibble of byte i
        rows = ple.reference.embedding_lookup(weight, ids)
        if weight.dtype == torch.uint8:
            r = rows.view(ids.shape[0], ids.shape[1], weight.shape[1])
            codes = r[..., :weight.shape[1] - 4]
            r[..., :weight.shape[1] - 4] = ((codes & 0x0F) << 4) | (codes >> 4)
        return rows

    ngram_ids = ple.vectorized.ngram_ids
""")


def test_the_cli_lists_the_tables_and_names_an_nf4_failure(tmp_path, capsys):
    path = tmp_path / "my_kernels.py"
    path.write_text(SWAPS_NIBBLES)
    code = main(["check", str(path), "--max-examples", "20", "--schemes", "nf4"])
    out = capsys.readouterr().out.splitlines()
    assert code == 1, out
    lines = dict(line.split(maxsplit=1) for line in out if not line.startswith("("))
    assert lines["ngram_ids"].endswith("ok") and "tables" not in lines["ngram_ids"], out
    assert "[tables: float32, bfloat16, nf4]" in lines["embedding_lookup"], out
    assert "FAIL: embedding_lookup: the nf4 output unpacked to" in lines["embedding_lookup"], out
    code = main(["check", str(path), "--ops", "embedding_lookup", "--max-examples", "5", "--schemes", "none"])
    out = capsys.readouterr().out.splitlines()
    assert code == 0 and out[0].endswith("[tables: float32, bfloat16]  ok"), out


def test_the_cli_lists_every_scheme_by_default(capsys):
    code = main(["check", "ple.vectorized", "--ops", "embedding_lookup,ngram_embedding", "--max-examples", "4"])
    out = capsys.readouterr().out.splitlines()
    assert code == 0, out
    assert all("fp8, int8, nf4]  ok" in line for line in out) and len(out) == 2, out


@pytest.mark.parametrize("value", ["nf5", "", "fp8,q4"])
def test_the_cli_refuses_unknown_schemes(value, capsys):
    assert main(["check", "ple.vectorized", "--schemes", value]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("error: --schemes:"), err
