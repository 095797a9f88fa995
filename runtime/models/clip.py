"""The CLIP vision tower (a ViT) that LLaVA puts in front of its decoder.

Weights and names as transformers' `CLIPVisionModel` saves them (`vision_model.*`), so a LLaVA folder's
`vision_tower.*` tensors load as they are. The tower runs eagerly on whole images (no KV cache, no paging):
a prefill step's images only, never a decode step.
"""

from __future__ import annotations

import torch
import torch.nn as nn
import torch.nn.functional as F

from .vision_config import ClipVisionConfig

_ACTIVATIONS = {
    "quick_gelu": lambda x: x * torch.sigmoid(1.702 * x),
    "gelu": F.gelu,
    "gelu_pytorch_tanh": lambda x: F.gelu(x, approximate="tanh"),
}


def activation(name: str):
    if name not in _ACTIVATIONS:
        raise ValueError(f"activation {name!r} is not supported in the vision tower; plait has {sorted(_ACTIVATIONS)}")
    return _ACTIVATIONS[name]


class ClipEmbeddings(nn.Module):
    def __init__(self, cfg: ClipVisionConfig):
        super().__init__()
        self.class_embedding = nn.Parameter(torch.zeros(cfg.hidden_size))
        self.patch_embedding = nn.Conv2d(
            cfg.num_channels, cfg.hidden_size, kernel_size=cfg.patch_size, stride=cfg.patch_size, bias=False
        )
        self.position_embedding = nn.Embedding(cfg.num_patches + 1, cfg.hidden_size)

    def forward(self, pixels: torch.Tensor) -> torch.Tensor:
        """pixels (N, C, S, S) -> (N, 1 + P, hidden): the class token, then each patch, row-major."""
        patches = self.patch_embedding(pixels.to(self.patch_embedding.weight.dtype))  # (N, hidden, S/p, S/p)
        patches = patches.flatten(2).transpose(1, 2)  # (N, P, hidden)
        cls = self.class_embedding.expand(patches.shape[0], 1, -1)  # (N, 1, hidden)
        return torch.cat([cls, patches], dim=1) + self.position_embedding.weight  # (N, 1 + P, hidden)


class ClipAttention(nn.Module):
    def __init__(self, cfg: ClipVisionConfig):
        super().__init__()
        self.num_heads, self.head_dim = cfg.num_heads, cfg.hidden_size // cfg.num_heads
        self.q_proj = nn.Linear(cfg.hidden_size, cfg.hidden_size)
        self.k_proj = nn.Linear(cfg.hidden_size, cfg.hidden_size)
        self.v_proj = nn.Linear(cfg.hidden_size, cfg.hidden_size)
        self.out_proj = nn.Linear(cfg.hidden_size, cfg.hidden_size)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        n, length, hidden = x.shape  # (N, L, hidden)

        def heads(t: torch.Tensor) -> torch.Tensor:
            return t.view(n, length, self.num_heads, self.head_dim).transpose(1, 2)  # (N, H, L, D)

        # Every patch sees every other (no causal mask): a ViT.
        o = F.scaled_dot_product_attention(heads(self.q_proj(x)), heads(self.k_proj(x)), heads(self.v_proj(x)))
        return self.out_proj(o.transpose(1, 2).reshape(n, length, hidden))  # (N, L, hidden)


class ClipMLP(nn.Module):
    def __init__(self, cfg: ClipVisionConfig):
        super().__init__()
        self.act = activation(cfg.act)
        self.fc1 = nn.Linear(cfg.hidden_size, cfg.intermediate_size)
        self.fc2 = nn.Linear(cfg.intermediate_size, cfg.hidden_size)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc2(self.act(self.fc1(x)))


class ClipEncoderLayer(nn.Module):
    def __init__(self, cfg: ClipVisionConfig):
        super().__init__()
        self.layer_norm1 = nn.LayerNorm(cfg.hidden_size, eps=cfg.eps)
        self.self_attn = ClipAttention(cfg)
        self.layer_norm2 = nn.LayerNorm(cfg.hidden_size, eps=cfg.eps)
        self.mlp = ClipMLP(cfg)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.self_attn(self.layer_norm1(x))
        return x + self.mlp(self.layer_norm2(x))


class ClipEncoder(nn.Module):
    def __init__(self, cfg: ClipVisionConfig):
        super().__init__()
        self.layers = nn.ModuleList(ClipEncoderLayer(cfg) for _ in range(cfg.num_layers))


class ClipVisionTransformer(nn.Module):
    def __init__(self, cfg: ClipVisionConfig):
        super().__init__()
        self.embeddings = ClipEmbeddings(cfg)
        self.pre_layrnorm = nn.LayerNorm(cfg.hidden_size, eps=cfg.eps)  # (sic: transformers' name)
        self.encoder = ClipEncoder(cfg)
        self.post_layernorm = nn.LayerNorm(cfg.hidden_size, eps=cfg.eps)


class ClipVisionModel(nn.Module):
    """`hidden_states(pixels, layers)`: the tower's hidden states after the named layers (transformers'
    `output_hidden_states` numbering: 0 is the embeddings after the pre-norm, i the output of layer i - 1;
    negative counts from the end), all that LLaVA reads. Layers past the deepest one asked for never run."""

    def __init__(self, cfg: ClipVisionConfig):
        super().__init__()
        self.config = cfg
        self.vision_model = ClipVisionTransformer(cfg)

    def hidden_states(self, pixels: torch.Tensor, layers: list[int]) -> list[torch.Tensor]:
        """pixels (N, C, S, S) -> one (N, 1 + P, hidden) tensor per entry of `layers`."""
        vm = self.vision_model
        total = len(vm.encoder.layers) + 1  # the embeddings' state and each layer's
        wanted = [i % total for i in layers]
        states = [vm.pre_layrnorm(vm.embeddings(pixels))]  # (N, 1 + P, hidden)
        for layer in vm.encoder.layers[: max(wanted)]:
            states.append(layer(states[-1]))
        return [states[i] for i in wanted]
