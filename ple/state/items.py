"""What a serving step asks of one request: ``Prefill``, ``Decode`` or ``Spec``."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch

__all__ = ["Prefill", "Decode", "Spec", "as_token_list"]


def as_token_list(name: str, tokens: Any) -> list[int]:
    """Tokens as a list of Python ints: an int, a list of ints (numpy integers too), or a 0-D / 1-D
    integer tensor or numpy array. A 2-D ``[1, L]`` batch row is a ``ValueError`` (pass ``row[0]``), and so
    is a tensor on the meta device (it has no values to read)."""
    if type(tokens).__module__ == "numpy" and hasattr(tokens, "dtype"):
        import numpy as np
        if isinstance(tokens, np.generic):                         # a numpy scalar
            tokens = tokens.item()                                 # then checked as a Python value below
        elif not np.issubdtype(tokens.dtype, np.integer):
            raise TypeError(f"{name}: expected an integer array, got numpy {tokens.dtype}")
        elif tokens.ndim > 1:
            raise ValueError(f"{name}: expected a 0-D or 1-D array, got shape {tuple(tokens.shape)}"
                             f"{'; pass tokens[0] for one row' if tokens.shape[0] == 1 else ''}")
        else:
            return [int(t) for t in tokens.reshape(-1).tolist()]
    if isinstance(tokens, torch.Tensor):
        if tokens.dtype.is_floating_point or tokens.dtype.is_complex or tokens.dtype == torch.bool:
            raise TypeError(f"{name}: expected an integer tensor, got {tokens.dtype}")
        if tokens.dim() > 1:
            raise ValueError(f"{name}: expected a 0-D or 1-D tensor, got shape {tuple(tokens.shape)}"
                             f"{'; pass tokens[0] for one row' if tokens.shape[0] == 1 else ''}")
        if tokens.device.type == "meta":
            raise ValueError(f"{name}: expected token ids with values, got a tensor on the meta device")
        return [int(t) for t in tokens.reshape(-1).tolist()]
    if isinstance(tokens, bool):
        raise TypeError(f"{name}: expected token ids, got a bool")
    if isinstance(tokens, int):
        return [tokens]
    if isinstance(tokens, (list, tuple)):
        tokens = [t.item() if type(t).__module__ == "numpy" and hasattr(t, "item") and not isinstance(t, bool)
                  else t for t in tokens]
        if not all(isinstance(t, int) and not isinstance(t, bool) for t in tokens):
            raise TypeError(f"{name}: expected a list of ints, got {tokens!r}")
        return list(tokens)
    raise TypeError(f"{name}: expected an int, a list of ints or a 1-D integer tensor or array, got "
                    f"{type(tokens).__name__}")


@dataclass(frozen=True)
class Prefill:
    """Append ``tokens`` (a chunk of the prompt, or any tokens) to the request in ``slot``.

    ``checkpoint_at`` / ``checkpoint_slot``: after the step, ``checkpoint_slot`` (an
    allocated, otherwise unused slot) holds the request's state and context after the
    first ``checkpoint_at`` tokens of this chunk, as a request of its own that can be
    continued or forked (prefix caching). ``checkpoint_at`` must be at least the conv
    history length S and at most ``len(tokens)``.
    """

    slot: int
    tokens: object
    checkpoint_at: int | None = None
    checkpoint_slot: int | None = None


@dataclass(frozen=True)
class Decode:
    """Append one token to the request in ``slot``."""

    slot: int
    token: object


@dataclass(frozen=True)
class Spec:
    """A speculative step: 1..``num_spec_tokens + 1`` tokens, of which ``cache.accept`` keeps a prefix."""

    slot: int
    tokens: object


def plain_decodes(items: Sequence[Prefill | Decode | Spec], records: Sequence[Any], vocab_size: int,
                  null_slot: int) -> list[tuple[Prefill | Decode | Spec, list[int]]] | None:
    """The parsed items of the commonest step, a batch of ``Decode`` items with ``int`` tokens on distinct,
    live, started slots and tokens in range, found in one short pass (``records[slot]`` is a cache's slot
    record, with ``active`` and ``started``); None for anything else, which the general loop of
    ``PLECache.schedule`` then parses (and, where something is wrong, names)."""
    n = len(records)
    parsed: list[tuple[Prefill | Decode | Spec, list[int]]] = []
    seen: set[int] = set()
    for item in items:
        if type(item) is not Decode:
            return None
        slot, token = item.slot, item.token
        if (type(slot) is not int or type(token) is not int or not 0 < slot < n or slot == null_slot
                or slot in seen or not 0 <= token < vocab_size):
            return None
        s = records[slot]
        if not (s.active and s.started):
            return None
        seen.add(slot)
        parsed.append((item, [token]))
    return parsed or None
