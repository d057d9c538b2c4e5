"""The n-gram table of one PLE layer: one abstraction, every storage.

A table is the module ``layer.ple_embedding.ngram_embedding`` (so its state-dict keys are
the checkpoint's: ``weight``, plus ``weight_scale`` when quantized) and answers one
question: ``table.rows(ids, dtype, ops=...)``, the concatenated rows ``[T, NH * D]`` of
hash ids ``[T, NH]`` in ``dtype``, on ``ids``'s device.

==========================  ===============================================================
`DenseTable`                a float ``weight`` Parameter ``[rows, D]`` (trainable; optionally
                            with sparse gradients)
`QuantizedTable`            FP8 or int8 ``weight`` buffer and its float32 ``weight_scale``,
                            or NF4 packed uint8 rows with their scales inside (``ple.quant``);
                            no gradient
either, sharded             its tensors DTensors on a device mesh (``ple.distributed``'s
                            ``TableRowwise`` / ``TableColwise``): each rank holds a piece and
                            the lookup is a collective, dispatched through the hook
                            ``ple.distributed`` registers (`register_dtensor_lookup`)
``ple.io.DiskTable``   any of the stored dtypes left in the checkpoint's files, read
                            through read-only memory maps and a row cache
                            (``load_layer(..., offload="disk")``); it overrides `lookup`,
                            `prefetch` and the placement methods, and the subclass hook
                            ``_values`` (stored rows to values)
==========================  ===============================================================

Dense and quantized tables may live in host memory while the layer runs on a GPU
(`Table.offload_`): rows are then gathered on the host and only the ``T * NH`` rows
looked up cross the bus. `Table.prefetch` starts that gather early (``ple.offload``);
the next `rows` call with the same ids uses the fetched rows. The prefetch state lives
in the table.

Every path gives the bits of the in-memory lookup: a gather is a copy, and
dequantization is one elementwise formula (``(q.float() * scale).to(dtype)``; NF4:
``level[code] * float(scale)``), applied to the rows gathered only. NF4 rows are unpacked by
the backend's own ``nf4_dequantize_rows`` where its op module has one (``ple.reference``: the
readable statement) and by ``ple.quant.dequantize_rows`` (vectorised) otherwise; both give the
same bits. An NF4 table is saved to and loaded from checkpoints (``ple.io``) and offloaded like
the others: kept in host memory (its packed rows, ``D/2 + 4`` bytes each, are gathered on the host
and cross the bus packed, to be unpacked on the device) or read from its files
(``ple.io.DiskTable``), and sharded by rows only (``ple.distributed``: whole packed rows a rank,
moved packed and unpacked after the collective).

While a row optimizer (``ple.optim``) holds a float table, its lookups record for it: `row_grad_lookup`
hands each lookup's ids and the gradient of its rows to the optimizer in the backward, and no gradient
reaches ``weight.grad`` (`Table.row_optimizer`).
"""

from __future__ import annotations

import functools
import warnings
from collections.abc import Callable
from types import ModuleType
from typing import TYPE_CHECKING, Any, cast

import torch
from torch import nn
from torch.types import Device

from .quant import SCHEMES, Scheme, as_scheme, dequantize_rows, gather_raw, quantize, scheme_of

if TYPE_CHECKING:
    from .backends import CustomOps
    from .offload import Prefetch

__all__ = ["Table", "DenseTable", "QuantizedTable", "gather_raw", "is_float_table", "FLOAT_TABLE_DTYPES",
           "register_dtensor_lookup", "row_grad_lookup"]

FLOAT_TABLE_DTYPES = (torch.float32, torch.float64, torch.bfloat16, torch.float16)


def is_float_table(dtype: torch.dtype) -> bool:
    """A trainable float table (float16/bfloat16/float32/float64); anything else (int8, FP8, NF4) is quantized."""
    return dtype in FLOAT_TABLE_DTYPES


def _is_dtensor(t: object) -> bool:
    if not torch.distributed.is_available():
        return False
    from torch.distributed.tensor import DTensor

    return isinstance(t, DTensor)


_dtensor_lookup: Callable[..., torch.Tensor] | None = None


def register_dtensor_lookup(fn: Callable[..., torch.Tensor]) -> None:
    """Set the lookup of a table whose ``weight`` is a DTensor: ``fn(table, ids, dtype, *, ops, validate)``.

    ``ple.distributed`` registers its collective lookup when imported (this module imports
    nothing above it); `Table.lookup` calls it for every DTensor table.
    """
    global _dtensor_lookup
    _dtensor_lookup = fn


class Table(nn.Module):
    """Base of every table: ``rows``, host offload and prefetch (see the module docstring).

    Subclasses set ``weight`` (and ``weight_scale`` when quantized) and may override
    `rows`. ``prefetch_verify`` (default True): a prefetch is used only if its ids equal
    the ids `rows` is asked for (one device sync on CUDA); False compares shapes only.
    """

    prefetch_verify: bool = True
    weight: torch.Tensor                     # set by the subclass (a Parameter or a buffer)

    def __init__(self) -> None:
        super().__init__()
        self._pending: Prefetch | None = None
        self.sparse_grad = False
        self._row_sink: Callable[[], Any] | None = None      # a weak reference to a ple.optim optimizer

    # ---- what it holds -----------------------------------------------------------------------
    @property
    def num_rows(self) -> int:
        return self.weight.shape[0]

    @property
    def dim(self) -> int:
        return self.weight.shape[1]

    @property
    def scale(self) -> torch.Tensor | None:
        """``weight_scale`` of a quantized table, else None."""
        return cast("torch.Tensor | None", getattr(self, "weight_scale", None))   # a buffer, if any

    @property
    def quantized(self) -> bool:
        return self.scale is not None or not is_float_table(self.weight.dtype)

    @property
    def _packed(self) -> bool:
        """NF4: ``weight`` holds packed uint8 rows, each with its scale (``ple.quant``)."""
        return self.weight.dtype == torch.uint8

    @property
    def pending_prefetch(self) -> Prefetch | None:
        """The prefetch `rows` will consume next (``ple.offload``), or None."""
        return self._pending

    # ---- lookups -----------------------------------------------------------------------------
    def rows(self, ids: torch.Tensor, dtype: torch.dtype, *, ops: ModuleType | CustomOps,
             validate: bool = True) -> torch.Tensor:
        """Rows of hash ids ``[T, NH]`` as ``[T, NH * D]`` in ``dtype`` on ``ids``'s device.

        ``ops`` is the backend's op module (its ``embedding_lookup`` gathers on the table's
        device). A pending prefetch of the same ids is used instead of a new gather; a
        table in host memory is gathered there and the rows copied over. ``validate=False``
        skips the range check of ``ids`` (a host sync): for ids the layer's own hash made.
        """
        pending, self._pending = self._pending, None
        if pending is not None:
            got = self._take(pending, ids)
            if got is not None:
                values = self._values_on(ops, *got, dtype)
                if self._trains_by_rows():              # a row optimizer takes the gradient: the rows serve
                    return row_grad_lookup(self, ids, lambda: values, ops)
                return values
        return self.lookup(ids, dtype, ops=ops, validate=validate)

    def _values(self, rows: torch.Tensor, scale: torch.Tensor | None, dtype: torch.dtype) -> torch.Tensor:
        """Stored rows ``[T, NH * D]`` (and their scale) as values in ``dtype``: dequantized, or cast."""
        if self._packed:                                     # NF4: the scales are in the rows
            return dequantize_rows(rows, None, dtype, dim=self.dim)
        # A quantized table has a scale (only a table with a float weight and no scale is not).
        return dequantize_rows(rows, cast(torch.Tensor, scale), dtype) if self.quantized else rows.to(dtype)

    def _values_on(self, ops: ModuleType | CustomOps, rows: torch.Tensor, scale: torch.Tensor | None,
                   dtype: torch.dtype) -> torch.Tensor:
        """`_values`, but NF4 rows go through ``ops.nf4_dequantize_rows`` where the op module has one."""
        unpack = getattr(ops, "nf4_dequantize_rows", None) if self._packed else None
        return unpack(rows, self.dim, dtype) if unpack is not None else self._values(rows, scale, dtype)

    @property
    def is_dtensor(self) -> bool:
        """The weight is a ``DTensor`` (``ple.distributed.TableRowwise`` / ``TableColwise``): lookups are collective."""
        return _is_dtensor(self.weight)

    @property
    def row_optimizer(self) -> torch.optim.Optimizer | None:
        """The ``ple.optim`` optimizer training this table row by row, or None (held by a weak reference)."""
        sink = getattr(self, "_row_sink", None)
        return sink() if sink is not None else None

    @property
    def trained(self) -> torch.Tensor:
        """What a row optimizer (``ple.optim``) holds for this table and its lookups' autograd records against:
        ``weight`` (for a disk table trained through an overlay, a float meta tensor ``[rows, D]`` in the
        overlay's dtype: its ``requires_grad`` says whether the table trains)."""
        return self.weight

    def _trains_by_rows(self) -> bool:
        """A lookup now records for a row optimizer (``ple.optim``): one holds the table and autograd is on."""
        return self.trained.requires_grad and torch.is_grad_enabled() and self.row_optimizer is not None

    def lookup(self, ids: torch.Tensor, dtype: torch.dtype, *, ops: ModuleType | CustomOps,
               validate: bool = True) -> torch.Tensor:
        """`rows` without a prefetch: gathered now. While a row optimizer holds the table (``ple.optim``), the
        rows' gradient goes to it in the backward (`row_grad_lookup`), never to ``.grad``."""
        if self._trains_by_rows():
            return row_grad_lookup(self, ids, lambda: self._gather(ids, dtype, ops=ops, validate=validate), ops)
        return self._gather(ids, dtype, ops=ops, validate=validate)

    def _gather(self, ids: torch.Tensor, dtype: torch.dtype, *, ops: ModuleType | CustomOps,
                validate: bool = True) -> torch.Tensor:
        """The body of `lookup`."""
        if self.is_dtensor:
            if _dtensor_lookup is None:
                raise RuntimeError("a DTensor table is looked up by ple.distributed: import ple.distributed")
            return _dtensor_lookup(self, ids, dtype, ops=ops, validate=validate)
        if self.weight.device == ids.device:
            lookup = functools.partial(ops.embedding_lookup, validate=validate)
            if self.sparse_grad and self.weight.requires_grad and torch.is_grad_enabled():
                from .reference.embedding import embedding_lookup_sparse_grad

                return embedding_lookup_sparse_grad(self.weight, ids, lookup).to(dtype)
            rows, scale = gather_raw(self.weight, self.scale, ids, lookup)
        else:                                        # offloaded: gather on the host, copy the rows
            from .reference.embedding import embedding_lookup

            host_lookup = functools.partial(embedding_lookup, validate=validate)
            rows, scale = gather_raw(self.weight, self.scale, ids.to(self.weight.device), host_lookup)
            rows = rows.to(ids.device, non_blocking=rows.is_pinned())
            if scale is not None:
                scale = scale.to(ids.device, non_blocking=scale.is_pinned())
        return self._values_on(ops, rows, scale, dtype)

    def _take(self, pending: Prefetch, ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor | None] | None:
        """``(rows, row_scale)`` of a pending prefetch if it may be used for ``ids``, else None (warns)."""
        p_ids, rows, scale = pending.result()
        if torch.is_grad_enabled() and self.trained.requires_grad and self.row_optimizer is None \
                and getattr(self, "_overlay", None) is None:
            warnings.warn("start_prefetch: the table needs a gradient here, so the prefetched rows (fetched "
                          "without autograd) were not used; looked up again", stacklevel=4)
            return None
        same = p_ids.shape == ids.shape and p_ids.device == ids.device and (
            not self.prefetch_verify or torch.equal(p_ids, ids.to(p_ids.dtype)))
        if not same:
            warnings.warn("start_prefetch: the prefetched ids do not match this call's ids (was "
                          "start_prefetch called with this step's tokens?); looked up again", stacklevel=4)
            return None
        return rows, scale

    # ---- placement -----------------------------------------------------------------------------
    def offload_(self, *, pin: bool | None = None) -> Table:
        """Keep the table in host memory (pinned if ``pin``, default: where CUDA exists). Returns self.

        A per-row scale (int8) goes with the rows; a per-tensor scale (FP8) stays where it is. An
        NF4 table's packed rows carry their scales: a lookup gathers them on the host, copies them
        over packed (``D/2 + 4`` bytes a row) and unpacks them on the device.
        """
        if self.is_dtensor:
            raise NotImplementedError("offload_: a DTensor table is looked up collectively; keep each rank's piece "
                                      "on its device")
        pin = torch.cuda.is_available() if pin is None else bool(pin)

        def host(t: torch.Tensor) -> torch.Tensor:
            t = t.detach().to("cpu")
            return t.pin_memory() if pin and not t.is_pinned() else t

        if isinstance(self._parameters.get("weight"), nn.Parameter):
            self.weight = nn.Parameter(host(self.weight), requires_grad=self.weight.requires_grad)
        else:
            self._buffers["weight"] = host(self.weight)
        if self.scale is not None and self.scale.dim() == 2:
            self._buffers["weight_scale"] = host(self.scale)
        self._pending = None
        return self

    def prefetch(self, ids: torch.Tensor, device: torch.device) -> None:
        """Start fetching the rows of hash ids ``[T, NH]`` (on the host or on ``device``) to ``device``.

        The next `rows` call whose ids match uses them; a new call replaces an unused one.
        """
        from .offload import start_fetch

        if self.is_dtensor:
            raise NotImplementedError("start_prefetch: a DTensor table is looked up collectively; there is "
                                      "nothing to prefetch")
        self._pending = start_fetch(self.weight, self.scale, ids, torch.device(device))

    def _apply(self, fn: Callable[[torch.Tensor], torch.Tensor], recurse: bool = True) -> Table:
        # A quantized table's buffers are presented as integer views while `fn` runs, so device
        # moves apply to them and dtype casts (which touch floating-point tensors only) do not.
        # (Every table that is quantized holds its tensors as buffers, never as parameters.)
        if not self.quantized:
            return super()._apply(fn, recurse)
        held = {k: t for k, t in self._buffers.items() if k in ("weight", "weight_scale") and t is not None}
        for k, t in held.items():
            if t.dtype.is_floating_point:
                self._buffers[k] = t.view(torch.int32 if k == "weight_scale" else torch.uint8)
        try:
            super()._apply(fn, recurse)
        finally:
            for k, t in held.items():
                self._buffers[k] = cast(torch.Tensor, self._buffers[k]).view(t.dtype)   # set again by fn
        return self


class DenseTable(Table):
    """A float table: the Parameter ``weight`` ``[num_rows, dim]``, normal(0, 1) as the model's.

    With ``sparse_grad`` its gradient is a sparse tensor of the rows looked up
    (``ple.reference.embedding_lookup_sparse_grad``), for tables whose dense gradient
    would not fit (the real model's: 320M x 160 in float32, about 205 GB).
    """

    def __init__(self, num_rows: int, dim: int, *, device: Device = None, dtype: torch.dtype | None = None,
                 sparse_grad: bool = False) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.empty(num_rows, dim, device=device, dtype=dtype))
        if self.weight.device.type != "meta":
            nn.init.normal_(self.weight)
        self.sparse_grad = bool(sparse_grad)

    def extra_repr(self) -> str:
        return f"{self.num_rows}, {self.dim}, dtype={self.weight.dtype}, sparse_grad={self.sparse_grad}"


class QuantizedTable(Table):
    """A quantized ``[rows, D]`` table: buffers ``weight`` (fp8 or int8) and ``weight_scale`` (float32), or NF4.

    ``weight_scale`` is ``[1]`` for FP8 (per tensor) and ``[rows, 1]`` for int8 (per row),
    see ``ple.quant``. An NF4 table has ``weight`` uint8 ``[rows, D/2 + 4]`` (each row's codes
    and float16 scale, docs/spec.md section 13) and no ``weight_scale``; its `dim` is D. No
    parameters (a quantized table is not trained). Moving it (``.to(device)``) moves the
    buffers; a dtype cast (``layer.to(torch.bfloat16)``) leaves them as they are, bit for bit.
    """

    def __init__(self, weight: torch.Tensor, weight_scale: torch.Tensor | None = None) -> None:
        super().__init__()
        s = scheme_of(weight.dtype) if isinstance(weight, torch.Tensor) else None
        if s is None or weight.dim() != 2 or (s.packed and weight.shape[1] < 5):
            what = f"{weight.dtype} {tuple(weight.shape)}" if isinstance(weight, torch.Tensor) \
                else type(weight).__name__
            raise ValueError(f"weight: expected a 2-D {' or '.join(str(x.dtype) for x in SCHEMES.values())} "
                             f"tensor (uint8: NF4 rows of D/2 + 4 bytes, D >= 2), got {what}")
        if s.packed:
            if weight_scale is not None:
                raise ValueError("weight_scale: an NF4 table has none (each row holds its float16 scale); "
                                 "pass None")
            self.register_buffer("weight", weight)
            return
        want = (weight.shape[0], 1) if s.per_row else (1,)
        if not isinstance(weight_scale, torch.Tensor) or weight_scale.dtype != torch.float32 \
                or tuple(weight_scale.shape) != want:
            what = f"{weight_scale.dtype} {tuple(weight_scale.shape)}" if isinstance(weight_scale, torch.Tensor) \
                else repr(weight_scale)
            raise ValueError(f"weight_scale: expected float32 {want} for a {s.name} table, got {what}")
        self.register_buffer("weight", weight)
        self.register_buffer("weight_scale", weight_scale)

    @classmethod
    def from_float(cls, table: torch.Tensor, scheme: Scheme | str) -> QuantizedTable:
        """The quantization of a float table ``[rows, D]`` (``ple.quant.quantize``): fp8, int8 or nf4."""
        return cls(*quantize(table, scheme))

    @classmethod
    def empty(cls, num_rows: int, dim: int, scheme: Scheme | str, device: Device = None) -> QuantizedTable:
        """An uninitialised table (e.g. on the meta device, filled by ``load_state_dict(assign=True)``).

        NF4: ``weight`` is uint8 ``[num_rows, dim/2 + 4]`` (``dim`` even: else a ``ValueError``
        naming ``dim``) and there is no ``weight_scale``.
        """
        s = as_scheme(scheme)
        weight = torch.empty(num_rows, s.weight_width(dim), dtype=s.dtype, device=device)
        if s.packed:
            return cls(weight)
        scale_shape = (num_rows, 1) if s.per_row else (1,)
        return cls(weight, torch.ones(scale_shape, dtype=torch.float32, device=device))

    @property
    def dim(self) -> int:
        """D, the values per row (an NF4 row stores them in ``D/2 + 4`` bytes)."""
        return self.scheme.dim_of(self.weight.shape[1])

    @property
    def scheme(self) -> Scheme:
        return cast(Scheme, scheme_of(self.weight.dtype))       # checked in __init__

    def extra_repr(self) -> str:
        return f"{self.num_rows}, {self.dim}, scheme={self.scheme.name}"


class _RowGradLookup(torch.autograd.Function):
    """The rows of ``ids`` (computed by ``values`` without autograd); the backward hands ``(ids, grad)`` to
    ``sink`` and returns no gradient for the weight (so nothing reaches ``.grad``)."""

    @staticmethod
    def forward(ctx: Any, weight: torch.Tensor, ids: torch.Tensor, values: Callable[[], torch.Tensor],
                sink: Callable[[torch.Tensor, torch.Tensor], None]) -> torch.Tensor:
        ctx.sink = sink
        ctx.save_for_backward(ids)
        return values()

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[None, None, None, None]:
        (ids,) = ctx.saved_tensors
        ctx.sink(ids, grad)
        return None, None, None, None


def row_grad_lookup(table: Table, ids: torch.Tensor, values: Callable[[], torch.Tensor],
                    ops: ModuleType | CustomOps) -> torch.Tensor:
    """What a table's lookup returns while a row optimizer (``ple.optim``) holds it and autograd records:
    ``values()`` (the rows, looked up without autograd), whose backward hands the ids ``[T, NH]`` and the rows'
    gradient ``[T, NH * D]`` to the optimizer holding the table then (nothing if it was dropped since)."""

    def sink(ids: torch.Tensor, grad: torch.Tensor) -> None:
        owner = table.row_optimizer
        if owner is not None:
            owner._accept(table, ids, grad, ops)          # type: ignore[attr-defined]

    return cast(torch.Tensor, _RowGradLookup.apply(table.trained, ids, values, sink))
