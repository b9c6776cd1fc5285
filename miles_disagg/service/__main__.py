"""``python -m miles_disagg.service ...``: the same as ``miles-disagg serve ...``."""

import sys

from miles_disagg.cli import main

if __name__ == "__main__":
    sys.exit(main(["serve", *sys.argv[1:]]))
