"""Host-offloaded tables and prefetched lookups.

The real table (320,001,536 rows of 160 values, ~95 GiB in bfloat16) need not sit on
the GPU: `offload_table` keeps it in CPU memory (pinned where CUDA exists; an int8
table's per-row scales go with it, an FP8 table's one scale stays with the layer)
while the projections, norms and conv stay on the layer's device. A lookup then
gathers the rows on the host and copies them over; only ``T * NH`` rows cross the bus
(half the bytes for an FP8 table, which is dequantized on the device; an NF4 table's rows
cross packed, ``D/2 + 4`` bytes each, and are unpacked on the device). The table
(``ple.table``) does this itself; this module holds the machinery.

``layer.start_prefetch(input_ids, query_start_loc, ngram_context)`` takes the arguments
of ``ngram_ids`` (docs/spec.md section 3), hashes them (on the tokens' device) and hands the ids
to ``table.prefetch``, which starts fetching the rows, so the work overlaps the
preceding decoder layer:

* CUDA, table on the host: a worker thread gathers the rows into pinned memory and
  copies them to the device on a side stream (ids on the device are first copied to
  the host, asynchronously).
* CUDA, table on the device: the gather runs on a side stream.
* No CUDA: everything runs synchronously, inside the call.
* A table in files (``ple.io.DiskTable``, ``load_layer(..., offload="disk")``): its
  gather (a read of the rows from a memory-mapped file, through its row cache) runs in the
  worker thread with or without CUDA, through `start_gather`, so the reads overlap the
  preceding layers; on CUDA the rows are then copied as for a host table.

The next `forward` / `step` (through ``table.rows``) waits for the prefetch and uses
its rows when its ids equal the ids it computed itself; otherwise (a stale or
mismatched prefetch, or a table that needs a gradient) it looks the rows up again and
warns. A prefetch is used at most once. Either way the rows are those of the in-memory
path, bit for bit.

Costs on CUDA: comparing the ids is one device synchronisation per use; a serving loop
that always prefetches the step's own tokens can set ``layer.table.prefetch_verify =
False`` to compare shapes only. Pass the tokens as host tensors (serving engines have
them there): they are then hashed on the host, without a device synchronisation.
"""

from __future__ import annotations

from concurrent.futures import Future, ThreadPoolExecutor
from typing import TYPE_CHECKING, cast

import torch
import torch.nn.functional as F

from . import _checks
from .quant import gather_raw

if TYPE_CHECKING:
    from collections.abc import Callable
    from typing import TypeAlias

    from .layer import PLELayer

    _Rows: TypeAlias = tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]   # (ids, rows, row_scale)
    # (host ids [T, NH], pin) -> (stored rows [T, NH * D], row_scale): see `start_gather`
    HostGather: TypeAlias = Callable[[torch.Tensor, bool], tuple[torch.Tensor, torch.Tensor | None]]

__all__ = ["offload_table", "is_offloaded", "start_prefetch", "start_fetch", "start_gather", "Prefetch"]

_EXECUTOR: ThreadPoolExecutor | None = None


def _executor() -> ThreadPoolExecutor:
    global _EXECUTOR
    if _EXECUTOR is None:
        _EXECUTOR = ThreadPoolExecutor(max_workers=1, thread_name_prefix="ple-prefetch")
    return _EXECUTOR


def offload_table(layer: PLELayer, *, pin: bool | None = None) -> PLELayer:
    """Keep ``layer``'s table in host memory; everything else stays where it is. Returns ``layer``.

    Move the layer to its device first (``layer.to("cuda")`` moves the table too), then
    offload. ``pin`` (default: whether CUDA is available) pins the host copy, which
    asynchronous copies need. Works for float, FP8, int8 and NF4 tables (``Table.offload_``): an NF4
    table's packed rows (each holding its scale) are gathered on the host and unpacked on the device.
    """
    layer.table.offload_(pin=pin)
    return layer


def is_offloaded(layer: PLELayer) -> bool:
    """Whether the table lives on another device (the host) than the layer's projections."""
    return layer.table.weight.device != layer.key_proj.weight.device


@torch.no_grad()
def start_prefetch(layer: PLELayer, input_ids: torch.Tensor, query_start_loc: torch.Tensor | None = None,
                   ngram_context: torch.Tensor | None = None) -> None:
    """Hash ``input_ids`` and start fetching their rows for the layer's next lookup (see the module doc).

    Arguments are those of ``ngram_ids``; they may live on the host or on the layer's
    device. Bad arguments raise before anything changes.
    """
    from . import reference

    _checks.tensor("input_ids", input_ids, ndim=1)
    cfg = layer.config
    dev = layer.key_proj.weight.device
    ops = layer.ops if input_ids.device == dev else reference   # fast ops run on the layer's device only
    ids = ops.ngram_ids(input_ids, layer.ple_embedding.hash_params(), heads_per_ngram=cfg.heads_per_ngram,
                        eos_token_id=cfg.eos_token_id, query_start_loc=query_start_loc,
                        ngram_context=ngram_context)
    layer.table.prefetch(ids, dev)


# ---- the fetch ---------------------------------------------------------------------------------------
def _unchecked_lookup(weight: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
    """``embedding_lookup`` without its range check (a device sync), for ids ``ngram_ids`` made."""
    T, NH = ids.shape
    return F.embedding(ids.to(torch.int64), weight).reshape(T, NH * weight.shape[1])


def _pinned_lookup(weight: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
    """A host gather into a pinned buffer, ``[T, NH * D]``."""
    T, NH = ids.shape
    out = torch.empty((T * NH, weight.shape[1]), dtype=weight.dtype, pin_memory=True)
    torch.index_select(weight, 0, ids.reshape(-1).to(torch.int64), out=out)
    return out.view(T, NH * weight.shape[1])


class Prefetch:
    """A fetch in flight: ``result()`` waits, then gives ``(ids, rows, row_scale)`` on the device."""

    def __init__(self, ids: torch.Tensor | None = None, rows: torch.Tensor | None = None,
                 scale: torch.Tensor | None = None, *,
                 future: Future[tuple[_Rows, torch.cuda.Event | None]] | None = None,
                 done: torch.cuda.Event | None = None) -> None:
        self._value: _Rows = cast("_Rows", (ids, rows, scale))     # ids and rows are None only with a future
        self._future = future
        self._done = done

    def result(self) -> _Rows:
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
def start_fetch(weight: torch.Tensor, weight_scale: torch.Tensor | None, ids: torch.Tensor,
                device: torch.device) -> Prefetch:
    """Start gathering the stored rows of ``ids`` ``[T, NH]`` from ``weight`` and moving them to ``device``.

    The rows are moved as stored (``ple.quant.gather_raw``: quantized, NF4 rows packed); the lookup
    that takes them (``Table.rows``) turns them into values on ``device``.
    """
    tdev = weight.device
    if device.type != "cuda" and tdev.type != "cuda":
        rows, scale = gather_raw(weight, weight_scale, ids.to(tdev), _unchecked_lookup)
        return Prefetch(ids.to(device), rows.to(device), None if scale is None else scale.to(device))

    if tdev == device:                                       # table on the GPU: a side stream
        current = torch.cuda.current_stream(device)
        side = torch.cuda.Stream(device=device)
        side.wait_stream(current)
        host_ids = ids.device.type == "cpu"
        if host_ids:
            ids = ids.pin_memory()
        else:
            ids.record_stream(side)
        with torch.cuda.stream(side):
            ids = ids.to(device, non_blocking=True)
            rows, scale = gather_raw(weight, weight_scale, ids, _unchecked_lookup)
            done = torch.cuda.Event()
            done.record(side)
        return Prefetch(ids, rows, scale, done=done)

    # Table on the host, layer on the GPU: gather + copy in a worker thread.
    return start_gather(lambda ids_host, pin: gather_raw(weight, weight_scale, ids_host, _pinned_lookup), ids,
                        device)


@torch.no_grad()
def start_gather(gather: HostGather, ids: torch.Tensor, device: torch.device) -> Prefetch:
    """Start ``gather(host_ids, pin)`` in the worker thread and move what it returns to ``device``.

    ``gather`` returns the stored rows of host ids ``[T, NH]`` as ``(rows [T, NH * D], row_scale)``
    (as ``ple.quant.gather_raw`` does; NF4: the packed rows ``[T, NH * (D/2 + 4)]``, ``row_scale``
    None, unpacked on ``device`` when the lookup uses them), in pinned memory when ``pin`` (True
    when ``device`` is a CUDA device). For tables that are gathered on the host, wherever they live: in host memory
    (`start_fetch`) or in files (``ple.io.DiskTable``). It runs in the worker even without
    CUDA, so a slow gather (a disk read) overlaps the caller's work; on CUDA the rows are then
    copied on a side stream, and ids on the device are first copied to the host asynchronously.
    """
    cuda = device.type == "cuda"
    ids_ready = None
    ids_dev = None
    if ids.device.type == "cpu":
        ids_host = ids
        if not cuda:
            ids_dev = ids
    elif not cuda:
        ids_host, ids_dev = ids.to("cpu"), ids
    else:
        ids_dev = ids.to(device)
        ids_host = torch.empty(ids.shape, dtype=ids.dtype, pin_memory=True)
        ids_host.copy_(ids, non_blocking=True)
        ids_ready = torch.cuda.Event()
        ids_ready.record(torch.cuda.current_stream(ids.device))

    def work() -> tuple[_Rows, torch.cuda.Event | None]:
        if ids_ready is not None:
            ids_ready.synchronize()
        rows_h, scale_h = gather(ids_host, cuda)
        if not cuda:
            scale_d = None if scale_h is None else scale_h.to(device)
            return (cast(torch.Tensor, ids_dev).to(device), rows_h.to(device), scale_d), None
        side = torch.cuda.Stream(device=device)
        with torch.cuda.stream(side):
            rows_d = rows_h.to(device, non_blocking=True)
            scale_d = None if scale_h is None else scale_h.to(device, non_blocking=True)
            ids_d = ids_dev if ids_dev is not None else ids_host.to(device, non_blocking=True)
            done = torch.cuda.Event()
            done.record(side)
        return (ids_d, rows_d, scale_d), done

    return Prefetch(future=_executor().submit(work))
