"""`sgl.image` and `sgl.video` programs on a random LLaVA folder, colocated (the Engine backend) and over
HTTP (RuntimeEndpoint on plait's server): each gen answers as the Engine does for the same text and
images; select and forks carry the images too."""

from __future__ import annotations

import plait as sgl
import pytest
from conftest import http_server_in_thread
from helpers.vlm_folders import make_llava_folder, png_bytes, random_image
from plait.backend.engine_backend import EngineBackend
from plait.runtime import Engine
from plait.runtime.multimodal.video import load_video_frames

GREEDY = {"temperature": 0, "max_new_tokens": 8}


@pytest.fixture(scope="module")
def engine(tmp_path_factory):
    eng = Engine(make_llava_folder(tmp_path_factory.mktemp("llava")), device="cpu")
    yield eng
    eng.shutdown()


@pytest.fixture(scope="module", params=["colocated", "http"])
def backend(request, engine):
    if request.param == "colocated":
        yield EngineBackend(engine)
        return
    with http_server_in_thread(engine) as url:
        yield sgl.RuntimeEndpoint(url)


@sgl.function
def look(s, image, question):
    s += "look: " + sgl.image(image) + question
    s += sgl.gen("answer", max_tokens=8, temperature=0)


@sgl.function
def watch(s, path):
    s += sgl.video(path, 3) + "what happens?"
    s += sgl.gen("answer", max_tokens=8, temperature=0)


@sgl.function
def pick(s, image):
    s += "the hello " + sgl.image(image) + " is "
    s += sgl.select("choice", choices=["quick", "lazy"])


def test_image_program_answers_as_the_engine(engine, backend, tmp_path):
    image = random_image(31)
    path = tmp_path / "cat.png"
    path.write_bytes(png_bytes(image))
    want = engine.generate("look: <image> what is it?", GREEDY, image_data=image)["text"]
    for source in (str(path), image, png_bytes(image)):
        state = look.run(image=source, question=" what is it?", backend=backend)
        assert state["answer"] == want
    other = look.run(image=random_image(32), question=" what is it?", backend=backend)
    assert other["answer"] == engine.generate("look: <image> what is it?", GREEDY, image_data=random_image(32))["text"]


def test_video_program_answers_as_the_engine(engine, backend, tmp_path):
    frames = [random_image(40 + i, (64, 64)) for i in range(5)]
    path = str(tmp_path / "clip.gif")
    frames[0].save(path, save_all=True, append_images=frames[1:], duration=40, loop=0)
    sampled = load_video_frames(path, 3)  # (a GIF's palette changes the pixels: the frames as read back)
    want = engine.generate("<image><image><image>what happens?", GREEDY, image_data=sampled)["text"]
    assert watch.run(path=path, backend=backend)["answer"] == want


def test_select_and_forks_carry_the_images(engine, backend):
    state = pick.run(image=random_image(33), backend=backend)
    assert state["choice"] in ("quick", "lazy")
    states = look.run_batch(
        [{"image": random_image(34), "question": " which?"}, {"image": random_image(35), "question": " which?"}],
        backend=backend,
    )
    for seed, st in zip((34, 35), states):
        assert st["answer"] == engine.generate("look: <image> which?", GREEDY, image_data=random_image(seed))["text"]
    assert engine.check_integrity()
