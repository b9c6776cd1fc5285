"""``python -m miles_disagg.engines.builtin ...``: the same as ``miles-disagg engine ...``."""

import sys

from miles_disagg.cli import main

if __name__ == "__main__":
    sys.exit(main(["engine", *sys.argv[1:]]))
