"""`python -m plait.runtime.router [flags]` — the same as `plait router [flags]`."""

import sys

from ..cli.main import main

if __name__ == "__main__":
    sys.exit(main(["router", *sys.argv[1:]]))
