"""Converting checkpoints: re-shard the PLE tables or change their dtype, block by block.

`convert` validates every PLE layer it finds (as `load_layer` does) and rewrites its table
through ``ple.io.save``'s table blocks (`table_entries`), so a table larger than RAM is held
one block at a time; every other tensor is copied block by block, and a model folder's other
files (configs, tokenizer) are copied beside. What transformers would load wrong, and the
``ple_only`` mark: ``ple.io.policy``.
"""

from __future__ import annotations

import json
import os
import shutil
from collections.abc import Iterator
from pathlib import Path
from typing import TYPE_CHECKING

import torch

from .. import _checks
from ..config import PLEConfig
from ..quant import Scheme
from .files import Checkpoint, Entry, dtype_name
from .layout import (
    BUFFERS,
    KEY_BIAS,
    KEY_PROJ,
    KV_BIAS,
    KV_PROJ,
    VALUE_BIAS,
    VALUE_PROJ,
    LayerPlan,
    find_layers,
    plan_layer,
)
from .load import BLOCK_BYTES, CONFIG_METADATA_KEY, identify_index, resolve_config
from .policy import mark_config, mark_metadata, problems_of, refuse_unless_ple_only
from .save import CheckpointTable, parse_table_dtype, prepare_dst, table_entries, tensor_entry, write_checkpoint

if TYPE_CHECKING:
    from .files import CheckpointSource, ConfigSource, TableDtype

__all__ = ["convert", "WEIGHT_SUFFIXES"]

WEIGHT_SUFFIXES = (".safetensors", ".safetensors.index.json", ".bin", ".bin.index.json", ".pt", ".pth")
"""Files `convert` does not copy from the source folder (weights; every other file is copied)."""


def _copy_entry(ckpt: Checkpoint, key: str, block_bytes: int, new_key: str | None = None) -> Entry:
    info = ckpt.info(key)

    def produce() -> Iterator[torch.Tensor]:
        if len(info.shape) == 0 or info.numel == 0:
            yield ckpt.read(key)
            return
        row = max(info.nbytes // max(info.shape[0], 1), 1)
        for _, block in ckpt.read_rows(key, 0, info.shape[0], rows_per_block=max(1, block_bytes // row)):
            yield block

    return Entry(new_key or key, info.dtype, info.shape, produce)


def convert(src: str | os.PathLike[str] | list[str | os.PathLike[str]] | tuple[str | os.PathLike[str], ...],
            dst: str | os.PathLike[str], *, config: ConfigSource = None,
            parts: int | None = None, table_dtype: TableDtype = None, merged_kv: bool | None = None,
            max_file_bytes: int | None = None, block_bytes: int = BLOCK_BYTES, overwrite: bool = False,
            ple_only: bool = False) -> dict[str, list[str]]:
    """Rewrite the checkpoint ``src`` as ``dst``: re-shard the PLE tables and/or change their dtype.

    Every PLE layer found is validated (as by `load_layer`) and rewritten with ``parts``
    shards (default: as it is; 0 = whole), table dtype ``table_dtype`` (default: as it
    is; see `save`) and, with ``merged_kv`` True / False, a merged ``kv_proj`` or
    separate projections. Every other tensor, including unknown keys, is copied as it
    is. For a directory ``dst``, every non-weight file of a ``src`` folder is copied
    (``config.json``, ``generation_config.json``, tokenizer files, ...; not ``WEIGHT_SUFFIXES``).
    Returns a summary.

    An output transformers would load wrong (an FP8 / int8 / NF4 table, or a merged ``kv_proj``;
    see ``ple.io.policy``) is a ``ValueError`` unless ``ple_only=True``; then
    ``config.json`` gets ``"ple_only"`` (the reasons) and each file ``ple.only`` in its
    metadata. Converting back to a float table with separate projections removes the mark.
    """
    ckpt, cfg = open_source(src, config, parts)
    target = parse_table_dtype(table_dtype)
    plans = layer_plans(ckpt, cfg, "src")
    problems = problems_of(((target if isinstance(target, Scheme) else plan.scheme if target is None else None,
                             plan.merged_kv if merged_kv is None else merged_kv) for plan in plans), cfg.family)
    refuse_unless_ple_only(problems, ple_only)
    dst_path = Path(dst)
    if any(f.resolve() in ((dst_path / f.name).resolve(), dst_path.resolve()) for f in ckpt.files):
        raise ValueError(f"dst: {dst} would overwrite the source checkpoint; write somewhere else")

    table_keys = {}      # first table key of a layer -> its plan; other table keys are dropped
    drop = set()
    for plan in plans:
        keys = [pc.key for pc in plan.pieces] + [pc.scale_key for pc in plan.pieces if pc.scale_key]
        keys += [plan.scale_key] if plan.scale_key else []
        table_keys[plan.pieces[0].key] = plan
        drop.update(keys)
    proj = {}
    for plan in plans:
        want = plan.merged_kv if merged_kv is None else merged_kv
        if want != plan.merged_kv:
            p = plan.prefix
            first = p + (KV_PROJ if plan.merged_kv else KEY_PROJ)
            proj[first] = (plan, want)
            drop.update([p + KV_PROJ] if plan.merged_kv else [p + KEY_PROJ, p + VALUE_PROJ])
            if plan.biases:                                      # the Engram family's, merged or split with them
                drop.update([p + KV_BIAS] if plan.merged_kv else [p + KEY_BIAS, p + VALUE_BIAS])

    entries = []
    for key in ckpt.keys():
        if key in table_keys:
            plan = table_keys[key]
            n_parts = parts if parts is not None else plan.parts
            entries += table_entries(CheckpointTable(ckpt, plan), plan.prefix, n_parts, target, block_bytes)
        elif key in proj:
            plan, want = proj[key]
            entries += _kv_entries(ckpt, plan, want)
        elif key not in drop:
            entries.append(_copy_entry(ckpt, key, block_bytes))

    path, single, files = write_converted(ckpt, cfg, entries, dst, overwrite=overwrite, problems=problems,
                                          max_file_bytes=max_file_bytes)
    if not single:
        folder = not isinstance(src, (list, tuple)) and (Path(src).is_dir() or str(src).endswith(".index.json"))
        _copy_other_files(ckpt.root, path, problems, names=None if folder else ["config.json"])
    tables = []
    for plan in plans:
        n = parts if parts is not None else plan.parts
        out = _out_dtype(plan, target)
        tables.append(f"{f'{n} shards' if n else 'whole'}, {dtype_name(out)}{' (nf4)' * (out == torch.uint8)}")
    return {"files": [str(f) for f in files], "layers": [p.prefix for p in plans], "tables": tables}


def write_converted(ckpt: Checkpoint, cfg: PLEConfig, entries: list[Entry], dst: str | os.PathLike[str], *,
                    overwrite: bool, problems: list[str],
                    max_file_bytes: int | None) -> tuple[Path, bool, list[Path]]:
    """Write ``entries`` as the checkpoint ``dst`` with ``ckpt``'s metadata, the config and the ple-only mark of
    ``problems``: ``(path, single file?, files written)`` (`convert` and ``ple.io.merge``)."""
    path, single = prepare_dst(dst, overwrite)
    meta = dict(ckpt.metadata)
    meta.setdefault("format", "pt")
    meta[CONFIG_METADATA_KEY] = json.dumps(cfg.to_dict())
    files = write_checkpoint(path, single, entries, metadata=mark_metadata(meta, problems),
                             max_file_bytes=max_file_bytes, config=None, problems=problems)
    return path, single, files


def open_source(src: CheckpointSource, config: ConfigSource, parts: int | None) -> tuple[Checkpoint, PLEConfig]:
    """The checkpoint a rewrite reads (`convert`'s ``src``, ``merge``'s base) and its config: ``config``, else
    the one saved in it or beside it (none: a ``ValueError``); ``parts`` checked (None, or at least 0)."""
    ckpt = Checkpoint.open(src)
    cfg = resolve_config(ckpt, config)
    if cfg is None:
        raise ValueError(f"config: not given, and {ckpt.root} has neither a saved config nor a config.json")
    if parts is not None:
        _checks.int_arg("parts", parts, minimum=0)
    return ckpt, cfg


def layer_plans(ckpt: Checkpoint, cfg: PLEConfig, arg: str) -> list[LayerPlan]:
    """The checked plan (``plan_layer``) of every PLE layer of ``ckpt``, in key order; no layer at all is a
    ``ValueError`` naming ``arg`` (the argument that gave the checkpoint)."""
    layers = find_layers(ckpt)
    if not layers:
        raise ValueError(f"{arg}: no PLE layer in the checkpoint at {ckpt.root}")
    plans = []
    for pos, pfx in enumerate(layers):
        index = identify_index(ckpt, pfx, cfg)
        if index is None:
            if len(layers) != cfg.num_ple_layers:
                raise ValueError(f"{pfx}{BUFFERS[0]}: cannot tell which PLE index this layer is (no "
                                 f"multipliers matching the config, and {len(layers)} layers for "
                                 f"{cfg.num_ple_layers} in the config)")
            index = pos
        plans.append(plan_layer(ckpt, cfg, index, pfx))
    return plans


def _copy_other_files(src: Path, dst: Path, problems: list[str], names: list[str] | None = None) -> None:
    """Copy the non-weight files and folders of the folder ``src`` (or only those ``names``) into ``dst``
    (``config.json`` with the ple-only mark set to ``problems``)."""
    if src.resolve() == dst.resolve():
        return
    for item in sorted(src.iterdir()):
        if item.name.endswith(WEIGHT_SUFFIXES) or (names is not None and item.name not in names):
            continue
        target = dst / item.name
        if item.name == "config.json" and item.is_file():
            with open(item, encoding="utf-8") as fh:
                config = json.load(fh)
            with open(target, "w", encoding="utf-8") as fh:
                json.dump(mark_config(config, problems), fh, indent=2)
        elif item.is_dir():
            shutil.copytree(item, target, dirs_exist_ok=True)
        else:
            shutil.copyfile(item, target)


def _out_dtype(plan: LayerPlan, target: torch.dtype | Scheme | None) -> torch.dtype:
    if target is None:
        return plan.table_dtype
    return target.dtype if isinstance(target, Scheme) else target


def _kv_entries(ckpt: Checkpoint, plan: LayerPlan, merged: bool) -> list[Entry]:
    p, C = plan.prefix, plan.config.hc_hidden_size
    if plan.proj_scales:
        raise ValueError(f"merged_kv: {p} has FP8 projections ({sorted(plan.proj_scales)}); merging or "
                         f"splitting them is not supported, keep merged_kv=None")
    pairs = [(KEY_PROJ, VALUE_PROJ, KV_PROJ)] + ([(KEY_BIAS, VALUE_BIAS, KV_BIAS)] if plan.biases else [])
    out = []
    for key, value, kv_key in pairs:
        if merged:
            kv = torch.cat([ckpt.read(p + key), ckpt.read(p + value).to(ckpt.info(p + key).dtype)])
            out.append(tensor_entry(p + kv_key, kv))
        else:
            kv = ckpt.read(p + kv_key)
            out += [tensor_entry(p + key, kv[:C]), tensor_entry(p + value, kv[C:])]
    return out
