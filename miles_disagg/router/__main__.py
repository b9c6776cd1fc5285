"""``python -m miles_disagg.router ...``: the same as ``miles-disagg router ...``."""

import sys

from miles_disagg.cli import main

if __name__ == "__main__":
    sys.exit(main(["router", *sys.argv[1:]]))
