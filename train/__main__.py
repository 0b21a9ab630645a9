"""`python -m train [flags]`: train a hybrid LM with FP8 Delta-Matching attention."""

import sys

from train import config, loop


def main(argv=None) -> int:
    run_config = config.parse_args(argv)
    try:
        result = loop.train(run_config)
    except (ValueError, OSError) as e:  # bad input, a damaged file, a full or read-only disk
        print(f"error: {_one_line(e)}", file=sys.stderr)
        return 2
    except loop.NonFiniteLoss as e:
        print(f"error: {e}", file=sys.stderr)
        return 1
    return 0 if result.status in ("done", "stopped") else 130


def _one_line(e: BaseException) -> str:
    return (
        " ".join(line.strip() for line in str(e).splitlines() if line.strip()) or type(e).__name__
    )


if __name__ == "__main__":
    sys.exit(main())
