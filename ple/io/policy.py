"""What transformers would load wrong, and the ``ple_only`` mark: the one home of that policy.

transformers (5.23) loads a PLE layer with a float table and separate ``key_proj`` /
``value_proj`` right; a quantized table or a merged ``kv_proj`` it would load wrong
(`transformers_problems`). `save` and `convert` refuse to write those unless
``ple_only=True`` (`refuse_unless_ple_only`), and then mark the checkpoint: ``"ple_only"``
(the reasons) in ``config.json`` (`mark_config`) and ``ple.only`` in each file's metadata
(`mark_metadata`); `inspect` reports the problems of what it finds and whether the
checkpoint is marked (`is_marked`).

transformers has no model of the Engram family (``PLEConfig.engram``): only the Qwen4Exp family maps
to a transformers model. An Engram checkpoint's one problem is `ENGRAM_PROBLEM`; it is marked, but not
refused (no form of it would load), so ``ple_only`` is not needed for it.
"""

from __future__ import annotations

import json
from collections.abc import Iterable
from typing import Any

from ..quant import Scheme
from .files import Checkpoint

__all__ = ["PLE_ONLY_KEY", "PLE_ONLY_METADATA_KEY", "ENGRAM_PROBLEM", "transformers_problems", "problems_of",
           "refuse_unless_ple_only", "mark_config", "mark_metadata", "is_marked"]

PLE_ONLY_KEY = "ple_only"
"""Key of ``config.json`` (and ``ple.only`` of the file metadata): why transformers cannot load the checkpoint."""
PLE_ONLY_METADATA_KEY = "ple.only"

_TABLE_PROBLEM = " table: "          # in the reason a quantized table gives, and in no other

ENGRAM_PROBLEM = ("engram family: transformers cannot load it (it has no model of DeepSeek's Engram module; only "
                  "the Qwen4Exp family maps to a transformers model); load it with ple.io.load_layer")
"""The one reason an Engram-family checkpoint gives (marked, never refused)."""


def transformers_problems(table_scheme: Scheme | None, merged_kv: bool, family: str = "qwen4exp") -> list[str]:
    """Why transformers (5.23) would load a PLE layer of this kind wrong (empty: it loads it right).

    Its model has a float ``nn.Embedding`` table and separate ``key_proj`` / ``value_proj``.
    No ``quantization_config`` transformers honours covers an embedding table with these
    scales (its FP8 / int8 methods quantize ``nn.Linear`` weights), so it would ignore
    ``weight_scale`` and use the raw FP8 / int8 values; and it would leave both projections
    randomly initialised beside an unknown ``kv_proj``. An Engram-family layer (``family``) it
    cannot load in any form: `ENGRAM_PROBLEM` alone.
    """
    if family == "engram":
        return [ENGRAM_PROBLEM]
    out = []
    if table_scheme is not None and table_scheme.packed:
        out.append(f"{table_scheme.name}{_TABLE_PROBLEM}transformers would take its packed uint8 rows "
                   f"[rows, D/2 + 4] (codes and float16 scales) for a float [rows, D] table")
    elif table_scheme is not None:
        out.append(f"{table_scheme.name}{_TABLE_PROBLEM}transformers would ignore its weight_scale and use the "
                   f"raw {table_scheme.name} values")
    if merged_kv:
        out.append("merged kv_proj: transformers would leave key_proj and value_proj randomly initialised")
    return out


def problems_of(layers: Iterable[tuple[Scheme | None, bool]], family: str = "qwen4exp") -> list[str]:
    """`transformers_problems` of several layers ``(table scheme, merged kv)`` of one config's ``family``, each
    reason once, in order."""
    out: list[str] = []
    for scheme, merged in layers:
        out += [p for p in transformers_problems(scheme, merged, family) if p not in out]
    return out


def refuse_unless_ple_only(problems: list[str], ple_only: bool) -> None:
    """A ``ValueError`` naming the argument to blame (``table_dtype`` for a quantized table, else
    ``merged_kv``) when there are problems and ``ple_only`` is not set. `ENGRAM_PROBLEM` is never refused:
    an Engram checkpoint has no form transformers would load."""
    problems = [p for p in problems if p != ENGRAM_PROBLEM]
    if problems and not ple_only:
        arg = "table_dtype" if any(_TABLE_PROBLEM in p for p in problems) else "merged_kv"
        raise ValueError(f"{arg}: transformers would load this checkpoint wrong ({'; '.join(problems)}); pass "
                         f"ple_only=True (--ple-only) to write it for ple only (config.json and `inspect` then "
                         f"say so), or keep a float table and separate projections")


def mark_config(config: dict[str, Any], problems: list[str]) -> dict[str, Any]:
    """``config`` (a config.json dict) with the ple-only mark set to ``problems`` (removed when none)."""
    config = {k: v for k, v in config.items() if k != PLE_ONLY_KEY}
    if problems:
        config[PLE_ONLY_KEY] = problems
    return config


def mark_metadata(metadata: dict[str, str], problems: list[str]) -> dict[str, str]:
    """File ``metadata`` with ``ple.only`` set to ``problems`` (JSON; removed when none)."""
    metadata = {k: v for k, v in metadata.items() if k != PLE_ONLY_METADATA_KEY}
    if problems:
        metadata[PLE_ONLY_METADATA_KEY] = json.dumps(problems)
    return metadata


def is_marked(ckpt: Checkpoint) -> bool:
    """Whether the checkpoint says it is for ple only (its files' metadata, or the ``config.json`` beside them)."""
    if PLE_ONLY_METADATA_KEY in ckpt.metadata:
        return True
    config = ckpt.root / "config.json"
    if config.is_file():
        try:
            with open(config, encoding="utf-8") as fh:
                return bool(json.load(fh).get(PLE_ONLY_KEY))
        except (ValueError, AttributeError):
            return False
    return False
