"""`python -m plait.runtime.cli COMMAND [flags]` — the same as `plait COMMAND [flags]`."""

import sys

from .main import main

if __name__ == "__main__":
    sys.exit(main())
