"""The model's checkpoint layout of a PLE layer, and the validation of one layer's tensors.

Keys, under a per-layer prefix: the Qwen4Exp model's ``model.language_model.layers.{i}.ple.`` (``i`` the
0-based decoder layer, ``ple_layer_ids[L] - 1`` for PLE index L), or, for the Engram family (``PLEConfig.engram``),
``layers.{i}.engram.`` (``i`` the demo's own 0-based layer id, ``layer_ids[L]``; `model_prefix` gives either)::

    ple_embedding.ngram_embedding.weight              [rows, D]   the table, unsharded, or
    ple_embedding.ngram_embedding.shard_{k}.weight    [n_k, D]    k = 0..parts-1; shard k holds rows
                                                                  [k*ceil(rows/parts), ...) (the last
                                                                  shards may be short or empty)
    ple_embedding.ngram_embedding.weight_scale        [1] f32     FP8 table: the per-tensor scale
    ple_embedding.ngram_embedding[.shard_{k}].weight_scale  [n, 1] f32   int8 table: per-row scales,
                                                                  sharded like the table
    (an NF4 table: the table or its shards are uint8 [n, D/2 + 4], each row its codes and float16
    scale, D even, and there is no weight_scale; its scales are checked finite as its rows are read)
    ple_embedding.layer_multipliers                   [N]   int64 \
    ple_embedding.ngram_heads_vocab_sizes             [NH]  int64  } must equal hash_params(config, L)
    ple_embedding.ngram_heads_offsets                 [NH]  int64 /
    key_proj.weight [C, E] and value_proj.weight [H, E], or kv_proj.weight [C + H, E] (key rows first);
        an FP8 projection comes with its float32 ``<name>.weight_scale``: one value, one per row
        ([rows] or [rows, 1]), or for kv_proj one per part ([2]: key rows, value rows); the loader
        dequantizes it to the model dtype
    norm_key.weight, norm_query.weight, norm_conv.weight   [C]
    conv1d.weight                                     [C, 1, K]
    key_proj.bias [C] and value_proj.bias [H], or kv_proj.bias [C + H] beside kv_proj.weight (key first):
        the Engram family only, and there required (float; never FP8)

The Engram family is saved in ple's own names above (its ``state_dict`` speaks the demo module's
keys; a checkpoint does not): the hash buffers hold its multipliers, head sizes and offsets
(``hash_params``), and its ``token_map`` lives in the config (``config.json`` and the files'
metadata), not in a tensor.

`plan_layer` checks every key of one layer against a config without reading the
table, and returns a `LayerPlan` that says where every row lives.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, NoReturn, cast

import torch

from ..config import PLEConfig
from ..quant import Scheme, scheme_of
from ..reference.hashing import hash_params
from .files import Checkpoint, TensorInfo, dtype_name

if TYPE_CHECKING:
    from ..layer import PLELayer

__all__ = [
    "TABLE", "TABLE_SCALE", "SHARD", "SHARD_SCALE", "BUFFERS", "KEY_PROJ", "VALUE_PROJ", "KV_PROJ", "NORMS",
    "CONV", "KEY_BIAS", "VALUE_BIAS", "KV_BIAS", "MODEL_PREFIX", "ENGRAM_PREFIX", "prefix_template", "decoder_layer",
    "model_prefix", "layer_prefixes", "layer_tensors", "shard_rows", "find_layers", "LayerPlan", "TablePiece",
    "plan_layer", "BufferCheck",
]

TABLE = "ple_embedding.ngram_embedding.weight"
TABLE_SCALE = "ple_embedding.ngram_embedding.weight_scale"
SHARD = "ple_embedding.ngram_embedding.shard_{k}.weight"
SHARD_SCALE = "ple_embedding.ngram_embedding.shard_{k}.weight_scale"
BUFFERS = ("ple_embedding.layer_multipliers", "ple_embedding.ngram_heads_vocab_sizes",
           "ple_embedding.ngram_heads_offsets")
KEY_PROJ, VALUE_PROJ, KV_PROJ = "key_proj.weight", "value_proj.weight", "kv_proj.weight"
NORMS = ("norm_key.weight", "norm_query.weight", "norm_conv.weight")
CONV = "conv1d.weight"
KEY_BIAS, VALUE_BIAS, KV_BIAS = "key_proj.bias", "value_proj.bias", "kv_proj.bias"
"""The Engram family's projection biases (``[C]``, ``[H]``; merged: ``[C + H]``, key first)."""
MODEL_PREFIX = "model.language_model.layers.{i}.ple."
"""The model's prefix; ``{i}`` is the 0-based decoder layer, ``ple_layer_ids[L] - 1`` for PLE index L."""
ENGRAM_PREFIX = "layers.{i}.engram."
"""The Engram family's prefix; ``{i}`` is the demo's (0-based) layer id, ``layer_ids[L]`` for PLE index L."""

_SHARD_RE = re.compile(r"^ple_embedding\.ngram_embedding\.shard_(\d+)\.(weight|weight_scale)$")
_LAYER_RE = re.compile(r"^((?:.*\.)?)ple_embedding\."
                       r"(?:ngram_embedding\.(?:shard_\d+\.)?weight|layer_multipliers)$")


def prefix_template(config: PLEConfig) -> str:
    """The family's default key prefix, to format with ``i`` (`decoder_layer`): `MODEL_PREFIX` (Qwen4Exp) or
    `ENGRAM_PREFIX` (Engram)."""
    return ENGRAM_PREFIX if config.family == "engram" else MODEL_PREFIX


def decoder_layer(config: PLEConfig, ple_layer_index: int) -> int:
    """The 0-based decoder layer of PLE index ``ple_layer_index``: ``ple_layer_ids[L] - 1`` (Qwen4Exp's ids are
    1-based), or the Engram demo's own 0-based ``layer_ids[L]``."""
    lid = config.ple_layer_ids[ple_layer_index]
    return lid if config.family == "engram" else lid - 1


def model_prefix(config: PLEConfig, ple_layer_index: int) -> str:
    """The default key prefix of PLE layer ``ple_layer_index``: ``model.language_model.layers.{i}.ple.`` (the
    Qwen4Exp model's), or ``layers.{i}.engram.`` for the Engram family (see `decoder_layer` for ``i``)."""
    return prefix_template(config).format(i=decoder_layer(config, ple_layer_index))


def layer_prefixes(config: PLEConfig, indices: list[int], prefix: str | None) -> list[str]:
    """The prefixes of PLE indices ``indices``: ``prefix`` (default `prefix_template`) formatted with ``i``
    (`decoder_layer`) and ``index`` (the PLE index); the same prefix twice is a ``ValueError`` naming ``prefix``."""
    template = prefix_template(config) if prefix is None else prefix
    out = [template.format(i=decoder_layer(config, k), index=k) for k in indices]
    if len(set(out)) != len(out):
        raise ValueError(f"prefix: {template!r} gives the same prefix to several layers; use {{i}} or {{index}}")
    return out


def layer_tensors(layer: PLELayer, *, merged_kv: bool = False) -> list[tuple[str, torch.Tensor]]:
    """Every tensor of ``layer`` but its table, by its key under the layer's prefix, as the layer holds it (not
    detached, not moved; a parameter FSDP2 shards stays a DTensor): the hash buffers, the projections (merged
    into ``kv_proj`` with ``merged_kv``) and, for the Engram family, their biases, the norms and the conv."""
    e = layer.ple_embedding
    out: list[tuple[str, torch.Tensor]] = list(zip(
        BUFFERS, (e.layer_multipliers, e.ngram_heads_vocab_sizes, e.ngram_heads_offsets), strict=True))
    kb, vb = layer.key_proj.bias, layer.value_proj.bias
    if merged_kv:
        out.append((KV_PROJ, torch.cat([layer.key_proj.weight, layer.value_proj.weight])))   # key rows first
        if kb is not None and vb is not None:
            out.append((KV_BIAS, torch.cat([kb, vb])))
    else:
        out += [(KEY_PROJ, layer.key_proj.weight), (VALUE_PROJ, layer.value_proj.weight)]
        out += [(k, b) for k, b in ((KEY_BIAS, kb), (VALUE_BIAS, vb)) if b is not None]
    out += list(zip(NORMS, (layer.norm_key.weight, layer.norm_query.weight, layer.norm_conv.weight), strict=True))
    out.append((CONV, layer.conv1d.weight))
    return out


def shard_rows(num_rows: int, parts: int) -> list[tuple[int, int]]:
    """Row ranges ``[start, stop)`` of ``parts`` shards: shard k starts at ``k * ceil(num_rows / parts)``."""
    if parts < 1:
        raise ValueError(f"parts: expected an int >= 1, got {parts}")
    size = -(-num_rows // parts)
    return [(min(k * size, num_rows), min((k + 1) * size, num_rows)) for k in range(parts)]


def _natural(s: str) -> list[int | str]:
    return [int(t) if t.isdigit() else t for t in re.split(r"(\d+)", s)]


def find_layers(ckpt: Checkpoint) -> list[str]:
    """Prefixes of the PLE layers in ``ckpt`` (those with a table, a shard or the multipliers), in layer
    order (numbers in the prefix compared as numbers)."""
    prefixes = set()
    for key in ckpt.keys():
        m = _LAYER_RE.match(key)
        if m:
            prefixes.add(m.group(1))
    return sorted(prefixes, key=_natural)


@dataclass(frozen=True)
class TablePiece:
    """Rows ``[start, stop)`` of the table are ``key`` (and, per row, ``scale_key``) in the checkpoint."""

    start: int
    stop: int
    key: str
    scale_key: str | None = None


@dataclass(frozen=True)
class BufferCheck:
    key: str
    status: str                 # "match", "mismatch", "missing"
    expected: list[int]
    found: list[int] | None


@dataclass
class LayerPlan:
    """One validated PLE layer of a checkpoint: where its tensors are and what they hold."""

    prefix: str
    config: PLEConfig
    ple_layer_index: int
    num_rows: int
    dim: int
    table_dtype: torch.dtype
    scheme: Scheme | None                    # None: a float table
    pieces: list[TablePiece]                 # in row order, covering [0, num_rows)
    sharded: bool
    scale_key: str | None                    # the per-tensor FP8 scale
    merged_kv: bool
    model_dtype: torch.dtype                 # dtype of the projections (of the norms if they are FP8)
    buffers: list[BufferCheck]
    unknown: list[str] = field(default_factory=list)   # full keys, skipped
    proj_scales: dict[str, str] = field(default_factory=dict)    # FP8 projection key -> its weight_scale key
    biases: bool = False                     # the Engram family's projection biases (KEY_BIAS / VALUE_BIAS, KV_BIAS)

    @property
    def parts(self) -> int:
        return len(self.pieces) if self.sharded else 0


def _fail(prefix: str, key: str, msg: str) -> NoReturn:
    raise ValueError(f"{prefix}{key}: {msg}")


def _expect(ckpt: Checkpoint, prefix: str, key: str, shape: tuple[int, ...], *, kind: str = "float",
            what: str = "") -> TensorInfo:
    full = prefix + key
    if full not in ckpt:
        _fail(prefix, key, f"missing from the checkpoint (expected {what or 'a tensor'} of shape "
                           f"{list(shape)})")
    info = ckpt.info(full)
    if info.shape != tuple(shape):
        _fail(prefix, key, f"expected shape {list(shape)}, got {list(info.shape)} (in {info.file.name})")
    if kind == "float" and (not info.dtype.is_floating_point or scheme_of(info.dtype) is not None):
        _fail(prefix, key, f"expected a float tensor (bfloat16, float16 or float32), got "
                           f"{dtype_name(info.dtype)}")
    if kind == "int64" and info.dtype != torch.int64:
        _fail(prefix, key, f"expected int64, got {dtype_name(info.dtype)}")
    return info


def _missing_last_shards(ckpt: Checkpoint, prefix: str, keys: list[str], rows: int, dim: int, split: int) -> None:
    """Fail naming the first missing shard when the shards found hold too few rows and are the first
    shards of a split into more parts: the config's ``split_ngram_parts``, or the fewest parts of their
    size."""
    found = [ckpt.info(prefix + k).shape for k in keys]
    have = sum(shape[0] for shape in found if len(shape) == 2)
    size = found[0][0] if found[0] else 0
    if have >= rows or not size:
        return
    for parts in dict.fromkeys((split, -(-rows // size))):
        if parts > len(keys) and [(b - a, dim) for a, b in shard_rows(rows, parts)[:len(keys)]] == found:
            _fail(prefix, SHARD.format(k=len(keys)),
                  f"missing: shards 0..{len(keys) - 1} hold {have} of the table's {rows} rows, as the first "
                  f"{len(keys)} of {parts} shards would (the config's split_ngram_parts is {split}); expected "
                  f"shards {len(keys)}..{parts - 1} too (a file of the checkpoint left out?)")


def plan_layer(ckpt: Checkpoint, config: PLEConfig, ple_layer_index: int, prefix: str, *,
               check_buffers: bool = True) -> LayerPlan:
    """Check one layer's keys, shapes and dtypes against ``config`` and return where its tensors are.

    Reads only the file headers and the three small int64 buffers. Any problem is a
    ``ValueError`` naming the key (a missing last shard too: the shards must hold the
    config's table rows). Missing buffers are allowed (the loader computes them
    from the config) and listed as ``"missing"``; buffers that differ from
    ``hash_params(config, ple_layer_index)`` are an error unless ``check_buffers=False``
    (``inspect`` reports them instead).
    """
    p = hash_params(config, ple_layer_index)
    C, H, K = config.hc_hidden_size, config.hidden_size, config.ple_conv_kernel_size
    E = cast(int, config.ple_embed_dim)          # set by PLEConfig.__post_init__
    rows, D = p.num_rows, config.ngram_head_dim
    mine = [k[len(prefix):] for k in ckpt.keys() if k.startswith(prefix)]
    known: set[str] = set()

    # ---- the hash buffers first: they tell which layer this is --------------------------------------
    checks = []
    for key, values in zip(BUFFERS, (p.multipliers, p.head_sizes, p.head_offsets), strict=True):
        known.add(key)
        want = values.tolist()
        if prefix + key not in ckpt:
            checks.append(BufferCheck(key, "missing", want, None))
            continue
        _expect(ckpt, prefix, key, (len(want),), kind="int64")
        got = ckpt.read(prefix + key).tolist()
        status = "match" if got == want else "mismatch"
        if status == "mismatch" and check_buffers:
            _fail(prefix, key, f"does not match the config (PLE index {ple_layer_index}): expected {want}, "
                               f"got {got}; wrong config, wrong PLE index, or a corrupt file")
        checks.append(BufferCheck(key, status, want, got))

    # ---- the table -------------------------------------------------------------------------------
    shards: dict[int, str] = {}
    shard_scales: dict[int, str] = {}
    for k in mine:
        m = _SHARD_RE.match(k)
        if m:
            (shards if m.group(2) == "weight" else shard_scales)[int(m.group(1))] = k
    if TABLE in mine and shards:
        _fail(prefix, TABLE, f"the table is given both whole and as {len(shards)} shards; expected one of "
                             f"the two")
    if TABLE in mine:
        keys = [TABLE]
        ranges = [(0, rows)]
    elif shards:
        parts = max(shards) + 1
        gaps = [k for k in range(parts) if k not in shards]
        if gaps:
            _fail(prefix, SHARD.format(k=gaps[0]), f"missing: shards 0..{parts - 1} were found except {gaps}")
        keys = [shards[k] for k in range(parts)]
        ranges = shard_rows(rows, parts)
        _missing_last_shards(ckpt, prefix, keys, rows, D, config.split_ngram_parts)
    else:
        _fail(prefix, TABLE, f"missing from the checkpoint (expected the table [{rows}, {D}] whole, or as "
                             f"shards {SHARD.format(k='k')})")
    dtypes = set()
    info: TensorInfo | None
    for key, (a, b) in zip(keys, ranges, strict=True):
        info = ckpt.info(prefix + key)
        width, rows_of = D, ""
        if info.dtype == torch.uint8:                            # NF4: D/2 + 4 bytes a row
            if D < 2 or D % 2:
                _fail(prefix, key, f"a uint8 (NF4) table, but the config's ngram_head_dim D = {D} is not even "
                                   f"(NF4 rows hold two values a byte; in {info.file.name})")
            width, rows_of = D // 2 + 4, "NF4 rows of D/2 + 4 bytes, "
        if info.shape != (b - a, width):
            what = f"rows [{a}, {b}) of the {rows}-row table" if key != TABLE else f"the {rows}-row table"
            _fail(prefix, key, f"expected shape {[b - a, width]} ({what}, {rows_of}D = {D}), got "
                               f"{list(info.shape)} (in {info.file.name})")
        dtypes.add(info.dtype)
    if len(dtypes) != 1:
        _fail(prefix, keys[0], f"all shards must share one dtype, got "
                               f"{sorted(dtype_name(d) for d in dtypes)}")
    table_dtype = dtypes.pop()
    scheme = scheme_of(table_dtype)
    if scheme is None and not table_dtype.is_floating_point:
        _fail(prefix, keys[0], f"expected a float, float8_e4m3fn, int8 or uint8 (NF4) table, got "
                               f"{dtype_name(table_dtype)}")
    known.update(keys)

    scale_key = None
    pieces = []
    if scheme is not None and scheme.packed:                     # NF4: the scales are in the rows
        pieces = [TablePiece(a, b, prefix + k) for k, (a, b) in zip(keys, ranges, strict=True)]
    elif scheme is not None and scheme.per_row:
        scale_keys = [TABLE_SCALE] if keys == [TABLE] else [SHARD_SCALE.format(k=k) for k in range(len(keys))]
        for sk, (a, b) in zip(scale_keys, ranges, strict=True):
            info = ckpt.info(prefix + sk) if prefix + sk in ckpt else None
            if info is None:
                _fail(prefix, sk, f"missing: an int8 table needs per-row float32 scales [{b - a}, 1]")
            if info.shape != (b - a, 1) or info.dtype != torch.float32:
                _fail(prefix, sk, f"expected float32 [{b - a}, 1] per-row scales, got "
                                  f"{dtype_name(info.dtype)} {list(info.shape)}")
        known.update(scale_keys)
        pieces = [TablePiece(a, b, prefix + k, prefix + s)
                  for k, s, (a, b) in zip(keys, scale_keys, ranges, strict=True)]
    else:
        pieces = [TablePiece(a, b, prefix + k) for k, (a, b) in zip(keys, ranges, strict=True)]
        if scheme is not None:                                   # fp8: one per-tensor scale
            if prefix + TABLE_SCALE not in ckpt:
                _fail(prefix, TABLE_SCALE, "missing: an FP8 table needs its per-tensor float32 scale")
            info = ckpt.info(prefix + TABLE_SCALE)
            if info.numel != 1 or len(info.shape) > 1 or info.dtype != torch.float32:
                _fail(prefix, TABLE_SCALE, f"expected one float32 scale ([] or [1]), got "
                                           f"{dtype_name(info.dtype)} {list(info.shape)}")
            scale_key = prefix + TABLE_SCALE
            known.add(TABLE_SCALE)
    stray = [k for k in mine if (k == TABLE_SCALE or k in shard_scales.values()) and k not in known]
    if stray:
        _fail(prefix, stray[0], f"a scale for a {dtype_name(table_dtype)} table; expected none "
                                f"(FP8 tables have one {TABLE_SCALE}, int8 tables per-row scales, NF4 "
                                f"tables none: their rows hold them)")

    # ---- projections, norms, conv ------------------------------------------------------------------
    if KV_PROJ in mine and (KEY_PROJ in mine or VALUE_PROJ in mine):
        _fail(prefix, KV_PROJ, f"found together with {KEY_PROJ} / {VALUE_PROJ}; expected the merged "
                               f"projection or the separate ones, not both")
    merged = KV_PROJ in mine
    shapes = {KV_PROJ: (C + H, E)} if merged else {KEY_PROJ: (C, E), VALUE_PROJ: (H, E)}
    proj_scales = {}
    for key, shape in shapes.items():
        full = prefix + key
        fp8 = full in ckpt and ckpt.info(full).dtype == torch.float8_e4m3fn
        _expect(ckpt, prefix, key, shape, kind="any" if fp8 else "float",
                what="the merged [key; value] projection" if key == KV_PROJ else "")
        known.add(key)
        if fp8:
            sk = key.removesuffix("weight") + "weight_scale"
            allowed = [(), (1,), (shape[0],), (shape[0], 1)] + ([(2,)] if key == KV_PROJ else [])
            info = ckpt.info(prefix + sk) if prefix + sk in ckpt else None
            if info is None or info.dtype != torch.float32 or info.shape not in allowed:
                seen = "missing" if info is None else f"{dtype_name(info.dtype)} {list(info.shape)}"
                _fail(prefix, sk, f"an FP8 {key} needs a float32 scale of shape one of "
                                  f"{[list(a) for a in allowed]}, got {seen}")
            proj_scales[key] = sk
            known.add(sk)
    bias_shapes = {KV_BIAS: (C + H,)} if merged else {KEY_BIAS: (C,), VALUE_BIAS: (H,)}
    if config.family == "engram":                                # the Engram family's projections have biases
        for bias, size in bias_shapes.items():
            _expect(ckpt, prefix, bias, size, what="the Engram family's projection bias")
            known.add(bias)
    else:
        found = [k for k in (KEY_BIAS, VALUE_BIAS, KV_BIAS) if k in mine]
        if found:
            _fail(prefix, found[0], "a projection bias, but the config is of the Qwen4Exp family, whose projections "
                                    "have none; is this an Engram checkpoint (PLEConfig.engram, family 'engram')?")
    for n in NORMS:
        norm = _expect(ckpt, prefix, n, (C,))
    _expect(ckpt, prefix, CONV, (C, 1, K))
    known.update(NORMS + (CONV,))

    unknown = [prefix + k for k in mine if k not in known]
    return LayerPlan(prefix=prefix, config=config, ple_layer_index=ple_layer_index, num_rows=rows, dim=D,
                     table_dtype=table_dtype, scheme=scheme, pieces=pieces, sharded=keys != [TABLE],
                     scale_key=scale_key, merged_kv=merged, buffers=checks, unknown=unknown,
                     model_dtype=norm.dtype if proj_scales else ckpt.info(prefix + next(iter(shapes))).dtype,
                     proj_scales=proj_scales, biases=config.family == "engram")
