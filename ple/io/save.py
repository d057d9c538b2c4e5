"""Saving PLE layers in the model's layout, and converting checkpoints (re-shard, change the table dtype).

Both stream: every tensor is written from blocks of at most ``block_bytes``, so
converting a table larger than RAM holds one block at a time (an FP8 target reads the
table twice: once for its largest magnitude, once to quantize).
"""

from __future__ import annotations

import json
import shutil
from collections.abc import Iterator
from pathlib import Path

import torch

from .. import _checks
from ..config import PLEConfig
from ..quant import SCHEMES, Scheme, dequantize, fp8_scale, quantize, scheme_of
from .files import Checkpoint, Entry, dtype_name, write_file, write_files
from .layout import (
    BUFFERS,
    CONV,
    KEY_PROJ,
    KV_PROJ,
    MODEL_PREFIX,
    NORMS,
    SHARD,
    SHARD_SCALE,
    TABLE,
    TABLE_SCALE,
    VALUE_PROJ,
    LayerPlan,
    find_layers,
    plan_layer,
    shard_rows,
)
from .load import BLOCK_BYTES, CONFIG_METADATA_KEY, identify_index, resolve_config, table_blocks

__all__ = ["save", "convert", "parse_table_dtype", "TABLE_DTYPES", "transformers_problems", "PLE_ONLY_KEY",
           "PLE_ONLY_METADATA_KEY", "WEIGHT_SUFFIXES"]

TABLE_DTYPES = {"bfloat16": torch.bfloat16, "float16": torch.float16, "float32": torch.float32,
                "fp8": SCHEMES["fp8"], "int8": SCHEMES["int8"]}


def parse_table_dtype(value):
    """``None`` (keep), a float ``torch.dtype``, a `Scheme`, or one of the names in ``TABLE_DTYPES``."""
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


# ---- what transformers would load wrong ------------------------------------------------------------
PLE_ONLY_KEY = "ple_only"
"""Key of ``config.json`` (and ``ple.only`` of the file metadata): why transformers cannot load the checkpoint."""
PLE_ONLY_METADATA_KEY = "ple.only"
WEIGHT_SUFFIXES = (".safetensors", ".safetensors.index.json", ".bin", ".bin.index.json", ".pt", ".pth")
"""Files `convert` does not copy from the source folder (weights; every other file is copied)."""


def transformers_problems(table_scheme: Scheme | None, merged_kv: bool) -> list[str]:
    """Why transformers (5.23) would load a PLE layer of this kind wrong (empty: it loads it right).

    Its model has a float ``nn.Embedding`` table and separate ``key_proj`` / ``value_proj``.
    No ``quantization_config`` transformers honours covers an embedding table with these
    scales (its FP8 / int8 methods quantize ``nn.Linear`` weights), so it would ignore
    ``weight_scale`` and use the raw FP8 / int8 values; and it would leave both projections
    randomly initialised beside an unknown ``kv_proj``.
    """
    out = []
    if table_scheme is not None:
        out.append(f"{table_scheme.name} table: transformers would ignore its weight_scale and use the raw "
                   f"{table_scheme.name} values")
    if merged_kv:
        out.append("merged kv_proj: transformers would leave key_proj and value_proj randomly initialised")
    return out


def _refuse_unless_ple_only(problems: list[str], ple_only: bool, arg: str) -> None:
    if problems and not ple_only:
        raise ValueError(f"{arg}: transformers would load this checkpoint wrong ({'; '.join(problems)}); pass "
                         f"ple_only=True (--ple-only) to write it for ple only (config.json and `inspect` then "
                         f"say so), or keep a float table and separate projections")


def _mark_config(config: dict, problems: list[str]) -> dict:
    """``config`` (a config.json dict) with the ple-only mark set to ``problems`` (removed when none)."""
    config = {k: v for k, v in config.items() if k != PLE_ONLY_KEY}
    if problems:
        config[PLE_ONLY_KEY] = problems
    return config


# ---- table sources: the rows of a table, block by block ---------------------------------------------
class _TableSource:
    """A table ``[rows, D]`` as blocks ``(values, row_scale)``; ``row_scale`` is ``[n, 1]`` (int8),
    the per-tensor ``[1]`` (fp8) or None (float)."""

    num_rows: int
    dim: int
    dtype: torch.dtype

    @property
    def scheme(self) -> Scheme | None:
        return scheme_of(self.dtype)

    def blocks(self, start: int, stop: int, block_rows: int) -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
        raise NotImplementedError

    def float_blocks(self, start, stop, block_rows) -> Iterator[torch.Tensor]:
        """Blocks as float32 (dequantized if the table is quantized)."""
        for values, scale in self.blocks(start, stop, block_rows):
            yield values.float() if scale is None else dequantize(values, scale, torch.float32)


class _MemoryTable(_TableSource):
    def __init__(self, module):
        self.weight = module.weight.detach()
        self.scale = module.scale.detach() if module.scale is not None else None
        self.num_rows, self.dim = self.weight.shape
        self.dtype = self.weight.dtype
        self.global_scale = self.scale.cpu() if self.scale is not None and self.scale.dim() == 1 else None

    def blocks(self, start, stop, block_rows):
        for a in range(start, stop, block_rows):
            b = min(a + block_rows, stop)
            scale = None
            if self.scale is not None:
                scale = self.scale[a:b] if self.scale.dim() == 2 else self.scale
                scale = scale.cpu()
            yield self.weight[a:b].cpu(), scale


class _CheckpointTable(_TableSource):
    def __init__(self, ckpt: Checkpoint, plan: LayerPlan):
        self.ckpt, self.plan = ckpt, plan
        self.num_rows, self.dim, self.dtype = plan.num_rows, plan.dim, plan.table_dtype
        self.global_scale = ckpt.read(plan.scale_key).reshape(1) if plan.scale_key else None

    def blocks(self, start, stop, block_rows):
        for _, values, scale in table_blocks(self.ckpt, self.plan, start, stop, block_rows):
            yield values, self.global_scale if scale is None else scale


def _amax(src: _TableSource, block_rows: int) -> torch.Tensor:
    """The largest magnitude of the table (exact: a max needs no float32 copy of a float table)."""
    amax = torch.zeros((), dtype=torch.float32)
    for v, s in src.blocks(0, src.num_rows, block_rows):
        if v.numel():
            x = v if s is None else dequantize(v, s, torch.float32)
            amax = torch.maximum(amax, x.abs().max().float())
    return amax


def _table_entries(src: _TableSource, prefix: str, parts: int, target, block_bytes: int) -> list[Entry]:
    """Entries of the table of one layer in ``parts`` shards (0: whole) and ``target`` dtype / scheme."""
    rows, D = src.num_rows, src.dim
    target = parse_table_dtype(target)
    if target is None:
        target = src.scheme or src.dtype
    out_dtype = target.dtype if isinstance(target, Scheme) else target
    block_rows = max(1, block_bytes // max(D * 4, 1))          # blocks pass through float32
    ranges = [(0, rows)] if parts == 0 else shard_rows(rows, parts)
    names = [TABLE] if parts == 0 else [SHARD.format(k=k) for k in range(parts)]
    same = src.scheme is not None and target is src.scheme
    fp8 = isinstance(target, Scheme) and not target.per_row
    int8 = isinstance(target, Scheme) and target.per_row
    scale = None
    if fp8:
        scale = src.global_scale if same else fp8_scale(_amax(src, block_rows))

    def values(a, b):
        for v, s in src.blocks(a, b, block_rows):
            if same:
                yield v
            elif isinstance(target, Scheme):
                x = v.float() if s is None else dequantize(v, s, torch.float32)
                yield quantize(x, target, scale=scale)[0]
            else:
                yield v.to(target) if s is None else dequantize(v, s, target)

    def row_scales(a, b):
        for v, s in src.blocks(a, b, block_rows):
            if same:
                yield s
            else:
                yield quantize(v.float() if s is None else dequantize(v, s, torch.float32), target)[1]

    entries = []
    for k, (name, (a, b)) in enumerate(zip(names, ranges, strict=True)):
        entries.append(Entry(prefix + name, out_dtype, (b - a, D), lambda a=a, b=b: values(a, b)))
        if int8:
            scale_name = TABLE_SCALE if parts == 0 else SHARD_SCALE.format(k=k)
            entries.append(Entry(prefix + scale_name, torch.float32, (b - a, 1),
                                 lambda a=a, b=b: row_scales(a, b)))
    if fp8:
        entries.append(Entry(prefix + TABLE_SCALE, torch.float32, (1,), lambda s=scale: iter([s.reshape(1)])))
    return entries


def _tensor_entry(key: str, t: torch.Tensor) -> Entry:
    t = t.detach().cpu().contiguous()
    return Entry(key, t.dtype, tuple(t.shape), lambda t=t: iter([t]))


def _layer_entries(layer, prefix: str, *, parts: int, merged_kv: bool, table_dtype, block_bytes: int):
    e = layer.ple_embedding
    out = _table_entries(_MemoryTable(e.ngram_embedding), prefix, parts, table_dtype, block_bytes)
    buffers = (e.layer_multipliers, e.ngram_heads_vocab_sizes, e.ngram_heads_offsets)
    for key, t in zip(BUFFERS, buffers, strict=True):
        out.append(_tensor_entry(prefix + key, t))
    if merged_kv:
        kv = torch.cat([layer.key_proj.weight, layer.value_proj.weight])     # [C + H, E], key rows first
        out.append(_tensor_entry(prefix + KV_PROJ, kv))
    else:
        out += [_tensor_entry(prefix + KEY_PROJ, layer.key_proj.weight),
                _tensor_entry(prefix + VALUE_PROJ, layer.value_proj.weight)]
    for key, mod in zip(NORMS, (layer.norm_key, layer.norm_query, layer.norm_conv), strict=True):
        out.append(_tensor_entry(prefix + key, mod.weight))
    out.append(_tensor_entry(prefix + CONV, layer.conv1d.weight))
    return out


def _prepare_dst(path, overwrite: bool) -> tuple[Path, bool]:
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


def _write(path: Path, single: bool, entries, *, metadata, max_file_bytes, config: PLEConfig | None,
           problems: list[str]):
    if single:
        if max_file_bytes is not None:
            raise ValueError("max_file_bytes: only for a directory checkpoint, not one .safetensors path")
        path.parent.mkdir(parents=True, exist_ok=True)
        write_file(path, entries, metadata)
        return [path]
    files = write_files(path, entries, max_file_bytes=max_file_bytes, metadata=metadata)
    if config is not None and not (path / "config.json").exists():
        with open(path / "config.json", "w", encoding="utf-8") as fh:
            json.dump(_mark_config(config.to_dict(), problems), fh, indent=2)
    return files


def save(layers, path, *, prefix: str | None = None, parts: int | None = None, merged_kv: bool = False,
         table_dtype=None, max_file_bytes: int | None = None, block_bytes: int = BLOCK_BYTES,
         overwrite: bool = False, ple_only: bool = False) -> list[Path]:
    """Save one PLE layer or several (one config) in the model's layout; returns the files written.

    ``path``: a ``.safetensors`` file, or a directory that gets ``model.safetensors``, or
    ``model-0000i-of-0000n.safetensors`` files of at most ``max_file_bytes`` plus
    ``model.safetensors.index.json``, and a ``config.json``. The config is also stored in
    each file's metadata (``ple.config``), so `load_layer` needs no config argument.

    ``prefix``: a key prefix, formatted with ``i`` (0-based decoder layer,
    ``ple_layer_ids[L] - 1``) and ``index`` (the PLE index L); default the model's
    ``model.language_model.layers.{i}.ple.``. ``parts``: table shards (default the
    config's ``split_ngram_parts``; 0 writes the table whole as
    ``ple_embedding.ngram_embedding.weight``). ``merged_kv``: write one
    ``kv_proj.weight`` (``[C + H, E]``, key rows first) instead of ``key_proj`` and
    ``value_proj``. ``table_dtype``: keep (None), ``"bfloat16"`` / ``"float16"`` /
    ``"float32"``, or quantize: ``"fp8"`` / ``"int8"`` (``ple.quant``).

    transformers loads a float table with separate projections right, and would load a
    quantized table or a merged ``kv_proj`` wrong (`transformers_problems`): those are a
    ``ValueError`` unless ``ple_only=True``, which writes them with ``"ple_only"`` (the
    reasons) in ``config.json`` and ``ple.only`` in each file's metadata, as `inspect` reports.
    """
    layers = list(layers) if isinstance(layers, (list, tuple)) else [layers]
    if not layers:
        raise ValueError("layers: expected at least one PLELayer")
    cfg = layers[0].config
    if any(layer.config != cfg for layer in layers):
        raise ValueError("layers: expected layers of one config")
    parts = cfg.split_ngram_parts if parts is None else _checks.int_arg("parts", parts, minimum=0)
    _checks.int_arg("block_bytes", block_bytes, minimum=1)
    table_dtype = parse_table_dtype(table_dtype)
    schemes = {table_dtype if table_dtype is not None else scheme_of(la.table.weight.dtype) for la in layers}
    scheme = next((s for s in schemes if isinstance(s, Scheme)), None)
    problems = transformers_problems(scheme, merged_kv)
    _refuse_unless_ple_only(problems, ple_only, "table_dtype" if scheme is not None else "merged_kv")
    template = MODEL_PREFIX if prefix is None else prefix
    prefixes = [template.format(i=cfg.ple_layer_ids[layer.ple_layer_index] - 1, index=layer.ple_layer_index)
                for layer in layers]
    if len(set(prefixes)) != len(prefixes):
        raise ValueError(f"prefix: {template!r} gives the same prefix to several layers; use {{i}} or "
                         f"{{index}}")
    path, single = _prepare_dst(path, overwrite)
    entries = []
    with torch.no_grad():
        for layer, pfx in zip(layers, prefixes, strict=True):
            entries += _layer_entries(layer, pfx, parts=parts, merged_kv=merged_kv, table_dtype=table_dtype,
                                      block_bytes=block_bytes)
    meta = {"format": "pt", CONFIG_METADATA_KEY: json.dumps(cfg.to_dict())}
    if problems:
        meta[PLE_ONLY_METADATA_KEY] = json.dumps(problems)
    return _write(path, single, entries, metadata=meta, max_file_bytes=max_file_bytes, config=cfg,
                  problems=problems)


def _copy_entry(ckpt: Checkpoint, key: str, block_bytes: int, new_key: str | None = None) -> Entry:
    info = ckpt.info(key)

    def produce():
        if len(info.shape) == 0 or info.numel == 0:
            yield ckpt.read(key)
            return
        row = max(info.nbytes // max(info.shape[0], 1), 1)
        for _, block in ckpt.read_rows(key, 0, info.shape[0], block_rows=max(1, block_bytes // row)):
            yield block

    return Entry(new_key or key, info.dtype, info.shape, produce)


def convert(src, dst, *, config=None, parts: int | None = None, table_dtype=None,
            merged_kv: bool | None = None, max_file_bytes: int | None = None, block_bytes: int = BLOCK_BYTES,
            overwrite: bool = False, ple_only: bool = False) -> dict:
    """Rewrite the checkpoint ``src`` as ``dst``: re-shard the PLE tables and/or change their dtype.

    Every PLE layer found is validated (as by `load_layer`) and rewritten with ``parts``
    shards (default: as it is; 0 = whole), table dtype ``table_dtype`` (default: as it
    is; see `save`) and, with ``merged_kv`` True / False, a merged ``kv_proj`` or
    separate projections. Every other tensor, including unknown keys, is copied as it
    is. For a directory ``dst``, every non-weight file of a ``src`` folder is copied
    (``config.json``, ``generation_config.json``, tokenizer files, ...; not ``WEIGHT_SUFFIXES``).
    Returns a summary.

    An output transformers would load wrong (an FP8 / int8 table, or a merged ``kv_proj``;
    see `transformers_problems`) is a ``ValueError`` unless ``ple_only=True``; then
    ``config.json`` gets ``"ple_only"`` (the reasons) and each file ``ple.only`` in its
    metadata. Converting back to a float table with separate projections removes the mark.
    """
    ckpt = Checkpoint.open(src)
    cfg = resolve_config(ckpt, config)
    if cfg is None:
        raise ValueError(f"config: not given, and {ckpt.root} has neither a saved config nor a config.json")
    if parts is not None:
        _checks.int_arg("parts", parts, minimum=0)
    target = parse_table_dtype(table_dtype)
    layers = find_layers(ckpt)
    if not layers:
        raise ValueError(f"src: no PLE layer in the checkpoint at {ckpt.root}")
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
    problems = []
    for plan in plans:
        scheme = target if isinstance(target, Scheme) else plan.scheme if target is None else None
        merged = plan.merged_kv if merged_kv is None else merged_kv
        problems += [p for p in transformers_problems(scheme, merged) if p not in problems]
    _refuse_unless_ple_only(problems, ple_only, "table_dtype" if any("table" in p for p in problems)
                            else "merged_kv")
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

    entries = []
    for key in ckpt.keys():
        if key in table_keys:
            plan = table_keys[key]
            p = parts if parts is not None else plan.parts
            entries += _table_entries(_CheckpointTable(ckpt, plan), plan.prefix, p, target, block_bytes)
        elif key in proj:
            plan, want = proj[key]
            entries += _kv_entries(ckpt, plan, want)
        elif key not in drop:
            entries.append(_copy_entry(ckpt, key, block_bytes))

    path, single = _prepare_dst(dst, overwrite)
    meta = dict(ckpt.metadata)
    meta.setdefault("format", "pt")
    meta[CONFIG_METADATA_KEY] = json.dumps(cfg.to_dict())
    meta.pop(PLE_ONLY_METADATA_KEY, None)
    if problems:
        meta[PLE_ONLY_METADATA_KEY] = json.dumps(problems)
    files = _write(path, single, entries, metadata=meta, max_file_bytes=max_file_bytes, config=None,
                   problems=problems)
    if not single:
        folder = not isinstance(src, (list, tuple)) and (Path(src).is_dir() or str(src).endswith(".index.json"))
        _copy_other_files(ckpt.root, path, problems, names=None if folder else ["config.json"])
    tables = []
    for plan in plans:
        n = parts if parts is not None else plan.parts
        tables.append(f"{f'{n} shards' if n else 'whole'}, {dtype_name(_out_dtype(plan, target))}")
    return {"files": [str(f) for f in files], "layers": [p.prefix for p in plans], "tables": tables}


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
                json.dump(_mark_config(config, problems), fh, indent=2)
        elif item.is_dir():
            shutil.copytree(item, target, dirs_exist_ok=True)
        else:
            shutil.copyfile(item, target)


def _out_dtype(plan: LayerPlan, target) -> torch.dtype:
    if target is None:
        return plan.table_dtype
    return target.dtype if isinstance(target, Scheme) else target


def _kv_entries(ckpt: Checkpoint, plan: LayerPlan, merged: bool) -> list[Entry]:
    p, C = plan.prefix, plan.config.hc_hidden_size
    if plan.proj_scales:
        raise ValueError(f"merged_kv: {p} has FP8 projections ({sorted(plan.proj_scales)}); merging or "
                         f"splitting them is not supported, keep merged_kv=None")
    if merged:
        kv = torch.cat([ckpt.read(p + KEY_PROJ), ckpt.read(p + VALUE_PROJ).to(ckpt.info(p + KEY_PROJ).dtype)])
        return [_tensor_entry(p + KV_PROJ, kv)]
    kv = ckpt.read(p + KV_PROJ)
    return [_tensor_entry(p + KEY_PROJ, kv[:C]), _tensor_entry(p + VALUE_PROJ, kv[C:])]
