"""Triton kernels of the fused gated flash attention (forward, backward preprocess, dK/dV, dQ).

Only the @triton.jit code lives here; the launch logic, masks and autograd are in `triton_attention.py`. Importing
this module imports Triton, and Triton decides at decoration time whether a kernel is compiled for the GPU or run by
its CPU interpreter (`TRITON_INTERPRET=1` must be set before this module is first imported).

Notation: B batch, H query heads, KV key/value heads (GQA: query head h reads KV head h // N_REP), T queries,
S keys, D head_dim padded to D_PAD (a power of two >= 16, as tl.dot needs). Every tensor is addressed through its
strides, so the (B, H, T, D) transposed views the model hands over are never copied.

Masking (all combined with AND): CAUSAL keeps key j for query i iff j <= i + causal_offset (0 = upper-left as
torch's is_causal, S - T = bottom-right as with a KV cache); HAS_KV loads a per-(batch, key) validity byte (key or
left padding); HAS_DENSE loads a (B|1, H|1, T, S) byte mask tile (any other mask the model passes). A row that sees
no key at all outputs 0 with zero gradients (eager's uniform-over-masked-keys output there is meaningless).

Gate (G1, applied in the forward epilogue): GATE=0 none, 1 elementwise logits (B, T, H, D), 2 headwise logits
(B, T, H, 1); out = o * gate_scale * sigmoid(logit), computed in fp32 before the single store of `out`.
With out = o * g the backward needs neither o nor g stored: Delta = rowsum(dOut * out) (= rowsum(dO_eff * o)),
d logit = dOut * out * (1 - sigmoid(logit)) (summed over D when headwise), dO_eff = dOut * g.
"""
from __future__ import annotations

import triton
import triton.language as tl


@triton.jit
def _tile_mask(offs_m, offs_n, b, h, T, S, causal_offset, KVALID, skvb, skvn, MASK, smb, smh, smm, smn,
               CAUSAL: tl.constexpr, HAS_KV: tl.constexpr, HAS_DENSE: tl.constexpr):
    """(BLOCK_M, BLOCK_N) bool: query offs_m may attend key offs_n."""
    valid = (offs_m[:, None] < T) & (offs_n[None, :] < S)
    if CAUSAL:
        valid = valid & (offs_n[None, :] <= offs_m[:, None] + causal_offset)
    if HAS_KV:
        kv = tl.load(KVALID + b * skvb + offs_n * skvn, mask=offs_n < S, other=0)
        valid = valid & (kv != 0)[None, :]
    if HAS_DENSE:
        mt = tl.load(MASK + b * smb + h * smh + offs_m[:, None] * smm + offs_n[None, :] * smn,
                     mask=(offs_m[:, None] < T) & (offs_n[None, :] < S), other=0)
        valid = valid & (mt != 0)
    return valid


@triton.jit
def _fwd_kernel(Q, K, V, G, Out, Lse, KVALID, MASK,
                sqb, sqh, sqm, sqd, skb, skh, skn, skd, svb, svh, svn, svd,
                sgb, sgh, sgm, sgd, sob, soh, som, sod, skvb, skvn, smb, smh, smm, smn,
                H, N_REP, T, S, causal_offset, sm_scale, gate_scale,
                HEAD_DIM: tl.constexpr, D_PAD: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                CAUSAL: tl.constexpr, HAS_KV: tl.constexpr, HAS_DENSE: tl.constexpr, GATE: tl.constexpr,
                PRECISION: tl.constexpr):
    pid_m = tl.program_id(0)
    pid_bh = tl.program_id(1)
    b = pid_bh // H
    h = pid_bh % H
    kvh = h // N_REP
    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_d = tl.arange(0, D_PAD)
    m_ok = offs_m < T
    d_ok = offs_d < HEAD_DIM
    q = tl.load(Q + b * sqb + h * sqh + offs_m[:, None] * sqm + offs_d[None, :] * sqd,
                mask=m_ok[:, None] & d_ok[None, :], other=0.0)  # (BLOCK_M, D_PAD)
    m_i = tl.full([BLOCK_M], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_M], tl.float32)
    acc = tl.zeros([BLOCK_M, D_PAD], tl.float32)
    hi = S
    if CAUSAL:  # the last query of this block sees keys < (pid_m + 1) * BLOCK_M + causal_offset
        hi = tl.minimum(S, (pid_m + 1) * BLOCK_M + causal_offset)
    for start_n in range(0, hi, BLOCK_N):
        offs_n = start_n + tl.arange(0, BLOCK_N)
        n_ok = offs_n < S
        kt = tl.load(K + b * skb + kvh * skh + offs_n[None, :] * skn + offs_d[:, None] * skd,
                     mask=n_ok[None, :] & d_ok[:, None], other=0.0)  # (D_PAD, BLOCK_N)
        qk = tl.dot(q, kt, input_precision=PRECISION) * sm_scale  # (BLOCK_M, BLOCK_N) fp32
        valid = _tile_mask(offs_m, offs_n, b, h, T, S, causal_offset, KVALID, skvb, skvn, MASK, smb, smh, smm, smn,
                           CAUSAL, HAS_KV, HAS_DENSE)
        qk = tl.where(valid, qk, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(qk, 1))
        m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)  # a row with no key yet: keep exp() finite
        p = tl.exp(qk - m_safe[:, None])
        alpha = tl.exp(m_i - m_safe)
        l_i = l_i * alpha + tl.sum(p, 1)
        v = tl.load(V + b * svb + kvh * svh + offs_n[:, None] * svn + offs_d[None, :] * svd,
                    mask=n_ok[:, None] & d_ok[None, :], other=0.0)  # (BLOCK_N, D_PAD)
        acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v, input_precision=PRECISION)
        m_i = m_new
    empty = l_i == 0.0
    o = acc / tl.where(empty, 1.0, l_i)[:, None]  # (BLOCK_M, D_PAD) fp32, the ungated output (never stored)
    lse = tl.where(empty, 0.0, m_i + tl.log(tl.where(empty, 1.0, l_i)))
    tl.store(Lse + pid_bh * T + offs_m, lse, mask=m_ok)
    # --- epilogue: the G1 gate, in registers, before the only store of the output ---
    if GATE == 1:
        gl = tl.load(G + b * sgb + h * sgh + offs_m[:, None] * sgm + offs_d[None, :] * sgd,
                     mask=m_ok[:, None] & d_ok[None, :], other=0.0).to(tl.float32)
        o = o * (tl.sigmoid(gl) * gate_scale)
    if GATE == 2:
        gl = tl.load(G + b * sgb + h * sgh + offs_m * sgm, mask=m_ok, other=0.0).to(tl.float32)
        o = o * (tl.sigmoid(gl) * gate_scale)[:, None]
    tl.store(Out + b * sob + h * soh + offs_m[:, None] * som + offs_d[None, :] * sod, o.to(Out.dtype.element_ty),
             mask=m_ok[:, None] & d_ok[None, :])


@triton.jit
def _bwd_preprocess(Out, DOut, G, DG, DOE, Delta,
                    sob, soh, som, sod, sdb, sdh, sdm, sdd, sgb, sgh, sgm, sgd, sggb, sggh, sggm, sggd,
                    seb, seh, sem, sed,
                    H, T, gate_scale,
                    HEAD_DIM: tl.constexpr, D_PAD: tl.constexpr, BLOCK_M: tl.constexpr, GATE: tl.constexpr):
    """Delta = rowsum(dOut * out); with a gate also d logit and dO_eff = dOut * g (the attention's own dO)."""
    pid_m = tl.program_id(0)
    pid_bh = tl.program_id(1)
    b = pid_bh // H
    h = pid_bh % H
    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_d = tl.arange(0, D_PAD)
    m_ok = offs_m < T
    md = m_ok[:, None] & (offs_d < HEAD_DIM)[None, :]
    o = tl.load(Out + b * sob + h * soh + offs_m[:, None] * som + offs_d[None, :] * sod, mask=md, other=0.0)
    do = tl.load(DOut + b * sdb + h * sdh + offs_m[:, None] * sdm + offs_d[None, :] * sdd, mask=md, other=0.0)
    prod = do.to(tl.float32) * o.to(tl.float32)  # (BLOCK_M, D_PAD)
    delta = tl.sum(prod, 1)
    tl.store(Delta + pid_bh * T + offs_m, delta, mask=m_ok)
    if GATE == 1:
        gp = G + b * sgb + h * sgh + offs_m[:, None] * sgm + offs_d[None, :] * sgd
        s = tl.sigmoid(tl.load(gp, mask=md, other=0.0).to(tl.float32))
        tl.store(DG + b * sggb + h * sggh + offs_m[:, None] * sggm + offs_d[None, :] * sggd,
                 (prod * (1.0 - s)).to(DG.dtype.element_ty), mask=md)
        doe = do.to(tl.float32) * (s * gate_scale)
    if GATE == 2:
        s = tl.sigmoid(tl.load(G + b * sgb + h * sgh + offs_m * sgm, mask=m_ok, other=0.0).to(tl.float32))
        tl.store(DG + b * sggb + h * sggh + offs_m * sggm, (delta * (1.0 - s)).to(DG.dtype.element_ty), mask=m_ok)
        doe = do.to(tl.float32) * (s * gate_scale)[:, None]
    if GATE != 0:
        tl.store(DOE + b * seb + h * seh + offs_m[:, None] * sem + offs_d[None, :] * sed,
                 doe.to(DOE.dtype.element_ty), mask=md)


@triton.jit
def _bwd_dkdv(Q, K, V, DO, Lse, Delta, DK, DV, KVALID, MASK,
              sqb, sqh, sqm, sqd, skb, skh, skn, skd, svb, svh, svn, svd, sdb, sdh, sdm, sdd,
              sdkb, sdkh, sdkn, sdkd, sdvb, sdvh, sdvn, sdvd, skvb, skvn, smb, smh, smm, smn,
              H, KV, N_REP, T, S, causal_offset, sm_scale,
              HEAD_DIM: tl.constexpr, D_PAD: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
              CAUSAL: tl.constexpr, HAS_KV: tl.constexpr, HAS_DENSE: tl.constexpr, PRECISION: tl.constexpr):
    """One program per (key block, batch, KV head): sums over its N_REP query heads, so no atomics (GQA)."""
    pid_n = tl.program_id(0)
    pid_bkv = tl.program_id(1)
    b = pid_bkv // KV
    kvh = pid_bkv % KV
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    offs_d = tl.arange(0, D_PAD)
    nd = (offs_n < S)[:, None] & (offs_d < HEAD_DIM)[None, :]
    k = tl.load(K + b * skb + kvh * skh + offs_n[:, None] * skn + offs_d[None, :] * skd, mask=nd, other=0.0)
    v = tl.load(V + b * svb + kvh * svh + offs_n[:, None] * svn + offs_d[None, :] * svd, mask=nd, other=0.0)
    dk = tl.zeros([BLOCK_N, D_PAD], tl.float32)
    dv = tl.zeros([BLOCK_N, D_PAD], tl.float32)
    lo = 0
    if CAUSAL:  # queries i < pid_n * BLOCK_N - causal_offset see none of these keys
        lo = tl.maximum(0, pid_n * BLOCK_N - causal_offset)
        lo = (lo // BLOCK_M) * BLOCK_M
    for r in range(0, N_REP):
        h = kvh * N_REP + r
        for start_m in range(lo, T, BLOCK_M):
            offs_m = start_m + tl.arange(0, BLOCK_M)
            m_ok = offs_m < T
            md = m_ok[:, None] & (offs_d < HEAD_DIM)[None, :]
            q = tl.load(Q + b * sqb + h * sqh + offs_m[:, None] * sqm + offs_d[None, :] * sqd, mask=md, other=0.0)
            do = tl.load(DO + b * sdb + h * sdh + offs_m[:, None] * sdm + offs_d[None, :] * sdd, mask=md, other=0.0)
            lse = tl.load(Lse + (b * H + h) * T + offs_m, mask=m_ok, other=0.0)
            delta = tl.load(Delta + (b * H + h) * T + offs_m, mask=m_ok, other=0.0)
            qk = tl.dot(q, tl.trans(k), input_precision=PRECISION) * sm_scale  # (BLOCK_M, BLOCK_N)
            valid = _tile_mask(offs_m, offs_n, b, h, T, S, causal_offset, KVALID, skvb, skvn, MASK, smb, smh, smm,
                               smn, CAUSAL, HAS_KV, HAS_DENSE)
            p = tl.where(valid, tl.exp(tl.where(valid, qk, 0.0) - lse[:, None]), 0.0)
            dv += tl.dot(tl.trans(p.to(do.dtype)), do, input_precision=PRECISION)
            dp = tl.dot(do, tl.trans(v), input_precision=PRECISION)  # (BLOCK_M, BLOCK_N)
            ds = p * (dp - delta[:, None])
            dk += tl.dot(tl.trans(ds.to(q.dtype)), q, input_precision=PRECISION)
    dk = dk * sm_scale
    tl.store(DK + b * sdkb + kvh * sdkh + offs_n[:, None] * sdkn + offs_d[None, :] * sdkd,
             dk.to(DK.dtype.element_ty), mask=nd)
    tl.store(DV + b * sdvb + kvh * sdvh + offs_n[:, None] * sdvn + offs_d[None, :] * sdvd,
             dv.to(DV.dtype.element_ty), mask=nd)


@triton.jit
def _bwd_dq(Q, K, V, DO, Lse, Delta, DQ, KVALID, MASK,
            sqb, sqh, sqm, sqd, skb, skh, skn, skd, svb, svh, svn, svd, sdb, sdh, sdm, sdd,
            sdqb, sdqh, sdqm, sdqd, skvb, skvn, smb, smh, smm, smn,
            H, N_REP, T, S, causal_offset, sm_scale,
            HEAD_DIM: tl.constexpr, D_PAD: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
            CAUSAL: tl.constexpr, HAS_KV: tl.constexpr, HAS_DENSE: tl.constexpr, PRECISION: tl.constexpr):
    pid_m = tl.program_id(0)
    pid_bh = tl.program_id(1)
    b = pid_bh // H
    h = pid_bh % H
    kvh = h // N_REP
    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_d = tl.arange(0, D_PAD)
    m_ok = offs_m < T
    d_ok = offs_d < HEAD_DIM
    md = m_ok[:, None] & d_ok[None, :]
    q = tl.load(Q + b * sqb + h * sqh + offs_m[:, None] * sqm + offs_d[None, :] * sqd, mask=md, other=0.0)
    do = tl.load(DO + b * sdb + h * sdh + offs_m[:, None] * sdm + offs_d[None, :] * sdd, mask=md, other=0.0)
    lse = tl.load(Lse + pid_bh * T + offs_m, mask=m_ok, other=0.0)
    delta = tl.load(Delta + pid_bh * T + offs_m, mask=m_ok, other=0.0)
    dq = tl.zeros([BLOCK_M, D_PAD], tl.float32)
    hi = S
    if CAUSAL:
        hi = tl.minimum(S, (pid_m + 1) * BLOCK_M + causal_offset)
    for start_n in range(0, hi, BLOCK_N):
        offs_n = start_n + tl.arange(0, BLOCK_N)
        nd = (offs_n < S)[:, None] & d_ok[None, :]
        k = tl.load(K + b * skb + kvh * skh + offs_n[:, None] * skn + offs_d[None, :] * skd, mask=nd, other=0.0)
        v = tl.load(V + b * svb + kvh * svh + offs_n[:, None] * svn + offs_d[None, :] * svd, mask=nd, other=0.0)
        qk = tl.dot(q, tl.trans(k), input_precision=PRECISION) * sm_scale
        valid = _tile_mask(offs_m, offs_n, b, h, T, S, causal_offset, KVALID, skvb, skvn, MASK, smb, smh, smm, smn,
                           CAUSAL, HAS_KV, HAS_DENSE)
        p = tl.where(valid, tl.exp(tl.where(valid, qk, 0.0) - lse[:, None]), 0.0)
        dp = tl.dot(do, tl.trans(v), input_precision=PRECISION)
        ds = p * (dp - delta[:, None])
        dq += tl.dot(ds.to(k.dtype), k, input_precision=PRECISION)
    dq = dq * sm_scale
    tl.store(DQ + b * sdqb + h * sdqh + offs_m[:, None] * sdqm + offs_d[None, :] * sdqd,
             dq.to(DQ.dtype.element_ty), mask=md)
