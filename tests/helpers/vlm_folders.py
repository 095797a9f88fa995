"""A tiny random LLaVA folder (a CLIP tower of 56x56 images in 14x14 patches: 16 image tokens, and the
Llama of model_folders.py), written by transformers' save_pretrained with its image processor and the
small tokenizer plus an `<image>` token; test images drawn from a seed."""

from __future__ import annotations

import io

import numpy as np
import torch
from PIL import Image
from transformers import CLIPImageProcessor, CLIPVisionConfig, LlamaConfig, LlavaConfig, LlavaForConditionalGeneration

from .model_folders import SHAPE, TEMPLATE, build_tokenizer

IMAGE_SIZE = 56
TOKENS_PER_IMAGE = (IMAGE_SIZE // 14) ** 2


def make_llava_folder(folder) -> str:
    tokenizer = build_tokenizer()
    tokenizer.add_special_tokens({"additional_special_tokens": ["<image>"]})
    tokenizer.chat_template = TEMPLATE
    image_token = tokenizer.convert_tokens_to_ids("<image>")
    vision = CLIPVisionConfig(
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=3,
        num_attention_heads=4,
        image_size=IMAGE_SIZE,
        patch_size=14,
        projection_dim=32,
    )
    text = LlamaConfig(**SHAPE)
    config = LlavaConfig(vision_config=vision, text_config=text, image_token_index=image_token)
    torch.manual_seed(0)
    model = LlavaForConditionalGeneration(config)
    with torch.no_grad():  # a larger projector: image features that move the greedy tokens
        for p in model.model.multi_modal_projector.parameters():
            p.mul_(20.0)
    model.save_pretrained(str(folder))
    tokenizer.save_pretrained(str(folder))
    CLIPImageProcessor(
        size={"shortest_edge": IMAGE_SIZE}, crop_size={"height": IMAGE_SIZE, "width": IMAGE_SIZE}
    ).save_pretrained(str(folder))
    return str(folder)


def random_image(seed: int, size=(80, 64)) -> Image.Image:
    """A random RGB image (not square: the resize and crop are exercised)."""
    rng = np.random.default_rng(seed)
    return Image.fromarray(rng.integers(0, 256, size=(size[1], size[0], 3), dtype=np.uint8))


def png_bytes(image: Image.Image) -> bytes:
    buf = io.BytesIO()
    image.save(buf, format="PNG")
    return buf.getvalue()
