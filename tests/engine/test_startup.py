"""Start-up: the engine process loads its tokenizer without torch on a warm start, and reports where the
scheduler process's start-up went.

The tokenizer's class is remembered per folder after the first (AutoTokenizer) load; later loads take
the plain fast class directly, which needs neither transformers' model configuration code nor torch.
"""

import os
import shutil
import subprocess
import sys

import pytest
from plait.runtime.executor import model_files
from plait.runtime.executor.model_files import load_tokenizer

TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja", "config.json")
TEXTS = ["Hello world", ' wörld  \n\n 123 {"a": [1, 2]}', "<|im_start|>user\nhi<|im_end|>", ""]


@pytest.fixture
def tokenizer_folder(tmp_path, monkeypatch, default_model_path):
    monkeypatch.setenv("PLAIT_CACHE_DIR", str(tmp_path / "cache"))
    folder = tmp_path / "tok"
    folder.mkdir()
    for name in TOKENIZER_FILES:
        if os.path.exists(os.path.join(default_model_path, name)):
            shutil.copy(os.path.join(default_model_path, name), folder / name)
    return str(folder)


def count_auto_loads(monkeypatch) -> list:
    from transformers import AutoTokenizer

    calls = []
    original = AutoTokenizer.from_pretrained.__func__

    def counted(cls, *args, **kwargs):
        calls.append(args)
        return original(cls, *args, **kwargs)

    monkeypatch.setattr(AutoTokenizer, "from_pretrained", classmethod(counted))
    return calls


def same_tokenizer(a, b) -> None:
    assert type(a) is type(b)
    for text in TEXTS:
        assert a.encode(text) == b.encode(text)
        assert a.encode(text, add_special_tokens=False) == b.encode(text, add_special_tokens=False)
        assert a.decode(a.encode(text)) == b.decode(b.encode(text))
    chat = [{"role": "user", "content": "hi"}]
    assert a.apply_chat_template(chat, tokenize=False, add_generation_prompt=True) == b.apply_chat_template(
        chat, tokenize=False, add_generation_prompt=True
    )
    assert a.get_vocab() == b.get_vocab() and a.added_tokens_decoder == b.added_tokens_decoder
    assert (a.eos_token_id, a.bos_token_id, a.pad_token_id, a.clean_up_tokenization_spaces) == (
        b.eos_token_id,
        b.bos_token_id,
        b.pad_token_id,
        b.clean_up_tokenization_spaces,
    )
    assert a.init_kwargs == b.init_kwargs


def test_a_warm_load_skips_autotokenizer_and_gives_the_same_tokenizer(tokenizer_folder, monkeypatch):
    calls = count_auto_loads(monkeypatch)
    first = load_tokenizer(tokenizer_folder)
    assert len(calls) == 1  # the first load of a folder: AutoTokenizer picks the class
    warm = load_tokenizer(tokenizer_folder)
    assert len(calls) == 1, "the warm load went through AutoTokenizer again"
    same_tokenizer(first, warm)


def test_changed_tokenizer_files_take_the_long_way_again(tokenizer_folder, monkeypatch):
    calls = count_auto_loads(monkeypatch)
    load_tokenizer(tokenizer_folder)
    config = os.path.join(tokenizer_folder, "tokenizer_config.json")
    stat = os.stat(config)
    os.utime(config, ns=(stat.st_atime_ns, stat.st_mtime_ns + 10**9))  # edited since it was remembered
    load_tokenizer(tokenizer_folder)
    assert len(calls) == 2
    load_tokenizer(tokenizer_folder)  # remembered again, as it is now
    assert len(calls) == 2


def test_a_tokenizer_of_its_own_class_is_not_remembered(tokenizer_folder, monkeypatch):
    from transformers import PreTrainedTokenizerFast

    class ItsOwnTokenizer(PreTrainedTokenizerFast):
        pass

    calls = count_auto_loads(monkeypatch)
    real = model_files._KnownTokenizerClasses.remember
    monkeypatch.setattr(
        model_files._KnownTokenizerClasses,
        "remember",
        lambda self, path, tok: real(self, path, ItsOwnTokenizer.__new__(ItsOwnTokenizer)),
    )
    load_tokenizer(tokenizer_folder)
    load_tokenizer(tokenizer_folder)
    assert len(calls) == 2  # AutoTokenizer every time: only the plain fast class may be loaded directly


def test_an_unwritable_cache_costs_only_the_long_way(tokenizer_folder, monkeypatch, tmp_path):
    blocker = tmp_path / "not_a_dir"
    blocker.write_text("")
    monkeypatch.setenv("PLAIT_CACHE_DIR", str(blocker))  # makedirs under a file fails
    calls = count_auto_loads(monkeypatch)
    a, b = load_tokenizer(tokenizer_folder), load_tokenizer(tokenizer_folder)
    assert len(calls) == 2
    same_tokenizer(a, b)


def test_the_engine_process_imports_no_torch_on_a_warm_start(tmp_path, monkeypatch, default_model_path):
    """A real Engine started in a fresh interpreter, its tokenizer already known: the engine process never
    imports torch (~2.5 s of a CPU start-up, once spent before the scheduler process was even launched),
    and it says where the scheduler process's start-up went."""
    monkeypatch.setenv("PLAIT_CACHE_DIR", str(tmp_path / "cache"))  # (the model folder is given by path)
    load_tokenizer(default_model_path)  # remembered (this process has torch already; the child must not)
    code = (
        "import sys\n"
        "from plait.runtime import Engine\n"
        f"with Engine(model_path={default_model_path!r}, num_threads=1, max_total_tokens=512) as eng:\n"
        "    out = eng.generate('Hello', {'max_new_tokens': 2, 'temperature': 0})\n"
        "    phases = eng.startup_phases\n"
        "assert out['meta_info']['completion_tokens'] == 2, out\n"
        "assert list(phases) == ['imported', 'model', 'tokenizer', 'ready'] or "
        "list(phases) == ['imported', 'tokenizer', 'model', 'ready'], phases\n"
        "assert 0 < phases['imported'] <= min(phases['model'], phases['tokenizer']) <= phases['ready'], phases\n"
        "print('torch' in sys.modules)\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300, env=os.environ)
    assert out.returncode == 0, out.stderr[-3000:]
    assert out.stdout.strip().splitlines()[-1] == "False", "torch was imported by the engine process"


def test_a_corrupt_cache_file_takes_the_long_way_and_is_written_again(tokenizer_folder, monkeypatch, tmp_path):
    cache = tmp_path / "cache" / "tokenizer_classes.json"
    cache.parent.mkdir(parents=True)
    cache.write_text('{"half a json')
    calls = count_auto_loads(monkeypatch)
    load_tokenizer(tokenizer_folder)
    assert len(calls) == 1
    cache.write_text('["not", "a", "dict"]')  # valid JSON of the wrong shape: ignored, rewritten
    load_tokenizer(tokenizer_folder)
    load_tokenizer(tokenizer_folder)
    assert len(calls) == 2
