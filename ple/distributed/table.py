"""The n-gram table sharded by rows over a process group.

Each rank owns a contiguous range of table rows ``[row_start, row_end)`` (by
default the balanced split, `row_range`). A lookup gathers the owned rows of
every requested id, zeros for the others, and sums over the group; since exactly
one rank owns each row the sum is the row itself, bit for bit. Backward leaves
each rank the gradient of its own rows only (a sharded table is never
all-reduced as a whole).

Two lookups, by where the tokens are:

* `ShardedTable.rows` (the ``ple.table.Table`` lookup, so `PLELayer.embed` uses it
  unchanged): every rank looks up the same ids (the layer is
  replicated, only the table is split). Forward all-reduce, backward identity: DTensor's
  ``Partial -> Replicate`` redistribute, and its autograd.
* `ShardedTable.lookup_sequence_parallel`: each rank has its own tokens (the
  step's rows are split across ranks). The ids are all-gathered, every rank
  looks up its rows for all tokens, and a reduce-scatter returns each rank its
  tokens' embeddings (DTensor's ``Partial -> Shard(0)``). Backward all-gathers the gradients of the embeddings, so
  each rank's shard gets the gradient of every token that hit its rows.

Quantized tables (the conventions of ``ple.quant``): ``weight`` may have any dtype
(int8, float8_e4m3fn, ...) with an optional float32 ``weight_scale``, per row
(``[rows, 1]``) or per tensor (``[1]``). Raw rows travel in the table's own width
(their bytes are summed as uint8, which is exact because every rank but the
owner contributes zero bits), the per-row scales travel beside them, and
dequantisation ``(row.float() * scale).to(dtype)`` happens after the sum.
Quantized tables have no gradient.

`ShardedPLELayer.load_table_from_checkpoint` reads a rank's rows straight from the
checkpoint through ``ple.io``'s one reader (``ple.io.read_table_rows``): every key is
checked against the config, then only the table shards that overlap the rank's rows
are read, and only those rows.
"""

from __future__ import annotations

import functools

import torch
from torch import nn

from .. import _checks
from ..config import PLEConfig
from ..layer import PLELayer
from ..quant import dequantize_rows
from ..reference.hashing import hash_params
from ..table import Table, gather_raw, is_float_table
from .comm import Comm, as_comm
from .partition import row_range as balanced_row_range

__all__ = ["ShardedTable", "ShardedPLELayer"]


def _sum_partials(x: torch.Tensor, comm: Comm, category: str, *, scatter: bool) -> torch.Tensor:
    """Sum every rank's ``x`` (each holds a part: its owned rows, zeros elsewhere), with DTensor's autograd.

    ``scatter=False``: the whole sum (``Partial -> Replicate``, an all-reduce; backward: the
    gradient as it is, every rank computing the same loss). ``scatter=True``: ``x`` is
    ``[W * m, ...]`` and this rank gets its ``[m, ...]`` block (``Partial -> Shard(0)``, a
    reduce-scatter; backward: an all-gather). Bytes are counted on ``comm`` as its own
    collectives count them (the backward's under ``category + "_grad"``).
    """
    from torch.distributed.tensor import DTensor, Partial, Replicate, Shard

    mesh, W = comm.mesh, comm.world_size
    n = x.numel() * x.element_size()
    if scatter and x.shape[0] % W:
        raise ValueError(f"x: expected a multiple of world_size={W} rows, got {x.shape[0]}")
    part = DTensor.from_local(x.contiguous(), mesh, [Partial()], run_check=False)
    out = part.redistribute(mesh, [Shard(0) if scatter else Replicate()]).to_local()
    comm.count(category, (W - 1) / W * n if scatter else 2 * (W - 1) / W * n)
    if scatter and out.requires_grad:
        out.register_hook(lambda g: comm.count(category + "_grad", (W - 1) * g.numel() * g.element_size()))
    return out


class ShardedTable(Table):
    """Rows ``[row_start, row_end)`` of a ``[num_rows, dim]`` table, held by this rank of ``group``.

    A ``ple.table.Table``: ``rows(ids, dtype, ops=...)`` is a collective (every rank of the
    group calls it with the same ids). ``weight`` is ``[row_end - row_start, dim]``; with
    ``scale="row"`` a float32 buffer ``weight_scale`` (``[row_end - row_start, 1]``)
    dequantises each row, with ``scale="tensor"`` one float32 scale (``[1]``) does. A
    floating table without a scale is a trainable Parameter (normal(0, 1) init, as the
    model's); any other table is a buffer that starts at zero (scale 1) and is meant to be
    loaded.

    ``load_state_dict`` accepts either this rank's rows or the whole table
    (``[num_rows, dim]``, and ``[num_rows, 1]`` row scales), which it slices.
    """

    def __init__(self, num_rows: int, dim: int, *, group=None, row_range: tuple[int, int] | None = None,
                 device=None, dtype=None, scale: str | None = None):
        super().__init__()
        _checks.int_arg("num_rows", num_rows, minimum=1)
        _checks.int_arg("dim", dim, minimum=1)
        if scale not in (None, "row", "tensor"):
            raise ValueError(f"scale: expected None, 'row' or 'tensor', got {scale!r}")
        self.comm = as_comm(group)
        if row_range is None:
            row_range = balanced_row_range(num_rows, self.comm.world_size, self.comm.rank)
        start, end = row_range
        if not (isinstance(start, int) and isinstance(end, int) and 0 <= start <= end <= num_rows):
            raise ValueError(f"row_range: expected 0 <= start <= end <= num_rows={num_rows}, got {row_range}")
        self._num_rows = num_rows
        self.row_start, self.row_end = start, end
        dtype = dtype or torch.get_default_dtype()
        w = torch.zeros(end - start, dim, device=device, dtype=dtype)
        if is_float_table(dtype) and scale is None:
            self.weight = nn.Parameter(nn.init.normal_(w))
        else:
            self.register_buffer("weight", w)
        self.scale_kind = scale
        if scale is not None:
            shape = (end - start, 1) if scale == "row" else (1,)
            self.register_buffer("weight_scale", torch.ones(shape, device=device, dtype=torch.float32))

    @property
    def num_rows(self) -> int:
        """Rows of the whole table (this rank holds ``row_end - row_start`` of them)."""
        return self._num_rows

    @staticmethod
    def scale_kind_of(weight_scale: torch.Tensor | None) -> str | None:
        """``None``, ``"tensor"`` (one scale: ``[]`` or ``[1]``) or ``"row"`` (``[rows, 1]``)."""
        if weight_scale is None:
            return None
        return "tensor" if weight_scale.numel() == 1 and weight_scale.dim() <= 1 else "row"

    @classmethod
    def from_full(cls, weight: torch.Tensor, *, weight_scale: torch.Tensor | None = None, group=None,
                  row_range: tuple[int, int] | None = None) -> ShardedTable:
        """This rank's shard of a whole table ``weight`` (``[num_rows, dim]``), with its scale if any."""
        kind = cls.scale_kind_of(weight_scale)
        m = cls(weight.shape[0], weight.shape[1], group=group, row_range=row_range, device=weight.device,
                dtype=weight.dtype, scale=kind)
        sd = {"weight": weight}
        if kind is not None:
            sd["weight_scale"] = weight_scale.reshape(1) if kind == "tensor" else weight_scale
        m.load_state_dict(sd)
        return m

    def extra_repr(self) -> str:
        return (f"rows [{self.row_start}, {self.row_end}) of {self.num_rows}, dim={self.dim}, "
                f"dtype={self.weight.dtype}, scale={self.scale_kind}, "
                f"rank={self.comm.rank}/{self.comm.world_size}")

    def _load_from_state_dict(self, state_dict, prefix, local_metadata, strict, missing_keys,
                              unexpected_keys, error_msgs):
        # A whole table (or whole row scale) is sliced to this rank's rows.
        local = self.row_end - self.row_start
        for name in ("weight", "weight_scale"):
            key = prefix + name
            t = state_dict.get(key)
            if t is not None and t.dim() >= 1 and t.shape[0] == self.num_rows and self.num_rows != local:
                state_dict[key] = t[self.row_start:self.row_end]
        super()._load_from_state_dict(state_dict, prefix, local_metadata, strict, missing_keys,
                                      unexpected_keys, error_msgs)

    def offload_(self, *, pin=None):
        raise NotImplementedError("offload_: a sharded table is looked up collectively; keep each rank's "
                                  "shard on its device")

    def prefetch(self, ids, device):
        raise NotImplementedError("start_prefetch: a sharded table is looked up collectively in embed(); "
                                  "there is nothing to prefetch")

    # ---- lookups -------------------------------------------------------------------------------
    def _partial(self, flat_ids: torch.Tensor, ops) -> tuple[torch.Tensor, torch.Tensor | None]:
        """Owned rows of ``flat_ids`` ``[n]`` (zeros elsewhere): ``[n, dim]`` payload and ``[n]`` row scales.

        Trainable tables give their rows (autograd reaches ``weight`` through the
        owned rows only); quantized tables give their rows' bytes as uint8.
        """
        local = flat_ids.long() - self.row_start
        owned = (local >= 0) & (local < self.weight.shape[0])
        safe = torch.where(owned, local, torch.zeros_like(local))[:, None]
        n = flat_ids.numel()
        row_scale = None
        if self.weight.shape[0] == 0:                                 # a rank that owns no rows
            rows = self.weight.new_zeros((n, self.dim))
            if self.scale_kind == "row":
                row_scale = self.weight_scale.new_zeros(n)
        else:
            lookup = functools.partial(ops.embedding_lookup, validate=False)   # safe ids: in range
            rows, row_scale = gather_raw(self.weight, self.scale, safe, lookup)
            row_scale = row_scale.reshape(n) if self.scale_kind == "row" else None
        if self.quantized:
            rows = rows.view(torch.uint8) if rows.element_size() == 1 else rows
        payload = torch.where(owned[:, None], rows, torch.zeros((), dtype=rows.dtype, device=rows.device))
        if row_scale is not None:
            row_scale = torch.where(owned, row_scale, torch.zeros_like(row_scale))
        return payload, row_scale

    def _finish(self, summed: torch.Tensor, row_scale: torch.Tensor | None, T: int, NH: int,
                dtype) -> torch.Tensor:
        """Summed ``[T * NH, dim]`` payload -> ``[T, NH * dim]`` in ``dtype``, dequantised."""
        if not self.quantized:
            return summed.reshape(T, NH * self.dim).to(dtype or summed.dtype)
        q = summed.view(self.weight.dtype)                            # [n, dim]
        scale = row_scale.reshape(T, NH) if self.scale_kind == "row" else self.scale
        if scale is None:
            return q.float().reshape(T, NH * self.dim).to(dtype or torch.get_default_dtype())
        return dequantize_rows(q.reshape(T, NH * self.dim), scale, dtype or torch.get_default_dtype())

    def rows(self, ids: torch.Tensor, dtype: torch.dtype | None = None, *, ops=None,
             validate: bool = True) -> torch.Tensor:
        """Rows for hash ids ``[T, NH]`` that every rank passes alike: ``[T, NH * dim]``.

        Rows come back in ``dtype`` (default: the table's dtype, or the default float
        dtype for a quantized table). ``ops`` is the op module whose
        ``embedding_lookup`` gathers a trainable table's rows (default: the reference).
        Ids outside the table give zero rows (no rank owns them), so ``validate`` has nothing
        to check beyond the metadata.
        """
        ops = ops or _reference_ops()
        _checks.tensor("ids", ids, ndim=2, kind="int", device=self.weight.device)
        T, NH = ids.shape
        payload, row_scale = self._partial(ids.reshape(-1), ops)
        if self.quantized:
            summed = self.comm.all_reduce(payload.contiguous(), "table_reduce")
            if row_scale is not None:
                row_scale = self.comm.all_reduce(row_scale.contiguous(), "table_scale")
        else:
            summed = _sum_partials(payload, self.comm, "table_reduce", scatter=False)
        return self._finish(summed, row_scale, T, NH, dtype)

    lookup = rows

    def lookup_sequence_parallel(self, ids: torch.Tensor, counts: list[int], *,
                                 dtype: torch.dtype | None = None, ops=None) -> torch.Tensor:
        """Rows for this rank's own hash ids ``[T_k, NH]``; rank r passes ``counts[r]`` rows of ids.

        Every rank of the group must call it (a rank with no tokens passes ``[0, NH]``).
        """
        ops = ops or _reference_ops()
        comm = self.comm
        W = comm.world_size
        _checks.tensor("ids", ids, ndim=2, kind="int", device=self.weight.device)
        if len(counts) != W or ids.shape[0] != counts[comm.rank]:
            raise ValueError(f"counts: expected {W} row counts, this rank's = {ids.shape[0]}, got {counts}")
        T, NH = ids.shape
        m = max(counts)
        padded = torch.full((m, NH), -1, dtype=torch.int64, device=ids.device)   # -1: owned by no rank
        padded[:T] = ids
        all_ids = comm.all_gather(padded, "table_ids")                             # [W, m, NH]
        payload, row_scale = self._partial(all_ids.reshape(-1), ops)              # [W*m*NH, dim]
        width = payload.shape[1] * NH
        if self.quantized:
            summed = comm.reduce_scatter(payload.reshape(W * m, width), "table_reduce")
            if row_scale is not None:
                row_scale = comm.reduce_scatter(row_scale.reshape(W * m, NH), "table_scale")
                row_scale = row_scale[:T].reshape(-1)
        else:
            summed = _sum_partials(payload.reshape(W * m, width), comm, "table_reduce", scatter=True)
        summed = summed[:T].reshape(T * NH, payload.shape[1])
        return self._finish(summed, row_scale, T, NH, dtype)


def _reference_ops():
    from .. import reference

    return reference


class ShardedPLELayer(PLELayer):
    """`PLELayer` whose n-gram table is split by rows over ``group``; everything else is replicated.

    ``forward`` and ``step`` are `PLELayer`'s: every rank passes the same tokens
    and gets the same outputs as one process with the whole table (the lookup sums
    the owned rows over the group). For sequence parallelism, where ranks hold
    different tokens, use `ple.distributed.sp_forward` / `sp_step`, which call
    `embed_sequence_parallel`.

    The whole table is never allocated: only this rank's rows (``row_range``, by
    default the balanced split). ``table_dtype`` / ``scale`` make a quantized table
    (see `ShardedTable`). The replicated parameters start as `PLELayer`'s do;
    give every rank the same weights with ``load_state_dict`` (a whole-model state
    dict is sliced to this rank's rows), `from_layer`, or `load_table_from_checkpoint`.

    Parameter names are `PLELayer`'s (``ple_embedding.ngram_embedding.weight`` holds
    the local rows; a quantized table adds ``ple_embedding.ngram_embedding.weight_scale``,
    as ``ple.quant`` does, so a quantized whole layer's state dict loads too).
    Training with replicated tokens: every rank gets the full gradient of the
    replicated parameters and the gradient of its own rows; do not all-reduce them.
    ``DistributedDataParallel(layer)`` leaves the table out of its all-reduce (the layer
    puts it on DDP's ignore list); for a model holding such layers call
    ``ple.distributed.exclude_tables_from_ddp(model)`` before wrapping it.
    """

    def __init__(self, config: PLEConfig, ple_layer_index: int = 0, *, group=None,
                 row_range: tuple[int, int] | None = None, backend: str = "reference", device=None,
                 dtype=None, table_dtype: torch.dtype | None = None, scale: str | None = None):
        table = ShardedTable(hash_params(config, ple_layer_index).num_rows, config.ngram_head_dim, group=group,
                             row_range=row_range, device=device, dtype=table_dtype or dtype, scale=scale)
        super().__init__(config, ple_layer_index, backend=backend, device=device, dtype=dtype, table=table)
        # DDP must not average (or, with uneven shards, even compare) the shards of different ranks.
        from .dtensor import exclude_tables_from_ddp

        exclude_tables_from_ddp(self)

    @classmethod
    def from_layer(cls, layer: PLELayer, group=None, *, row_range: tuple[int, int] | None = None,
                   backend: str | None = None) -> ShardedPLELayer:
        """This rank's sharded copy of a whole ``layer`` (same weights, same backend unless given)."""
        table = layer.ple_embedding.ngram_embedding
        w = table.weight
        new = cls(layer.config, layer.ple_layer_index, group=group, row_range=row_range,
                  backend=backend or layer.backend, device=w.device, dtype=layer.key_proj.weight.dtype,
                  table_dtype=w.dtype,
                  scale=ShardedTable.scale_kind_of(table.scale))
        new.load_state_dict(layer.state_dict())
        return new

    @property
    def comm(self) -> Comm:
        return self.table.comm

    def embed_sequence_parallel(self, ids: torch.Tensor, dtype: torch.dtype,
                                counts: list[int]) -> torch.Tensor:
        """Rows for this rank's own hash ids ``[T_k, NH]``; ``counts`` holds every rank's ``T_k``."""
        return self.table.lookup_sequence_parallel(ids, counts, dtype=dtype, ops=self.ops)

    def load_table_from_checkpoint(self, source, *, prefix: str | None = None) -> None:
        """Read this rank's rows (and their scales) from a checkpoint, through ``ple.io.read_table_rows``.

        ``source`` and ``prefix`` are as for ``ple.io.load_layer``: every key of the layer is
        checked against this layer's config first (a checkpoint of another config, or one
        missing a shard, is a ``ValueError`` naming the key), then only the shards that
        overlap this rank's rows are read, and only those rows. A float checkpoint table is
        cast to this layer's table dtype; a quantized one replaces the table by a quantized
        shard of the same rows.
        """
        from ..io import read_table_rows

        t = self.table
        weight, weight_scale = read_table_rows(source, self.config, self.ple_layer_index, start=t.row_start,
                                               end=t.row_end, prefix=prefix)
        kind = ShardedTable.scale_kind_of(weight_scale)
        quantized = kind is not None or not is_float_table(weight.dtype)
        if quantized and (weight.dtype != t.weight.dtype or kind != t.scale_kind):
            t = ShardedTable(t.num_rows, t.dim, group=t.comm, row_range=(t.row_start, t.row_end),
                             device=t.weight.device, dtype=weight.dtype, scale=kind)
            self.ple_embedding.ngram_embedding = t
        with torch.no_grad():
            t.weight.copy_(weight.to(t.weight.dtype))
            if kind is not None:
                t.weight_scale.copy_(weight_scale.reshape(t.weight_scale.shape))

    def extra_repr(self) -> str:
        t = self.table
        return super().extra_repr() + f", rows=[{t.row_start}, {t.row_end}) of {t.num_rows}"
