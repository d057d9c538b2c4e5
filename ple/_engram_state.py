"""The Engram family's state-dict keys: an Engram-family `ple.PLELayer` keeps ple's fused parameters and speaks the
demo module's keys through these two hooks (docs/engram.md, "The module"; docs/spec.md section 15).

`to_engram_keys` is the layer's ``state_dict`` post-hook, `from_engram_keys` its ``load_state_dict`` pre-hook.
They read only the layer's config and buffers, so this module sits below ``ple.layer``.
"""

from __future__ import annotations

from typing import Any, cast

import torch
from torch import nn

__all__ = ["ENGRAM_KEYS", "to_engram_keys", "from_engram_keys"]

ENGRAM_KEYS: dict[str, str] = {
    "ple_embedding.ngram_heads_offsets": "multi_head_embedding.offsets",
    "ple_embedding.ngram_embedding.": "multi_head_embedding.embedding.",     # weight (and a quantized table's scale)
    "conv1d.weight": "short_conv.conv.weight",
    "norm_conv.weight": "short_conv.norms.{m}.weight",
    "value_proj.weight": "value_proj.weight",
    "value_proj.bias": "value_proj.bias",
    "key_proj.weight": "key_projs.{m}.weight",
    "key_proj.bias": "key_projs.{m}.bias",
    "norm_key.weight": "norm1.{m}.weight",
    "norm_query.weight": "norm2.{m}.weight",
}
"""An Engram-family `PLELayer`'s parameter (left) and the demo module's key it is saved under (right), in the
demo's order; ``{m}`` keys hold stream m's rows ``[m * H, (m + 1) * H)`` of the fused parameter. The hash
multipliers and head sizes are not saved (the demo derives them from its config, as the layer does)."""

_DERIVED = ("ple_embedding.layer_multipliers", "ple_embedding.ngram_heads_vocab_sizes")


def to_engram_keys(module: nn.Module, state_dict: dict[str, Any], prefix: str, local_metadata: object) -> None:
    """``state_dict`` post-hook of an Engram-family layer: ple's keys become the demo module's (`ENGRAM_KEYS`)."""
    layer: Any = module
    M, H = layer.config.hc_count, layer.config.hidden_size
    mine = {k[len(prefix):]: state_dict.pop(k) for k in list(state_dict) if k.startswith(prefix)}
    streams: dict[str, list[tuple[str, torch.Tensor]]] = {}              # a ModuleList's keys: stream by stream
    for ours, theirs in ENGRAM_KEYS.items():
        if ours.endswith("."):                                             # every entry of the table
            for k in [k for k in mine if k.startswith(ours)]:
                state_dict[prefix + theirs + k[len(ours):]] = mine.pop(k)
        elif "{m}" in theirs:
            whole = mine.pop(ours)
            group = streams.setdefault(theirs.split(".{m}.")[0], [])
            # each stream its own tensor (safetensors refuses tensors sharing memory); keep_vars: views of the parameter
            group += [(theirs.format(m=m), whole[m * H:(m + 1) * H] if whole.requires_grad
                       else whole[m * H:(m + 1) * H].clone()) for m in range(M)]
        else:
            state_dict[prefix + theirs] = mine.pop(ours)
        if "{m}" in theirs and ours != "key_proj.weight":                # key_projs: weight and bias of each stream
            for name, part in sorted(streams.pop(theirs.split(".{m}.")[0]),
                                     key=lambda kv: int(kv[0].split(".")[-2])):
                state_dict[prefix + name] = part
    for k in _DERIVED:
        mine.pop(k, None)
    state_dict.update({prefix + k: v for k, v in mine.items()})            # anything else, as it was


def from_engram_keys(module: nn.Module, state_dict: dict[str, Any], prefix: str, local_metadata: object,
                      strict: bool, missing_keys: list[str], unexpected_keys: list[str],
                      error_msgs: list[str]) -> None:
    """``load_state_dict`` pre-hook of an Engram-family layer: the demo module's keys become ple's. Missing
    stream keys are left missing (the loader reports them); the demo's offsets must be this config's."""
    layer: Any = module
    M = layer.config.hc_count
    for ours, theirs in ENGRAM_KEYS.items():
        if ours.endswith("."):
            for k in [k for k in state_dict if k.startswith(prefix + theirs)]:
                state_dict[prefix + ours + k[len(prefix + theirs):]] = state_dict.pop(k)
        elif "{m}" in theirs:
            keys = [prefix + theirs.format(m=m) for m in range(M)]
            if all(k in state_dict for k in keys):
                state_dict[prefix + ours] = torch.cat([state_dict.pop(k) for k in keys])
        elif prefix + theirs in state_dict and theirs != ours:
            state_dict[prefix + ours] = state_dict.pop(prefix + theirs)
    offsets_key = prefix + "ple_embedding.ngram_heads_offsets"
    own = layer.ple_embedding.ngram_heads_offsets
    got = state_dict.get(offsets_key)
    known = isinstance(got, torch.Tensor) and "meta" not in (got.device.type, own.device.type)   # values to compare
    if known and got is not None and (got.shape != own.shape or not torch.equal(got.cpu(), own.cpu())):
        raise ValueError(f"state_dict: {prefix}multi_head_embedding.offsets {got.tolist()} differ from this config's "
                         f"{own.tolist()} (another engram_vocab_size, n_head_per_ngram or layer_ids?)")
    for k in _DERIVED:                                                     # derived from the config, as the demo does
        state_dict.setdefault(prefix + k, _buffer(layer, k))


def _buffer(layer: Any, key: str) -> torch.Tensor:
    owner: Any = layer
    for part in key.split("."):
        owner = getattr(owner, part)
    return cast(torch.Tensor, owner)
