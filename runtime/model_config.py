"""ModelConfig: the architecture facts plait needs, read from a Hugging Face config.json."""

from __future__ import annotations

import json
import os
from dataclasses import dataclass, field
from typing import Any, Optional

SUPPORTED_ARCHITECTURES = {
    "LlamaForCausalLM": "llama",
    "MistralForCausalLM": "llama",
    "Qwen2ForCausalLM": "qwen2",
    "Qwen3ForCausalLM": "qwen3",
}


@dataclass
class ModelConfig:
    architecture: str
    hidden_size: int
    intermediate_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    vocab_size: int
    rms_norm_eps: float = 1e-6
    rope_theta: float = 10000.0
    rope_scaling: Optional[dict[str, Any]] = None
    max_position_embeddings: int = 4096
    tie_word_embeddings: bool = False
    attention_bias: bool = False  # Qwen2: biases on q/k/v
    qk_norm: bool = False  # Qwen3: RMSNorm on q and k per head
    bos_token_id: Optional[int] = None
    eos_token_ids: list[int] = field(default_factory=list)
    raw: dict[str, Any] = field(default_factory=dict, repr=False)

    @property
    def family(self) -> str:
        return SUPPORTED_ARCHITECTURES[self.architecture]

    @classmethod
    def from_dict(cls, cfg: dict[str, Any]) -> "ModelConfig":
        archs = cfg.get("architectures") or []
        arch = next((a for a in archs if a in SUPPORTED_ARCHITECTURES), None)
        if arch is None:
            raise ValueError(
                f"unsupported model architecture {archs or cfg.get('model_type')!r}; plait supports "
                f"{sorted(SUPPORTED_ARCHITECTURES)}")
        if cfg.get("sliding_window") and arch == "MistralForCausalLM" and cfg.get("use_sliding_window", True):
            # NOTE: sliding-window attention is not implemented; it only matters past the window.
            pass
        n_heads = cfg["num_attention_heads"]
        head_dim = cfg.get("head_dim") or cfg["hidden_size"] // n_heads
        eos = cfg.get("eos_token_id")
        eos_ids = [] if eos is None else ([eos] if isinstance(eos, int) else list(eos))
        family = SUPPORTED_ARCHITECTURES[arch]
        return cls(
            architecture=arch,
            hidden_size=cfg["hidden_size"],
            intermediate_size=cfg["intermediate_size"],
            num_hidden_layers=cfg["num_hidden_layers"],
            num_attention_heads=n_heads,
            num_key_value_heads=cfg.get("num_key_value_heads") or n_heads,
            head_dim=head_dim,
            vocab_size=cfg["vocab_size"],
            rms_norm_eps=cfg.get("rms_norm_eps", 1e-6),
            rope_theta=cfg.get("rope_theta", (cfg.get("rope_parameters") or {}).get("rope_theta", 10000.0)),
            rope_scaling=cfg.get("rope_scaling") or _rope_scaling_from_parameters(cfg),
            max_position_embeddings=cfg.get("max_position_embeddings", 4096),
            tie_word_embeddings=bool(cfg.get("tie_word_embeddings", False)),
            attention_bias=bool(cfg.get("attention_bias", family == "qwen2")),
            qk_norm=family == "qwen3",
            bos_token_id=cfg.get("bos_token_id"),
            eos_token_ids=eos_ids,
            raw=cfg,
        )

    @classmethod
    def from_path(cls, path: str) -> "ModelConfig":
        cfg_file = os.path.join(path, "config.json")
        if not os.path.isfile(cfg_file):
            raise ValueError(f"no config.json in model folder {path!r}")
        with open(cfg_file) as f:
            cfg = json.load(f)
        gen_file = os.path.join(path, "generation_config.json")
        mc = cls.from_dict(cfg)
        if os.path.isfile(gen_file):
            with open(gen_file) as f:
                gen = json.load(f)
            eos = gen.get("eos_token_id")
            if eos is not None:
                extra = [eos] if isinstance(eos, int) else list(eos)
                mc.eos_token_ids = sorted(set(mc.eos_token_ids) | set(extra))
        return mc


def _rope_scaling_from_parameters(cfg: dict[str, Any]) -> Optional[dict[str, Any]]:
    # transformers >= 5 writes `rope_parameters` instead of `rope_scaling`.
    rp = cfg.get("rope_parameters")
    if rp and rp.get("rope_type", "default") != "default":
        return dict(rp)
    return None


# Built-in shapes for `load_format="dummy"` benchmarks (same numbers as the public configs).
BUILTIN_SHAPES: dict[str, dict[str, Any]] = {
    "llama-3.2-1b": dict(
        architectures=["LlamaForCausalLM"], hidden_size=2048, intermediate_size=8192, num_hidden_layers=16,
        num_attention_heads=32, num_key_value_heads=8, head_dim=64, vocab_size=128256, rms_norm_eps=1e-5,
        rope_theta=500000.0, max_position_embeddings=131072, tie_word_embeddings=True,
        rope_scaling=dict(rope_type="llama3", factor=32.0, low_freq_factor=1.0, high_freq_factor=4.0,
                          original_max_position_embeddings=8192),
        bos_token_id=128000, eos_token_id=[128001, 128008, 128009]),
    "llama-3.1-8b": dict(
        architectures=["LlamaForCausalLM"], hidden_size=4096, intermediate_size=14336, num_hidden_layers=32,
        num_attention_heads=32, num_key_value_heads=8, head_dim=128, vocab_size=128256, rms_norm_eps=1e-5,
        rope_theta=500000.0, max_position_embeddings=131072, tie_word_embeddings=False,
        rope_scaling=dict(rope_type="llama3", factor=8.0, low_freq_factor=1.0, high_freq_factor=4.0,
                          original_max_position_embeddings=8192),
        bos_token_id=128000, eos_token_id=[128001, 128008, 128009]),
    "smollm2-135m": dict(
        architectures=["LlamaForCausalLM"], hidden_size=576, intermediate_size=1536, num_hidden_layers=30,
        num_attention_heads=9, num_key_value_heads=3, head_dim=64, vocab_size=49152, rms_norm_eps=1e-5,
        rope_theta=100000.0, max_position_embeddings=8192, tie_word_embeddings=True,
        bos_token_id=1, eos_token_id=2),
}
