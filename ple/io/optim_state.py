"""A row optimizer's state in a checkpoint (docs/spec.md section 11): written by ``save(..., optimizer=opt)``, read
by `load_optimizer`.

The state goes in the checkpoint directory's ``optimizer/`` folder, as safetensors files of its own (transformers
and `load_layer` never look there), in the table's layout: for a layer of prefix ``P``, the state tensor ``name``
(``sum`` for Adagrad; ``exp_avg`` and ``exp_avg_sq`` for Adam; SGD has none) of a whole table is
``P + "ple_embedding.ngram_embedding.optim.<name>"``, and of a table saved in shards ``...shard_{k}.optim.<name>``
holding the shard's rows. The files' metadata (``ple.optimizer``) hold the rule, the hyperparameters, and per
table its prefix, size and step count. The files are written as the checkpoint's are (a temporary name, flushed
to disk, renamed).

Sharded (DTensor) tables: ``ple.distributed.save_sharded`` has every rank write its own shard, shard k of W from
rank k, under the keys of a save in W shards, so a single process loads it and a
sharded run loads a single process's save. `load_optimizer` into an optimizer over sharded tables reads each
rank's piece only, whatever the number of shards saved: its rows (row sharding), or every row's ``sum`` /
``exp_avg_sq`` and its columns of ``exp_avg`` (column sharding).
"""

from __future__ import annotations

import json
import os
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch

from .files import Checkpoint, Entry, write_files
from .layout import SHARD, TABLE, shard_rows

if TYPE_CHECKING:
    from ..layer import PLELayer

__all__ = ["OPTIMIZER_DIR", "optimizer_entries", "write_optimizer", "load_optimizer"]

OPTIMIZER_DIR = "optimizer"
_META_KEY = "ple.optimizer"


def _state_key(prefix: str, parts: int, k: int, name: str) -> str:
    """``P...ngram_embedding.optim.<name>``, or ``P...ngram_embedding.shard_{k}.optim.<name>`` (the table's
    key with ``weight`` replaced by ``optim.<name>``)."""
    weight_key = TABLE if parts == 0 else SHARD.format(k=k)
    return prefix + weight_key.removesuffix("weight") + f"optim.{name}"


def _names(rule: str) -> tuple[str, ...]:
    """The rule's state tensors (``ple.optim.STATE_NAMES``)."""
    from ..optim.rowwise import STATE_NAMES

    return STATE_NAMES[rule]


def _blocks(t: torch.Tensor) -> Callable[[], Iterator[torch.Tensor]]:
    """An `Entry`'s producer of ``t`` (one block, on the CPU)."""
    return lambda: iter([t.cpu().contiguous()])


def _order(optimizer: Any, layers: list[PLELayer]) -> list[int]:
    """For each layer, the index of its table among ``optimizer``'s (each of its tables saved once)."""
    from ..optim import RowOptimizer

    if not isinstance(optimizer, RowOptimizer):
        raise TypeError(f"optimizer: expected a ple.optim optimizer (SparseSGD, RowwiseAdagrad, RowwiseAdam), got "
                        f"{type(optimizer).__name__}")
    tables = optimizer._tables
    order = []
    for i, layer in enumerate(layers):
        match = [j for j, t in enumerate(tables) if t is layer.table]
        if not match:
            raise ValueError(f"optimizer: it does not train layer {i}'s table (PLE index {layer.ple_layer_index})")
        order.append(match[0])
    if len(order) != len(tables):
        raise ValueError(f"optimizer: it trains {len(tables)} tables, the layers saved have {len(order)}; save "
                         f"every layer it trains")
    return order


def _metadata(optimizer: Any, described: list[dict[str, Any] | None]) -> dict[str, str]:
    group = optimizer.param_groups[0]
    meta = {"rule": optimizer.rule, "lr": group["lr"], "weight_decay": group["weight_decay"], "eps": group["eps"],
            "betas": list(group["betas"]), "fused": optimizer.fused, "tables": described}
    if "initial_lr" in group:
        meta["initial_lr"] = group["initial_lr"]
    return {"format": "pt", _META_KEY: json.dumps(meta)}


def optimizer_entries(optimizer: Any, layers: list[PLELayer], prefixes: list[str], parts: int
                      ) -> tuple[list[Entry], dict[str, str]]:
    """The entries and metadata of ``optimizer``'s state for ``layers`` (each of whose tables it must train)."""
    order = _order(optimizer, layers)
    tables = optimizer._tables
    if any(t.is_dtensor for t in tables):
        raise ValueError("optimizer: it trains a sharded (DTensor) table, whose state is held piece by piece; save "
                         "with ple.distributed.save_sharded(layers, path, optimizer=...), on every rank")
    entries: list[Entry] = []
    described: list[dict[str, Any] | None] = [None] * len(tables)
    for pfx, j in zip(prefixes, order, strict=True):
        w = tables[j].weight
        st = optimizer.state[w]
        rows = w.shape[0]
        ranges = [(0, rows)] if parts == 0 else shard_rows(rows, parts)
        for name in _names(optimizer.rule):
            full = st[name].detach()
            for k, (a, b) in enumerate(ranges):
                piece = full[a:b]
                entries.append(Entry(_state_key(pfx, parts, k, name), torch.float32, tuple(piece.shape),
                                     _blocks(piece)))
        described[j] = {"prefix": pfx, "rows": rows, "dim": int(w.shape[1]), "step": int(st["step"]),
                        "parts": parts}
    return entries, _metadata(optimizer, described)


def write_optimizer(directory: Path, entries: list[Entry], metadata: dict[str, str],
                    max_file_bytes: int | None) -> list[Path]:
    """Write the optimizer's files into ``directory / "optimizer"`` (replacing what was there)."""
    out = directory / OPTIMIZER_DIR
    if out.is_dir():
        for f in list(out.glob("*.safetensors")) + list(out.glob("*.json")):
            f.unlink()
    if not entries:                                       # SGD: no state, the metadata alone
        entries = [Entry("optim.none", torch.float32, (0,), lambda: iter([torch.zeros(0)]))]
    return write_files(out, entries, max_file_bytes=max_file_bytes, metadata=metadata)


def load_optimizer(optimizer: Any, path: str | os.PathLike[str]) -> None:
    """Load into ``optimizer`` the state ``ple.io.save(..., optimizer=...)`` wrote to the checkpoint at ``path``.

    ``optimizer`` is a ``ple.optim`` optimizer of the same rule over tables of the same sizes, in the order
    of the saved one (the layers' tables as they were saved). Over sharded (DTensor) tables every rank calls it
    and reads its own piece of the state (whatever the number of shards it was saved in). Its state tensors
    are filled in place and its step count and hyperparameters (``lr``, ...) set as saved, so training
    continues as if never stopped (``load_state_dict``'s checks: another rule, another number or size of
    tables is a ``ValueError`` naming ``state_dict`` ... and nothing is loaded).

    Disk tables trained through an overlay (``load_layer(..., offload="disk", overlay=DIR)``, docs/spec.md 12) keep
    their rows' state in the overlay itself: ``path`` is then DIR, and what is loaded is the step count and
    hyperparameters of the overlay's last flush.

    Raises:
        ValueError: ``path`` holds no optimizer state (naming ``path``), or a state that does not fit.
        TypeError: ``optimizer`` is not a ``ple.optim`` optimizer.
    """
    from ..optim import RowOptimizer

    if not isinstance(optimizer, RowOptimizer):
        raise TypeError(f"optimizer: expected a ple.optim optimizer, got {type(optimizer).__name__}")
    overlays = [getattr(t, "_overlay", None) for t in optimizer._tables]
    if any(o is not None for o in overlays):
        _load_from_overlays(optimizer, overlays, Path(path))
        return
    folder = Path(path) / OPTIMIZER_DIR
    if not folder.is_dir():
        raise ValueError(f"path: {path} holds no optimizer state (no {OPTIMIZER_DIR}/ folder; save with "
                         f"ple.io.save(layer, path, optimizer=opt))")
    ckpt = Checkpoint.open(folder)
    raw = ckpt.metadata.get(_META_KEY)
    if raw is None:
        raise ValueError(f"path: {folder} has no {_META_KEY!r} metadata")
    meta = json.loads(raw)
    tables = meta["tables"]
    state: dict[int, dict[str, Any]] = {}
    for i, t in enumerate(tables):
        ranges = [(0, t["rows"])] if t["parts"] == 0 else shard_rows(t["rows"], t["parts"])
        st: dict[str, Any] = {"step": t["step"]}
        mine = optimizer._tables[i] if i < len(optimizer._tables) else None
        for name in _names(meta["rule"]):
            keys = [_state_key(t["prefix"], t["parts"], k, name) for k in range(len(ranges))]
            if mine is not None and mine.is_dtensor:             # this rank's piece only
                st[name] = _read_piece(ckpt, keys, ranges, t, mine, name)
                continue
            pieces = [ckpt.read(key) for key in keys]
            st[name] = torch.cat(pieces) if len(pieces) > 1 else pieces[0]
        state[i] = st
    group = {"params": list(range(len(tables))), "rule": meta["rule"], "lr": meta["lr"],
             "weight_decay": meta["weight_decay"], "eps": meta["eps"], "betas": tuple(meta["betas"])}
    if "initial_lr" in meta:
        group["initial_lr"] = meta["initial_lr"]
    optimizer.load_state_dict({"state": state, "param_groups": [group]})


def _load_from_overlays(optimizer: Any, overlays: list[Any], path: Path) -> None:
    """Disk tables trained through overlays (``ple.io.disk_table.training``): the rows' state is in the overlays
    already; the step count and hyperparameters are those their last flush kept. ``path`` is the overlay
    directory (several tables: a folder holding all their overlays)."""
    if any(o is None for o in overlays):
        raise ValueError("optimizer: some of its tables train through overlays and some do not; load their "
                         "state separately")
    where = path.resolve()
    metas = []
    for o in overlays:
        d = Path(o.store.directory).resolve()
        if d != where and d.parent != where:                 # DIR, or the folder of load_layers' overlays
            raise ValueError(f"path: {path} is not the overlay of this optimizer's table ({d}); pass the "
                             f"directory given to load_layer(..., overlay=...)")
        saved = o.store.meta.get("optimizer") if isinstance(o.store.meta, dict) else None
        if saved is None:
            raise ValueError(f"path: the overlay {d} holds no optimizer state (flushed before any optimizer "
                             f"took the table, or never flushed)")
        metas.append(saved)
    first = metas[0]
    group = {"params": list(range(len(metas))), "rule": first["rule"], "lr": first["lr"],
             "weight_decay": first["weight_decay"], "eps": first["eps"], "betas": tuple(first["betas"])}
    if "initial_lr" in first:
        group["initial_lr"] = first["initial_lr"]
    state = {i: {"step": int(m["step"])} for i, m in enumerate(metas)}
    optimizer.load_state_dict({"state": state, "param_groups": [group]})


def _read_piece(ckpt: Checkpoint, keys: list[str], ranges: list[tuple[int, int]], saved: dict[str, Any],
                table: Any, name: str) -> torch.Tensor:
    """This rank's piece of the saved state ``name`` for its sharded ``table``, read shard by shard in blocks:
    the rows the rank holds (row sharding, ``Shard(0)``), or every row, and of ``exp_avg`` the rank's columns
    (column sharding); split as the table is (``shard_rows``). The whole tensor is never read."""
    from .load import BLOCK_BYTES

    if (saved["rows"], saved["dim"]) != (table.num_rows, table.dim):
        raise ValueError(f"path: the state was saved for a table of {(saved['rows'], saved['dim'])}, this "
                         f"optimizer's is {(table.num_rows, table.dim)}")
    w = table.weight                                              # a DTensor (the layer's table, sharded)
    W, rank = w.device_mesh.size(), w.device_mesh.get_local_rank()
    per_value = name == "exp_avg"                                 # [rows, D]; the others are [rows]
    cols: tuple[int, int] | None = None
    if w.placements[0].dim == 0:                                  # Shard(0): this rank's rows
        a, b = shard_rows(table.num_rows, W)[rank]
    else:                                                         # Shard(1): every row, this rank's columns
        a, b = 0, table.num_rows
        cols = shard_rows(table.dim, W)[rank] if per_value else None
    block = max(1, BLOCK_BYTES // (4 * table.dim))
    pieces = []
    for key, (ka, kb) in zip(keys, ranges, strict=True):
        for lo in range(max(a, ka), min(b, kb), block):
            x = ckpt.read(key, lo - ka, min(lo + block, b, kb) - ka)
            pieces.append((x[:, cols[0]:cols[1]] if cols is not None else x).clone())
    if pieces:
        return torch.cat(pieces)
    width = (cols[1] - cols[0] if cols is not None else table.dim) if per_value else None
    return torch.zeros((0,) if width is None else (0, width), dtype=torch.float32)
