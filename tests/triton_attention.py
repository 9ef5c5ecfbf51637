"""A small FlashAttention-2 (Dao 2023) forward and backward in Triton, for crosscheck to judge
(tests/test_triton_kernel.py), with planted bugs behind a flag.

    out, lse = flash_attention(q, k, v, causal="bottom_right", scale=0.2)
    out.backward(dout)                          # q.grad, k.grad, v.grad

Shapes: q [B, H, N_q, D], k and v [B, H_kv, N_k, D] (H a multiple of H_kv: query head h reads
kv head h // (H / H_kv)), D in {16, 32, 64}; out [B, H, N_q, D] in q's dtype, lse [B, H, N_q]
float32, natural log. Dtypes float16, bfloat16, float32; every sum in float32. causal: False,
True or "top_left" (key j visible to query i iff j <= i), "bottom_right" (j <= i + N_k - N_q, the
last query sees every key); a query row that sees no key gets out 0, lse -inf and no gradient.

Written from the algorithm as published (FlashAttention-2, Algorithms 1 and 2), with block
sizes small enough (BLOCK_M = BLOCK_N = 32) that Triton's CPU interpreter runs it quickly. Run it
with TRITON_INTERPRET=1 set before `import triton` (there is no GPU here): Triton reads the
variable at each @triton.jit decoration, and triton.language's own helpers (tl.zeros, tl.sum,
tl.max, ...) are decorated when triton is imported; tests/test_triton_kernel.py runs its cases
in a fresh Python for that reason.

Two habits make bfloat16 right under the interpreter (Triton 3.9), which stores bfloat16 as raw
uint16 bits:
  * no arithmetic on a 16-bit tile: every tile is upcast to float32 as it is loaded, and every
    tl.dot runs on float32 operands (input_precision="ieee"). Products of 16-bit values are
    exact in float32, so this is the tensor-core dot with float32 accumulation; the
    interpreter's own add or dot of two bfloat16 tiles works on the bits as integers (garbage);
  * rounding to the input dtype by hand (_rounded): the interpreter's float32 -> bfloat16 cast
    truncates toward zero, with or without fp_downcast_rounding="rtne".
Left as it is: the interpreter's bfloat16 <-> float32 casts also misread subnormals (|x| < 2^-126)
both ways, in loads and in the final cast of a result; attention's values are far from them.
Offsets are computed in int64 (the program ids cast first): no int32 overflow on large tensors,
and the interpreter checks every int32 add and multiply for overflow, at a cost. It also
re-patches triton.language at every call of a @triton.jit helper (about 1 ms), so the inner
loops call few helpers.
"""
import math

import torch
import triton
import triton.language as tl

BLOCK_M = 32        # query rows per program
BLOCK_N = 32        # key rows per step of the inner loop
# planted bugs (flash_attention(..., bug=NAME)), each a one-line change of the kernels
BUGS = {
    "scale": "the softmax scale 1% too large, forward and backward",
    "causal_diagonal": "causal mask off by one: a query does not see its own diagonal key",
    "low_sum": "the running sum l rounded to the input dtype after every key block",
    "dq_unscaled": "dq without its factor scale",
    "dk_head": "dk of kv head 0 (batch 0) negated",
}


@triton.jit
def _rounded(x, DTYPE: tl.constexpr):
    """float32 x rounded to nearest-even in DTYPE, held in float32 (a value DTYPE holds exactly,
    which any cast then keeps). bfloat16 by its bits: x + 0x7FFF + (the lowest bit kept), then
    the top 16 bits (no NaN reaches here); float16 and float32 by a cast, which the interpreter
    rounds right."""
    if DTYPE == tl.bfloat16:
        bits = x.to(tl.uint32, bitcast=True)
        bits = bits + 0x7FFF + ((bits >> 16) & 1)
        return ((bits >> 16) << 16).to(tl.float32, bitcast=True)
    else:
        return x.to(DTYPE).to(tl.float32)


@triton.jit
def _keep(rows, last, cols, n_q, n_k, CAUSAL: tl.constexpr, DIAG_EXCLUDED: tl.constexpr):
    """[BLOCK_M, BLOCK_N] bool: query rows[i] may attend key cols[j]: both in range and, causal,
    cols <= last = rows + diag_offset (0 top-left, N_k - N_q bottom-right; the bug: cols < last)."""
    keep = (rows[:, None] < n_q) & (cols[None, :] < n_k)
    if CAUSAL:
        if DIAG_EXCLUDED:
            keep = keep & (cols[None, :] < last[:, None])
        else:
            keep = keep & (cols[None, :] <= last[:, None])
    return keep


@triton.jit
def _key_end(start_m, n_k, diag_offset, CAUSAL: tl.constexpr, BLOCK_M: tl.constexpr):
    """One past the last key any of the query rows start_m .. start_m + BLOCK_M - 1 may see."""
    if CAUSAL:
        return tl.maximum(tl.minimum(n_k, start_m + BLOCK_M + diag_offset), 0)
    else:
        return n_k


@triton.jit
def _kv_head(bh, heads, kv_heads):
    """The (batch, kv head) index of the (batch, query head) index bh = b * H + h."""
    return (bh // heads) * kv_heads + (bh % heads) // (heads // kv_heads)


@triton.jit
def _attn_fwd(Q, K, V, O, LSE, scale, n_q, n_k, heads, kv_heads, diag_offset,
              CAUSAL: tl.constexpr, DIAG_EXCLUDED: tl.constexpr, LOW_SUM: tl.constexpr,
              BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, HEAD_DIM: tl.constexpr):
    """Forward, one program per (query block, batch * head): FlashAttention-2's Algorithm 1.

    Q, O [B*H, N_q, D]; K, V [B*H_kv, N_k, D]; LSE [B*H, N_q] float32 (contiguous). For the
    program's BLOCK_M query rows, with m (running max), l (running sum) and acc [BLOCK_M, D],
    all float32, and every key block K_j, V_j (up to the causal diagonal):
        1. S = scale * Q K_j^T, -inf where masked
        2. m_new = max(m, rowmax(S));  alpha = exp(m - m_new)
        3. P = exp(S - m_new)                          (P rounded to the input dtype for step 5)
        4. l = alpha * l + rowsum(P)
        5. acc = alpha * acc + P V_j;  m = m_new
    then O = acc / l in the input dtype, LSE = m + log(l). A row with no key left: O = 0,
    LSE = -inf (m stays -inf; "m_use" keeps exp() away from -inf - -inf).
    """
    start_m = tl.program_id(0).to(tl.int64) * BLOCK_M
    bh = tl.program_id(1).to(tl.int64)
    DTYPE = Q.dtype.element_ty
    rows = start_m + tl.arange(0, BLOCK_M)
    last = rows + diag_offset                       # causal: the last key each row sees
    dims = tl.arange(0, HEAD_DIM)
    q_block = (bh * n_q + start_m) * HEAD_DIM + tl.arange(0, BLOCK_M)[:, None] * HEAD_DIM + dims[None, :]
    q = tl.load(Q + q_block, mask=rows[:, None] < n_q, other=0.0).to(tl.float32)
    kv_block = (_kv_head(bh, heads, kv_heads) * n_k * HEAD_DIM
                + tl.arange(0, BLOCK_N)[:, None] * HEAD_DIM + dims[None, :])
    k_ptrs, v_ptrs = K + kv_block, V + kv_block     # the key block at start_n (advanced below)
    m = tl.full([BLOCK_M], float("-inf"), tl.float32)
    l = tl.zeros([BLOCK_M], tl.float32)
    acc = tl.zeros([BLOCK_M, HEAD_DIM], tl.float32)
    for start_n in range(0, _key_end(start_m, n_k, diag_offset, CAUSAL, BLOCK_M), BLOCK_N):
        cols = start_n + tl.arange(0, BLOCK_N)
        k = tl.load(k_ptrs, mask=cols[:, None] < n_k, other=0.0).to(tl.float32)
        v = tl.load(v_ptrs, mask=cols[:, None] < n_k, other=0.0).to(tl.float32)
        s = tl.dot(q, tl.trans(k), input_precision="ieee") * scale                     # 1.
        s = tl.where(_keep(rows, last, cols, n_q, n_k, CAUSAL, DIAG_EXCLUDED), s, float("-inf"))
        m_new = tl.maximum(m, tl.max(s, axis=1))                                        # 2.
        m_use = tl.where(m_new == float("-inf"), 0.0, m_new)
        alpha = tl.exp(m - m_use)
        p = tl.exp(s - m_use[:, None])                                                  # 3.
        l = l * alpha + tl.sum(p, axis=1)                                               # 4.
        if LOW_SUM:
            l = _rounded(l, DTYPE)
        acc = acc * alpha[:, None] + tl.dot(_rounded(p, DTYPE), v, input_precision="ieee")   # 5.
        m = m_new
        k_ptrs += BLOCK_N * HEAD_DIM
        v_ptrs += BLOCK_N * HEAD_DIM
    seen = l > 0
    out = acc / tl.where(seen, l, 1.0)[:, None]
    lse = tl.where(seen, m + tl.log(tl.where(seen, l, 1.0)), float("-inf"))
    tl.store(O + q_block, _rounded(out, DTYPE).to(DTYPE), mask=rows[:, None] < n_q)
    tl.store(LSE + bh * n_q + rows, lse, mask=rows < n_q)


@triton.jit
def _attn_bwd_preprocess(O, DO, DELTA, n_q, BLOCK_M: tl.constexpr, HEAD_DIM: tl.constexpr):
    """D = rowsum(dO * O) in float32 from the forward's own O: DELTA [B*H, N_q]."""
    rows = tl.program_id(0).to(tl.int64) * BLOCK_M + tl.arange(0, BLOCK_M)
    bh = tl.program_id(1).to(tl.int64)
    offsets = bh * n_q * HEAD_DIM + rows[:, None] * HEAD_DIM + tl.arange(0, HEAD_DIM)[None, :]
    o = tl.load(O + offsets, mask=rows[:, None] < n_q, other=0.0).to(tl.float32)
    do = tl.load(DO + offsets, mask=rows[:, None] < n_q, other=0.0).to(tl.float32)
    tl.store(DELTA + bh * n_q + rows, tl.sum(o * do, axis=1), mask=rows < n_q)


@triton.jit
def _weights(q, k, lse, keep, scale):
    """P = exp(scale * q k^T - lse) [BLOCK_M, BLOCK_N], 0 where not `keep`, recomputed from the
    forward's lse (a row with no key has lse -inf: read as +inf, so its P is 0)."""
    s = tl.dot(q, tl.trans(k), input_precision="ieee") * scale
    lse = tl.where(lse == float("-inf"), float("inf"), lse)
    return tl.where(keep, tl.exp(s - lse[:, None]), 0.0)


@triton.jit
def _attn_bwd_dkdv(Q, K, V, DO, LSE, DELTA, DK, DV, scale, n_q, n_k, heads, kv_heads, diag_offset,
                   negate_dk, CAUSAL: tl.constexpr, DIAG_EXCLUDED: tl.constexpr,
                   BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, HEAD_DIM: tl.constexpr):
    """dK, dV, one program per (key block, batch * kv head): FlashAttention-2's Algorithm 2,
    outer loop over key blocks, inner over the query blocks of every query head in the kv
    head's group (so grouped-query heads sum here, with no atomics). For each Q_i, dO_i, lse_i,
    D_i:
        1. P = exp(scale * Q_i K_j^T - lse_i), 0 where masked   (P rounded to the input dtype)
        2. dV_j += P^T dO_i
        3. dP = dO_i V_j^T;  dS = P * (dP - D_i)                 (dS rounded to the input dtype)
        4. dK_j += dS^T Q_i
    then dK_j *= scale. Causal: the query blocks above the diagonal are skipped.
    negate_dk: the planted bug's (batch * kv head) index whose dK is negated, -1 for none.
    """
    start_n = tl.program_id(0).to(tl.int64) * BLOCK_N
    bh_kv = tl.program_id(1).to(tl.int64)
    group = heads // kv_heads
    DTYPE = Q.dtype.element_ty
    cols = start_n + tl.arange(0, BLOCK_N)
    dims = tl.arange(0, HEAD_DIM)
    kv_block = ((bh_kv * n_k + start_n) * HEAD_DIM
                + tl.arange(0, BLOCK_N)[:, None] * HEAD_DIM + dims[None, :])
    k = tl.load(K + kv_block, mask=cols[:, None] < n_k, other=0.0).to(tl.float32)
    v = tl.load(V + kv_block, mask=cols[:, None] < n_k, other=0.0).to(tl.float32)
    dk = tl.zeros([BLOCK_N, HEAD_DIM], tl.float32)
    dv = tl.zeros([BLOCK_N, HEAD_DIM], tl.float32)
    if CAUSAL:      # query i sees key j iff j <= i + diag_offset: rows from start_n - diag_offset
        first = (tl.maximum(start_n - diag_offset, 0) // BLOCK_M) * BLOCK_M
    else:
        first = 0
    q_tile = tl.arange(0, BLOCK_M)[:, None] * HEAD_DIM + dims[None, :]
    for g in range(0, group):
        bh = (bh_kv // kv_heads) * heads + (bh_kv % kv_heads) * group + g
        q_ptrs = Q + (bh * n_q + first) * HEAD_DIM + q_tile      # the query block at start_m
        do_ptrs = DO + (bh * n_q + first) * HEAD_DIM + q_tile
        for start_m in range(first, n_q, BLOCK_M):
            rows = start_m + tl.arange(0, BLOCK_M)
            q = tl.load(q_ptrs, mask=rows[:, None] < n_q, other=0.0).to(tl.float32)
            do = tl.load(do_ptrs, mask=rows[:, None] < n_q, other=0.0).to(tl.float32)
            lse = tl.load(LSE + bh * n_q + rows, mask=rows < n_q, other=0.0)
            delta = tl.load(DELTA + bh * n_q + rows, mask=rows < n_q, other=0.0)
            keep = _keep(rows, rows + diag_offset, cols, n_q, n_k, CAUSAL, DIAG_EXCLUDED)
            p = _weights(q, k, lse, keep, scale)                                          # 1.
            dv += tl.dot(tl.trans(_rounded(p, DTYPE)), do, input_precision="ieee")        # 2.
            ds = p * (tl.dot(do, tl.trans(v), input_precision="ieee") - delta[:, None])   # 3.
            dk += tl.dot(tl.trans(_rounded(ds, DTYPE)), q, input_precision="ieee")        # 4.
            q_ptrs += BLOCK_M * HEAD_DIM
            do_ptrs += BLOCK_M * HEAD_DIM
    dk = dk * scale * tl.where(bh_kv == negate_dk, -1.0, 1.0)
    tl.store(DK + kv_block, _rounded(dk, DTYPE).to(DTYPE), mask=cols[:, None] < n_k)
    tl.store(DV + kv_block, _rounded(dv, DTYPE).to(DTYPE), mask=cols[:, None] < n_k)


@triton.jit
def _attn_bwd_dq(Q, K, V, DO, LSE, DELTA, DQ, scale, n_q, n_k, heads, kv_heads, diag_offset,
                 CAUSAL: tl.constexpr, DIAG_EXCLUDED: tl.constexpr, DQ_UNSCALED: tl.constexpr,
                 BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, HEAD_DIM: tl.constexpr):
    """dQ, one program per (query block, batch * head), a separate kernel (no atomics): for
    every key block K_j, V_j up to the causal diagonal,
        1. P = exp(scale * Q_i K_j^T - lse_i), 0 where masked
        2. dS = P * (dO_i V_j^T - D_i)                           (dS rounded to the input dtype)
        3. dQ_i += dS K_j
    then dQ_i *= scale (the bug leaves it out).
    """
    start_m = tl.program_id(0).to(tl.int64) * BLOCK_M
    bh = tl.program_id(1).to(tl.int64)
    DTYPE = Q.dtype.element_ty
    rows = start_m + tl.arange(0, BLOCK_M)
    last = rows + diag_offset
    dims = tl.arange(0, HEAD_DIM)
    q_block = (bh * n_q + start_m) * HEAD_DIM + tl.arange(0, BLOCK_M)[:, None] * HEAD_DIM + dims[None, :]
    q = tl.load(Q + q_block, mask=rows[:, None] < n_q, other=0.0).to(tl.float32)
    do = tl.load(DO + q_block, mask=rows[:, None] < n_q, other=0.0).to(tl.float32)
    lse = tl.load(LSE + bh * n_q + rows, mask=rows < n_q, other=0.0)
    delta = tl.load(DELTA + bh * n_q + rows, mask=rows < n_q, other=0.0)
    kv_block = (_kv_head(bh, heads, kv_heads) * n_k * HEAD_DIM
                + tl.arange(0, BLOCK_N)[:, None] * HEAD_DIM + dims[None, :])
    k_ptrs, v_ptrs = K + kv_block, V + kv_block     # the key block at start_n (advanced below)
    dq = tl.zeros([BLOCK_M, HEAD_DIM], tl.float32)
    for start_n in range(0, _key_end(start_m, n_k, diag_offset, CAUSAL, BLOCK_M), BLOCK_N):
        cols = start_n + tl.arange(0, BLOCK_N)
        k = tl.load(k_ptrs, mask=cols[:, None] < n_k, other=0.0).to(tl.float32)
        v = tl.load(v_ptrs, mask=cols[:, None] < n_k, other=0.0).to(tl.float32)
        p = _weights(q, k, lse, _keep(rows, last, cols, n_q, n_k, CAUSAL, DIAG_EXCLUDED), scale)   # 1.
        ds = p * (tl.dot(do, tl.trans(v), input_precision="ieee") - delta[:, None])          # 2.
        dq += tl.dot(_rounded(ds, DTYPE), k, input_precision="ieee")                          # 3.
        k_ptrs += BLOCK_N * HEAD_DIM
        v_ptrs += BLOCK_N * HEAD_DIM
    if not DQ_UNSCALED:
        dq = dq * scale
    tl.store(DQ + q_block, _rounded(dq, DTYPE).to(DTYPE), mask=rows[:, None] < n_q)


def _diag_offset(causal, n_q, n_k):
    """(causal?, the diagonal's offset): key j is visible to query i iff j <= i + offset."""
    if causal in (False, None):
        return False, 0
    if causal in (True, "top_left"):
        return True, 0
    if causal == "bottom_right":
        return True, n_k - n_q
    raise ValueError(f"causal={causal!r}: False, True, 'top_left' or 'bottom_right'")


class FlashAttention(torch.autograd.Function):
    """(q, k, v, causal, scale, bug) -> (out, lse); backward gives dq, dk, dv (lse has no
    gradient: it is marked non-differentiable)."""

    @staticmethod
    def forward(ctx, q, k, v, causal, scale, bug):
        b, heads, n_q, d = q.shape
        kv_heads, n_k = k.shape[1], k.shape[2]
        if k.shape != (b, kv_heads, n_k, d) or v.shape != k.shape or heads % kv_heads:
            raise ValueError(f"shapes q {tuple(q.shape)}, k {tuple(k.shape)}, v {tuple(v.shape)}")
        if d not in (16, 32, 64) or not (q.dtype == k.dtype == v.dtype):
            raise ValueError(f"head dim {d} (16, 32, 64) or dtypes {q.dtype}, {k.dtype}, {v.dtype}")
        if bug is not None and bug not in BUGS:
            raise ValueError(f"bug={bug!r}: one of {sorted(BUGS)}")
        is_causal, offset = _diag_offset(causal, n_q, n_k)
        scale = (1 / math.sqrt(d) if scale is None else float(scale)) * (1.01 if bug == "scale" else 1.0)
        q, k, v = q.contiguous(), k.contiguous(), v.contiguous()
        out = torch.empty_like(q)
        lse = torch.empty((b, heads, n_q), dtype=torch.float32, device=q.device)
        _attn_fwd[(triton.cdiv(n_q, BLOCK_M), b * heads)](
            q, k, v, out, lse, scale, n_q, n_k, heads, kv_heads, offset,
            CAUSAL=is_causal, DIAG_EXCLUDED=bug == "causal_diagonal", LOW_SUM=bug == "low_sum",
            BLOCK_M=BLOCK_M, BLOCK_N=BLOCK_N, HEAD_DIM=d)
        ctx.save_for_backward(q, k, v, out, lse)
        ctx.settings = (is_causal, offset, scale, bug)
        ctx.mark_non_differentiable(lse)
        return out, lse

    @staticmethod
    def backward(ctx, dout, _dlse):
        q, k, v, out, lse = ctx.saved_tensors
        is_causal, offset, scale, bug = ctx.settings
        b, heads, n_q, d = q.shape
        kv_heads, n_k = k.shape[1], k.shape[2]
        dout = dout.contiguous().to(q.dtype)
        delta = torch.empty_like(lse)
        _attn_bwd_preprocess[(triton.cdiv(n_q, BLOCK_M), b * heads)](
            out, dout, delta, n_q, BLOCK_M=BLOCK_M, HEAD_DIM=d)
        dq, dk, dv = torch.empty_like(q), torch.empty_like(k), torch.empty_like(v)
        masks = {"CAUSAL": is_causal, "DIAG_EXCLUDED": bug == "causal_diagonal"}
        blocks = {"BLOCK_M": BLOCK_M, "BLOCK_N": BLOCK_N, "HEAD_DIM": d}
        _attn_bwd_dkdv[(triton.cdiv(n_k, BLOCK_N), b * kv_heads)](
            q, k, v, dout, lse, delta, dk, dv, scale, n_q, n_k, heads, kv_heads, offset,
            0 if bug == "dk_head" else -1, **masks, **blocks)
        _attn_bwd_dq[(triton.cdiv(n_q, BLOCK_M), b * heads)](
            q, k, v, dout, lse, delta, dq, scale, n_q, n_k, heads, kv_heads, offset,
            **masks, DQ_UNSCALED=bug == "dq_unscaled", **blocks)
        return dq, dk, dv, None, None, None


def flash_attention(q, k, v, causal=False, scale=None, bug=None):
    """out [B, H, N_q, D] (q's dtype), lse [B, H, N_q] (float32, natural log) of softmax(scale q
    k^T, masked) v, differentiable in q, k, v. causal: False, True / "top_left", "bottom_right";
    scale: default 1/sqrt(D); bug: None or a key of BUGS (a planted bug, for the tests)."""
    return FlashAttention.apply(q, k, v, causal, scale, bug)
