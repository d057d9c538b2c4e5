"""A memory plan for training the table: the bytes per rank of the table, its optimizer state and a step's traffic.

``plan(config, table_dtype, rule, world_size)`` (and ``python -m ple plan``) counts, for a table sharded by
rows over ``world_size`` ranks (``ple.distributed``, each rank holding ``ceil(rows / W)`` rows and their state):

* **table**: the rank's rows in ``table_dtype``;
* **state**: the rule's state of those rows (SGD none, Adagrad 4 bytes a row, Adam ``4 D + 4`` bytes a row);
* **step**: what a step of ``tokens`` tokens per rank moves, with ``M = tokens * NH`` lookups per rank and the
  hash spreading them evenly over the ranks (so each rank also serves ``M`` lookups of others): the looked-up
  rows sent to the ranks that asked (``M`` rows), their gradients back (``M`` rows), and the update, at most
  ``M`` distinct rows and their state read and written once;
* **working memory** of a step: the ids and gradient rows a step keeps until ``step()`` (none with
  ``fused=True``) and the update's temporaries (about four float32 ``[M, D]`` buffers);

and whether table + state + working memory fit ``device_memory`` (when given). Counted, not measured: the
layer's other parameters, activations and the framework's own memory are not in it. For comparison it also
gives the dense alternatives' state (``torch.optim.Adam``: 8 bytes a value; ``SparseAdam``: the same, dense).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from .. import _checks
from ..config import PLEConfig
from ..reference.hashing import hash_params

__all__ = ["MemoryPlan", "plan", "parse_bytes"]

_STATE_ROW = {"sgd": lambda dim: 0, "adagrad": lambda dim: 4, "adam": lambda dim: 4 * dim + 4}
_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


@dataclass(frozen=True)
class MemoryPlan:
    """The counts of `plan` (bytes, per rank)."""

    rows: int                   # the table's rows (all ranks)
    dim: int                    # D
    table_dtype: str
    rule: str
    world_size: int
    tokens: int                 # tokens a step, per rank
    lookups: int                # M = tokens * NH, per rank
    rows_per_rank: int
    table_bytes: int
    state_bytes: int
    working_bytes: int
    rows_sent_bytes: int        # looked-up rows served to the ranks that asked, a step
    grads_received_bytes: int   # their gradients back, a step
    update_bytes: int           # rows and state read and written by the update, a step (at most)
    dense_adam_state_bytes: int
    device_memory: int | None

    @property
    def total_bytes(self) -> int:
        return self.table_bytes + self.state_bytes + self.working_bytes

    @property
    def fits(self) -> bool | None:
        """Whether table + state + working memory fit ``device_memory`` (None when none was given)."""
        return None if self.device_memory is None else self.total_bytes <= self.device_memory

    def format(self) -> str:
        """The plan as the lines ``python -m ple plan`` prints."""
        g = _gib
        lines = [
            f"table {self.rows:,} x {self.dim} {self.table_dtype}, rule {self.rule}, {self.world_size} rank(s), "
            f"{self.tokens:,} tokens a step per rank ({self.lookups:,} lookups)",
            f"  per rank: {self.rows_per_rank:,} rows",
            f"    table            {g(self.table_bytes)}",
            f"    optimizer state  {g(self.state_bytes)}   (dense torch.optim.Adam would keep "
            f"{g(self.dense_adam_state_bytes)})",
            f"    step working     {g(self.working_bytes)}",
            f"    total            {g(self.total_bytes)}",
            f"  a step moves per rank: rows served {g(self.rows_sent_bytes)}, gradients received "
            f"{g(self.grads_received_bytes)}, update reads + writes <= {g(self.update_bytes)}",
        ]
        if self.device_memory is not None:
            lines.append(f"  fits {g(self.device_memory)} per device: {'yes' if self.fits else 'no'}")
        return "\n".join(lines)


def _gib(n: int) -> str:
    return f"{n / 2**30:,.2f} GiB" if n >= 2**26 else f"{n / 2**20:,.2f} MiB"


def parse_bytes(text: str) -> int:
    """``"141GB"``, ``"80GiB"``, ``"512MiB"``, ``"1e9"`` -> bytes (``GB`` = 10**9, ``GiB`` = 2**30)."""
    units = {"": 1, "b": 1, "kb": 10**3, "mb": 10**6, "gb": 10**9, "tb": 10**12,
             "kib": 2**10, "mib": 2**20, "gib": 2**30, "tib": 2**40}
    t = text.strip().lower().replace(" ", "")
    num = t.rstrip("abcdefghijklmnopqrstuvwxyz")
    unit = t[len(num):]
    if unit not in units or not num:
        raise ValueError(f"device_memory: expected a size like 80GiB or 141GB, got {text!r}")
    try:
        value = float(num)
    except ValueError:
        raise ValueError(f"device_memory: expected a size like 80GiB or 141GB, got {text!r}") from None
    return int(value * units[unit])


def plan(config: PLEConfig | str, table_dtype: str = "bfloat16", rule: str = "adagrad", world_size: int = 1, *,
         tokens: int = 2048, fused: bool = False, device_memory: int | str | None = None) -> MemoryPlan:
    """The memory plan of training one layer's table (see the module docstring).

    Args:
        config: a `PLEConfig` or a preset name (``"qwen4exp"``: the real model's table).
        table_dtype: ``"bfloat16"``, ``"float16"`` or ``"float32"`` (a quantized table does not train).
        rule: ``"sgd"``, ``"adagrad"`` or ``"adam"``.
        world_size: ranks the table's rows are sharded over (1: one device).
        tokens: tokens a training step looks up, per rank.
        fused: ``fused=True`` keeps no gradient between backward and step.
        device_memory: bytes per device (an int, or a string such as ``"141GB"``), for ``fits``.

    Raises:
        ValueError / TypeError naming the argument.
    """
    if isinstance(config, str):
        config = PLEConfig.preset(config)
    if not isinstance(config, PLEConfig):
        raise TypeError(f"config: expected a PLEConfig or a preset name, got {type(config).__name__}")
    if isinstance(table_dtype, str) and table_dtype not in _DTYPES:
        raise ValueError(f"table_dtype: a trained table is float: one of {sorted(_DTYPES)}; got {table_dtype!r}")
    _checks.choice_arg("table_dtype", table_dtype, sorted(_DTYPES))      # not a str (a torch.dtype too): TypeError
    _checks.choice_arg("rule", rule, tuple(_STATE_ROW))
    _checks.bool_arg("fused", fused)
    _checks.int_arg("world_size", world_size, minimum=1)
    _checks.int_arg("tokens", tokens, minimum=0)
    if isinstance(device_memory, str):
        device_memory = parse_bytes(device_memory)
    elif device_memory is not None:
        _checks.int_arg("device_memory", device_memory, minimum=1)
    rows = hash_params(config, 0).num_rows
    D, NH = config.ngram_head_dim, config.num_ngram_heads
    item = _DTYPES[table_dtype].itemsize
    per_rank = math.ceil(rows / world_size)
    M = tokens * NH
    state_row = _STATE_ROW[rule](D)
    kept = 0 if fused else M * (8 + D * item)                       # ids and gradient rows until step()
    working = kept + 4 * M * D * 4
    return MemoryPlan(
        rows=rows, dim=D, table_dtype=table_dtype, rule=rule, world_size=world_size, tokens=tokens, lookups=M,
        rows_per_rank=per_rank, table_bytes=per_rank * D * item, state_bytes=per_rank * state_row,
        working_bytes=working, rows_sent_bytes=M * D * item, grads_received_bytes=M * D * item,
        update_bytes=2 * M * (D * item + state_row), dense_adam_state_bytes=per_rank * D * 8,
        device_memory=device_memory)
