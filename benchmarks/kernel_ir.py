"""Which instructions our attention kernels compile to (GPU): a PTX census per kernel.

    PYTHONUNBUFFERED=1 PYTHONPATH=. python3 benchmarks/kernel_ir.py --out $OUT

Runs the forward and backward once (FP8 precise, FP8 fast accumulation, bf16) with XLA
dumping its compiled modules, splits the PTX into kernels (``.entry``) and counts, per
kernel: tensor-core instructions (wgmma / mma variants, with their operand types),
barriers, shared-memory traffic, FP8 conversions and exp2 instructions. Writes
kernel_ir.json and the PTX of our kernels (ptx.tgz) under --out.
"""
from __future__ import annotations

import argparse
import collections
import glob
import json
import os
import re
import sys
import tarfile
import tempfile

PATTERNS = {
    "wgmma": r"wgmma\.mma_async[.\w]*",
    "mma": r"\bmma\.sync[.\w]*",
    "wgmma_wait": r"wgmma\.wait_group[.\w]*",
    "bar": r"\bbar(?:rier)?\.(?:sync|arrive)[.\w]*",
    "st_shared": r"\bst\.shared[.\w]*",
    "ld_shared": r"\bld\.shared[.\w]*",
    "ldmatrix": r"\bldmatrix[.\w]*",
    "stmatrix": r"\bstmatrix[.\w]*",
    "cp_async": r"\bcp\.async[.\w]*",
    "tma": r"\bcp\.async\.bulk[.\w]*",
    "ld_global": r"\bld\.global[.\w]*",
    "cvt_f8": r"\bcvt\.[.\w]*e[45]m[23][.\w]*",
    "ex2": r"\bex2\.approx[.\w]*",
    "prmt": r"\bprmt\.[.\w]*",
}


def census(ptx_text):
    """{kernel name: {pattern: {instruction variant: count}}} for every .entry in a PTX file."""
    out = {}
    parts = re.split(r"\.visible \.entry\s+", ptx_text)
    for part in parts[1:]:
        name = re.match(r"[\w$]+", part).group(0)
        counts = {}
        for key, pat in PATTERNS.items():
            c = collections.Counter(re.findall(pat, part))
            if c:
                counts[key] = dict(c.most_common(6))
        out[name] = counts
    return out


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", default=os.environ.get("OUT", "."))
    args = parser.parse_args()
    dump = tempfile.mkdtemp(prefix="xla_dump_")
    os.environ["XLA_FLAGS"] = os.environ.get("XLA_FLAGS", "") + f" --xla_dump_to={dump}"
    import dataclasses

    import jax
    import jax.numpy as jnp

    import dm_jax
    from pallas_kernels.fp8_attention.config import default_block_sizes
    from pallas_kernels.fp8_attention.fast_accumulation import fast_fp8_accumulation
    from tests.shapes import BENCH_MAIN

    case = dataclasses.replace(BENCH_MAIN, b=1)
    q, k, v, do = case.arrays(seed=0, dtype=jnp.bfloat16)
    for precision, fast in (("fp8", False), ("fp8", True), ("bf16", False)):
        bs = dataclasses.replace(default_block_sizes(128, 128), fast_accumulation=fast)

        def step(q, k, v, do, precision=precision, bs=bs):
            out, vjp = jax.vjp(lambda q, k, v: dm_jax.attention(
                q, k, v, precision=precision, implementation="pallas", block_sizes=bs), q, k, v)
            return (out,) + vjp(do)

        with fast_fp8_accumulation(fast):
            jax.block_until_ready(jax.jit(step)(q, k, v, do))
    files = sorted(glob.glob(os.path.join(dump, "*.ptx")))
    result = {"files": len(files), "kernels": {}}
    ours = []
    for f in files:
        text = open(f, errors="replace").read()
        for name, counts in census(text).items():
            if "dm_" in name or "attention" in name:
                result["kernels"][f"{os.path.basename(f)}::{name}"] = counts
                if f not in ours:
                    ours.append(f)
    if not files:
        result["dump_listing"] = sorted(os.listdir(dump))[:50]
    with tarfile.open(os.path.join(args.out, "ptx.tgz"), "w:gz") as tar:
        for f in ours:
            tar.add(f, arcname=os.path.basename(f))
    with open(os.path.join(args.out, "kernel_ir.json"), "w") as fh:
        json.dump(result, fh, indent=1)
    for name, counts in result["kernels"].items():
        short = {k: sum(v.values()) for k, v in counts.items()}
        print(name.split("::")[-1][:60], short)
        for key in ("wgmma", "mma", "cvt_f8"):
            if key in counts:
                print("   ", key, counts[key])
    if not files:
        print("no PTX in the dump:", result.get("dump_listing"))
    return 0


if __name__ == "__main__":
    sys.exit(main())
