"""Host-offloaded tables and prefetched lookups.

The real table (320,001,536 rows of 160 values, ~95 GiB in bfloat16) need not sit on
the GPU: `offload_table` keeps it in CPU memory (pinned where CUDA exists; an int8
table's per-row scales go with it, an FP8 table's one scale stays with the layer)
while the projections, norms and conv stay on the layer's device. A lookup then
gathers the rows on the host and copies them over; only ``T * NH`` rows cross the bus
(half the bytes for an FP8 table, which is dequantized on the device).

``layer.start_prefetch(input_ids, query_start_loc, ngram_context)`` takes the arguments
of ``ngram_ids`` (SPEC section 3), computes the hash ids and starts fetching the rows,
so the work overlaps the preceding decoder layer:

* CUDA, table on the host: the ids are hashed on the host when the tokens are there
  (else on the device and copied back); a worker thread gathers the rows into pinned
  memory and copies them to the device on a side stream.
* CUDA, table on the device: ids and gather run on a side stream.
* No CUDA: everything runs synchronously, inside the call.

The next `forward` / `step` (through ``layer.embed``) waits for the prefetch and uses
its rows when its ids equal the ids it computed itself; otherwise (a stale or
mismatched prefetch, or a table that needs a gradient) it looks the rows up again and
warns. A prefetch is used at most once. Either way the rows are those of the in-memory
path, bit for bit: a gather is a copy, and dequantization is the same elementwise formula.

Costs on CUDA: comparing the ids is one device synchronisation per use; a serving loop
that always prefetches the step's own tokens can set ``layer.prefetch_verify = False``
to compare shapes only. Pass the tokens as host tensors (serving engines have them
there): ``ngram_ids`` checks token ranges on the host, so device tensors cost a
synchronisation inside `start_prefetch`.
"""

from __future__ import annotations

import warnings
from concurrent.futures import ThreadPoolExecutor

import torch
import torch.nn.functional as F
from torch import nn

from . import _checks
from .quant import QuantizedEmbedding, dequantize_rows
from .reference import embedding as _ref_embedding
from .reference import hashing as _ref_hashing

__all__ = ["offload_table", "is_offloaded", "start_prefetch", "embed_rows"]

_EXECUTOR: ThreadPoolExecutor | None = None


def _executor() -> ThreadPoolExecutor:
    global _EXECUTOR
    if _EXECUTOR is None:
        _EXECUTOR = ThreadPoolExecutor(max_workers=1, thread_name_prefix="ple-prefetch")
    return _EXECUTOR


def _table(layer) -> nn.Module:
    return layer.ple_embedding.ngram_embedding


def _compute_device(layer) -> torch.device:
    return layer.key_proj.weight.device


def offload_table(layer, *, pin: bool | None = None):
    """Keep ``layer``'s table in host memory; everything else stays where it is. Returns ``layer``.

    Move the layer to its device first (``layer.to("cuda")`` moves the table too), then
    offload. ``pin`` (default: whether CUDA is available) pins the host copy, which
    asynchronous copies need. A table that is already on the host is kept (and pinned
    if asked). Works for float and quantized tables.
    """
    pin = torch.cuda.is_available() if pin is None else bool(pin)

    def host(t: torch.Tensor) -> torch.Tensor:
        t = t.detach().to("cpu")
        return t.pin_memory() if pin and not t.is_pinned() else t

    table = _table(layer)
    if isinstance(table, QuantizedEmbedding):
        table._buffers["weight"] = host(table.weight)
        if table.scheme.per_row:
            table._buffers["weight_scale"] = host(table.weight_scale)
    else:
        table.weight = nn.Parameter(host(table.weight), requires_grad=table.weight.requires_grad)
    layer._pending_prefetch = None
    return layer


def is_offloaded(layer) -> bool:
    """Whether the table lives on another device (the host) than the layer's projections."""
    return _table(layer).weight.device != _compute_device(layer)


# ---- gathering -------------------------------------------------------------------------------------
def _unchecked_lookup(weight: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
    """``embedding_lookup`` without its range check (a device sync), for ids made by ``ngram_ids``."""
    T, NH = ids.shape
    return F.embedding(ids.to(torch.int64), weight).reshape(T, NH * weight.shape[1])


def _gather(table: nn.Module, ids: torch.Tensor, lookup):
    """Raw rows of ``[T, NH]`` ids on the table's device: ``(rows [T, NH*D], row_scale or None)``."""
    if isinstance(table, QuantizedEmbedding):
        return table.lookup(ids, lookup=lookup)
    return lookup(table.weight, ids), None


def _gather_pinned(weight: torch.Tensor, scale: torch.Tensor | None, ids: torch.Tensor, pin: bool):
    """Host gather into (pinned) buffers: ``weight[ids]`` as ``[T, NH*D]`` and, per row, ``scale[ids]``."""
    T, NH = ids.shape
    flat = ids.reshape(-1).to(torch.int64)
    fp8 = weight.dtype.is_floating_point and weight.element_size() == 1
    raw = weight.view(torch.uint8) if fp8 else weight
    rows = torch.empty((T * NH, weight.shape[1]), dtype=raw.dtype, pin_memory=pin)
    torch.index_select(raw, 0, flat, out=rows)
    rows = rows.view(weight.dtype).reshape(T, NH * weight.shape[1])
    row_scale = None
    if scale is not None:
        row_scale = torch.empty((T * NH, 1), dtype=scale.dtype, pin_memory=pin)
        torch.index_select(scale, 0, flat, out=row_scale)
        row_scale = row_scale.reshape(T, NH)
    return rows, row_scale


def _lookup_now(layer, ids: torch.Tensor):
    """Rows of ``ids`` on ``ids``'s device, looked up now (host gather + copy for an offloaded table)."""
    table = _table(layer)
    if table.weight.device == ids.device:
        return _gather(table, ids, layer.ops.embedding_lookup)
    rows, scale = _gather(table, ids.to(table.weight.device), _ref_embedding.embedding_lookup)
    non_blocking = rows.is_pinned()
    rows = rows.to(ids.device, non_blocking=non_blocking)
    if scale is not None:
        scale = scale.to(ids.device, non_blocking=non_blocking)
    return rows, scale


def _finish(table: nn.Module, rows: torch.Tensor, row_scale, dtype: torch.dtype) -> torch.Tensor:
    if isinstance(table, QuantizedEmbedding):
        return dequantize_rows(rows, row_scale.to(rows.device), dtype)
    return rows.to(dtype)


def embed_rows(layer, ids: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """``layer.embed`` for quantized, offloaded or prefetched tables: ``[T, NH]`` ids -> ``[T, E]``."""
    table = _table(layer)
    pending, layer._pending_prefetch = getattr(layer, "_pending_prefetch", None), None
    if pending is not None:
        p_ids, rows, scale = pending.result()
        needs_grad = torch.is_grad_enabled() and table.weight.requires_grad
        if needs_grad:
            warnings.warn("start_prefetch: the table needs a gradient here, so the prefetched rows (fetched "
                          "without autograd) were not used; looked up again", stacklevel=3)
        elif p_ids.shape == ids.shape and p_ids.device == ids.device and (
                not getattr(layer, "prefetch_verify", True) or torch.equal(p_ids, ids.to(p_ids.dtype))):
            return _finish(table, rows, scale, dtype)
        else:
            warnings.warn("start_prefetch: the prefetched ids do not match this call's ids (was "
                          "start_prefetch called with this step's tokens?); looked up again", stacklevel=3)
    rows, scale = _lookup_now(layer, ids)
    return _finish(table, rows, scale, dtype)


# ---- prefetch --------------------------------------------------------------------------------------
class _Prefetch:
    """A prefetch in flight: ``result()`` waits, then gives ``(ids, rows, row_scale)`` on the device."""

    def __init__(self, ids=None, rows=None, scale=None, *, future=None, done=None):
        self._value = (ids, rows, scale)
        self._future = future
        self._done = done

    def result(self):
        if self._future is not None:
            self._value, self._done = self._future.result()
            self._future = None
        if self._done is not None:                     # CUDA: order the side stream's copies before use
            cur = torch.cuda.current_stream(self._value[1].device)
            cur.wait_event(self._done)
            for t in self._value:
                if t is not None:
                    t.record_stream(cur)
            self._done = None
        return self._value


@torch.no_grad()
def start_prefetch(layer, input_ids: torch.Tensor, query_start_loc: torch.Tensor | None = None,
                   ngram_context: torch.Tensor | None = None) -> None:
    """Hash ``input_ids`` and start fetching their rows for the next ``layer.embed`` (see the module doc).

    Arguments are those of ``ngram_ids``; they may live on the host or on the layer's
    device. Bad arguments raise before anything changes; a new call replaces a pending
    prefetch that was not used.
    """
    _checks.tensor("input_ids", input_ids, ndim=1, kind="anyint")
    cfg = layer.config
    params = layer.ple_embedding.hash_params()
    kw = dict(heads_per_ngram=cfg.heads_per_ngram, eos_token_id=cfg.eos_token_id,
              query_start_loc=query_start_loc, ngram_context=ngram_context)
    dev = _compute_device(layer)
    table = _table(layer)
    tdev = table.weight.device
    in_dev = input_ids.device
    hash_ops = layer.ops if in_dev == dev else _ref_hashing     # fast ops run on the layer's device only

    if dev.type != "cuda" and tdev.type != "cuda":
        ids = hash_ops.ngram_ids(input_ids, params, **kw)
        lookup = layer.ops.embedding_lookup if tdev == dev else _ref_embedding.embedding_lookup
        rows, scale = _gather(table, ids.to(tdev), lookup)
        scale = None if scale is None else scale.to(dev)
        layer._pending_prefetch = _Prefetch(ids.to(dev), rows.to(dev), scale)
        return

    if tdev == dev:                                              # table on the GPU: a side stream
        side = torch.cuda.Stream(device=dev)
        side.wait_stream(torch.cuda.current_stream(dev))
        if in_dev.type == "cpu":
            ids_host = _ref_hashing.ngram_ids(input_ids, params, **kw).pin_memory()
        else:
            for t in (input_ids, query_start_loc, ngram_context):
                if t is not None and t.device.type == "cuda":
                    t.record_stream(side)
        with torch.cuda.stream(side):
            if in_dev.type == "cpu":
                ids = ids_host.to(dev, non_blocking=True)
            else:
                ids = hash_ops.ngram_ids(input_ids, params, **kw).to(dev)
            rows, scale = _gather(table, ids, _unchecked_lookup)
            done = torch.cuda.Event()
            done.record(side)
        layer._pending_prefetch = _Prefetch(ids, rows, scale, done=done)
        return

    # Table on the host, layer on the GPU: hash, then gather + copy in a worker thread.
    pin = True
    ids_ready = None
    if in_dev.type == "cpu":
        ids_host = _ref_hashing.ngram_ids(input_ids, params, **kw)
        ids_dev = None
    else:
        ids_dev = layer.ops.ngram_ids(input_ids, params, **kw) if in_dev == dev else \
            _ref_hashing.ngram_ids(input_ids, params, **kw)
        ids_host = torch.empty(ids_dev.shape, dtype=ids_dev.dtype, pin_memory=pin)
        ids_host.copy_(ids_dev, non_blocking=True)
        ids_ready = torch.cuda.Event()
        ids_ready.record(torch.cuda.current_stream(ids_dev.device))
        ids_dev = ids_dev.to(dev)
    weight = table.weight
    quantized = isinstance(table, QuantizedEmbedding)
    host_scale = table.weight_scale if quantized and table.scheme.per_row else None
    dev_scale = table.weight_scale if quantized and host_scale is None else None

    def work():
        if ids_ready is not None:
            ids_ready.synchronize()
        rows_h, scale_h = _gather_pinned(weight, host_scale, ids_host, pin)
        side = torch.cuda.Stream(device=dev)
        with torch.cuda.stream(side):
            rows_d = rows_h.to(dev, non_blocking=True)
            scale_d = scale_h.to(dev, non_blocking=True) if scale_h is not None else dev_scale
            ids_d = ids_dev if ids_dev is not None else ids_host.to(dev, non_blocking=True)
            done = torch.cuda.Event()
            done.record(side)
        return (ids_d, rows_d, scale_d), done

    layer._pending_prefetch = _Prefetch(future=_executor().submit(work))
