"""`PLELayer`: the whole layer as an ``nn.Module``, on either backend.

Parameter and buffer names are the model checkpoint's, so the model's layer loads
with ``load_state_dict(strict=True)``::

    ple_embedding.ngram_embedding.weight   [rows, D]
    ple_embedding.layer_multipliers        [N]   int64
    ple_embedding.ngram_heads_vocab_sizes  [NH]  int64
    ple_embedding.ngram_heads_offsets      [NH]  int64
    key_proj.weight                        [C, E]
    value_proj.weight                      [H, E]
    norm_key.weight / norm_query.weight / norm_conv.weight   [C]
    conv1d.weight                          [C, 1, K]

An Engram-family config (``PLEConfig.engram``, docs/engram.md) makes DeepSeek's Engram module: the same
parameters, with biases on both projections, held fused as above (``key_proj`` is the demo's ``key_projs``
stacked, ``norm_key`` its ``norm1``, ...), while ``state_dict`` and ``load_state_dict`` speak the demo
module's keys and shapes (`ENGRAM_KEYS`).

The table (``layer.table``, one ``ple.table.Table``) may be quantized
(``NGramEmbedding.quantize_``, ``ple.quant``: an FP8 or int8 ``weight`` plus
``ple_embedding.ngram_embedding.weight_scale``), sharded over ranks (``ple.distributed``)
and may stay in host memory while the rest runs on the GPU (``ple.offload``), with its
rows fetched ahead of time by ``layer.start_prefetch``.
"""

from __future__ import annotations

from types import ModuleType
from typing import TYPE_CHECKING, Any, NamedTuple, cast

import torch
import torch.nn.functional as F
from torch import nn

from . import _checks
from ._engram_state import ENGRAM_KEYS, from_engram_keys, to_engram_keys
from ._layer_parts import GroupedRMSNorm, NGramEmbedding
from .backends import CustomOps, backend_module, resolve_backend, traits, triton_compiled_available
from .config import PLEConfig
from .offload import start_prefetch as _start_prefetch
from .table import DenseTable, QuantizedTable, Table

if TYPE_CHECKING:
    from .state import PLECache, StepBatch

__all__ = ["PLELayer", "GroupedRMSNorm", "NGramEmbedding", "Intermediates", "ENGRAM_KEYS"]


class Intermediates(NamedTuple):
    """What ``layer(h, ids, return_intermediates=True)`` returns: every value on the way, ``[B, L, ...]``.

    ``scores`` and ``gates`` are the per-stream score ``s`` and gate ``g`` (docs/spec.md section 4,
    ``ple.reference.gate``), recomputed by the reference from ``key`` and the hidden states;
    ``conv`` is the conv term ``y``. ``output = (gated + conv) + hidden_states`` (padding
    positions: ``gated`` and ``conv_input`` are zero there, ids are those of EOS).
    """

    ngram_ids: torch.Tensor     # [B, L, NH] table rows, head by head
    embeddings: torch.Tensor    # [B, L, E]
    key: torch.Tensor           # [B, L, C]
    value: torch.Tensor         # [B, L, H]
    scores: torch.Tensor        # [B, L, M]
    gates: torch.Tensor         # [B, L, M]
    gated: torch.Tensor         # [B, L, C]
    conv_input: torch.Tensor    # [B, L, C]
    conv: torch.Tensor          # [B, L, C]
    output: torch.Tensor        # [B, L, C]


class PLELayer(nn.Module):
    """The hashed n-gram embedding layer of Qwen4Exp.

    ``layer(hidden_states, input_ids, attention_mask=None)`` runs whole sequences
    (training, evaluation) and returns ``hidden_states + gated + conv``;
    ``layer.step(hidden_states, batch, cache)`` runs one serving step against a
    ``ple.state.PLECache``.

    ``backend`` picks the ops (``ple.backends``): ``"reference"`` (``ple.reference``, the
    specification, written to be read), ``"torch"`` (``ple.vectorized``: the same math
    vectorised, sync-free and ``torch.compile``-friendly), ``"triton"`` (``ple.fast``) or
    ``"auto"`` (Triton where it runs compiled, i.e. when the layer's weights are on a CUDA
    device and Triton is installed; ``"torch"`` elsewhere, so moving the layer with ``.to()``
    moves the choice with it). ``layer.backend`` says which is in use; it can be changed with
    ``layer.set_backend``.

    Every backend runs the same composition, op by op (`forward`, `step`): ``ngram_embedding``
    (or ``ngram_ids`` then the table's lookup, for a table that is not a plain dense one in the
    tokens' memory), the key and value projections, then ``ple_prefill`` for whole requests;
    a serving step with decodes, spec rows or prefix checkpoints runs ``ple_gate``, one
    ``ple_conv`` per mode and ``export_conv_checkpoints`` instead. Nothing branches on the
    backend's name.

    ``ops`` runs the layer on your own ops instead: any object with the op names of
    ``ple.backends.OP_NAMES`` (``ngram_ids``, ``embedding_lookup``, ``ngram_embedding``,
    ``ple_gate``, ``ple_conv``, ``export_conv_checkpoints``, ``dilated_causal_conv``,
    ``ple_prefill``), each with the signature of its ``ple.reference`` twin, e.g. a module of
    kernels under test (``ple.testing.check_layer`` checks such a layer whole, fused entry
    points included). ``layer.backend`` is then ``"custom"``; ``set_backend`` goes back to a
    built-in backend.

    ``sparse_table_grad=True`` makes the table's gradient a sparse tensor of the rows looked
    up (use an optimizer that takes sparse gradients, e.g. ``torch.optim.SparseAdam``); its
    dense value equals the dense gradient. Use it to train the real model's table: its dense
    gradient (320M x 160, accumulated in float32) would take about 205 GB.

    ``table`` replaces the default dense table by any ``ple.table.Table`` of the same size
    (a quantized one, or ``ple.distributed``'s sharded one), so no table is built only to
    be swapped out.

    Initialisation follows the model: the table is normal(0, 1), the projections
    use ``nn.Linear``'s default, the three norms and the conv start at zero. An Engram-family config
    starts as the demo module does: the table normal(0, 1), the projections and their biases
    ``nn.Linear``'s default, the norms at one, the conv ``nn.Conv1d``'s default.
    """

    _custom_ops: CustomOps | None

    def __init__(self, config: PLEConfig, ple_layer_index: int = 0, *, backend: str = "reference",
                 device: torch.device | str | int | None = None, dtype: torch.dtype | None = None,
                 sparse_table_grad: bool = False, table: Table | None = None, ops: object | None = None) -> None:
        super().__init__()
        if not isinstance(config, PLEConfig):
            raise TypeError(f"config: expected a PLEConfig, got {type(config).__name__}")
        ple_layer_index = _checks.int_arg("ple_layer_index", ple_layer_index, minimum=0)
        if config.num_ple_layers == 0:
            raise ValueError("config: has no PLE layer (ple_layer_ids is empty; a config without ple_layer_ids "
                             "means no PLE layer, as in transformers); pass ple_layer_ids=[...]")
        if ple_layer_index >= config.num_ple_layers:
            raise ValueError(f"ple_layer_index: the config has {config.num_ple_layers} PLE layer(s) "
                             f"(ple_layer_ids={list(config.ple_layer_ids)}), got index {ple_layer_index}")
        self.config = config
        self.ple_layer_index = ple_layer_index
        C, H, K = config.hc_hidden_size, config.hidden_size, config.ple_conv_kernel_size
        E = cast(int, config.ple_embed_dim)          # set by PLEConfig.__post_init__
        kw: dict[str, Any] = dict(device=device, dtype=dtype)
        self.ple_embedding = NGramEmbedding(config, ple_layer_index, **kw, table=table,
                                            sparse_grad=sparse_table_grad)
        engram = config.family == "engram"
        self.key_proj = nn.Linear(E, C, bias=engram, **kw)
        self.value_proj = nn.Linear(E, H, bias=engram, **kw)
        norm_eps = None if engram else config.rms_norm_eps          # Engram's key / query eps follows the dtype
        self.norm_key = GroupedRMSNorm(C, H, norm_eps, **kw, unit_offset=not engram)   # type: ignore[arg-type]
        self.norm_query = GroupedRMSNorm(C, H, norm_eps, **kw, unit_offset=not engram)  # type: ignore[arg-type]
        self.norm_conv = GroupedRMSNorm(C, H, config.rms_norm_eps, **kw, unit_offset=not engram)
        self.conv1d = nn.Conv1d(C, C, K, groups=C, dilation=config.conv_dilation, bias=False, **kw)
        if not engram:
            nn.init.zeros_(self.conv1d.weight)
        else:
            self.register_state_dict_post_hook(to_engram_keys)
            self.register_load_state_dict_pre_hook(from_engram_keys)
        self.set_backend(backend)
        if ops is not None:
            self._custom_ops = CustomOps(ops)

    # ---- backend -------------------------------------------------------------------------------
    def set_backend(self, backend: str) -> None:
        """Switch the ops this layer runs on (see the class docstring)."""
        resolve_backend(backend)                       # validates the name (and that "triton" can run)
        self._backend_request = backend
        self._custom_ops = None

    @property
    def backend(self) -> str:
        """The backend in use: ``"reference"``, ``"torch"``, ``"triton"`` (``"auto"`` decides by the weights'
        device), or ``"custom"`` (``PLELayer(ops=...)``)."""
        if self._custom_ops is not None:
            return "custom"
        if self._backend_request == "auto":
            on_cuda = self.key_proj.weight.is_cuda
            return "triton" if on_cuda and triton_compiled_available() else "torch"
        return self._backend_request

    @property
    def ops(self) -> ModuleType | CustomOps:
        """The ops in use: ``ple.reference``, ``ple.vectorized``, ``ple.fast``, or the `CustomOps` of
        ``PLELayer(ops=...)``."""
        if self._custom_ops is not None:
            return self._custom_ops
        return backend_module(self.backend)

    # ---- pieces shared by forward and step -----------------------------------------------------
    def _check_hidden(self, hidden_states: torch.Tensor, ndim: int) -> None:
        C = self.config.hc_hidden_size
        shape = (None,) * (ndim - 1) + (C,)
        _checks.tensor("hidden_states", hidden_states, ndim=ndim, kind="float",
                       device=self.key_proj.weight.device, shape=shape)
        if hidden_states.dtype != self.key_proj.weight.dtype:
            raise TypeError(f"hidden_states: expected the layer's dtype {self.key_proj.weight.dtype}, "
                            f"got {hidden_states.dtype}")

    @property
    def table(self) -> Table:
        """The n-gram table, ``ple_embedding.ngram_embedding`` (a ``ple.table.Table``)."""
        return self.ple_embedding.ngram_embedding

    def embed(self, ids: torch.Tensor, dtype: torch.dtype, *, validate: bool = True) -> torch.Tensor:
        """Rows of the table for hash ids ``[T, NH]``, concatenated: ``[T, E]`` in ``dtype`` (``Table.rows``).

        ``forward`` and ``step`` pass ``validate=False``: their ids come from the layer's own
        hash, whose rows lie in the table by construction, so the range check (a host sync)
        is skipped.
        """
        return self.table.rows(ids, dtype, ops=self.ops, validate=validate)

    def hashed_rows(self, input_ids: torch.Tensor, dtype: torch.dtype, *, query_start_loc: torch.Tensor,
                    ngram_context: torch.Tensor | None = None, validate: bool = True) -> torch.Tensor:
        """The table rows of ``[T]`` tokens' n-grams, ``[T, E]`` in ``dtype``: `ngram_ids` then `embed`.

        With a plain dense table in the tokens' memory (not quantized, sharded, offloaded, with a
        sparse gradient, or a prefetch pending) this is the backend's ``ngram_embedding`` (on
        ``ple.fast`` one kernel: the ids are hashed and the rows gathered without writing the ids
        to memory; bit for bit the same rows); so is an NF4 table there on a backend with
        ``ngram_embedding_nf4`` (``ple.fast``: hash, gather and unpack in one kernel). Any other
        table is asked for the rows of the ids.
        """
        cfg = self.config
        kw = dict(heads_per_ngram=cfg.heads_per_ngram, eos_token_id=cfg.eos_token_id,
                  query_start_loc=query_start_loc, ngram_context=ngram_context)
        t = self.table
        here = t.pending_prefetch is None and not t.is_dtensor and t.weight.device == input_ids.device
        if here and type(t) is DenseTable and not t.sparse_grad and t.row_optimizer is None:
            return self.ops.ngram_embedding(t.weight, input_ids, self.ple_embedding.hash_params(), **kw,
                                            validate=validate).to(dtype)
        fused_nf4 = getattr(self.ops, "ngram_embedding_nf4", None)
        if here and type(t) is QuantizedTable and t.weight.dtype == torch.uint8 and fused_nf4 is not None:
            return fused_nf4(t.weight, input_ids, self.ple_embedding.hash_params(), dtype=dtype, **kw,
                             validate=validate)
        ids = self.ops.ngram_ids(input_ids, self.ple_embedding.hash_params(), **kw, validate=validate)
        return self.embed(ids, dtype, validate=False)                  # ids of our own hash

    def start_prefetch(self, input_ids: torch.Tensor, query_start_loc: torch.Tensor | None = None,
                       ngram_context: torch.Tensor | None = None) -> None:
        """Hash the next step's tokens and start fetching their table rows (``ple.offload``).

        Takes the arguments of ``ngram_ids`` (a step's ``batch.input_ids``,
        ``batch.query_start_loc``, ``batch.ngram_context``). On CUDA the gather and the
        copy to the device run in the background while the preceding layer runs;
        without CUDA they run now. The next `forward` / `step` whose ids match uses them
        (``layer.table.prefetch_verify = False`` compares shapes only, saving a device sync).
        """
        _start_prefetch(self, input_ids, query_start_loc, ngram_context)

    def project(self, embeddings: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """``[T, E]`` embeddings -> ``(key [T, C], value [T, H])``.

        By default (``ple.reference``, ``ple.vectorized``) the model's two GEMMs (``key_proj``, then
        ``value_proj``), so the bits are the model's. An op module that declares
        ``FUSED_KV_PROJECTION`` (``ple.fast``, see ``ple.backends.traits``) gets one GEMM over the
        concatenated ``[C + H, E]`` weight (`kv_weight`) and two column views of its ``[T, C + H]``
        result (its gate reads them through their strides): the embeddings are read once and
        one GEMM is launched instead of two.
        """
        kb, vb = self.key_proj.bias, self.value_proj.bias                 # the Engram family's; else None
        if not traits(self.ops).fused_kv_projection:
            return F.linear(embeddings, self.key_proj.weight, kb), F.linear(embeddings, self.value_proj.weight, vb)
        bias = None if kb is None or vb is None else torch.cat([kb, vb])
        kv = F.linear(embeddings, self.kv_weight(), bias)           # [T, C + H], key columns first
        C = self.config.hc_hidden_size
        return kv[:, :C], kv[:, C:]

    def kv_weight(self) -> torch.Tensor:
        """``cat([key_proj.weight, value_proj.weight])``, ``[C + H, E]`` (key rows first).

        The parameters keep their names (``state_dict`` is unchanged; an Engram-family layer's speaks the demo's
        keys, `ENGRAM_KEYS`). Where autograd records
        (a weight requires grad and grad mode is on) or under ``torch.compile`` the
        concatenation is made in the graph on every call; otherwise it is cached and rebuilt
        only when either weight's storage or version counter changes (``load_state_dict``,
        ``.to()``, an optimizer step), at the cost of one more copy of the two weights. A CUDA
        graph (``ple.state.graphs``) captured after the cache was built reads that copy: capture
        again after changing the weights.
        """
        wk, wv = self.key_proj.weight, self.value_proj.weight
        if torch.compiler.is_compiling() or (torch.is_grad_enabled() and (wk.requires_grad or wv.requires_grad)):
            return torch.cat([wk, wv])
        key = (wk.data_ptr(), wk._version, wk.dtype, wk.device, wv.data_ptr(), wv._version)
        cached = getattr(self, "_kv_cache", None)
        if cached is None or cached[0] != key:
            cached = (key, torch.cat([wk.detach(), wv.detach()]))
            self._kv_cache = cached
        return cached[1]

    def gate(self, embeddings: torch.Tensor, hidden_states: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Project ``[T, E]`` embeddings to key and value (`project`) and gate them: ``(gated, conv_input)``."""
        key, value = self.project(embeddings)
        return self.ops.ple_gate(key, value, hidden_states, *self.norm_weights, self.config.gate_eps(key.dtype),
                                 **self.config.gate_options())

    @property
    def norm_weights(self) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """``(norm_key.weight, norm_query.weight, norm_conv.weight)``, the gate ops' three norm weights. Their eps
        is ``config.gate_eps(dtype)`` and the family's form ``config.gate_options()`` (``ple.config``)."""
        return self.norm_key.weight, self.norm_query.weight, self.norm_conv.weight

    @property
    def conv_weights(self) -> torch.Tensor:
        """``conv1d.weight`` as the ``[C, K]`` the functional ops take."""
        return self.conv1d.weight[:, 0, :]

    # ---- whole sequences -----------------------------------------------------------------------
    def forward(self, hidden_states: torch.Tensor, input_ids: torch.Tensor,
                attention_mask: torch.Tensor | None = None, *,
                return_intermediates: bool = False) -> torch.Tensor | Intermediates:
        """``[B, L, C]`` hidden states and ``[B, L]`` token ids -> ``[B, L, C]``.

        ``return_intermediates=True`` returns an `Intermediates` instead (n-gram ids, embeddings,
        key, value, per-stream scores and gates, gated, conv input, conv term and the output), for
        exploring the layer; the output is the same.

        Every row is a whole sequence from its start. ``input_ids`` is int32 or int64;
        ``attention_mask`` is bool, integer or float (non-zero keeps). Where it is 0 the
        token hashes as EOS (the Engram family: as its ``pad_id``) and its gated value and conv input are
        zeroed before the convolution (so left or right padding does not leak into real tokens).

        An Engram-family layer returns ``hidden_states + engram(hidden_states.view(B, L, M, H),
        input_ids).view(B, L, C)``, the demo's block.

        On every backend the gate, the mask, the conv and both adds are one op, ``ple_prefill``
        (``ple.fast`` runs it as one kernel); with ``return_intermediates`` they run op by op
        (``ple_gate``, the mask, ``dilated_causal_conv``, the adds) so each value can be returned.

        The token range of ``input_ids`` is a read of their values: eager calls always check it;
        under ``torch.compile`` only backends that check inside a registered op
        (``CHECKS_VALUES_WHEN_COMPILED``: ``ple.fast``) do, so the graph has no break.
        """
        self._check_hidden(hidden_states, 3)
        B, L, C = hidden_states.shape  # batch, length, channels (hc_count * hidden_size)
        dev = hidden_states.device
        _checks.tensor("input_ids", input_ids, kind="int", device=dev, shape=(B, L))
        eos = self.config.eos_token_id
        keep = None
        if attention_mask is not None:
            _checks.tensor("attention_mask", attention_mask, device=dev, shape=(B, L))
            if attention_mask.dtype.is_complex:
                raise TypeError(f"attention_mask: expected a bool, integer or float tensor, got "
                                f"{attention_mask.dtype}")
            keep = attention_mask != 0                            # non-zero keeps, as in transformers
            input_ids = torch.where(keep, input_ids, torch.full_like(input_ids, eos))
        query_start_loc = torch.arange(B + 1, device=dev, dtype=torch.int64) * L
        check_values = traits(self.ops).checks_values_when_compiled or not torch.compiler.is_compiling()
        flat = hidden_states.reshape(B * L, C)
        if not return_intermediates:
            emb = self.hashed_rows(input_ids.reshape(B * L), hidden_states.dtype, query_start_loc=query_start_loc,
                                   validate=check_values)
            key, value = self.project(emb)
            out = self.ops.ple_prefill(key, value, flat, *self.norm_weights, self.config.gate_eps(flat.dtype),
                                       self.conv_weights, dilation=self.config.conv_dilation,
                                       query_start_loc=query_start_loc,
                                       keep=None if keep is None else keep.reshape(B * L), validate=False,
                                       **self.config.gate_options())
            return out.reshape(B, L, C)
        ids = self.ops.ngram_ids(input_ids.reshape(B * L), self.ple_embedding.hash_params(),
                                 heads_per_ngram=self.config.heads_per_ngram, eos_token_id=eos,
                                 query_start_loc=query_start_loc, validate=check_values)
        emb = self.embed(ids, hidden_states.dtype, validate=False)   # [B*L, E]; ids of our own hash
        key, value = self.project(emb)
        gated, conv_input = self.ops.ple_gate(key, value, flat, *self.norm_weights, self.config.gate_eps(flat.dtype),
                                              **self.config.gate_options())
        if keep is not None:
            mask = keep.reshape(B * L, 1).to(gated.dtype)
            gated, conv_input = gated * mask, conv_input * mask
        y = self.ops.dilated_causal_conv(conv_input.reshape(B, L, C), self.conv_weights,
                                          dilation=self.config.conv_dilation)
        out = (gated.reshape(B, L, C) + y) + hidden_states
        from .reference.gate import stream_scores
        cfg = self.config
        scores, gates = stream_scores(key, hidden_states.reshape(B * L, C), self.norm_key.weight,
                                      self.norm_query.weight, cfg.hidden_size, cfg.gate_eps(key.dtype),
                                      unit_offset=cfg.family != "engram")
        rows = lambda t: t.reshape(B, L, *t.shape[1:])  # noqa: E731
        return Intermediates(rows(ids), rows(emb), rows(key), rows(value), rows(scores), rows(gates), rows(gated),
                             rows(conv_input), y, out)

    # ---- serving -------------------------------------------------------------------------------
    def step(self, hidden_states: torch.Tensor, batch: StepBatch, cache: PLECache) -> torch.Tensor:
        """One serving step: ``[T, C]`` rows of ``batch`` (from ``cache.schedule``) -> ``[T, C]``.

        See ``ple.state`` for the cache; the outputs equal ``forward`` over each
        request's whole accepted sequence. The step itself is ``ple.state.step.layer_step``, reached
        through the cache (``cache.run_layer_step``), so this module does not import ``ple.state``.
        """
        run = getattr(cache, "run_layer_step", None)
        if not callable(run):
            raise TypeError(f"cache: expected a ple.state.PLECache, got {type(cache).__name__}")
        return run(self, hidden_states, batch)

    def __enter__(self) -> PLELayer:
        return self

    def __exit__(self, exc_type: object, exc: object, tb: object) -> None:
        """The end of ``with layer:`` (``with ple.io.load_layer(...) as layer:``) is the table's: a table on
        disk is closed, an overlay flushed first unless the block raised (``ple.io.disk_table.training``); a table in
        memory has nothing to release, and the layer stays usable."""
        leave = getattr(self.table, "__exit__", None)
        if leave is not None:
            leave(exc_type, exc, tb)

    def extra_repr(self) -> str:
        c = self.config
        return (f"ple_layer_index={self.ple_layer_index}, backend={self.backend!r}, C={c.hc_hidden_size}, "
                f"E={c.ple_embed_dim}, NH={c.num_ngram_heads}, K={c.ple_conv_kernel_size}, d={c.conv_dilation}")
