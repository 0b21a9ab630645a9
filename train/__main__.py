"""`python -m train [flags]`: train a hybrid LM with FP8 Delta-Matching attention."""

import sys

from train import config, loop


def main(argv=None) -> int:
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
    sys.exit(main())
