"""The two parameter-holding parts of `ple.layer.PLELayer`: `GroupedRMSNorm` (one norm's weight) and
`NGramEmbedding` (the table and its hash parameters as buffers). Public as ``ple.layer.GroupedRMSNorm`` and
``ple.layer.NGramEmbedding`` (re-exported there), kept here so ``ple/layer.py`` holds the layer itself.
"""

from __future__ import annotations

import torch
from torch import nn

from .config import PLEConfig
from .reference.hashing import HashParams, hash_params
from .table import DenseTable, QuantizedTable, Table

__all__ = ["GroupedRMSNorm", "NGramEmbedding"]


class GroupedRMSNorm(nn.Module):
    """Holds the weight of one grouped RMS norm (``[C]``). Qwen4Exp: starts at zero, scale ``1 + w``
    (``unit_offset``); Engram (``unit_offset=False``): the demo's ``nn.RMSNorm`` weights side by side, starting
    at one, scale ``w``."""

    def __init__(self, channels: int, group_size: int, eps: float, device: torch.device | str | int | None = None,
                 dtype: torch.dtype | None = None, *, unit_offset: bool = True) -> None:
        super().__init__()
        self.group_size = group_size
        self.eps = eps
        self.unit_offset = unit_offset
        start = torch.zeros if unit_offset else torch.ones
        self.weight = nn.Parameter(start(channels, device=device, dtype=dtype))

    def extra_repr(self) -> str:
        eps = "finfo(dtype).eps" if self.eps is None else self.eps
        scale = "" if self.unit_offset else ", scale=w"
        return f"{self.weight.shape[0]}, group_size={self.group_size}, eps={eps}{scale}"


class NGramEmbedding(nn.Module):
    """The hashed n-gram table of one PLE layer (``ple.table``) and its hash parameters as int64 buffers.

    ``table`` defaults to a `DenseTable` of the config's size; any other `Table` (quantized,
    sharded, ...) must have the same number of rows and row width.
    """

    layer_multipliers: torch.Tensor          # buffers, registered in __init__
    ngram_heads_vocab_sizes: torch.Tensor
    ngram_heads_offsets: torch.Tensor
    token_map: torch.Tensor | None           # not saved: the config's (Engram family), or None
    ngram_embedding: Table

    def __init__(self, config: PLEConfig, ple_layer_index: int, device: torch.device | str | int | None = None,
                 dtype: torch.dtype | None = None, *, table: Table | None = None, sparse_grad: bool = False) -> None:
        super().__init__()
        params = hash_params(config, ple_layer_index)
        D = config.ngram_head_dim
        if table is None:
            table = DenseTable(params.num_rows, D, device=device, dtype=dtype, sparse_grad=sparse_grad)
        elif not isinstance(table, Table):
            raise TypeError(f"table: expected a ple.table.Table, got {type(table).__name__}")
        elif (table.num_rows, table.dim) != (params.num_rows, D):
            raise ValueError(f"table: PLE index {ple_layer_index} of this config needs a table of "
                             f"{params.num_rows} rows of {D}, got {table.num_rows} rows of {table.dim}")
        self.ngram_embedding = table
        self.register_buffer("layer_multipliers", params.multipliers.to(device))
        self.register_buffer("ngram_heads_vocab_sizes", params.head_sizes.to(device))
        self.register_buffer("ngram_heads_offsets", params.head_offsets.to(device))
        tmap = None if params.token_map is None else params.token_map.to(device)
        self.register_buffer("token_map", tmap, persistent=False)      # moves with .to(); the config is its record
        self.vocab_size = config.vocab_size
        self.eos_rule = params.eos_rule

    def hash_params(self) -> HashParams:
        """The hash parameters as stored in this module's buffers (so loaded buffers are what is used), with the
        family's window rule and token map."""
        return HashParams(self.layer_multipliers, self.ngram_heads_vocab_sizes, self.ngram_heads_offsets,
                          self.ngram_embedding.num_rows, self.vocab_size, self.token_map, self.eos_rule)

    def quantize_(self, scheme: str) -> None:
        """Replace the float table by its quantization, in place: ``"fp8"``, ``"int8"`` or ``"nf4"`` (``ple.quant``).
        A table whose values are not in memory (on the meta device, e.g. ``ple.io.DiskTable``) is a
        ``ValueError``: quantize its checkpoint with ``ple.io.convert`` instead."""
        if self.ngram_embedding.weight.device.type == "meta":
            raise ValueError(f"table: cannot quantize a table whose values are not in memory "
                             f"({type(self.ngram_embedding).__name__}); convert its checkpoint with ple.io.convert")
        self.ngram_embedding = QuantizedTable.from_float(self.ngram_embedding.weight.detach(), scheme)
