"""What several test files share, in one place (``tests/`` is on ``sys.path``: ``pythonpath`` in pyproject.toml).

Fixtures are in ``tests/conftest.py`` (``poisoned_empty``, ``deterministic_mode``); the tensors of kernel
cases (random rows, index tensors, conv states in every layout, slots and token_indices) in the kit,
``ple.testing.kit.cases``. Here: deterministic mode as a context manager, "nothing changed" snapshots of a
cache or of an op's arguments, layers with every parameter random, the hash parameters of the tiny preset,
a small valid call of every op (`valid_op_calls`),
a planted mistake the kit must catch, serving replays compared, one process's answer over a packed batch, each
rank serving its own requests and a module's checks spawned once per world size (the gloo tests), tables off
the device (prefetched forwards and lookups, which NF4 unpacker a lookup calls), and the hash in plain Python
(``py_*``: docs/spec.md sections 2-3 in loops and Python ints, the oracle of the hashing and n-gram statistics tests).
"""

from __future__ import annotations

import contextlib
import copy
from collections.abc import Iterator, Sequence

import pytest
import torch

import ple
from ple.testing.numerics import assert_bitwise_equal


@contextlib.contextmanager
def deterministic_algorithms(enabled: bool = True, *, warn_only: bool = False) -> Iterator[None]:
    """``torch.use_deterministic_algorithms(enabled, warn_only=warn_only)`` inside, the previous mode after."""
    was = torch.are_deterministic_algorithms_enabled()
    was_warn_only = torch.is_deterministic_algorithms_warn_only_enabled()
    torch.use_deterministic_algorithms(enabled, warn_only=warn_only)
    try:
        yield
    finally:
        torch.use_deterministic_algorithms(was, warn_only=was_warn_only)


# ---- nothing changed -----------------------------------------------------------------------------------
def cache_snapshot(cache) -> tuple:
    """A ``PLECache``'s states, slot bookkeeping and version, copied."""
    return cache.conv_states.clone(), copy.deepcopy(cache._slots), cache._version


def assert_cache_unchanged(cache, snap: tuple) -> None:
    """The cache holds what `cache_snapshot` copied: states bit for bit, the same slots and version."""
    states, slots, version = snap
    assert_bitwise_equal(cache.conv_states, states, name="conv_states")
    assert cache._slots == slots
    assert cache._version == version


def args_snapshot(args: dict) -> dict:
    """Copies of every tensor argument of an op call and of the base of its conv state."""
    out = {k: v.clone() for k, v in args.items() if isinstance(v, torch.Tensor) and v.device.type != "meta"}
    state = args.get("conv_state")
    if isinstance(state, torch.Tensor) and state._base is not None:
        out["conv_state._base"] = state._base.clone()
    return out


def assert_args_unchanged(args: dict, before: dict) -> None:
    """Every tensor `args_snapshot` copied is as it was, bit for bit."""
    for k, v in before.items():
        now = args["conv_state"]._base if k == "conv_state._base" else args[k]
        assert_bitwise_equal(now, v, name=k)


# ---- layers and inputs ---------------------------------------------------------------------------------
def nonzero_layers(config: ple.PLEConfig, num_layers: int = 1, *, seed: int = 0, dtype: torch.dtype = torch.float64,
                   draw_dtype: torch.dtype = torch.float64, **kwargs) -> list[ple.PLELayer]:
    """Layers 0 .. num_layers - 1 with every parameter non-zero (norms and conv too, which the model starts at
    zero), so each part of the layer shows in the output: normal draws in ``draw_dtype`` from one generator,
    in ``dtype``, times 0.5; the same in every process. ``kwargs`` go to `PLELayer` (``backend``, ...)."""
    g = torch.Generator().manual_seed(seed)
    layers = []
    for i in range(num_layers):
        layer = ple.PLELayer(config, i, dtype=dtype, **kwargs)
        with torch.no_grad():
            for p in layer.parameters():
                p.copy_(torch.randn(p.shape, generator=g, dtype=draw_dtype).to(dtype) * 0.5)
        layers.append(layer)
    return layers


def tiny_hash_setup() -> tuple:
    """(the hash parameters of the tiny preset's PLE layer 0, the keywords ``ngram_ids`` takes with them)."""
    config = ple.PLEConfig.preset("tiny")
    return ple.reference.hash_params(config, 0), dict(heads_per_ngram=config.heads_per_ngram,
                                                       eos_token_id=config.eos_token_id)


def valid_op_calls() -> list[tuple[str, tuple, dict]]:
    """(op, args, kwargs) of a small valid call of every op of ``ple.backends.OP_NAMES`` (and of a serving prefill:
    ``"serving ple_prefill"``), fresh tensors each time; the tensors are shared between the calls."""
    g = torch.Generator().manual_seed(0)
    T, C, H, K, d = 8, 6, 3, 3, 2
    S = (K - 1) * d
    tiny = ple.PLEConfig.preset("tiny")
    params = ple.reference.hash_params(tiny, tiny.ple_layer_ids[0])
    ids = torch.tensor([5, 2, 9, 9, 4, 2, 7, 7])
    query_start_loc = torch.tensor([0, 3, 8])
    ngram_kw = dict(heads_per_ngram=tiny.heads_per_ngram, eos_token_id=tiny.eos_token_id,
                    query_start_loc=query_start_loc, ngram_context=torch.tensor([[1, 2], [3, 4]]))
    table = torch.randn(params.num_rows, 2, generator=g)
    gate = [torch.randn(s, generator=g) for s in ((T, C), (T, H), (T, C), (C,), (C,), (C,))] + [1e-6]
    conv_weights = torch.randn(C, K, generator=g)
    conv_state = torch.randn(4, C, S, generator=g)
    rows = torch.randn(T, C, generator=g)
    serving = dict(dilation=d, query_start_loc=query_start_loc, conv_state=conv_state,
                   state_indices=torch.tensor([2, 1]), has_initial_states=torch.tensor([True, False]))
    return [
        ("ngram_ids", (ids, params), ngram_kw),
        ("ngram_embedding", (table, ids, params), ngram_kw),
        ("embedding_lookup", (table, torch.tensor([[0, 3], [1, 2]])), {}),
        ("ple_gate", tuple(gate), {}),
        ("ple_conv", (rows, rows.clone(), conv_state, conv_weights, torch.tensor([3, 1])),
         dict(mode="prefill", dilation=d, query_start_loc=query_start_loc)),
        ("export_conv_checkpoints", (rows, conv_state),
         dict(query_start_loc=query_start_loc, offsets=torch.tensor([0, S]), slots=torch.tensor([0, 2]), state_len=S)),
        ("dilated_causal_conv", (rows, conv_weights), dict(dilation=d, cu_seqlens=query_start_loc)),
        ("ple_prefill", (*gate, conv_weights), dict(dilation=d, query_start_loc=query_start_loc)),
        ("serving ple_prefill", (*gate, conv_weights), serving),
    ]


def packed_reference(full: ple.PLELayer, starts: Sequence[int], eos_at: int, seed: int = 6) -> dict:
    """A packed float64 batch of sequences ``starts`` (one EOS at row ``eos_at``) and one process's answer:
    ``ids``, ``hidden``, ``probe`` (the loss is ``(out * probe).sum()``), ``ref`` (every sequence through
    ``full``'s forward, concatenated) and ``h``, the hidden states it ran on, whose ``grad`` (like ``full``'s
    parameters') holds the loss's gradient."""
    config = full.config
    T = starts[-1]
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, config.vocab_size, (T,), generator=g)
    ids[eos_at] = config.eos_token_id
    hidden = torch.randn(T, config.hc_hidden_size, generator=g, dtype=torch.float64)
    probe = torch.randn(T, config.hc_hidden_size, generator=g, dtype=torch.float64)
    h = hidden.clone().requires_grad_(True)
    ref = torch.cat([full(h[a:b][None], ids[a:b][None])[0] for a, b in zip(starts, starts[1:]) if b > a])
    (ref * probe).sum().backward()
    return dict(ids=ids, hidden=hidden, probe=probe, ref=ref, h=h)


def own_requests_served(layer: ple.PLELayer, full: ple.PLELayer, rank: int, world_size: int,
                        dtype: torch.dtype) -> Iterator[tuple[int | None, torch.Tensor, torch.Tensor]]:
    """Rank ``rank`` serves requests of its own (two, prompts by rank) from its own ``dtype`` caches, one for the
    sharded ``layer`` (per-rank tokens) and one for the whole ``full``: three steps (prefills; a decode and a
    spec, of which one token is kept; a decode), in which the last rank idles in step 1 and joins the lookup
    (``join_table_lookup``). Yields, as it goes (without autograd), ``(k, sharded, whole)``: the outputs of each
    step k with tokens, then ``(None, sharded, whole)``: the caches' conv states."""
    from ple.distributed import join_table_lookup
    from ple.state import PLECache
    from ple.testing.serving import step_each

    # a list of steps, each a list of (kind, request, tokens)
    script = [[("prefill", 0, [5 + rank, 6, 7, 8, 9][: 2 + rank % 3]), ("prefill", 1, [9, 2, 11 + rank])],
              [] if rank == world_size - 1 else [("decode", 0, 12), ("spec", 1, [13, 14])],
              [("decode", 0, 15 + rank)]]
    caches = [PLECache(full.config, num_slots=4, num_spec_tokens=2, num_layers=1, dtype=dtype)
              for _ in range(2)]                                          # [sharded layer, whole layer]
    slots = [[c.allocate(), c.allocate()] for c in caches]
    g = torch.Generator().manual_seed(40 + rank)
    with torch.no_grad():
        for k, step in enumerate(script):
            if not step:
                join_table_lookup(layer)
                continue
            outs = step_each((layer, full), caches, slots, step, generator=g, dtype=dtype)
            yield k, outs[0], outs[1]
            for c, s in zip(caches, slots, strict=True):
                if any(kind == "spec" for kind, _, _ in step):
                    c.accept(s[1], 1)
        yield None, caches[0].conv_state(0), caches[1].conv_state(0)


def _run_every_check(rank: int, world_size: int, checks: dict, *args) -> dict:
    from ple.testing import spawned

    return spawned.run_checks(checks, list(checks), rank, world_size, *args)


class SpawnedChecks:
    """A test module's checks run on every rank of a gloo group: ``check_<name>(rank, world_size, *args)``,
    module-level functions, named here by ``<name>`` (iterating gives the names, in order). Each world size
    is spawned once, at its first `report`, and runs every check (``ple.testing.spawned.run_checks``);
    `report` fails the test of one check with each failing rank's report."""

    def __init__(self, *checks, timeout: float, pg_timeout: float) -> None:
        self.checks = {f.__name__.removeprefix("check_"): f for f in checks}
        self.timeout, self.pg_timeout = timeout, pg_timeout
        self._failures: dict[int, dict[str, list]] = {}

    def __iter__(self) -> Iterator[str]:
        return iter(self.checks)

    def report(self, world_size: int, name: str, *args) -> None:
        """Fail unless check ``name`` passed on every rank of the group of ``world_size`` (``args``: the checks')."""
        from ple.distributed import spawn

        if world_size not in self._failures:
            per_rank = spawn(_run_every_check, world_size, self.checks, *args, timeout=self.timeout,
                             pg_timeout=self.pg_timeout)
            self._failures[world_size] = {n: [(r, res[n]) for r, res in enumerate(per_rank) if res[n] is not None]
                                          for n in self.checks}
        failures = self._failures[world_size][name]
        if failures:
            pytest.fail("\n".join(f"rank {r}:\n{tb}" for r, tb in failures), pytrace=False)


# ---- the kit -------------------------------------------------------------------------------------------
def assert_planted_mistake_caught(check, fn, kw: dict, words: Sequence[str], max_examples: int) -> None:
    """``check(fn, max_examples=..., **kw)`` raises ``AssertionError`` and its message names every one of ``words``."""
    with pytest.raises(AssertionError) as e:
        check(fn, max_examples=max_examples, **kw)
    msg = str(e.value)
    for w in words:
        assert w in msg, msg


def assert_same_serving(layer_sets: Sequence, script: Sequence, *, seed: int, num_spec_tokens: int = 2) -> None:
    """Replay ``script`` (``ple.testing.strategies.random_script``) through each set of layers, each on a new
    bfloat16 cache of 4 slots, with every warning an error (a prefetch left unused warns): the same tokens
    and every output bit for bit equal to the first set's."""
    import warnings

    from ple.state import PLECache
    from ple.testing.serving import replay

    results = []
    for layers in layer_sets:
        cache = PLECache(layers[0].config, 4, num_spec_tokens=num_spec_tokens, num_layers=len(layers),
                         dtype=torch.bfloat16)
        with warnings.catch_warnings():
            warnings.simplefilter("error")
            results.append(replay(layers, cache, script, generator=torch.Generator().manual_seed(seed),
                                  check_states=False))
    first = results[0]
    for other in results[1:]:
        assert other.tokens == first.tokens
        for rid in first.outputs:
            for x, y in zip(first.outputs[rid], other.outputs[rid], strict=True):
                assert_bitwise_equal(y, x, name=f"request {rid} output")


# ---- tables off the device: prefetches, unpackers -------------------------------------------------------
def with_prefetch(layer):
    """Make ``layer.step`` prefetch its own tokens first, as a serving engine would."""
    step = layer.step

    def prefetching_step(h, batch, cache):
        layer.start_prefetch(batch.input_ids, batch.query_start_loc, batch.ngram_context)
        assert layer.table.pending_prefetch is not None
        out = step(h, batch, cache)
        assert layer.table.pending_prefetch is None                        # consumed
        return out

    layer.step = prefetching_step
    return layer


def assert_prefetched_forward(layer, ref, h: torch.Tensor, tokens: torch.Tensor, *, name: str) -> None:
    """``layer``'s forward over ``tokens`` (``[B, L]``, one sequence a row) after a prefetch of them equals
    ``ref``'s bit for bit; the prefetch is pending until the forward takes it (one not used would warn: an
    error here)."""
    import warnings

    layer.start_prefetch(tokens.reshape(-1), torch.arange(tokens.shape[0] + 1) * tokens.shape[1])
    assert layer.table.pending_prefetch is not None
    with warnings.catch_warnings():
        warnings.simplefilter("error")                                     # a prefetch not used would warn
        assert_bitwise_equal(layer(h, tokens), ref(h, tokens), name=name)
    assert layer.table.pending_prefetch is None


def assert_cuda_lookups(ref, layer, ids_on: str) -> torch.Tensor:
    """Three rounds of 40 tokens (requests of 7, 0 and 33) on ``ref``'s GPU: ``layer``'s rows, with the tokens
    prefetched (from ``ids_on``) and without, equal the all-GPU ``ref``'s bit for bit. Returns the last ids."""
    dev = torch.device("cuda")
    config = ref.config
    gen = torch.Generator().manual_seed(8)
    for _ in range(3):
        tokens = torch.randint(0, config.vocab_size, (40,), generator=gen)
        qsl = torch.tensor([0, 7, 7, 40])
        ids = ref.ops.ngram_ids(tokens.to(dev), ref.ple_embedding.hash_params(),
                                heads_per_ngram=config.heads_per_ngram, eos_token_id=config.eos_token_id,
                                query_start_loc=qsl.to(dev))
        expected = ref.embed(ids, torch.bfloat16)
        layer.start_prefetch(tokens.to(ids_on), qsl.to(ids_on))
        assert_bitwise_equal(layer.embed(ids, torch.bfloat16), expected, name="prefetched rows")
        assert_bitwise_equal(layer.embed(ids, torch.bfloat16), expected, name="lookup without prefetch")
    return ids


def unpacker_calls(monkeypatch) -> list[str]:
    """The NF4 unpackers lookups call from now on, one entry a call: ``"reference"``
    (``ple.reference.nf4_dequantize_rows``, the readable one) or ``"vectorised"`` (``ple.quant``'s, as
    ``ple.table`` calls it)."""
    import ple.quant
    import ple.reference
    import ple.table

    calls = []

    def spy(name, fn):
        def record(*args, **kwargs):
            calls.append(name)
            return fn(*args, **kwargs)
        return record

    monkeypatch.setattr(ple.reference, "nf4_dequantize_rows", spy("reference", ple.reference.nf4_dequantize_rows))
    monkeypatch.setattr(ple.table, "dequantize_rows", spy("vectorised", ple.quant.dequantize_rows))
    return calls


# ---- the hash in plain Python: an independent statement of docs/spec.md sections 2 and 3 -------------------
# Loops and Python ints, no torch: the oracle of tests/reference/test_hashing.py and tests/analysis/test_stats.py.
def py_splitmix64(x: int) -> int:
    z = (x + 0x9E3779B97F4A7C15) % 2**64
    z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) % 2**64
    z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) % 2**64
    return z ^ (z >> 31)


def py_multipliers(V: int, N: int, seed: int, L: int) -> list[int]:
    half = max(1, ((2**63 - 1) // max(V, 1)) // 2)
    base = seed + 10007 * L
    return [2 * (py_splitmix64((base + 0x9E3779B97F4A7C15 * (i + 1)) % 2**64) % half) + 1 for i in range(N)]


def py_is_prime(n: int) -> bool:
    if n < 2:
        return False
    f = 2
    while f * f <= n:
        if n % f == 0:
            return False
        f += 1
    return True


def py_head_sizes(base: int, NH: int, L: int) -> list[int]:
    primes, n = [], base
    while len(primes) < (L + 1) * NH:
        if py_is_prime(n):
            primes.append(n)
        n += 1
    return primes[L * NH :]


def py_windows(tokens: list[int], ctx: list[int], N: int, eos: int) -> list[list[int]]:
    """``w[0..N-1]`` (newest first) of every token of ``tokens``, read literally from docs/spec.md section 3."""
    full = list(ctx) + list(tokens)
    out = []
    for p in range(len(ctx), len(full)):
        w = [full[p]]
        reached_eos = False
        for k in range(1, N):
            tok = full[p - k] if p - k >= 0 else eos
            w.append(eos if reached_eos else tok)
            if tok == eos:
                reached_eos = True
        out.append(w)
    return out


def py_rows(window: list[int], mult: list[int], sizes: list[int], P: int) -> list[int]:
    """The NH table rows of one window."""
    offsets = [sum(sizes[:h]) for h in range(len(sizes))]
    rows = []
    for n in range(2, len(mult) + 1):
        mix = 0
        for k in range(n):
            mix ^= window[k] * mult[k]
        for j in range(P):
            h = (n - 2) * P + j
            rows.append(mix % sizes[h] + offsets[h])
    return rows


def reads_not_counted(monkeypatch, mode, most_rows: int, what: str) -> None:
    """Patch the disk table's positional reads (``ple.io.disk_table._reads.pread_rows``, as
    ``ple.io.disk_table.table`` calls it) so that ``mode``, a dispatch mode that records the largest tensor made and
    skips ops while its ``paused`` is True, does not count their scratch buffer: it holds the pages of a gather's
    coalesced runs, a page or two a row read (at a tiny table, runs span the whole file), a cost of the rows read,
    not of the table. Each read must be of at most ``most_rows`` rows (``what`` says which rows those are, in the
    failure)."""
    import ple.io.disk_table._reads as reads
    import ple.io.disk_table.table as disk

    real = reads.pread_rows

    def read(files, file_of, offsets, *args, **kwargs):
        assert offsets.numel() <= most_rows, f"a positional read of {offsets.numel()} rows: more than {what}"
        mode.paused = True
        try:
            return real(files, file_of, offsets, *args, **kwargs)
        finally:
            mode.paused = False
    monkeypatch.setattr(reads, "pread_rows", read)
    monkeypatch.setattr(disk, "pread_rows", read)


def random_entries(data, dtypes: Sequence[torch.dtype], max_dim: int) -> tuple[dict[str, torch.Tensor], list]:
    """Up to 5 tensors of random dtypes (of ``dtypes``) and shapes (up to 3 dims of ``0..max_dim``), each as a
    writer ``Entry`` producing it in blocks of a drawn size (Hypothesis ``data``): ``(tensors, entries)``."""
    from hypothesis import strategies as st

    from ple.io.writer import Entry

    gen = torch.Generator().manual_seed(data.draw(st.integers(0, 2**31 - 1)))
    tensors, entries = {}, []
    for i in range(data.draw(st.integers(1, 5))):
        dt = data.draw(st.sampled_from(dtypes))
        shape = tuple(data.draw(st.lists(st.integers(0, max_dim), max_size=3)))
        t = (torch.randn(shape, generator=gen) * 4).to(dt)
        blocks = [t] if t.dim() == 0 else list(torch.split(t, data.draw(st.integers(1, 4)))) or [t]
        tensors[f"t{i}"] = t
        entries.append(Entry(f"t{i}", dt, shape, lambda b=blocks: iter(b)))
    return tensors, entries
