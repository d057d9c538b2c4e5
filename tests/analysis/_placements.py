"""Helpers of the ``ple.analysis`` layer tests (test_probe.py, test_ablate.py, test_table_diff.py): one layer's
values with its table held in each placement, the table's values as lookups give them, a twin layer with other
table values, and a few serving steps.

Imported as ``from analysis._placements import ...`` (``tests/`` is on the path: ``pythonpath`` in pyproject.toml).
"""

from __future__ import annotations

import copy
from pathlib import Path

import torch

import ple
import ple.io as pio
from ple.state import PLECache
from ple.testing.serving import step_each

TINY = ple.PLEConfig.preset("tiny")          # 6128 rows of D = 4 in 6 heads, C = 48

# Where a table can be: in memory (float, or quantized), in host memory, on disk (float, or quantized).
PLACEMENTS = ("dense", "fp8", "int8", "nf4", "host", "disk", "disk-int8", "disk-nf4")


def inputs(seed: int, dtype: torch.dtype, B: int = 2, L: int = 9) -> tuple[torch.Tensor, torch.Tensor]:
    """Hidden states ``[B, L, C]`` in ``dtype`` and token ids ``[B, L]`` (an EOS among them)."""
    gen = torch.Generator().manual_seed(seed)
    h = torch.randn(B, L, TINY.hc_hidden_size, generator=gen, dtype=torch.float64).to(dtype)
    ids = torch.randint(0, TINY.vocab_size, (B, L), generator=gen)
    ids[0, 3] = TINY.eos_token_id
    return h, ids


def placed(layer: ple.PLELayer, placement: str, tmp_path: Path) -> ple.PLELayer:
    """A layer with ``layer``'s values (and backend) whose table is held as ``placement`` (`PLACEMENTS`);
    quantized placements hold the quantization of ``layer``'s table. ``layer`` is left as it was."""
    if placement.startswith("disk"):
        scheme = placement.partition("-")[2] or None
        src = copy.deepcopy(layer)
        if scheme is not None:
            src.ple_embedding.quantize_(scheme)
        path = tmp_path / placement
        pio.save(src, path, ple_only=scheme is not None, overwrite=True)
        return pio.load_layer(path, ple_layer_index=layer.ple_layer_index, offload="disk",
                              backend=layer.backend, cache_bytes=1000)
    out = copy.deepcopy(layer)
    if placement in ("fp8", "int8", "nf4"):
        out.ple_embedding.quantize_(placement)
    elif placement == "host":
        out.table.offload_(pin=False)
    else:
        assert placement == "dense", placement
    return out


def table_values(layer: ple.PLELayer) -> torch.Tensor:
    """Every row of ``layer``'s table as its lookups give them, float64 ``[rows, D]`` (through ``layer.embed``,
    one row a lookup: dequantized, an overlay's rows in)."""
    ids = torch.arange(layer.table.num_rows).view(-1, 1)
    with torch.no_grad():
        return layer.embed(ids, torch.float64)


def twin(layer: ple.PLELayer, values: torch.Tensor) -> ple.PLELayer:
    """A layer of ``layer``'s config, backend, dtype and non-table values whose table is a dense one holding
    ``values`` ``[rows, D]`` rounded to the layer's dtype."""
    dtype = layer.key_proj.weight.dtype
    out = ple.PLELayer(layer.config, layer.ple_layer_index, backend=layer.backend, dtype=dtype)
    rest = {k: v for k, v in layer.state_dict().items() if not k.startswith("ple_embedding.ngram_embedding.")}
    missing, unexpected = out.load_state_dict(rest, strict=False)
    assert missing == ["ple_embedding.ngram_embedding.weight"] and not unexpected
    with torch.no_grad():
        out.table.weight.copy_(values.to(dtype))
    return out


def head_spans(layer: ple.PLELayer) -> list[tuple[int, int]]:
    """``(first row, rows)`` of each hash head."""
    emb = layer.ple_embedding
    return list(zip(emb.ngram_heads_offsets.tolist(), emb.ngram_heads_vocab_sizes.tolist(), strict=True))


def serve(layer: ple.PLELayer, seed: int = 0) -> torch.Tensor:
    """The outputs of three serving steps (two prefills; two decodes; a decode and a prefill) of ``layer``
    on a new cache, the hidden states drawn from ``seed``: ``[tokens, C]``, steps in order."""
    dtype = layer.key_proj.weight.dtype
    cache = PLECache(layer.config, num_slots=4, num_layers=layer.ple_layer_index + 1, dtype=dtype)
    slots = [cache.allocate(), cache.allocate()]
    gen = torch.Generator().manual_seed(seed)
    plans = [[("prefill", 0, [5, 6, 7, 8, 9]), ("prefill", 1, [11, 12, 13])],
             [("decode", 0, 14), ("decode", 1, 15)],
             [("decode", 0, 16), ("prefill", 1, [17, TINY.eos_token_id, 18])]]
    outs = []
    with torch.no_grad():
        for plan in plans:
            outs += step_each([layer], [cache], [slots], plan, generator=gen, dtype=dtype)
    return torch.cat(outs)
