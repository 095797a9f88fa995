"""The VLM benchmark's workload, shared by plait's side (bench_vlm.py) and vLLM's (vllm_vlm_peer.py): a LLaVA-1.5
model folder without weights (both run it with dummy weights), its prompts and images, and how a batch is
measured (`measure_batches`: the same protocol and arithmetic on both sides). Needs transformers,
tokenizers, numpy and Pillow only (no plait, no torch), so vLLM's own Python imports it on the GPU machine and
each side writes the folder with its own transformers (a processor saved by one version is read by the same).

The folder holds what both engines read: config.json (LLaVA-1.5: a CLIP tower, the mlp2x_gelu projector, a
Llama decoder), preprocessor_config.json (CLIP's 336-pixel resize and crop), processor_config.json (vLLM builds
transformers' LlavaProcessor from it) and a tokenizer built here, offline: a word-level vocabulary of 32000
entries (`<unk>` `<s>` `</s>`, the prompt's "USER:" / "ASSISTANT:", then words t5 ... t31999), BOS added, and
`<image>` = 32000, `<pad>` = 32001 as llava-1.5-7b-hf has them. Every word of a prompt is exactly one token on
both sides (no training, so no library version can tokenize it differently); the decoder's vocabulary is 32064
(llava-1.5-7b-hf's, padded), so dummy weights may generate ids the tokenizer lacks, which decode to nothing.
"""

from __future__ import annotations

import io
import json
import os
import time
from typing import Callable

import numpy as np

IMAGE_TOKEN, PAD_TOKEN = "<image>", "<pad>"
WORDS = 32000  # the tokenizer's vocabulary before <image> (32000) and <pad> (32001)
FIRST_WORD = 5  # ids 0-4: <unk> <s> </s> USER: ASSISTANT:
CLIP_MEAN = [0.48145466, 0.4578275, 0.40821073]
CLIP_STD = [0.26862954, 0.26130258, 0.27577711]

# LLaVA-1.5-7B: CLIP ViT-L/14 at 336 pixels (576 patches), features of its second-to-last layer without the
# class token, a two-layer GELU projector, Llama-2-7B.
LLAVA_7B = dict(
    vision=dict(
        hidden_size=1024,
        intermediate_size=4096,
        num_hidden_layers=24,
        num_attention_heads=16,
        image_size=336,
        patch_size=14,
        projection_dim=768,
    ),
    text=dict(
        hidden_size=4096,
        intermediate_size=11008,
        num_hidden_layers=32,
        num_attention_heads=32,
        num_key_value_heads=32,
        max_position_embeddings=4096,
    ),
)
# The CPU run's model: tests/helpers/vlm_folders.py's shape (a 56-pixel tower of 16 patches, a two-layer
# Llama of hidden 64), over the same tokenizer.
TINY = dict(
    vision=dict(
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=3,
        num_attention_heads=4,
        image_size=56,
        patch_size=14,
        projection_dim=32,
    ),
    text=dict(
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=4096,
    ),
)
SHAPES = {"llava-1.5-7b": LLAVA_7B, "tiny": TINY}


def tokens_per_image(shape: dict) -> int:
    """A patch each (the "default" strategy drops the class token)."""
    vision = shape["vision"]
    return (vision["image_size"] // vision["patch_size"]) ** 2


def config(shape: dict) -> dict:
    """config.json of a LLaVA-1.5 at `shape` (transformers' LlavaConfig keys)."""
    vision = dict(
        shape["vision"], model_type="clip_vision_model", hidden_act="quick_gelu", layer_norm_eps=1e-5, num_channels=3
    )
    text = dict(
        shape["text"],
        model_type="llama",
        vocab_size=32064,
        rms_norm_eps=1e-5,
        rope_theta=10000.0,
        hidden_act="silu",
        bos_token_id=1,
        eos_token_id=2,
        pad_token_id=WORDS + 1,
        tie_word_embeddings=False,
        attention_bias=False,
        mlp_bias=False,
        torch_dtype="bfloat16",
    )
    return dict(
        architectures=["LlavaForConditionalGeneration"],
        model_type="llava",
        vision_config=vision,
        text_config=text,
        image_token_index=WORDS,
        pad_token_id=WORDS + 1,
        vision_feature_layer=-2,
        vision_feature_select_strategy="default",
        projector_hidden_act="gelu",
        multimodal_projector_bias=True,
        tie_word_embeddings=False,
        torch_dtype="bfloat16",
    )


def build_tokenizer():
    """The word-level tokenizer of the module's docstring, as a transformers fast tokenizer."""
    from tokenizers import AddedToken, Tokenizer, models, pre_tokenizers, processors
    from transformers import PreTrainedTokenizerFast

    vocab = {"<unk>": 0, "<s>": 1, "</s>": 2, "USER:": 3, "ASSISTANT:": 4}
    vocab.update((f"t{i}", i) for i in range(FIRST_WORD, WORDS))
    tok = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tok.post_processor = processors.TemplateProcessing(single="<s> $A", special_tokens=[("<s>", 1)])
    tok.add_special_tokens([AddedToken(IMAGE_TOKEN, normalized=False), AddedToken(PAD_TOKEN, normalized=False)])
    return PreTrainedTokenizerFast(
        tokenizer_object=tok, unk_token="<unk>", bos_token="<s>", eos_token="</s>", pad_token=PAD_TOKEN
    )


def write_folder(folder: str, shape: dict) -> str:
    """A LLaVA-1.5 folder at `shape` (a SHAPES value) without weights: config, tokenizer, processor."""
    from transformers import CLIPImageProcessor, LlavaProcessor

    os.makedirs(folder, exist_ok=True)
    with open(os.path.join(folder, "config.json"), "w") as f:
        json.dump(config(shape), f, indent=1)
    size = shape["vision"]["image_size"]
    images = CLIPImageProcessor(
        size={"shortest_edge": size},
        crop_size={"height": size, "width": size},
        image_mean=CLIP_MEAN,
        image_std=CLIP_STD,
    )
    LlavaProcessor(
        image_processor=images,
        tokenizer=build_tokenizer(),
        patch_size=shape["vision"]["patch_size"],
        vision_feature_select_strategy="default",
        image_token=IMAGE_TOKEN,
        num_additional_image_tokens=1,  # the class token, which the "default" strategy drops
    ).save_pretrained(folder)
    # transformers 5 keeps the image processor inside processor_config.json; plait reads its own file
    images.save_pretrained(folder)
    return folder


def prompt(index: int, words: int) -> str:
    """Request `index`'s prompt in LLaVA-1.5's format: one image, then `words` words (one token each), distinct
    per index. Tokens: BOS, "USER:", the image, the words, "ASSISTANT:"."""
    span = WORDS - FIRST_WORD
    text = " ".join(f"t{FIRST_WORD + (index * 7919 + j * 104729) % span}" for j in range(words))
    return f"USER: {IMAGE_TOKEN}\n{text}\nASSISTANT:"


def text_tokens(words: int) -> int:
    """A prompt's tokens besides its image's: BOS, "USER:", `words`, "ASSISTANT:"."""
    return words + 3


def noise_image(seed: int, size: int):
    """A `size` x `size` RGB PIL image of uniform noise (a PNG written and read back, as a file would come)."""
    from PIL import Image

    pixels = np.random.default_rng(seed).integers(0, 256, size=(size, size, 3), dtype=np.uint8)
    buf = io.BytesIO()
    Image.fromarray(pixels).save(buf, format="PNG")
    buf.seek(0)
    image = Image.open(buf)
    image.load()
    return image.convert("RGB")


def requests(first: int, count: int, words: int, size: int) -> list[tuple[str, object]]:
    """`count` (prompt, image) pairs, request `first + i` each: distinct text and a distinct image, so no
    request shares more than "<s> USER:" with any other, in this run or another."""
    return [(prompt(first + i, words), noise_image(first + i, size)) for i in range(count)]


# generate(requests, max_new_tokens) -> (prompt tokens, output tokens) of the batch, all requests together
Generate = Callable[[list, int], tuple[int, int]]


def measure_batches(generate: Generate, flush: Callable[[], None], shape: dict, args) -> list[dict]:
    """Each batch size as closed batches of fresh requests (none repeats a text or an image, so nothing is a
    prefix hit, nor a hit in any cache of processed images): a warm-up batch (16 new tokens before the first
    batch size, 2 before the others), the prefill run (1 new token: its prompt tokens, the image tokens
    included, over its time is the image-prefill rate), then the full run (`args.new_tokens` each). Decode
    tok/s: the full run's tokens after each request's first (which its prefill made) over the full run's time
    less the prefill run's (None where the full run was no slower: a count of new tokens too small to time).
    `args`: add_arguments' flags."""
    rows = []
    first = 0
    per_request = text_tokens(args.words) + tokens_per_image(shape)
    for batch in args.batches:

        def run(new: int) -> tuple[int, int, float]:
            nonlocal first
            reqs = requests(first, batch, args.words, args.image_size)  # built (PNGs decoded) before the clock
            first += batch
            start = time.perf_counter()
            prompt_tokens, output_tokens = generate(reqs, new)
            return prompt_tokens, output_tokens, time.perf_counter() - start

        run(2 if rows else 16)
        flush()
        reported, _, prefill_s = run(1)
        flush()
        _, output_tokens, full_s = run(args.new_tokens)
        flush()
        prompt_tokens = batch * per_request
        rows.append(
            dict(
                batch=batch,
                prompt_tokens=prompt_tokens,
                reported_prompt_tokens=reported,  # the engine's count, the same unless it tokenized otherwise
                prefill_s=round(prefill_s, 4),
                prefill_tok_s=prompt_tokens / prefill_s,
                full_s=round(full_s, 4),
                output_tokens=output_tokens,
                decode_tok_s=(output_tokens - batch) / (full_s - prefill_s) if full_s > prefill_s else None,
                exact_lengths=output_tokens == batch * args.new_tokens,
            )
        )
    return rows


def format_rows(rows: list[dict]) -> str:
    lines = [
        f"{'batch':>6} {'prompt tok':>11} {'prefill s':>10} {'prefill tok/s':>14} {'full s':>8} {'decode tok/s':>13}"
    ]
    for r in rows:
        lines.append(
            f"{r['batch']:>6} {r['prompt_tokens']:>11} {r['prefill_s']:>10.3f} {r['prefill_tok_s']:>14.1f} "
            f"{r['full_s']:>8.3f} {'n/a' if r['decode_tok_s'] is None else format(r['decode_tok_s'], '.1f'):>13}"
        )
    if not all(r["exact_lengths"] for r in rows):
        lines.append("WARNING: some requests did not generate exactly the asked number of tokens")
    if any(r["reported_prompt_tokens"] != r["prompt_tokens"] for r in rows):
        lines.append("WARNING: the engine counted other prompt lengths than the workload's (reported_prompt_tokens)")
    return "\n".join(lines)


def result(engine: str, shape_name: str, args, rows: list[dict], settings: dict) -> dict:
    """The JSON both sides save (bench_vlm.json, vllm_vlm_peer.json)."""
    return dict(
        bench="vlm",
        engine=engine,
        model=f"{shape_name} (LLaVA-1.5 shape, dummy weights)",
        image_size=args.image_size,
        image_tokens=tokens_per_image(SHAPES[shape_name]),
        text_tokens=text_tokens(args.words),
        new_tokens=args.new_tokens,
        settings=settings,
        rows=rows,
    )


def add_arguments(parser, gpu: bool = True) -> None:
    """The workload's flags, the same on both sides (defaults: the GPU run, else the CPU run's tiny model)."""
    parser.add_argument("--shape", default="llava-1.5-7b" if gpu else "tiny", choices=sorted(SHAPES))
    parser.add_argument("--batches", type=int, nargs="+", default=[1, 16, 64] if gpu else [1, 2])
    parser.add_argument("--words", type=int, default=30, help="prompt words besides the image (one token each)")
    parser.add_argument("--image-size", type=int, default=448, help="the noise images' side in pixels")
    parser.add_argument("--new-tokens", type=int, default=128)
