"""Public Hypothesis strategies for testing PLE kernels and serving code.

Use them to test your own kernels against ``ple.reference``::

    from hypothesis import given
    from ple.testing import strategies as pst

    @given(pst.configs(), pst.seeds())
    def test_my_gate(config, seed): ...

    @given(pst.configs().flatmap(lambda c: pst.varlen_batches(c).map(lambda b: (c, b))))
    def test_my_ngram_ids(config_and_batch): ...

* `configs` draws small `PLEConfig`s with odd sizes (channels rarely a power of two),
  small vocabularies (so hash collisions and EOS tokens are common) and K 1..5, N 2..4.
* `varlen_batches(config)` draws a `VarlenBatch`: tokens of R requests laid end to
  end with ``query_start_loc`` and each request's ``ngram_context``; empty and
  one-token requests included; EOS-heavy token streams.
* `serving_scripts(config)` draws request traffic for `ple.testing.serving.replay`:
  arrivals, chunked prefills, decodes, spec steps with random acceptance, appends
  after spec, and slot reuse.
* `seeds` draws a seed for a ``torch.Generator`` (tensor values come from it, so a
  failing example is reproduced by its seed, which Hypothesis prints).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch
from hypothesis import strategies as st

from ..config import PLEConfig
from .serving import Action, random_script

__all__ = ["configs", "varlen_batches", "VarlenBatch", "serving_scripts", "seeds", "token_streams"]


def seeds() -> st.SearchStrategy[int]:
    return st.integers(0, 2**31 - 1)


@st.composite
def configs(draw: st.DrawFn, *, max_hidden: int = 9, max_hc: int = 3, kernel_sizes: Sequence[int] = (1, 2, 3, 4, 5),
            ngram_sizes: Sequence[int] = (2, 3, 4), max_heads_per_ngram: int = 3, max_vocab: int = 64,
            families: Sequence[str] = ("qwen4exp",)) -> PLEConfig:
    """Small, odd-sized `PLEConfig`s of the ``families`` asked for (``"qwen4exp"``, ``"engram"``).

    An Engram config has two layers with 0-based ids, a random pad, head sizes from small starts and,
    half the time, a random ``token_map`` onto fewer ids (so distinct tokens hash alike)."""
    N = draw(st.sampled_from(ngram_sizes))
    P = draw(st.integers(1, max_heads_per_ngram))
    D = draw(st.integers(1, 3))
    V = draw(st.integers(4, max_vocab))
    family = draw(st.sampled_from(list(families)))
    if family == "engram":
        lo = draw(st.integers(0, 20))
        token_map = None
        if draw(st.booleans()):
            V2 = draw(st.integers(2, V))
            token_map = draw(st.lists(st.integers(0, V2 - 1), min_size=V, max_size=V))
        return PLEConfig.engram(
            vocab_size=V, hidden_size=draw(st.integers(1, max_hidden)), hc_count=draw(st.integers(1, max_hc)),
            engram_vocab_size=draw(st.lists(st.integers(2, 200), min_size=N - 1, max_size=N - 1)),
            max_ngram_size=N, n_embed_per_ngram=P * D, n_head_per_ngram=P,
            layer_ids=(lo, lo + draw(st.integers(1, 12))), pad_id=draw(st.integers(0, V - 1)),
            seed=draw(st.integers(0, 2**32)), kernel_size=draw(st.sampled_from(kernel_sizes)),
            token_map=token_map)
    return PLEConfig(
        vocab_size=V,
        hidden_size=draw(st.integers(1, max_hidden)),
        hc_count=draw(st.integers(1, max_hc)),
        ple_embed_dim=(N - 1) * P * D,
        ple_conv_kernel_size=draw(st.sampled_from(kernel_sizes)),
        ngram_size=N,
        heads_per_ngram=P,
        ngram_vocab_size_base=draw(st.integers(2, 200)),
        make_ngram_vocab_size_divisible_by=draw(st.sampled_from([1, 8, 16])),
        seed=draw(st.integers(0, 2**32)),
        eos_token_id=draw(st.integers(0, V - 1)),
        ple_layer_ids=(1, 2),
    )


def token_streams(config: PLEConfig, *, min_size: int = 0, max_size: int = 24,
                  eos_rate: float = 0.2) -> st.SearchStrategy[list[int]]:
    """Token ids in ``[0, vocab_size)`` with EOS drawn about ``eos_rate`` of the time."""
    token = st.one_of(st.just(config.eos_token_id), st.integers(0, config.vocab_size - 1)) \
        if eos_rate > 0 else st.integers(0, config.vocab_size - 1)
    return st.lists(token, min_size=min_size, max_size=max_size)


@dataclass(frozen=True)
class VarlenBatch:
    """R requests laid end to end."""

    input_ids: torch.Tensor         # [T] int64
    query_start_loc: torch.Tensor   # [R+1]
    ngram_context: torch.Tensor     # [R, N-1] int64
    lengths: tuple

    @property
    def num_requests(self) -> int:
        return len(self.lengths)


@st.composite
def varlen_batches(draw: st.DrawFn, config: PLEConfig, *, max_requests: int = 4, max_len: int = 12,
                   index_dtype: torch.dtype | None = None) -> VarlenBatch:
    """A varlen batch for ``config``: empty and one-token requests included, contexts with EOS."""
    R = draw(st.integers(1, max_requests))
    seqs = [draw(token_streams(config, max_size=max_len)) for _ in range(R)]
    ctx = [draw(token_streams(config, min_size=config.context_len, max_size=config.context_len))
           for _ in range(R)]
    idx = index_dtype or draw(st.sampled_from([torch.int32, torch.int64]))
    query_start_loc_list = [0]
    for s in seqs:
        query_start_loc_list.append(query_start_loc_list[-1] + len(s))
    return VarlenBatch(
        input_ids=torch.tensor([t for s in seqs for t in s], dtype=torch.int64),
        query_start_loc=torch.tensor(query_start_loc_list, dtype=idx),
        ngram_context=torch.tensor(ctx, dtype=torch.int64).reshape(R, config.context_len),
        lengths=tuple(len(s) for s in seqs),
    )


@st.composite
def serving_scripts(draw: st.DrawFn, config: PLEConfig, *, num_spec_tokens: int = 3, max_requests: int = 5,
                    max_live: int = 3, max_prompt: int = 16, max_chunk: int = 6,
                    max_generate: int = 6) -> list[list[Action]]:
    """Request traffic for `ple.testing.serving.replay` (see `random_script`)."""
    rng = draw(st.randoms(use_true_random=False))
    return random_script(rng, vocab_size=config.vocab_size, eos_token_id=config.eos_token_id,
                         num_requests=draw(st.integers(1, max_requests)), max_live=max_live,
                         max_prompt=max_prompt, max_chunk=max_chunk, max_generate=max_generate,
                         num_spec_tokens=num_spec_tokens, eos_rate=draw(st.sampled_from([0.0, 0.1, 0.4])),
                         append_rate=draw(st.sampled_from([0.0, 0.2])))
