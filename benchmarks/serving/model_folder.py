"""A model folder for serving benchmarks: a built-in shape's config.json with a real tokenizer, served with
dummy weights (`--load-format dummy`) by `plait serve` and `vllm serve` alike.

    python benchmarks/serving/model_folder.py --shape llama-3.1-8b --out /tmp/llama8b-smol
    python benchmarks/serving/model_folder.py --shape llama-3.1-8b --tokenizer tok/ --out /tmp/llama8b-smol

The tokenizer is the embedded default model's (SmolLM2-135M-Instruct, vocabulary 49,152) unless
`--tokenizer` names a folder; the config's `vocab_size` is the tokenizer's, so every id a client sends
decodes. `--save-tokenizer DIR` writes the tokenizer files alone (to carry them to a machine without the
default model's package).
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "chat_template.jinja")


def tokenizer_folder(given: str | None) -> str:
    if given:
        return given
    from plait.runtime.models.default_model import default_model_path

    return default_model_path()


def copy_tokenizer(src: str, dst: str) -> list[str]:
    os.makedirs(dst, exist_ok=True)
    copied = []
    for name in TOKENIZER_FILES:
        if os.path.exists(os.path.join(src, name)):
            shutil.copy(os.path.join(src, name), os.path.join(dst, name))
            copied.append(name)
    if "tokenizer.json" not in copied:
        raise SystemExit(f"{src} has no tokenizer.json")
    return copied


def vocab_size(folder: str) -> int:
    with open(os.path.join(folder, "tokenizer.json")) as f:
        tok = json.load(f)
    ids = list(tok["model"]["vocab"].values()) + [t["id"] for t in tok.get("added_tokens", [])]
    return max(ids) + 1


def write_folder(shape: str, tokenizer: str, out: str) -> dict:
    from plait.runtime.models.config import BUILTIN_SHAPES

    copy_tokenizer(tokenizer, out)
    cfg = dict(BUILTIN_SHAPES[shape])
    cfg.update(model_type="llama", torch_dtype="bfloat16", hidden_act="silu", vocab_size=vocab_size(out))
    own = {}  # the tokenizer's own model's special ids
    if os.path.exists(os.path.join(tokenizer, "config.json")):
        with open(os.path.join(tokenizer, "config.json")) as f:
            own = json.load(f)
    for key in ("bos_token_id", "eos_token_id", "pad_token_id"):
        if key in own:
            cfg[key] = own[key]
    with open(os.path.join(out, "config.json"), "w") as f:
        json.dump(cfg, f, indent=1)
    return cfg


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--shape", default="llama-3.1-8b")
    p.add_argument("--tokenizer", default=None, help="a folder with tokenizer.json (default: the embedded model's)")
    p.add_argument("--out", default=None)
    p.add_argument("--save-tokenizer", default=None, help="only copy the tokenizer files into this folder")
    args = p.parse_args()
    src = tokenizer_folder(args.tokenizer)
    if args.save_tokenizer:
        print("copied", copy_tokenizer(src, args.save_tokenizer), "to", args.save_tokenizer)
        shutil.copy(os.path.join(src, "config.json"), os.path.join(args.save_tokenizer, "config.json"))
        return
    if not args.out:
        p.error("--out is needed")
    cfg = write_folder(args.shape, src, args.out)
    print(f"{args.out}: {args.shape} shape, vocab {cfg['vocab_size']}, tokenizer from {src}")


if __name__ == "__main__":
    main()
