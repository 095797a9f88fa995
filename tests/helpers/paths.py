"""Where the tests' files lie, for tests in any room: the repository, this folder's data, and the full
corpora a checkout may have beside it (../shared/data)."""

import os

HELPERS = os.path.dirname(os.path.abspath(__file__))
TESTS = os.path.dirname(HELPERS)
REPO = os.path.dirname(TESTS)
DATA = os.path.join(HELPERS, "data")
SHARED_DATA = os.path.join(REPO, "..", "shared", "data")
