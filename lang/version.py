"""`plait.__version__`: the installed distribution's version (SGLang programs print and compare
`sgl.__version__`)."""

from importlib.metadata import PackageNotFoundError, version

try:
    __version__ = version("plait")
except PackageNotFoundError:  # run from a source tree that was never installed
    __version__ = "0.0.0+unknown"
