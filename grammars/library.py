"""Built-in grammar files shipped as package data (`grammars/*.ebnf`), loaded by name."""

from __future__ import annotations

from importlib import resources


def available_grammars() -> list[str]:
    """Names of the shipped EBNF grammars (file names without `.ebnf`)."""
    return sorted(p.name[:-5] for p in resources.files(__package__).iterdir() if p.name.endswith(".ebnf"))


def load_ebnf(name: str) -> str:
    """The text of a shipped EBNF grammar, e.g. `load_ebnf("json")`."""
    path = resources.files(__package__) / f"{name}.ebnf"
    if not path.is_file():
        raise ValueError(f"unknown grammar {name!r}; shipped: {', '.join(available_grammars())}")
    return path.read_text(encoding="utf-8")
