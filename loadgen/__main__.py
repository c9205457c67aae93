"""`python -m loadgen`: `baton bench` without the rest of the `baton` command."""
from __future__ import annotations

import argparse
import os
import sys

from loadgen.command import DESCRIPTION, add_bench_arguments, run_bench


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(prog="python -m loadgen", description=DESCRIPTION)
    add_bench_arguments(parser)
    args = parser.parse_args(argv)
    try:
        return run_bench(args)
    except KeyboardInterrupt:
        return 130
    except ValueError as exc:  # a bad flag or an unreachable server: one line, no traceback
        if os.environ.get("BATON_DEBUG"):
            raise
        print(f"{parser.prog}: error: {exc}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
