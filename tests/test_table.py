"""``ple.table``: one table abstraction (dense, quantized, host-offloaded) behind ``PLELayer(table=...)``;
the package's attributes after a bare ``import ple``; the layer's own argument errors on both backends."""

from __future__ import annotations

import subprocess
import sys

import pytest
import torch

from ple import PLEConfig, PLELayer
from ple.reference import embedding_lookup
from ple.table import DenseTable, QuantizedTable, Table, gather_raw
from ple.testing.layers import random_layer
from ple.testing.numerics import assert_bitwise_equal

TINY = PLEConfig.preset("tiny")
BACKENDS = ["reference", "torch", pytest.param("triton", marks=pytest.mark.interpreter)]


def test_bare_import_exposes_the_documented_subpackages():
    """docs/spec.md section 7: after ``import ple`` alone, ple.reference, ple.state, ple.io and ple.testing work."""
    code = ("import sys, ple\n"
            "assert ple.state.PLECache and ple.io.load_layer and ple.reference.ple_conv and ple.testing\n"
            "assert 'ple.fast' not in sys.modules, 'ple.fast (Triton) is loaded on first use only'\n"
            "assert ple.fast.ple_conv is not None\n")
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr


def test_layer_holds_one_table_and_embed_asks_it():
    layer = random_layer(TINY, 0, torch.float32, seed=1)
    assert isinstance(layer.table, DenseTable) and layer.table is layer.ple_embedding.ngram_embedding
    ids = torch.randint(0, layer.table.num_rows, (5, TINY.num_ngram_heads))
    assert_bitwise_equal(layer.embed(ids, torch.float32), embedding_lookup(layer.table.weight, ids).detach(),
                         name="dense rows")


@pytest.mark.parametrize("scheme", ["fp8", "int8"])
def test_layer_built_with_a_quantized_table(scheme):
    """``PLELayer(table=...)`` takes the table as it is: no dense table is built first."""
    donor = random_layer(TINY, 0, torch.bfloat16, seed=2)
    table = QuantizedTable.from_float(donor.table.weight.detach(), scheme)
    torch.manual_seed(0)
    layer = PLELayer(TINY, 0, dtype=torch.bfloat16, table=table)
    assert layer.table is table and "ple_embedding.ngram_embedding.weight" not in dict(layer.named_parameters())
    ids = torch.randint(0, table.num_rows, (7, TINY.num_ngram_heads))
    rows, scale = gather_raw(table.weight, table.weight_scale, ids, embedding_lookup)
    from ple.quant import dequantize_rows

    assert_bitwise_equal(layer.embed(ids, torch.bfloat16), dequantize_rows(rows, scale, torch.bfloat16),
                         name="quantized rows")


def test_table_argument_errors():
    rows = PLELayer(TINY).table.num_rows
    with pytest.raises(ValueError, match="^table: .*6128 rows of 4, got 10 rows of 4"):
        PLELayer(TINY, table=DenseTable(10, TINY.ngram_head_dim))
    with pytest.raises(ValueError, match="^table: "):
        PLELayer(TINY, table=DenseTable(rows, TINY.ngram_head_dim + 1))
    with pytest.raises(TypeError, match="^table: expected a ple.table.Table"):
        PLELayer(TINY, table=torch.nn.Embedding(rows, TINY.ngram_head_dim))


def test_offloaded_table_gathers_on_the_host_and_keeps_gradients():
    layer = random_layer(TINY, 0, torch.float32, seed=3)
    ids = torch.randint(0, layer.table.num_rows, (4, TINY.num_ngram_heads))
    expected = layer.embed(ids, torch.float32).detach()
    layer.table.offload_(pin=False)
    assert isinstance(layer.table, Table) and layer.table.weight.device.type == "cpu"
    got = layer.embed(ids, torch.float32)
    assert_bitwise_equal(got.detach(), expected, name="offloaded rows")
    got.sum().backward()
    assert layer.table.weight.grad is not None and layer.table.weight.grad.abs().sum() > 0


@pytest.mark.parametrize("backend", BACKENDS)
def test_forward_index_and_mask_dtypes(backend):
    """docs/spec.md section 9: ``input_ids`` int32/int64 only; ``attention_mask`` bool, integer or float (non-zero
    keeps), complex refused; on either backend."""
    layer = random_layer(TINY, 0, torch.float32, seed=4)
    layer.set_backend(backend)
    gen = torch.Generator().manual_seed(5)
    B, L = 2, 6
    h = torch.randn(B, L, TINY.hc_hidden_size, generator=gen)
    ids = torch.randint(0, 200, (B, L), generator=gen)
    mask = torch.ones(B, L, dtype=torch.bool)
    mask[1, :2] = False
    with torch.no_grad():
        expected = layer(h, ids, mask)
        assert_bitwise_equal(layer(h, ids.to(torch.int32), mask), expected, name="int32 ids")
        for m in (mask.float(), mask.to(torch.bfloat16) * 0.5, mask.long() * 3):
            assert_bitwise_equal(layer(h, ids, m), expected, name=f"{m.dtype} mask")
        for bad in (torch.uint8, torch.int16, torch.bool, torch.float32, torch.complex64):
            with pytest.raises(TypeError, match="^input_ids: "):
                layer(h, ids.to(bad), mask)
        with pytest.raises(TypeError, match="^attention_mask: "):
            layer(h, ids, mask.to(torch.complex64))
