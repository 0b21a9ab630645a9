"""The chunked linear recurrence's state pass as one Pallas kernel per direction.

Per (batch, head) the state S [K, V] crosses the N chunks of `dm_jax.nn.recurrence`'s chunked
form; per chunk c (inputs U_p, W_p, exp(G) * Q, P, K_end, exp(G_C) from the chunk's dense part)

    U   = U_p - W_p S                      (U = U_p for the plain rule: W_p absent)
    o_c = (exp(G) * Q) S + P U             [C, V]
    S'  = exp(G_C) * S + K_end^T U         [K, V]

:mod:`.forward` runs all N steps in one launch with S kept on chip; :mod:`.backward` runs
them in reverse in one launch carrying dS, then forms the gradients that contract over V as
batched matmuls. Launch settings: :mod:`.config`. No autodiff here: the custom VJP that
pairs the two lives in `dm_jax.nn.recurrence_pallas`.
"""
