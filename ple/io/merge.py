"""Merging a trained overlay into its base: `merge` writes one whole checkpoint of base + overlay (docs/spec.md 12).

A disk table trained through an overlay (``load_layer(path, offload="disk", overlay=DIR)``,
``ple.io.disk_table.training``) leaves the checkpoint's files as they were and the rows training changed in ``DIR``.
`merge` writes a new checkpoint whose table holds, for every row, the overlay's value where it has one and the
base's elsewhere: what the trained layer's lookups return. Every other tensor and file is copied as
``ple.io.convert`` copies them.

Streaming. The table is written as ``convert`` writes it (``ple.io.save.table_entries``), from a `MergedTable`:
blocks of at most ``block_bytes`` (as float32) of the base, read in row order (``ple.io.load.table_blocks``),
each with the overlay's rows of that block put in. The overlay's rows of a block are read by range
(`~ple.io.disk_table.overlay.OverlayStore.read_range`): each segment's ids are sorted, so its rows in a block's
range are one run of it, found by two searches through its fences and read at once; it costs the overlay's rows
of the block, not the block's rows (a probe per table row cost a third of the merge's time). A range answers any
block the writer asks for, in any order and more than once (an FP8 target reads the table twice, once for its
largest magnitude; an int8 target reads each shard once for its values and once for its scales).

Overlapped. The file is written as ``ple.io.writer.write_file`` writes a large one (``ple.io._pipeline``): the
next block is made (the base read, the overlay's rows put in, the cast) in a thread of its own while the current
one is written, and the disk writes each 16 MiB as it lands rather than all at the final fsync (docs/disk.md
measures it against a cold copy of the base, what the disk allows a job that reads as much as it writes).
Memory: two blocks and what making one needs, plus the overlay's index (the store's: a bit per table row and a
fence per 128 of its rows on disk, ``ple.io.disk_table.overlay``); the whole table is never held
(``merge_budget``).
"""

from __future__ import annotations

import json
import os
from collections.abc import Iterator
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch

from .. import _checks
from .._deprecation import deprecated_parameter
from ..quant import Scheme
from .convert import (
    WEIGHT_SUFFIXES,
    _copy_entry,
    _copy_other_files,
    _out_dtype,
    layer_plans,
    open_source,
    write_converted,
)
from .disk_table.overlay._files import differences
from .disk_table.overlay.store import OverlayStore
from .disk_table.table import DiskTable
from .disk_table.training import base_fingerprint
from .files import Checkpoint, dtype_name
from .layout import LayerPlan
from .load import BLOCK_BYTES, table_blocks
from .optim_state import OPTIMIZER_DIR
from .policy import problems_of, refuse_unless_ple_only
from .save import (
    CheckpointTable,
    _floats,
    _TableSource,
    parse_table_dtype,
    table_entries,
)

if TYPE_CHECKING:
    from .files import CheckpointSource, ConfigSource, TableDtype

__all__ = ["merge", "MergedTable", "LAYER_DIR"]

LAYER_DIR = "ple_layer_{i}"
"""The overlay of PLE layer ``i`` in the folder ``load_layers(..., overlay=DIR)`` trains into (``DIR/ple_layer_i``)."""


class MergedTable(_TableSource):
    """The table of a checkpoint's layer (``plan``) with an overlay's rows put in, as float blocks of ``dtype``.

    A float base row is cast to ``dtype``, a quantized one dequantized to it (``ple.quant.dequantize``, the
    formula of the disk table's lookups); an overlay row is cast to ``dtype`` (rounded to nearest).
    """

    def __init__(self, ckpt: Checkpoint, plan: LayerPlan, store: OverlayStore, dtype: torch.dtype) -> None:
        self.ckpt, self.plan, self.store = ckpt, plan, store
        self.base = CheckpointTable(ckpt, plan)
        self.num_rows, self.dim, self.dtype = plan.num_rows, plan.dim, dtype
        self.global_scale = None

    @deprecated_parameter("block_rows", "rows_per_block", since="0.1.0")
    def blocks(self, start: int, stop: int,
               rows_per_block: int) -> Iterator[tuple[torch.Tensor, torch.Tensor | None]]:
        for lo, v, s in table_blocks(self.ckpt, self.plan, start, stop, rows_per_block):
            values = _floats(self.base, v, self.base.global_scale if s is None else s, self.dtype)
            if values is v:                             # a view of the file's (private) mapping: not written into
                values = v.clone()
            ids, got = self.store.read_range(lo, lo + values.shape[0], ["rows"])
            if ids.numel():
                values.index_copy_(0, ids - lo, got["rows"].to(self.dtype))
            yield values, None


def merge(path: CheckpointSource, overlay: str | os.PathLike[str], out: str | os.PathLike[str], *,
          table_dtype: TableDtype = None, config: ConfigSource = None, parts: int | None = None,
          max_file_bytes: int | None = None, block_bytes: int = BLOCK_BYTES, overwrite: bool = False,
          ple_only: bool = False) -> dict[str, Any]:
    """Write the checkpoint ``path`` with the rows trained into ``overlay`` as a new checkpoint ``out``.

    ``overlay``: an overlay directory (``load_layer(path, offload="disk", overlay=DIR)``; it holds a
    ``manifest.json``), or a folder of them, ``ple_layer_{i}`` for PLE layer i (``load_layers(...,
    overlay=DIR)``; a layer's folder without a manifest was never flushed and is skipped). Each overlay is
    applied to the layer whose base it records (config, prefix, files and sampled rows, as
    ``ple.io.disk_table.training.base_fingerprint``): an overlay made on another base is a ``ValueError`` naming it and
    what differs. Its last flushed generation is merged (`~ple.io.disk_table.overlay.OverlayStore`; updates a live
    trainer has not flushed are not), every file of it checked against its checksums before ``out`` is
    touched: a damaged one is a ``ValueError`` naming it. The overlay is opened read only: while its trainer
    holds it (between ``flush()`` calls), its last flushed generation is read without the lock.

    The table of a trained layer: ``table_dtype=None`` keeps a float base's dtype (overlay rows of another dtype,
    e.g. ``overlay_dtype=torch.float32`` over a bfloat16 base, are rounded to it, as the layer's lookups in
    that dtype round them); a quantized base (FP8 / int8 / NF4) is written in the overlay's float dtype
    (bfloat16 unless it was trained with another ``overlay_dtype``), untouched rows dequantized as its lookups
    dequantize them: quantizing again would round away what training changed, and the trained rows have no
    quantized form to keep (pass ``table_dtype`` to quantize anyway). A float or quantized ``table_dtype``
    (``"bfloat16"``, ``"float16"``, ``"float32"``, ``"fp8"``, ``"int8"``, ``"nf4"``) casts or quantizes the
    merged values, in float32, as ``save`` and ``convert`` do (FP8's per-tensor scale from the merged table's
    largest magnitude: the table is read twice). Layers without an overlay are rewritten as ``convert`` would
    rewrite them, and everything else is as ``convert``'s: ``parts`` (table shards; default as in the base, 0 =
    whole), ``config``, ``max_file_bytes``, ``block_bytes``, ``overwrite`` and ``ple_only`` (an output
    transformers would load wrong, a quantized table or a merged ``kv_proj``, is a ``ValueError`` unless
    ``ple_only=True``, which marks it); the non-weight files of a model folder are copied beside (not the
    base's ``optimizer/`` folder, which is not the state of the merged training, nor an overlay or ``out``
    inside it).

    ``out``: a ``.safetensors`` file or a directory, neither the base's folder nor an overlay's (a
    ``ValueError``). Each file is written under a temporary name, flushed to disk and renamed (``ple.io.save``),
    so a file at ``out`` is never half written; with ``overwrite=True`` the old checkpoint there is deleted
    first. Memory: a few blocks (see the module docstring), never the whole table. Written overlapped: the next
    block is made while one is written (see the module docstring).

    Returns a summary: ``files`` written, ``layers`` (prefixes), ``tables`` (each as written), and
    ``overlays``: per layer ``{"path", "rows", "generation", "dtype"}`` of the overlay merged, or None.
    """
    ckpt, cfg = open_source(path, config, parts)
    _checks.int_arg("block_bytes", block_bytes, minimum=1)
    target = parse_table_dtype(table_dtype)
    if not isinstance(overlay, (str, os.PathLike)):
        raise TypeError(f"overlay: expected a directory path, got {type(overlay).__name__}")
    plans = layer_plans(ckpt, cfg, "path")
    dirs = _overlay_dirs(Path(overlay))
    _check_out(Path(out), ckpt, Path(overlay), dirs)
    stores: dict[int, OverlayStore] = {}
    try:
        _open_stores(ckpt, plans, dirs, stores)
        return _write(ckpt, cfg, plans, stores, out, target, parts, max_file_bytes, block_bytes, overwrite,
                      ple_only, path, Path(overlay))
    finally:
        for store in stores.values():
            store.close()


def _overlay_dirs(overlay: Path) -> list[tuple[Path, int | None]]:
    """``(directory, PLE index it is named for or None)`` of each flushed overlay ``overlay`` stands for."""
    if OverlayStore.manifest(overlay) is not None:
        return [(overlay, None)]
    if not overlay.is_dir():
        raise ValueError(f"overlay: {overlay} is not a directory")
    found: list[tuple[Path, int | None]] = []
    for sub in sorted(overlay.iterdir()):
        name = sub.name.removeprefix("ple_layer_")
        if sub.is_dir() and name != sub.name and name.isdigit() and OverlayStore.manifest(sub) is not None:
            found.append((sub, int(name)))
    if not found:
        raise ValueError(f"overlay: {overlay} holds no overlay (no manifest.json, nor ple_layer_{{i}} folders "
                         f"holding one); train with load_layer(..., overlay=DIR) and call table.flush()")
    return found


def _inside(a: Path, b: Path) -> bool:
    """``a`` is ``b`` or inside it (resolved)."""
    a, b = a.resolve(), b.resolve()
    return a == b or b in a.parents


def _check_out(out: Path, ckpt: Checkpoint, overlay: Path, dirs: list[tuple[Path, int | None]]) -> None:
    folder = out.parent if out.suffix == ".safetensors" else out
    if folder.resolve() == ckpt.root.resolve() or any(f.resolve() in (out.resolve(), (out / f.name).resolve())
                                                       for f in ckpt.files):
        raise ValueError(f"out: {out} is in the base checkpoint's folder ({ckpt.root}); write somewhere else")
    if folder.resolve() == overlay.resolve() or any(_inside(folder, d) for d, _ in dirs):
        raise ValueError(f"out: {out} is in the overlay's folder ({overlay}); write somewhere else")


def _open_stores(ckpt: Checkpoint, plans: list[LayerPlan], dirs: list[tuple[Path, int | None]],
                 stores: dict[int, OverlayStore]) -> None:
    """Open each overlay (read only, every file checked) into ``stores`` under the position of its layer."""
    prints: dict[int, dict[str, Any]] = {}

    def fingerprint(k: int) -> dict[str, Any]:
        if k not in prints:
            table = DiskTable.from_checkpoint(ckpt, plans[k], cache_bytes=0)
            try:
                prints[k] = json.loads(json.dumps(base_fingerprint(ckpt, plans[k], table)))
            finally:
                table.close()
        return prints[k]

    for directory, index in dirs:
        stored = (OverlayStore.manifest(directory) or {}).get("base")
        match = [k for k in range(len(plans)) if fingerprint(k) == stored]
        if not match:
            prefix = stored.get("prefix") if isinstance(stored, dict) else None
            near = [k for k, p in enumerate(plans) if (index is not None and p.ple_layer_index == index)
                    or (index is None and p.prefix == prefix)] or [0]
            diff = differences(stored, fingerprint(near[0]))
            raise ValueError(f"overlay: {directory} was made on another base than layer {plans[near[0]].prefix!r} "
                             f"of {ckpt.root} (or any of its {len(plans)} layer(s)): " + "; ".join(diff[:8]))
        k = match[0]
        if k in stores:
            raise ValueError(f"overlay: {directory} and {stores[k].directory} both train layer {plans[k].prefix!r}")
        stores[k] = OverlayStore.open(directory, base=fingerprint(k), dim=None, memory_bytes=0, readonly=True,
                                      table_rows=plans[k].num_rows)
        stores[k].verify()


def _write(ckpt: Checkpoint, cfg: Any, plans: list[LayerPlan], stores: dict[int, OverlayStore], out: Any,
           target: torch.dtype | Scheme | None, parts: int | None, max_file_bytes: int | None, block_bytes: int,
           overwrite: bool, ple_only: bool, src: Any, overlay: Path) -> dict[str, Any]:
    def kind(k: int) -> Scheme | None:                  # the output table's scheme of layer k (None: float)
        if target is not None:
            return target if isinstance(target, Scheme) else None
        return None if k in stores else plans[k].scheme

    problems = problems_of(((kind(k), plan.merged_kv) for k, plan in enumerate(plans)), cfg.family)
    refuse_unless_ple_only(problems, ple_only)
    sources: dict[str, tuple[int, _TableSource]] = {}   # first table key of a layer -> (position, its source)
    drop = set()
    for k, plan in enumerate(plans):
        drop.update([pc.key for pc in plan.pieces] + [pc.scale_key for pc in plan.pieces if pc.scale_key])
        drop.update([plan.scale_key] if plan.scale_key else [])
        src_table: _TableSource = CheckpointTable(ckpt, plan)
        if k in stores:
            dtype = torch.float32 if target is not None else \
                plan.table_dtype if plan.scheme is None else stores[k].layout.dtype
            src_table = MergedTable(ckpt, plan, stores[k], dtype)
        sources[plan.pieces[0].key] = (k, src_table)
    entries = []
    for key in ckpt.keys():
        if key in sources:
            k, table = sources[key]
            n_parts = parts if parts is not None else plans[k].parts
            entries += table_entries(table, plans[k].prefix, n_parts, target, block_bytes)
        elif key not in drop:
            entries.append(_copy_entry(ckpt, key, block_bytes))

    path, single, files = write_converted(ckpt, cfg, entries, out, overwrite=overwrite, problems=problems,
                                          max_file_bytes=max_file_bytes)
    if not single:
        folder = isinstance(src, (str, os.PathLike)) and (Path(src).is_dir() or str(src).endswith(".index.json"))
        names = [item.name for item in sorted(ckpt.root.iterdir())
                 if not item.name.endswith(WEIGHT_SUFFIXES) and item.name != OPTIMIZER_DIR
                 and not any(_inside(d, item) for d in [overlay, path, *(s.directory for s in stores.values())])]
        _copy_other_files(ckpt.root, path, problems, names=names if folder else ["config.json"])
    tables, overlays = [], []
    for k, plan in enumerate(plans):
        n = parts if parts is not None else plan.parts
        trained_quantized = target is None and k in stores and plan.scheme is not None
        dt = stores[k].layout.dtype if trained_quantized else _out_dtype(plan, target)
        tables.append(f"{f'{n} shards' if n else 'whole'}, {dtype_name(dt)}{' (nf4)' * (dt == torch.uint8)}")
        s = stores.get(k)
        overlays.append(None if s is None else {"path": str(s.directory), "rows": s.num_rows,
                                                "generation": s.generation, "dtype": dtype_name(s.layout.dtype)})
    return {"files": [str(f) for f in files], "layers": [p.prefix for p in plans], "tables": tables,
            "overlays": overlays}
