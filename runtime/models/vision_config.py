"""A vision-language model's vision facts, read from its config.json without torch (the engine process
reads them to expand image placeholders; the model builds its tower from them)."""

from __future__ import annotations

from typing import Any


class ClipVisionConfig:
    """The vision_config facts the tower needs (CLIP's defaults where a key is absent)."""

    def __init__(self, cfg: dict[str, Any]):
        model_type = cfg.get("model_type", "clip_vision_model")
        if model_type != "clip_vision_model":
            raise ValueError(
                f"vision tower {model_type!r} is not supported; plait runs CLIP towers (clip_vision_model)"
            )
        self.hidden_size = cfg.get("hidden_size", 768)
        self.intermediate_size = cfg.get("intermediate_size", 3072)
        self.num_layers = cfg.get("num_hidden_layers", 12)
        self.num_heads = cfg.get("num_attention_heads", 12)
        self.num_channels = cfg.get("num_channels", 3)
        self.image_size = cfg.get("image_size", 224)
        self.patch_size = cfg.get("patch_size", 32)
        self.eps = cfg.get("layer_norm_eps", 1e-5)
        self.act = cfg.get("hidden_act", "quick_gelu")
        if self.hidden_size % self.num_heads:
            raise ValueError(f"vision hidden_size {self.hidden_size} is not a multiple of {self.num_heads} heads")

    @property
    def num_patches(self) -> int:
        return (self.image_size // self.patch_size) ** 2


class LlavaVision:
    """What a LLaVA config says of its images: the tower, the hidden-state layers its features come
    from, the feature strategy, the image token, and so how many image tokens one image becomes."""

    def __init__(self, raw: dict[str, Any]):
        self.tower = ClipVisionConfig(raw.get("vision_config") or {})
        layer = raw.get("vision_feature_layer", -2)
        self.feature_layers = [layer] if isinstance(layer, int) else list(layer)
        self.feature_strategy = raw.get("vision_feature_select_strategy", "default")
        if self.feature_strategy not in ("default", "full"):
            raise ValueError(
                f"vision_feature_select_strategy {self.feature_strategy!r} is not supported (default, full)"
            )
        token = raw.get("image_token_index", raw.get("image_token_id"))
        self.image_token_id: int = 32000 if token is None else token  # transformers' LlavaConfig default
        self.projector_act = raw.get("projector_hidden_act", "gelu")
        self.projector_bias = bool(raw.get("multimodal_projector_bias", True))

    @property
    def tokens_per_image(self) -> int:
        """A patch each, plus the class token with the "full" strategy."""
        return self.tower.num_patches + (self.feature_strategy == "full")
