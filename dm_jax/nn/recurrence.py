"""Gated linear recurrences shared by the Gated DeltaNet, Mamba-2 (SSD) and KDA mixers.

One state S [K, V] per (batch, head). With a per-step decay D_t = diag(exp(g_t)) (g_t <= 0,
one value per head for GDN / Mamba-2, one per key channel for KDA) the two rules are

  delta rule (GDN, KDA):   S_t = (I - b_t k_t k_t^T) D_t S_{t-1} + b_t k_t v_t^T
  plain gated (Mamba-2):   S_t = D_t S_{t-1} + b_t k_t v_t^T
  output:                  o_t = S_t^T q_t

For a scalar decay D_t (I - b k k^T) = (I - b k k^T) D_t, so GDN's usual form
S_t = a_t (I - b_t k_t k_t^T) S_{t-1} + b_t k_t v_t^T is the same rule.

Both rules write S_t = D_t S_{t-1} + k_t u_t^T with the "pseudo value"
  u_t = b_t (v_t - (D_t S_{t-1})^T k_t)   (delta rule)      u_t = b_t v_t   (plain).

`recurrent_naive` runs this step by step (the reference). `recurrent_chunked` splits time into
chunks of C steps. Inside a chunk starting from state S_0, with cumulative log decays
G_r = sum_{s<=r} g_s and pair decays Dec_rj = exp(G_r - G_j) (j <= r):

  D_r S_{r-1} = exp(G_r) S_0 + sum_{j<r} Dec_rj k_j u_j^T
  => (I + A) U = diag(b) V - diag(b) (exp(G) * K) S_0,   A_rj = b_r <k_r, Dec_rj k_j>, j < r
  o_r  = (exp(G_r) * q_r)^T S_0 + sum_{j<=r} <q_r, Dec_rj k_j> u_j
  S_C  = exp(G_C) * S_0 + sum_j (Dec_Cj * k_j) u_j^T

so everything except the C x C unit-lower-triangular solve and the small state update is a
dense matmul (the WY/UT form of DeltaNet's chunked algorithm). With U_p = (I+A)^-1 diag(b) V,
W_p = (I+A)^-1 diag(b) (exp(G) * K) and K_end = Dec_C * K, a chunk maps its start state affinely:

  S_C = M S_0 + N,   M = diag(exp(G_C)) - K_end^T W_p  [K, K],   N = K_end^T U_p  [K, V]

(plain rule: W_p = 0, so M is the decay alone). `state_pass` picks how S crosses chunks:
"sequential" carries it with a `lax.scan` over the N = T / C chunks (`scan_unroll` steps per
loop iteration); "associative" composes the maps with `lax.associative_scan`,
(M2, N2) o (M1, N1) = (M2 M1, M2 N1 + N2), log2(N) levels of batched matmuls instead of N
dependent steps, at the price of K x K products (delta rule; per-channel decay products for
the plain rule). Both then give o = (exp(G) * Q) S_0 + P (U_p - W_p S_0). "pallas" runs the
sequential steps inside one Pallas kernel per direction with S kept on chip
(`dm_jax.nn.recurrence_pallas`; compiled on a GPU, interpret mode elsewhere). "auto" picks
"pallas" on a GPU where the kernels take the shapes, else "sequential".

Document boundaries (segment ids) reset the state: S_{t-1} := 0 whenever
segment_t != segment_{t-1}; in the chunked form pairs (r, j) from different documents and
the carried S_0 for positions past a boundary are masked out. All math runs in float32.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from dm_jax.nn.chunk_local_pallas import check_chunk_local, pallas_chunk_local
from dm_jax.nn.recurrence_pallas import pallas_state_pass
from dm_jax.nn.sequence import document_starts
from pallas_kernels.linear_recurrence.config import StatePassConfig, check_kernel_shapes


def _check(q, k, v, g, b, segment_ids):
    B, T, H, K = q.shape
    if k.shape != (B, T, H, K):
        raise ValueError(f"k: expected {(B, T, H, K)} like q, got {k.shape}")
    if v.shape[:3] != (B, T, H):
        raise ValueError(f"v: expected [B, T, H, V] = [{B}, {T}, {H}, V], got {v.shape}")
    if g.shape not in ((B, T, H, 1), (B, T, H, K)):
        raise ValueError(f"log_decay: expected {(B, T, H, 1)} or {(B, T, H, K)}, got {g.shape}")
    if b.shape != (B, T, H):
        raise ValueError(f"beta: expected {(B, T, H)}, got {b.shape}")
    if segment_ids is not None and segment_ids.shape != (B, T):
        raise ValueError(f"segment_ids: expected {(B, T)}, got {segment_ids.shape}")


STATE_PASSES = ("auto", "sequential", "associative", "pallas")


def resolve_state_pass(state_pass: str, c: int, k: int, v: int) -> str:
    """The pass that `state_pass` names for chunks of `c` steps with [k, v] states: "auto" is
    "pallas" where its kernels compile (a GPU backend) and take the shapes (chunks of at most
    128, power-of-two k and v of 16 or more), else "sequential"; the others name themselves.
    """
    if state_pass != "auto":
        return state_pass
    if jax.default_backend() != "gpu":
        return "sequential"
    try:
        check_kernel_shapes(c, k, v, StatePassConfig(), compiled=True)
    except ValueError:
        return "sequential"
    return "pallas"


def check_state_pass(state_pass: str, scan_unroll: int = 1, unroll_name="scan_unroll") -> None:
    """ValueError naming the argument unless `state_pass` is known and `scan_unroll` >= 1
    (`unroll_name`: what the caller calls scan_unroll)."""
    if state_pass not in STATE_PASSES:
        raise ValueError(f"state_pass: must be one of {STATE_PASSES}, got {state_pass!r}")
    if isinstance(scan_unroll, bool) or not isinstance(scan_unroll, int) or scan_unroll < 1:
        raise ValueError(f"{unroll_name}: must be an int >= 1, got {scan_unroll!r}")


CHUNK_LOCALS = ("xla", "pallas")  # how the chunked form makes the chunks' own operands


def check_chunk_local_name(chunk_local: str) -> None:
    if chunk_local not in CHUNK_LOCALS:
        raise ValueError(f"chunk_local: must be one of {CHUNK_LOCALS}, got {chunk_local!r}")


def _boundaries(segment_ids, B, T):
    """reset_BT: True where a new document starts after t = 0 (state cleared before the step)."""
    if segment_ids is None:
        return jnp.zeros((B, T), bool)
    return document_starts(segment_ids).at[:, 0].set(False)


def recurrent_naive(
    q_BTHK,
    k_BTHK,
    v_BTHV,
    log_decay_BTHG,
    beta_BTH,
    *,
    delta_rule: bool,
    segment_ids=None,
    initial_state_BHKV=None,
):
    """Step-by-step reference. log_decay G is 1 (per head) or K (per key channel).

    Returns (o_BTHV float32, final state_BHKV float32).
    """
    _check(q_BTHK, k_BTHK, v_BTHV, log_decay_BTHG, beta_BTH, segment_ids)
    B, T, H, K = q_BTHK.shape
    V = v_BTHV.shape[-1]
    f32 = lambda x: jnp.moveaxis(x.astype(jnp.float32), 1, 0)  # time-major for the scan
    xs = (
        f32(q_BTHK),
        f32(k_BTHK),
        f32(v_BTHV),
        f32(log_decay_BTHG),
        f32(beta_BTH),
        jnp.moveaxis(_boundaries(segment_ids, B, T), 1, 0),
    )
    S0 = (
        jnp.zeros((B, H, K, V), jnp.float32)
        if initial_state_BHKV is None
        else initial_state_BHKV.astype(jnp.float32)
    )

    def step(S, x):
        q, k, v, g, b, reset = x
        S = jnp.where(reset[:, None, None, None], 0.0, S)
        DS = jnp.exp(g)[..., None] * S  # D_t S_{t-1}: decay rows (key channels)
        if delta_rule:
            u = b[..., None] * (v - jnp.einsum("bhkv,bhk->bhv", DS, k))
        else:
            u = b[..., None] * v
        S = DS + k[..., :, None] * u[..., None, :]
        return S, jnp.einsum("bhkv,bhk->bhv", S, q)

    S, o = jax.lax.scan(step, S0, xs)
    return jnp.moveaxis(o, 0, 1), S


def unit_lower_inverse(L_CC):
    """Inverse of unit lower-triangular matrices [..., C, C] by recursive 2 x 2 blocking.

    [[L11, 0], [L21, L22]]^-1 = [[L11^-1, 0], [-L22^-1 L21 L11^-1, L22^-1]]; both diagonal
    blocks are inverted in one batched call, so the trace has log2(C) levels of matmuls.
    (Matmuls only: XLA's CPU triangular solve can deadlock its thread pool on few cores.)
    """
    C = L_CC.shape[-1]
    if C == 1:
        return jnp.ones_like(L_CC)
    Cp = 1 << (C - 1).bit_length()
    if Cp != C:  # pad with an identity block: blockdiag(L, I)^-1 = blockdiag(L^-1, I)
        eye = jnp.eye(Cp, dtype=L_CC.dtype)
        padded = eye.at[:C, :C].set(0.0) + jnp.pad(
            L_CC, [(0, 0)] * (L_CC.ndim - 2) + [(0, Cp - C)] * 2
        )
        return unit_lower_inverse(padded)[..., :C, :C]
    h = C // 2
    inv = unit_lower_inverse(jnp.stack([L_CC[..., :h, :h], L_CC[..., h:, h:]]))
    top_inv, bottom_inv = inv[0], inv[1]
    lower = -(bottom_inv @ L_CC[..., h:, :h]) @ top_inv
    top = jnp.concatenate([top_inv, jnp.zeros_like(top_inv)], axis=-1)
    return jnp.concatenate([top, jnp.concatenate([lower, bottom_inv], axis=-1)], axis=-2)


def unit_lower_inverse_doubling(L_CC):
    """The same inverse as `unit_lower_inverse` as a product of C x C matmuls: with
    A = L - I strictly lower triangular (so A^C = 0),
    (I + A)^-1 = sum_{n<C} (-A)^n = (I - A)(I + A^2)(I + A^4) ... (I + A^(2^(m-1))), 2^m >= C:
    2 (m - 1) full-size matmuls instead of log2(C) levels of ever smaller ones."""
    C = L_CC.shape[-1]
    eye = jnp.eye(C, dtype=L_CC.dtype)
    power = L_CC - eye
    inv = eye - power
    for _ in range(1, (C - 1).bit_length()):
        power = power @ power
        inv = inv + inv @ power
    return inv


SOLVES = ("blocks", "doubling", "triangular")


def _solve_unit_lower(L_CC, rhs_CX, solve: str):
    """L^-1 rhs for unit lower-triangular L: "blocks" (`unit_lower_inverse`), "doubling"
    (`unit_lower_inverse_doubling`) or "triangular" (`lax.linalg.triangular_solve`; XLA's CPU
    triangular solve can deadlock its thread pool on few cores, so for accelerators)."""
    if solve == "triangular":
        return jax.lax.linalg.triangular_solve(
            L_CC, rhs_CX, left_side=True, lower=True, unit_diagonal=True
        )
    inverse = unit_lower_inverse if solve == "blocks" else unit_lower_inverse_doubling
    return inverse(L_CC) @ rhs_CX


def _pair(a_rK, b_jK, dec_rjG):
    """sum_c a_rc b_jc Dec_rjc; for a per-head decay (G = 1) a plain matmul times Dec."""
    if dec_rjG.shape[-1] == 1:
        return jnp.einsum("...rc,...jc->...rj", a_rK, b_jK) * dec_rjG[..., 0]
    return jnp.einsum("...rc,...jc,...rjc->...rj", a_rK, b_jK, dec_rjG)


def recurrent_chunked(
    q_BTHK,
    k_BTHK,
    v_BTHV,
    log_decay_BTHG,
    beta_BTH,
    *,
    delta_rule: bool,
    segment_ids=None,
    initial_state_BHKV=None,
    chunk_size: int = 64,
    state_pass: str = "sequential",
    scan_unroll: int = 1,
    pallas_config=None,
    solve: str = "blocks",
    chunk_local: str = "xla",
    chunk_local_config=None,
):
    """Chunked parallel form of `recurrent_naive` (same arguments, same results).

    `state_pass` ("sequential", "associative", "pallas" or "auto": `resolve_state_pass`)
    picks how the state crosses chunks (see the module docstring); `scan_unroll` is the
    sequential scan's `unroll` (the other passes ignore it); `pallas_config` the pallas
    pass's launch settings (`pallas_kernels.linear_recurrence.config.StatePassConfig`,
    None: the defaults). All change the schedule only: the math, and the results up to
    float rounding, are the same. `solve` picks how the delta rule's C x C unit
    lower-triangular systems are solved (`SOLVES`, `_solve_unit_lower`), also the schedule
    only. `chunk_local` picks how the chunks' own operands (the decays, A, the solve, P,
    qg, K_end) are formed: "xla" (the stages below, with named scopes chunk_prep, pair and
    solve that profiles show) or "pallas" (one Pallas kernel per direction,
    `dm_jax.nn.chunk_local_pallas`; one decay per head, C a power of two from 16 to 128;
    `chunk_local_config` its launch settings), the same math up to float rounding.
    """
    _check(q_BTHK, k_BTHK, v_BTHV, log_decay_BTHG, beta_BTH, segment_ids)
    check_state_pass(state_pass, scan_unroll)
    if solve not in SOLVES:
        raise ValueError(f"solve: must be one of {SOLVES}, got {solve!r}")
    if chunk_size <= 0:
        raise ValueError(f"chunk_size must be positive, got {chunk_size}")
    check_chunk_local_name(chunk_local)
    B, T, H, K = q_BTHK.shape
    V = v_BTHV.shape[-1]
    C = min(chunk_size, T)
    state_pass = resolve_state_pass(state_pass, C, K, V)
    N = -(-T // C)
    pad = N * C - T
    seg = jnp.zeros((B, T), jnp.int32) if segment_ids is None else segment_ids.astype(jnp.int32)
    prev_seg = jnp.concatenate([seg[:, :1], seg[:, :-1]], axis=1)

    if chunk_local == "pallas":
        check_chunk_local(C, log_decay_BTHG.shape[-1])
        with jax.named_scope("chunk_local"):
            padded = lambda x: jnp.pad(x, [(0, 0), (0, pad)] + [(0, 0)] * (x.ndim - 2))
            seg_p = jnp.pad(seg, [(0, 0), (0, pad)], mode="edge").reshape(B, N, C)
            carried = seg_p == prev_seg[:, ::C][:, :N, None]  # still in the chunk's first document
            u_part, w_part, qg, P, k_end, gam_end = pallas_chunk_local(
                padded(q_BTHK),
                padded(k_BTHK),
                padded(v_BTHV),
                padded(log_decay_BTHG[..., 0]),
                padded(beta_BTH),
                seg_p.reshape(B, N * C),
                carried.reshape(B, N * C),
                chunk_size=C,
                delta_rule=delta_rule,
                config=chunk_local_config,
            )
    else:
        u_part, w_part, qg, P, k_end, gam_end = _chunk_local_xla(
            q_BTHK, k_BTHK, v_BTHV, log_decay_BTHG, beta_BTH, seg, prev_seg, C, N, solve, delta_rule
        )

    S0 = (
        jnp.zeros((B, H, K, V), jnp.float32)
        if initial_state_BHKV is None
        else initial_state_BHKV.astype(jnp.float32)
    )
    pass_kw = dict(fold=initial_state_BHKV is not None, unroll=scan_unroll, config=pallas_config)
    with jax.named_scope("state_pass"):
        o, S = _state_pass(state_pass, S0, u_part, w_part, qg, P, k_end, gam_end, **pass_kw)
    return o[:, :T], S


def _chunk_local_xla(
    q_BTHK, k_BTHK, v_BTHV, log_decay_BTHG, beta_BTH, seg, prev_seg, C, N, solve, delta_rule
):
    """(u_p, w_p or None, qg, P, k_end, gam_end) of every chunk, [N, B, H, C, X] (gam_end
    [N, B, H, G, 1]), by XLA: the chunk_prep, pair and solve stages."""
    B, T = seg.shape
    V = v_BTHV.shape[-1]
    pad = N * C - T

    def chunks(x):
        # [B, T, H, ...] -> [N, B, H, C, ...]; padded steps have k = v = b = g = 0 (no effect).
        x = jnp.pad(x.astype(jnp.float32), [(0, 0), (0, pad)] + [(0, 0)] * (x.ndim - 2))
        x = x.reshape(B, N, C, *x.shape[2:])
        return jnp.moveaxis(jnp.moveaxis(x, 1, 0), 2, 3)

    with jax.named_scope("chunk_prep"):
        q, k, v, g = (chunks(x) for x in (q_BTHK, k_BTHK, v_BTHV, log_decay_BTHG))
        b = chunks(beta_BTH)[..., None]  # [N, B, H, C, 1]
        seg_c = jnp.pad(seg, [(0, 0), (0, pad)], mode="edge").reshape(B, N, C)
        seg_c = jnp.moveaxis(seg_c, 1, 0)[:, :, None]  # [N, B, 1, C]
        seg_prev = jnp.moveaxis(prev_seg[:, ::C][:, :N], 1, 0)[:, :, None, None]  # [N, B, 1, 1]

        Gc = jnp.cumsum(g, axis=-2)  # G_r: [N, B, H, C, G]
        idx = jnp.arange(C)
        same = (seg_c[..., :, None] == seg_c[..., None, :]) & (idx[:, None] >= idx[None, :])
        diff = Gc[..., :, None, :] - Gc[..., None, :, :]  # G_r - G_j: [N, B, H, C, C, G]
        dec = jnp.exp(jnp.where(same[..., None], diff, -jnp.inf))  # Dec_rj, zero unless j <= r
        carried = (seg_c == seg_prev)[..., None]  # positions still in the chunk's first document
        gam = jnp.exp(Gc) * carried  # exp(G_r), masked after a boundary: [N, B, H, C, G]

    if delta_rule:
        with jax.named_scope("pair"):
            strict = idx[:, None] > idx[None, :]
            A = b * _pair(k, k, dec) * strict  # A_rj = b_r <k_r, Dec_rj k_j>, j < r
        with jax.named_scope("solve"):  # [U_p, W_p] = (I + A)^-1 [b V, b exp(G) K]
            rhs = jnp.concatenate([b * v, b * gam * k], axis=-1)
            uw = _solve_unit_lower(A + jnp.eye(C, dtype=A.dtype), rhs, solve)
            u_part, w_part = uw[..., :V], uw[..., V:]
    else:
        u_part, w_part = b * v, None  # W_p = 0: U = U_p whatever the start state
    with jax.named_scope("pair"):
        P = _pair(q, k, dec)  # <q_r, Dec_rj k_j>, j <= r
        qg = gam * q
        k_end = dec[..., -1, :, :] * k  # K_end = Dec_Cj * k_j: [N, B, H, C, K]
        gam_end = jnp.swapaxes(gam[..., -1:, :], -1, -2)  # exp(G_C): [N, B, H, G, 1] scales rows
    return u_part, w_part, qg, P, k_end, gam_end


def _state_pass(state_pass, S0, u_part, w_part, qg, P, k_end, gam_end, *, fold, unroll, config):
    """(o [B, N * C, H, V], final S) by the named pass (module docstring); `fold`: S0 is a
    given state. The pallas pass writes o token-major itself (by default); the others
    return [N, B, H, C, V], transposed here."""
    if state_pass == "pallas":
        config = StatePassConfig() if config is None else config
        o, S = pallas_state_pass(S0, u_part, w_part, qg, P, k_end, gam_end, config=config)
        if config.token_major_outputs:
            return o, S
    elif state_pass == "sequential":
        o, S = sequential_state_pass(S0, u_part, w_part, qg, P, k_end, gam_end, unroll)
    else:
        starts, S = _associative_starts(S0, fold, u_part, w_part, k_end, gam_end)
        _, o = _chunk_out(starts, u_part, w_part, qg, P)
    N, B, H, C, V = o.shape
    return jnp.moveaxis(o, 0, 1).swapaxes(2, 3).reshape(B, N * C, H, V), S


def sequential_state_pass(S0_BHKV, u_p, w_p, qg, P, k_end, gam_end, unroll: int = 1):
    """(o_NBHCV, final S_BHKV): the chunk steps U = U_p - W_p S, o = qg S + P U,
    S' = gam_end * S + K_end^T U carried by a `lax.scan` over the N chunks from S0.

    Operands [N, B, H, C, X] (w_p None: the plain rule), gam_end [N, B, H, G, 1]; the
    reference of `dm_jax.nn.recurrence_pallas.pallas_state_pass`, which takes the same.
    """

    def step(S, x):
        u_p_c, w_p_c, qg_c, P_c, k_end_c, gam_end_c = x
        u, o = _chunk_out(S, u_p_c, w_p_c, qg_c, P_c)
        return gam_end_c * S + _tmul(k_end_c, u), o

    S, o = jax.lax.scan(step, S0_BHKV, (u_p, w_p, qg, P, k_end, gam_end), unroll=unroll)
    return o, S


def _chunk_out(S_KV, u_p, w_p, qg, P):
    """(U, o) of chunks that start from S: U = U_p - W_p S, o = (exp(G) * Q) S + P U."""
    u = u_p if w_p is None else u_p - w_p @ S_KV
    return u, qg @ S_KV + P @ u


def _tmul(a_CK, b_CX):
    """a^T b [K, X], contracting the chunk axis (no transposed copy of a)."""
    return jnp.einsum("...ck,...cx->...kx", a_CK, b_CX)


def _associative_starts(S0, fold, u_p, w_p, k_end, gam_end):
    """Every chunk's start state [N, B, H, K, V] and the final state, by a parallel prefix
    over the chunks' affine maps S -> M S + N (the initial state S0 folded into the first
    map's N when `fold`; otherwise S0 is zero)."""
    if w_p is None:  # M = diag(exp(G_C)): keep only the decays [G, 1] (scalar or per row)
        M = gam_end
        apply = jnp.multiply
    else:  # M = diag(exp(G_C)) - K_end^T W_p
        M = gam_end * jnp.eye(k_end.shape[-1], dtype=k_end.dtype) - _tmul(k_end, w_p)
        apply = jnp.matmul
    Nc = _tmul(k_end, u_p)
    if fold:
        Nc = Nc.at[0].add(apply(M[0], S0))

    def compose(first, then):  # (M2, N2) o (M1, N1) = (M2 M1, M2 N1 + N2)
        (M1, N1), (M2, N2) = first, then
        return apply(M2, M1), apply(M2, N1) + N2

    _, ends = jax.lax.associative_scan(compose, (M, Nc))
    return jnp.concatenate([S0[None], ends[:-1]]), ends[-1]


IMPLEMENTATIONS = {"chunked": recurrent_chunked, "naive": recurrent_naive}


def run_recurrence(
    q,
    k,
    v,
    log_decay,
    beta,
    *,
    delta_rule: bool,
    segment_ids=None,
    impl: str = "chunked",
    chunk_size: int = 64,
    state_pass: str = "sequential",
    scan_unroll: int = 1,
    chunk_local: str = "xla",
):
    """Dispatch to the chunked (default) or naive form; returns o_BTHV in float32.

    chunk_size, state_pass, scan_unroll and chunk_local configure the chunked form (the
    naive form has none; they are still checked).
    """
    if impl not in IMPLEMENTATIONS:
        raise ValueError(f"impl must be one of {sorted(IMPLEMENTATIONS)}, got {impl!r}")
    check_state_pass(state_pass, scan_unroll)
    check_chunk_local_name(chunk_local)
    kw = dict(chunk_size=chunk_size, state_pass=state_pass, scan_unroll=scan_unroll)
    kw.update(chunk_local=chunk_local)
    o, _ = IMPLEMENTATIONS[impl](
        q,
        k,
        v,
        log_decay,
        beta,
        delta_rule=delta_rule,
        segment_ids=segment_ids,
        **(kw if impl == "chunked" else {}),
    )
    return o


def init_log_A(key, shape, lo: float = 1.0, hi: float = 16.0):
    """A_log with A = exp(A_log) ~ U[lo, hi]: per-step log decay is -A * softplus(.)."""
    return jnp.log(jax.random.uniform(key, shape, jnp.float32, lo, hi))


def init_dt_bias(key, shape, dt_min: float = 1e-3, dt_max: float = 0.1):
    """Bias b with softplus(b) = dt, dt log-uniform in [dt_min, dt_max] (Mamba's init)."""
    u = jax.random.uniform(key, shape, jnp.float32)
    dt = jnp.exp(u * (jnp.log(dt_max) - jnp.log(dt_min)) + jnp.log(dt_min))
    return dt + jnp.log(-jnp.expm1(-dt))  # inverse softplus
