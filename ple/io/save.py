"""Saving PLE layers in the model's layout; the table dtypes it takes, and the table as blocks to write.

Streams: every tensor is written from blocks of at most ``block_bytes``. The table's blocks
(`table_entries`, from a layer in memory or, for ``ple.io.convert``, a `CheckpointTable`) are
the ones `convert` re-shards or re-types too, so converting a table larger than RAM holds one
block at a time (an FP8 target reads the table twice: once for its largest magnitude, once to
quantize). What transformers would load wrong, and the ``ple_only`` mark: ``ple.io.policy``.
"""

from __future__ import annotations

import functools
import json
import os
import shutil
from collections.abc import Iterator
from pathlib import Path
from typing import TYPE_CHECKING, Any, cast

import torch

from .. import _checks
from .._deprecation import deprecated_parameter
from ..config import PLEConfig
from ..quant import SCHEMES, Scheme, dequantize, fp8_scale, quantize, scheme_of
from .files import Checkpoint, Entry, write_file, write_files
from .layout import (
    SHARD,
    SHARD_SCALE,
    TABLE,
    TABLE_SCALE,
    LayerPlan,
    layer_prefixes,
    layer_tensors,
    shard_rows,
)
from .load import BLOCK_BYTES, CONFIG_METADATA_KEY, table_blocks
from .optim_state import OPTIMIZER_DIR, optimizer_entries, write_optimizer
from .policy import mark_config, mark_metadata, refuse_unless_ple_only, transformers_problems

if TYPE_CHECKING:
    from ..layer import PLELayer
    from ..table import Table
    from .files import TableDtype

__all__ = ["save", "parse_table_dtype", "TABLE_DTYPES", "table_entries", "tensor_entry", "CheckpointTable",
           "prepare_dst", "write_checkpoint"]

TABLE_DTYPES: dict[str, torch.dtype | Scheme] = {
    "bfloat16": torch.bfloat16, "float16": torch.float16, "float32": torch.float32,
    "fp8": SCHEMES["fp8"], "int8": SCHEMES["int8"], "nf4": SCHEMES["nf4"]}


def parse_table_dtype(value: TableDtype) -> torch.dtype | Scheme | None:
    """``None`` (keep), a float ``torch.dtype``, a `Scheme`, or one of the names in ``TABLE_DTYPES``
    (a quantized dtype names its scheme: ``torch.uint8`` is NF4)."""
    if value is None or isinstance(value, Scheme):
        return value
    if isinstance(value, torch.dtype):
        s = scheme_of(value)
        if s is not None:
            return s
        if value in (torch.bfloat16, torch.float16, torch.float32):
            return value
    if isinstance(value, str) and value in TABLE_DTYPES:
        return TABLE_DTYPES[value]
    raise ValueError(f"table_dtype: expected one of {sorted(TABLE_DTYPES)} (or None to keep it), got "
                     f"{value!r}")


# ---- table sources: the rows of a table, block by block ---------------------------------------------
class _TableSource:
    """A table ``[rows, D]`` as blocks ``(values, row_scale)``; ``row_scale`` is ``[n, 1]`` (int8),
    the per-tensor ``[1]`` (fp8) or None (float, and NF4, whose blocks are packed rows ``[n, D/2 + 4]``)."""

    num_rows: int
    dim: int                                    # D, the values of a row (not an NF4 row's bytes)
    dtype: torch.dtype
    global_scale: torch.Tensor | None           # the per-tensor (fp8) scale, else None

    @property
    def scheme(self) -> Scheme | None:
        return scheme_of(self.dtype)

    def blocks(self, start: int, stop: int,
               rows_per_block: int) -> Iterator[tuple[torch.Tensor, torch.Tensor | None]]:
        raise NotImplementedError


class _MemoryTable(_TableSource):
    def __init__(self, module: Table) -> None:
        self.weight = module.weight.detach()
        self.scale = module.scale.detach() if module.scale is not None else None
        self.num_rows, self.dim = module.num_rows, module.dim
        self.dtype = self.weight.dtype
        self.global_scale = self.scale.cpu() if self.scale is not None and self.scale.dim() == 1 else None

    def blocks(self, start: int, stop: int,
               rows_per_block: int) -> Iterator[tuple[torch.Tensor, torch.Tensor | None]]:
        for a in range(start, stop, rows_per_block):
            b = min(a + rows_per_block, stop)
            scale = None
            if self.scale is not None:
                scale = self.scale[a:b] if self.scale.dim() == 2 else self.scale
                scale = scale.cpu()
            yield self.weight[a:b].cpu(), scale


class CheckpointTable(_TableSource):
    """The table of a checkpoint's layer (``plan``), read block by block."""

    def __init__(self, ckpt: Checkpoint, plan: LayerPlan) -> None:
        self.ckpt, self.plan = ckpt, plan
        self.num_rows, self.dim, self.dtype = plan.num_rows, plan.dim, plan.table_dtype
        self.global_scale = ckpt.read(plan.scale_key).reshape(1) if plan.scale_key else None

    @deprecated_parameter("block_rows", "rows_per_block", since="0.1.0")
    def blocks(self, start: int, stop: int,
               rows_per_block: int) -> Iterator[tuple[torch.Tensor, torch.Tensor | None]]:
        for _, values, scale in table_blocks(self.ckpt, self.plan, start, stop, rows_per_block):
            yield values, self.global_scale if scale is None else scale


def _floats(src: _TableSource, v: torch.Tensor, s: torch.Tensor | None, dtype: torch.dtype) -> torch.Tensor:
    """A block of ``src`` as ``dtype`` values ``[n, D]`` (a quantized block dequantized, NF4 rows unpacked)."""
    if src.scheme is None:
        return v.to(dtype)
    return dequantize(v, s, dtype)


def _amax(src: _TableSource, rows_per_block: int) -> torch.Tensor:
    """The largest magnitude of the table (exact: a max needs no float32 copy of a float table)."""
    amax = torch.zeros((), dtype=torch.float32)
    for v, s in src.blocks(0, src.num_rows, rows_per_block):
        if v.numel():
            x = v if src.scheme is None else _floats(src, v, s, torch.float32)
            amax = torch.maximum(amax, x.abs().max().float())
    return amax


def table_entries(src: _TableSource, prefix: str, parts: int, target: TableDtype, block_bytes: int) -> list[Entry]:
    """Entries of the table of one layer in ``parts`` shards (0: whole) and ``target`` dtype / scheme."""
    rows, D = src.num_rows, src.dim
    kind = parse_table_dtype(target)
    if kind is None:
        kind = src.scheme or src.dtype
    out_dtype = kind.dtype if isinstance(kind, Scheme) else kind
    rows_per_block = max(1, block_bytes // max(D * 4, 1))      # blocks pass through float32
    ranges = [(0, rows)] if parts == 0 else shard_rows(rows, parts)
    names = [TABLE] if parts == 0 else [SHARD.format(k=k) for k in range(parts)]
    same = src.scheme is not None and kind is src.scheme
    fp8 = isinstance(kind, Scheme) and not kind.per_row
    int8 = isinstance(kind, Scheme) and kind.per_row and not kind.packed
    width = kind.weight_width(D) if isinstance(kind, Scheme) else D      # NF4: D/2 + 4 bytes a row
    scale = None
    if fp8:
        scale = src.global_scale if same else fp8_scale(_amax(src, rows_per_block))

    def values(a: int, b: int) -> Iterator[torch.Tensor]:
        for v, s in src.blocks(a, b, rows_per_block):
            if same:
                yield v
            elif isinstance(kind, Scheme):
                yield quantize(_floats(src, v, s, torch.float32), kind, scale=scale)[0]
            else:
                yield _floats(src, v, s, kind)

    def row_scales(a: int, b: int) -> Iterator[torch.Tensor]:      # int8 targets only
        for v, s in src.blocks(a, b, rows_per_block):
            if same:
                yield cast(torch.Tensor, s)                           # an int8 source's blocks have scales
            else:
                yield cast(torch.Tensor, quantize(_floats(src, v, s, torch.float32), cast(Scheme, kind))[1])

    entries = []
    for k, (name, (a, b)) in enumerate(zip(names, ranges, strict=True)):
        entries.append(Entry(prefix + name, out_dtype, (b - a, width), functools.partial(values, a, b)))
        if int8:
            scale_name = TABLE_SCALE if parts == 0 else SHARD_SCALE.format(k=k)
            entries.append(Entry(prefix + scale_name, torch.float32, (b - a, 1),
                                 functools.partial(row_scales, a, b)))
    if fp8:
        fp8_scale_ = cast(torch.Tensor, scale)                   # an fp8 table has its per-tensor scale
        entries.append(Entry(prefix + TABLE_SCALE, torch.float32, (1,), lambda: iter([fp8_scale_.reshape(1)])))
    return entries


def tensor_entry(key: str, t: torch.Tensor) -> Entry:
    t = t.detach().cpu().contiguous()
    return Entry(key, t.dtype, tuple(t.shape), lambda: iter([t]))


def _layer_entries(layer: PLELayer, prefix: str, *, parts: int, merged_kv: bool, table_dtype: TableDtype,
                   block_bytes: int) -> list[Entry]:
    out = table_entries(_MemoryTable(layer.ple_embedding.ngram_embedding), prefix, parts, table_dtype, block_bytes)
    out += [tensor_entry(prefix + key, t) for key, t in layer_tensors(layer, merged_kv=merged_kv)]
    return out


def prepare_dst(path: str | os.PathLike[str], overwrite: bool) -> tuple[Path, bool]:
    """``(path, single_file)``; refuses to mix with an existing checkpoint unless ``overwrite``."""
    path = Path(path)
    single = path.suffix == ".safetensors"
    if single:
        old = [path] if path.exists() else []
    else:
        old = sorted(path.glob("*.safetensors")) if path.is_dir() else []
    if old and not overwrite:
        raise ValueError(f"path: {path} already holds a checkpoint ({len(old)} file(s)); pass overwrite=True "
                         f"(--overwrite) to replace it")
    for f in old:
        f.unlink()
    return path, single


def write_checkpoint(path: Path, single: bool, entries: list[Entry], *, metadata: dict[str, str],
                     max_file_bytes: int | None, config: PLEConfig | None, problems: list[str]) -> list[Path]:
    """Write ``entries`` to the checked destination of `prepare_dst` (with a ``config.json``, ple-only marked,
    for a directory when ``config`` is given and there is none); returns the files written."""
    if single:
        if max_file_bytes is not None:
            raise ValueError("max_file_bytes: only for a directory checkpoint, not one .safetensors path")
        path.parent.mkdir(parents=True, exist_ok=True)
        write_file(path, entries, metadata)
        return [path]
    files = write_files(path, entries, max_file_bytes=max_file_bytes, metadata=metadata)
    if config is not None and not (path / "config.json").exists():
        with open(path / "config.json", "w", encoding="utf-8") as fh:
            json.dump(mark_config(config.to_dict(), problems), fh, indent=2)
    return files


def save(layers: PLELayer | list[PLELayer] | tuple[PLELayer, ...], path: str | os.PathLike[str], *,
         prefix: str | None = None, parts: int | None = None, merged_kv: bool = False,
         table_dtype: TableDtype = None, max_file_bytes: int | None = None, block_bytes: int = BLOCK_BYTES,
         overwrite: bool = False, ple_only: bool = False, optimizer: Any = None) -> list[Path]:
    """Save one PLE layer or several (one config) in the model's layout; returns the files written.

    ``path``: a ``.safetensors`` file, or a directory that gets ``model.safetensors``, or
    ``model-0000i-of-0000n.safetensors`` files of at most ``max_file_bytes`` plus
    ``model.safetensors.index.json``, and a ``config.json``. The config is also stored in
    each file's metadata (``ple.config``), so `load_layer` needs no config argument.

    ``prefix``: a key prefix, formatted with ``i`` (0-based decoder layer,
    ``ple_layer_ids[L] - 1``; the Engram family's own 0-based ``layer_ids[L]``) and ``index``
    (the PLE index L); default the model's ``model.language_model.layers.{i}.ple.``, and
    ``layers.{i}.engram.`` for the Engram family (``ple.io.layout``). ``parts``: table shards
    (default the config's ``split_ngram_parts``; 0 writes the table whole as
    ``ple_embedding.ngram_embedding.weight``). ``merged_kv``: write one
    ``kv_proj.weight`` (``[C + H, E]``, key rows first) instead of ``key_proj`` and
    ``value_proj`` (an Engram layer's biases too: one ``kv_proj.bias`` ``[C + H]``). ``table_dtype``:
    keep (None), ``"bfloat16"`` / ``"float16"`` / ``"float32"``, or quantize: ``"fp8"`` / ``"int8"`` /
    ``"nf4"`` (``ple.quant``; an NF4 table is uint8 ``[rows, D/2 + 4]`` rows holding their own float16
    scales, and has no ``weight_scale``).

    An Engram-family layer is saved in ple's names (not its ``state_dict``'s demo keys), with its
    projection biases ``key_proj.bias`` / ``value_proj.bias``; the config (``family``,
    ``engram_vocab_size``, ``token_map``) goes in ``config.json`` and the files' metadata.

    transformers loads a float table with separate projections right, and would load a
    quantized table or a merged ``kv_proj`` wrong (``ple.io.policy``): those are a
    ``ValueError`` unless ``ple_only=True``, which writes them with ``"ple_only"`` (the
    reasons) in ``config.json`` and ``ple.only`` in each file's metadata, as `inspect` reports.
    transformers has no Engram model at all: an Engram checkpoint is always written so marked,
    with no ``ple_only=True`` needed (there is no form of it transformers loads).

    ``optimizer``: a ``ple.optim`` optimizer training these layers' tables (all of them, and no
    other): its state is written beside the table, in ``path/optimizer/`` in the table's shard
    layout (``ple.io.optim_state``; transformers and `load_layer` ignore it), for
    ``ple.io.load_optimizer``. Needs a directory ``path``.
    """
    layers = list(layers) if isinstance(layers, (list, tuple)) else [layers]
    if not layers:
        raise ValueError("layers: expected at least one PLELayer")
    cfg = layers[0].config
    if any(layer.config != cfg for layer in layers):
        raise ValueError("layers: expected layers of one config")
    parts = cfg.split_ngram_parts if parts is None else _checks.int_arg("parts", parts, minimum=0)
    _checks.int_arg("block_bytes", block_bytes, minimum=1)
    if optimizer is None and any(la.table.is_dtensor for la in layers):     # (with one: the optimizer's message)
        raise ValueError("layers: a sharded (DTensor) table is saved piece by piece on every rank with "
                         "ple.distributed.save_sharded(layers, path, optimizer=...)")
    for la in layers:
        if la.table.weight.device.type == "meta":              # e.g. a DiskTable: its values are in its files
            raise ValueError(f"layers: a table whose values are not in memory ({type(la.table).__name__}) is "
                             f"not saved from the layer; convert its checkpoint with ple.io.convert")
    table_dtype = parse_table_dtype(table_dtype)
    schemes = {table_dtype if table_dtype is not None else scheme_of(la.table.weight.dtype) for la in layers}
    scheme = next((s for s in schemes if isinstance(s, Scheme)), None)
    problems = transformers_problems(scheme, merged_kv, family=cfg.family)
    refuse_unless_ple_only(problems, ple_only)
    prefixes = layer_prefixes(cfg, [layer.ple_layer_index for layer in layers], prefix)
    if optimizer is not None:
        if str(path).endswith(".safetensors"):
            raise ValueError("optimizer: its state is saved in the checkpoint directory's optimizer/ folder; pass "
                             "a directory path")
        optim_entries, optim_meta = optimizer_entries(optimizer, layers, prefixes, parts)
    path, single = prepare_dst(path, overwrite)
    entries = []
    with torch.no_grad():
        for layer, pfx in zip(layers, prefixes, strict=True):
            entries += _layer_entries(layer, pfx, parts=parts, merged_kv=merged_kv, table_dtype=table_dtype,
                                      block_bytes=block_bytes)
    meta = mark_metadata({"format": "pt", CONFIG_METADATA_KEY: json.dumps(cfg.to_dict())}, problems)
    files = write_checkpoint(path, single, entries, metadata=meta, max_file_bytes=max_file_bytes, config=cfg,
                             problems=problems)
    if optimizer is not None:
        files += write_optimizer(path, optim_entries, optim_meta, max_file_bytes)
    elif not single and (path / OPTIMIZER_DIR).is_dir():         # an older save's state is not this one's
        shutil.rmtree(path / OPTIMIZER_DIR)
    return files
