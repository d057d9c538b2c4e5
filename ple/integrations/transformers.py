"""``ple`` inside a transformers ``Qwen4Exp*`` model: `patch` swaps its PLE modules for ``ple``-backed ones.

::

    from transformers import Qwen4ExpForCausalLM
    from ple.integrations.transformers import patch

    model = patch(Qwen4ExpForCausalLM.from_pretrained(path), backend="auto")
    model.generate(input_ids, attention_mask=mask, max_new_tokens=32)      # the model's own cache

Needs transformers >= 5.23 (``pip install 'ple[hf]'``); importing ``ple`` never imports it.

Every ``Qwen4ExpTextPLELayer`` of the model (the causal-LM and the conditional-generation
forms alike) is replaced by a `TransformersPLELayer`: a `PLELayer` whose ``forward`` takes
the model's module's arguments ``(hidden_states, input_ids, cache, conv_mask)``
and returns what that module returns, the layer's own term ``gated + conv`` (the decoder
layer adds it to the hidden states; it is computed directly, never as ``layer(h) - h``).
It holds the *same* parameter and buffer objects under the same names, so ``state_dict()``,
``save_pretrained``, optimizers built before the patch and tied references are unchanged,
and `unpatch` puts the model's modules back.

Why replace modules rather than use transformers' kernel hub (``kernels`` /
``use_kernel_forward_from_hub``): that mechanism swaps the ``forward`` of classes the model
marks with a hub layer name, and transformers 5.23 marks no PLE class; it also fetches
kernels from the Hub, where these are a local package. A module swap is what it would do
underneath, done here with the parameters shared.

Caching: during ``generate()`` the module reads and writes the model's own cache object
exactly as the model's module does, through ``get_conv_state`` / ``update_conv_state`` of
the PLE layer's decoder index: conv state 2 holds the last N - 1 token ids (the n-gram
context), conv state 1 the last S conv inputs ``[B, C, S]``. So everything the cache does
(``crop``, beam reordering, ``record_past`` rollback) works unchanged, and a cache filled by
the unpatched model can be continued by the patched one and back. ``conv_mask`` (the
model's 2-D padding mask, non-zero keeps) zeroes the gated values and conv inputs of
padding positions, as the model does; the model has already replaced their ids by EOS.

Backends: ``"auto"`` (Triton on a CUDA device, the reference elsewhere; re-decided at
every call, so ``model.to("cuda")`` after patching picks the kernels), ``"reference"``
or ``"triton"`` (on the CPU only under ``TRITON_INTERPRET=1``). On the Triton backend the
n-gram hash and table gather, the projections (one GEMM), the gate and the conv run as
``ple.fast`` kernels with their Triton backward. With a cache, the conv runs over the S
cached columns plus the new ones and keeps the last L outputs (S = 9 extra rows a step).
Logits, generated tokens and gradients are those of the unpatched model (the tests
compare them on a small random model, both backends).

Qwen4Exp only: a config of the Engram family (``PLEConfig.engram``, ``"family": "engram"`` in a model's
config, or a `TransformersPLELayer` built from one) is a ``ValueError`` naming the family.

Not covered: a model whose PLE table was replaced by a quantized transformers module
(`patch` raises ``TypeError``), and accelerate hooks on the PLE module itself (a
``device_map`` that places the PLE module as a unit): the hooks stay on the module that
was swapped out.
"""

from __future__ import annotations

from types import ModuleType
from typing import TYPE_CHECKING, Any, cast

import torch
import torch.nn.functional as F
from torch import nn

from .. import _checks
from ..backends import resolve_backend, traits
from ..config import PLEConfig
from ..layer import PLELayer

if TYPE_CHECKING:
    from torch.types import Device
    from transformers import Qwen4ExpTextConfig

__all__ = ["patch", "unpatch", "is_patched", "TransformersPLELayer", "tiny_config", "MIN_TRANSFORMERS"]

MIN_TRANSFORMERS = "5.23"


def _modeling() -> ModuleType:
    """transformers' ``modeling_qwen4_exp`` module, or ImportError saying how to get it."""
    hint = f"ple.integrations.transformers needs transformers >= {MIN_TRANSFORMERS}: pip install 'ple[hf]'"
    try:
        import transformers
        from packaging.version import Version
    except ImportError as e:
        raise ImportError(hint) from e
    if Version(transformers.__version__) < Version(MIN_TRANSFORMERS):
        raise ImportError(f"{hint} (found {transformers.__version__})")
    from transformers.models.qwen4_exp import modeling_qwen4_exp

    return modeling_qwen4_exp


class TransformersPLELayer(PLELayer):
    """A `PLELayer` with the calling convention of transformers' ``Qwen4ExpTextPLELayer``.

    ``forward(hidden_states [B, L, C], input_ids [B, L], cache=None, conv_mask=None)``
    returns the layer's term ``gated + conv`` ``[B, L, C]`` in the hidden states' dtype, not
    ``hidden_states + ...``; see the module docstring for the cache protocol. Built by
    `patch` around the model's own tensors (`from_module`); ``layer_idx`` is the decoder
    layer's index, the cache's layer. ``PLELayer.forward(layer, h, ids)`` still gives the
    whole-sequence layer, and ``layer.step`` serves from a ``ple.state.PLECache``.
    """

    _original: tuple[nn.Module]              # set by `patch`: the model's module (a tuple: not a submodule)

    def __init__(self, config: PLEConfig, ple_layer_index: int, layer_idx: int, *, backend: str = "auto",
                 device: Device = None, dtype: torch.dtype | None = None) -> None:
        if isinstance(config, PLEConfig):
            _refuse_engram("config", config.family)
        super().__init__(config, ple_layer_index, backend=backend, device=device, dtype=dtype)
        self.layer_idx = _checks.int_arg("layer_idx", layer_idx, minimum=0)

    @classmethod
    def from_module(cls, module: nn.Module, config: PLEConfig, *, backend: str = "auto") -> TransformersPLELayer:
        """Wrap a transformers ``Qwen4ExpTextPLELayer``: the new layer holds ``module``'s own parameter and
        buffer objects (nothing is copied or allocated), under the same names."""
        hf: Any = module                     # transformers' module: its attributes are the model's
        emb: Any = getattr(module, "ple_embedding", None)
        table = getattr(emb, "ngram_embedding", None)
        if type(table) is not nn.Embedding or not table.weight.is_floating_point():
            raise TypeError(f"module: expected the model's float nn.Embedding table, got "
                            f"{type(table).__name__} (a quantized or replaced table cannot be patched)")
        layer = cls(config, emb.ple_layer_index, hf.layer_idx, backend=backend, device="meta",
                    dtype=hf.key_proj.weight.dtype)
        mine = dict(layer.named_parameters()) | dict(layer.named_buffers())
        theirs = dict(module.named_parameters()) | dict(module.named_buffers())
        if mine.keys() != theirs.keys():
            raise ValueError(f"module: its tensors {sorted(theirs)} are not the PLE layer's {sorted(mine)} "
                             f"(a transformers version with another layout?)")
        for name, t in theirs.items():
            if tuple(t.shape) != tuple(mine[name].shape):
                raise ValueError(f"module: {name} has shape {tuple(t.shape)}, the config wants "
                                 f"{tuple(mine[name].shape)}")
        _share(layer, theirs)
        layer.train(module.training)
        return layer

    # The model's module's calling convention (not PLELayer.forward's): `patch` swaps it in for that module.
    def forward(self, hidden_states: torch.Tensor, input_ids: torch.Tensor,  # type: ignore[override]
                cache: Any = None, conv_mask: torch.Tensor | None = None, *,
                past_key_values: Any = None, **kwargs: Any) -> torch.Tensor:
        """The model's module's forward: ``gated + conv`` for ``[B, L, C]`` hidden states and ``[B, L]`` ids.

        ``cache`` is the model's cache object (or None: whole sequences, as in training); transformers
        5.23 passes it as ``past_key_values``, 5.24 and later as ``cache`` (both accepted). ``conv_mask`` is
        its ``[B, L]`` padding mask (bool, integer or float; non-zero keeps). Other keyword arguments
        (transformers 5.25 passes its decoder layer's, e.g. ``output_router_logits``) are ignored, as the
        model's own layer ignores them.
        """
        if past_key_values is not None:
            if cache is not None:
                raise TypeError("past_key_values: got both cache and past_key_values; pass one")
            cache = past_key_values
        cfg = self.config
        self._check_hidden(hidden_states, 3)
        B, L, C = hidden_states.shape
        dev = hidden_states.device
        _checks.tensor("input_ids", input_ids, kind="int", device=dev, shape=(B, L))
        keep = None
        if conv_mask is not None:
            _checks.tensor("conv_mask", conv_mask, device=dev, shape=(B, L))
            if conv_mask.dtype.is_complex:
                raise TypeError(f"conv_mask: expected a bool, integer or float tensor, got {conv_mask.dtype}")
            keep = (conv_mask != 0).reshape(B * L, 1)
        context = self._ngram_context(input_ids, cache)
        query_start_loc = torch.arange(B + 1, device=dev, dtype=torch.int64) * L
        check_values = traits(self.ops).checks_values_when_compiled or not torch.compiler.is_compiling()
        emb = self.hashed_rows(input_ids.reshape(B * L), hidden_states.dtype, query_start_loc=query_start_loc,
                               ngram_context=context, validate=check_values)
        key, value = self.project(emb)
        gated, conv_input = self.ops.ple_gate(key, value, hidden_states.reshape(B * L, C), self.norm_key.weight,
                                              self.norm_query.weight, self.norm_conv.weight, cfg.rms_norm_eps)
        if keep is not None:
            m = keep.to(gated.dtype)
            gated, conv_input = gated * m, conv_input * m
        y = self._conv(conv_input.reshape(B, L, C), cache)
        return gated.reshape(B, L, C) + y

    def _ngram_context(self, input_ids: torch.Tensor, cache: Any) -> torch.Tensor | None:
        """``[B, N-1]`` tokens before ``input_ids`` from the cache's conv state 2 (None: sequence starts), and
        the cache updated with ``input_ids`` as the model's module updates it."""
        if cache is None:
            return None
        n = self.config.context_len
        cached = cache.get_conv_state(self.layer_idx, state_idx=2)
        context = None if cached is None else cached[:, -n:].clone()      # read before the update below
        ids = input_ids.long()
        if cached is None and ids.shape[1] < n:                            # the model pads with EOS, not 0
            ids = F.pad(ids, (n - ids.shape[1], 0), value=self.config.eos_token_id)
        cache.update_conv_state(ids, self.layer_idx, state_idx=2, conv_kernel_size=n)
        return context

    def _conv(self, x: torch.Tensor, cache: Any) -> torch.Tensor:
        """``silu(conv)`` of ``[B, L, C]`` conv inputs, continuing the cache's conv state 1 (and updating it)."""
        cfg = self.config
        w, d = self.conv_weights, cfg.conv_dilation
        if cache is None:
            return self.ops.dilated_causal_conv(x, w, dilation=d)
        S, L = cfg.conv_state_len, x.shape[1]
        full = cache.update_conv_state(x.transpose(1, 2), self.layer_idx, state_idx=1, conv_kernel_size=S)
        window = F.pad(full, (S, 0))[..., -(S + L):]                       # S columns of history, then x
        y = self.ops.dilated_causal_conv(window.transpose(1, 2).contiguous(), w, dilation=d)
        return y[:, S:]

    def extra_repr(self) -> str:
        return f"layer_idx={self.layer_idx}, " + super().extra_repr()


def tiny_config(**changes: Any) -> Qwen4ExpTextConfig:
    """A small ``Qwen4ExpTextConfig`` for trying `patch` without a checkpoint (``Qwen4ExpForCausalLM(tiny_config())``).

    Four decoder layers (three GatedDeltaNet, one indexed attention), hidden size 32, two
    hyper-connection streams, PLE on decoder layers 1 and 3 with small tables (424 and 512
    rows of 4), vocabulary 64, EOS 2, padding 0. Keyword arguments change any field. The
    model it builds starts its PLE norms and conv at zero, as the real model does.
    """
    _modeling()
    from transformers import Qwen4ExpTextConfig

    fields: dict[str, Any] = dict(
        vocab_size=64, hidden_size=32, num_hidden_layers=4, num_attention_heads=2, num_key_value_heads=1,
        head_dim=16, linear_key_head_dim=8, linear_value_head_dim=8, linear_num_key_heads=2,
        linear_num_value_heads=2, moe_intermediate_size=16, shared_expert_intermediate_size=16, num_experts=4,
        num_experts_per_tok=2, hc_count=2, hc_lowrank=8, ple_layer_ids=[1, 3], ple_embed_dim=16,
        heads_per_ngram=2, ngram_vocab_size_base=101, make_ngram_vocab_size_divisible_by=8, split_ngram_parts=3,
        eos_token_id=2, pad_token_id=0, max_position_embeddings=128, indexer_n_heads=2, indexer_kv_heads=1,
        indexer_head_dim=16, indexer_budget=8, indexer_compress_ratio=4)
    fields.update(changes)
    return Qwen4ExpTextConfig(**fields)


def _share(layer: nn.Module, tensors: dict[str, torch.Tensor]) -> None:
    """Make ``layer``'s parameters and buffers the given objects (by dotted name)."""
    for name, t in tensors.items():
        owner, _, attr = name.rpartition(".")
        sub = layer.get_submodule(owner)
        if attr in sub._parameters:
            sub._parameters[attr] = cast(nn.Parameter, t)         # one of the other module's parameters
        else:
            sub._buffers[attr] = t


def _refuse_engram(name: str, family: Any) -> None:
    """``ValueError`` naming the Engram family when ``family`` is ``"engram"``: the patch serves Qwen4Exp only."""
    if family == "engram":
        raise ValueError(f"{name}: the Engram family (family='engram') cannot be patched: "
                         f"ple.integrations.transformers swaps the modules of a transformers Qwen4Exp model only; "
                         f"build an Engram layer as ple.PLELayer(ple.PLEConfig.engram(...), i) (docs/engram.md)")


def _text_config_dict(model: nn.Module) -> dict[str, Any]:
    """The model's text config as a dict, after refusing a config of the Engram family (its text config's
    ``family``, or a whole model config's)."""
    config = getattr(model, "config", None)
    if config is None or not hasattr(config, "get_text_config"):
        raise TypeError(f"model: expected a transformers model (with .config), got {type(model).__name__}")
    text = config.get_text_config(decoder=True).to_dict()
    _refuse_engram("model", text.get("family", getattr(config, "family", None)))
    return text


def _ple_config(model: nn.Module) -> PLEConfig:
    config = PLEConfig.from_dict(_text_config_dict(model))
    _refuse_engram("model", config.family)
    return config


def _ple_modules(model: nn.Module,
                 kinds: type[nn.Module] | tuple[type[nn.Module], ...]) -> list[tuple[nn.Module, str, nn.Module]]:
    out = []
    for name, module in model.named_modules():
        if isinstance(module, kinds):
            parent_name, _, attr = name.rpartition(".")
            out.append((model.get_submodule(parent_name), attr, module))
    return out


def patch(model: nn.Module, backend: str = "auto") -> nn.Module:
    """Swap every PLE module of a transformers ``Qwen4Exp*`` model for a `TransformersPLELayer`; returns ``model``.

    In place, and idempotent: patching a patched model only sets ``backend`` on its layers.
    ``backend`` is ``"auto"``, ``"reference"`` or ``"triton"`` (see the module docstring).
    ``ValueError`` if the model has no PLE module (its config has no ``ple_layer_ids``), or if its config is
    of the Engram family (``"family": "engram"``: DeepSeek's Engram has no transformers model to patch; see
    docs/engram.md); ``TypeError`` if ``model`` is not a transformers model. See `unpatch`.
    """
    hf = _modeling()
    if not isinstance(model, nn.Module) or not hasattr(getattr(model, "config", None), "get_text_config"):
        raise TypeError(f"model: expected a transformers model, got {type(model).__name__}")
    resolve_backend(backend)                                   # a bad name fails before anything changes
    _text_config_dict(model)                                   # an Engram config fails here, before anything
    found = _ple_modules(model, (hf.Qwen4ExpTextPLELayer, TransformersPLELayer))
    if not found:
        raise ValueError(f"model: {type(model).__name__} has no PLE module (Qwen4ExpTextPLELayer); its config's "
                         f"ple_layer_ids is empty or missing")
    config = _ple_config(model)
    swaps = []
    for parent, attr, module in found:
        if isinstance(module, TransformersPLELayer):
            continue
        layer = TransformersPLELayer.from_module(module, config, backend=backend)
        layer._original = (module,)                            # a tuple: not a submodule, not in state_dict
        swaps.append((parent, attr, layer))
    for _, _, module in found:                                  # every check passed: now change the model
        if isinstance(module, TransformersPLELayer):
            module.set_backend(backend)
    for parent, attr, layer in swaps:
        setattr(parent, attr, layer)
    return model


def unpatch(model: nn.Module) -> nn.Module:
    """Put the model's own PLE modules back (holding the patched layers' current tensors); returns ``model``.

    A model that is not patched is returned unchanged.
    """
    for parent, attr, module in _ple_modules(model, TransformersPLELayer):
        layer = cast(TransformersPLELayer, module)             # _ple_modules found only those
        (original,) = layer._original
        _share(original, dict(layer.named_parameters()) | dict(layer.named_buffers()))
        original.train(layer.training)
        setattr(parent, attr, original)
    return model


def is_patched(model: nn.Module) -> bool:
    """Whether any PLE module of ``model`` is a `TransformersPLELayer`."""
    return any(isinstance(m, TransformersPLELayer) for m in model.modules())
