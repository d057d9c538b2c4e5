"""Hash parameters and n-gram ids (SPEC sections 2 and 3), in plain Python and PyTorch.

A token's n-gram of order n is its window of the last n tokens; the window is
hashed by XOR-ing ``token * multiplier`` products and taken modulo one prime per
hash head. The multipliers are odd and small enough that ``token * m < 2**63`` for
every token id below ``vocab_size``, so the products never overflow int64.

``ngram_ids`` is written as the specification: a loop over the requests (``query_start_loc``
read on the host), each hashed from its context and tokens as SPEC section 3 says; not
sync-free (``ple.vectorized`` computes the same ids on the device for the whole batch).
"""

from __future__ import annotations

import functools

import torch

from .. import _checks
from ..config import PLEConfig
from ..params import HashParams

__all__ = ["HashParams", "hash_params", "splitmix64", "primes_from", "layer_multipliers", "ngram_ids", "ngram_windows",
           "ngrams_of_rows"]

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
    """SPEC section 2: odd multipliers with ``token * m < 2**63`` for tokens below ``vocab_size``."""
    half = max(1, ((2**63 - 1) // max(vocab_size, 1)) // 2)
    base = seed + _LAYER_STRIDE * ple_layer_index
    return [2 * (splitmix64((base + _GOLDEN * (i + 1)) & _MASK64) % half) + 1 for i in range(ngram_size)]


def hash_params(config: PLEConfig, ple_layer_index: int) -> HashParams:
    """Multipliers, head table sizes and offsets of PLE layer ``ple_layer_index`` (0-based PLE index)."""
    if not isinstance(config, PLEConfig):
        raise TypeError(f"config: expected a PLEConfig, got {type(config).__name__}")
    _checks.int_arg("ple_layer_index", ple_layer_index, minimum=0)
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


def _requests(input_ids: torch.Tensor, N: int, eos_token_id: int, query_start_loc: torch.Tensor | None,
              ngram_context: torch.Tensor | None) -> list[torch.Tensor]:
    """Per request, ``ctx ++ x`` as int64 ``[N - 1 + q]``: its N-1 context tokens (oldest first; all EOS
    without ``ngram_context``), then its q tokens (SPEC section 3). Reads ``query_start_loc`` on the host."""
    ids = input_ids.to(torch.int64)
    starts = [0, ids.numel()] if query_start_loc is None else query_start_loc.tolist()
    R = len(starts) - 1
    if ngram_context is None:
        ctx = torch.full((R, N - 1), eos_token_id, dtype=torch.int64, device=ids.device)
    else:
        ctx = ngram_context.to(torch.int64)
    return [torch.cat([ctx[r], ids[starts[r]:starts[r + 1]]]) for r in range(R)]


def _windows(seq: torch.Tensor, N: int, eos_token_id: int) -> torch.Tensor:
    """The window of every token of one request, ``[q, N]``: column k the token k positions back
    (column 0 the token itself), after the EOS rule. ``seq`` is ``ctx ++ x`` (`_requests`)."""
    q = seq.numel() - (N - 1)
    window = [seq[N - 1:]]                                      # w[0]: the token itself
    seen_eos = torch.zeros(q, dtype=torch.bool, device=seq.device)
    for k in range(1, N):
        back = seq[N - 1 - k : N - 1 - k + q]                   # the token k positions back (maybe in ctx)
        # SPEC 3, EOS rule: once a step back has reached an EOS, every older entry is EOS (the EOS itself
        # is kept, so an EOS token still sees its own history).
        window.append(torch.where(seen_eos, eos_token_id, back))
        seen_eos = seen_eos | (back == eos_token_id)
    return torch.stack(window, 1)


def ngram_windows(input_ids: torch.Tensor, *, ngram_size: int, eos_token_id: int,
                  query_start_loc: torch.Tensor | None = None,
                  ngram_context: torch.Tensor | None = None) -> torch.Tensor:
    """The n-gram window each token hashes: ``[T, N]`` int64, column k the token k positions back
    (column 0 the token itself), after the EOS rule (past an EOS every older entry is EOS).

    Token t's n-gram for n = 2..N is ``window[t, :n]`` read backwards (oldest first). Arguments as
    in `ngram_ids`.
    """
    N = ngram_size
    windows = [_windows(seq, N, eos_token_id)
               for seq in _requests(input_ids, N, eos_token_id, query_start_loc, ngram_context)]
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
                        query_start_loc=query_start_loc, ngram_context=ngram_context).tolist()
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
    """Table rows of every token's NH hash heads: ``[T, NH]`` int64 (SPEC section 3).

    ``input_ids`` is ``[T]``: the tokens of R requests laid end to end, cut by
    ``query_start_loc`` (``[R+1]``; default: one request). ``ngram_context``
    (``[R, N-1]``, oldest first; default: all EOS, i.e. every request starts its
    sequence) holds the tokens before each request's first token, so a chunk's ids
    equal those of the same tokens hashed within the whole sequence.

    A token's window ``w[0..N-1]`` is the token itself, then the tokens 1..N-1 positions back
    (through the context), except that past an EOS every older entry is EOS (the EOS itself
    is kept). For order n in 2..N, ``mix_n = (w[0]*m[0]) ^ ... ^ (w[n-1]*m[n-1])`` with
    ``m = params.multipliers``, and head ``h = (n-2) * heads_per_ngram + j`` takes row
    ``mix_n % head_sizes[h] + head_offsets[h]``. Token ids outside ``[0, V)`` raise ``ValueError``.

    ``validate=False`` skips the value checks (token id ranges, offsets); for callers that
    validated on the host, e.g. ``PLECache.schedule``; out-of-range values are
    then undefined behaviour.
    """
    check = _checks.ngram_call if validate else _checks.ngram_meta
    check(input_ids, params, heads_per_ngram, eos_token_id, query_start_loc, ngram_context)
    dev = input_ids.device
    N, P = params.multipliers.numel(), heads_per_ngram
    m = params.multipliers.to(dev)
    sizes, offsets = params.head_sizes.to(dev), params.head_offsets.to(dev)
    out = []
    for seq in _requests(input_ids, N, eos_token_id, query_start_loc, ngram_context):
        w = _windows(seq, N, eos_token_id)                      # [q, N]
        # SPEC 3: mix_n = (w[0]*m[0]) ^ ... ^ (w[n-1]*m[n-1]) (int64: token * m < 2**63, no overflow);
        # head h = (n-2)*P + j takes row mix_n % size[h] + offset[h].
        mix = w[:, 0] * m[0]
        heads = []
        for n in range(2, N + 1):
            mix = mix ^ (w[:, n - 1] * m[n - 1])
            h = slice((n - 2) * P, (n - 1) * P)
            heads.append(mix[:, None] % sizes[h] + offsets[h])
        out.append(torch.cat(heads, dim=1))
    return torch.cat(out) if out else torch.zeros(0, (N - 1) * P, dtype=torch.int64, device=dev)
