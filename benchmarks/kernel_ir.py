"""What our attention kernels compile to on Hopper, without a GPU: a PTX census per kernel.

    python benchmarks/kernel_ir.py --out /tmp/kernel_ir     # needs `pip install triton`
    python benchmarks/kernel_ir.py --head-dim 192 --head-dim-v 128 --out ...

1. Lowers one forward+backward step of the Triton backend (`dm_jax.backends`) for CUDA on any
   host (``jax.jit(...).trace(...).lower(lowering_platforms=("cuda",))``) and keeps the
   Triton IR (TTIR) that Pallas hands to XLA for each kernel.
2. Compiles each with the `triton` package for sm_90 (Hopper), with the kernel's warps and
   stages, to Triton-GPU IR and PTX. XLA compiles the same TTIR with its own copy of
   Triton, whose version may differ: read the result as what Triton does with our IR.
3. Counts per kernel: tensor-core instructions (wgmma and mma.sync variants, with operand
   types), byte permutes (prmt), barriers, shared-memory stores and loads, FP8 conversions
   and exp2, global atomics (atom, red) and the shared memory a kernel needs (sm_90 allows
   227 KiB a block). Writes kernel_ir.json and the IR files under --out.
"""

from __future__ import annotations

import argparse
import collections
import dataclasses
import json
import os
import re
import sys

PATTERNS = {
    "wgmma": r"wgmma\.mma_async[.\w]*",
    "mma.sync": r"\bmma\.sync[.\w]*",
    "prmt": r"\bprmt\.[.\w]*",
    "bar": r"\bbar(?:rier)?\.(?:sync|arrive)[.\w]*",
    "st.shared": r"\bst\.shared[.\w]*",
    "ld.shared": r"\bld\.shared[.\w]*",
    "cvt_f8": r"\bcvt\.[.\w]*e[45]m[23][.\w]*",
    "ex2": r"\bex2\.approx[.\w]*",
    "atom": r"\batom\.[.\w]*",
    "red": r"\bred\.[.\w]*",
}
SM90_SHARED_BYTES = 227 * 1024  # the most shared memory one block may use on Hopper


def census(ptx: str) -> dict:
    """{pattern: {instruction variant: count}} of one kernel's PTX (empty patterns left out)."""
    out = {}
    for key, pattern in PATTERNS.items():
        counts = collections.Counter(re.findall(pattern, ptx))
        if counts:
            out[key] = dict(counts.most_common())
    return out


def capture_ttir(
    precision="fp8", accumulation="precise", head_dim=128, causal=False, tokens=256, head_dim_v=None
):
    """({kernel name: TTIR text} of one fwd+bwd step of the Triton backend, lowered for CUDA on
    this host; its TritonConfig)."""
    import jax.numpy as jnp

    from dm_jax import backends
    from pallas_kernels.fp8_attention.api import AttentionSpec
    from pallas_kernels.fp8_attention.tiles import default_tiles
    from pallas_kernels.fp8_attention.triton.triton_ir import lower_for_cuda

    dv = head_dim_v or head_dim
    triton = backends.get("triton")
    config = dataclasses.replace(triton.default_config(head_dim, dv), fp8_accumulation=accumulation)
    spec = AttentionSpec(causal, "matched", precision, head_dim**-0.5, default_tiles(head_dim, dv))
    q = jnp.zeros((1, tokens, 2, head_dim), jnp.bfloat16)
    v = jnp.zeros((1, tokens, 2, dv), jnp.bfloat16)

    def step(q, k, v, do):
        out, lse = triton.forward(q, k, v, None, None, spec=spec, config=config)
        return triton.backward(q, k, v, out, lse, do, None, None, spec=spec, config=config)[:3]

    modules = lower_for_cuda(step, q, q, v, v)
    return modules, config


def compile_for_hopper(ttir_path: str, num_warps: int, num_stages: int) -> dict:
    """Triton-GPU IR and PTX of one TTIR file, for sm_90."""
    import triton
    from triton.backends.compiler import GPUTarget

    kernel = triton.compile(
        ttir_path,
        target=GPUTarget("cuda", 90, 32),
        options=dict(num_warps=num_warps, num_stages=num_stages),
    )
    return dict(
        ttgir=kernel.asm["ttgir"], ptx=kernel.asm["ptx"], shared_bytes=kernel.metadata.shared
    )


def main(argv=None):
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", default="kernel_ir")
    parser.add_argument("--head-dim", type=int, default=128)
    parser.add_argument("--head-dim-v", type=int, default=None, help="Dv (default: --head-dim)")
    args = parser.parse_args(argv)
    try:
        import triton
    except ImportError:
        print(
            "benchmarks/kernel_ir.py needs the triton package: pip install triton", file=sys.stderr
        )
        return 2
    os.makedirs(args.out, exist_ok=True)
    dv = args.head_dim_v or args.head_dim
    result = {
        "triton": triton.__version__,
        "target": "sm_90",
        "head_dim": args.head_dim,
        "head_dim_v": dv,
        "kernels": {},
    }
    for precision, mode in (
        ("fp8", "precise"),
        ("fp8", "promote32"),
        ("fp8", "fast"),
        ("bf16", "precise"),
    ):
        modules, config = capture_ttir(precision, mode, args.head_dim, head_dim_v=dv)
        for name, ttir in sorted(modules.items()):
            tag = f"{precision}_{mode}:{name}"
            path = os.path.join(args.out, f"{precision}_{name}.ttir")
            with open(path, "w") as f:
                f.write(ttir)
            forward = "forward" in name
            warps = config.num_warps if forward else config.bwd_num_warps
            stages = config.num_stages if forward else config.bwd_num_stages
            compiled = compile_for_hopper(path, warps, stages)
            for key in ("ttgir", "ptx"):
                with open(path[:-5] + "." + key, "w") as f:
                    f.write(compiled[key])
            mma = re.search(r"nvidia_mma<\{versionMajor = (\d)", compiled["ttgir"])
            result["kernels"][tag] = dict(
                census(compiled["ptx"]),
                mma_version=int(mma.group(1)) if mma else None,
                shared_bytes=compiled["shared_bytes"],
                warps=warps,
                stages=stages,
            )
    with open(os.path.join(args.out, "kernel_ir.json"), "w") as f:
        json.dump(result, f, indent=1)
    print(f"triton {triton.__version__}, sm_90, head dims {args.head_dim}/{dv}")
    print(
        "| kernel | MMA | tensor-core instructions | prmt | bar | st.shared | ld.shared | atom + red | shared KiB |"
    )
    print("| --- | --- | --- | --- | --- | --- | --- | --- | --- |")
    for tag, c in result["kernels"].items():
        tc = ", ".join(
            f"{n} x {k}" for k, n in {**c.get("wgmma", {}), **c.get("mma.sync", {})}.items()
        )
        total = lambda key: sum(c.get(key, {}).values())  # noqa: E731
        over = " (over sm_90's 227)" if c["shared_bytes"] > SM90_SHARED_BYTES else ""
        print(
            f"| {tag} | v{c['mma_version']} | {tc} | {total('prmt')} | {total('bar')} | "
            f"{total('st.shared')} | {total('ld.shared')} | {total('atom') + total('red')} | "
            f"{c['shared_bytes'] / 1024:.1f}{over} |"
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())
