"""`python -m plait.runtime.server [flags]` — the same as `plait serve [flags]`."""

import sys

from ..cli.main import main

if __name__ == "__main__":
    sys.exit(main(["serve", *sys.argv[1:]]))
