"""Training a table read from disk: the overlay of a `DiskTable` (docs/spec.md section 12; store:
``ple.io.disk_table.overlay``).

``load_layer(path, offload="disk", overlay=DIR)`` gives the `DiskTable` a `TableOverlay`: the checkpoint's
files stay read only, and the rows a row optimizer (``ple.optim``) changes, with their optimizer state, live
in an `~ple.io.disk_table.overlay.OverlayStore` in ``DIR`` (in memory up to ``overlay_bytes``, spilled to files in DIR
beyond it, durable at ``layer.table.flush()``; its index off the heap: a bitmap of the table's rows, 1 bit
each, and the segments' ids searched where they lie on disk).

A lookup reads each row's overlay value where it has one, else the base row (through the row cache, as
before): `TableOverlay.overlaid`. A row optimizer's step (`TableOverlay.update`) works on a compact table of
the step's distinct rows: their current values (the overlay's, else the base row turned into the overlay's
dtype: a quantized base row dequantized once, by the formula of its lookups) and state (the overlay's, else
zeros), updated by the backend's ``table_update`` with the lookups renumbered into that compact table (the
same lookups in the same order, so the same sums and roundings as on the whole table), then written back.
With a float base and the overlay in the table's own dtype (the default) a layer trained this way has the
bits of the same training on the in-memory table.
"""

from __future__ import annotations

import hashlib
import json
import os
import weakref
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch

from ... import _checks
from ...table import Table, row_grad_lookup
from ..files import dtype_name
from .overlay.store import OverlayStore

if TYPE_CHECKING:
    from types import ModuleType

    from ...backends import CustomOps
    from ..files import Checkpoint
    from ..layout import LayerPlan
    from .table import DiskTable

__all__ = ["TableOverlay", "OverlayTraining", "check_overlay_args", "base_fingerprint", "sample_ids", "OVERLAY_BYTES",
           "SAMPLE_ROWS"]

OVERLAY_BYTES = 1 << 30
"""Default ``overlay_bytes`` of ``load_layer(..., overlay=DIR)``: the overlay's rows kept in memory."""

SAMPLE_ROWS = 257
"""Rows (spread evenly over the table) whose bytes the base's fingerprint hashes."""


def sample_ids(n: int) -> torch.Tensor:
    """The rows of a table of ``n`` rows the fingerprint hashes: ``SAMPLE_ROWS`` (at most ``n``) spread evenly
    over ``[0, n)``, the first and the last included, in integer arithmetic (a float32 ``linspace`` rounds
    past the last row above 2**24 rows)."""
    k = min(SAMPLE_ROWS, n)
    return torch.unique(torch.arange(k, dtype=torch.int64) * (n - 1) // max(k - 1, 1))


def base_fingerprint(ckpt: Checkpoint, plan: LayerPlan, table: DiskTable) -> dict[str, Any]:
    """What identifies the base an overlay trains: the layer's config and prefix, the table's shape and
    dtype, its files (names and sizes) and a hash of ``SAMPLE_ROWS`` of its rows (two checkpoints of one
    config differ there). Reads ``SAMPLE_ROWS`` rows; moving the checkpoint's folder changes nothing. An Engram
    config's ``token_map`` (one id per token: 129280 in the demo) is kept as its SHA-256, so that the manifest each
    flush writes stays small."""
    n = table.num_rows
    sample = table._read(sample_ids(n)).view(torch.uint8)
    config = plan.config.to_dict()
    if config.get("token_map") is not None:
        config["token_map"] = "sha256:" + hashlib.sha256(json.dumps(config["token_map"]).encode()).hexdigest()
    return {"config": config, "prefix": plan.prefix, "rows": n, "dim": table.dim,
            "table_dtype": dtype_name(plan.table_dtype) + (" nf4" if table._packed else ""),
            "files": sorted([Path(f).name, Path(f).stat().st_size] for f in table.files),
            "sample_sha256": hashlib.sha256(sample.numpy().tobytes()).hexdigest()}


def _state_layout(names: tuple[str, ...], shapes: tuple[tuple[int, ...], ...]) -> dict[str, Any]:
    """A rule's state as the store's ``state``: per row, the shape past the rows' axis, float32."""
    return {name: (shape[1:], torch.float32) for name, shape in zip(names, shapes, strict=True)}


def check_overlay_args(overlay: Any, overlay_bytes: Any, overlay_dtype: Any, offload: Any) -> None:
    """``load_layer``'s checks of its overlay arguments: a ``ValueError`` / ``TypeError`` naming the one at fault."""
    if overlay is None and (overlay_bytes is not None or overlay_dtype is not None):
        raise ValueError("overlay_bytes, overlay_dtype: options of a trainable disk table; pass overlay=DIR")
    if overlay is not None:
        if offload != "disk":
            raise ValueError(f"overlay: trains a table read from disk; pass offload='disk' with it (offload is "
                             f"{offload!r})")
        if not isinstance(overlay, (str, os.PathLike)):
            raise TypeError(f"overlay: expected a directory path, got {type(overlay).__name__}")
        if overlay_bytes is not None:
            _checks.int_arg("overlay_bytes", overlay_bytes, minimum=0)
        if overlay_dtype is not None and (not isinstance(overlay_dtype, torch.dtype)
                                          or not overlay_dtype.is_floating_point):
            raise TypeError(f"overlay_dtype: expected a torch float dtype, got {overlay_dtype!r}")


class TableOverlay:
    """The overlay of a trainable `DiskTable` (see the module docstring): made by `TableOverlay.open`."""

    def __init__(self, table: DiskTable, store: OverlayStore) -> None:
        self._table = weakref.ref(table)             # (no cycle: a table dropped unclosed, no optimizer over it,
        self.store = store                           # is freed at once, and its store's lock with it)

    @property
    def table(self) -> DiskTable:
        """The table this overlay trains."""
        table = self._table()
        if table is None:
            raise RuntimeError("overlay: its table was garbage-collected")
        return table

    @classmethod
    def open(cls, table: DiskTable, directory: str | os.PathLike[str], *, base: dict[str, Any], memory_bytes: int,
             dtype: torch.dtype | None) -> TableOverlay:
        """Resume the overlay in ``directory`` or start one. ``dtype``: of the overlay's rows (default: the
        table's value dtype for a float base, so training equals the in-memory table's; bfloat16 for a quantized
        one); an existing overlay keeps its own, and another ``dtype`` given for it is a ``ValueError``."""
        found = OverlayStore.manifest(directory)
        if found is not None:
            if dtype is not None and dtype_name(dtype) != found.get("dtype"):
                raise ValueError(f"overlay_dtype: the overlay in {directory} holds {found.get('dtype')} rows, "
                                 f"not {dtype_name(dtype)} (leave overlay_dtype out to resume it)")
            store = OverlayStore.open(directory, base=base, dim=None, memory_bytes=memory_bytes,
                                      table_rows=table.num_rows)
            if store.layout.dim != table.dim:
                store.close()
                raise ValueError(f"overlay: {directory} holds rows of {store.layout.dim} values, the table's have "
                                 f"{table.dim}")
        else:
            if dtype is None:
                dtype = torch.bfloat16 if table.quantized else table.weight.dtype
            store = OverlayStore.open(directory, base=base, dim=table.dim, dtype=dtype, memory_bytes=memory_bytes,
                                      table_rows=table.num_rows)
        return cls(table, store)

    @property
    def dtype(self) -> torch.dtype:
        """The dtype of the overlay's rows."""
        return self.store.layout.dtype

    @property
    def state_names(self) -> tuple[str, ...]:
        return tuple(name for name, _, _ in self.store.layout.state)

    def attach(self, rule: str, names: tuple[str, ...], shapes: tuple[tuple[int, ...], ...]) -> None:
        """A row optimizer of ``rule`` takes the table: the overlay's rows must hold that rule's state (an
        empty overlay takes it). ``ValueError`` naming ``params`` otherwise, nothing changed."""
        want = _state_layout(names, shapes)
        try:
            self.store.relayout(want)
        except ValueError:
            raise ValueError(f"params: the table's overlay ({self.store.directory}) holds rows trained with the "
                             f"state {list(self.state_names) or 'none'}; a {rule!r} optimizer keeps "
                             f"{list(names) or 'none'} (train it with the rule it was trained with)") from None

    # ---- lookups ----------------------------------------------------------------------------------------
    def overlaid(self, ids: torch.Tensor, values: torch.Tensor) -> torch.Tensor:
        """``values`` ``[T, NH * D]`` (the base rows of ``ids`` ``[T, NH]``, on any device) with each row
        the overlay holds replaced by its value, cast to ``values``'s dtype."""
        if not self.store.num_rows:
            return values
        T, NH = ids.shape
        D = self.table.dim
        hit, got = self.store.read(ids.reshape(-1).to("cpu", torch.int64), ["rows"])
        cuda = values.device.type == "cuda"
        rows = got["rows"].pin_memory() if cuda else got["rows"]
        rows = rows.to(values.device, non_blocking=cuda).to(values.dtype)
        mask = hit.to(values.device, non_blocking=False).view(T * NH, 1)
        return torch.where(mask, rows, values.view(T * NH, D)).view(T, NH * D)

    def base_values(self, ids: torch.Tensor) -> torch.Tensor:
        """Base rows of sorted distinct host ids ``[n]`` in the overlay's dtype ``[n, D]`` (through the row
        cache; a quantized row dequantized by the formula of its lookups)."""
        t = self.table
        with t._lock:
            raw = t._distinct_rows(ids)
        rows = raw.view(torch.uint8).view(t.stored_dtype).view(ids.numel(), -1)
        scale = t.scale
        if scale is not None and scale.dim() == 2:                       # int8: per-row scales
            scale = scale.view(-1).index_select(0, ids).view(-1, 1)
        return t._values(rows, scale, self.dtype)

    # ---- training -------------------------------------------------------------------------------------------
    def update(self, ids: torch.Tensor, grad: torch.Tensor, op: Any, hyper: dict[str, Any]) -> None:
        """One row-optimizer step: lookups ``ids`` ``[M]`` with gradients ``grad`` ``[M, D]``, applied by
        ``op`` (a backend's ``table_update``) to the rows' current values and state, written to the overlay."""
        ids = ids.to("cpu", torch.int64)
        if not ids.numel():
            return
        grad = grad.to("cpu")
        uniq, inverse = torch.unique(ids, sorted=True, return_inverse=True)
        hit, cur = self.store.read(uniq)
        rows = torch.where(hit.view(-1, 1), cur["rows"], self.base_values(uniq))
        names = self.state_names
        state = tuple(cur[f"state.{n}"] for n in names)          # zeros where the overlay has no row
        op(rows, inverse, grad, state, validate=False, **hyper)
        self.store.update(uniq, rows, dict(zip(names, state, strict=True)))

    def flush(self, meta: dict[str, Any] | None) -> None:
        """`OverlayStore.flush` (``meta`` None: the last flush's)."""
        self.store.flush(meta=meta)

    def close(self) -> None:
        self.store.close()


class OverlayTraining(Table):
    """What a `DiskTable` trains with (its base class): the overlay it is given (`attach_overlay`), the lookups
    that read the overlay's rows over the base's, `trained`, `flush`, and the ``with`` block. Without an
    overlay it changes nothing.

    The overlay's lifetime: `close` (``DiskTable.close``) releases it, and its directory's single-writer lock,
    *without* flushing (updates since the last `flush` are dropped); so does the table garbage-collected
    unclosed (``del layer``, and any optimizer over it: it holds the table), its unflushed spill files left
    for the next open to delete. ``with ple.io.load_layer(..., offload="disk", overlay=DIR) as layer:``
    flushes and closes at the end of the block, or only closes when the block ends with an exception (see
    `__exit__`)."""

    _overlay: TableOverlay | None = None

    @property
    def overlay(self) -> OverlayStore | None:
        """The store of the rows training changed (``load_layer(..., overlay=DIR)``; ``ple.io.disk_table.training``),
        or None: a table served, not trained."""
        return self._overlay.store if self._overlay is not None else None

    def attach_overlay(self, overlay: TableOverlay) -> None:
        """Train through ``overlay`` (``load_layer(..., overlay=DIR)`` calls it): `trained` becomes a float meta
        tensor ``[rows, D]`` of the overlay's dtype that requires grad (``weight`` keeps saying what the files
        hold)."""
        self._overlay = overlay
        self._trained = torch.empty((self.num_rows, self.dim), dtype=overlay.dtype, device="meta",
                                    requires_grad=True)

    @property
    def trained(self) -> torch.Tensor:
        return self._trained if self._overlay is not None else self.weight

    def close(self) -> None:
        """Release the overlay (and its directory's lock) without flushing: updates since the last `flush` are
        dropped. ``DiskTable.close`` releases its files too."""
        if self._overlay is not None:
            self._overlay.close()

    def __enter__(self) -> OverlayTraining:
        return self

    def __exit__(self, exc_type: object, exc: object, tb: object) -> None:
        """The end of a ``with`` block (of the table, or of its layer: ``PLELayer.__exit__``): without an exception,
        `flush` (the overlay durable, with the row optimizer's step count), then `close`; after an exception,
        `close` only: the overlay stays as of its last flush (a step broken off half way is not made durable).
        A table without an overlay is closed."""
        try:
            if exc_type is None and self._overlay is not None and not self._overlay.store.closed:
                self.flush()
        finally:
            self.close()

    def flush(self) -> None:
        """Make the overlay durable (docs/spec.md 12): when this returns, the overlay's directory holds every update
        so far and the row optimizer's step count and hyperparameters (for ``ple.io.load_optimizer``), and a
        process killed at any moment after leaves it as of this flush or a later one. Lookups' gradients
        not yet applied by ``step()`` are not in it. ``ValueError`` for a table without an overlay."""
        if self._overlay is None:
            raise ValueError("flush: this table has no overlay (load it with load_layer(..., offload='disk', "
                             "overlay=DIR) to train it)")
        owner = self.row_optimizer
        describe = getattr(owner, "describe_table", None)
        meta = {"optimizer": describe(self)} if describe is not None else None
        self._overlay.flush(meta)

    def rows(self, ids: torch.Tensor, dtype: torch.dtype, *, ops: ModuleType | CustomOps,
             validate: bool = True) -> torch.Tensor:
        """As ``Table.rows``; with an overlay, each row it holds replaces the base row (prefetched or not)."""
        if self._overlay is None:
            return super().rows(ids, dtype, ops=ops, validate=validate)
        pending, self._pending = self._pending, None
        got = self._take(pending, ids) if pending is not None else None
        if got is None:
            return self.lookup(ids, dtype, ops=ops, validate=validate)
        values = self._overlaid(ids, self._values_on(ops, *got, dtype))
        return row_grad_lookup(self, ids, lambda: values, ops) if self._trains_by_rows() else values

    def _overlaid(self, ids: torch.Tensor, values: torch.Tensor) -> torch.Tensor:
        return values if self._overlay is None else self._overlay.overlaid(ids, values)
