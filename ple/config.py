"""`PLEConfig`: the fields of the model's ``config.json`` that the PLE layer reads.

Field names are the model's own, so a real ``config.json`` (or its ``text_config``
part) loads unchanged. Derived sizes are properties:

=====================  ======  ====================================================
property               symbol  meaning
=====================  ======  ====================================================
``num_ngram_heads``    NH      ``(ngram_size - 1) * heads_per_ngram`` hash heads
``ngram_head_dim``     D       ``ple_embed_dim // NH``, width of one table row
``hc_hidden_size``     C       ``hc_count * hidden_size``, the layer's channels
``conv_dilation``      d       conv dilation, equal to ``ngram_size``
``conv_state_len``     S       ``(ple_conv_kernel_size - 1) * d``, conv history
``context_len``        N-1     tokens of n-gram context carried between chunks
=====================  ======  ====================================================
"""

from __future__ import annotations

import dataclasses
import json
import numbers
import os
from dataclasses import dataclass
from typing import Any, cast

from ._checks.args import choice_arg, float_arg, int_arg

__all__ = ["PLEConfig", "PRESETS"]


def _is_int(value: Any) -> bool:
    return isinstance(value, numbers.Integral) and not isinstance(value, bool)


@dataclass(frozen=True)
class PLEConfig:
    """Configuration of the PLE layers of one model.

    A field of the wrong Python type (a float or a string for an int, a bool for either, ...) raises
    ``TypeError``, one of the right type out of range ``ValueError``, naming the field (docs/spec.md
    section 9); numpy integer scalars count as ints and are stored as ints. ``eos_token_id`` may be
    given as a list (the model's convention); its first entry is used.
    ``ple_layer_ids`` are 1-based decoder layer numbers; they are stored sorted and
    unique, and the *PLE index* of a layer is its position in that list.
    """

    vocab_size: int
    """V: token ids lie in ``[0, vocab_size)``."""
    hidden_size: int
    """H: width of one hyper-connection stream."""
    hc_count: int
    """M: number of hyper-connection streams; hidden states are ``M * H`` wide."""
    eos_token_id: int
    """The token that cuts n-gram windows (docs/spec.md section 3). Required."""
    ple_embed_dim: int | None = None
    """E: width of the concatenated n-gram embedding; defaults to ``hidden_size``."""
    ple_conv_kernel_size: int = 4
    """K: taps of the dilated causal conv."""
    ngram_size: int = 3
    """N: largest n-gram order; orders 2..N are hashed. Also the conv dilation."""
    heads_per_ngram: int = 8
    """P: hash heads (tables) per n-gram order."""
    ngram_vocab_size_base: int = 20_000_000
    """Head table sizes are the primes at or above this number."""
    make_ngram_vocab_size_divisible_by: int = 128
    """The table's row count is padded up to a multiple of this."""
    seed: int = 1234
    """Seed of the multiplier hash."""
    rms_norm_eps: float = 1e-6
    """Epsilon of the three grouped RMS norms."""
    ple_layer_ids: tuple[int, ...] = ()
    """1-based decoder layers that carry a PLE layer. Empty (the default, as in transformers when the key is
    missing or null): the model has no PLE layer, and building a layer or a cache from the config is an error."""
    split_ngram_parts: int = 512
    """How many shards the checkpoint splits the table into."""

    def __post_init__(self) -> None:
        set_ = object.__setattr__
        eos = self.eos_token_id
        if isinstance(eos, (list, tuple)):
            if len(eos) == 0:
                raise ValueError("eos_token_id: expected an int or a non-empty list, got []")
            eos = eos[0]
        if eos is None:
            raise ValueError("eos_token_id: required for PLE layers, got None")
        set_(self, "eos_token_id", eos)
        if self.ple_embed_dim is None:
            set_(self, "ple_embed_dim", self.hidden_size)
        ids: Any = self.ple_layer_ids     # user input (an int, a list, a tuple), checked below
        if _is_int(ids):
            ids = (ids,)
        if not isinstance(ids, (list, tuple)) or not all(_is_int(i) for i in ids):
            raise TypeError(f"ple_layer_ids: expected an int or a list of ints, got {self.ple_layer_ids!r}")
        if any(i < 1 for i in ids):
            raise ValueError(f"ple_layer_ids: expected a list of 1-based layer ids, got {list(ids)}")
        set_(self, "ple_layer_ids", tuple(sorted({int(i) for i in ids})))

        positive = (
            "vocab_size", "hidden_size", "hc_count", "ple_embed_dim", "ple_conv_kernel_size",
            "heads_per_ngram", "ngram_vocab_size_base", "make_ngram_vocab_size_divisible_by",
            "split_ngram_parts",
        )
        minimum = dict(ngram_vocab_size_base=2)
        for name in positive:
            set_(self, name, int_arg(name, getattr(self, name), minimum=minimum.get(name, 1)))
        set_(self, "ngram_size", int_arg("ngram_size", self.ngram_size, minimum=2))
        set_(self, "seed", int_arg("seed", self.seed, minimum=0))
        set_(self, "eos_token_id", int_arg("eos_token_id", self.eos_token_id))
        if not 0 <= self.eos_token_id < self.vocab_size:
            raise ValueError(
                f"eos_token_id: expected an int in [0, vocab_size={self.vocab_size}), got {self.eos_token_id!r}"
            )
        set_(self, "rms_norm_eps", float_arg("rms_norm_eps", self.rms_norm_eps, above=0, finite=True))
        embed_dim = cast(int, self.ple_embed_dim)       # set above when None
        if self.ple_layer_ids and embed_dim % self.num_ngram_heads != 0:   # as transformers: with PLE
            raise ValueError(
                f"ple_embed_dim: must be divisible by the number of hash heads "
                f"(ngram_size - 1) * heads_per_ngram = {self.num_ngram_heads}, got {self.ple_embed_dim}"
            )

    # ---- derived sizes -------------------------------------------------------------------------
    @property
    def num_ngram_heads(self) -> int:
        """NH = (N - 1) * P."""
        return (self.ngram_size - 1) * self.heads_per_ngram

    @property
    def ngram_head_dim(self) -> int:
        """D = E / NH, the width of one table row."""
        return cast(int, self.ple_embed_dim) // self.num_ngram_heads    # set by __post_init__ when None

    @property
    def hc_hidden_size(self) -> int:
        """C = M * H, the channel count of hidden states, keys, gated values and the conv."""
        return self.hc_count * self.hidden_size

    @property
    def conv_dilation(self) -> int:
        """d = N."""
        return self.ngram_size

    @property
    def conv_state_len(self) -> int:
        """S = (K - 1) * d, the conv inputs a request carries between steps."""
        return (self.ple_conv_kernel_size - 1) * self.conv_dilation

    @property
    def context_len(self) -> int:
        """N - 1, the tokens of n-gram context a request carries between steps."""
        return self.ngram_size - 1

    @property
    def num_ple_layers(self) -> int:
        return len(self.ple_layer_ids)

    # ---- loading -------------------------------------------------------------------------------
    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> PLEConfig:
        """Build from a dict: the text config itself, or a whole model config with ``text_config``.

        Keys the layer does not use are ignored.
        """
        if not isinstance(data, dict):
            raise TypeError(f"data: expected a dict, got {type(data).__name__}")
        if isinstance(data.get("text_config"), dict):
            # the text part wins; keys only at the top level (e.g. eos_token_id) still count
            data = {**{k: v for k, v in data.items() if k != "text_config"}, **data["text_config"]}
        names = {f.name for f in dataclasses.fields(cls)}
        kwargs = {k: v for k, v in data.items() if k in names}
        for required in ("vocab_size", "hidden_size", "hc_count", "eos_token_id"):
            if required not in kwargs:
                raise ValueError(f"{required}: missing from the config")
        if kwargs.get("ple_layer_ids") is None:      # missing or null: no PLE layer, as in transformers
            kwargs["ple_layer_ids"] = ()
        return cls(**kwargs)

    @classmethod
    def from_json(cls, path: str | os.PathLike) -> PLEConfig:
        """Load a ``config.json`` (model or text config)."""
        with open(path, encoding="utf-8") as fh:
            return cls.from_dict(json.load(fh))

    @classmethod
    def preset(cls, name: str, **overrides: Any) -> PLEConfig:
        """A named preset (see ``PRESETS``), with fields overridden by keyword."""
        choice_arg("name", name, sorted(PRESETS))
        return dataclasses.replace(PRESETS[name], **overrides)

    def to_dict(self) -> dict[str, Any]:
        d = dataclasses.asdict(self)
        d["ple_layer_ids"] = list(self.ple_layer_ids)
        return d

    def replace(self, **changes: Any) -> PLEConfig:
        return dataclasses.replace(self, **changes)


PRESETS: dict[str, PLEConfig] = {
    # Small enough for the Triton interpreter and gradcheck; every size odd or non-power-of-two
    # where it can be, so indexing bugs show.
    "tiny": PLEConfig(
        vocab_size=1000, hidden_size=24, hc_count=2, ple_embed_dim=24, ple_conv_kernel_size=4,
        ngram_size=3, heads_per_ngram=3, ngram_vocab_size_base=1000,
        make_ngram_vocab_size_divisible_by=16, seed=1234, eos_token_id=2, ple_layer_ids=(1, 2),
        split_ngram_parts=4,
    ),
    # The released Qwen4Exp text model (Qwen3.8-Flash-Next).
    "qwen4exp": PLEConfig(
        vocab_size=248320, hidden_size=2560, hc_count=4, ple_embed_dim=2560, ple_conv_kernel_size=4,
        ngram_size=3, heads_per_ngram=8, ngram_vocab_size_base=20_000_000,
        make_ngram_vocab_size_divisible_by=128, seed=1234, eos_token_id=248044, rms_norm_eps=1e-6,
        ple_layer_ids=(2,), split_ngram_parts=128,
    ),
}
