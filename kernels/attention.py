"""FlashAttention-2 in Triton: chapter 05's online softmax over key blocks, forward and backward.

Attention is softmax(q kᵀ · scale) v, one softmax per query row over its keys. Like the
cross-entropy's softmax over the vocabulary (chapter 05), that row never needs to exist as a whole:
a program holds a block of query rows and walks the keys one block at a time, keeping per row the
running maximum m, the running sum l of exp(s − m), and the accumulator acc of exp(s − m)·v. When a
new key block raises the maximum, l and acc are rescaled by exp(m_old − m_new) before the block's
terms are added. At the end out = acc / l, and the forward saves one float32 per row, the
log-sum-exp lse = m + log l, for the backward.

The backward recomputes each block of probabilities from the saved lse, p = exp(s − lse), instead of
keeping the [seq, seq] matrix. With dP = dO vᵀ and the preprocess delta = rowsum(dO ∘ O) (= rowsum(p
∘ dP)), the softmax's gradient is dS = p ∘ (dP − delta), and

    dV = pᵀ dO,      dK = scale · dSᵀ q,      dQ = scale · dS k.

Two kernels compute them without atomics: one program per key block accumulates dK and dV over every
query block (and, for grouped-query attention, over every query head of its KV head); one program
per query block accumulates dQ over every key block, as the forward does. A one-pass backward
(``Config.onepass``: the key-block program also adds its share of dQ into float32, with atomics or
the TMA's bulk reduction) is built and measured; it is off, slower on Hopper for want of registers
(assets/notes/attention.md, version 6).

Hopper (compute capability 9.0 and up): the kernels load their tiles through tensor descriptors,
one TMA copy per tile with the zeros past the end filled by the copy engine (``Config.tma``,
``tma_ready``; chapter 16, section 8); elsewhere, and for tensors whose addresses or strides the
copy engine cannot take, through pointers.

Layout: SDPA's [batch, heads, seq, head_dim], read through strides (Llama's q, k and v are
transposed views of [batch, seq, heads, head_dim] projections and are not copied). Grouped-query
attention (GQA): q has a multiple of k's heads, and query head h reads KV head h // (heads /
kv_heads); K and V are never repeated in memory.

Packed documents: with ``cu_seqlens`` (int32, [n_docs + 1], batch 1) the sequence holds documents
[cu_seqlens[i], cu_seqlens[i + 1]) and a query attends only to keys of its own document; with
``position_ids`` ([batch, seq]) each row's documents are the runs of consecutive positions. Each
token carries its document's first and one-past-last position (``segment_bounds``,
``segment_bounds_from_positions``; int32 [batch, seq]); a query block walks only the key blocks
between the start of its first row's document and the end of its last row's document, and a key is
masked where its document start differs from the query's. Padding-free SFT batches pack independent
examples this way.

Arithmetic is float32. On a GPU the matmuls take bf16/fp16 tiles into tensor cores with float32
accumulation (the product of two bf16 values is exact in float32, so this is the float32 matmul of
the rounded inputs); probabilities are rounded to the input dtype for the p·v and pᵀ·dO products, as
FlashAttention does. float32 inputs use IEEE float32 matmuls, not TF32. In Triton's interpreter
every tile is upcast to float32 first (its bf16 dot is wrong).

Order: kernels → launch configuration → host launches → operators → autograd → ``flash_attention``
and the float64 reference ``attention_reference``.
"""

from __future__ import annotations

import functools
import math
import numbers
from dataclasses import dataclass

import numpy as np
import torch
import triton
import triton.language as tl
from triton.runtime.errors import OutOfResources
from triton.tools.tensor_descriptor import TensorDescriptor

from . import ops, runtime

# Which version of the kernels this is: the benchmark records it, so a recorded timing says which
# code it timed. assets/notes/attention.md lists each version, what changed and what was measured of
# it.
VERSION = 6
LOG2E = 1.4426950408889634  # exp(x) = exp2(x · log2 e): the kernels work in base 2, exp2 is the hardware's
HEAD_DIMS = (16, 32, 64, 128)  # tl.dot needs 16 ≤ head_dim; 16 and 32 keep the interpreter's sizes small
DTYPES = (torch.float32, torch.bfloat16, torch.float16)

# --------------------------------------------------------------------------------------------------
# Kernels
# --------------------------------------------------------------------------------------------------


@triton.jit
def _tile(ptr, rows, n_rows, stride_row, cols, UPCAST: tl.constexpr):
    # A [rows, head_dim] tile of a [seq, head_dim] slice; rows past n_rows read as 0. Upcast in the
    # interpreter only.
    x = tl.load(ptr + rows[:, None].to(tl.int64) * stride_row + cols[None, :],
                mask=(rows < n_rows)[:, None], other=0.0)
    if UPCAST:
        x = x.to(tl.float32)
    return x


@triton.jit
def _rows(desc, ptr, b, h, start, n, stride_row, cols, BLOCK: tl.constexpr, D: tl.constexpr,
          DESC: tl.constexpr, UPCAST: tl.constexpr):
    # The [BLOCK, D] tile of rows start, start + 1, ... of (batch b, head h), rows past n read as 0:
    # through the TMA (desc: a tensor descriptor over [batch, heads, seq, d]; one instruction copies
    # the whole tile into shared memory, and the copy engine, not the threads, computes the
    # addresses and zero-fills past the end) or through pointers (ptr: this head's first row).
    if DESC:
        x = desc.load([b, h, start, 0]).reshape([BLOCK, D])
        if UPCAST:
            x = x.to(tl.float32)
    else:
        x = _tile(ptr, start + tl.arange(0, BLOCK), n, stride_row, cols, UPCAST)
    return x


@triton.jit
def _allowed(rows, cols, n, SEG, CAUSAL: tl.constexpr, PACKED: tl.constexpr):
    # Which (query row, key column) pairs take part: both in range, key not after the query
    # (causal), both in the same document (packed: equal document starts). rows and cols are
    # broadcastable 2-D indices ([M, 1] and [1, N] for a queries × keys tile, [1, M] and [N, 1] for
    # keys × queries), so one function serves both orientations.
    ok = (rows < n) & (cols < n)
    if CAUSAL:
        ok = ok & (cols <= rows)
    if PACKED:
        seg_r = tl.load(SEG + rows, mask=rows < n, other=-1)
        seg_c = tl.load(SEG + cols, mask=cols < n, other=-2)
        ok = ok & (seg_r == seg_c)
    return ok


@triton.jit
def _key_range(m0, n, SEG, SEG_END, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
               CAUSAL: tl.constexpr, PACKED: tl.constexpr):
    # The key blocks a query block [m0, m0 + BLOCK_M) can see: from its first row's document start
    # (rounded down to a block) to its last row's document end, and no further than its last row
    # when causal.
    lo = 0
    hi = n
    last = tl.minimum(m0 + BLOCK_M, n) - 1
    if PACKED:
        lo = (tl.load(SEG + m0) // BLOCK_N) * BLOCK_N
        hi = tl.load(SEG_END + last)
    if CAUSAL:
        hi = tl.minimum(hi, last + 1)
    return lo, hi


@triton.jit
def _query_range(n0, n, SEG, SEG_END, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                 CAUSAL: tl.constexpr, PACKED: tl.constexpr):
    # The query blocks that can see a key block [n0, n0 + BLOCK_N): from the first key's document
    # start (or the first key itself, causal), rounded down to a block, to the last key's document
    # end.
    lo = 0
    hi = n
    last = tl.minimum(n0 + BLOCK_N, n) - 1
    if PACKED:
        lo = tl.load(SEG + n0)
        hi = tl.load(SEG_END + last)
    if CAUSAL:
        lo = tl.maximum(lo, n0)
    lo = (lo // BLOCK_M) * BLOCK_M
    return lo, hi


@triton.jit
def _unmasked_end(m0, n, lo, BLOCK_N: tl.constexpr, CAUSAL: tl.constexpr, PACKED: tl.constexpr):
    # Where a query block's key walk needs its mask: every key block before the returned position is
    # wholly visible to every row (in range, and before the block's first row when causal), so it
    # skips the mask's compares and selects. Packed documents can end anywhere: everything is masked
    # there.
    if PACKED:
        return lo
    elif CAUSAL:
        return m0  # a multiple of BLOCK_N (attention_config keeps BLOCK_M a multiple of BLOCK_N)
    else:
        return (n // BLOCK_N) * BLOCK_N


@triton.jit
def _interior_keys(m0, n, lo, SEG, SEG_END, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                   CAUSAL: tl.constexpr):
    # Packed, a query block whose rows all lie in one document: the key blocks [a, b) that every row
    # sees whole, from the document's start rounded up to a block to the block's first row (causal)
    # or to the document's end rounded down. They need no mask. Rows in several documents: the empty
    # range at lo (everything masked).
    last = tl.minimum(m0 + BLOCK_M, n) - 1
    start = tl.load(SEG + m0)
    one_doc = start == tl.load(SEG + last)
    a = ((start + BLOCK_N - 1) // BLOCK_N) * BLOCK_N
    if CAUSAL:
        b = m0  # a multiple of BLOCK_N (attention_config keeps BLOCK_M a multiple of BLOCK_N)
    else:
        b = (tl.load(SEG_END + m0) // BLOCK_N) * BLOCK_N
    b = tl.where(b > a, b, a)
    return tl.where(one_doc, a, lo), tl.where(one_doc, b, lo)


@triton.jit
def _interior_queries(n0, n, lo, SEG, SEG_END, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                      CAUSAL: tl.constexpr):
    # The dK/dV walk's counterpart: for a key block whose keys all lie in one document, the query
    # blocks [a, b) whose every row sees every key: past the key block's last key (causal) or from
    # the document's start, rounded up to a query block, to the document's end rounded down. Keys in
    # several documents: the empty range at lo.
    last = tl.minimum(n0 + BLOCK_N, n) - 1
    start = tl.load(SEG + n0)
    one_doc = start == tl.load(SEG + last)
    if CAUSAL:
        a = ((n0 + BLOCK_N - 1 + BLOCK_M - 1) // BLOCK_M) * BLOCK_M
    else:
        a = ((start + BLOCK_M - 1) // BLOCK_M) * BLOCK_M
    b = (tl.load(SEG_END + n0) // BLOCK_M) * BLOCK_M
    b = tl.where(b > a, b, a)
    return tl.where(one_doc, a, lo), tl.where(one_doc, b, lo)


@triton.jit
def _fwd_step(q, k_desc, v_desc, k_base, v_base, b, hk, rows, n0, n, sk_s, sv_s, cols_d, SEG, qk_scale, m_i, l_i,
              acc, D: tl.constexpr, BLOCK_N: tl.constexpr, MASKED: tl.constexpr, CAUSAL: tl.constexpr,
              PACKED: tl.constexpr, UPCAST: tl.constexpr, PRECISION: tl.constexpr, DESC: tl.constexpr):
    # One key block [n0, n0 + BLOCK_N) of the online softmax.
    cols = n0 + tl.arange(0, BLOCK_N)
    k = _rows(k_desc, k_base, b, hk, n0, n, sk_s, cols_d, BLOCK_N, D, DESC, UPCAST)
    v = _rows(v_desc, v_base, b, hk, n0, n, sv_s, cols_d, BLOCK_N, D, DESC, UPCAST)
    s = _scores(q, k, rows[:, None], cols[None, :], n, SEG, qk_scale, CAUSAL, PACKED, PRECISION, MASKED)
    m_new = tl.maximum(m_i, tl.max(s, 1))
    m_ref = m_new
    # a row that has seen no key yet has m = -inf, and exp2(-inf - (-inf)) is NaN: measure from 0
    if MASKED:
        m_ref = tl.where(m_new == float("-inf"), 0.0, m_new)
    alpha = tl.exp2(m_i - m_ref)  # rescale what was summed under the old maximum
    p = tl.exp2(s - m_ref[:, None])
    l_i = l_i * alpha + tl.sum(p, 1)
    acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v, input_precision=PRECISION)
    return m_new, l_i, acc


@triton.jit
def _fwd_blocks(q, k_desc, v_desc, k_base, v_base, b, hk, rows, start, end, n, sk_s, sv_s, cols_d, SEG,
                qk_scale, m_i, l_i, acc,
                D: tl.constexpr, BLOCK_N: tl.constexpr, MASKED: tl.constexpr, CAUSAL: tl.constexpr,
                PACKED: tl.constexpr, UPCAST: tl.constexpr, PRECISION: tl.constexpr, DESC: tl.constexpr,
                WS: tl.constexpr):
    # The online softmax over key blocks start, start + BLOCK_N, ... < end: the forward's inner
    # loop. WS: Triton splits the loop between warps that only issue the loads and warps that only
    # compute (warp specialisation), instead of every warp doing both in turn.
    if WS:
        for n0 in tl.range(start, end, BLOCK_N, warp_specialize=True):
            m_i, l_i, acc = _fwd_step(q, k_desc, v_desc, k_base, v_base, b, hk, rows, n0, n, sk_s, sv_s, cols_d,
                                      SEG, qk_scale, m_i, l_i, acc, D, BLOCK_N, MASKED, CAUSAL, PACKED, UPCAST,
                                      PRECISION, DESC)
    else:
        for n0 in range(start, end, BLOCK_N):
            m_i, l_i, acc = _fwd_step(q, k_desc, v_desc, k_base, v_base, b, hk, rows, n0, n, sk_s, sv_s, cols_d,
                                      SEG, qk_scale, m_i, l_i, acc, D, BLOCK_N, MASKED, CAUSAL, PACKED, UPCAST,
                                      PRECISION, DESC)
    return m_i, l_i, acc


@triton.jit
def _fwd_kernel(
    Q, K, V, OUT, LSE, SEG, SEG_END,
    sq_b, sq_h, sq_s, sk_b, sk_h, sk_s, sv_b, sv_h, sv_s, so_b, so_h, so_s,
    n, qk_scale, n_heads,
    GROUP: tl.constexpr, D: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
    CAUSAL: tl.constexpr, PACKED: tl.constexpr, UPCAST: tl.constexpr, PRECISION: tl.constexpr,
    INTERIOR: tl.constexpr = False, DESC: tl.constexpr = False, WS: tl.constexpr = False,
    q_desc=None, k_desc=None, v_desc=None,  # tensor descriptors, read when DESC
):
    # One program: BLOCK_M query rows of one (batch, head). qk_scale = scale · log2 e (exp2 below).
    m0 = tl.program_id(0) * BLOCK_M
    bh = tl.program_id(1).to(tl.int64)
    b = bh // n_heads
    h = bh % n_heads
    hk = h // GROUP  # GQA: the KV head this query head reads
    SEG += b * n  # this row's document bounds (read only when PACKED)
    SEG_END += b * n
    rows = m0 + tl.arange(0, BLOCK_M)
    cols_d = tl.arange(0, D)
    q = _rows(q_desc, Q + b * sq_b + h * sq_h, b.to(tl.int32), h.to(tl.int32), m0, n, sq_s, cols_d, BLOCK_M, D,
              DESC, UPCAST)
    k_base = K + b * sk_b + hk * sk_h
    v_base = V + b * sv_b + hk * sv_h
    b32, hk32 = b.to(tl.int32), hk.to(tl.int32)  # a descriptor's coordinates are 32-bit

    # -inf, not a finite stand-in: any finite start would zero a row whose scaled scores all lie
    # below it.
    m_i = tl.full([BLOCK_M], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_M], tl.float32)
    acc = tl.zeros([BLOCK_M, D], tl.float32)
    lo, hi = _key_range(m0, n, SEG, SEG_END, BLOCK_M, BLOCK_N, CAUSAL, PACKED)
    if PACKED and INTERIOR:  # masked [lo, a), whole [a, z), masked [z, hi)
        a, z = _interior_keys(m0, n, lo, SEG, SEG_END, BLOCK_M, BLOCK_N, CAUSAL)
        m_i, l_i, acc = _fwd_blocks(q, k_desc, v_desc, k_base, v_base, b32, hk32, rows, lo, a, n, sk_s, sv_s,
                                    cols_d, SEG, qk_scale, m_i, l_i, acc,
                                    D, BLOCK_N, True, CAUSAL, PACKED, UPCAST, PRECISION, DESC, WS)
    else:  # whole [lo, z), masked [z, hi)
        a = lo
        z = _unmasked_end(m0, n, lo, BLOCK_N, CAUSAL, PACKED)
    m_i, l_i, acc = _fwd_blocks(q, k_desc, v_desc, k_base, v_base, b32, hk32, rows, a, z, n, sk_s, sv_s, cols_d,
                                SEG, qk_scale, m_i, l_i, acc,
                                D, BLOCK_N, False, CAUSAL, PACKED, UPCAST, PRECISION, DESC, WS)
    m_i, l_i, acc = _fwd_blocks(q, k_desc, v_desc, k_base, v_base, b32, hk32, rows, z, hi, n, sk_s, sv_s, cols_d,
                                SEG, qk_scale, m_i, l_i, acc,
                                D, BLOCK_N, True, CAUSAL, PACKED, UPCAST, PRECISION, DESC, WS)

    # Rows past n only: every real row sees at least its own key, and l = 0 there means its scores
    # overflowed float32 to -inf, which leaves NaN (0 / 0) as SDPA's softmax does, not a row of
    # zeros.
    l_safe = tl.where(rows < n, l_i, 1.0)
    out = acc / l_safe[:, None]
    ok = rows < n
    o_at = OUT + b * so_b + h * so_h + rows[:, None].to(tl.int64) * so_s + cols_d[None, :]
    tl.store(o_at, out.to(OUT.dtype.element_ty), mask=ok[:, None])
    # lse in natural log: m is in base 2 (scores were multiplied by log2 e).
    tl.store(LSE + bh * n + rows, (m_i + tl.log2(l_safe)) / 1.4426950408889634, mask=ok)


@triton.jit
def _delta_kernel(OUT, DO, DELTA, so_b, so_h, so_s, sd_b, sd_h, sd_s, n, n_heads,
                  D: tl.constexpr, BLOCK_M: tl.constexpr):
    # The backward's preprocess: delta = rowsum(dO ∘ O), one float32 per query row.
    bh = tl.program_id(1).to(tl.int64)
    b = bh // n_heads
    h = bh % n_heads
    rows = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)
    cols_d = tl.arange(0, D)
    o = _tile(OUT + b * so_b + h * so_h, rows, n, so_s, cols_d, True)
    do = _tile(DO + b * sd_b + h * sd_h, rows, n, sd_s, cols_d, True)
    tl.store(DELTA + bh * n + rows, tl.sum(o * do, 1), mask=rows < n)


@triton.jit
def _scores(a, b, rows, cols, n, SEG, qk_scale, CAUSAL: tl.constexpr, PACKED: tl.constexpr,
            PRECISION: tl.constexpr, MASKED: tl.constexpr):
    # The scaled scores a · bᵀ (base 2), -inf where _allowed says no: queries × keys for a = q, b =
    # k, or keys × queries for a = k, b = q. rows (query indices) and cols (key indices) come
    # broadcastable to that orientation.
    s = tl.dot(a, tl.trans(b), input_precision=PRECISION) * qk_scale
    if MASKED:
        s = tl.where(_allowed(rows, cols, n, SEG, CAUSAL, PACKED), s, float("-inf"))
    return s


@triton.jit
def _dq_blocks(q, do, k_desc, v_desc, k_base, v_base, b, hk, rows, start, end, n, sk_s, sv_s, cols_d, lse2, delta,
               SEG, qk_scale, dq,
               D: tl.constexpr, BLOCK_N: tl.constexpr, MASKED: tl.constexpr, CAUSAL: tl.constexpr,
               PACKED: tl.constexpr, UPCAST: tl.constexpr, PRECISION: tl.constexpr, DESC: tl.constexpr):
    # dQ += dS · K over key blocks start, start + BLOCK_N, ... < end: the dQ kernel's inner loop.
    for n0 in range(start, end, BLOCK_N):
        cols = n0 + tl.arange(0, BLOCK_N)
        k = _rows(k_desc, k_base, b, hk, n0, n, sk_s, cols_d, BLOCK_N, D, DESC, UPCAST)
        v = _rows(v_desc, v_base, b, hk, n0, n, sv_s, cols_d, BLOCK_N, D, DESC, UPCAST)
        s = _scores(q, k, rows[:, None], cols[None, :], n, SEG, qk_scale, CAUSAL, PACKED, PRECISION, MASKED)
        p = tl.exp2(s - lse2[:, None])  # recomputed from the saved log-sum-exp (lse2: base 2)
        dp = tl.dot(do, tl.trans(v), input_precision=PRECISION)
        ds = p * (dp - delta[:, None])
        dq += tl.dot(ds.to(k.dtype), k, input_precision=PRECISION)
    return dq


@triton.jit
def _masked_query_end(n0, lo, hi, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, CAUSAL: tl.constexpr,
                      PACKED: tl.constexpr):
    # Where a key block's query walk stops needing its mask: from the returned position on, every
    # query block sees every key of [n0, n0 + BLOCK_N) (causal: its first row is at or past the
    # block's last key). Rows and keys past n need no mask here: their q, dO and k read as 0, so
    # they add 0 to dK and dV, and dK, dV of keys past n are not stored. Packed documents can end
    # anywhere: everything is masked there.
    if PACKED:
        return hi
    elif CAUSAL:
        return tl.minimum(hi, ((n0 + BLOCK_N - 1 + BLOCK_M - 1) // BLOCK_M) * BLOCK_M)
    else:
        return lo


@triton.jit
def _dkdv_blocks(q_desc, do_desc, b, h, q_base, do_base, sq_h, sd_h, k, v, cols, start, end, n, sq_s, sd_s, cols_d,
                 LSE, DELTA, bh, SEG,
                 qk_scale, dk, dv, HEADS: tl.constexpr, D: tl.constexpr, BLOCK_M: tl.constexpr,
                 MASKED: tl.constexpr, CAUSAL: tl.constexpr, PACKED: tl.constexpr, UPCAST: tl.constexpr,
                 PRECISION: tl.constexpr, DESC: tl.constexpr):
    # dV += Pᵀ · dO and dK += dSᵀ · Q over query blocks start, start + BLOCK_M, ... < end of HEADS
    # consecutive query heads (from q_base, do_base and bh on): the dK/dV kernel's inner loop, one
    # loop over (head, query block). The tiles are keys × queries (sᵀ = k · qᵀ), so that pᵀ and dSᵀ
    # enter dV's and dK's products as they stand, with no transpose of a tile held in registers.
    steps = tl.cdiv(end - start, BLOCK_M)
    for it in range(0, HEADS * steps):
        if HEADS == 1:  # dense rows' loop: no division per step (assets/notes/attention.md, version 5)
            g = 0
            m0 = start + it * BLOCK_M
        else:
            g = it // steps
            m0 = start + (it - g * steps) * BLOCK_M
        rows = m0 + tl.arange(0, BLOCK_M)
        q = _rows(q_desc, q_base + g * sq_h, b, h + g, m0, n, sq_s, cols_d, BLOCK_M, D, DESC, UPCAST)
        do = _rows(do_desc, do_base + g * sd_h, b, h + g, m0, n, sd_s, cols_d, BLOCK_M, D, DESC, UPCAST)
        lse2 = tl.load(LSE + (bh + g) * n + rows, mask=rows < n, other=0.0) * 1.4426950408889634
        delta = tl.load(DELTA + (bh + g) * n + rows, mask=rows < n, other=0.0)
        st = _scores(k, q, rows[None, :], cols[:, None], n, SEG, qk_scale, CAUSAL, PACKED, PRECISION, MASKED)
        pt = tl.exp2(st - lse2[None, :])
        dv += tl.dot(pt.to(do.dtype), do, input_precision=PRECISION)
        dpt = tl.dot(v, tl.trans(do), input_precision=PRECISION)
        dst = pt * (dpt - delta[None, :])
        dk += tl.dot(dst.to(q.dtype), q, input_precision=PRECISION)
    return dk, dv


@triton.jit
def _key_block(k_base, v_base, k_desc, v_desc, SEG, SEG_END, b, hk, n0, n, sk_s, sv_s, cols_d,
               BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, D: tl.constexpr, CAUSAL: tl.constexpr,
               PACKED: tl.constexpr, INTERIOR: tl.constexpr, DESC: tl.constexpr, UPCAST: tl.constexpr):
    # What a backward program over the key block [n0, n0 + BLOCK_N) starts from: its k and v tiles
    # and its walk over the query blocks, masked [lo, a), whole [a, z), masked [z, hi) (packed
    # rows with the interior walk), else masked [lo, a), whole [a, hi) (z = hi).
    k = _rows(k_desc, k_base, b, hk, n0, n, sk_s, cols_d, BLOCK_N, D, DESC, UPCAST)
    v = _rows(v_desc, v_base, b, hk, n0, n, sv_s, cols_d, BLOCK_N, D, DESC, UPCAST)
    lo, hi = _query_range(n0, n, SEG, SEG_END, BLOCK_M, BLOCK_N, CAUSAL, PACKED)
    if PACKED and INTERIOR:
        a, z = _interior_queries(n0, n, lo, SEG, SEG_END, BLOCK_M, BLOCK_N, CAUSAL)
    else:
        a = _masked_query_end(n0, lo, hi, BLOCK_M, BLOCK_N, CAUSAL, PACKED)
        z = hi
    return k, v, lo, a, z, hi


@triton.jit
def _bwd_dkdv_kernel(
    Q, K, V, DO, LSE, DELTA, DK, DV, SEG, SEG_END,
    sq_b, sq_h, sq_s, sk_b, sk_h, sk_s, sv_b, sv_h, sv_s, sd_b, sd_h, sd_s,
    sdk_b, sdk_h, sdk_s, sdv_b, sdv_h, sdv_s,
    n, qk_scale, scale, n_kv_heads,
    GROUP: tl.constexpr, D: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
    CAUSAL: tl.constexpr, PACKED: tl.constexpr, UPCAST: tl.constexpr, PRECISION: tl.constexpr,
    INTERIOR: tl.constexpr = False, HEADS: tl.constexpr = 1, DESC: tl.constexpr = False,
    q_desc=None, k_desc=None, v_desc=None, do_desc=None,  # tensor descriptors, read when DESC
):
    # One program: BLOCK_N keys of one (batch, KV head); dK and dV summed over every query head of
    # the group and every query block that sees them. The blocks on the diagonal (causal) or in
    # packed documents are masked; the rest not.
    n0 = tl.program_id(0) * BLOCK_N
    bhk = tl.program_id(1).to(tl.int64)
    b = bhk // n_kv_heads
    hk = bhk % n_kv_heads
    SEG += b * n
    SEG_END += b * n
    cols = n0 + tl.arange(0, BLOCK_N)
    cols_d = tl.arange(0, D)
    b32 = b.to(tl.int32)  # a descriptor's coordinates are 32-bit
    k, v, lo, a, z, hi = _key_block(K + b * sk_b + hk * sk_h, V + b * sv_b + hk * sv_h, k_desc, v_desc, SEG, SEG_END,
                                    b32, hk.to(tl.int32), n0, n, sk_s, sv_s, cols_d, BLOCK_M, BLOCK_N, D, CAUSAL,
                                    PACKED, INTERIOR, DESC, UPCAST)
    dk = tl.zeros([BLOCK_N, D], tl.float32)
    dv = tl.zeros([BLOCK_N, D], tl.float32)
    # HEADS = GROUP: each range once, over every head of the group (one pipelined loop each); HEADS
    # = 1: each head's ranges in turn.
    for g in range(GROUP // HEADS):
        h = hk * GROUP + g
        bh = b * (n_kv_heads * GROUP) + h
        q_base = Q + b * sq_b + h * sq_h
        do_base = DO + b * sd_b + h * sd_h
        h32 = h.to(tl.int32)
        dk, dv = _dkdv_blocks(q_desc, do_desc, b32, h32, q_base, do_base, sq_h, sd_h, k, v, cols, lo, a, n, sq_s, sd_s,
                              cols_d, LSE, DELTA, bh, SEG, qk_scale, dk, dv,
                              HEADS, D, BLOCK_M, True, CAUSAL, PACKED, UPCAST, PRECISION, DESC)
        dk, dv = _dkdv_blocks(q_desc, do_desc, b32, h32, q_base, do_base, sq_h, sd_h, k, v, cols, a, z, n, sq_s, sd_s,
                              cols_d, LSE, DELTA, bh, SEG, qk_scale, dk, dv,
                              HEADS, D, BLOCK_M, False, CAUSAL, PACKED, UPCAST, PRECISION, DESC)
        if PACKED and INTERIOR:
            dk, dv = _dkdv_blocks(q_desc, do_desc, b32, h32, q_base, do_base, sq_h, sd_h, k, v, cols, z, hi, n, sq_s,
                                  sd_s, cols_d, LSE, DELTA, bh, SEG, qk_scale, dk, dv,
                                  HEADS, D, BLOCK_M, True, CAUSAL, PACKED, UPCAST, PRECISION, DESC)
    ok = (cols < n)[:, None]
    tl.store(DK + b * sdk_b + hk * sdk_h + cols[:, None].to(tl.int64) * sdk_s + cols_d[None, :],
             (dk * scale).to(DK.dtype.element_ty), mask=ok)
    tl.store(DV + b * sdv_b + hk * sdv_h + cols[:, None].to(tl.int64) * sdv_s + cols_d[None, :],
             dv.to(DV.dtype.element_ty), mask=ok)


@triton.jit
def _bwd_dq_kernel(
    Q, K, V, DO, LSE, DELTA, DQ, SEG, SEG_END,
    sq_b, sq_h, sq_s, sk_b, sk_h, sk_s, sv_b, sv_h, sv_s, sd_b, sd_h, sd_s, sdq_b, sdq_h, sdq_s,
    n, qk_scale, scale, n_heads,
    GROUP: tl.constexpr, D: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
    CAUSAL: tl.constexpr, PACKED: tl.constexpr, UPCAST: tl.constexpr, PRECISION: tl.constexpr,
    INTERIOR: tl.constexpr = False, DESC: tl.constexpr = False,
    q_desc=None, k_desc=None, v_desc=None, do_desc=None,  # tensor descriptors, read when DESC
):
    # One program: BLOCK_M query rows of one (batch, head), dQ summed over the key blocks they see
    # (the forward's walk).
    m0 = tl.program_id(0) * BLOCK_M
    bh = tl.program_id(1).to(tl.int64)
    b = bh // n_heads
    h = bh % n_heads
    hk = h // GROUP
    SEG += b * n
    SEG_END += b * n
    rows = m0 + tl.arange(0, BLOCK_M)
    cols_d = tl.arange(0, D)
    b32, h32, hk32 = b.to(tl.int32), h.to(tl.int32), hk.to(tl.int32)  # a descriptor's coordinates are 32-bit
    q = _rows(q_desc, Q + b * sq_b + h * sq_h, b32, h32, m0, n, sq_s, cols_d, BLOCK_M, D, DESC, UPCAST)
    do = _rows(do_desc, DO + b * sd_b + h * sd_h, b32, h32, m0, n, sd_s, cols_d, BLOCK_M, D, DESC, UPCAST)
    lse2 = tl.load(LSE + bh * n + rows, mask=rows < n, other=0.0) * 1.4426950408889634
    delta = tl.load(DELTA + bh * n + rows, mask=rows < n, other=0.0)
    k_base = K + b * sk_b + hk * sk_h
    v_base = V + b * sv_b + hk * sv_h
    dq = tl.zeros([BLOCK_M, D], tl.float32)
    lo, hi = _key_range(m0, n, SEG, SEG_END, BLOCK_M, BLOCK_N, CAUSAL, PACKED)
    if PACKED and INTERIOR:  # masked [lo, a), whole [a, full), masked [full, hi)
        a, full = _interior_keys(m0, n, lo, SEG, SEG_END, BLOCK_M, BLOCK_N, CAUSAL)
        dq = _dq_blocks(q, do, k_desc, v_desc, k_base, v_base, b32, hk32, rows, lo, a, n, sk_s, sv_s, cols_d, lse2,
                        delta, SEG, qk_scale, dq, D, BLOCK_N, True, CAUSAL, PACKED, UPCAST, PRECISION, DESC)
    else:  # whole [lo, full), masked [full, hi)
        a = lo
        full = _unmasked_end(m0, n, lo, BLOCK_N, CAUSAL, PACKED)
    dq = _dq_blocks(q, do, k_desc, v_desc, k_base, v_base, b32, hk32, rows, a, full, n, sk_s, sv_s, cols_d, lse2,
                    delta, SEG, qk_scale, dq, D, BLOCK_N, False, CAUSAL, PACKED, UPCAST, PRECISION, DESC)
    dq = _dq_blocks(q, do, k_desc, v_desc, k_base, v_base, b32, hk32, rows, full, hi, n, sk_s, sv_s, cols_d, lse2,
                    delta, SEG, qk_scale, dq, D, BLOCK_N, True, CAUSAL, PACKED, UPCAST, PRECISION, DESC)
    tl.store(DQ + b * sdq_b + h * sdq_h + rows[:, None].to(tl.int64) * sdq_s + cols_d[None, :],
             (dq * scale).to(DQ.dtype.element_ty), mask=(rows < n)[:, None])


@triton.jit
def _onepass_blocks(q_desc, do_desc, dq_desc, q_base, do_base, dq_base, b, h, k, v, cols, start, end, n, sq_s,
                    sd_s, sdq_s, cols_d, LSE, DELTA, bh, SEG, qk_scale, scale, dk, dv,
                    D: tl.constexpr, BLOCK_M: tl.constexpr, MASKED: tl.constexpr, CAUSAL: tl.constexpr,
                    PACKED: tl.constexpr, UPCAST: tl.constexpr, PRECISION: tl.constexpr, DESC: tl.constexpr,
                    TMA_REDUCE: tl.constexpr):
    # The one-pass backward's inner loop over query blocks start, start + BLOCK_M, ... < end: the
    # dK/dV walk's four products, and a fifth, this key block's share of dQ = scale · dS · K, added
    # into the float32 dQ of those query rows. Other key blocks add theirs to the same rows, in no
    # fixed order: dQ is summed in float32 and its last bits may differ from run to run.
    for m0 in range(start, end, BLOCK_M):
        rows = m0 + tl.arange(0, BLOCK_M)
        q = _rows(q_desc, q_base, b, h, m0, n, sq_s, cols_d, BLOCK_M, D, DESC, UPCAST)
        do = _rows(do_desc, do_base, b, h, m0, n, sd_s, cols_d, BLOCK_M, D, DESC, UPCAST)
        lse2 = tl.load(LSE + bh * n + rows, mask=rows < n, other=0.0) * 1.4426950408889634
        delta = tl.load(DELTA + bh * n + rows, mask=rows < n, other=0.0)
        st = _scores(k, q, rows[None, :], cols[:, None], n, SEG, qk_scale, CAUSAL, PACKED, PRECISION, MASKED)
        pt = tl.exp2(st - lse2[None, :])
        dv += tl.dot(pt.to(do.dtype), do, input_precision=PRECISION)
        dpt = tl.dot(v, tl.trans(do), input_precision=PRECISION)
        dst = (pt * (dpt - delta[None, :])).to(q.dtype)
        dk += tl.dot(dst, q, input_precision=PRECISION)
        dq = tl.dot(tl.trans(dst), k, input_precision=PRECISION) * scale
        if TMA_REDUCE:  # the copy engine adds the tile into memory (cp.reduce.async.bulk): no thread waits
            dq_desc.atomic_add([b, h, m0, 0], dq.reshape([1, 1, BLOCK_M, D]))
        else:
            tl.atomic_add(dq_base + rows[:, None].to(tl.int64) * sdq_s + cols_d[None, :], dq,
                          mask=(rows < n)[:, None], sem="relaxed")
    return dk, dv


@triton.jit
def _bwd_onepass_kernel(
    Q, K, V, DO, LSE, DELTA, DQ, DK, DV, SEG, SEG_END,
    sq_b, sq_h, sq_s, sk_b, sk_h, sk_s, sv_b, sv_h, sv_s, sd_b, sd_h, sd_s, sdq_b, sdq_h, sdq_s,
    sdk_b, sdk_h, sdk_s, sdv_b, sdv_h, sdv_s,
    n, qk_scale, scale, n_kv_heads,
    GROUP: tl.constexpr, D: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
    CAUSAL: tl.constexpr, PACKED: tl.constexpr, UPCAST: tl.constexpr, PRECISION: tl.constexpr,
    INTERIOR: tl.constexpr = False, DESC: tl.constexpr = False, TMA_REDUCE: tl.constexpr = False,
    q_desc=None, k_desc=None, v_desc=None, do_desc=None, dq_desc=None,  # read when DESC (dq_desc: TMA_REDUCE)
):
    # One program: BLOCK_N keys of one (batch, KV head), as in _bwd_dkdv_kernel, which also adds
    # each query block's dQ share as it goes: five products per tile instead of the two kernels'
    # seven (the dQ kernel recomputes q·kᵀ and dO·vᵀ). DQ is float32 and starts at zero.
    n0 = tl.program_id(0) * BLOCK_N
    bhk = tl.program_id(1).to(tl.int64)
    b = bhk // n_kv_heads
    hk = bhk % n_kv_heads
    b32 = b.to(tl.int32)
    SEG += b * n
    SEG_END += b * n
    cols = n0 + tl.arange(0, BLOCK_N)
    cols_d = tl.arange(0, D)
    k, v, lo, a, z, hi = _key_block(K + b * sk_b + hk * sk_h, V + b * sv_b + hk * sv_h, k_desc, v_desc, SEG, SEG_END,
                                    b32, hk.to(tl.int32), n0, n, sk_s, sv_s, cols_d, BLOCK_M, BLOCK_N, D, CAUSAL,
                                    PACKED, INTERIOR, DESC, UPCAST)
    dk = tl.zeros([BLOCK_N, D], tl.float32)
    dv = tl.zeros([BLOCK_N, D], tl.float32)
    for g in range(GROUP):
        h = hk * GROUP + g
        bh = b * (n_kv_heads * GROUP) + h
        h32 = h.to(tl.int32)
        q_base = Q + b * sq_b + h * sq_h
        do_base = DO + b * sd_b + h * sd_h
        dq_base = DQ + b * sdq_b + h * sdq_h
        dk, dv = _onepass_blocks(q_desc, do_desc, dq_desc, q_base, do_base, dq_base, b32, h32, k, v, cols, lo, a,
                                 n, sq_s, sd_s, sdq_s, cols_d, LSE, DELTA, bh, SEG, qk_scale, scale, dk, dv,
                                 D, BLOCK_M, True, CAUSAL, PACKED, UPCAST, PRECISION, DESC, TMA_REDUCE)
        dk, dv = _onepass_blocks(q_desc, do_desc, dq_desc, q_base, do_base, dq_base, b32, h32, k, v, cols, a, z,
                                 n, sq_s, sd_s, sdq_s, cols_d, LSE, DELTA, bh, SEG, qk_scale, scale, dk, dv,
                                 D, BLOCK_M, False, CAUSAL, PACKED, UPCAST, PRECISION, DESC, TMA_REDUCE)
        if PACKED and INTERIOR:
            dk, dv = _onepass_blocks(q_desc, do_desc, dq_desc, q_base, do_base, dq_base, b32, h32, k, v, cols, z,
                                     hi, n, sq_s, sd_s, sdq_s, cols_d, LSE, DELTA, bh, SEG, qk_scale, scale, dk,
                                     dv, D, BLOCK_M, True, CAUSAL, PACKED, UPCAST, PRECISION, DESC, TMA_REDUCE)
    ok = (cols < n)[:, None]
    tl.store(DK + b * sdk_b + hk * sdk_h + cols[:, None].to(tl.int64) * sdk_s + cols_d[None, :],
             (dk * scale).to(DK.dtype.element_ty), mask=ok)
    tl.store(DV + b * sdv_b + hk * sdv_h + cols[:, None].to(tl.int64) * sdv_s + cols_d[None, :],
             dv.to(DV.dtype.element_ty), mask=ok)


# --------------------------------------------------------------------------------------------------
# Launch configuration
# --------------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class BlockConfig:
    """One kernel's tile: query rows and keys per tile, warps and pipeline stages."""

    block_m: int  # query rows per tile
    block_n: int  # keys per tile
    num_warps: int
    num_stages: int


@dataclass(frozen=True)
class Config:
    """The tiles of the forward and both backward kernels, the delta preprocess's rows per program,
    and whether packed rows take the mask-free interior walk."""

    forward: BlockConfig
    dkdv: BlockConfig  # the backward's key-block kernel
    dq: BlockConfig  # the backward's query-block kernel
    delta_rows: int  # rows per program of the rowsum(dO ∘ O) preprocess
    # packed: walk the blocks wholly inside one document without the mask (PACKED_INTERIOR)
    interior: bool = False
    # The one-pass backward's tile (_bwd_onepass_kernel: dQ added into float32 as the dK/dV walk
    # goes); None runs the two kernels above (dkdv, dq), which need no atomics.
    onepass: BlockConfig | None = None
    # Hopper's machinery, each where it measured faster (assets/notes/attention.md, version 6):
    tma: bool = False  # tiles loaded through tensor descriptors (the TMA) in the forward and one pass
    tma_reduce: bool = False  # the one pass adds dQ with the TMA's bulk reduction, not atomics
    warp_specialize: bool = False  # the forward's key loop split between loading and computing warps


_INTERPRETER_BLOCK = 128  # the interpreter pays per program, not per element: big tiles keep launches few

# Packed documents: whether the kernels run the key (or query) blocks that lie wholly inside one
# document without the mask, as they do the blocks before the diagonal of a dense row. The tests run
# both ways; the timings of both walks are in assets/notes/attention.md ("The interior walk").
PACKED_INTERIOR = True

# Whether GPUs with the TMA (compute capability 9.0 and up) load the forward's and the backward's
# tiles through tensor descriptors (on since version 6; assets/notes/attention.md). The benchmark
# times both.
USE_TMA = True
# Packed rows take the pointer loads even there: their kernels ran faster with the TMA in the tile
# sweep, but the whole packed call did not, measured end to end (assets/notes/attention.md,
# version 6). The benchmark times both.
PACKED_TMA = False


def attention_config(seq: int, head_dim: int, props: runtime.DeviceProps | None = None,
                     element_size: int = 2, packed: bool = False) -> Config:
    """Block sizes of the forward and both backward kernels for a sequence of ``seq`` tokens and
    ``head_dim``, for inputs of ``element_size`` bytes (2: bf16 or fp16; 4: float32), of dense rows
    or of ``packed`` documents. A GPU whose shared memory cannot hold these tiles gets smaller ones
    at launch (``shrinking``).

    Args:
        seq: tokens per sequence.
        head_dim: the heads' width.
        props: the device's properties; None reads the current device's.
        element_size: bytes per element of q, k and v.
        packed: documents packed along the sequence (``cu_seqlens`` or ``position_ids``).

    Returns:
        the ``Config`` (cached per arguments).
    """
    return _attention_config(seq, head_dim, props or runtime.device_props(), element_size,
                             PACKED_INTERIOR, packed, USE_TMA and (PACKED_TMA or not packed))


@functools.lru_cache(maxsize=256)
def _attention_config(seq: int, head_dim: int, props: runtime.DeviceProps, element_size: int,
                      interior: bool, packed: bool = False, use_tma: bool = True) -> Config:
    if props.interpreter:
        block = min(_INTERPRETER_BLOCK, max(16, triton.next_power_of_2(max(seq, 1))))
        one = BlockConfig(block, block, 4, 1)
        return Config(one, one, one, block, interior)
    # Hopper tiles, chosen by timing rather than autotuned: `python -m
    # kernels.bench.attention_blocks` (d = 128, 8,192 tokens; the sweep and its figures:
    # assets/notes/attention.md, "Tiles measured"). The forward takes 128 query rows by 128 keys
    # with 8 warps and 3 stages of K/V prefetch. Both backward kernels hold float32 accumulators
    # besides their recomputed [BLOCK_M, BLOCK_N] tiles, and run fastest at 64 × 64 with 4 warps and
    # 2 stages. d = 64 was not swept. float32 tiles take twice the bytes: half the rows and keys,
    # for checking rather than training (not timed). Packed rows of short documents walk a few key
    # blocks per query block, and the forward runs fastest there at 64 × 64 with 4 warps and 2
    # stages (the same sweep with --documents 1024, "Tiles for packed rows"); the backward's tiles
    # stay the fastest there.
    #
    # On Hopper (version 6) every kernel loads its tiles through tensor descriptors, the same tiles
    # measured fastest with them (the sweep with its TMA rows). The one-pass backward and warp
    # specialisation stay off: both measured slower there (assets/notes/attention.md, version 6).
    wide = head_dim > 64
    if element_size > 2:
        forward = dkdv = dq = BlockConfig(64, 64, 4, 2)
    else:
        forward = BlockConfig(64, 64, 4, 2) if packed and wide else BlockConfig(128, 128,
                                                                                8 if wide else 4, 3)
        dkdv = BlockConfig(64, 64, 4, 2)
        dq = BlockConfig(64, 64, 4, 2)
    tma = use_tma and props.capability >= (9, 0)
    config = Config(forward, dkdv, dq, 64, interior, tma=tma)
    check_config(config)
    return config


def check_config(config: Config) -> None:
    """Raise a ``ValueError`` for tiles the kernels compute wrong: the forward's and the dQ kernel's
    ``block_m`` must be a multiple of their ``block_n`` (their mask-free walk ends at the query
    block's first row, which must be a whole number of key blocks). The dK/dV kernel takes any
    shape.

    Args:
        config: the configuration to check.

    Raises:
        ValueError: the forward's or the dQ kernel's ``block_m`` not a multiple of its ``block_n``,
            or ``tma_reduce`` without a one-pass tile.
    """
    for name, block in (("forward", config.forward), ("dq", config.dq)):
        if block.block_m % block.block_n:
            raise ValueError(f"config.{name} has block_m={block.block_m} and block_n={block.block_n}: the {name} "
                             "kernel needs block_m a multiple of block_n")
    if config.tma_reduce and config.onepass is None:
        raise ValueError("config.tma_reduce adds the one-pass backward's dQ: it needs config.onepass, a tile")


def shrinking(block: BlockConfig, divisible: bool):
    """``block``, then ever smaller tiles: two pipeline stages instead of more, then half the keys,
    then half the rows (down to 16 each), then one stage. A GPU with less shared memory per block
    than a tile needs (a consumer card has under half of Hopper's) refuses the launch; the launch
    then takes the next one. ``divisible`` keeps ``block_m`` a multiple of ``block_n``, as the query
    kernels' mask-free walk needs.

    Args:
        block: the tile asked for.
        divisible: keep ``block_m`` a multiple of ``block_n``.

    Yields:
        ``BlockConfig``s, ``block`` first, down to 16 × 16 with one stage.
    """
    m, n, warps, stages = block.block_m, block.block_n, block.num_warps, block.num_stages
    yield block
    while True:
        if stages > 2:
            stages = 2
        elif n > 16:
            n //= 2
        elif m > 16:
            m //= 2
        elif stages > 1:
            stages = 1
        else:
            return
        if divisible and m % n:
            n = m
        yield BlockConfig(m, n, warps if m * n > 64 * 64 else min(warps, 4), stages)


# (kernel, device, tile asked for, head_dim, dtype, flags) -> tile launched
_FITTED: dict[tuple, BlockConfig] = {}


def _launch(kernel, grid, block: BlockConfig, fit: bool, divisible: bool, key: tuple, *args, descriptors=None,
            **meta) -> None:
    """``kernel[grid(tile)](*args)`` with ``block``'s tile, or where ``fit`` is set and this GPU's
    shared memory cannot hold it, with the first of ``shrinking(block)`` that it can (remembered per
    ``key``). An explicit configuration is launched as given: a tile sweep must see its own tile
    fail, not a smaller one run. ``descriptors(tile)``, when given, names the tensor descriptors of
    that tile (a descriptor's box is the tile's shape)."""
    key = (kernel.fn.__name__, block, *key)
    tiles = shrinking(_FITTED.get(key, block), divisible) if fit else iter([block])
    error = None
    for tile in tiles:
        try:
            kernel[grid(tile)](*args, BLOCK_M=tile.block_m, BLOCK_N=tile.block_n, num_warps=tile.num_warps,
                               num_stages=tile.num_stages, **(descriptors(tile) if descriptors else {}), **meta)
        except OutOfResources as exc:  # raised before the kernel runs: nothing was written
            if not fit:
                raise
            error = exc
            continue
        _FITTED[key] = tile
        return
    raise RuntimeError(f"{kernel.fn.__name__}: no tile down to 16 × 16 fits this GPU's shared memory ({error})")


# --------------------------------------------------------------------------------------------------
# Host side: launches
# --------------------------------------------------------------------------------------------------


def segment_bounds(cu_seqlens: torch.Tensor, seq: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Each token's document start and end (int32, [1, seq] each) for documents ``cu_seqlens`` (no
    host sync).

    Args:
        cu_seqlens: int32 [n_docs + 1] document offsets, from 0 to ``seq``.
        seq: the sequence's length.

    Returns:
        ``(start, end)``: each token's document's first and one-past-last position.
    """
    # The boundaries searched are cu_seqlens itself, not a slice of it: Inductor (torch 2.11) cannot
    # lower a searchsorted over a slice of a tensor computed in the graph.
    pos = torch.arange(seq, device=cu_seqlens.device, dtype=cu_seqlens.dtype)
    doc = (torch.searchsorted(cu_seqlens, pos, right=True) - 1).clamp_(min=0)
    return cu_seqlens[doc][None], cu_seqlens[doc + 1][None]


def segment_bounds_from_positions(position_ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Each token's document start and end (int32, [batch, seq] each) where documents are the runs
    of consecutive position ids (0, 1, 2, 0, 1, ... : a new document wherever a position is not the
    previous one plus 1, as ``DataCollatorWithFlattening`` writes them). Tensor operations only: no
    host sync, traceable.

    Args:
        position_ids: an integer [batch, seq] tensor.

    Returns:
        ``(start, end)``: each token's document's first and one-past-last position, contiguous.
    """
    batch, seq = position_ids.shape
    idx = torch.arange(seq, device=position_ids.device).expand(batch, seq)
    new = torch.ones(batch, seq, dtype=torch.bool, device=position_ids.device)
    prev, cur = position_ids[:, :-1], position_ids[:, 1:]
    # prev + 1 wraps at the dtype's maximum (uint8 255 -> 0, int64's max -> its min): that is no
    # continuation.
    new[:, 1:] = (cur != prev + 1) | (prev == torch.iinfo(position_ids.dtype).max)
    start = running_max(torch.where(new, idx, 0))
    # The end of i's document is the next document's start after i (or seq): a running minimum from
    # the right.
    later_starts = torch.cat([torch.where(new, idx, seq)[:, 1:], idx.new_full((batch, 1), seq)], dim=1)
    end = -running_max(-later_starts.flip(1)).flip(1)
    return start.to(torch.int32).contiguous(), end.to(torch.int32).contiguous()


_SCAN_CHUNK = 256


def running_max(x: torch.Tensor) -> torch.Tensor:
    """``x.cummax(dim=1).values`` of a [batch, seq] tensor, in two levels: within chunks of 256,
    then each chunk's maximum carried into the chunks after it. PyTorch scans a whole row in one
    thread block, which at long rows took as long as a tenth of the packed forward
    (assets/notes/attention.md, "The packed rows' segments"). The chunks scan side by side instead.

    Args:
        x: a [batch, seq] tensor.

    Returns:
        The running maximum along dim 1, of ``x``'s shape and dtype.

    Raises:
        ValueError: ``x`` not 2-D.
    """
    if x.dim() != 2:
        raise ValueError(f"running_max takes a [batch, seq] tensor, got shape {tuple(x.shape)}")
    batch, seq = x.shape
    pad = (-seq) % _SCAN_CHUNK
    if pad:  # repeating the last value changes no earlier maximum
        x = torch.cat([x, x[:, -1:].expand(batch, pad)], dim=1)
    chunks = (seq + _SCAN_CHUNK - 1) // _SCAN_CHUNK
    local = x.reshape(batch, chunks, _SCAN_CHUNK).cummax(dim=2).values
    through = local[:, :, -1].cummax(dim=1).values  # the maximum up to the end of each chunk
    local[:, 1:] = torch.maximum(local[:, 1:], through[:, :-1, None])
    return local.reshape(batch, chunks * _SCAN_CHUNK)[:, :seq]


def _unit_last(t: torch.Tensor) -> torch.Tensor:
    # Columns must be adjacent (the kernels add a column index to a row's address); any other stride
    # is read as is.
    return t if t.stride(-1) == 1 else t.contiguous()


def _precision(dtype: torch.dtype) -> str:
    # float32 tiles (float32 inputs, and every tile in the interpreter, which upcasts): IEEE float32
    # matmuls, since TF32 would leave ~1e-3 errors. bf16/fp16 tiles on a GPU ignore the choice.
    return "ieee" if dtype == torch.float32 or runtime.INTERPRET else "tf32"


def _seg_args(seg_start, seg_end, like: torch.Tensor):
    if seg_start is None:
        dummy = torch.zeros(1, dtype=torch.int32, device=like.device)
        return dummy, dummy, False
    return seg_start, seg_end, True


def _strides(t: torch.Tensor) -> tuple[int, int, int]:
    return t.stride(0), t.stride(1), t.stride(2)


def tma_ready(*tensors: torch.Tensor) -> bool:
    """Whether the TMA can read and write these [batch, heads, seq, head_dim] tensors through
    tensor descriptors: in Triton's interpreter (which emulates the loads), or on a GPU of compute
    capability 9.0 or newer (Hopper's copy engine) with each tensor's address and every stride but
    the last (which must be 1) a multiple of 16 bytes. Where not, the kernels load through pointers.

    Args:
        tensors: the tensors the kernel would read or write through descriptors.

    Returns:
        True where every tensor qualifies.
    """
    if not runtime.INTERPRET:
        if not tensors or any(t.device.type != "cuda" for t in tensors):
            return False
        if torch.cuda.get_device_capability(tensors[0].device)[0] < 9:
            return False
    for t in tensors:
        size = t.element_size()
        if t.stride(-1) != 1 or t.data_ptr() % 16 or any(st * size % 16 for st in t.stride()[:-1]):
            return False
    return True


def _descriptor(t: torch.Tensor, rows: int):
    # A tensor descriptor over [batch, heads, seq, head_dim] whose box is one head's [rows, head_dim]
    # tile; reads past seq come back as zeros, writes there are dropped.
    return TensorDescriptor(t, list(t.shape), list(t.stride()), [1, 1, rows, t.shape[-1]])


def attention_forward(q, k, v, causal: bool, scale: float, seg_start=None, seg_end=None,
                      config: Config | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """Launch the forward: ``(out, lse)``, out [batch, heads, seq, head_dim] (memory in [batch, seq,
    heads, head_dim] order, so Hugging Face's transpose back is free), lse float32 [batch, heads,
    seq] in natural log. An explicit ``config`` is checked first (``check_config``). The inputs are
    not checked here (``flash_attention`` does it).

    Args:
        q, k, v: [batch, heads, seq, head_dim] and [batch, kv_heads, seq, head_dim] (twice).
        causal: mask keys after each query.
        scale: the factor of q kᵀ.
        seg_start, seg_end: each token's document bounds (int32 [batch, seq]), or None for rows of
            one document.
        config: the tiles; None picks ``attention_config``'s, shrunk where this GPU needs it.

    Returns:
        ``(out, lse)``.

    Raises:
        ValueError: an explicit ``config`` that ``check_config`` refuses.
        RuntimeError: no tile down to 16 × 16 fits this GPU's shared memory.
        OutOfResources: an explicit ``config``'s tile that this GPU cannot hold (not shrunk).
    """
    q, k, v = _unit_last(q), _unit_last(k), _unit_last(v)
    batch, heads, seq, head_dim = q.shape
    out = torch.empty(batch, seq, heads, head_dim, dtype=q.dtype, device=q.device).transpose(1, 2)
    lse = torch.empty(batch, heads, seq, dtype=torch.float32, device=q.device)
    if config is not None:
        check_config(config)
    if out.numel() == 0:
        return out, lse
    cfg = config or attention_config(seq, head_dim, runtime.device_props(q.device), q.element_size(),
                                     seg_start is not None)
    seg, seg_e, packed = _seg_args(seg_start, seg_end, q)
    interior = packed and cfg.interior
    desc = cfg.tma and tma_ready(q, k, v)

    def descriptors(tile: BlockConfig) -> dict:
        if not desc:
            return {}
        return dict(q_desc=_descriptor(q, tile.block_m), k_desc=_descriptor(k, tile.block_n),
                    v_desc=_descriptor(v, tile.block_n))

    _launch(_fwd_kernel, lambda c: (triton.cdiv(seq, c.block_m), batch * heads), cfg.forward, config is None,
            True, (q.device, head_dim, q.dtype, causal, packed, interior, desc, cfg.warp_specialize),
            q, k, v, out, lse, seg, seg_e, *_strides(q), *_strides(k), *_strides(v), *_strides(out),
            seq, scale * LOG2E, heads, descriptors=descriptors,
            GROUP=heads // k.shape[1], D=head_dim, CAUSAL=causal, PACKED=packed, UPCAST=runtime.INTERPRET,
            PRECISION=_precision(q.dtype), INTERIOR=interior, DESC=desc, WS=cfg.warp_specialize)
    return out, lse


def attention_backward(grad_out, q, k, v, out, lse, causal: bool, scale: float, seg_start=None, seg_end=None,
                       config: Config | None = None) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Launch the backward: ``(dq, dk, dv)`` in the layouts of q, k and v (dense ones are kept).

    An explicit ``config`` is checked first (``check_config``).

    Args:
        grad_out: the gradient of the output.
        q, k, v, out, lse: the forward's inputs and outputs.
        causal, scale, seg_start, seg_end: as the forward's.
        config: the tiles; None picks ``attention_config``'s, shrunk where this GPU needs it.

    Returns:
        ``(dq, dk, dv)``.

    Raises:
        ValueError: an explicit ``config`` that ``check_config`` refuses.
        RuntimeError: no tile down to 16 × 16 fits this GPU's shared memory.
        OutOfResources: an explicit ``config``'s tile that this GPU cannot hold (not shrunk).
    """
    q, k, v, grad_out = _unit_last(q), _unit_last(k), _unit_last(v), _unit_last(grad_out)
    batch, heads, seq, head_dim = q.shape
    kv_heads = k.shape[1]
    dq, dk, dv = torch.empty_like(q), torch.empty_like(k), torch.empty_like(v)
    if config is not None:
        check_config(config)
    if q.numel() == 0:
        return dq, dk.zero_(), dv.zero_()
    cfg = config or attention_config(seq, head_dim, runtime.device_props(q.device), q.element_size(),
                                     seg_start is not None)
    seg, seg_e, packed = _seg_args(seg_start, seg_end, q)
    delta = torch.empty(batch, heads, seq, dtype=torch.float32, device=q.device)
    _delta_kernel[(triton.cdiv(seq, cfg.delta_rows), batch * heads)](
        out, grad_out, delta, *_strides(out), *_strides(grad_out), seq, heads, D=head_dim,
        BLOCK_M=cfg.delta_rows,
    )
    interior = packed and cfg.interior
    common = dict(GROUP=heads // kv_heads, D=head_dim, CAUSAL=causal, PACKED=packed,
                  UPCAST=runtime.INTERPRET,
                  PRECISION=_precision(q.dtype), INTERIOR=interior)
    key, fit = (q.device, head_dim, q.dtype, causal, packed, interior), config is None
    # Packed rows walk a few query blocks per key block and head: one loop over every head of the
    # group fills the pipeline once instead of once per head; dense rows' long walks run faster one
    # head at a time, where the longer loop's index arithmetic costs more than the fills it saves
    # (assets/notes/attention.md, version 5).
    # The one pass sums dQ with atomics in no fixed order: under torch.use_deterministic_algorithms
    # the two kernels run instead.
    if cfg.onepass is not None and not torch.are_deterministic_algorithms_enabled():
        return _onepass_backward(grad_out, q, k, v, lse, delta, dk, dv, seg, seg_e, scale, cfg, fit, key, common)
    group_heads = heads // kv_heads if packed else 1
    desc = cfg.tma and tma_ready(q, k, v, grad_out)
    key = (*key, desc)

    def descriptors(tile: BlockConfig) -> dict:
        if not desc:
            return {}
        return dict(q_desc=_descriptor(q, tile.block_m), do_desc=_descriptor(grad_out, tile.block_m),
                    k_desc=_descriptor(k, tile.block_n), v_desc=_descriptor(v, tile.block_n))

    _launch(_bwd_dkdv_kernel, lambda c: (triton.cdiv(seq, c.block_n), batch * kv_heads), cfg.dkdv,
            fit, False, key,
            q, k, v, grad_out, lse, delta, dk, dv, seg, seg_e,
            *_strides(q), *_strides(k), *_strides(v), *_strides(grad_out), *_strides(dk), *_strides(dv),
            seq, scale * LOG2E, scale, kv_heads, descriptors=descriptors, HEADS=group_heads, DESC=desc, **common)
    _launch(_bwd_dq_kernel, lambda c: (triton.cdiv(seq, c.block_m), batch * heads), cfg.dq, fit, True, key,
            q, k, v, grad_out, lse, delta, dq, seg, seg_e,
            *_strides(q), *_strides(k), *_strides(v), *_strides(grad_out), *_strides(dq),
            seq, scale * LOG2E, scale, heads, descriptors=descriptors, DESC=desc, **common)
    return dq, dk, dv


def _onepass_backward(grad_out, q, k, v, lse, delta, dk, dv, seg, seg_e, scale, cfg: Config, fit: bool, key: tuple,
                      common: dict):
    # The one-pass backward: dK and dV per key block, dQ summed into float32 (zeros first) by every
    # key block that sees its rows, then rounded to q's dtype in q's layout.
    batch, heads, seq, head_dim = q.shape
    kv_heads = k.shape[1]
    dq32 = torch.zeros_like(q, dtype=torch.float32)  # q's layout (zeros_like keeps a dense tensor's strides)
    desc = cfg.tma and tma_ready(q, k, v, grad_out, dq32)
    reduce = cfg.tma_reduce and tma_ready(dq32)
    if cfg.tma_reduce and runtime.INTERPRET:
        raise ValueError("config.tma_reduce: Triton's interpreter has no TMA reduction; the one-pass backward "
                         "adds dQ with atomics there (tma_reduce=False)")

    def descriptors(tile: BlockConfig) -> dict:
        named = {}
        if desc:
            named.update(q_desc=_descriptor(q, tile.block_m), do_desc=_descriptor(grad_out, tile.block_m),
                         k_desc=_descriptor(k, tile.block_n), v_desc=_descriptor(v, tile.block_n))
        if reduce:
            named["dq_desc"] = _descriptor(dq32, tile.block_m)
        return named

    _launch(_bwd_onepass_kernel, lambda c: (triton.cdiv(seq, c.block_n), batch * kv_heads), cfg.onepass, fit,
            False, (*key, desc, reduce),
            q, k, v, grad_out, lse, delta, dq32, dk, dv, seg, seg_e,
            *_strides(q), *_strides(k), *_strides(v), *_strides(grad_out), *_strides(dq32), *_strides(dk),
            *_strides(dv), seq, scale * LOG2E, scale, kv_heads, descriptors=descriptors,
            DESC=desc, TMA_REDUCE=reduce, **common)
    return dq32.to(q.dtype, memory_format=torch.preserve_format), dk, dv


# --------------------------------------------------------------------------------------------------
# Operators
# --------------------------------------------------------------------------------------------------


def _fwd_impl(q, k, v, causal, scale, seg_start, seg_end):
    return attention_forward(q, k, v, causal, scale, seg_start, seg_end)


def _fwd_fake(q, k, v, causal, scale, seg_start, seg_end):
    batch, heads, seq, head_dim = q.shape
    out = q.new_empty(batch, seq, heads, head_dim).transpose(1, 2)
    return out, q.new_empty(batch, heads, seq, dtype=torch.float32)


def _bwd_impl(grad_out, q, k, v, out, lse, causal, scale, seg_start, seg_end):
    return attention_backward(grad_out, q, k, v, out, lse, causal, scale, seg_start, seg_end)


def _bwd_fake(grad_out, q, k, v, out, lse, causal, scale, seg_start, seg_end):
    return torch.empty_like(_unit_last(q)), torch.empty_like(_unit_last(k)), torch.empty_like(_unit_last(v))


flash_attention_fwd = ops.define(
    "flash_attention_fwd(Tensor q, Tensor k, Tensor v, bool causal, float scale, Tensor? seg_start, "
    "Tensor? seg_end) -> (Tensor, Tensor)",
    _fwd_impl, _fwd_fake,
)
flash_attention_bwd = ops.define(
    "flash_attention_bwd(Tensor grad_out, Tensor q, Tensor k, Tensor v, Tensor out, Tensor lse, bool causal, "
    "float scale, Tensor? seg_start, Tensor? seg_end) -> (Tensor, Tensor, Tensor)",
    _bwd_impl, _bwd_fake,
)


# --------------------------------------------------------------------------------------------------
# Autograd and the functional form
# --------------------------------------------------------------------------------------------------


class FlashAttentionFunction(torch.autograd.Function):
    """Attention forward and backward as two operators; saves q, k, v, the output and the log-sum-exp."""

    @staticmethod
    def forward(ctx, q, k, v, causal: bool, scale: float, seg_start, seg_end):
        """Run the forward operator; save q, k, v, the output, lse and the document bounds.

        Args:
            ctx: autograd's context.
            q, k, v, causal, scale: as ``flash_attention``'s (scale resolved to a float).
            seg_start, seg_end: each token's document bounds, or None.
        """
        out, lse = ops.call(flash_attention_fwd, q, k, v, causal, scale, seg_start, seg_end)
        ctx.save_for_backward(q, k, v, out, lse, seg_start, seg_end)
        ctx.causal, ctx.scale = causal, scale
        return out

    @staticmethod
    def backward(ctx, grad_out):
        """The gradients of q, k and v (which raise if differentiated again).

        Args:
            ctx: autograd's context.
            grad_out: the gradient of the output.
        """
        q, k, v, out, lse, seg_start, seg_end = ctx.saved_tensors
        dq, dk, dv = ops.call(flash_attention_bwd, grad_out, q, k, v, out, lse, ctx.causal, ctx.scale,
                              seg_start, seg_end)
        if torch.is_grad_enabled() and any(t.requires_grad for t in (grad_out, q, k, v)):
            # create_graph=True: the backward kernel has no derivative of its own. Gradients that
            # silently carry none would make a gradient penalty's gradient wrong; these raise when
            # differentiated, as SDPA's fused kernels do.
            dq, dk, dv = _NoDoubleBackward.apply(dq, dk, dv, grad_out, q, k, v)
        return dq, dk, dv, None, None, None, None


class _NoDoubleBackward(torch.autograd.Function):
    """``(dq, dk, dv)`` as given, in the graph of what they were computed from (grad_out, q, k, v):
    differentiating them with respect to any of those raises, rather than finding no path and
    reading as zero."""

    @staticmethod
    def forward(ctx, dq, dk, dv, *sources):
        return dq.view_as(dq), dk.view_as(dk), dv.view_as(dv)

    @staticmethod
    def backward(ctx, *grad_grads):
        raise RuntimeError("flash_attention has no double backward (the derivative of its backward is not "
                           "implemented, as for SDPA's fused kernels): differentiate a gradient of attention with "
                           "F.scaled_dot_product_attention's math backend, or without create_graph=True")


def _check_tensor(name: str, t) -> None:
    if not isinstance(t, torch.Tensor):
        raise TypeError(f"{name} must be a tensor, got {type(t).__name__}")
    if t.dtype not in DTYPES:
        hint = ("cast it to float32 (or use torch.nn.functional.scaled_dot_product_attention for float64)"
                if t.dtype == torch.float64 else "expected float32, bfloat16 or float16")
        raise TypeError(f"{name} has dtype {t.dtype}, which the attention kernels do not take: {hint}")
    if t.dim() != 4:
        raise ValueError(f"{name} must be 4-D [batch, heads, seq, head_dim] (SDPA's layout), got {tuple(t.shape)}")


def check_inputs(q, k, v, causal, scale, cu_seqlens) -> None:
    """Raise a ``TypeError``/``ValueError`` naming the argument for anything ``flash_attention``
    does not take. ``cu_seqlens``'s values are not read here (``check_cu_seqlens``).

    Args:
        q, k, v, causal, scale, cu_seqlens: ``flash_attention``'s arguments.

    Raises:
        TypeError: a non-tensor, an unsupported or mixed dtype, a non-bool ``causal``, a
            non-real ``scale``, or a ``cu_seqlens`` that is not a 1-D int32 tensor.
        ValueError: shapes that do not fit, a head_dim not in ``HEAD_DIMS``, a scale out of
            float32's range, several devices, or a ``cu_seqlens`` too short, on another device or
            with a batch other than 1.
    """
    for name, t in (("q", q), ("k", k), ("v", v)):
        _check_tensor(name, t)
    if not (q.dtype == k.dtype == v.dtype):
        raise TypeError(f"q, k and v must have one dtype, got {q.dtype}, {k.dtype} and {v.dtype}")
    batch, heads, seq, head_dim = q.shape
    if k.shape != v.shape:
        raise ValueError(f"k and v must have the same shape, got k {tuple(k.shape)} and v {tuple(v.shape)}")
    kv_batch, kv_heads, kv_seq, kv_dim = k.shape
    if kv_batch != batch or kv_seq != seq or kv_dim != head_dim:
        raise ValueError(f"k and v must be [batch={batch}, kv_heads, seq={seq}, head_dim={head_dim}] like q "
                         f"{tuple(q.shape)} (self-attention: one sequence length), got {tuple(k.shape)}")
    if kv_heads == 0 or heads % kv_heads:
        raise ValueError(f"q's heads ({heads}) must be a multiple of k's and v's heads ({kv_heads}) "
                         "(grouped-query attention)")
    if head_dim not in HEAD_DIMS:
        raise ValueError(f"head_dim must be one of {HEAD_DIMS}, got {head_dim}")
    if not isinstance(causal, (bool, np.bool_)):
        raise TypeError(f"causal must be a bool, got {type(causal).__module__}.{type(causal).__name__}")
    if scale is not None:
        if isinstance(scale, bool) or not isinstance(scale, numbers.Real):
            raise TypeError(f"scale must be a real number or None (1/sqrt(head_dim)), got {type(scale).__name__}")
        try:
            value = float(scale)
        except OverflowError:  # an int past float's range
            value = math.inf
        # The kernels multiply the scores by scale · log2 e in float32: past float32's range that is
        # inf.
        if not abs(value) * LOG2E <= _FLOAT32_MAX:
            big_int = isinstance(scale, numbers.Integral) and value == math.inf
            shown = "an int past float's range" if big_int else f"{value:.4g}"
            raise ValueError(f"scale must be finite, with |scale| · log2(e) within float32's range (|scale| ≤ "
                             f"{_FLOAT32_MAX / LOG2E:.4g}), got {shown}")
    devices = {t.device for t in (q, k, v)}
    if len(devices) > 1:
        raise ValueError(f"q, k and v must be on one device, got {q.device}, {k.device} and {v.device}")
    if not runtime.INTERPRET and q.device.type not in ("cuda", "meta"):  # meta: shapes only (the fakes)
        raise ValueError(f"in gpu mode q, k and v must be CUDA tensors, got tensors on {q.device}")
    if cu_seqlens is None:
        return
    if not isinstance(cu_seqlens, torch.Tensor) or cu_seqlens.dtype != torch.int32 or cu_seqlens.dim() != 1:
        got = (f"{cu_seqlens.dtype} tensor of shape {tuple(cu_seqlens.shape)}" if isinstance(cu_seqlens, torch.Tensor)
               else type(cu_seqlens).__name__)
        raise TypeError(f"cu_seqlens must be a 1-D int32 tensor [n_docs + 1], got {got}")
    if cu_seqlens.numel() < 2:
        raise ValueError(f"cu_seqlens must hold at least two offsets [0, ..., seq], got {cu_seqlens.numel()}")
    if batch != 1:
        raise ValueError(f"cu_seqlens packs documents along one row: q's batch must be 1, got {batch}")
    if cu_seqlens.device != q.device:
        raise ValueError(f"cu_seqlens must be on q's device {q.device}, got {cu_seqlens.device}")


def check_cu_seqlens(cu_seqlens: torch.Tensor, seq: int) -> None:
    """The values of ``cu_seqlens``: 0 first, ``seq`` last, never decreasing. Reads them to the host
    (a sync).

    Args:
        cu_seqlens: the document offsets.
        seq: the sequence's length.

    Raises:
        ValueError: values that do not rise from 0 to ``seq``.
    """
    values = cu_seqlens.tolist()
    if values[0] != 0 or values[-1] != seq or any(b < a for a, b in zip(values, values[1:])):
        shown = values if len(values) <= 12 else values[:6] + ["..."] + values[-6:]
        raise ValueError(f"cu_seqlens must rise from 0 to seq={seq} (document offsets), got {shown}")


# integer dtypes whose + PyTorch leaves unimplemented
_NO_ARITHMETIC = (torch.uint16, torch.uint32, torch.uint64)
_FLOAT32_MAX = float(torch.finfo(torch.float32).max)


def _check_position_ids(position_ids, q, cu_seqlens) -> None:
    if cu_seqlens is not None:
        raise ValueError("give cu_seqlens or position_ids, not both")
    if (not isinstance(position_ids,
                       torch.Tensor) or position_ids.is_floating_point() or position_ids.is_complex()
            # bool: True/False would read as positions 1/0, other documents
            or position_ids.dtype == torch.bool):
        got = position_ids.dtype if isinstance(position_ids, torch.Tensor) else type(position_ids).__name__
        raise TypeError(f"position_ids must be an integer tensor [batch, seq], got {got}")
    batch, seq = q.shape[0], q.shape[2]
    if position_ids.dtype in _NO_ARITHMETIC:
        raise TypeError(f"position_ids of dtype {position_ids.dtype}: PyTorch has no addition for it; cast it to "
                        "torch.int64")
    if position_ids.dim() != 2 or position_ids.shape[1] != seq or position_ids.shape[0] not in (1, batch):
        raise ValueError(f"position_ids must be [batch={batch} (or 1), seq={seq}], got {tuple(position_ids.shape)}")
    if position_ids.device != q.device:
        raise ValueError(f"position_ids must be on q's device {q.device}, got {position_ids.device}")


def flash_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, causal: bool = True,
                    scale: float | None = None, cu_seqlens: torch.Tensor | None = None, *,
                    position_ids: torch.Tensor | None = None,
                    check_cu_seqlens_values: bool = True) -> torch.Tensor:
    """FlashAttention-2: softmax(q kᵀ · scale [+ causal mask]) v, differentiable in q, k and v.

    Computes what ``F.scaled_dot_product_attention(q, k, v, is_causal=causal, scale=scale,
    enable_gqa=True)`` computes.

    q is [batch, heads, seq, head_dim], k and v [batch, kv_heads, seq, head_dim] with heads a
    multiple of kv_heads (grouped-query attention, K and V not repeated); head_dim one of 16, 32,
    64, 128; float32, bfloat16 or float16. Any strides with unit stride along head_dim are read in
    place (others are copied). ``scale`` defaults to 1/sqrt(head_dim).

    ``cu_seqlens`` (int32 [n_docs + 1], batch 1): documents packed along the sequence; no query
    attends across a document boundary. Its values are checked on the host (one synchronisation)
    unless ``check_cu_seqlens_values=False``, for callers that built it themselves (the Hugging Face
    patch does), and never while ``torch.compile`` traces.

    ``position_ids`` (integer, [batch, seq]; instead of ``cu_seqlens``): documents are the runs of
    consecutive positions in each row, a new one wherever the positions restart
    (``segment_bounds_from_positions``). Chapter 16 (notebooks/16_flash_attention.ipynb)
    derives it.

    Args:
        q: [batch, heads, seq, head_dim].
        k: [batch, kv_heads, seq, head_dim], heads a multiple of kv_heads.
        v: of ``k``'s shape.
        causal: mask keys after each query.
        scale: the factor of q kᵀ, by default 1/sqrt(head_dim).
        cu_seqlens: int32 [n_docs + 1] document boundaries of a batch of 1, or None.
        position_ids: [batch, seq] positions whose restarts start documents, or None.
        check_cu_seqlens_values: check ``cu_seqlens`` on the host (one synchronisation).

    Returns:
        The attention output, of ``q``'s shape and dtype.

    Raises:
        TypeError, ValueError: from ``check_inputs`` and the checks of ``cu_seqlens``'s values and
            of ``position_ids`` (not both may be given), naming the argument.
    """
    check_inputs(q, k, v, causal, scale, cu_seqlens)
    causal = bool(causal)  # a numpy bool: the operator's schema takes Python's
    seq, head_dim = q.shape[2], q.shape[3]
    scale = 1.0 / math.sqrt(head_dim) if scale is None else float(scale)
    seg_start = seg_end = None
    if position_ids is not None:
        _check_position_ids(position_ids, q, cu_seqlens)
        seg_start, seg_end = segment_bounds_from_positions(position_ids.expand(q.shape[0], seq))
    if cu_seqlens is not None:
        if check_cu_seqlens_values and not torch.compiler.is_compiling():
            check_cu_seqlens(cu_seqlens, seq)
        seg_start, seg_end = segment_bounds(cu_seqlens, seq)
    return FlashAttentionFunction.apply(q, k, v, causal, scale, seg_start, seg_end)


def document_mask(cu_seqlens: torch.Tensor, seq: int, causal: bool = True) -> torch.Tensor:
    """The boolean [seq, seq] mask ``flash_attention`` applies (True: the query row may attend to
    the key column). Chapter 16 (notebooks/16_flash_attention.ipynb) draws it.

    Args:
        cu_seqlens: int32 document offsets, or None for one document.
        seq: the sequence's length.
        causal: also mask keys after each query.

    Returns:
        the [seq, seq] boolean mask, on the CPU.
    """
    if cu_seqlens is None:
        allowed = torch.ones(seq, seq, dtype=torch.bool)
    else:
        start = segment_bounds(cu_seqlens.cpu(), seq)[0][0]
        allowed = start[:, None] == start[None, :]
    if causal:
        allowed = allowed & torch.ones(seq, seq, dtype=torch.bool).tril()
    return allowed


def attention_reference(q, k, v, causal: bool = True, scale: float | None = None,
                        cu_seqlens: torch.Tensor | None = None) -> torch.Tensor:
    """Plain PyTorch attention in the inputs' dtype (float64 for tests), K and V repeated for GQA,
    the mask materialised: what ``flash_attention`` must equal. Chapter 16
    (notebooks/16_flash_attention.ipynb) checks the kernel against it.

    Args:
        q, k, v: as ``flash_attention``'s.
        causal: mask keys after each query.
        scale: the factor of q kᵀ, by default 1/sqrt(head_dim).
        cu_seqlens: int32 document offsets, or None.

    Returns:
        the attention output, of ``q``'s shape and dtype.
    """
    heads, kv_heads, seq, head_dim = q.shape[1], k.shape[1], q.shape[2], q.shape[3]
    scale = 1.0 / math.sqrt(head_dim) if scale is None else scale
    k = k.repeat_interleave(heads // kv_heads, dim=1)
    v = v.repeat_interleave(heads // kv_heads, dim=1)
    s = (q @ k.transpose(-1, -2)) * scale
    s = s.masked_fill(~document_mask(cu_seqlens, seq, causal).to(s.device), float("-inf"))
    return torch.softmax(s, dim=-1) @ v
