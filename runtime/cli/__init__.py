"""`plait` command line: `plait serve` and `plait router` (main.py), their flags generated from the settings
dataclasses (flags.py). `python -m plait.runtime.cli`, `python -m plait.runtime.server` and
`python -m plait.runtime.router` run the same `main`."""
