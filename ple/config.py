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
``token_vocab_size``   V'      ids after ``token_map`` (Engram family; else V)
=====================  ======  ====================================================

Two families share these fields (``family``): ``"qwen4exp"``, the model's own layer, and ``"engram"``,
DeepSeek's Engram module (`PLEConfig.engram`, docs/engram.md): the same ops read the family's
differences (hash parameters, the window rule, the token map, biases, the norms' form and eps) as data.
"""

from __future__ import annotations

import dataclasses
import json
import numbers
import os
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any, cast

import torch

from ._checks.args import choice_arg, float_arg, int_arg

__all__ = ["PLEConfig", "PRESETS", "FAMILIES"]

FAMILIES = ("qwen4exp", "engram")
"""The layer families a `PLEConfig` describes (docs/spec.md sections 1 and 15)."""


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
    """1-based decoder layers that carry a PLE layer (the Engram family: the demo's 0-based ``layer_ids``).
    Empty (the default, as in transformers when the key is missing or null): the model has no PLE layer, and
    building a layer or a cache from the config is an error."""
    split_ngram_parts: int = 512
    """How many shards the checkpoint splits the table into."""
    family: str = "qwen4exp"
    """``"qwen4exp"`` (the model's layer) or ``"engram"`` (DeepSeek's Engram module; build it with
    `PLEConfig.engram`). In the Engram family ``eos_token_id`` holds the demo's ``pad_id`` (the token positions
    before a sequence read; no EOS rule), ``ple_layer_ids`` its ``layer_ids`` (0 allowed), ``rms_norm_eps`` the
    conv norms' eps (1e-5) and the table is not padded (``make_ngram_vocab_size_divisible_by`` 1)."""
    engram_vocab_size: tuple[int, ...] = ()
    """Engram family: one head-size start per order 2..N (the demo's ``engram_vocab_size``); else empty."""
    token_map: tuple[int, ...] | None = field(default=None, repr=False)
    """Engram family: the demo's compressed tokenizer as a lookup, one id in ``[0, V')`` per token id (None: the
    identity). Token ids, contexts and the pad go through it before hashing."""

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
        set_(self, "family", choice_arg("family", self.family, FAMILIES))
        engram = self.family == "engram"
        if any(i < (0 if engram else 1) for i in ids):      # the Engram demo numbers layers from 0
            raise ValueError(f"ple_layer_ids: expected a list of {'0' if engram else '1'}-based layer ids, "
                             f"got {list(ids)}")
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
        self._check_family()
        embed_dim = cast(int, self.ple_embed_dim)       # set above when None
        if self.ple_layer_ids and embed_dim % self.num_ngram_heads != 0:   # as transformers: with PLE
            raise ValueError(
                f"ple_embed_dim: must be divisible by the number of hash heads "
                f"(ngram_size - 1) * heads_per_ngram = {self.num_ngram_heads}, got {self.ple_embed_dim}"
            )

    def _check_family(self) -> None:
        """The Engram family's own fields (``engram_vocab_size``, ``token_map``), stored as tuples of ints; in the
        Qwen4Exp family they must be left empty."""
        set_ = object.__setattr__
        sizes: Any = self.engram_vocab_size
        tmap: Any = self.token_map
        if self.family != "engram":
            if sizes not in ((), []):
                raise ValueError(f"engram_vocab_size: only the Engram family has it (family={self.family!r})")
            if tmap is not None:
                raise ValueError(f"token_map: only the Engram family has it (family={self.family!r})")
            set_(self, "engram_vocab_size", ())
            return
        if not isinstance(sizes, Sequence) or isinstance(sizes, str) or not all(_is_int(v) for v in sizes):
            raise TypeError(f"engram_vocab_size: expected a list of ints, got {type(sizes).__name__}")
        if len(sizes) != self.ngram_size - 1 or any(v < 2 for v in sizes):
            raise ValueError(f"engram_vocab_size: expected {self.ngram_size - 1} sizes >= 2 (one per order "
                             f"2..{self.ngram_size}), got {list(sizes)}")
        set_(self, "engram_vocab_size", tuple(int(v) for v in sizes))
        if self.make_ngram_vocab_size_divisible_by != 1:
            raise ValueError("make_ngram_vocab_size_divisible_by: the Engram family's table is not padded (1), "
                             f"got {self.make_ngram_vocab_size_divisible_by}")
        if tmap is None:
            return
        if isinstance(tmap, torch.Tensor):
            if tmap.dtype.is_floating_point or tmap.dtype.is_complex or tmap.dtype == torch.bool:
                raise TypeError(f"token_map: expected an integer tensor or a list of ints, got {tmap.dtype}")
            tmap = tmap.detach().cpu().reshape(-1).tolist()
        elif hasattr(tmap, "tolist") and hasattr(tmap, "dtype"):          # a numpy array
            if tmap.dtype.kind not in "iu":
                raise TypeError(f"token_map: expected an integer array or a list of ints, got {tmap.dtype}")
            tmap = tmap.reshape(-1).tolist()
        if not isinstance(tmap, Sequence) or isinstance(tmap, str) or not all(_is_int(v) for v in tmap):
            raise TypeError(f"token_map: expected a list of ints, one per token id, got {type(tmap).__name__}")
        if len(tmap) != self.vocab_size:
            raise ValueError(f"token_map: expected one entry per token id (vocab_size={self.vocab_size}), "
                             f"got {len(tmap)}")
        if len(tmap) and min(tmap) < 0:
            raise ValueError(f"token_map: expected ids >= 0, got {min(tmap)}")
        set_(self, "token_map", tuple(int(v) for v in tmap))

    # ---- derived sizes -------------------------------------------------------------------------
    @property
    def pad_id(self) -> int | None:
        """Engram family: the demo's ``pad_id`` (kept in ``eos_token_id``); None for the Qwen4Exp family."""
        return self.eos_token_id if self.family == "engram" else None

    @property
    def token_vocab_size(self) -> int:
        """V': the ids hashed after ``token_map`` (its max + 1); V when there is no map."""
        return self.vocab_size if self.token_map is None else max(self.token_map, default=-1) + 1

    def gate_eps(self, dtype: torch.dtype) -> float:
        """The key and query norms' eps for activations of ``dtype``: ``rms_norm_eps`` (Qwen4Exp); the Engram
        family's ``nn.RMSNorm`` default, ``torch.finfo(dtype).eps``."""
        return torch.finfo(dtype).eps if self.family == "engram" else self.rms_norm_eps

    def gate_options(self) -> dict[str, Any]:
        """The keyword arguments of ``ple_gate`` / ``ple_prefill`` that carry the family's norms: none for
        Qwen4Exp (so ops with the plain section-7 signature run it), ``conv_eps`` (``rms_norm_eps``) and
        ``unit_offset=False`` (scale ``w``, not ``1 + w``) for Engram."""
        if self.family == "engram":
            return {"conv_eps": self.rms_norm_eps, "unit_offset": False}
        return {}

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

    @classmethod
    def engram(cls, *, vocab_size: int, hidden_size: int, hc_count: int, engram_vocab_size: Sequence[int],
               max_ngram_size: int = 3, n_embed_per_ngram: int = 512, n_head_per_ngram: int = 8,
               layer_ids: Sequence[int] = (1, 15), pad_id: int = 2, seed: int = 0, kernel_size: int = 4,
               token_map: Any = None) -> PLEConfig:
        """The config of DeepSeek's Engram module (its demo's field names; ``hc_count`` is its ``hc_mult``).

        N = ``max_ngram_size``, P = ``n_head_per_ngram``, D = ``n_embed_per_ngram / P``,
        E = ``(N - 1) * n_embed_per_ngram``, K = ``kernel_size``, d = N, M = ``hc_count``, H = ``hidden_size``;
        ``layer_ids`` become ``ple_layer_ids`` (the PLE index is the position in the sorted list),
        ``pad_id`` ``eos_token_id``; ``token_map`` (the compressed tokenizer as a lookup, a tensor, array or list
        of ``vocab_size`` ids; ``ple.integrations.engram.token_map``) is stored as a tuple of ints. Bad values
        are a ``ValueError`` (a wrong type a ``TypeError``) naming the demo's field.
        """
        n_embed = int_arg("n_embed_per_ngram", n_embed_per_ngram, minimum=1)
        heads = int_arg("n_head_per_ngram", n_head_per_ngram, minimum=1)
        if n_embed % heads:
            raise ValueError(f"n_embed_per_ngram: must be divisible by n_head_per_ngram={heads}, got {n_embed}")
        order = int_arg("max_ngram_size", max_ngram_size, minimum=2)
        int_arg("kernel_size", kernel_size, minimum=1)
        vocab = int_arg("vocab_size", vocab_size, minimum=1)
        pad = int_arg("pad_id", pad_id)
        if not 0 <= pad < vocab:
            raise ValueError(f"pad_id: expected an int in [0, vocab_size={vocab}), got {pad}")
        if isinstance(layer_ids, (str, bytes)) or not isinstance(layer_ids, Sequence):
            raise TypeError(f"layer_ids: expected a list of ints, got {type(layer_ids).__name__}")
        if not layer_ids:
            raise ValueError("layer_ids: expected at least one layer id, got []")
        if all(isinstance(i, numbers.Integral) for i in layer_ids) and list(layer_ids) != sorted(set(layer_ids)):
            raise ValueError(f"layer_ids: expected increasing layer ids (the demo hands out head sizes in the "
                             f"order given, ple in sorted order), got {list(layer_ids)}")
        try:
            return cls(vocab_size=vocab, hidden_size=hidden_size, hc_count=hc_count,
                       ple_embed_dim=(order - 1) * n_embed, ple_conv_kernel_size=kernel_size, ngram_size=order,
                       heads_per_ngram=heads, make_ngram_vocab_size_divisible_by=1, seed=seed,
                       eos_token_id=pad, rms_norm_eps=1e-5, ple_layer_ids=tuple(layer_ids), family="engram",
                       engram_vocab_size=cast(Any, engram_vocab_size), token_map=token_map)
        except (TypeError, ValueError) as err:   # name the demo's field where ours differs
            msg = str(err)
            for ours, theirs in (("ple_layer_ids", "layer_ids"), ("ple_conv_kernel_size", "kernel_size"),
                                 ("ngram_size", "max_ngram_size"), ("eos_token_id", "pad_id")):
                if msg.startswith(ours + ":"):
                    raise type(err)(theirs + msg[len(ours):]) from None
            raise

    def to_dict(self) -> dict[str, Any]:
        """The fields as a JSON-ready dict (``from_dict`` reads it back). A Qwen4Exp config writes the model's own
        keys only; an Engram config adds ``family``, ``engram_vocab_size`` and ``token_map``."""
        d = dataclasses.asdict(self)
        d["ple_layer_ids"] = list(self.ple_layer_ids)
        if self.family == "qwen4exp":
            for key in ("family", "engram_vocab_size", "token_map"):
                del d[key]
        else:
            d["engram_vocab_size"] = list(self.engram_vocab_size)
            d["token_map"] = None if self.token_map is None else list(self.token_map)
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
# DeepSeek's Engram demo (engram_demo_v1.py: EngramConfig and BackBoneConfig's defaults), without its
# tokenizer's map (pass token_map=ple.integrations.engram.token_map(tokenizer) to add it).
PRESETS["engram-demo"] = PLEConfig.engram(
    vocab_size=129280, hidden_size=1024, hc_count=4, engram_vocab_size=(129280 * 5, 129280 * 5),
    max_ngram_size=3, n_embed_per_ngram=512, n_head_per_ngram=8, layer_ids=(1, 15), pad_id=2, seed=0,
    kernel_size=4)
