"""`PLECache.save` / `PLECache.load`: a whole cache in one safetensors file, bit-exact.

The file holds ``conv_states`` (the states of every layer, in the cache's layout),
``contexts`` (``[num_slots, N-1]`` int64) and, under the metadata key ``"ple"``, a JSON
record: the config, the sizes, the layout and the slot table. `load_cache` checks every
part of it before it builds the cache, so a damaged, truncated, empty or edited file is
a ``ValueError`` naming ``path`` and what is wrong, never a half-loaded cache.

Imports point one way: ``ple.state.cache`` imports this module (for ``PLECache.save`` /
``load``), and this one reaches the cache only through the instance or class it is given and
its public bookkeeping (``SLOT_FIELDS``, ``slot_table``, ``restore_slot_table``).
"""

from __future__ import annotations

import json
import os
from typing import TYPE_CHECKING, Any

import torch

from ..config import PLEConfig

if TYPE_CHECKING:
    from torch.types import Device

    from .cache import PLECache

__all__ = ["save_cache", "load_cache", "FORMAT"]

FORMAT = "ple.PLECache/1"


def save_cache(cache: PLECache, path: str | os.PathLike) -> None:
    from safetensors.torch import save_file

    table = cache.slot_table()
    meta = dict(config=cache.config.to_dict(), num_slots=cache.num_slots, num_spec_tokens=cache.num_spec_tokens,
                num_layers=cache.num_layers, layout=cache.layout, slots=table, format=FORMAT)
    save_file({"conv_states": cache.conv_states.contiguous().cpu(), "contexts": cache.contexts},
              str(path), metadata={"ple": json.dumps(meta)})


def _read(path: str | os.PathLike) -> tuple[dict[str, Any], torch.Tensor, torch.Tensor]:
    """``(metadata record, conv_states, contexts)`` of the file, or a ValueError naming ``path``."""
    from safetensors import safe_open

    if not os.path.isfile(path):
        raise ValueError(f"path: {path} is not a file")
    if os.path.getsize(path) < 8:
        raise ValueError(f"path: {path} is empty or truncated ({os.path.getsize(path)} bytes); "
                         f"not a PLECache file")
    try:
        with safe_open(str(path), framework="pt") as f:
            raw = (f.metadata() or {}).get("ple")
            if raw is None:
                raise ValueError(f"path: {path} is not a PLECache file (no 'ple' metadata)")
            missing = {"conv_states", "contexts"} - set(f.keys())
            if missing:
                raise ValueError(f"path: {path} lacks the tensor(s) {sorted(missing)} of a PLECache file")
            states, contexts = f.get_tensor("conv_states"), f.get_tensor("contexts")
    except ValueError:
        raise
    except Exception as e:  # safetensors' own error types: a damaged or truncated file
        raise ValueError(f"path: {path} is not a readable safetensors file (damaged or truncated?): {e}") from None
    try:
        meta = json.loads(raw)
    except json.JSONDecodeError as e:
        raise ValueError(f"path: {path}: its 'ple' metadata is not valid JSON ({e})") from None
    if not isinstance(meta, dict) or meta.get("format") != FORMAT:
        raise ValueError(f"path: {path}: expected a {FORMAT!r} record in its 'ple' metadata")
    return meta, states, contexts


def _int(value: object) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _tokens(value: object, n_max: int, vocab: int) -> bool:
    return isinstance(value, list) and len(value) <= n_max and all(_int(t) and 0 <= t < vocab for t in value)


def _check_slot_table(path: str | os.PathLike, meta: dict[str, Any], cache: PLECache) -> list[dict[str, Any]]:
    """The slot table of the record (its ``"slots"`` entry), each entry checked against the cache it is loaded
    into."""
    table = meta.get("slots")
    n = cache.num_slots
    if not isinstance(table, list) or len(table) != n:
        got = len(table) if isinstance(table, list) else type(table).__name__
        raise ValueError(f"path: {path}: the slot table has {got} entries, expected num_slots = {n}")
    V, N1, Q = cache.config.vocab_size, cache.config.context_len, cache.num_spec_tokens + 1
    for i, s in enumerate(table):
        where = f"path: {path}: slot {i}"
        if not isinstance(s, dict) or set(s) != set(cache.SLOT_FIELDS):
            raise ValueError(f"{where}: expected the fields {list(cache.SLOT_FIELDS)}")
        ok = (isinstance(s["active"], bool) and isinstance(s["started"], bool)
              and _int(s["length"]) and s["length"] >= 0
              and _tokens(s["context"], N1, V) and (len(s["context"]) == N1 or not s["active"])
              and _int(s["num_accepted"]) and 1 <= s["num_accepted"] <= Q
              and (s["spec_tokens"] is None or _tokens(s["spec_tokens"], Q, V))
              and (s["spec_context"] is None or (_tokens(s["spec_context"], N1, V) and len(s["spec_context"]) == N1))
              and isinstance(s["realigned"], list)
              and all(_int(x) and 0 <= x < cache.num_layers for x in s["realigned"]))
        if not ok:
            raise ValueError(f"{where}: a field is out of range or of the wrong type: {s}")
        if i == cache.null_slot and s["active"]:
            raise ValueError(f"{where}: the null slot is marked active")
    return table


def load_cache(cls: type[PLECache], path: str | os.PathLike, *, device: Device = None) -> PLECache:
    """Read a cache written by `save_cache` (see the module docstring)."""
    meta, states, contexts = _read(path)
    try:
        config = PLEConfig.from_dict(meta["config"])
        cache = cls(config, meta["num_slots"], num_spec_tokens=meta["num_spec_tokens"],
                    num_layers=meta["num_layers"], dtype=states.dtype, device=device, layout=meta["layout"])
    except (KeyError, TypeError, ValueError) as e:
        raise ValueError(f"path: {path}: its record does not describe a valid cache ({type(e).__name__}: {e})") \
            from None
    if tuple(states.shape) != tuple(cache.conv_states.shape):
        raise ValueError(f"path: {path}: conv_states has shape {tuple(states.shape)}, expected "
                         f"{tuple(cache.conv_states.shape)}")
    table = _check_slot_table(path, meta, cache)
    eos = [config.eos_token_id] * config.context_len
    want = torch.tensor([s["context"] if s["active"] else eos for s in table], dtype=torch.int64)
    if contexts.dtype != torch.int64 or not torch.equal(contexts, want.reshape(contexts.shape)
                                                        if contexts.numel() == want.numel() else want):
        raise ValueError(f"path: {path}: the contexts tensor disagrees with the slot table")
    cache.conv_states.copy_(states)
    cache.restore_slot_table(table)
    return cache
