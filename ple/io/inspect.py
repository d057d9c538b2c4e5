"""``inspect``: what a checkpoint holds, from its headers (and the three small hash buffers) only."""

from __future__ import annotations

import re
from typing import TYPE_CHECKING, Any

from ..config import PLEConfig
from ..reference.hashing import hash_params
from .files import Checkpoint, dtype_name, human_bytes
from .layout import BUFFERS, find_layers, plan_layer
from .load import identify_index, resolve_config
from .policy import is_marked, problems_of

if TYPE_CHECKING:
    from .files import CheckpointSource, ConfigSource

__all__ = ["inspect", "format_inspect"]

_SHARD = re.compile(r"^(.*\.shard_)(\d+)(\..*)$")


def _tensor_rows(ckpt: Checkpoint, keys: list[str], prefix: str) -> list[dict[str, Any]]:
    """One row per tensor, shards of one name collapsed into one row ``shard_{0..n-1}``."""
    rows: list[dict[str, Any]] = []
    groups: dict[tuple[str, str], dict[str, Any]] = {}
    for key in keys:
        info = ckpt.info(key)
        rel = key[len(prefix):]
        m = _SHARD.match(rel)
        if m:
            g = groups.get((m.group(1), m.group(3)))
            if g is None:
                g = dict(key=None, count=0, shapes=[], dtypes=set(), bytes=0, _pat=(m.group(1), m.group(3)),
                         _ks=[])
                groups[(m.group(1), m.group(3))] = g
                rows.append(g)
            g["count"] += 1
            g["shapes"].append(list(info.shape))
            g["dtypes"].add(dtype_name(info.dtype))
            g["bytes"] += info.nbytes
            g["_ks"].append(int(m.group(2)))
        else:
            rows.append(dict(key=rel, count=1, shapes=[list(info.shape)], dtypes={dtype_name(info.dtype)},
                             bytes=info.nbytes))
    out = []
    for r in rows:
        if r["key"] is None:
            a, b = r.pop("_pat")
            ks = sorted(r.pop("_ks"))
            r["key"] = f"{a}{{{ks[0]}..{ks[-1]}}}{b}"
        shapes = r["shapes"]
        shape = shapes[0] if all(s == shapes[0] for s in shapes) else None
        out.append(dict(key=r["key"], count=r["count"], shape=shape, shapes=shapes,
                        dtype="/".join(sorted(r["dtypes"])), bytes=r["bytes"]))
    return out


def inspect(path: CheckpointSource, config: ConfigSource = None) -> dict[str, Any]:
    """A JSON-able description of the checkpoint at ``path``: files, PLE layers and their tensors (shapes,
    dtypes, bytes), whether the hash buffers match the config, unknown keys, and any problem `load_layer`
    would raise. Reads headers and the int64 hash buffers only, never a table.

    Each tensor row has ``shape`` (a list; None when shards differ) and ``shapes`` (one list per
    shard). ``family``: the config's (``"qwen4exp"``, ``"engram"``; None without a config).
    ``ple_only`` lists why transformers would load these PLE layers wrong (a quantized
    table, a merged ``kv_proj``; an Engram checkpoint: it cannot load it at all; empty: it loads them
    right), and ``ple_only_marked`` whether the checkpoint says so itself (``ple_only=True`` of
    `save` / `convert`; an Engram checkpoint ``save`` writes is always marked).
    """
    ckpt = Checkpoint.open(path)
    config_error = None
    try:
        cfg: PLEConfig | None = resolve_config(ckpt, config)
    except (ValueError, TypeError) as e:
        if config is not None:
            raise
        cfg, config_error = None, str(e)                  # a config.json of some other model: go on without
    layers = find_layers(ckpt)
    report: dict[str, Any] = dict(
        path=str(path), files=[dict(name=f.name, bytes=f.stat().st_size) for f in ckpt.files],
        total_bytes=ckpt.total_bytes, config=None if cfg is None else cfg.to_dict(), config_error=config_error,
        layers=[])
    claimed = set()
    kinds = []                                    # (table scheme, merged kv) of the layers planned
    for pos, prefix in enumerate(layers):
        keys = [k for k in ckpt.keys() if k.startswith(prefix)]
        claimed.update(keys)
        entry = dict(prefix=prefix, tensors=_tensor_rows(ckpt, keys, prefix),
                     bytes=sum(ckpt.info(k).nbytes for k in keys), ple_layer_index=None, buffers=[],
                     unknown=[], error=None, table=None)
        if cfg is not None:
            index = identify_index(ckpt, prefix, cfg)
            if index is None and len(layers) == cfg.num_ple_layers:
                index = pos
            entry["ple_layer_index"] = index
            if index is None:
                entry["error"] = (f"{prefix}{BUFFERS[0]}: matches no PLE index of the config "
                                  f"{list(hash_params(cfg, 0).multipliers.tolist())}...")
            else:
                try:
                    plan_layer(ckpt, cfg, index, prefix)                 # what load_layer would raise
                except ValueError as e:
                    entry["error"] = str(e)
                try:
                    plan = plan_layer(ckpt, cfg, index, prefix, check_buffers=False)
                except ValueError:
                    pass
                else:
                    entry["buffers"] = [dict(key=b.key, status=b.status, expected=b.expected, found=b.found)
                                        for b in plan.buffers]
                    entry["unknown"] = [k[len(prefix):] for k in plan.unknown]
                    kind = "float" if plan.scheme is None else plan.scheme.name
                    entry["table"] = dict(rows=plan.num_rows, dim=plan.dim, scheme=kind, parts=plan.parts,
                                          dtype=dtype_name(plan.table_dtype), merged_kv=plan.merged_kv,
                                          biases=plan.biases)
                    kinds.append((plan.scheme, plan.merged_kv))
        report["layers"].append(entry)
    report["family"] = None if cfg is None else cfg.family
    report["ple_only"] = problems_of(kinds, "qwen4exp" if cfg is None else cfg.family)
    report["ple_only_marked"] = is_marked(ckpt)
    others = [k for k in ckpt.keys() if k not in claimed]
    report["other"] = dict(count=len(others), bytes=sum(ckpt.info(k).nbytes for k in others))
    return report


def _shape_text(row: dict[str, Any]) -> str:
    shapes = row["shapes"]
    return str(shapes[0]) if row["shape"] is not None else f"{shapes[0]} .. {shapes[-1]}"


def format_inspect(report: dict[str, Any]) -> str:
    """The text `python -m ple inspect` prints."""
    lines = []
    files = report["files"]
    lines.append(f"checkpoint: {report['path']}  ({len(files)} file{'s' * (len(files) != 1)}, "
                 f"{human_bytes(report['total_bytes'])})")
    cfg = report["config"]
    if cfg is None:
        why = f" ({report['config_error']})" if report.get("config_error") else ""
        lines.append(f"config: none found{why}; pass --config; hash buffers not checked")
    else:
        if report.get("family") == "engram":
            tmap = cfg.get("token_map")
            lines.append(f"family: engram (DeepSeek's Engram module): engram_vocab_size={cfg['engram_vocab_size']} "
                         f"pad_id={cfg['eos_token_id']} token_map="
                         f"{'none (identity)' if tmap is None else f'{len(tmap)} ids -> {max(tmap, default=-1) + 1}'}")
            ids = "layer_ids"
        else:
            ids = "ple_layer_ids"
        lines.append(f"config: V={cfg['vocab_size']} H={cfg['hidden_size']} M={cfg['hc_count']} "
                     f"E={cfg['ple_embed_dim']} N={cfg['ngram_size']} P={cfg['heads_per_ngram']} "
                     f"{ids}={cfg['ple_layer_ids']} split_ngram_parts={cfg['split_ngram_parts']}")
    if not report["layers"]:
        lines.append("no PLE layer found")
    for layer in report["layers"]:
        idx = layer["ple_layer_index"]
        lines.append("")
        lines.append(f"PLE layer {'?' if idx is None else idx}: prefix {layer['prefix']!r}  "
                     f"({human_bytes(layer['bytes'])})")
        t = layer["table"]
        if t is not None:
            where = f"{t['parts']} shards" if t["parts"] else "whole"
            lines.append(f"  table: {t['rows']} rows x {t['dim']}, {t['dtype']} ({t['scheme']}), {where}; "
                         f"projections {'merged kv_proj' if t['merged_kv'] else 'key_proj + value_proj'}"
                         f"{' with biases' if t.get('biases') else ''}")
        width = max([len(r["key"]) for r in layer["tensors"]] + [10])
        lines.append(f"  {'tensor':<{width}}  {'shape':<22} {'dtype':<14} {'bytes':>12}")
        for r in layer["tensors"]:
            count = f"  ({r['count']} shards)" if r["count"] > 1 else ""
            size = human_bytes(r["bytes"])
            lines.append(f"  {r['key']:<{width}}  {_shape_text(r):<22} {r['dtype']:<14} {size:>12}{count}")
        for b in layer["buffers"]:
            if b["status"] == "match":
                lines.append(f"  {b['key']}: matches the config")
            elif b["status"] == "missing":
                lines.append(f"  {b['key']}: MISSING (load computes it from the config)")
            else:
                lines.append(f"  {b['key']}: MISMATCH: expected {b['expected']}, found {b['found']}")
        if layer["unknown"]:
            lines.append(f"  unknown keys (skipped on load): {layer['unknown']}")
        if layer["error"]:
            lines.append(f"  ERROR (load would fail): {layer['error']}")
    if report.get("family") == "engram" and report["layers"]:
        lines.append("")
        mark = "marked so in the checkpoint" if report["ple_only_marked"] else "NOT marked in the checkpoint"
        lines.append(f"transformers: cannot load it ({mark}): it has no model of the Engram family (only the "
                     f"Qwen4Exp family maps to a transformers model); load it with ple.io.load_layer")
    elif report["ple_only"]:
        lines.append("")
        mark = "marked so in the checkpoint" if report["ple_only_marked"] else "NOT marked in the checkpoint"
        lines.append(f"for ple only ({mark}): transformers would load it wrong:")
        lines += [f"  - {p}" for p in report["ple_only"]]
    elif report["layers"]:
        lines.append("")
        lines.append("transformers: loads these PLE layers as they are (float table, key_proj + value_proj)")
    other = report["other"]
    if other["count"]:
        lines.append("")
        lines.append(f"other tensors: {other['count']} ({human_bytes(other['bytes'])})")
    return "\n".join(lines)
