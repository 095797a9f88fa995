"""plait: SGLang-compatible frontend language for structured LLM programs."""
