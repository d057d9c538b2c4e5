"""The n-gram table sharded by rows over a process group.

Each rank owns a contiguous range of table rows ``[row_start, row_end)`` (by
default the balanced split, `row_range`). A lookup gathers the owned rows of
every requested id, zeros for the others, and sums over the group; since exactly
one rank owns each row the sum is the row itself, bit for bit. Backward leaves
each rank the gradient of its own rows only (a sharded table is never
all-reduced as a whole).

Two lookups, by where the tokens are:

* `ShardedEmbedding.forward`: every rank looks up the same ids (the layer is
  replicated, only the table is split). Forward all-reduce, backward identity.
* `ShardedEmbedding.lookup_sequence_parallel`: each rank has its own tokens (the
  step's rows are split across ranks). The ids are all-gathered, every rank
  looks up its rows for all tokens, and a reduce-scatter returns each rank its
  tokens' embeddings. Backward all-gathers the gradients of the embeddings, so
  each rank's shard gets the gradient of every token that hit its rows.

Quantized tables (the conventions of ``ple.quant``): ``weight`` may have any dtype
(int8, float8_e4m3fn, ...) with an optional float32 ``weight_scale``, per row
(``[rows, 1]``) or per tensor (``[1]``). Raw rows travel in the table's own width
(their bytes are summed as uint8, which is exact because every rank but the
owner contributes zero bits), the per-row scales travel beside them, and
dequantisation ``(row.float() * scale).to(dtype)`` happens after the sum.
Quantized tables have no gradient.

`load_table_rows` reads a rank's rows straight from the checkpoint: from the
table shards (``<prefix>ple_embedding.ngram_embedding.shard_{k}.weight``, and
``shard_{k}.weight_scale`` for per-row scales) that overlap the range, or from a
whole table, reading only the overlapping rows.
"""

from __future__ import annotations

import json
import os
import re
from dataclasses import dataclass
from glob import glob

import torch
import torch.nn.functional as F
from torch import nn

from .. import _checks
from ..config import PLEConfig
from ..layer import PLELayer
from ..reference.hashing import HashParams, hash_params
from .comm import Comm, as_comm
from .partition import row_range as balanced_row_range

__all__ = ["ShardedEmbedding", "ShardedNGramEmbedding", "ShardedPLELayer", "load_table_rows",
           "checkpoint_table_shards", "TablePiece", "is_float_table"]

TABLE_KEY = "ple_embedding.ngram_embedding"
_FLOAT_TABLES = (torch.float32, torch.float64, torch.bfloat16, torch.float16)


def is_float_table(dtype: torch.dtype) -> bool:
    """A trainable float table (float16/bfloat16/float32/float64); anything else (int8, FP8) is quantized."""
    return dtype in _FLOAT_TABLES


class _AllReduceSum(torch.autograd.Function):
    """Forward: sum over ranks. Backward: identity (every rank computes the same loss downstream)."""

    @staticmethod
    def forward(ctx, x, comm: Comm, category: str):
        return comm.all_reduce(x.clone(), category)

    @staticmethod
    def backward(ctx, grad):
        return grad, None, None


class _ReduceScatterRows(torch.autograd.Function):
    """Forward: ``[W * m, E]`` summed over ranks, this rank's ``[m, E]`` block. Backward: all-gather."""

    @staticmethod
    def forward(ctx, x, comm: Comm, category: str):
        ctx.comm, ctx.category = comm, category
        return comm.reduce_scatter(x, category)

    @staticmethod
    def backward(ctx, grad):
        g = ctx.comm.all_gather(grad.contiguous(), ctx.category + "_grad")          # [W, m, E]
        return g.reshape(-1, *grad.shape[1:]), None, None


class ShardedEmbedding(nn.Module):
    """Rows ``[row_start, row_end)`` of a ``[num_rows, dim]`` table, held by this rank of ``group``.

    ``weight`` is ``[row_end - row_start, dim]``; with ``scale="row"`` a float32
    buffer ``weight_scale`` (``[row_end - row_start, 1]``) dequantises each row, with
    ``scale="tensor"`` one float32 scale (``[1]``) does. A floating table without a
    scale is trainable (normal(0, 1) init, as the model's); any other table starts
    at zero (scale 1) and is meant to be loaded.

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
        self.num_rows, self.dim = num_rows, dim
        self.row_start, self.row_end = start, end
        dtype = dtype or torch.get_default_dtype()
        trainable = is_float_table(dtype) and scale is None
        w = torch.empty(end - start, dim, device=device, dtype=dtype)
        if trainable:
            nn.init.normal_(w)
        else:
            w.zero_()
        self.weight = nn.Parameter(w, requires_grad=trainable)
        self.scale_kind = scale
        if scale == "row":
            self.register_buffer("weight_scale", torch.ones(end - start, 1, device=device,
                                                            dtype=torch.float32))
        elif scale == "tensor":
            self.register_buffer("weight_scale", torch.ones(1, device=device, dtype=torch.float32))
        else:
            self.weight_scale = None

    @staticmethod
    def scale_kind_of(weight_scale: torch.Tensor | None) -> str | None:
        """``None``, ``"tensor"`` (one scale: ``[]`` or ``[1]``) or ``"row"`` (``[rows, 1]``)."""
        if weight_scale is None:
            return None
        return "tensor" if weight_scale.numel() == 1 and weight_scale.dim() <= 1 else "row"

    @classmethod
    def from_full(cls, weight: torch.Tensor, *, weight_scale: torch.Tensor | None = None, group=None,
                  row_range: tuple[int, int] | None = None) -> ShardedEmbedding:
        """This rank's shard of a whole table ``weight`` (``[num_rows, dim]``), with its scale if any."""
        kind = cls.scale_kind_of(weight_scale)
        m = cls(weight.shape[0], weight.shape[1], group=group, row_range=row_range, device=weight.device,
                dtype=weight.dtype, scale=kind)
        sd = {"weight": weight}
        if kind is not None:
            sd["weight_scale"] = weight_scale.reshape(1) if kind == "tensor" else weight_scale
        m.load_state_dict(sd)
        return m

    @property
    def quantized(self) -> bool:
        return self.weight_scale is not None or not is_float_table(self.weight.dtype)

    def _apply(self, fn, recurse=True):
        # As ple.quant.QuantizedEmbedding: device moves apply to a quantized table, dtype casts do not.
        if not self.quantized:
            return super()._apply(fn, recurse)
        w = self._parameters["weight"]
        s = self._buffers.get("weight_scale")
        self._parameters["weight"] = nn.Parameter(w.detach().view(torch.uint8), requires_grad=False)
        if s is not None:
            self._buffers["weight_scale"] = s.view(torch.int32)
        try:
            super()._apply(fn, recurse)
        finally:
            self._parameters["weight"] = nn.Parameter(self._parameters["weight"].detach().view(w.dtype),
                                                      requires_grad=False)
            if s is not None:
                self._buffers["weight_scale"] = self._buffers["weight_scale"].view(torch.float32)
        return self

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

    # ---- lookups -------------------------------------------------------------------------------
    def _partial(self, flat_ids: torch.Tensor, ops) -> tuple[torch.Tensor, torch.Tensor | None]:
        """Owned rows of ``flat_ids`` ``[n]`` (zeros elsewhere): ``[n, dim]`` payload and ``[n]`` row scales.

        Trainable tables give their rows (autograd reaches ``weight`` through the
        owned rows only); quantized tables give their rows' bytes as uint8.
        """
        local = flat_ids.long() - self.row_start
        owned = (local >= 0) & (local < self.weight.shape[0])
        safe = torch.where(owned, local, torch.zeros_like(local))
        n = flat_ids.numel()
        w = self.weight if not self.quantized else self.weight.detach().view(torch.uint8)
        if w.shape[0] == 0:                                           # a rank that owns no rows
            rows = w.new_zeros((n, w.shape[1]))
        elif self.quantized:
            rows = F.embedding(safe, w)
        else:
            rows = ops.embedding_lookup(w, safe[:, None])             # [n, dim]
        payload = torch.where(owned[:, None], rows, torch.zeros((), dtype=rows.dtype, device=rows.device))
        row_scale = None
        if self.scale_kind == "row":
            s = self.weight_scale[safe, 0] if w.shape[0] else self.weight_scale.new_zeros(n)
            row_scale = torch.where(owned, s, torch.zeros_like(s))
        return payload, row_scale

    def _finish(self, summed: torch.Tensor, row_scale: torch.Tensor | None, T: int, NH: int,
                dtype) -> torch.Tensor:
        """Summed ``[T * NH, dim]`` payload -> ``[T, NH * dim]`` in ``dtype``, dequantised."""
        if not self.quantized:
            return summed.reshape(T, NH * self.dim).to(dtype or summed.dtype)
        q = summed.view(self.weight.dtype).float()                    # [n, dim]
        if self.scale_kind == "row":
            q = q * row_scale[:, None]
        elif self.scale_kind == "tensor":
            q = q * self.weight_scale
        return q.reshape(T, NH * self.dim).to(dtype or torch.get_default_dtype())

    def forward(self, ids: torch.Tensor, *, dtype: torch.dtype | None = None, ops=None) -> torch.Tensor:
        """Rows for hash ids ``[T, NH]`` that every rank passes alike: ``[T, NH * dim]``.

        Rows come back in ``dtype`` (default: the table's dtype, or the default float
        dtype for a quantized table). ``ops`` is the op module whose
        ``embedding_lookup`` gathers a trainable table's rows (default: the reference).
        """
        ops = ops or _reference_ops()
        _checks.tensor("ids", ids, ndim=2, kind="anyint", device=self.weight.device)
        T, NH = ids.shape
        payload, row_scale = self._partial(ids.reshape(-1), ops)
        if self.quantized:
            summed = self.comm.all_reduce(payload.contiguous(), "table_reduce")
            if row_scale is not None:
                row_scale = self.comm.all_reduce(row_scale.contiguous(), "table_scale")
        else:
            summed = _AllReduceSum.apply(payload, self.comm, "table_reduce")
        return self._finish(summed, row_scale, T, NH, dtype)

    def lookup_sequence_parallel(self, ids: torch.Tensor, counts: list[int], *,
                                 dtype: torch.dtype | None = None, ops=None) -> torch.Tensor:
        """Rows for this rank's own hash ids ``[T_k, NH]``; rank r passes ``counts[r]`` rows of ids.

        Every rank of the group must call it (a rank with no tokens passes ``[0, NH]``).
        """
        ops = ops or _reference_ops()
        comm = self.comm
        W = comm.world_size
        _checks.tensor("ids", ids, ndim=2, kind="anyint", device=self.weight.device)
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
            summed = _ReduceScatterRows.apply(payload.reshape(W * m, width), comm, "table_reduce")
        summed = summed[:T].reshape(T * NH, payload.shape[1])
        return self._finish(summed, row_scale, T, NH, dtype)


def _reference_ops():
    from .. import reference

    return reference


class ShardedNGramEmbedding(nn.Module):
    """`ple.layer.NGramEmbedding` with a `ShardedEmbedding` table: the same buffer names."""

    def __init__(self, config: PLEConfig, ple_layer_index: int, *, group=None, row_range=None, device=None,
                 dtype=None, scale: str | None = None):
        super().__init__()
        params = hash_params(config, ple_layer_index)
        self.ngram_embedding = ShardedEmbedding(params.num_rows, config.ngram_head_dim, group=group,
                                                row_range=row_range, device=device, dtype=dtype, scale=scale)
        self.register_buffer("layer_multipliers", params.multipliers.to(device))
        self.register_buffer("ngram_heads_vocab_sizes", params.head_sizes.to(device))
        self.register_buffer("ngram_heads_offsets", params.head_offsets.to(device))
        self.vocab_size = config.vocab_size

    def hash_params(self) -> HashParams:
        return HashParams(self.layer_multipliers, self.ngram_heads_vocab_sizes, self.ngram_heads_offsets,
                          self.ngram_embedding.num_rows, self.vocab_size)


class ShardedPLELayer(PLELayer):
    """`PLELayer` whose n-gram table is split by rows over ``group``; everything else is replicated.

    ``forward`` and ``step`` are `PLELayer`'s: every rank passes the same tokens
    and gets the same outputs as one process with the whole table (the lookup sums
    the owned rows over the group). For sequence parallelism, where ranks hold
    different tokens, use `ple.distributed.sp_forward` / `sp_step`, which call
    `embed_sequence_parallel`.

    The whole table is never allocated: only this rank's rows (``row_range``, by
    default the balanced split). ``table_dtype`` / ``scale`` make a quantized table
    (see `ShardedEmbedding`). The replicated parameters start as `PLELayer`'s do;
    give every rank the same weights with ``load_state_dict`` (a whole-model state
    dict is sliced to this rank's rows), `from_layer`, or `load_table_from_checkpoint`.

    Parameter names are `PLELayer`'s (``ple_embedding.ngram_embedding.weight`` holds
    the local rows; a quantized table adds ``ple_embedding.ngram_embedding.weight_scale``,
    as ``ple.quant`` does, so a quantized whole layer's state dict loads too).
    Training with replicated tokens: every rank gets the full gradient of the
    replicated parameters and the gradient of its own rows; do not all-reduce them.
    """

    def __init__(self, config: PLEConfig, ple_layer_index: int = 0, *, group=None,
                 row_range: tuple[int, int] | None = None, backend: str = "reference", device=None,
                 dtype=None, table_dtype: torch.dtype | None = None, scale: str | None = None):
        # PLELayer builds the whole table; build it with a config whose table is a few rows (only the
        # table depends on the head sizes), then swap in this rank's shard of the real table.
        tiny_table = config.replace(ngram_vocab_size_base=2, make_ngram_vocab_size_divisible_by=1)
        super().__init__(tiny_table, ple_layer_index, backend=backend, device=device, dtype=dtype)
        self.config = config
        self.ple_embedding = ShardedNGramEmbedding(config, ple_layer_index, group=group, row_range=row_range,
                                                   device=device, dtype=table_dtype or dtype, scale=scale)

    @classmethod
    def from_layer(cls, layer: PLELayer, group=None, *, row_range: tuple[int, int] | None = None,
                   backend: str | None = None) -> ShardedPLELayer:
        """This rank's sharded copy of a whole ``layer`` (same weights, same backend unless given)."""
        table = layer.ple_embedding.ngram_embedding
        w = table.weight
        new = cls(layer.config, layer.ple_layer_index, group=group, row_range=row_range,
                  backend=backend or layer.backend, device=w.device, dtype=layer.key_proj.weight.dtype,
                  table_dtype=w.dtype,
                  scale=ShardedEmbedding.scale_kind_of(getattr(table, "weight_scale", None)))
        new.load_state_dict(layer.state_dict())
        return new

    @property
    def table(self) -> ShardedEmbedding:
        return self.ple_embedding.ngram_embedding

    @property
    def comm(self) -> Comm:
        return self.table.comm

    def embed(self, ids: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
        """Rows for hash ids ``[T, NH]`` (the same on every rank), summed over the group: ``[T, E]``."""
        return self.table(ids, dtype=dtype, ops=self.ops)

    def embed_sequence_parallel(self, ids: torch.Tensor, dtype: torch.dtype,
                                counts: list[int]) -> torch.Tensor:
        """Rows for this rank's own hash ids ``[T_k, NH]``; ``counts`` holds every rank's ``T_k``."""
        return self.table.lookup_sequence_parallel(ids, counts, dtype=dtype, ops=self.ops)

    def start_prefetch(self, input_ids, query_start_loc=None, ngram_context=None) -> None:
        """Not supported: a sharded table's lookup is a collective, made when the layer runs."""
        raise NotImplementedError("start_prefetch: a sharded table is looked up collectively in embed(); "
                                  "there is nothing to prefetch")

    def load_table_from_checkpoint(self, source, *, key_prefix: str = "") -> None:
        """Read this rank's rows (and their scales) from a checkpoint (see `load_table_rows`).

        A float checkpoint table is cast to this layer's table dtype; a quantized one
        replaces the table by a quantized shard of the same rows.
        """
        t = self.table
        weight, weight_scale = load_table_rows(source, t.row_start, t.row_end, key_prefix=key_prefix)
        if weight.shape[1] != t.dim:
            raise ValueError(f"source: the checkpoint's table rows are {weight.shape[1]} wide, "
                             f"the layer's {t.dim}")
        kind = ShardedEmbedding.scale_kind_of(weight_scale)
        quantized = kind is not None or not is_float_table(weight.dtype)
        if quantized and (weight.dtype != t.weight.dtype or kind != t.scale_kind):
            t = ShardedEmbedding(t.num_rows, t.dim, group=t.comm, row_range=(t.row_start, t.row_end),
                                 device=t.weight.device, dtype=weight.dtype, scale=kind)
            self.ple_embedding.ngram_embedding = t
        with torch.no_grad():
            t.weight.copy_(weight.to(t.weight.dtype))
            if kind is not None:
                t.weight_scale.copy_(weight_scale.reshape(t.weight_scale.shape))

    def extra_repr(self) -> str:
        t = self.table
        return super().extra_repr() + f", rows=[{t.row_start}, {t.row_end}) of {t.num_rows}"


# ---- checkpoint shards ---------------------------------------------------------------------------
@dataclass(frozen=True)
class TablePiece:
    """Rows ``[start, stop)`` of the table are tensor ``key`` of ``path`` (and their scales ``scale_key``)."""

    start: int
    stop: int
    path: str
    key: str
    scale_path: str | None = None
    scale_key: str | None = None


def _safetensors_files(source) -> list[str]:
    if isinstance(source, (list, tuple)):
        return [os.fspath(p) for p in source]
    source = os.fspath(source)
    if os.path.isdir(source):
        index = glob(os.path.join(source, "*.safetensors.index.json"))
        if index:
            with open(index[0], encoding="utf-8") as fh:
                files = sorted(set(json.load(fh)["weight_map"].values()))
            return [os.path.join(source, f) for f in files]
        return sorted(glob(os.path.join(source, "*.safetensors")))
    return [source]


def checkpoint_table_shards(source, *, key_prefix: str = ""):
    """Where a checkpoint keeps one layer's table: ``(pieces, tensor_scale)``, from headers only.

    ``source`` is a checkpoint directory (its ``*.safetensors.index.json`` is used
    when there is one), a file, or a list of files; keys are ``key_prefix`` followed
    by ``ple_embedding.ngram_embedding.`` and then ``shard_{k}.weight`` (shard k holds
    the rows after shards ``0..k-1``; their sizes come from the headers) with
    optional per-row ``shard_{k}.weight_scale`` ``[n_k, 1]``, or one whole ``weight``.
    ``pieces`` are `TablePiece` in row order; ``tensor_scale`` is ``(path, key)`` of a
    per-tensor ``weight_scale`` (an FP8 table), or None.
    """
    from safetensors import safe_open

    base = re.escape(key_prefix + TABLE_KEY)
    shard_re = re.compile(base + r"\.shard_(\d+)\.(weight|weight_scale)$")
    whole_re = re.compile(base + r"\.(weight|weight_scale)$")
    shards: dict = {}
    whole: dict = {}
    for path in _safetensors_files(source):
        with safe_open(path, framework="pt") as f:
            for key in f.keys():
                m = shard_re.match(key)
                if m:
                    shards[(int(m.group(1)), m.group(2))] = (path, key, tuple(f.get_slice(key).get_shape()))
                    continue
                m = whole_re.match(key)
                if m:
                    whole[m.group(1)] = (path, key, tuple(f.get_slice(key).get_shape()))
    where = f"{key_prefix}{TABLE_KEY}"
    tensor_scale = None
    scale = whole.get("weight_scale")
    if scale is not None and (len(scale[2]) <= 1 and (not scale[2] or scale[2][0] == 1)):
        tensor_scale, scale = scale[:2], None
    pieces = []
    if shards:
        ks = sorted(k for k, what in shards if what == "weight")
        if ks != list(range(len(ks))):
            raise ValueError(f"source: table shards {where}.shard_{{k}}.weight must be numbered "
                             f"0..{len(ks) - 1}, got {ks}")
        row = 0
        for k in ks:
            path, key, shape = shards[(k, "weight")]
            sc = shards.get((k, "weight_scale"))
            pieces.append(TablePiece(row, row + shape[0], path, key, *(sc[:2] if sc else (None, None))))
            row += shape[0]
    elif "weight" in whole:
        path, key, shape = whole["weight"]
        pieces.append(TablePiece(0, shape[0], path, key, *(scale[:2] if scale else (None, None))))
    else:
        raise ValueError(f"source: no '{where}.shard_{{k}}.weight' or '{where}.weight' tensors in {source}")
    return pieces, tensor_scale


def load_table_rows(source, start: int, end: int, *, key_prefix: str = ""):
    """Rows ``[start, end)`` of a layer's table: ``(weight [end - start, D], weight_scale or None)``.

    Only the pieces that hold those rows are opened and only those rows are read
    (``safetensors`` slices). ``weight`` keeps the checkpoint's dtype;
    ``weight_scale`` is the rows' per-row scales ``[end - start, 1]``, the per-tensor
    scale ``[1]``, or None for a float table. See `checkpoint_table_shards`.
    """
    from safetensors import safe_open

    pieces, tensor_scale = checkpoint_table_shards(source, key_prefix=key_prefix)
    total = pieces[-1].stop
    if not 0 <= start <= end <= total:
        raise ValueError(f"start, end: expected 0 <= start <= end <= {total} (the table's rows), "
                         f"got {start}, {end}")
    rows, scales = [], []
    for p in pieces:
        a, b = max(p.start, start), min(p.stop, end)
        if b <= a and not (p is pieces[0] and start == end):
            continue
        a, b = (a, b) if b > a else (p.start, p.start)                 # an empty range: one empty read
        with safe_open(p.path, framework="pt") as f:
            rows.append(f.get_slice(p.key)[a - p.start:b - p.start])
        if p.scale_key is not None:
            with safe_open(p.scale_path, framework="pt") as f:
                scales.append(f.get_slice(p.scale_key)[a - p.start:b - p.start].reshape(-1, 1))
    weight = torch.cat(rows, dim=0)
    if tensor_scale is not None:
        with safe_open(tensor_scale[0], framework="pt") as f:
            return weight, f.get_tensor(tensor_scale[1]).float().reshape(1)
    if scales:
        if len(scales) != len(rows):
            raise ValueError(f"source: some table shards of {key_prefix}{TABLE_KEY} have per-row scales "
                             f"and some do not")
        return weight, torch.cat(scales, dim=0).float()
    return weight, None
