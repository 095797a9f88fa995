"""Model registry: config.json's architecture → our PyTorch module."""

from .config import ModelConfig


def model_class(cfg: ModelConfig):
    from .llama import LlamaForCausalLM
    from .llava import LlavaForConditionalGeneration
    from .qwen import Qwen2ForCausalLM, Qwen3ForCausalLM

    return {
        "llama": LlamaForCausalLM,
        "qwen2": Qwen2ForCausalLM,
        "qwen3": Qwen3ForCausalLM,
        "llava": LlavaForConditionalGeneration,
    }[cfg.family]
