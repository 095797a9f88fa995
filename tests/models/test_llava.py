"""LLaVA (a CLIP tower, its projector and the Llama decoder) from a random folder written by transformers:
greedy outputs token for token equal to transformers' on text, one image, two images, a video's frames
and an image split across prefill chunks; the prefix cache keys image tokens by the image (the same image
is a hit, another never is); preprocessing equal to CLIPImageProcessor; bad images refused clearly."""

from __future__ import annotations

import base64

import numpy as np
import pytest
import torch
from helpers.model_folders import EOS
from helpers.vlm_folders import TOKENS_PER_IMAGE, make_llava_folder, png_bytes, random_image
from plait.runtime import Engine
from plait.runtime.multimodal.images import ImageError, load_image
from plait.runtime.multimodal.prompt_images import MAX_IMAGES_PER_REQUEST, PromptImages
from plait.runtime.multimodal.video import load_video_frames, sample_indices
from transformers import CLIPImageProcessor, LlavaForConditionalGeneration

GREEDY = {"temperature": 0, "max_new_tokens": 12}


@pytest.fixture(scope="module")
def folder(tmp_path_factory):
    return make_llava_folder(tmp_path_factory.mktemp("llava"))


@pytest.fixture(scope="module")
def hf(folder):
    return LlavaForConditionalGeneration.from_pretrained(folder).eval()


@pytest.fixture(scope="module")
def engine(folder):
    eng = Engine(folder, device="cpu", chunked_prefill_size=24)
    yield eng
    eng.shutdown()


def image_token(folder) -> int:
    facts = PromptImages.for_model(folder)
    assert facts is not None
    return facts.image_token_id


def hf_reference(hf, folder, ids: list[int], images: list) -> list[int]:
    """transformers' greedy tokens: each image placeholder expanded as its processor does."""
    token = image_token(folder)
    expanded = [t for i in ids for t in ([token] * TOKENS_PER_IMAGE if i == token else [i])]
    extra = {}
    if images:
        processor = CLIPImageProcessor.from_pretrained(folder)
        extra["pixel_values"] = torch.from_numpy(processor(images=images, return_tensors="np")["pixel_values"])
    with torch.no_grad():
        out = hf.generate(
            torch.tensor([expanded]),
            **extra,
            max_new_tokens=GREEDY["max_new_tokens"],
            do_sample=False,
            eos_token_id=EOS,
            pad_token_id=0,
        )
    return out[0, len(expanded) :].tolist()


def test_preprocessing_equals_clip_image_processor(folder):
    ours = PromptImages.for_model(folder)
    assert ours is not None and ours.tokens_per_image == TOKENS_PER_IMAGE
    processor = CLIPImageProcessor.from_pretrained(folder)
    for seed, size in ((1, (80, 64)), (2, (40, 90)), (3, (56, 56)), (4, (300, 200))):
        image = random_image(seed, size)
        ref = processor(images=image, return_tensors="np")["pixel_values"][0]
        np.testing.assert_array_equal(ours.preprocess(image), ref)


def test_text_one_image_two_images_match_transformers(engine, hf, folder):
    token = image_token(folder)
    a, b = random_image(1), random_image(2)
    cases = [
        ([5, 17, 40, 41, 42], []),
        ([5, 17, token, 40, 41, 42], [a]),
        ([5, token, 9, 10, token, 40], [a, b]),
        ([token, token, 7], [b, a]),  # two placeholders side by side: two images
    ]
    for ids, images in cases:
        out = engine.generate(input_ids=ids, image_data=images or None, sampling_params=GREEDY)
        assert out["output_ids"] == hf_reference(hf, folder, ids, images), (ids, len(images))
        # 24-token chunks: an image of 16 tokens falls across chunk boundaries in the longer prompts
    one = engine.generate(input_ids=[5, 17, token, 40], image_data=a, sampling_params=GREEDY)
    other = engine.generate(input_ids=[5, 17, token, 40], image_data=b, sampling_params=GREEDY)
    assert one["output_ids"] != other["output_ids"], "the image changes the answer"
    assert engine.check_integrity()


def test_video_frames_match_transformers(engine, hf, folder, tmp_path):
    frames = [random_image(10 + i, (64, 64)) for i in range(6)]
    path = str(tmp_path / "clip.gif")
    frames[0].save(path, save_all=True, append_images=frames[1:], duration=40, loop=0)
    sampled = load_video_frames(path, 3)
    assert len(sampled) == 3 and sample_indices(6, 3) == [0, 2, 5]
    token = image_token(folder)
    ids = [5] + [token] * 3 + [40, 41]
    out = engine.generate(input_ids=ids, image_data=sampled, sampling_params=GREEDY)
    assert out["output_ids"] == hf_reference(hf, folder, ids, sampled)
    with pytest.raises(ImageError, match="PyAV"):
        (tmp_path / "clip.mp4").write_bytes(b"\0" * 64)
        load_video_frames(str(tmp_path / "clip.mp4"), 3)


def test_cache_keys_images_by_their_pixels(engine, folder):
    token = image_token(folder)
    a, b = random_image(21), random_image(22)
    ids = [5, 17, 18, token, 40, 41, 42]
    engine.flush_cache()
    first = engine.generate(input_ids=ids, image_data=a, sampling_params=GREEDY)
    assert first["meta_info"]["cached_tokens"] == 0
    # The same image again (as PNG bytes this time): everything but the last token is a hit.
    again = engine.generate(input_ids=ids, image_data=png_bytes(a), sampling_params=GREEDY)
    assert again["meta_info"]["cached_tokens"] == len(ids) - 1 + TOKENS_PER_IMAGE - 1
    assert again["output_ids"] == first["output_ids"]
    # Another image behind the same placeholder ids: only the text before it is shared.
    other = engine.generate(input_ids=ids, image_data=b, sampling_params=GREEDY)
    assert other["meta_info"]["cached_tokens"] == 3
    assert engine.check_integrity()


def test_image_sources(tmp_path):
    image = random_image(5)
    data = png_bytes(image)
    path = tmp_path / "x.png"
    path.write_bytes(data)
    b64 = base64.b64encode(data).decode()
    for source in (
        image,
        data,
        str(path),
        b64,
        f"data:image/png;base64,{b64}",
        {"url": f"data:image/png;base64,{b64}"},
    ):
        np.testing.assert_array_equal(np.asarray(load_image(source)), np.asarray(image))


@pytest.mark.parametrize(
    "source, message",
    [
        (b"not an image at all", "not a readable image"),
        ("https://example.com/cat.png", "no network"),
        ("data:image/png,abc", "base64"),
        ("/no/such/file.png", "no such file"),
        ("!!!not base64!!!", "neither a file path"),
        (12, "must be a PIL image"),
    ],
)
def test_bad_images_are_clear_errors(engine, folder, source, message):
    token = image_token(folder)
    with pytest.raises(ValueError, match=message):
        engine.generate(input_ids=[5, token, 6], image_data=source, sampling_params=GREEDY)


def test_placeholder_and_count_errors(engine, folder):
    token = image_token(folder)
    image = random_image(3)
    with pytest.raises(ValueError, match="1 image token.*for 2 image"):
        engine.generate(input_ids=[5, token, 6], image_data=[image, image], sampling_params=GREEDY)
    with pytest.raises(ValueError, match=f"at most {MAX_IMAGES_PER_REQUEST}"):
        many = [token] * (MAX_IMAGES_PER_REQUEST + 1)
        engine.generate(input_ids=many, image_data=[image] * (MAX_IMAGES_PER_REQUEST + 1), sampling_params=GREEDY)
    with pytest.raises(ValueError, match="3 image token.*for 1 image"):
        engine.generate(input_ids=[5, token, token, token, 6], image_data=image, sampling_params=GREEDY)
    expanded = [5] + [token] * TOKENS_PER_IMAGE + [6]  # given expanded: kept as it is
    assert engine.generate(input_ids=expanded, image_data=image, sampling_params=GREEDY)["output_ids"]
    assert engine.check_integrity()


def test_mark_images_keys_each_image_and_keeps_namespaces():
    from plait.runtime.io_struct import ImageInput
    from plait.runtime.request import cache_key_prompt, mark_images

    ids = [9, 300, 300, 300, 7]
    a, b = ImageInput(1, 3, None, 12345), ImageInput(1, 3, None, 67890)
    ka, kb = mark_images(ids, (a,)), mark_images(ids, (b,))
    assert ka[0] == kb[0] == 9 and ka[4] == kb[4] == 7  # the text stays as it is
    assert ka[1:4] != kb[1:4] and ka == mark_images(ids, (ImageInput(1, 3, None, 12345),))
    assert all(0 <= t < 2**63 and t % 2**32 == 300 for t in ka[1:4])  # int64, the token in the low bits
    salted = cache_key_prompt(ids, None, "salt")
    both = mark_images(salted, (a,))
    assert both[1] not in (salted[1], ka[1]) and both[2:4] == ka[2:4]  # a namespace mark and an image's, both kept
