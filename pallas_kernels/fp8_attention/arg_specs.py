"""Attention problems (arg specs) of the op, shared by the tests of every backend (CPU,
interpret mode) and the GPU benchmarks (benchmarks/correctness.py, attention.py, passes.py,
tune.py): shapes, masking, delta mode and precision, and their random inputs.
"""

from __future__ import annotations

import dataclasses
from typing import Optional

import jax
import jax.numpy as jnp

HEAD_DIMS = ((64, 64), (128, 128), (256, 256), (192, 128))  # (Dqk, Dv) we support and test


@dataclasses.dataclass(frozen=True)
class Case:
    """One attention problem: q [b, t, hq, dqk], k [b, s, hkv, dqk], v [b, s, hkv, dv]."""

    name: str
    b: int
    t: int
    s: int
    hq: int
    hkv: int
    dqk: int
    dv: int
    causal: bool = False
    segment_len: Optional[int] = None  # packed sequences: segment id = position // len
    delta: str = "matched"
    precision: str = "fp8"

    def arrays(self, seed=0, dtype=jnp.float32):
        """(q, k, v, do), unit normal."""
        ks = jax.random.split(jax.random.PRNGKey(seed), 4)
        n = jax.random.normal
        return (
            n(ks[0], (self.b, self.t, self.hq, self.dqk), jnp.float32).astype(dtype),
            n(ks[1], (self.b, self.s, self.hkv, self.dqk), jnp.float32).astype(dtype),
            n(ks[2], (self.b, self.s, self.hkv, self.dv), jnp.float32).astype(dtype),
            n(ks[3], (self.b, self.t, self.hq, self.dv), jnp.float32).astype(dtype),
        )

    def segment_ids(self):
        """None, or (q_ids [b, t], kv_ids [b, s]); batch rows get shifted segment borders."""
        if self.segment_len is None:
            return None

        def ids(n):
            pos = jnp.arange(n)[None, :] + 17 * jnp.arange(self.b)[:, None]
            return (pos // self.segment_len).astype(jnp.int32)

        return ids(self.t), ids(self.s)

    def shrunk(self):
        """The same problem at [1, 256 tokens, 2 query heads] (GQA stays grouped; documents
        shrink with the tokens, to 16 or more): the size at which the GPU scripts' --smoke
        modes run on a CPU."""
        seg = self.segment_len
        seg = None if seg is None else max(16, seg * 256 // self.t)
        return dataclasses.replace(
            self, b=1, t=256, s=256, hq=2, hkv=2 if self.hkv == self.hq else 1, segment_len=seg
        )

    @property
    def flops_fwd(self):
        """Forward FLOPs of the two matmuls (causal halves them)."""
        f = 2.0 * self.b * self.hq * self.t * self.s * (self.dqk + self.dv)
        return f / 2 if self.causal else f


# CPU interpret-mode cases: few, small, each covering several features at once.
KERNEL_CASES = (
    # ragged T = S (not a multiple of any tile), several key tiles, plain MHA
    Case("mha_d64_ragged", 1, 200, 200, 2, 2, 64, 64, delta="matched"),
    # GQA, causal, T != S (cross lengths), stale delta
    Case("gqa_causal_cross", 1, 150, 230, 4, 2, 64, 64, causal=True, delta="stale"),
    # MLA head dims (192 / 128), MQA, packed segments + causal, dO-matched delta
    Case(
        "mqa_mla_segments",
        2,
        192,
        192,
        2,
        1,
        192,
        128,
        causal=True,
        segment_len=70,
        delta="do_matched",
    ),
    # head dim 128 through the bf16 path; causal without padding (unmasked interior tiles)
    Case(
        "d128_bf16_causal",
        1,
        128,
        128,
        2,
        1,
        128,
        128,
        causal=True,
        delta="matched",
        precision="bf16",
    ),
    # head dim 256, causal
    Case("d256_causal", 1, 96, 96, 1, 1, 256, 256, causal=True, delta="matched"),
    # odd everything: 7 queries, 13 keys, a group of 3 query heads, head dims 32 / 48 (not
    # powers of two), batch 2, causal with T < S
    Case("odd_tiny", 2, 7, 13, 3, 1, 32, 48, causal=True, delta="matched"),
)


# Reference (pure-JAX emulation) cases: every feature against f32 attention, seconds each.
REFERENCE_CASES = (
    Case("gqa_d64", 1, 256, 256, 4, 2, 64, 64),
    Case("mqa_ragged_t_ne_s_mla", 1, 200, 136, 2, 1, 192, 128),
    Case("mha_d256", 1, 128, 128, 2, 2, 256, 256),
    Case("batch2_d128_odd_t", 2, 130, 130, 2, 2, 128, 128),
)


def gpu_cases(t: int, causal: bool, delta: str, head_dims=HEAD_DIMS, precision="fp8"):
    """Realistic GPU shapes: about 32 (batch x head) rows of 4096 tokens per head dim."""
    b = max(1, 8192 // t)
    out = []
    for dqk, dv in head_dims:
        hq = 16 if max(dqk, dv) <= 128 else 8
        out.append(
            Case(
                f"T{t}_d{dqk}_{dv}{'_causal' if causal else ''}",
                b,
                t,
                t,
                hq,
                hq // 2,
                dqk,
                dv,
                causal=causal,
                delta=delta,
                precision=precision,
            )
        )
    return out


BENCH_MAIN = Case("main", 4, 4096, 4096, 16, 16, 128, 128)

# The speed benchmark's other shapes (benchmarks/attention.py --shapes): head dims where
# cuDNN FP8 cannot train, GQA, longer sequences; about the main shape's work per step.
BENCH_SHAPES = {
    "main": BENCH_MAIN,
    "d64": Case("d64", 4, 4096, 4096, 16, 16, 64, 64),
    "d256": Case("d256", 4, 4096, 4096, 16, 16, 256, 256),
    "d192_128": Case("d192_128", 4, 4096, 4096, 16, 16, 192, 128),
    "gqa32_8": Case("gqa32_8", 2, 4096, 4096, 32, 8, 128, 128),
    "t8192": Case("t8192", 2, 8192, 8192, 16, 16, 128, 128),
    "t16384": Case("t16384", 1, 16384, 16384, 16, 16, 128, 128),
    # one attention layer of the training presets' steps at T = 8192 (docs/training.md):
    # few heads, so a causal launch has few CTAs per SM and its last wave matters
    "small_t8192": Case("small_t8192", 8, 8192, 8192, 4, 2, 128, 128),
    "h569m_t8192": Case("h569m_t8192", 4, 8192, 8192, 4, 2, 256, 256),
    # the `569m` layer at 8 x 4096 as training runs it: packed documents (segment ids; here
    # of 1,500 tokens, offset per row), beside the same layer without them
    "h569m_t4096": Case("h569m_t4096", 8, 4096, 4096, 4, 2, 256, 256),
    "h569m_t4096_docs": Case("h569m_t4096_docs", 8, 4096, 4096, 4, 2, 256, 256, segment_len=1500),
    "small_t8192_docs": Case("small_t8192_docs", 8, 8192, 8192, 4, 2, 128, 128, segment_len=1500),
}
