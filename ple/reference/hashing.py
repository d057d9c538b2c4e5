"""Hash parameters and n-gram ids, in plain Python and PyTorch.

Specified in ``docs/spec.md`` (``../../docs/spec.md`` from this file), sections 2 (hash parameters) and 3
(n-gram ids).

A token's n-gram of order n is its window of the last n tokens; the window is
hashed by XOR-ing ``token * multiplier`` products and taken modulo one prime per
hash head. The config's multipliers are odd and small enough that ``token * m < 2**63`` for
every token id below ``vocab_size``; a hand-made `HashParams` may carry any multipliers, whose
products then wrap modulo ``2**64`` as int64 arithmetic does, and the floor remainder still puts
every row inside its head (the serving engine's rows for such parameters).

``ngram_ids`` is written as the specification: a loop over the requests (``query_start_loc``
read on the host), each hashed from its context and tokens as docs/spec.md section 3 says; not
sync-free (``ple.vectorized`` computes the same ids on the device for the whole batch).
"""

from __future__ import annotations

import functools

import torch

from .. import _checks
from ..config import PLEConfig
from ..params import HashParams

__all__ = ["HashParams", "hash_params", "splitmix64", "primes_from", "layer_multipliers", "ngram_ids", "ngram_windows",
           "ngrams_of_rows", "engram_multipliers", "engram_head_sizes"]

_MASK64 = (1 << 64) - 1
_GOLDEN = 0x9E3779B97F4A7C15
_LAYER_STRIDE = 10007


def splitmix64(x: int) -> int:
    """One step of SplitMix64 on an unsigned 64-bit integer (Python int in, Python int out)."""
    z = (x + _GOLDEN) & _MASK64
    z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & _MASK64
    z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & _MASK64
    return z ^ (z >> 31)


def _is_prime(n: int) -> bool:
    """Deterministic Miller-Rabin for n < 3.3e24 (these bases suffice)."""
    if n < 2:
        return False
    small = (2, 3, 5, 7, 11, 13, 17, 19, 23, 29, 31, 37, 41)
    for p in small:
        if n % p == 0:
            return n == p
    d, r = n - 1, 0
    while d % 2 == 0:
        d, r = d // 2, r + 1
    for a in small:
        x = pow(a, d, n)
        if x in (1, n - 1):
            continue
        for _ in range(r - 1):
            x = x * x % n
            if x == n - 1:
                break
        else:
            return False
    return True


@functools.lru_cache(maxsize=64)
def primes_from(start: int, count: int) -> tuple[int, ...]:
    """The first ``count`` primes ``>= start``, in increasing order."""
    out: list[int] = []
    n = start
    while len(out) < count:
        if _is_prime(n):
            out.append(n)
        n += 1
    return tuple(out)


def layer_multipliers(vocab_size: int, ngram_size: int, seed: int, ple_layer_index: int) -> list[int]:
    """The N multipliers of a layer (docs/spec.md section 2): odd, with ``token * m < 2**63`` for tokens below
    ``vocab_size``.

    ``half = max(1, ((2**63 - 1) // max(V, 1)) // 2)``, ``base = seed + 10007 * ple_layer_index`` and
    ``m[i] = 2 * (splitmix64(base + 0x9E3779B97F4A7C15 * (i + 1)) % half) + 1`` (unsigned 64-bit arithmetic).
    """
    half = max(1, ((2**63 - 1) // max(vocab_size, 1)) // 2)
    base = seed + _LAYER_STRIDE * ple_layer_index
    return [2 * (splitmix64((base + _GOLDEN * (i + 1)) & _MASK64) % half) + 1 for i in range(ngram_size)]


def engram_multipliers(token_vocab_size: int, ngram_size: int, seed: int, layer_id: int) -> list[int]:
    """The Engram family's N multipliers of decoder layer ``layer_id`` (docs/spec.md section 15):
    ``half = max(1, ((2**63 - 1) // V') // 2)``, ``r = numpy.random.default_rng(seed + 10007 * layer_id)
    .integers(0, half, size=N, dtype=int64)``, ``m = 2 * r + 1``. NumPy's generator is the definition."""
    import numpy as np

    half = max(1, ((2**63 - 1) // max(token_vocab_size, 1)) // 2)
    r = np.random.default_rng(seed + _LAYER_STRIDE * layer_id).integers(0, half, size=ngram_size, dtype=np.int64)
    return [2 * int(v) + 1 for v in r]


@functools.lru_cache(maxsize=16)
def engram_head_sizes(engram_vocab_size: tuple[int, ...], heads_per_ngram: int,
                      layer_ids: tuple[int, ...]) -> tuple[tuple[int, ...], ...]:
    """The Engram family's head sizes, one tuple of ``(N-1) * P`` primes per layer id (docs/spec.md section 15).

    A set of primes seen starts empty; for each layer id in order, each order n = 2..N, each of its P
    heads in turn: the smallest prime above ``start`` not yet seen (``start`` is ``engram_vocab_size[n-2] - 1``
    at each order's first head, then the prime just taken). Primes are distinct across orders and layers."""
    seen: set[int] = set()
    out = []
    for _ in layer_ids:
        sizes: list[int] = []
        for base in engram_vocab_size:
            start = base - 1
            for _ in range(heads_per_ngram):
                p = start + 1
                while p in seen or not _is_prime(p):
                    p += 1
                seen.add(p)
                sizes.append(p)
                start = p
        out.append(tuple(sizes))
    return tuple(out)


def hash_params(config: PLEConfig, ple_layer_index: int) -> HashParams:
    """Multipliers, head table sizes and offsets of PLE layer ``ple_layer_index`` (docs/spec.md section 2).

    Args:
        config: the model's `PLEConfig` (V, N, P, seed, ``ngram_vocab_size_base``,
            ``make_ngram_vocab_size_divisible_by``).
        ple_layer_index: the 0-based PLE index L (the layer's position in ``config.ple_layer_ids``).

    Returns:
        `HashParams`: ``multipliers`` int64 ``[N]`` (`layer_multipliers`); ``head_sizes`` int64 ``[NH]``, the
        NH consecutive primes ``>= ngram_vocab_size_base`` after the first ``L * NH`` of them;
        ``head_offsets`` int64 ``[NH]``, their running sum from 0; ``num_rows``, ``sum(head_sizes)`` rounded
        up to a multiple of ``make_ngram_vocab_size_divisible_by``; ``vocab_size`` V. The tensors are on torch's
        default device (the CPU unless changed).

        An Engram-family config (docs/spec.md section 15) gives its layer's parameters instead: decoder layer
        ``lid = config.ple_layer_ids[ple_layer_index]``, multipliers `engram_multipliers` of V' (the ids after
        ``token_map``), sizes `engram_head_sizes` (distinct primes across orders and layers), ``num_rows`` their
        sum (no padding), ``token_map`` as an int64 tensor (None without a map) and ``eos_rule`` False.

    Raises:
        TypeError: ``config`` is not a `PLEConfig`; ``ple_layer_index`` is not an int.
        ValueError: ``ple_layer_index`` is negative.

    Example::

        >>> hash_params(PLEConfig.preset("qwen4exp"), 0).multipliers.tolist()
        [23703573157769, 20109073645365, 8052911324071]
    """
    if not isinstance(config, PLEConfig):
        raise TypeError(f"config: expected a PLEConfig, got {type(config).__name__}")
    ple_layer_index = _checks.int_arg("ple_layer_index", ple_layer_index, minimum=0)   # a numpy int: a Python int
    if config.family == "engram":
        return _engram_hash_params(config, ple_layer_index)
    NH = config.num_ngram_heads
    mult = layer_multipliers(config.vocab_size, config.ngram_size, config.seed, ple_layer_index)
    # Layer L takes the NH consecutive primes after the first L * NH primes >= base.
    sizes = primes_from(config.ngram_vocab_size_base, (ple_layer_index + 1) * NH)[ple_layer_index * NH:]
    offsets, total = [], 0
    for s in sizes:
        offsets.append(total)
        total += s
    div = config.make_ngram_vocab_size_divisible_by
    num_rows = -(-total // div) * div
    return HashParams(
        multipliers=torch.tensor(mult, dtype=torch.int64),
        head_sizes=torch.tensor(sizes, dtype=torch.int64),
        head_offsets=torch.tensor(offsets, dtype=torch.int64),
        num_rows=num_rows,
        vocab_size=config.vocab_size,
    )


def _engram_hash_params(config: PLEConfig, ple_layer_index: int) -> HashParams:
    """`hash_params` of an Engram-family config (docs/spec.md section 15)."""
    if ple_layer_index >= config.num_ple_layers:
        raise ValueError(f"ple_layer_index: the config has {config.num_ple_layers} layer(s) "
                         f"(layer_ids={list(config.ple_layer_ids)}), got index {ple_layer_index}")
    lid = config.ple_layer_ids[ple_layer_index]
    mult = engram_multipliers(config.token_vocab_size, config.ngram_size, config.seed, lid)
    sizes = engram_head_sizes(config.engram_vocab_size, config.heads_per_ngram,
                              config.ple_layer_ids)[ple_layer_index]
    offsets = [sum(sizes[:h]) for h in range(len(sizes))]
    tmap = None if config.token_map is None else torch.tensor(config.token_map, dtype=torch.int64)
    return HashParams(multipliers=torch.tensor(mult, dtype=torch.int64),
                      head_sizes=torch.tensor(sizes, dtype=torch.int64),
                      head_offsets=torch.tensor(offsets, dtype=torch.int64),
                      num_rows=sum(sizes), vocab_size=config.vocab_size, token_map=tmap, eos_rule=False)


def _request_token_lists(input_ids: torch.Tensor, ngram_size: int, eos_token_id: int,
                         query_start_loc: torch.Tensor | None,
                         ngram_context: torch.Tensor | None) -> list[torch.Tensor]:
    """Per request, ``ctx ++ x`` as int64 ``[N - 1 + q]``: its N-1 context tokens (oldest first; all EOS
    without ``ngram_context``), then its q tokens (docs/spec.md section 3). Reads ``query_start_loc`` on the
    host."""
    N = ngram_size
    ids = input_ids.to(torch.int64)
    query_start_loc_list = [0, ids.numel()] if query_start_loc is None else query_start_loc.tolist()
    R = len(query_start_loc_list) - 1
    if ngram_context is None:
        ctx = torch.full((R, N - 1), eos_token_id, dtype=torch.int64, device=ids.device)
    else:
        ctx = ngram_context.to(torch.int64)
    return [torch.cat([ctx[r], ids[query_start_loc_list[r]:query_start_loc_list[r + 1]]]) for r in range(R)]


def _request_windows(seq: torch.Tensor, ngram_size: int, eos_token_id: int, eos_rule: bool = True) -> torch.Tensor:
    """The window of every token of one request, ``[q, N]``: column k the token k positions back
    (column 0 the token itself), after the EOS rule when ``eos_rule`` (the Engram family has none: every
    entry is the token k back). ``seq`` is ``ctx ++ x`` (`_request_token_lists`), already mapped."""
    N = ngram_size
    q = seq.numel() - (N - 1)
    window = [seq[N - 1:]]                                      # w[0]: the token itself
    seen_eos = torch.zeros(q, dtype=torch.bool, device=seq.device)
    for k in range(1, N):
        back = seq[N - 1 - k : N - 1 - k + q]                   # the token k positions back (maybe in ctx)
        # docs/spec.md 3, the EOS rule: once a step back has reached an EOS, every older entry is EOS (the EOS itself
        # is kept, so an EOS token still sees its own history). Engram (section 15): no rule.
        window.append(torch.where(seen_eos, eos_token_id, back) if eos_rule else back)
        seen_eos = seen_eos | (back == eos_token_id)
    return torch.stack(window, 1)


def _mapped(seq: torch.Tensor, eos_token_id: int, token_map: torch.Tensor | None) -> tuple[torch.Tensor, int]:
    """``(token_map[seq], token_map[eos_token_id])``: the ids the hash reads (docs/spec.md section 15: tokens,
    contexts and the boundary token go through the map first); unchanged without a map."""
    if token_map is None:
        return seq, eos_token_id
    token_map = token_map.to(seq.device)
    return token_map[seq].to(torch.int64), int(token_map[eos_token_id])     # an int32 map: int64 products


def ngram_windows(input_ids: torch.Tensor, *, ngram_size: int, eos_token_id: int,
                  query_start_loc: torch.Tensor | None = None,
                  ngram_context: torch.Tensor | None = None, eos_rule: bool = True) -> torch.Tensor:
    """The n-gram window each token hashes: ``[T, N]`` int64, column k the token k positions back
    (column 0 the token itself), after the EOS rule (past an EOS every older entry is EOS) unless
    ``eos_rule`` is False (the Engram family). Ids are the tokens' own (not mapped by a ``token_map``).

    Token t's n-gram for n = 2..N is ``window[t, :n]`` read backwards (oldest first). Arguments as
    in `ngram_ids`.
    """
    N = ngram_size
    windows = [_request_windows(seq, N, eos_token_id, eos_rule)
               for seq in _request_token_lists(input_ids, N, eos_token_id, query_start_loc, ngram_context)]
    return torch.cat(windows) if windows else torch.zeros(0, N, dtype=torch.int64, device=input_ids.device)


def ngrams_of_rows(input_ids: torch.Tensor, params: HashParams, *, heads_per_ngram: int, eos_token_id: int,
                   query_start_loc: torch.Tensor | None = None,
                   ngram_context: torch.Tensor | None = None) -> dict[tuple[int, int], dict[tuple, int]]:
    """Which n-grams of these tokens hit which table rows: ``{(head, row): {ngram: count}}``.

    An n-gram is a tuple of token ids, oldest first; head h hashes the ``h // heads_per_ngram + 2``-grams.
    Rows hit by more than one distinct n-gram are hash collisions. Arguments as in `ngram_ids`.
    """
    ids = ngram_ids(input_ids, params, heads_per_ngram=heads_per_ngram, eos_token_id=eos_token_id,
                    query_start_loc=query_start_loc, ngram_context=ngram_context).tolist()
    win = ngram_windows(input_ids, ngram_size=params.ngram_size, eos_token_id=eos_token_id,
                        query_start_loc=query_start_loc, ngram_context=ngram_context,
                        eos_rule=params.eos_rule).tolist()
    out: dict[tuple[int, int], dict[tuple, int]] = {}
    for t, rows in enumerate(ids):
        for h, row in enumerate(rows):
            gram = tuple(reversed(win[t][:h // heads_per_ngram + 2]))
            hits = out.setdefault((h, row), {})
            hits[gram] = hits.get(gram, 0) + 1
    return out


def ngram_ids(input_ids: torch.Tensor, params: HashParams, *, heads_per_ngram: int, eos_token_id: int,
              query_start_loc: torch.Tensor | None = None,
              ngram_context: torch.Tensor | None = None, validate: bool = True) -> torch.Tensor:
    """Table rows of every token's NH hash heads (docs/spec.md sections 3 and 7.3).

    A token's window ``w[0..N-1]`` is the token itself, then the tokens 1..N-1 positions back
    (through the context), except that past an EOS every older entry is EOS (the EOS itself
    is kept). The Engram family (``params.eos_rule`` False, docs/spec.md section 15) has no EOS rule, and
    with ``params.token_map`` every id (tokens, context, ``eos_token_id`` as the fill before the sequence)
    is mapped before the products. For order n in 2..N, ``mix_n = (w[0]*m[0]) ^ ... ^ (w[n-1]*m[n-1])`` with
    ``m = params.multipliers`` (int64 products, wrapping modulo ``2**64`` for hand-built multipliers that
    overflow), and head
    ``h = (n-2) * heads_per_ngram + j`` (j in ``0..heads_per_ngram-1``) takes row
    ``mix_n % head_sizes[h] + head_offsets[h]``, ``%`` the floor remainder (``torch.remainder``: in
    ``[0, head_sizes[h])`` also for a negative mix). A chunk's ids equal those of the same tokens
    hashed within the whole sequence, given the chunk's ``ngram_context``.

    Args:
        input_ids: int32 or int64 ``[T]``, the tokens of R requests laid end to end.
        params: the layer's `HashParams` (`hash_params`): multipliers ``[N]``, head sizes and
            offsets ``[NH]``, ``vocab_size`` V.
        heads_per_ngram: P, hash heads per n-gram order; ``NH = (N - 1) * P``.
        eos_token_id: the token that cuts windows, in ``[0, V)``.
        query_start_loc: int32 or int64 ``[R+1]``, offsets cutting ``input_ids`` into requests
            (from 0, non-decreasing, ending at T). Default: one request, ``[0, T]``.
        ngram_context: int32 or int64 ``[R, N-1]``, the tokens before each request's first token,
            oldest first. Default: all EOS (every request starts its sequence).
        validate: False skips the value checks (token id ranges, offsets; the
            metadata checks still run), for callers that validated on the host
            (``PLECache.schedule``); out-of-range values are then undefined behaviour.

    Returns:
        int64 ``[T, NH]`` on ``input_ids``' device: column h is head h's table row.

    Raises:
        TypeError: ``input_ids``, ``query_start_loc`` or ``ngram_context`` is not an int32 / int64
            tensor; ``params`` is not a `HashParams`; ``heads_per_ngram`` or ``eos_token_id`` is not an int.
        ValueError: ``input_ids`` is not 1-D, is on the meta device, or holds an id outside ``[0, V)``.
        ValueError: ``heads_per_ngram`` is below 1, or ``(N - 1) * heads_per_ngram`` differs from the
            number of head sizes in ``params``.
        ValueError: ``eos_token_id`` is outside ``[0, V)``.
        ValueError: ``query_start_loc`` is not 1-D, is empty, is on another device than ``input_ids``
            (or on the meta device), does not start at 0, decreases, or does not end at T.
        ValueError: ``ngram_context`` is not ``[R, N-1]``, is on another device (or the meta device),
            or holds an id outside ``[0, V)``.

    Example::

        >>> params = hash_params(PLEConfig.preset("tiny"), 0)            # N = 3, P = 3: NH = 6
        >>> ngram_ids(torch.tensor([5, 7, 2, 9]), params, heads_per_ngram=3, eos_token_id=2).shape
        torch.Size([4, 6])
    """
    check = _checks.ngram_call if _checks.validating(validate) else _checks.ngram_meta
    check(input_ids, params, heads_per_ngram, eos_token_id, query_start_loc, ngram_context)
    return _ngram_ids(input_ids, params, heads_per_ngram, eos_token_id, query_start_loc, ngram_context)


def _ngram_ids(input_ids: torch.Tensor, params: HashParams, heads_per_ngram: int, eos_token_id: int,
               query_start_loc: torch.Tensor | None, ngram_context: torch.Tensor | None) -> torch.Tensor:
    """The body of `ngram_ids`, for a call already checked (by it, or by ``ngram_embedding``'s one check)."""
    dev = input_ids.device
    N, P = params.multipliers.numel(), heads_per_ngram
    m = params.multipliers.to(dev)
    sizes, offsets = params.head_sizes.to(dev), params.head_offsets.to(dev)
    out = []
    for seq in _request_token_lists(input_ids, N, eos_token_id, query_start_loc, ngram_context):
        seq, boundary = _mapped(seq, eos_token_id, params.token_map)        # docs/spec.md 15: the map first
        w = _request_windows(seq, N, boundary, params.eos_rule)             # [q, N]
        # docs/spec.md 3: mix_n = (w[0]*m[0]) ^ ... ^ (w[n-1]*m[n-1]) (int64, wrapping modulo 2**64);
        # head h = (n-2)*P + j takes row mix_n % size[h] + offset[h] (% on tensors: the floor remainder).
        mix = w[:, 0] * m[0]
        heads = []
        for n in range(2, N + 1):
            mix = mix ^ (w[:, n - 1] * m[n - 1])
            h = slice((n - 2) * P, (n - 1) * P)
            heads.append(mix[:, None] % sizes[h] + offsets[h])
        out.append(torch.cat(heads, dim=1))
    return torch.cat(out) if out else torch.zeros(0, (N - 1) * P, dtype=torch.int64, device=dev)
