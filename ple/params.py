"""`HashParams`: what the hash of one PLE layer needs, as a plain record.

Specified in ``docs/spec.md`` (``../docs/spec.md`` from this file), sections 2 (how the values are made)
and 3 (how the hash uses them, for any multipliers).

It lives at the bottom of the package (beside the config) because every layer of it passes one
around: the argument checks, the op backends, the checkpoint readers. How the values are made is
the specification's: ``ple.reference.hash_params``.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch.types import Device

__all__ = ["HashParams"]


@dataclass(frozen=True)
class HashParams:
    """Everything the hash of one PLE layer needs.

    ``multipliers`` is int64 ``[N]`` (``m[0]`` goes with the current token); ``head_sizes`` and
    ``head_offsets`` are int64 ``[NH]`` (head h addresses rows ``[head_offsets[h],
    head_offsets[h] + head_sizes[h])``); ``num_rows`` is the table's row count (padded);
    ``vocab_size`` is V. Built by hand, any multipliers are accepted: products that overflow wrap
    modulo ``2**64`` and the floor remainder keeps each head's rows in its range (docs/spec.md section 3),
    on every backend.
    """

    multipliers: torch.Tensor
    head_sizes: torch.Tensor
    head_offsets: torch.Tensor
    num_rows: int
    vocab_size: int

    @property
    def ngram_size(self) -> int:
        return self.multipliers.numel()

    def __repr__(self) -> str:
        sizes = self.head_sizes.tolist() if self.head_sizes.device.type != "meta" else "?"
        if isinstance(sizes, list) and len(sizes) > 6:
            sizes = f"[{sizes[0]}, {sizes[1]}, ..., {sizes[-1]}]"
        return (f"HashParams(N={self.ngram_size}, {self.head_sizes.numel()} heads of sizes {sizes}, "
                f"num_rows={self.num_rows}, vocab_size={self.vocab_size})")

    def to(self, device: Device) -> HashParams:
        return HashParams(self.multipliers.to(device), self.head_sizes.to(device),
                          self.head_offsets.to(device), self.num_rows, self.vocab_size)
