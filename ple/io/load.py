"""Loading PLE layers, or rows of their tables, from safetensors checkpoints in the model's layout.

`load_layer` (a whole layer) and `read_table_rows` (rows ``[start, end)`` of one
layer's table, e.g. one rank's shard) share one path: `Checkpoint` reads the headers,
`ple.io.layout.plan_layer` checks every key of the layer against the config, and
`table_blocks` reads only the rows asked for, from only the shards that hold them.
"""

from __future__ import annotations

import json
import os
import warnings
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any, Literal, cast, overload

import torch

from .. import _checks
from .._deprecation import deprecated_parameter
from ..config import PLEConfig
from ..layer import PLELayer
from ..quant import Scheme, nf4_unpack
from ..reference.hashing import hash_params
from ..table import QuantizedTable, Table
from .disk_table.table import DISK_CACHE_BYTES, DiskTable
from .disk_table.training import OVERLAY_BYTES, TableOverlay, base_fingerprint, check_overlay_args
from .files import Checkpoint, dtype_name
from .layout import (
    BUFFERS,
    CONV,
    KEY_BIAS,
    KEY_PROJ,
    KV_BIAS,
    KV_PROJ,
    NORMS,
    TABLE,
    TABLE_SCALE,
    VALUE_BIAS,
    VALUE_PROJ,
    LayerPlan,
    find_layers,
    model_prefix,
    plan_layer,
)

if TYPE_CHECKING:
    from torch.types import Device
    from typing_extensions import Unpack

    from .files import CheckpointSource, ConfigSource, LoadOptions, Offload

__all__ = ["LoadReport", "load_layer", "load_layers", "resolve_config", "select_prefix", "identify_index",
           "read_table", "read_table_rows", "table_blocks", "CONFIG_METADATA_KEY", "BLOCK_BYTES"]

CONFIG_METADATA_KEY = "ple.config"
"""safetensors metadata key under which ``ple.io.save`` stores the config (JSON)."""

BLOCK_BYTES = 256 << 20
"""Default largest block read (or written) at once: tables move through memory in blocks this size."""


@dataclass
class LoadReport:
    """What `load_layer` found: the layer's prefix and layout, and what it skipped or filled in."""

    prefix: str
    ple_layer_index: int
    table: str                                   # e.g. "4 shards, bfloat16" or "whole, float8_e4m3fn"
    merged_kv: bool
    skipped: list[str] = field(default_factory=list)           # unknown (legacy) keys, not loaded
    computed_buffers: list[str] = field(default_factory=list)  # hash buffers absent from the file


# ---- config and prefix ----------------------------------------------------------------------------
def resolve_config(ckpt: Checkpoint, config: ConfigSource = None) -> PLEConfig | None:
    """``config`` as a `PLEConfig` (a PLEConfig, a dict, a preset name or a JSON path), else the config
    saved in the checkpoint's metadata, else ``config.json`` next to its files, else None."""
    if isinstance(config, PLEConfig):
        return config
    if isinstance(config, dict):
        return PLEConfig.from_dict(config)
    if isinstance(config, str) and not config.endswith(".json") and not Path(config).exists():
        return PLEConfig.preset(config)
    if config is not None:
        if not Path(config).is_file():
            raise ValueError(f"config: {config} is not a file (expected a config.json path or a preset name)")
        return PLEConfig.from_json(config)
    raw = ckpt.metadata.get(CONFIG_METADATA_KEY)
    if raw is not None:
        return PLEConfig.from_dict(json.loads(raw))
    for d in dict.fromkeys([ckpt.root] + [f.parent for f in ckpt.files]):
        path = d / "config.json"
        if path.exists():
            try:
                return PLEConfig.from_json(path)
            except (ValueError, TypeError) as e:
                raise ValueError(f"config: {path} is not a PLE model config: {e}") from None
    return None


def _require_config(ckpt: Checkpoint, config: ConfigSource) -> PLEConfig:
    cfg = resolve_config(ckpt, config)
    if cfg is None:
        raise ValueError(f"config: not given, and the checkpoint at {ckpt.root} has neither a saved config "
                         f"nor a config.json; pass config= (a PLEConfig, a config.json path or a preset "
                         f"name)")
    return cfg


def identify_index(ckpt: Checkpoint, prefix: str, config: PLEConfig) -> int | None:
    """The PLE index whose multipliers the layer at ``prefix`` holds, or None (absent or matching none)."""
    key = prefix + BUFFERS[0]
    if key not in ckpt or ckpt.info(key).dtype != torch.int64:
        return None
    got = ckpt.read(key).tolist()
    for index in range(config.num_ple_layers):
        if hash_params(config, index).multipliers.tolist() == got:
            return index
    return None


def select_prefix(ckpt: Checkpoint, config: PLEConfig, ple_layer_index: int,
                  prefix: str | None = None) -> str:
    """The prefix of PLE layer ``ple_layer_index`` in ``ckpt``.

    An explicit ``prefix`` wins. Otherwise: the only layer of a one-layer checkpoint;
    else the layer whose multipliers are those of ``ple_layer_index``; else, when the
    checkpoint holds as many layers as the config, the one at that position.
    """
    layers = find_layers(ckpt)
    if prefix is not None:
        if not isinstance(prefix, str):
            raise TypeError(f"prefix: expected a str, got {type(prefix).__name__}")
        if not any(k.startswith(prefix) for k in ckpt.keys()):
            raise ValueError(f"prefix: no key starts with {prefix!r}; PLE layers found: {layers}")
        return prefix
    if not layers:
        raise ValueError(f"path: no PLE layer in the checkpoint at {ckpt.root} (no key ending in {TABLE}, "
                         f"ple_embedding.ngram_embedding.shard_{{k}}.weight or {BUFFERS[0]})")
    if len(layers) == 1:
        return layers[0]
    for p in layers:
        if identify_index(ckpt, p, config) == ple_layer_index:
            return p
    if len(layers) == config.num_ple_layers:
        return layers[ple_layer_index]
    if model_prefix(config, ple_layer_index) in layers:
        return model_prefix(config, ple_layer_index)
    raise ValueError(f"prefix: the checkpoint holds {len(layers)} PLE layers {layers} and none is "
                     f"recognisably PLE index {ple_layer_index} of the config ({config.num_ple_layers} "
                     f"layers); pass prefix=")


# ---- reading ------------------------------------------------------------------------------------
def _rows_per_block(row_bytes: int, block_bytes: int) -> int:
    return max(1, block_bytes // max(row_bytes, 1))


def _open_layer(path: CheckpointSource, config: ConfigSource, ple_layer_index: int,
                prefix: str | None) -> tuple[Checkpoint, LayerPlan]:
    """The checkpoint at ``path`` and the checked plan of PLE layer ``ple_layer_index`` in it."""
    ckpt = Checkpoint.open(path)
    cfg = _require_config(ckpt, config)
    _checks.int_arg("ple_layer_index", ple_layer_index, minimum=0)
    if ple_layer_index >= cfg.num_ple_layers:
        raise ValueError(f"ple_layer_index: the config has {cfg.num_ple_layers} PLE layer(s), got "
                         f"{ple_layer_index}")
    pfx = select_prefix(ckpt, cfg, ple_layer_index, prefix)
    return ckpt, plan_layer(ckpt, cfg, ple_layer_index, pfx)


def _check_nf4_scales(ckpt: Checkpoint, key: str, rows: torch.Tensor, first: int) -> None:
    """NF4 rows ``rows`` (rows ``first..`` of ``key``) must hold finite float16 scales: else a ``ValueError``
    naming the key, the row and the file."""
    scale = nf4_unpack(rows)[1]
    bad = (~torch.isfinite(scale)).nonzero()
    if bad.numel():
        r = int(bad[0])
        raise ValueError(f"{key}: row {first + r}'s NF4 scale is {float(scale[r])} (bytes {rows.shape[1] - 4}, "
                         f"{rows.shape[1] - 3} of the row), expected a finite float16; a damaged file? (in "
                         f"{ckpt.info(key).file})")


@deprecated_parameter("block_rows", "rows_per_block", since="0.1.0")
def table_blocks(ckpt: Checkpoint, plan: LayerPlan, start: int, stop: int,
                 rows_per_block: int) -> Iterator[tuple[int, torch.Tensor, torch.Tensor | None]]:
    """Rows ``[start, stop)`` of the table of ``plan``, in row order and blocks of at most ``rows_per_block``
    (the keyword ``block_rows=`` still works and warns: deprecated):
    ``(first row, values, per-row scales [n, 1] or None)``. Only the shards holding those rows are read,
    and of them only those rows. NF4 ``values`` are the packed rows ``[n, D/2 + 4]``; each block's
    float16 scales are checked finite as it is read (else a ``ValueError`` naming the key, row and file)."""
    packed = plan.scheme is not None and plan.scheme.packed
    for piece in plan.pieces:
        a, b = max(start, piece.start), min(stop, piece.stop)
        for lo in range(a, b, max(rows_per_block, 1)):
            hi = min(lo + rows_per_block, b)
            values = ckpt.read(piece.key, lo - piece.start, hi - piece.start)
            if packed:
                _check_nf4_scales(ckpt, piece.key, values, lo - piece.start)
            scale = None
            if piece.scale_key is not None:
                scale = ckpt.read(piece.scale_key, lo - piece.start, hi - piece.start)
            yield lo, values, scale


def _read_rows(ckpt: Checkpoint, plan: LayerPlan, start: int, stop: int, *, dtype: torch.dtype | None,
               device: Device, pin: bool, block_bytes: int) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Rows ``[start, stop)`` of the table into one preallocated tensor: ``(weight, scale or None)``."""
    quant = plan.scheme is not None
    tdtype = plan.table_dtype if quant or dtype is None else dtype
    width = plan.scheme.weight_width(plan.dim) if plan.scheme is not None else plan.dim    # NF4: D/2 + 4
    weight = torch.empty((stop - start, width), dtype=tdtype, device=device, pin_memory=pin)
    scale = None
    if plan.scheme is not None and plan.scheme.packed:  # NF4: the scales are in the rows
        pass
    elif plan.scheme is not None and plan.scheme.per_row:
        scale = torch.empty((stop - start, 1), dtype=torch.float32, device=device, pin_memory=pin)
    elif plan.scheme is not None:                       # fp8: its per-tensor scale (checked by plan_layer)
        # A copy: what the library reads may be a view of its mapping of the file (Checkpoint.read).
        scale = ckpt.read(cast(str, plan.scale_key)).reshape(1).to(device, copy=True)
    n = _rows_per_block(width * plan.table_dtype.itemsize, block_bytes)
    for a, values, row_scale in table_blocks(ckpt, plan, start, stop, n):
        weight[a - start: a - start + values.shape[0]].copy_(values)
        if row_scale is not None:                       # per-row scales: scale was made above
            cast(torch.Tensor, scale)[a - start: a - start + values.shape[0]].copy_(row_scale)
    return weight, scale


def read_table(ckpt: Checkpoint, plan: LayerPlan, *, dtype: torch.dtype | None = None, device: Device = None,
               pin: bool = False, block_bytes: int = BLOCK_BYTES) -> tuple[torch.Tensor, torch.Tensor | None]:
    """The table of ``plan`` read into one preallocated ``[rows, D]`` tensor: ``(weight, scale or None)``.

    Shards are read block by block (at most ``block_bytes`` at a time) straight into
    the destination, which may be a GPU tensor or pinned host memory, so the table is
    never held twice. A float table is cast to ``dtype`` (default: its own); a quantized
    one keeps its dtype and comes with its float32 scale(s). The rows
    ``[0, rows)`` of `read_table_rows`.
    """
    return _read_rows(ckpt, plan, 0, plan.num_rows, dtype=dtype, device=device, pin=pin,
                      block_bytes=block_bytes)


def read_table_rows(path: CheckpointSource, config: ConfigSource = None, ple_layer_index: int = 0, *,
                    start: int = 0, end: int | None = None, prefix: str | None = None, device: Device = None,
                    block_bytes: int = BLOCK_BYTES) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Rows ``[start, end)`` of PLE layer ``ple_layer_index``'s table: ``(weight, weight_scale)``.

    ``path``, ``config``, ``ple_layer_index`` and ``prefix`` are as for `load_layer`,
    and so is the checking: every key of the layer (hash buffers, shapes, the shard
    count and sizes, scales, the projections, norms and conv) is checked against the
    config before any table row is read, and any problem is a ``ValueError`` naming
    the key (or the missing shard, or the file). Hash buffers absent from the file and
    unknown keys under the prefix are not errors (`load_layer` computes the one and
    skips the other, with warnings). ``end`` defaults to the table's row count;
    ``0 <= start <= end <= rows`` or a ``ValueError``.

    Only the shards overlapping ``[start, end)`` are read, and of them only those rows,
    block by block (at most ``block_bytes`` at a time) into one tensor on ``device``
    (default: the CPU). ``weight`` is ``[end - start, D]`` in the checkpoint's dtype;
    ``weight_scale`` is None for a float table, the rows' per-row float32 scales
    ``[end - start, 1]`` for an int8 table, or the per-tensor float32 scale ``[1]`` for
    an FP8 table; an NF4 table's ``weight`` is its packed uint8 rows ``[end - start, D/2 + 4]``
    and ``weight_scale`` None.
    """
    for name, value in (("start", start), ("end", 0 if end is None else end)):
        if isinstance(value, bool) or not isinstance(value, int):
            raise TypeError(f"start, end: expected ints (end may be None), got {name} = {value!r}")
    _checks.int_arg("block_bytes", block_bytes, minimum=1)
    ckpt, plan = _open_layer(path, config, ple_layer_index, prefix)
    end = plan.num_rows if end is None else end
    if not 0 <= start <= end <= plan.num_rows:
        raise ValueError(f"start, end: expected 0 <= start <= end <= {plan.num_rows} (the table's rows), "
                         f"got {start}, {end}")
    device = torch.device(device) if device is not None else torch.device("cpu")
    return _read_rows(ckpt, plan, start, end, dtype=None, device=device, pin=False, block_bytes=block_bytes)


def _state_dict(ckpt: Checkpoint, plan: LayerPlan, *, device: torch.device, dtype: torch.dtype,
                table_device: torch.device, pin: bool, block_bytes: int,
                table: bool = True) -> dict[str, torch.Tensor]:
    """The layer's tensors by state-dict key; ``table=False`` leaves the table (and its scale) out."""
    cfg = plan.config
    p = plan.prefix

    def small(key: str) -> torch.Tensor:
        t = ckpt.read(p + key)
        if key in plan.proj_scales:                            # an FP8 projection: dequantize
            scale = ckpt.read(p + plan.proj_scales[key]).float()
            if key == KV_PROJ and scale.numel() == 2:           # merged kv_proj: one scale per part
                scale = torch.cat([scale[:1].expand(cfg.hc_hidden_size), scale[1:].expand(cfg.hidden_size)])
            scale = scale.reshape(-1, 1) if scale.numel() > 1 else scale.reshape(())
            t = t.float() * scale
        # A copy: what the library reads may be a view of its mapping of the file, and the layer must not
        # change (or crash, SIGBUS) when the file is truncated or rewritten after loading.
        return t.to(device=device, dtype=dtype, copy=True)

    sd: dict[str, torch.Tensor] = {}
    if table:
        weight, scale = read_table(ckpt, plan, dtype=dtype, device=table_device, pin=pin, block_bytes=block_bytes)
        sd[TABLE] = weight
        if scale is not None:
            per_row = cast(Scheme, plan.scheme).per_row             # a scale comes with a quantized table
            sd[TABLE_SCALE] = scale if per_row else scale.to(device)
    for check in plan.buffers:
        values = check.found if check.found is not None else check.expected
        sd[check.key] = torch.tensor(values, dtype=torch.int64, device=device)
    C = cfg.hc_hidden_size
    pairs = [(KEY_PROJ, VALUE_PROJ, KV_PROJ)] + ([(KEY_BIAS, VALUE_BIAS, KV_BIAS)] if plan.biases else [])
    for key, value, merged in pairs:                            # the weights, then the Engram family's biases
        if plan.merged_kv:                                      # one tensor, the key's rows first
            both = small(merged)
            sd[key], sd[value] = both[:C].clone(), both[C:].clone()
        else:
            sd[key], sd[value] = small(key), small(value)
    for key in NORMS + (CONV,):
        sd[key] = small(key)
    return sd


def _assign(layer: PLELayer, sd: dict[str, torch.Tensor], device: torch.device) -> None:
    """Put ``sd`` (ple's own names, `_state_dict`) into ``layer``, built on ``meta``, strictly; an Engram-family
    layer's ``token_map`` buffer, which no checkpoint holds (the config does), is made on ``device``."""
    layer.load_state_dict(sd, strict=True, assign=True)
    tmap = hash_params(layer.config, layer.ple_layer_index).token_map
    if tmap is not None:
        layer.ple_embedding.token_map = tmap.to(device)


@overload
def load_layer(path: CheckpointSource, config: ConfigSource = None, ple_layer_index: int = 0, *,
               return_report: Literal[False] = False, **options: Unpack[LoadOptions]) -> PLELayer: ...
@overload
def load_layer(path: CheckpointSource, config: ConfigSource = None, ple_layer_index: int = 0, *,
               return_report: Literal[True], **options: Unpack[LoadOptions]) -> tuple[PLELayer, LoadReport]: ...
def load_layer(path: CheckpointSource, config: ConfigSource = None, ple_layer_index: int = 0, *,
               prefix: str | None = None, backend: str = "reference", device: Device = None,
               dtype: torch.dtype | None = None, offload: Offload = False, cache_bytes: int | None = None,
               block_bytes: int = BLOCK_BYTES, overlay: str | os.PathLike[str] | None = None,
               overlay_bytes: int | None = None, overlay_dtype: torch.dtype | None = None,
               return_report: bool = False) -> PLELayer | tuple[PLELayer, LoadReport]:
    """Load PLE layer ``ple_layer_index`` from a safetensors checkpoint.

    ``path``: a ``.safetensors`` file, a directory of them (with or without
    ``model.safetensors.index.json``), the index file itself, a list of files, or a
    `Checkpoint`. ``config``: a `PLEConfig`,
    a dict, a ``config.json`` path or a preset name; default: the config saved in the
    checkpoint, else ``config.json`` beside it. ``prefix``: the layer's key prefix
    (default: found, see `select_prefix`; the model's is
    ``model.language_model.layers.{i}.ple.``, an Engram checkpoint's ``layers.{i}.engram.``).
    An Engram-family config (``PLEConfig.engram``, kept in the checkpoint by ``save``) loads an
    Engram layer, its projection biases included; every placement, quantized table and the
    disk table's overlay work for it as for the Qwen4Exp family.

    Every key is checked before anything large is read: a missing or mis-shaped tensor,
    a table given both whole and sharded or with a missing shard (the last one too),
    hash buffers that differ from the config, or a truncated file raise ``ValueError``
    naming the key (a file, by its path).
    Unknown keys under the prefix are skipped with a warning; hash buffers absent from
    the file are computed from the config, with a warning.

    The table (whole, or ``split_ngram_parts``-style shards) is read block by block into
    one preallocated tensor; FP8, int8 and NF4 tables stay quantized (``ple.quant``; an NF4
    table's float16 row scales are checked finite as its blocks are read), wherever ``offload``
    puts them (an NF4 table in host memory or on disk stays packed, ``D/2 + 4`` bytes a row, and
    only the rows gathered are unpacked; read from disk, each row's scale is checked finite as
    the row is first read). A merged ``kv_proj.weight`` is split into ``key_proj`` /
    ``value_proj``. ``dtype``: the dtype of the float tensors (default: that of the
    projections in the file). ``offload``: keep the table in host memory, pinned where CUDA
    exists (``ple.offload``), and put the rest on ``device`` (``offload=True`` or
    ``"host"``); ``offload="disk"``: leave the table in its files and read its rows from
    them as they are needed, through read-only memory maps and a cache of ``cache_bytes`` of
    hot rows (default ``ple.io.disk_table.table.DISK_CACHE_BYTES``, 256 MiB; 0: none): the table is a
    ``ple.io.DiskTable``, whose rows are those of the in-memory table bit for bit and
    are never all read (``table.stats()`` counts what is).
    ``overlay=DIR`` (with ``offload="disk"``): the table trains (docs/spec.md 12, ``ple.io.disk_table.training``): a row
    optimizer (``ple.optim``) writes the rows it changes, and their state, to an overlay in DIR (kept in memory
    up to ``overlay_bytes``, default ``ple.io.disk_table.training.OVERLAY_BYTES``, 1 GiB; spilled to files in DIR
    beyond it), never to the checkpoint's files; ``layer.table.flush()`` makes it durable, and an existing
    overlay is resumed (``ple.io.load_optimizer(opt, DIR)`` for the optimizer's step count). ``overlay_dtype``:
    of its rows (default: the table's dtype for a float table, so training equals the in-memory table's bit
    for bit; bfloat16 for an FP8, int8 or NF4 table, whose rows are dequantized at their first update). An
    overlay made on another base (config, files or rows) is a ``ValueError`` naming it, and one another
    process has open is a ``RuntimeError`` (one this process still holds names the way out,
    ``layer.table.close()``). ``with load_layer(..., overlay=DIR) as layer:`` flushes and closes at the end of
    the block (only closes after an exception); ``layer.table.close()`` closes without flushing; a layer
    garbage-collected releases the overlay's lock. Over a float base, ``layer.to(dtype)`` to another float dtype
    is a ``ValueError`` naming ``dtype`` (the overlay's rows keep theirs).
    Returns the layer, or ``(layer, LoadReport)`` with ``return_report``.
    """
    if dtype is not None and (not isinstance(dtype, torch.dtype) or not dtype.is_floating_point):
        raise TypeError(f"dtype: expected a torch float dtype, got {dtype!r}")
    if not isinstance(offload, (bool, str)):
        raise TypeError(f"offload: expected False, True or 'host' (host memory), or 'disk' (read from the "
                        f"checkpoint's files), got {type(offload).__name__}")
    if not isinstance(offload, bool) and offload not in ("host", "disk"):
        raise ValueError(f"offload: expected False, True or 'host' (host memory), or 'disk' (read from the "
                         f"checkpoint's files), got {offload!r}")
    disk = offload == "disk"
    if cache_bytes is not None:
        if not disk:
            raise ValueError(f"cache_bytes: the row cache of a table read from disk; pass offload='disk' with "
                             f"it (offload is {offload!r})")
        _checks.int_arg("cache_bytes", cache_bytes, minimum=0)
    _checks.int_arg("block_bytes", block_bytes, minimum=1)
    check_overlay_args(overlay, overlay_bytes, overlay_dtype, offload)
    ckpt, plan = _open_layer(path, config, ple_layer_index, prefix)
    cfg, pfx = plan.config, plan.prefix
    dtype = dtype or plan.model_dtype
    device = torch.device(device) if device is not None else torch.device("cpu")
    table_device = torch.device("cpu") if offload else device
    pin = bool(offload) and not disk and torch.cuda.is_available()

    report = LoadReport(pfx, ple_layer_index, table=f"{f'{plan.parts} shards' if plan.sharded else 'whole'}, "
                                                    f"{dtype_name(plan.table_dtype)}"
                                                    f"{' (nf4)' if plan.scheme and plan.scheme.packed else ''}",
                        merged_kv=plan.merged_kv, skipped=list(plan.unknown),
                        computed_buffers=[b.key for b in plan.buffers if b.status == "missing"])
    if report.skipped:
        warnings.warn(f"load_layer: skipped {len(report.skipped)} unknown key(s) under {pfx!r}: "
                      f"{report.skipped[:8]}{' ...' if len(report.skipped) > 8 else ''}", stacklevel=2)
    if report.computed_buffers:
        warnings.warn(f"load_layer: {report.computed_buffers} absent under {pfx!r}; computed from the config",
                      stacklevel=2)

    table: Table | None
    if disk:
        table = DiskTable.from_checkpoint(ckpt, plan, dtype=dtype, device=device,
                                          cache_bytes=DISK_CACHE_BYTES if cache_bytes is None else cache_bytes,
                                          rows_per_block=_rows_per_block(4, block_bytes))
        sd = _state_dict(ckpt, plan, device=device, dtype=dtype, table_device=table_device, pin=pin,
                         block_bytes=block_bytes, table=False)
        if table.scale is not None:
            sd[TABLE_SCALE] = table.scale                           # the table's own (read once)
        if overlay is not None:
            try:
                table.attach_overlay(TableOverlay.open(
                    table, overlay, base=base_fingerprint(ckpt, plan, table), dtype=overlay_dtype,
                    memory_bytes=OVERLAY_BYTES if overlay_bytes is None else overlay_bytes))
            except BaseException:
                table.close()
                raise
    else:
        sd = _state_dict(ckpt, plan, device=device, dtype=dtype, table_device=table_device, pin=pin,
                         block_bytes=block_bytes)
        table = None if plan.scheme is None else QuantizedTable.empty(plan.num_rows, plan.dim, plan.scheme,
                                                                       device="meta")
    layer = PLELayer(cfg, ple_layer_index, backend=backend, device="meta", dtype=dtype, table=table)
    _assign(layer, sd, device)
    return (layer, report) if return_report else layer


def load_layers(path: CheckpointSource, config: ConfigSource = None, **kwargs: Any) -> list[PLELayer]:
    """Every PLE layer of the config, in PLE-index order (keyword arguments as for `load_layer`; with
    ``overlay=DIR`` and several layers, layer ``i``'s overlay is ``DIR/ple_layer_{i}``)."""
    ckpt = Checkpoint.open(path)
    cfg = _require_config(ckpt, config)
    overlay = kwargs.pop("overlay", None)
    several = overlay is not None and cfg.num_ple_layers > 1

    def where(i: int) -> str | os.PathLike[str] | None:
        return os.path.join(overlay, f"ple_layer_{i}") if several else overlay

    return [load_layer(ckpt, cfg, i, overlay=where(i), **kwargs) for i in range(cfg.num_ple_layers)]
