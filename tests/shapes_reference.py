"""Attention problem shapes for the reference tests (small: CPU, seconds)."""
import dataclasses

import jax


@dataclasses.dataclass(frozen=True)
class Problem:
    name: str
    b: int
    t: int
    s: int
    hq: int
    hkv: int
    dqk: int
    dv: int

    def arrays(self, seed, dtype=jax.numpy.float32):
        ks = jax.random.split(jax.random.PRNGKey(seed), 4)
        n = jax.random.normal
        return (
            n(ks[0], (self.b, self.t, self.hq, self.dqk), dtype),
            n(ks[1], (self.b, self.s, self.hkv, self.dqk), dtype),
            n(ks[2], (self.b, self.s, self.hkv, self.dv), dtype),
            n(ks[3], (self.b, self.t, self.hq, self.dv), dtype),
        )


PROBLEMS = [
    Problem("gqa_d64", 1, 256, 256, 4, 2, 64, 64),
    Problem("mqa_ragged_t_ne_s_mla", 1, 200, 136, 2, 1, 192, 128),
    Problem("mha_d256", 1, 128, 128, 2, 2, 256, 256),
    Problem("batch2_d128_odd_t", 2, 130, 130, 2, 2, 128, 128),
]
