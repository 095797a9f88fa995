"""`sglang.lang.backend`: plait's backends under SGLang's module paths."""
