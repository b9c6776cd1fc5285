"""``python -m miles_disagg.engine ...``: run the built-in engine."""

from __future__ import annotations

import argparse
import sys

from miles_disagg.engine import cli


def main() -> int:
    parser = argparse.ArgumentParser(prog="python -m miles_disagg.engine", description=cli.__doc__.splitlines()[0])
    cli.add_arguments(parser)
    return cli.run(parser.parse_args())


if __name__ == "__main__":
    sys.exit(main())
