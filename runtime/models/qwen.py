"""Qwen2 / Qwen2.5 (q/k/v biases) and Qwen3 (per-head q/k RMSNorm).

Both are the Llama decoder with flags set from ModelConfig (`attention_bias`, `qk_norm`), so they
share llama.py's code; this module only names them for the registry.
"""

from .llama import LlamaForCausalLM


class Qwen2ForCausalLM(LlamaForCausalLM):
    pass


class Qwen3ForCausalLM(LlamaForCausalLM):
    pass
