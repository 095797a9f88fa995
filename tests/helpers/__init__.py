"""What the test rooms share besides conftest.py's fixtures: a fake step runner, model folders and draft
heads written on the fly, a scripted Engine stand-in, the server fuzzer's cases, and the data in `data/`.
Tests import them as `helpers.<module>` (tests/ is on sys.path through its conftest.py)."""
