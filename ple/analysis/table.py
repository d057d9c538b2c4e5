"""The table as a whole: read block by block (`table_diff`, `head_means`), and its lookups ablated (`ablate`).

Every table of ``ple.table`` is read here the same way, a block of rows at a time, so the memory a
call takes is a few blocks (`BLOCK_BYTES`), never the table: a dense or quantized table in device or
host memory is sliced (a quantized block dequantized by the formula of its lookups, ``ple.quant``); a
table on disk (``ple.io.DiskTable``) is read from its mapped files, past its row cache (which keeps
its rows and counters: ``table.stats()`` does not move), with an overlay's rows put in where it has
them (``load_layer(..., overlay=DIR)``), as its lookups read them. A sharded table (``ple.distributed``,
a DTensor ``weight``) is not read: a ``ValueError`` naming the argument.

`ablate` changes what the layer's lookups return inside a ``with`` block, on every backend and
placement, without copying the table; see its docstring.
"""

from __future__ import annotations

import math
import random
from collections.abc import Callable, Iterator
from types import ModuleType
from typing import TYPE_CHECKING, NamedTuple

import torch

from .. import _checks
from ..io.disk_table.table import DiskTable
from ..layer import PLELayer
from ..table import Table

if TYPE_CHECKING:
    from ..backends import CustomOps

__all__ = ["TableDiff", "table_diff", "head_means", "ablate", "Ablation", "MODES", "BLOCK_BYTES"]

BLOCK_BYTES = 64 << 20
"""The largest block of a table read at once, counted as float64 values: ``BLOCK_BYTES // (8 * D)`` rows
(52,428 rows of the model's D = 160). A module attribute, read at each call: lower it to bound memory further."""

MODES = ("zero", "mean", "shuffle")
"""What `ablate` makes the lookups read."""

_BITS = {8: torch.int64, 4: torch.int32, 2: torch.int16, 1: torch.uint8}


# ---- reading a table block by block ----------------------------------------------------------------------
def _as_table(name: str, obj: object) -> Table:
    """``obj``'s table (a `PLELayer`'s, or ``obj`` itself), readable block by block; else an error naming ``name``."""
    table = obj.table if isinstance(obj, PLELayer) else obj
    if not isinstance(table, Table):
        raise TypeError(f"{name}: expected a ple.PLELayer or a ple.table.Table, got {type(obj).__name__}")
    if table.is_dtensor:
        raise ValueError(f"{name}: a sharded (DTensor) table is not read here: each rank holds a piece of it "
                         f"(ple.distributed); compare or average the checkpoint's table instead "
                         f"(ple.io.load_layer(path, offload='disk'))")
    if table.weight.device.type == "meta" and not isinstance(table, DiskTable):
        raise ValueError(f"{name}: the table's values are not in memory ({type(table).__name__} on the meta device)")
    return table


def _value_dtype(table: Table) -> torch.dtype:
    """The dtype a table's values are exact in: its own for a float table, float32 for FP8 / int8 / NF4 (their
    dequantized products are formed, exactly, in float32)."""
    return torch.float32 if table.quantized else table.weight.dtype


def _rows_per_block(dim: int) -> int:
    return max(1, BLOCK_BYTES // (8 * max(dim, 1)))


def _block(table: Table, start: int, stop: int, dtype: torch.dtype) -> torch.Tensor:
    """Rows ``[start, stop)`` of ``table`` as values ``[stop - start, D]`` in ``dtype`` (see the module docstring):
    what a lookup of those rows returns in ``dtype``. On the table's device (a disk table's: the host)."""
    ids = torch.arange(start, stop, dtype=torch.int64)
    if isinstance(table, DiskTable):
        with table._lock:                                  # the mappings; the row cache is not touched
            if table._closed:
                raise RuntimeError("DiskTable: the table was closed; load the layer again")
            raw = table._read(ids)
        if table._packed:
            table._check_scales(ids, raw)                  # NF4: each row's float16 scale, as its lookups check
        rows = raw.view(torch.uint8).view(table.stored_dtype).view(stop - start, -1)
    else:
        rows = table.weight[start:stop].detach()
    scale = table.scale
    if scale is not None:
        scale = (scale[start:stop] if scale.dim() == 2 else scale).to(rows.device)
    values = table._values(rows, scale, dtype)
    if isinstance(table, DiskTable):
        values = table._overlaid(ids.view(-1, 1), values)
    return values


def _blocks(table: Table, dtype: torch.dtype) -> Iterator[tuple[int, torch.Tensor]]:
    """``(first row, values [n, D] in dtype)`` for the whole table, in row order, `BLOCK_BYTES` at a time."""
    n = _rows_per_block(table.dim)
    for start in range(0, table.num_rows, n):
        stop = min(start + n, table.num_rows)
        yield start, _block(table, start, stop, dtype)


def _bits(values: torch.Tensor) -> torch.Tensor:
    return values.view(_BITS[values.element_size()])


# ---- table_diff -------------------------------------------------------------------------------------------
class TableDiff(NamedTuple):
    """What `table_diff` returns."""

    rows: torch.Tensor      # int64 [k]: the rows whose b - a has the largest L2 norm, largest first
    norms: torch.Tensor     # float64 [k]: their norms
    changed: int            # how many rows differ at all (k = min(top, changed))


@torch.no_grad()
def table_diff(a: PLELayer | Table, b: PLELayer | Table, *, top: int = 100) -> TableDiff:
    """The ``top`` rows of ``b - a`` with the largest L2 norm, their norms, and how many rows differ at all.

    ``a`` and ``b`` are layers (their ``layer.table``) or tables of the same shape (rows and D), of any
    kind and placement but sharded: dense, FP8 / int8 / NF4, in host memory, on disk (an overlay's rows
    included), in any mix. Both are read block by block (`BLOCK_BYTES`; see the module docstring), so a
    disk table is never in memory whole and its row cache is left as it was; the result lives on the host.

    Values are compared as a lookup returns them, in the wider of the two tables' value dtypes (a float
    table's own dtype; float32 for a quantized one, whose dequantized values are exact there), e.g. a
    bfloat16 table against its FP8 quantization in float32. A row *differs* when the bits of any of its
    values differ in that dtype: ``0.0`` against ``-0.0`` differs, a NaN against a NaN of the same bits
    does not. The norm is taken in float64 over the differing values only (values equal bit for bit count
    0, so a NaN left unchanged does not make its row's norm NaN); a NaN norm (a NaN on either side of a
    differing value) ranks above every number, an infinite one (a finite value against an infinity, or
    ``inf`` against ``-inf``) above every finite one.

    Returns `TableDiff`: ``rows`` (int64) and ``norms`` (float64) of the ``min(top, changed)`` differing rows
    with the largest norms, largest first, ties in ascending row id; only rows that differ are listed (so
    a row whose values went from ``0.0`` to ``-0.0`` is listed with norm 0, and no unchanged row is).
    ``changed``: how many rows differ.

    Raises: ``top`` not an int: ``TypeError``; below 1: ``ValueError``. ``a`` / ``b`` neither a layer nor a
    table: ``TypeError`` naming it; sharded, or with its values on the meta device: ``ValueError`` naming it;
    ``b`` of another shape than ``a``: ``ValueError`` naming ``b``.
    """
    top = _checks.int_arg("top", top, minimum=1)
    ta, tb = _as_table("a", a), _as_table("b", b)
    if (tb.num_rows, tb.dim) != (ta.num_rows, ta.dim):
        raise ValueError(f"b: a table of {tb.num_rows} rows of {tb.dim} values, but a has {ta.num_rows} rows of "
                         f"{ta.dim}: only tables of one shape are compared")
    dtype = torch.promote_types(_value_dtype(ta), _value_dtype(tb))
    best_rows = torch.empty(0, dtype=torch.int64)
    best_norms = torch.empty(0, dtype=torch.float64)
    changed = 0
    for (start, va), (_, vb) in zip(_blocks(ta, dtype), _blocks(tb, dtype), strict=True):
        vb = vb.to(va.device)
        same = _bits(va) == _bits(vb)                                         # [n, D]
        differ = (~same).any(dim=1).nonzero().squeeze(1)                      # block rows, ascending
        if not differ.numel():
            continue
        changed += differ.numel()
        delta = torch.where(same[differ], 0.0, vb[differ].double() - va[differ].double())
        norms = torch.linalg.vector_norm(delta, dim=1).cpu()
        # The kept rows (ties in ascending id) come before this block's (ascending, and above every kept id):
        # a stable sort keeps each tie in ascending id. NaN sorts above every number.
        rows = torch.cat([best_rows, differ.cpu() + start])
        norms = torch.cat([best_norms, norms])
        order = torch.sort(norms, descending=True, stable=True).indices[:top]
        best_rows, best_norms = rows[order], norms[order]
    return TableDiff(best_rows, best_norms, changed)


# ---- head means ------------------------------------------------------------------------------------------
@torch.no_grad()
def head_means(layer: PLELayer) -> torch.Tensor:
    """Each hash head's mean row of ``layer``'s table: float64 ``[NH, D]``, on the host.

    Head h holds rows ``[ngram_heads_offsets[h], ngram_heads_offsets[h] + ngram_heads_vocab_sizes[h])``
    (docs/spec.md section 3); its mean is the sum of those rows' values (as a lookup gives them: dequantized
    for FP8 / int8 / NF4, an overlay's rows for a disk table trained through one), added in float64 block by
    block in row order, divided by the head's row count. Rows after the last head (the table's padding to a
    multiple of ``make_ngram_vocab_size_divisible_by``) belong to no head and are not counted. The table
    is read block by block (`BLOCK_BYTES`): memory is a block, whatever the table's size and placement.
    A sharded table is a ``ValueError`` naming ``table``.
    """
    if not isinstance(layer, PLELayer):
        raise TypeError(f"layer: expected a ple.PLELayer, got {type(layer).__name__}")
    table = _as_table("table", layer)
    offsets = layer.ple_embedding.ngram_heads_offsets.tolist()
    sizes = layer.ple_embedding.ngram_heads_vocab_sizes.tolist()
    sums = torch.zeros(len(offsets), table.dim, dtype=torch.float64)
    for start, values in _blocks(table, torch.float64):
        stop = start + values.shape[0]
        for h, (off, size) in enumerate(zip(offsets, sizes, strict=True)):
            lo, hi = max(start, off), min(stop, off + size)
            if lo < hi:
                sums[h] += values[lo - start: hi - start].sum(dim=0).cpu()
    return sums / torch.tensor(sizes, dtype=torch.float64).clamp_min(1).view(-1, 1)


# ---- ablate ------------------------------------------------------------------------------------------------
def _affine_coefficients(sizes: list[int], seed: int) -> tuple[list[int], list[int]]:
    """Per head of ``n`` rows, ``(a, b)`` with ``gcd(a, n) = 1`` (so ``i -> (a * i + b) mod n`` is a bijection of
    ``[0, n)``), drawn from ``random.Random(seed)``, the identity excluded where ``n > 1``."""
    rng = random.Random(seed)
    mult, add = [], []
    for n in sizes:
        a, b = 1, 0
        while n > 1 and (math.gcd(a, n) != 1 or (a, b) == (1, 0)):
            a, b = rng.randrange(1, n), rng.randrange(n)
        mult.append(a)
        add.append(b)
    return mult, add


class Ablation:
    """The context manager `ablate` returns: enter it to ablate the layer's lookups, leave it to restore them.

    One object is entered at most once at a time (entering it again while active is a ``RuntimeError``);
    it may be entered again after it was left (a ``"mean"`` ablation then reads the table's means again).
    ``mode`` and ``seed`` say what it does (see `ablate`).
    """

    def __init__(self, layer: PLELayer, mode: str, *, seed: int = 0) -> None:
        if not isinstance(layer, PLELayer):
            raise TypeError(f"layer: expected a ple.PLELayer, got {type(layer).__name__}")
        self.mode = _checks.choice_arg("mode", mode, MODES)
        self.seed = _checks.int_arg("seed", seed, minimum=0)
        _refuse_sharded(layer)
        self.layer = layer
        self._saved: list[tuple[object, str, object]] | None = None
        self._saved_rows: Callable[..., torch.Tensor] = layer.table.rows
        self._saved_prefetch: Callable[..., None] = layer.table.prefetch
        self._head_means = torch.empty(0, 0, dtype=torch.float64)       # [NH, D], read on entering a "mean" one
        self._means: dict[tuple[torch.device, torch.dtype], torch.Tensor] = {}
        self._heads_on: dict[torch.device, torch.Tensor] = {}

    # ---- what the lookups read ------------------------------------------------------------------------------
    def _head_table(self, device: torch.device) -> torch.Tensor:
        """int64 ``[4, NH + 1]`` on ``device``: each head's offset, size and shuffle coefficients a and b, then a
        column of zeros (head NH: no head). Made on the host once (the buffers read once), then moved."""
        got = self._heads_on.get(device)
        if got is None:
            host = self._heads_on.get(torch.device("cpu"))
            if host is None:
                emb = self.layer.ple_embedding
                offsets, sizes = emb.ngram_heads_offsets.tolist(), emb.ngram_heads_vocab_sizes.tolist()
                mult, add = _affine_coefficients(sizes, self.seed)
                host = torch.tensor([offsets, sizes, mult, add], dtype=torch.int64)
                host = torch.cat([host, host.new_zeros(4, 1)], dim=1)
                self._heads_on[torch.device("cpu")] = host
            got = self._heads_on[device] = host.to(device)
        return got

    def _heads(self, ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """``(head of each id, the id inside its head's range, the head table)``; ids in no head (the padding rows
        after the last head, or outside the table) get head NH."""
        heads = self._head_table(ids.device)
        offsets, sizes = heads[0, :-1], heads[1]
        ids = ids.to(torch.int64)
        head = (torch.searchsorted(offsets, ids, right=True) - 1).clamp_min(0)
        inside = (ids >= 0) & (ids - offsets[head] < sizes[head])
        return torch.where(inside, head, offsets.numel()), inside, heads

    def source_rows(self, ids: torch.Tensor) -> torch.Tensor:
        """The rows a ``"shuffle"`` ablation's lookups of ``ids`` (any shape, int32 / int64) read instead, in
        ``ids``'s dtype and shape: row ``offsets[h] + (a_h * i + b_h) mod sizes[h]`` for row ``offsets[h] + i``
        of head h; an id in no head (the padding rows after the last head, or outside the table: left for the
        lookup to refuse) is its own source. ``"zero"`` and ``"mean"`` read no row: a ``ValueError`` naming
        ``mode``. Reads no tensor value on the host once the ablation was entered (or this was called once)."""
        if self.mode != "shuffle":
            raise ValueError(f"mode: a {self.mode!r} ablation reads no table row; source_rows is for 'shuffle'")
        _checks.tensor("ids", ids, kind="int")
        head, inside, heads = self._heads(ids)
        offset, size, a, b = (heads[j][head] for j in range(4))
        moved = (a * (ids.to(torch.int64) - offset) + b).remainder(size.clamp_min(1)) + offset
        return torch.where(inside, moved, ids.to(torch.int64)).to(ids.dtype)

    def _mean_rows(self, ids: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
        key = (ids.device, dtype)
        means = self._means.get(key)
        if means is None:                                  # [NH + 1, D]: the heads' means, then zeros (no head)
            base = self._head_means
            means = torch.cat([base, base.new_zeros(1, base.shape[1])]).to(device=ids.device, dtype=dtype)
            self._means[key] = means
        head, _, _ = self._heads(ids)
        return means[head]                                 # [T, k, D]

    def _rows(self, ids: torch.Tensor, dtype: torch.dtype, *, ops: ModuleType | CustomOps,
              validate: bool = True) -> torch.Tensor:
        """The ablated ``table.rows``."""
        table = self.layer.table
        if self.mode == "shuffle":
            return self._saved_rows(self.source_rows(ids), dtype, ops=ops, validate=validate)
        _checks.index("ids", ids, ndim=2)
        if validate:
            _checks.value_range("ids", _checks.host_values("ids", ids), table.num_rows, "rows")
        table._pending = None                                 # a lookup consumes a pending prefetch
        T, k = ids.shape
        D = table.dim
        if self.mode == "zero":
            return torch.zeros(T, k * D, dtype=dtype, device=ids.device)
        return self._mean_rows(ids, dtype).reshape(T, k * D)

    def _prefetch(self, ids: torch.Tensor, device: torch.device) -> None:
        """The ablated ``table.prefetch``: the shuffled rows' fetch, or (zero, mean) nothing to fetch."""
        if self.mode == "shuffle":
            self._saved_prefetch(self.source_rows(ids), device)
        else:
            self.layer.table._pending = None

    def _hashed_rows(self, input_ids: torch.Tensor, dtype: torch.dtype, *, query_start_loc: torch.Tensor,
                     ngram_context: torch.Tensor | None = None, validate: bool = True) -> torch.Tensor:
        """The ablated ``layer.hashed_rows``: always ``ngram_ids`` then ``layer.embed`` (the table's ablated
        ``rows``), never the fused hash and gather."""
        layer = self.layer
        cfg = layer.config
        ids = layer.ops.ngram_ids(input_ids, layer.ple_embedding.hash_params(), heads_per_ngram=cfg.heads_per_ngram,
                                  eos_token_id=cfg.eos_token_id, query_start_loc=query_start_loc,
                                  ngram_context=ngram_context, validate=validate)
        return layer.embed(ids, dtype, validate=False)

    # ---- entering and leaving --------------------------------------------------------------------------------
    def __enter__(self) -> Ablation:
        if self._saved is not None:
            raise RuntimeError("ablate: this ablation is active already (leave its with block first)")
        layer, table = self.layer, self.layer.table
        _refuse_sharded(layer)
        self._means = {}
        self._heads_on = {}
        self._head_table(torch.device("cpu"))                                        # the buffers read now
        if self.mode == "mean":
            self._head_means = head_means(layer)                                    # may raise: nothing hooked yet
        self._saved_rows = table.rows                                               # (bound, or an outer hook)
        self._saved_prefetch = table.prefetch
        hooks = [(layer, "hashed_rows", self._hashed_rows), (table, "rows", self._rows),
                 (table, "prefetch", self._prefetch)]
        self._saved = [(obj, name, vars(obj).get(name, _MISSING)) for obj, name, _ in hooks]
        for obj, name, fn in hooks:
            object.__setattr__(obj, name, fn)
        return self

    def __exit__(self, exc_type: object, exc: object, tb: object) -> None:
        saved, self._saved = self._saved, None
        for obj, name, before in reversed(saved or []):
            if before is _MISSING:
                object.__delattr__(obj, name)
            else:
                object.__setattr__(obj, name, before)
        self._means = {}


_MISSING = object()


def _refuse_sharded(layer: PLELayer) -> None:
    if layer.table.is_dtensor:
        raise ValueError("table: layer.table is sharded (a DTensor table, ple.distributed): ablate does not hook "
                         "a collective lookup (every rank would have to take part alike, and a mean would need "
                         "a collective over the table); ablate the whole table's layer instead "
                         "(ple.io.load_layer(path, offload='disk'))")


def ablate(layer: PLELayer, mode: str, *, seed: int = 0) -> Ablation:
    """A context manager inside which ``layer``'s table lookups read something else: ``with ablate(layer, "mean"):``.

    ``mode``:

    * ``"zero"``: every lookup reads zeros: the layer's output is that of the same layer with an all-zero
      table (the projections, gate and conv run as they do, on zero embeddings).
    * ``"mean"``: a lookup of a row of hash head h reads h's mean row (`head_means`: float64, rounded once to
      the lookup's dtype): a memory of one row a head. The means are read when the block is entered, block by
      block (a table on disk is read once, whole, at `BLOCK_BYTES` a time: minutes for the real model's).
    * ``"shuffle"``: a lookup of row ``offsets[h] + i`` of head h reads row ``offsets[h] + (a_h * i + b_h) mod
      sizes[h]`` of the same head: a permutation of each head's rows (`Ablation.source_rows`), with ``a_h``
      prime to the head's size and ``(a_h, b_h)`` drawn from ``random.Random(seed)`` (never the identity of
      a head of more than one row). It is an affine bijection, computed per id as the lookups run, not a
      uniformly drawn permutation: rows consecutive in a head go to rows a fixed step apart. ``seed``
      (an int >= 0, default 0) matters for this mode only.

    Rows after the last head (the table's padding, which no hash reaches) read zeros under ``"mean"``
    and themselves under ``"shuffle"``. The ablated lookups carry no gradient to the table (zero, mean;
    shuffle's go to the rows read).

    How: on entering, three instance attributes shadow methods, and leaving deletes them (an outer
    ablation's, nested, are put back): ``layer.hashed_rows`` (so the fused hash and gather of a dense or
    NF4 table on the tokens' device is not taken: ids are hashed by ``ngram_ids``, then looked up through
    ``layer.embed``), ``layer.table.rows`` (every lookup: ``forward``, ``return_intermediates``, the
    serving ``layer.step``, ``layer.embed``) and ``layer.table.prefetch`` (``layer.start_prefetch``: the
    shuffled rows are fetched; zero and mean fetch nothing). Nothing the size of the table is allocated:
    zero and mean never read the table in a lookup (a disk table's counters do not move), ``"mean"`` holds
    ``[NH, D]`` values, and shuffle maps the ids themselves. Dense, FP8 / int8 / NF4, host-offloaded and
    disk tables alike; every backend (``layer.ops``). A ``CompiledStep`` or ``GraphedStep`` made before the
    block runs the graph it traced (make it inside the block to trace the ablated lookups); replacing
    ``layer.ple_embedding``'s table inside the block leaves the new one unhooked.

    Leaving the block (normally or by an exception) leaves the layer bit for bit as it was: no parameter or
    buffer is written, only the three attributes come and go. A pending prefetch is consumed by an
    ablated lookup, as by any lookup.

    Raises: ``mode`` not a str: ``TypeError``; not one of ``"zero"``, ``"mean"``, ``"shuffle"``: ``ValueError``
    naming ``mode`` (both at the call). ``layer`` not a ``PLELayer``: ``TypeError``; ``seed`` not an int:
    ``TypeError``, negative: ``ValueError``. A sharded (DTensor) table is a ``ValueError`` naming ``table``, in
    every mode: its lookup is a collective every rank must join alike, and a mean would need one over the table.
    """
    return Ablation(layer, mode, seed=seed)
