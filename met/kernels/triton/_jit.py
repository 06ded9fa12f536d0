"""The jitted Triton functions of met.kernels.triton.attention (imported only on first use:
triton is needed to import this module)."""

import triton
import triton.language as tl


@triton.jit
def tanh(x):
    t = tl.exp(-2.0 * tl.abs(x))
    y = (1.0 - t) / (1.0 + t)
    return tl.where(x < 0, -y, y)

@triton.jit
def attn_kernel(Q, K, V, KS, VS, OUT, SLOTS, TILE_SEQ, TILE_M0,
                Q_START, Q_LEN, CTX_LEN, SLOT_START,
                sq_t, sq_h, sk_h, sk_s, sv_h, sv_s, ss_h, so_t, so_h,
                scale, softcap, window,
                GROUP: tl.constexpr, GROUP_PAD: tl.constexpr, BLOCK_M: tl.constexpr,
                BLOCK_N: tl.constexpr, HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr,
                QUANT: tl.constexpr, SOFTCAP: tl.constexpr, WINDOW: tl.constexpr,
                IEEE: tl.constexpr, UPCAST: tl.constexpr):
    tile = tl.program_id(0)
    kvh = tl.program_id(1)
    seq = tl.load(TILE_SEQ + tile)
    m0 = tl.load(TILE_M0 + tile)
    q_start = tl.load(Q_START + seq)
    q_len = tl.load(Q_LEN + seq)
    ctx = tl.load(CTX_LEN + seq)
    s0 = tl.load(SLOT_START + seq)
    r = tl.arange(0, BLOCK_M * GROUP_PAD)
    m = m0 + r // GROUP_PAD
    g = r % GROUP_PAD
    row_ok = (m < q_len) & (g < GROUP)
    pos = ctx - q_len + m
    d = tl.arange(0, BLOCK_D)
    d_ok = d < HEAD_DIM
    head = kvh * GROUP + g
    q_off = (q_start + m).to(tl.int64)[:, None] * sq_t + head[:, None] * sq_h + d[None, :]
    q = tl.load(Q + q_off, mask=row_ok[:, None] & d_ok[None, :], other=0.0)
    if UPCAST:
        q = q.to(tl.float32)
    # Keys this tile's rows can see: up to its last row's position, from the window of
    # its first row.
    hi = ctx - q_len + tl.minimum(m0 + BLOCK_M, q_len)
    lo = 0
    if WINDOW:
        lo = tl.maximum(ctx - q_len + m0 - window + 1, 0)
    m_i = tl.full([BLOCK_M * GROUP_PAD], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_M * GROUP_PAD], tl.float32)
    acc = tl.zeros([BLOCK_M * GROUP_PAD, BLOCK_D], tl.float32)
    for start in range(lo, hi, BLOCK_N):
        n = start + tl.arange(0, BLOCK_N)
        n_ok = n < hi
        slot = tl.load(SLOTS + s0 + n, mask=n_ok, other=0).to(tl.int64)
        kv_mask = n_ok[:, None] & d_ok[None, :]
        k = tl.load(K + kvh * sk_h + slot[:, None] * sk_s + d[None, :], mask=kv_mask,
                    other=0.0)
        if QUANT or UPCAST:
            k = k.to(q.dtype)
        if IEEE:
            s = tl.dot(q, tl.trans(k), input_precision="ieee")
        else:
            s = tl.dot(q, tl.trans(k))
        if QUANT:
            ks = tl.load(KS + kvh * ss_h + slot, mask=n_ok, other=0.0)
            s = s * ks[None, :]
        s = s * scale
        if SOFTCAP:
            s = softcap * tanh(s / softcap)
        valid = row_ok[:, None] & n_ok[None, :] & (n[None, :] <= pos[:, None])
        if WINDOW:
            valid = valid & (pos[:, None] - n[None, :] < window)
        s = tl.where(valid, s, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(s, 1))
        m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)
        alpha = tl.exp(m_i - m_safe)
        p = tl.exp(s - m_safe[:, None])
        l_i = l_i * alpha + tl.sum(p, 1)
        v = tl.load(V + kvh * sv_h + slot[:, None] * sv_s + d[None, :], mask=kv_mask,
                    other=0.0)
        if QUANT:
            vs = tl.load(VS + kvh * ss_h + slot, mask=n_ok, other=0.0)
            p = p * vs[None, :]
        if QUANT or UPCAST:
            v = v.to(q.dtype)
        if IEEE:
            pv = tl.dot(p.to(v.dtype), v, input_precision="ieee")
        else:
            pv = tl.dot(p.to(v.dtype), v)
        acc = acc * alpha[:, None] + pv
        m_i = m_new
    l_safe = tl.where(l_i > 0, l_i, 1.0)
    out = acc / l_safe[:, None]
    o_off = (q_start + m).to(tl.int64)[:, None] * so_t + head[:, None] * so_h + d[None, :]
    tl.store(OUT + o_off, out.to(OUT.dtype.element_ty), mask=row_ok[:, None] & d_ok[None, :])

@triton.jit
def rint(x):
    # Round half to even (what torch.round does), from floor.
    f = tl.floor(x)
    diff = x - f
    odd = (f - 2.0 * tl.floor(f * 0.5)) != 0.0
    up = (diff > 0.5) | ((diff == 0.5) & odd)
    return tl.where(up, f + 1.0, f)

@triton.jit
def e4m3_round(y):
    # y (|y| <= 448) rounded half to even onto the float8 e4m3 grid: 3 mantissa bits, steps
    # of 2^-9 below 2^-6 (subnormals). The stored conversion is then exact on every device
    # (the interpreter's own float8 conversion rounds wrongly).
    bits = y.to(tl.int32, bitcast=True)
    e = tl.maximum(((bits >> 23) & 0xFF) - 127, -6)
    step = ((e - 3 + 127) << 23).to(tl.float32, bitcast=True)
    return rint(y / step) * step


@triton.jit
def write_row(X, C, S, t, h, slot, sx_t, sx_h, sc_h, sc_s, ss_h,
              HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr, QUANT: tl.constexpr):
    d = tl.arange(0, BLOCK_D)
    ok = d < HEAD_DIM
    x = tl.load(X + t * sx_t + h * sx_h + d, mask=ok, other=0.0)
    dst = C + h * sc_h + slot * sc_s + d
    if QUANT == 0:
        tl.store(dst, x.to(C.dtype.element_ty), mask=ok)
    else:
        xf = x.to(tl.float32)
        qmax = 127.0 if QUANT == 1 else 448.0
        amax = tl.max(tl.abs(xf), 0)
        sc = tl.div_rn(amax, qmax)
        safe = tl.where(sc > 0, sc, 1.0)
        y = tl.where(sc > 0, tl.div_rn(xf, safe), 0.0)
        if QUANT == 1:
            y = tl.minimum(tl.maximum(rint(y), -127.0), 127.0)
        else:
            y = e4m3_round(tl.minimum(tl.maximum(y, -448.0), 448.0))
        tl.store(dst, y.to(C.dtype.element_ty), mask=ok)
        tl.store(S + h * ss_h + slot, sc)

@triton.jit
def write_kernel(K, V, KC, VC, KS, VS, SLOT, sk_t, sk_h, sv_t, sv_h,
                 sc_h, sc_s, ss_h, HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr,
                 QUANT: tl.constexpr):
    t = tl.program_id(0)
    h = tl.program_id(1)
    slot = tl.load(SLOT + t).to(tl.int64)
    write_row(K, KC, KS, t, h, slot, sk_t, sk_h, sc_h, sc_s, ss_h, HEAD_DIM, BLOCK_D, QUANT)
    write_row(V, VC, VS, t, h, slot, sv_t, sv_h, sc_h, sc_s, ss_h, HEAD_DIM, BLOCK_D, QUANT)
