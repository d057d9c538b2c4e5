"""Who owns what: contiguous splits of rows and tokens, and the halo plan of a split.

Everything here is host arithmetic on Python ints that every rank computes alike
from metadata it already holds (the split and the request offsets), so no rank
has to ask another what it will send.

A *split* of ``T`` rows over ``W`` ranks is a list ``bounds`` of ``W + 1`` offsets:
rank ``k`` owns rows ``[bounds[k], bounds[k + 1])``. A rank may own no rows.

Two rules: a batch's tokens are split balanced (`even_bounds`, the default of ``sp_forward``
and ``sp_step``); a table's rows (and columns) are split as the checkpoint layout and
DTensor's ``Shard`` split them (`shard_range`), whichever entry point shards the table.
"""

from __future__ import annotations

from bisect import bisect_right
from dataclasses import dataclass

from .._deprecation import deprecated_parameter
from ..io.layout import shard_rows

__all__ = ["even_bounds", "shard_range", "check_bounds", "fragments", "HaloPlan", "halo_plan"]


def even_bounds(total: int, world_size: int) -> list[int]:
    """The balanced split: every rank gets ``total // W`` rows and the first ``total % W`` one more."""
    q, r = divmod(total, world_size)
    out = [0]
    for k in range(world_size):
        out.append(out[-1] + q + (1 if k < r else 0))
    return out


def shard_range(size: int, world_size: int, rank: int) -> tuple[int, int]:
    """``[start, end)`` of ``rank``'s piece of ``size`` table rows (or columns): the one rule for a sharded table.

    It is the checkpoint layout's (``ple.io.layout.shard_rows``) and ``torch.chunk``'s, so DTensor's
    ``Shard``: every rank ``ceil(size / W)``, the last ranks possibly fewer or none (5 rows over 4
    ranks: 2, 2, 1, 0). A table split over W ranks lines up with a checkpoint in W shards.
    """
    return shard_rows(size, world_size)[rank]


def check_bounds(name: str, bounds: object, total: int, world_size: int) -> list[int]:
    """Validate a split: ``W + 1`` non-decreasing ints from 0 to ``total``."""
    if not isinstance(bounds, (list, tuple)) or not all(isinstance(b, int) and not isinstance(b, bool)
                                                      for b in bounds):
        raise TypeError(f"{name}: expected a list of {world_size + 1} ints, got {bounds!r}")
    b = list(bounds)
    if len(b) != world_size + 1:
        raise ValueError(f"{name}: expected {world_size + 1} offsets (world_size + 1), got {len(b)}")
    if b[0] != 0 or b[-1] != total or any(b[i + 1] < b[i] for i in range(len(b) - 1)):
        raise ValueError(f"{name}: expected non-decreasing offsets from 0 to {total}, got {b}")
    return b


@deprecated_parameter("starts", "query_start_loc_list", since="0.1.0")
def fragments(query_start_loc_list: list[int], lo: int, hi: int) -> list[tuple[int, int, int]]:
    """The pieces of requests inside rows ``[lo, hi)``: ``(request, start, end)`` in row order.

    ``query_start_loc_list`` are the request offsets (``[R + 1]``, a list); empty requests have no piece.
    (The keyword ``starts=`` still works and warns: deprecated.)
    """
    out: list[tuple[int, int, int]] = []
    if hi <= lo:
        return out
    r = bisect_right(query_start_loc_list, lo) - 1
    while r < len(query_start_loc_list) - 1 and query_start_loc_list[r] < hi:
        a, b = max(query_start_loc_list[r], lo), min(query_start_loc_list[r + 1], hi)
        if b > a:
            out.append((r, a, b))
        r += 1
    return out


@dataclass(frozen=True)
class HaloPlan:
    """What one rank sends and receives in a halo exchange.

    ``recvs``: ``(source rank, offset in the halo, rows)``, in row order; the halo
    is the ``num_recv`` rows just before this rank's first row that belong to the
    same request, at most ``history`` of them. ``sends``: ``(destination rank,
    first local row, end local row)``.
    """

    rank: int
    start: int                                  # global row where this rank's halo begins
    num_recv: int
    recvs: tuple[tuple[int, int, int], ...]
    sends: tuple[tuple[int, int, int], ...]


def halo_starts(bounds: list[int], query_start_loc_list: list[int], history: int) -> list[int]:
    """For every rank, the global row its halo starts at (its own first row if it needs none).

    A rank needs the rows before its first row that belong to the request of that
    row, at most ``history`` of them; a rank with no rows, or whose first row starts
    a request, needs none.
    """
    need = []
    for k in range(len(bounds) - 1):
        lo, hi = bounds[k], bounds[k + 1]
        if hi == lo or history == 0:
            need.append(lo)
            continue
        first = query_start_loc_list[bisect_right(query_start_loc_list, lo) - 1]   # start of row lo's request
        need.append(max(first, lo - history))
    return need


@deprecated_parameter("starts", "query_start_loc_list", since="0.1.0")
def halo_plan(bounds: list[int], query_start_loc_list: list[int], history: int, rank: int) -> HaloPlan:
    """The halo exchange of ``rank`` for a split ``bounds`` of requests ``query_start_loc_list`` (both global
    offsets, lists). (The keyword ``starts=`` still works and warns: deprecated.)

    The halo of a rank may come from several earlier ranks when they hold fewer than
    ``history`` rows. Every rank receives at most ``history`` rows, so one exchange
    moves at most ``(W - 1) * history`` rows in all, whatever the number of tokens.
    """
    need = halo_starts(bounds, query_start_loc_list, history)
    W = len(bounds) - 1
    recvs, off = [], 0
    for q in range(rank):
        lo, hi = max(need[rank], bounds[q]), min(bounds[rank], bounds[q + 1])
        if hi > lo:
            recvs.append((q, off, hi - lo))
            off += hi - lo
    sends = []
    b0 = bounds[rank]
    for k in range(rank + 1, W):
        lo, hi = max(need[k], b0), min(bounds[k], bounds[rank + 1])
        if hi > lo:
            sends.append((k, lo - b0, hi - b0))
    return HaloPlan(rank=rank, start=need[rank], num_recv=off, recvs=tuple(recvs), sends=tuple(sends))
