"""``python -m miles_disagg.engines.agent ...``: the same as ``miles-disagg agent ...``."""

import sys

from miles_disagg.cli import main

if __name__ == "__main__":
    sys.exit(main(["agent", *sys.argv[1:]]))
