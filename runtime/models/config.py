"""ModelConfig: the architecture facts plait needs, read from a Hugging Face config.json."""

from __future__ import annotations

import json
import logging
import os
from dataclasses import dataclass, field
from typing import Any, Optional

from ..quant.checkpoint import Fp8CheckpointFormat
from .vision_config import LlavaVision

SUPPORTED_ARCHITECTURES = {
    "LlamaForCausalLM": "llama",
    "MistralForCausalLM": "llama",
    "Qwen2ForCausalLM": "qwen2",
    "Qwen3ForCausalLM": "qwen3",
    "LlavaForConditionalGeneration": "llava",
}
# config.json's `model_type` → architecture, for configs without an `architectures` list (transformers
# itself goes by model_type then).
MODEL_TYPES = {
    "llama": "LlamaForCausalLM",
    "mistral": "MistralForCausalLM",
    "qwen2": "Qwen2ForCausalLM",
    "qwen3": "Qwen3ForCausalLM",
    "llava": "LlavaForConditionalGeneration",
}
SUPPORTED_ROPE_TYPES = ("default", "linear", "llama3")  # what models/rotary.RotaryEmbedding computes
REQUIRED_KEYS = ("hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads", "vocab_size")

logger = logging.getLogger("plait.model_config")


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
    # The longest context plait runs this model at: config.json's max_position_embeddings, or the
    # sliding window when one applies (see _sliding_window).
    max_position_embeddings: int = 4096
    tie_word_embeddings: bool = False
    attention_bias: bool = False  # biases on q/k/v (Qwen2 always; Llama/Qwen3 with attention_bias)
    attention_out_bias: bool = False  # a bias on o_proj too (Llama/Qwen3 with attention_bias)
    qk_norm: bool = False  # Qwen3: RMSNorm on q and k per head
    bos_token_id: Optional[int] = None
    eos_token_ids: list[int] = field(default_factory=list)
    # The dtype the checkpoint was saved in ("bfloat16", "float16", "float32"; None when unsaid): dtype
    # "auto" keeps a float16 checkpoint in float16 on the GPU (its weights may not fit bfloat16's precision).
    checkpoint_dtype: Optional[str] = None
    # An FP8 checkpoint's format (config.json's quantization_config; runtime/quant/checkpoint.py): its linear
    # layers are loaded as FP8, and `quantization` is fp8 whether or not it was asked for.
    fp8_checkpoint: Optional[Fp8CheckpointFormat] = None
    raw: dict[str, Any] = field(default_factory=dict, repr=False)

    @property
    def family(self) -> str:
        return SUPPORTED_ARCHITECTURES[self.architecture]

    @classmethod
    def from_dict(cls, cfg: dict[str, Any], source: str = "the model config") -> "ModelConfig":
        """`source` names where cfg came from (a config.json path) in the errors."""
        arch = _architecture(cfg, source)
        family = SUPPORTED_ARCHITECTURES[arch]
        if family == "llava":
            return _vision_language(cls, cfg, arch, source)
        _check_supported(cfg, arch, source)
        missing = [k for k in REQUIRED_KEYS if cfg.get(k) is None]
        if missing:
            raise ValueError(f"{source} lacks {missing}, which a {arch} config needs")
        n_heads = cfg["num_attention_heads"]
        n_kv = cfg.get("num_key_value_heads") or n_heads
        if n_heads % n_kv:
            raise ValueError(f"{source}: num_attention_heads {n_heads} is not a multiple of num_key_value_heads {n_kv}")
        head_dim = cfg.get("head_dim") or cfg["hidden_size"] // n_heads
        eos = cfg.get("eos_token_id")
        eos_ids = [] if eos is None else ([eos] if isinstance(eos, int) else list(eos))
        # Qwen2 has q/k/v biases whatever the config says; Mistral has none; Llama and Qwen3 put one on
        # q/k/v and o_proj when attention_bias is set.
        biased = family == "qwen2" or (arch != "MistralForCausalLM" and bool(cfg.get("attention_bias", False)))
        return cls(
            architecture=arch,
            hidden_size=cfg["hidden_size"],
            intermediate_size=cfg["intermediate_size"],
            num_hidden_layers=cfg["num_hidden_layers"],
            num_attention_heads=n_heads,
            num_key_value_heads=n_kv,
            head_dim=head_dim,
            vocab_size=cfg["vocab_size"],
            rms_norm_eps=cfg.get("rms_norm_eps", 1e-6),
            rope_theta=cfg.get("rope_theta", (cfg.get("rope_parameters") or {}).get("rope_theta", 10000.0)),
            rope_scaling=_rope_scaling(cfg),
            max_position_embeddings=_context_limit(cfg, arch, source),
            tie_word_embeddings=bool(cfg.get("tie_word_embeddings", False)),
            attention_bias=biased,
            attention_out_bias=biased and family != "qwen2",
            qk_norm=family == "qwen3",
            bos_token_id=cfg.get("bos_token_id"),
            eos_token_ids=eos_ids,
            checkpoint_dtype=_checkpoint_dtype(cfg),
            fp8_checkpoint=Fp8CheckpointFormat.parse(cfg.get("quantization_config"), source),
            raw=cfg,
        )

    @classmethod
    def from_path(cls, path: str) -> "ModelConfig":
        cfg_file = os.path.join(path, "config.json")
        if not os.path.isfile(cfg_file):
            raise ValueError(
                f"no config.json in model folder {path!r}: a Hugging Face model folder holds "
                f"config.json, the weights (*.safetensors) and the tokenizer files"
            )
        mc = cls.from_dict(read_json(cfg_file), source=cfg_file)
        gen_file = os.path.join(path, "generation_config.json")
        if os.path.isfile(gen_file):
            # NOTE: every EOS id of either file stops generation (transformers' generate lets the
            # generation config's list win; a union never runs past an end the model was trained on).
            eos = read_json(gen_file).get("eos_token_id")
            if eos is not None:
                extra = [eos] if isinstance(eos, int) else list(eos)
                mc.eos_token_ids = sorted(set(mc.eos_token_ids) | set(extra))
        return mc

    def resolve_context_length(self, requested: Optional[int]) -> int:
        """The context length to run at: `requested` (ServerArgs.context_length), or the model's limit
        when None. Above the limit is an error, not a silent clamp: the user asked for a context the
        model cannot serve."""
        limit = self.max_position_embeddings
        if requested is None:
            return limit
        if requested > limit:
            window = _sliding_window(self.raw, self.architecture)
            why = (
                f"its sliding window ({window} tokens; plait runs full attention, exact only within the window)"
                if window is not None and window == limit
                else "max_position_embeddings in config.json"
            )
            raise ValueError(
                f"context_length {requested} is above this model's limit of {limit} tokens ({why}); "
                f"set context_length <= {limit} or leave it unset"
            )
        return requested


def _vision_language(cls, cfg: dict[str, Any], arch: str, source: str) -> "ModelConfig":
    """A VLM's config: its decoder's facts from `text_config` (a Llama's; the top level's EOS, dtype and
    tying where it says them), the whole file kept in `raw` for the vision side (models/llava.py)."""
    text = dict(cfg.get("text_config") or {})
    text.setdefault("model_type", "llama")
    if text["model_type"] != "llama":
        raise ValueError(f"{source}: a {arch} over a {text['model_type']!r} decoder is not supported (llama)")
    for key in ("eos_token_id", "bos_token_id", "tie_word_embeddings", "torch_dtype", "dtype"):
        if cfg.get(key) is not None and text.get(key) is None:
            text[key] = cfg[key]
    text.pop("architectures", None)
    mc = cls.from_dict(text, source=f"{source} (text_config)")
    try:
        LlavaVision(cfg)  # the vision side checked before anything starts
    except ValueError as e:
        raise ValueError(f"{source}: {e}") from None
    mc.architecture, mc.raw = arch, cfg
    return mc


def read_json(file: str) -> dict[str, Any]:
    try:
        with open(file) as f:
            data = json.load(f)
    except json.JSONDecodeError as e:
        raise ValueError(f"{file} is not valid JSON: {e}") from None
    if not isinstance(data, dict):
        raise ValueError(f"{file} must hold a JSON object, got {type(data).__name__}")
    return data


def _architecture(cfg: dict[str, Any], source: str) -> str:
    archs = cfg.get("architectures") or []
    arch = next((a for a in archs if a in SUPPORTED_ARCHITECTURES), None)
    if arch is not None:
        return arch
    if not archs and cfg.get("model_type") in MODEL_TYPES:
        return MODEL_TYPES[cfg["model_type"]]
    kind = ""
    if "vision_config" in cfg or "text_config" in cfg:
        kind = " (a multimodal model: plait runs text-only decoders and LLaVA-1.5-style CLIP + Llama models)"
    elif cfg.get("num_local_experts") or cfg.get("num_experts"):
        kind = " (a mixture-of-experts model: plait runs dense decoders)"
    found = archs or (f"model_type {cfg['model_type']!r}" if cfg.get("model_type") else "no architectures")
    raise ValueError(
        f"unsupported model architecture {found!r} in {source}{kind}; plait supports {sorted(SUPPORTED_ARCHITECTURES)}"
    )


def _check_supported(cfg: dict[str, Any], arch: str, source: str) -> None:
    """Settings a supported architecture may carry that plait does not implement: an error, never
    silently different numbers."""
    quant = cfg.get("quantization_config")
    if quant and Fp8CheckpointFormat.parse(quant, source) is None:
        method = quant.get("quant_method", "?") if isinstance(quant, dict) else "?"
        raise ValueError(
            f"{source}: quantized checkpoints ({method}) are not supported; plait loads "
            f"float32/float16/bfloat16 weights and FP8 ones (quant_method fp8, or compressed-tensors float-quantized)"
        )
    act = cfg.get("hidden_act", "silu")
    if act not in ("silu", "swish"):
        raise ValueError(f"{source}: hidden_act {act!r} is not supported ({arch} in plait uses silu)")
    if cfg.get("mlp_bias"):
        raise ValueError(f"{source}: mlp_bias=true is not supported (biases on the MLP projections)")
    kind = (_rope_scaling(cfg) or {}).get("rope_type", "default")
    if kind not in SUPPORTED_ROPE_TYPES:
        raise ValueError(
            f"{source}: rope scaling {kind!r} is not supported; plait supports {list(SUPPORTED_ROPE_TYPES)}"
        )


def _rope_scaling(cfg: dict[str, Any]) -> Optional[dict[str, Any]]:
    # transformers >= 5 writes `rope_parameters` instead of `rope_scaling`; older files say `type`.
    rs = cfg.get("rope_scaling") or cfg.get("rope_parameters")
    if not rs:
        return None
    rs = dict(rs)
    rs.setdefault("rope_type", rs.get("type", "default"))
    return None if rs["rope_type"] == "default" else rs


def _sliding_window(cfg: dict[str, Any], arch: str) -> Optional[int]:
    """The attention window of the config's layers, None when every layer attends to the whole context."""
    window = cfg.get("sliding_window")
    if not window:
        return None
    if arch == "MistralForCausalLM":
        return window  # Mistral's window applies to every layer whenever set
    layer_types = cfg.get("layer_types")
    if layer_types is not None:
        return window if "sliding_attention" in layer_types else None
    # Qwen2/3 before layer_types: layers from max_window_layers on slide when use_sliding_window
    if cfg.get("use_sliding_window") and cfg.get("max_window_layers", 0) < cfg.get("num_hidden_layers", 0):
        return window
    return None


def _context_limit(cfg: dict[str, Any], arch: str, source: str) -> int:
    limit = cfg.get("max_position_embeddings", 4096)
    window = _sliding_window(cfg, arch)
    if window is not None and window < limit:
        # NOTE: sliding-window attention is not implemented; within the window full attention is the
        # same computation, so the context is held to the window rather than silently differing past it.
        logger.warning(
            "%s: sliding-window attention (window %d) is not implemented; the context is limited "
            "to %d tokens (max_position_embeddings: %d)",
            source,
            window,
            window,
            limit,
        )
        return window
    return limit


# Built-in shapes for `load_format="dummy"` benchmarks (same numbers as the public configs).
BUILTIN_SHAPES: dict[str, dict[str, Any]] = {
    "llama-3.2-1b": dict(
        architectures=["LlamaForCausalLM"],
        hidden_size=2048,
        intermediate_size=8192,
        num_hidden_layers=16,
        num_attention_heads=32,
        num_key_value_heads=8,
        head_dim=64,
        vocab_size=128256,
        rms_norm_eps=1e-5,
        rope_theta=500000.0,
        max_position_embeddings=131072,
        tie_word_embeddings=True,
        rope_scaling=dict(
            rope_type="llama3",
            factor=32.0,
            low_freq_factor=1.0,
            high_freq_factor=4.0,
            original_max_position_embeddings=8192,
        ),
        bos_token_id=128000,
        eos_token_id=[128001, 128008, 128009],
    ),
    "llama-3.1-8b": dict(
        architectures=["LlamaForCausalLM"],
        hidden_size=4096,
        intermediate_size=14336,
        num_hidden_layers=32,
        num_attention_heads=32,
        num_key_value_heads=8,
        head_dim=128,
        vocab_size=128256,
        rms_norm_eps=1e-5,
        rope_theta=500000.0,
        max_position_embeddings=131072,
        tie_word_embeddings=False,
        rope_scaling=dict(
            rope_type="llama3",
            factor=8.0,
            low_freq_factor=1.0,
            high_freq_factor=4.0,
            original_max_position_embeddings=8192,
        ),
        bos_token_id=128000,
        eos_token_id=[128001, 128008, 128009],
    ),
    "smollm2-135m": dict(
        architectures=["LlamaForCausalLM"],
        hidden_size=576,
        intermediate_size=1536,
        num_hidden_layers=30,
        num_attention_heads=9,
        num_key_value_heads=3,
        head_dim=64,
        vocab_size=49152,
        rms_norm_eps=1e-5,
        rope_theta=100000.0,
        max_position_embeddings=8192,
        tie_word_embeddings=True,
        bos_token_id=1,
        eos_token_id=2,
    ),
}


def _checkpoint_dtype(cfg: dict[str, Any]) -> Optional[str]:
    """config.json's torch_dtype (transformers < 5) or dtype (5+), e.g. "bfloat16"; None when absent."""
    value = cfg.get("torch_dtype") or cfg.get("dtype")
    return value.removeprefix("torch.") if isinstance(value, str) else None
