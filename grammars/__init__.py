"""plait.grammars: built-in grammars and named regexes, shipped as package data."""
