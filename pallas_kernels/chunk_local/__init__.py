"""The chunked linear recurrence's chunk-local stage as Pallas kernels (one forward, two backward).

Per (batch, head, chunk) of `dm_jax.nn.recurrence`'s chunked form (C steps; cumulative log
decays G_r = sum_{s<=r} g_s, one decay per head; pair decays Dec_rj = exp(G_r - G_j) for
j <= r in one document, else 0; gam_r = exp(G_r) while r is still in the document the chunk
started in, else 0):

    A    = diag(b) (K K^T * Dec), strictly lower          (delta rule only)
    U_p  = (I + A)^-1 diag(b) V        W_p = (I + A)^-1 diag(b gam) K   (plain: U_p = b V)
    P    = Q K^T * Dec                 qg  = gam * Q       K_end = Dec_C * K

:mod:`.forward` reads Q, K, V and the gates token-major ([B, T, H, X], the projections'
layout) and writes the state pass's operands in the chunk layout [N, B, H, C, X], one
program per chunk (and, under differentiation, T = (I + A)^-1 for the backward);
:mod:`.backward` recomputes the rest of the chunk and writes the gradients of Q, K, V, the
log decays and b token-major, in two launches (the pairs P, qg, K_end; the solve). The
[C, C] decays and A that the XLA form materialises per chunk stay on chip. Launch
settings: :mod:`.config`. No autodiff here: the custom VJP lives in
`dm_jax.nn.chunk_local_pallas`.
"""
