"""`python -m train [flags]`: train a hybrid LM with FP8 Delta-Matching attention."""

import os
import sys

# XLA's multi-threaded CPU runtime can deadlock on the hybrid model's step (seen with jax
# 0.10.2 on small CPU machines); single-threaded Eigen avoids it. No effect on GPU kernels.
CPU_XLA_FLAGS = "--xla_cpu_multi_thread_eigen=false intra_op_parallelism_threads=1"


def main(argv=None) -> int:
    from train import config, loop  # after XLA_FLAGS is set

    run_config = config.parse_args(argv)
    try:
        result = loop.train(run_config)
    except (ValueError, FileNotFoundError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    except loop.NonFiniteLoss as e:
        print(f"error: {e}", file=sys.stderr)
        return 1
    return 0 if result.status in ("done", "stopped") else 130


if __name__ == "__main__":
    if "xla_cpu_multi_thread_eigen" not in os.environ.get("XLA_FLAGS", ""):
        os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "") + " " + CPU_XLA_FLAGS).strip()
    sys.exit(main())
