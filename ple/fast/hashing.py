"""N-gram ids (docs/spec.md section 3) as one Triton kernel, and the fused hash + table gather.

Kernel design (``_ngram_kernel``; grid ``cdiv(T, BLOCK_T)``, one program per block of tokens:
`_BLOCK_T` tokens for the ids, ``_FUSED_ROWS // NH'`` for the fused gather, ``NH'`` being ``NH``
rounded up to a power of two):

* **Request of a token.** With ``query_start_loc`` (``IS_VARLEN``, read through its
  stride) each lane finds its
  request by a binary search over the ``R + 1`` offsets in the kernel: the largest
  ``r`` in ``[0, R)`` with ``query_start_loc[r] <= t``, which skips empty requests.
  The search takes ``ceil(log2 R)`` steps, passed as a runtime loop count, so no host
  loop over tokens and no recompilation per batch size (``T`` and ``R`` are runtime).
* **Window.** ``w[0]`` is the token; for ``k`` in ``1..N-1`` (unrolled, ``N`` is a
  constexpr) the token ``k`` back is read from the chunk when the position in the
  request is ``>= k`` and otherwise from the request's ``ngram_context`` row (column
  ``N - 1 + pos - k``; all EOS without a context, ``HAS_CONTEXT`` false). A running flag
  says whether a step back has already reached an EOS; once it has, the entry is EOS.
* **Family** (docs/spec.md section 15). ``HAS_TOKEN_MAP``: every id the window reads (the token, the
  tokens back, the context or the boundary token ``eos``) is gathered through the token map (``map_ptr``,
  int32 or int64 ``[V]``, read through its stride) before it is hashed; the boundary once per program
  (every lane the same address). ``EOS_RULE`` false (the Engram family): no running flag, every entry is the (mapped)
  token k back, and positions before the request read the (mapped) ``eos``. Both are constexprs, so the
  Qwen4Exp kernel (``EOS_RULE``, no map) compiles as before.
* **Hash.** ``mix`` accumulates ``w[k] * m[k]`` by XOR in int64, products wrapping modulo ``2**64``
  (the config's multipliers never wrap; hand-built ones may, docs/spec.md section 3); after step ``k``
  it becomes the mix of the ``P`` heads of order ``k + 1`` in a ``[tokens, NH']`` tile, and every head
  takes the floor remainder ``mix mod size[h] + offset[h]`` at once (Triton's ``%`` truncates, so a
  negative remainder is moved up by ``size[h]``). Multipliers, sizes and offsets are read from the
  ``HashParams`` tensors (so a loaded checkpoint's buffers are what is used): the multipliers
  as one vector, sizes and offsets as ``[tokens, NH']`` tiles (consecutive heads in one
  128-bit load; the repeats hit the cache).
* **Outputs.** ``HAS_IDS_OUT`` stores the ids tile ``[T, NH]`` (int64 pairs, 128-bit stores);
  ``HAS_TABLE`` gathers row ``id`` of every (token, head) into columns ``[h*D, (h+1)*D)`` of the
  embedding, as ``[tokens, NH', BLOCK_D]`` tiles (`_BLOCK_D` columns, 16-byte pieces of rows).
  The fused ``ngram_embedding`` sets only ``HAS_TABLE`` (the ids are never written); its
  backward (``ple.ngram_embedding_backward``) hashes again with ``HAS_IDS_OUT`` and runs the
  lookup's backward (``ple.fast.embedding._lookup_bwd``: atomics, or in deterministic mode the
  sorted, token-order sum). A gather is a copy, so the fused result equals
  ``embedding_lookup(weight, ngram_ids(...))`` bit for bit.

All address arithmetic is int64; every input is addressed through its strides.

Registered as ``torch.ops.ple.ngram_ids`` and ``torch.ops.ple.ngram_embedding``: the public
functions check the metadata (``ple._checks.ngram_meta``), the ops the values
(``query_start_loc``, token ids) at run time unless ``validate=False``; the launch itself
needs only shapes (grid from ``T``, search steps from ``R``), so then nothing is read back.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from .. import _checks
from .. import reference as _reference
from ..quant import NF4_LEVELS
from ..reference.hashing import HashParams
from ._library import check_runnable, register, twin
from ._numerics import down, pow2_block
from .embedding import _lookup_bwd

__all__ = ["ngram_ids", "ngram_embedding", "ngram_embedding_nf4"]

_BLOCK_T = 64          # tokens per program of ``ngram_ids`` (an ids tile [_BLOCK_T, NH])
_FUSED_ROWS = 256      # (token, head) rows per program of the fused gather: _FUSED_ROWS // NH' tokens
_BLOCK_D = 64          # table columns per chunk of the fused gather
_NF4_BLOCK_D = 32      # values per chunk of the fused NF4 gather (16 bytes of a row's codes)
_LEVELS: dict[torch.device, torch.Tensor] = {}


def _levels(device: torch.device) -> torch.Tensor:
    """``ple.quant.NF4_LEVELS`` (float32 [16]) on ``device``, copied there once."""
    if device not in _LEVELS:
        _LEVELS[device] = NF4_LEVELS.to(device)
    return _LEVELS[device]


@triton.jit
def _ngram_kernel(
    ids_ptr, stride_ids_t,                                 # [T] token ids
    query_start_loc_ptr, stride_query_start_loc_r,         # [R+1] query_start_loc (IS_VARLEN)
    ctx_ptr, stride_ctx_r, stride_ctx_k,                   # [R, N-1] contexts (HAS_CONTEXT)
    mult_ptr, sizes_ptr, offsets_ptr,                      # [N], [NH], [NH] int64, contiguous
    out_ptr, stride_out_t, stride_out_h,                   # [T, NH] int64 ids (HAS_IDS_OUT)
    w_ptr, stride_w_r, stride_w_d,                         # [rows, D] table, or NF4 words [rows, W] (HAS_TABLE)
    emb_ptr, stride_emb_t, stride_emb_c,                   # [T, NH*D] embedding (HAS_TABLE)
    levels_ptr,                                            # [16] float32 NF4 levels (NF4)
    map_ptr, stride_map,                                   # [V] int32 / int64 token map (HAS_TOKEN_MAP)
    T, R, D, eos, search_steps,
    N: tl.constexpr, P: tl.constexpr, IS_VARLEN: tl.constexpr, HAS_CONTEXT: tl.constexpr,
    HAS_IDS_OUT: tl.constexpr, HAS_TABLE: tl.constexpr, BLOCK_T: tl.constexpr, BLOCK_D: tl.constexpr,
    NF4: tl.constexpr = False, WORD: tl.constexpr = 1, IS_OUT_BF16: tl.constexpr = False,
    EOS_RULE: tl.constexpr = True, HAS_TOKEN_MAP: tl.constexpr = False,
):
    NH: tl.constexpr = (N - 1) * P
    # NHP: NH rounded up to a power of two (the width of the head axis of the tiles).
    v0: tl.constexpr = NH - 1
    v1: tl.constexpr = v0 | (v0 >> 1)
    v2: tl.constexpr = v1 | (v1 >> 2)
    v3: tl.constexpr = v2 | (v2 >> 4)
    v4: tl.constexpr = v3 | (v3 >> 8)
    NHP: tl.constexpr = v4 + 1
    # NP: N rounded up to a power of two (the multipliers are loaded as one vector).
    u0: tl.constexpr = N - 1
    u1: tl.constexpr = u0 | (u0 >> 1)
    u2: tl.constexpr = u1 | (u1 >> 2)
    u3: tl.constexpr = u2 | (u2 >> 4)
    NP: tl.constexpr = u3 + 1

    pid = tl.program_id(0)
    t = pid.to(tl.int64) * BLOCK_T + tl.arange(0, BLOCK_T).to(tl.int64)   # [BLOCK_T] token index
    live = t < T
    h = tl.arange(0, NHP).to(tl.int64)                                   # [NHP] hash head
    head = h < NH
    order = h // P + 1                                                   # a head's n-gram order - 1

    if IS_VARLEN:
        # Largest r in [0, R-1] with query_start_loc[r] <= t (invariant: the answer lies in [lo, hi]).
        lo = tl.zeros([BLOCK_T], dtype=tl.int64)
        hi = tl.zeros([BLOCK_T], dtype=tl.int64) + (R - 1)
        for _ in range(search_steps):
            mid = (lo + hi + 1) // 2
            start_mid = tl.load(query_start_loc_ptr + mid * stride_query_start_loc_r, mask=live, other=0).to(tl.int64)
            go_right = start_mid <= t
            lo = tl.where(go_right, mid, lo)
            hi = tl.where(go_right, hi, mid - 1)
        req = lo
        start = tl.load(query_start_loc_ptr + req * stride_query_start_loc_r, mask=live, other=0).to(tl.int64)
    else:
        req = tl.zeros([BLOCK_T], dtype=tl.int64)
        start = tl.zeros([BLOCK_T], dtype=tl.int64)
    pos = t - start                                                      # position in the request

    jm = tl.arange(0, NP)
    mults = tl.load(mult_ptr + jm, mask=jm < N, other=0)                # [NP]: vector loads, not N scalars
    tok = tl.load(ids_ptr + t * stride_ids_t, mask=live, other=0).to(tl.int64)
    if HAS_TOKEN_MAP:                                                    # docs/spec.md 15: the map first
        tok = tl.load(map_ptr + tok * stride_map, mask=live, other=0).to(tl.int64)
        boundary = tl.load(map_ptr + (tl.zeros([BLOCK_T], dtype=tl.int64) + eos) * stride_map, mask=live,
                           other=0).to(tl.int64)                         # token_map[eos]: one address
    else:
        boundary = eos                                                   # the boundary token, as the ids read it
    mix = tok * tl.sum(tl.where(jm == 0, mults, 0), axis=0)
    seen_eos = tok < 0                                                   # all false
    mix2 = tl.zeros([BLOCK_T, NHP], dtype=tl.int64)                      # [token, head]: the head's mix
    for k in tl.static_range(1, N):
        in_chunk = pos >= k
        from_chunk = tl.load(ids_ptr + (t - k) * stride_ids_t, mask=live & in_chunk, other=0).to(tl.int64)
        if HAS_CONTEXT:
            col = N - 1 + pos - k
            from_ctx = tl.load(ctx_ptr + req * stride_ctx_r + col * stride_ctx_k,
                               mask=live & (pos < k), other=0).to(tl.int64)
        else:
            from_ctx = tl.zeros([BLOCK_T], dtype=tl.int64) + eos
        back = tl.where(in_chunk, from_chunk, from_ctx)                  # the token k positions back
        if HAS_TOKEN_MAP:
            back = tl.load(map_ptr + back * stride_map, mask=live, other=0).to(tl.int64)
        if EOS_RULE:
            w_k = tl.where(seen_eos, tl.zeros([BLOCK_T], dtype=tl.int64) + boundary, back)
            seen_eos = seen_eos | (back == boundary)
        else:                                                            # Engram: no EOS rule
            w_k = back
        mix = mix ^ (w_k * tl.sum(tl.where(jm == k, mults, 0), axis=0))
        mix2 = tl.where((order == k)[None, :], mix[:, None], mix2)       # the P heads of order k + 1
    # The head sizes and offsets are loaded per (token, head), a [BLOCK_T, NHP] tile: consecutive heads
    # in one thread are one 128-bit load (the repeats hit the cache), and the tile stays in that layout.
    m2 = live[:, None] & head[None, :]
    h2 = tl.zeros([BLOCK_T, 1], dtype=tl.int64) + h[None, :]
    size = tl.load(sizes_ptr + h2, mask=m2, other=1)
    offset = tl.load(offsets_ptr + h2, mask=m2, other=0)
    # The floor remainder (docs/spec.md section 3): Triton's % keeps the dividend's sign, and a mix is negative
    # when hand-built multipliers make a product wrap, so a negative remainder moves up by the head's size.
    rem = mix2 % size
    row = tl.where(rem < 0, rem + size, rem) + offset                    # [BLOCK_T, NHP] int64 table rows
    if HAS_IDS_OUT:
        tl.store(out_ptr + t[:, None] * stride_out_t + h[None, :] * stride_out_h, row, mask=m2)
    if HAS_TABLE and NF4:
        # NF4 rows, read as words of WORD bytes (NIB codes a word), unpacked in registers: D values a row.
        NIB: tl.constexpr = 2 * WORD
        BLOCK_W: tl.constexpr = BLOCK_D // NIB                           # words per chunk (BLOCK_D values)
        n_code_words = D // NIB
        base = w_ptr + row * stride_w_r                                  # [BLOCK_T, NHP] the rows' first words
        # The scale: bytes D/2, D/2 + 1 (a little-endian float16), the first two bytes of word D / NIB.
        lo = tl.load(base + n_code_words * stride_w_d, mask=m2, other=0).to(tl.int32)
        if WORD == 1:
            hi_byte = tl.load(base + (n_code_words + 1) * stride_w_d, mask=m2, other=0).to(tl.int32)
            bits = (lo & 0xFF) | ((hi_byte & 0xFF) << 8)
        else:
            bits = lo & 0xFFFF
        bits = tl.where(bits >= 32768, bits - 65536, bits)             # the 16 bits as int16 holds them
        scale = bits.to(tl.int16).to(tl.float16, bitcast=True).to(tl.float32)
        shift = 4 * tl.arange(0, NIB)                                    # nibble k of a word is value k of it
        for w0 in range(0, n_code_words, BLOCK_W):
            wi = w0 + tl.arange(0, BLOCK_W).to(tl.int64)
            mw = m2[:, :, None] & (wi < n_code_words)[None, None, :]
            words = tl.load(base[:, :, None] + wi[None, None, :] * stride_w_d, mask=mw, other=0).to(tl.int32)
            codes = tl.reshape((words[:, :, :, None] >> shift[None, None, None, :]) & 15,
                               (BLOCK_T, NHP, BLOCK_D))                  # value w * NIB + k of the row
            vals = tl.load(levels_ptr + codes) * scale[:, :, None]       # level[code] * scale in float32
            d = w0 * NIB + tl.arange(0, BLOCK_D).to(tl.int64)
            m3 = m2[:, :, None] & (d < D)[None, None, :]
            tl.store(emb_ptr + t[:, None, None] * stride_emb_t + (h[None, :, None] * D + d[None, None, :]) *
                     stride_emb_c, down(vals, emb_ptr.dtype.element_ty, IS_OUT_BF16), mask=m3)
    elif HAS_TABLE:
        # Row id of (token, head) to columns [h*D, (h+1)*D) of the token's embedding, BLOCK_D at a time.
        for d0 in range(0, D, BLOCK_D):
            d = d0 + tl.arange(0, BLOCK_D).to(tl.int64)
            m3 = m2[:, :, None] & (d < D)[None, None, :]
            vals = tl.load(w_ptr + row[:, :, None] * stride_w_r + d[None, None, :] * stride_w_d, mask=m3)
            tl.store(emb_ptr + t[:, None, None] * stride_emb_t + (h[None, :, None] * D + d[None, None, :]) *
                     stride_emb_c, vals, mask=m3)


def _nf4_words(weight: torch.Tensor) -> tuple[torch.Tensor, int]:
    """NF4 rows ``[rows, W]`` (uint8) as ``[rows, W / WORD]`` words of ``WORD`` bytes (4, 2 or 1): the widest
    that divides the row width, its stride and the rows' offset, so a row is read in ``W / WORD`` loads."""
    for word, dt in ((4, torch.int32), (2, torch.int16)):
        if (weight.stride(1) == 1 and weight.shape[1] % word == 0 and weight.stride(0) % word == 0
                and weight.storage_offset() % word == 0 and weight.data_ptr() % word == 0):
            return weight.view(dt), word
    return weight, 1


def _hash(input_ids, multipliers, head_sizes, head_offsets, P, eos_token_id, query_start_loc, ngram_context, *,
          weight=None, write_ids=True, nf4_dtype=None, token_map=None, eos_rule=True):
    """Launch ``_ngram_kernel``; returns ``(ids or None, embedding or None)``. With ``nf4_dtype``, ``weight``
    holds NF4 rows (uint8 ``[rows, D/2 + 4]``) and the embedding their values in that dtype. ``token_map`` and
    ``eos_rule``: the family (``HashParams``' fields of those names)."""
    dev = input_ids.device
    T = input_ids.numel()
    N = multipliers.numel()
    NH = (N - 1) * P
    R = 1 if query_start_loc is None else query_start_loc.numel() - 1
    mult = multipliers.to(device=dev, dtype=torch.int64).contiguous()
    sizes = head_sizes.to(device=dev, dtype=torch.int64).contiguous()
    offsets = head_offsets.to(device=dev, dtype=torch.int64).contiguous()
    out = torch.empty((T, NH), dtype=torch.int64, device=dev) if write_ids else None
    has_table = weight is not None
    nf4 = nf4_dtype is not None
    D = (2 * (weight.shape[1] - 4) if nf4 else weight.shape[1]) if has_table else 0
    out_dtype = nf4_dtype if nf4 else (weight.dtype if has_table else None)
    emb = torch.empty((T, NH * D), dtype=out_dtype, device=dev) if has_table else None
    if T == 0:
        return out, emb
    is_varlen = query_start_loc is not None
    if query_start_loc is None:                                         # placeholders are never read
        query_start_loc = input_ids
    ctx = ngram_context if ngram_context is not None else input_ids[None]
    ids_out = out if out is not None else mult[None]                    # out is None without write_ids
    w, word = _nf4_words(weight) if nf4 else (weight if weight is not None else mult[None], 1)
    e = emb if emb is not None else mult[None]                          # emb is None without a table
    levels = _levels(dev) if nf4 else mult
    tmap = token_map.to(dev) if token_map is not None else mult         # a placeholder without a map
    # The fused gather's tile is [tokens, NH', BLOCK_D] (NH' = NH rounded up to a power of two).
    block_t = max(1, _FUSED_ROWS // triton.next_power_of_2(NH)) if has_table else _BLOCK_T
    _ngram_kernel[(triton.cdiv(T, block_t),)](
        ids_ptr=input_ids, stride_ids_t=input_ids.stride(0),
        query_start_loc_ptr=query_start_loc, stride_query_start_loc_r=query_start_loc.stride(0),
        ctx_ptr=ctx, stride_ctx_r=ctx.stride(0), stride_ctx_k=ctx.stride(1),
        mult_ptr=mult, sizes_ptr=sizes, offsets_ptr=offsets,
        out_ptr=ids_out, stride_out_t=ids_out.stride(0), stride_out_h=ids_out.stride(1),
        w_ptr=w, stride_w_r=w.stride(0), stride_w_d=w.stride(1),
        emb_ptr=e, stride_emb_t=e.stride(0), stride_emb_c=e.stride(1), levels_ptr=levels,
        map_ptr=tmap, stride_map=tmap.stride(0),
        T=T, R=R, D=D, eos=eos_token_id, search_steps=max(R - 1, 0).bit_length(),
        N=N, P=P, IS_VARLEN=is_varlen, HAS_CONTEXT=ngram_context is not None,
        HAS_IDS_OUT=write_ids, HAS_TABLE=has_table, BLOCK_T=block_t,
        BLOCK_D=max(pow2_block(D, _NF4_BLOCK_D), 2 * word) if nf4 else pow2_block(D, _BLOCK_D),
        NF4=nf4, WORD=word, IS_OUT_BF16=out_dtype == torch.bfloat16,
        EOS_RULE=eos_rule, HAS_TOKEN_MAP=token_map is not None,
    )
    return out, emb


# ---- registration ----------------------------------------------------------------------------------


def _family(params: HashParams) -> tuple[torch.Tensor | None, bool]:
    """The op arguments that carry the family: ``(params.token_map, params.eos_rule)``."""
    return params.token_map, params.eos_rule


def _ngram_ids_impl(input_ids: torch.Tensor, multipliers: torch.Tensor, head_sizes: torch.Tensor,
                    head_offsets: torch.Tensor, vocab_size: int, heads_per_ngram: int, eos_token_id: int,
                    query_start_loc: torch.Tensor | None, ngram_context: torch.Tensor | None,
                    token_map: torch.Tensor | None, eos_rule: bool, validate: bool) -> torch.Tensor:
    if validate:
        _checks.ngram_values(input_ids, HashParams(multipliers, head_sizes, head_offsets, 0, vocab_size, token_map,
                                                   eos_rule),
                             heads_per_ngram, eos_token_id, query_start_loc, ngram_context)
    ids, _ = _hash(input_ids, multipliers, head_sizes, head_offsets, heads_per_ngram, eos_token_id,
                   query_start_loc, ngram_context, token_map=token_map, eos_rule=eos_rule)
    return ids


def _ngram_ids_fake(input_ids, multipliers, head_sizes, head_offsets, vocab_size, heads_per_ngram, eos_token_id,
                    query_start_loc, ngram_context, token_map, eos_rule, validate):
    return input_ids.new_empty((input_ids.shape[0], head_sizes.shape[0]), dtype=torch.int64)


_ngram_ids_op = register("ngram_ids", _ngram_ids_impl, fake=_ngram_ids_fake)


@twin(_reference.ngram_ids)
def ngram_ids(input_ids: torch.Tensor, params: HashParams, *, heads_per_ngram: int, eos_token_id: int,
              query_start_loc: torch.Tensor | None = None,
              ngram_context: torch.Tensor | None = None, validate: bool = True) -> torch.Tensor:
    """One kernel (``_ngram_kernel``, a program per 64 tokens): each token finds its request by a binary search over
    ``query_start_loc`` on the device, reads its window from the chunk or its ``ngram_context`` with the EOS rule,
    and hashes every head in int64 (Triton's truncating ``%`` moved up to the floor remainder). The family's
    ``params.token_map`` (a gather of every id read, the boundary token included) and ``params.eos_rule`` are the
    kernel's ``HAS_TOKEN_MAP`` and ``EOS_RULE`` constexprs, and the op's ``token_map`` / ``eos_rule`` arguments.
    Registered as ``torch.ops.ple.ngram_ids``: the public function checks the metadata, the op the values at run
    time, reading the tokens and offsets on the host (``validate=True``); with ``validate=False`` the launch needs
    only shapes, so nothing is read back. CPU tensors are refused (``ValueError``) while the kernels are compiled; under
    ``TRITON_INTERPRET=1`` they run on the CPU."""
    _checks.ngram_meta(input_ids, params, heads_per_ngram, eos_token_id, query_start_loc, ngram_context)
    return _ngram_ids_op(input_ids, params.multipliers, params.head_sizes, params.head_offsets, params.vocab_size,
                         heads_per_ngram, eos_token_id, query_start_loc, ngram_context, *_family(params),
                         _checks.validating(validate))


def _ngram_embedding_bwd_impl(grad: torch.Tensor, input_ids: torch.Tensor, multipliers: torch.Tensor,
                              head_sizes: torch.Tensor, head_offsets: torch.Tensor, heads_per_ngram: int,
                              eos_token_id: int, query_start_loc: torch.Tensor | None,
                              ngram_context: torch.Tensor | None, token_map: torch.Tensor | None, eos_rule: bool,
                              num_rows: int, dtype: torch.dtype) -> torch.Tensor:
    ids, _ = _hash(input_ids, multipliers, head_sizes, head_offsets, heads_per_ngram, eos_token_id,
                   query_start_loc, ngram_context, token_map=token_map, eos_rule=eos_rule)
    return _lookup_bwd(grad, ids, num_rows, dtype)


def _ngram_embedding_bwd_fake(grad, input_ids, multipliers, head_sizes, head_offsets, heads_per_ngram,
                              eos_token_id, query_start_loc, ngram_context, token_map, eos_rule, num_rows, dtype):
    return grad.new_empty((num_rows, grad.shape[1] // max(head_sizes.shape[0], 1)), dtype=dtype)


_ngram_embedding_bwd_op = register("ngram_embedding_backward", _ngram_embedding_bwd_impl,
                                   fake=_ngram_embedding_bwd_fake)


def _ngram_embedding_impl(weight: torch.Tensor, input_ids: torch.Tensor, multipliers: torch.Tensor,
                          head_sizes: torch.Tensor, head_offsets: torch.Tensor, vocab_size: int,
                          heads_per_ngram: int, eos_token_id: int, query_start_loc: torch.Tensor | None,
                          ngram_context: torch.Tensor | None, token_map: torch.Tensor | None, eos_rule: bool,
                          validate: bool) -> torch.Tensor:
    if validate:
        _checks.ngram_values(input_ids, HashParams(multipliers, head_sizes, head_offsets, 0, vocab_size, token_map,
                                                   eos_rule),
                             heads_per_ngram, eos_token_id, query_start_loc, ngram_context, weight=weight)
    _, emb = _hash(input_ids, multipliers, head_sizes, head_offsets, heads_per_ngram, eos_token_id,
                   query_start_loc, ngram_context, weight=weight, write_ids=False, token_map=token_map,
                   eos_rule=eos_rule)
    return emb


def _ngram_embedding_fake(weight, input_ids, multipliers, head_sizes, head_offsets, vocab_size, heads_per_ngram,
                          eos_token_id, query_start_loc, ngram_context, token_map, eos_rule, validate):
    return weight.new_empty((input_ids.shape[0], head_sizes.shape[0] * weight.shape[1]))


def _ngram_embedding_setup(ctx, inputs, output):
    weight, input_ids, mult, sizes, offsets, vocab, P, eos, query_start_loc, context, token_map, eos_rule, _ = inputs
    ctx.save_for_backward(input_ids, mult, sizes, offsets, query_start_loc, context, token_map)
    ctx.meta = (P, eos, eos_rule, weight.shape[0], weight.dtype)


def _ngram_embedding_backward(ctx, grad):
    input_ids, mult, sizes, offsets, query_start_loc, context, token_map = ctx.saved_tensors
    P, eos, eos_rule, rows, dtype = ctx.meta
    dw = _ngram_embedding_bwd_op(grad.contiguous(), input_ids, mult, sizes, offsets, P, eos, query_start_loc,
                                 context, token_map, eos_rule, rows, dtype)
    return (dw,) + (None,) * 12


_ngram_embedding_op = register("ngram_embedding", _ngram_embedding_impl, fake=_ngram_embedding_fake,
                               backward=_ngram_embedding_backward, setup_context=_ngram_embedding_setup)


@twin(_reference.ngram_embedding)
def ngram_embedding(weight: torch.Tensor, input_ids: torch.Tensor, params: HashParams, *,
                    heads_per_ngram: int, eos_token_id: int, query_start_loc: torch.Tensor | None = None,
                    ngram_context: torch.Tensor | None = None, validate: bool = True) -> torch.Tensor:
    """Fused: the ``ngram_ids`` kernel with the table gather on hashes and gathers in one pass, so the ids are never
    written to memory (a gather is a copy: the composition's bits). Backward
    (``torch.ops.ple.ngram_embedding_backward``): the hash again, then ``embedding_lookup``'s backward (atomics into
    a float32 (float64 for a float64 table) buffer, or under ``torch.use_deterministic_algorithms(True)`` the
    sorted, token-order sum), a dense ``[rows, D]`` gradient. Registered as ``torch.ops.ple.ngram_embedding``: the
    values (tokens, offsets, the table's row count) are checked inside the op unless ``validate=False``, which reads
    nothing back. An NF4 table's rows: ``ngram_embedding_nf4``. CPU tensors are refused (``ValueError``) while the
    kernels are compiled; under ``TRITON_INTERPRET=1`` they run on the CPU."""
    _checks.ngram_meta(input_ids, params, heads_per_ngram, eos_token_id, query_start_loc, ngram_context,
                       weight=weight)
    return _ngram_embedding_op(weight, input_ids, params.multipliers, params.head_sizes, params.head_offsets,
                               params.vocab_size, heads_per_ngram, eos_token_id, query_start_loc, ngram_context,
                               *_family(params), _checks.validating(validate))


# ---- NF4 tables: hash, gather and unpack in one kernel ---------------------------------------------------------


def _ngram_embedding_nf4_impl(weight: torch.Tensor, input_ids: torch.Tensor, multipliers: torch.Tensor,
                              head_sizes: torch.Tensor, head_offsets: torch.Tensor, vocab_size: int,
                              heads_per_ngram: int, eos_token_id: int, query_start_loc: torch.Tensor | None,
                              ngram_context: torch.Tensor | None, token_map: torch.Tensor | None, eos_rule: bool,
                              dtype: torch.dtype, validate: bool) -> torch.Tensor:
    if validate:
        _checks.ngram_values(input_ids, HashParams(multipliers, head_sizes, head_offsets, 0, vocab_size, token_map,
                                                   eos_rule),
                             heads_per_ngram, eos_token_id, query_start_loc, ngram_context, weight=weight)
    _, emb = _hash(input_ids, multipliers, head_sizes, head_offsets, heads_per_ngram, eos_token_id,
                   query_start_loc, ngram_context, weight=weight, write_ids=False, nf4_dtype=dtype,
                   token_map=token_map, eos_rule=eos_rule)
    return emb


def _ngram_embedding_nf4_fake(weight, input_ids, multipliers, head_sizes, head_offsets, vocab_size,
                              heads_per_ngram, eos_token_id, query_start_loc, ngram_context, token_map, eos_rule,
                              dtype, validate):
    return weight.new_empty((input_ids.shape[0], head_sizes.shape[0] * 2 * (weight.shape[1] - 4)), dtype=dtype)


_ngram_embedding_nf4_op = register("ngram_embedding_nf4", _ngram_embedding_nf4_impl,
                                   fake=_ngram_embedding_nf4_fake)


def ngram_embedding_nf4(weight: torch.Tensor, input_ids: torch.Tensor, params: HashParams, *, dtype: torch.dtype,
                        heads_per_ngram: int, eos_token_id: int, query_start_loc: torch.Tensor | None = None,
                        ngram_context: torch.Tensor | None = None, validate: bool = True) -> torch.Tensor:
    """The values of an NF4 table's rows for ``input_ids``' n-grams: hash, gather and unpack in one kernel.

    Not an op of docs/spec.md section 7 (``ple.fast`` only; the layer uses it for an NF4 table
    in the tokens' memory). It is, bit for bit::

        ple.reference.nf4_dequantize_rows(ple.reference.ngram_embedding(weight, input_ids, params, ...), D, dtype)

    with ``D = 2 * (W - 4)``: each packed row (``W = D/2 + 4`` bytes) is read once, as words of
    4 bytes where the row width allows it (2 or 1 bytes otherwise), and unpacked in registers
    (``level[code] * scale`` in float32, one rounding to ``dtype`` on the store); neither the ids
    nor the packed rows are written to memory. No autograd: an NF4 table does not train.

    Args:
        weight: uint8 ``[rows, D/2 + 4]``, NF4 rows (docs/spec.md section 13).
        input_ids, params, heads_per_ngram, eos_token_id, query_start_loc, ngram_context, validate:
            as for ``ngram_embedding``.
        dtype: the output's float dtype.

    Returns:
        ``[T, NH * D]`` in ``dtype``.

    Raises:
        TypeError: ``dtype`` is not a float dtype; ``weight`` is not uint8; the arguments of ``ngram_embedding``.
        ValueError: ``weight`` is not ``[rows, D/2 + 4]`` with D even and at least 2; as
            ``ngram_embedding``.
    """
    check_runnable("ngram_embedding_nf4", (weight, input_ids), {})
    _checks.ngram_meta(input_ids, params, heads_per_ngram, eos_token_id, query_start_loc, ngram_context,
                       weight=weight)
    if weight.dtype != torch.uint8:
        raise TypeError(f"weight: expected NF4 rows, uint8 [rows, D/2 + 4], got dtype {weight.dtype}")
    if weight.shape[1] < 5:
        raise ValueError(f"weight: expected NF4 rows, uint8 [rows, D/2 + 4] with D >= 2 even, got {weight.dtype} "
                         f"{tuple(weight.shape)}")
    if not isinstance(dtype, torch.dtype) or not dtype.is_floating_point:
        raise TypeError(f"dtype: expected a torch float dtype, got {dtype!r}")
    return _ngram_embedding_nf4_op(weight, input_ids, params.multipliers, params.head_sizes, params.head_offsets,
                                   params.vocab_size, heads_per_ngram, eos_token_id, query_start_loc,
                                   ngram_context, *_family(params), dtype, _checks.validating(validate))
