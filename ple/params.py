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

    The family's window (docs/spec.md sections 3 and 15) is data here too: ``token_map`` (int64 or int32
    ``[V]`` on any device, moved to the ids' as the multipliers are; or None for the identity) maps every token
    id, context id and the boundary token before hashing; ``eos_rule`` True (Qwen4Exp) cuts windows at an EOS,
    False (Engram) hashes every token as it is and only fills positions before the sequence with the boundary
    token (the op's ``eos_token_id`` argument, the Engram config's ``pad_id``).
    """

    multipliers: torch.Tensor
    head_sizes: torch.Tensor
    head_offsets: torch.Tensor
    num_rows: int
    vocab_size: int
    token_map: torch.Tensor | None = None
    eos_rule: bool = True

    @property
    def ngram_size(self) -> int:
        return self.multipliers.numel()

    def __repr__(self) -> str:
        sizes = self.head_sizes.tolist() if self.head_sizes.device.type != "meta" else "?"
        if isinstance(sizes, list) and len(sizes) > 6:
            sizes = f"[{sizes[0]}, {sizes[1]}, ..., {sizes[-1]}]"
        family = "" if self.eos_rule and self.token_map is None else (
            f", eos_rule={self.eos_rule}, token_map={'None' if self.token_map is None else 'a map'}")
        return (f"HashParams(N={self.ngram_size}, {self.head_sizes.numel()} heads of sizes {sizes}, "
                f"num_rows={self.num_rows}, vocab_size={self.vocab_size}{family})")

    def to(self, device: Device) -> HashParams:
        tmap = None if self.token_map is None else self.token_map.to(device)
        return HashParams(self.multipliers.to(device), self.head_sizes.to(device),
                          self.head_offsets.to(device), self.num_rows, self.vocab_size, tmap, self.eos_rule)
