"""SGLang's named chat templates, as data: each name's role markup, and which model paths pick which name.

`plait.chat_template` builds its `ChatTemplate`s from this table (`get_chat_template(name)`,
`get_chat_template_by_model_path(path)`). A model served by plait's runtime needs none of them: its markup is
derived from the tokenizer's own template. They are for backends without a tokenizer (OpenAI, Anthropic,
LiteLLM, VertexAI) and for programs that name a template, as SGLang's do.
"""

from __future__ import annotations

from typing import Optional

_IM = ("<|im_start|>system\n", "<|im_end|>\n"), ("<|im_start|>user\n", "<|im_end|>\n")
_IM_ASSISTANT = ("<|im_start|>assistant\n", "<|im_end|>\n")
_LLAMA3 = {r: (f"<|start_header_id|>{r}<|end_header_id|>\n\n", "<|eot_id|>") for r in ("system", "user", "assistant")}
_DEEPSEEK = {"system": ("", ""), "user": ("<｜User｜>", ""), "assistant": ("<｜Assistant｜>", "<｜end▁of▁sentence｜>")}
_MINICPM = {"system": ("", " "), "user": ("user:", " "), "assistant": ("assistant:", "</s>")}
_VICUNA_SYSTEM = (
    "A chat between a curious user and an artificial intelligence assistant. "
    "The assistant gives helpful, detailed, and polite answers to the user's questions."
)
_YI_VL_SYSTEM = (
    "This is a chat between an inquisitive human and an AI assistant. Assume the role of the AI assistant. "
    "Read all the images carefully, and respond to the human's questions with informative, helpful, detailed "
    "and polite answers."
)


def _chatml(**extra: object) -> dict:
    return {"roles": {"system": _IM[0], "user": _IM[1], "assistant": _IM_ASSISTANT}, "stop": ("<|im_end|>",), **extra}


# name -> {"roles": {role: (prefix, suffix)}, "system": default system prompt, "stop": end-of-turn strings,
#          "image_token": what an image becomes in the text, "style": "llama-2" (the system turn inside the
#          first user turn) or absent}
NAMED_TEMPLATES: dict[str, dict] = {
    "default": {"roles": {"system": ("SYSTEM:", "\n"), "user": ("USER:", "\n"), "assistant": ("ASSISTANT:", "\n")}},
    # No markup: the OpenAI chat backend sends messages(), so the text is only for reading.
    "plain": {"roles": {"system": ("", "\n"), "user": ("", "\n"), "assistant": ("", "\n")}},
    "claude": {"roles": {"system": ("", ""), "user": ("\n\nHuman: ", ""), "assistant": ("\n\nAssistant:", "")}},
    "chatml": _chatml(),
    "chatml-llava": _chatml(system="You are a helpful assistant.", image_token="<image>\n"),
    "qwen": _chatml(system="You are a helpful assistant."),
    "qwen2-vl": _chatml(
        system="You are a helpful assistant.", image_token="<|vision_start|><|image_pad|><|vision_end|>"
    ),
    "vicuna_v1.1": {
        "roles": {"system": ("", " "), "user": ("USER:", " "), "assistant": ("ASSISTANT:", "</s>")},
        "system": _VICUNA_SYSTEM,
        "image_token": " <image>\n",
    },
    "llama-2-chat": {
        "roles": {
            "system": ("<<SYS>>\n", "\n<</SYS>>\n\n"),
            "user": ("[INST] ", " [/INST]"),
            "assistant": ("", " </s><s>"),
        },
        "style": "llama-2",
    },
    "llama-3-instruct": {"roles": _LLAMA3, "stop": ("<|eot_id|>",), "image_token": "<|image|>"},
    "llama-3-instruct-llava": {"roles": _LLAMA3, "stop": ("<|eot_id|>",), "image_token": "<image>\n"},
    "llama-4": {
        "roles": {r: (f"<|header_start|>{r}<|header_end|>\n\n", "<|eot|>") for r in ("system", "user", "assistant")},
        "stop": ("<|eot|>",),
        "image_token": "<|image|>",
    },
    "minicpmv": {"roles": _MINICPM, "stop": ("<|im_end|>", "<|endoftext|>"), "image_token": "(<image>./</image>)"},
    "minicpmo": {"roles": _MINICPM, "stop": ("<|im_end|>", "<|endoftext|>"), "image_token": "(<image>./</image>)"},
    "janus-pro": {"roles": _DEEPSEEK, "stop": ("<｜end▁of▁sentence｜>",), "image_token": "<image_placeholder>\n"},
    "deepseek-v3": {"roles": _DEEPSEEK, "stop": ("<｜end▁of▁sentence｜>",)},
    "yi-1.5": {
        "roles": {
            "system": ("", ""),
            "user": ("<|im_start|>user\n", "<|im_end|>\n<|im_start|>assistant\n"),
            "assistant": ("", "<|im_end|>\n"),
        },
        "stop": ("<|im_end|>",),
    },
    "yi-vl": {
        "roles": {"system": ("", "\n\n"), "user": ("### Human:", "\n"), "assistant": ("### Assistant:", "\n")},
        "system": _YI_VL_SYSTEM,
        "image_token": " <image_placeholder>\n",
    },
    "gemma-it": {
        "roles": {
            "system": ("", ""),
            "user": ("<start_of_turn>user\n", "<end_of_turn>\n"),
            "assistant": ("<start_of_turn>model\n", "<end_of_turn>\n"),
        }
    },
    "dbrx-instruct": {
        "roles": {
            "system": ("<|im_start|>system\n", "<|im_end|>"),
            "user": ("\n<|im_start|>user\n", "<|im_end|>"),
            "assistant": ("\n<|im_start|>assistant\n", "<|im_end|>"),
        },
        "system": "You are DBRX, created by Databricks.",
        "stop": ("<|im_end|>",),
    },
    "c4ai-command-r": {
        "roles": {
            "system": ("<|START_OF_TURN_TOKEN|><|SYSTEM_TOKEN|>", "<|END_OF_TURN_TOKEN|>"),
            "user": ("<|START_OF_TURN_TOKEN|><|USER_TOKEN|>", "<|END_OF_TURN_TOKEN|>"),
            "assistant": ("<|START_OF_TURN_TOKEN|><|CHATBOT_TOKEN|>", "<|END_OF_TURN_TOKEN|>"),
        }
    },
    "granite-3-instruct": {
        "roles": {
            r: (f"<|start_of_role|>{r}<|end_of_role|>", "<|end_of_text|>") for r in ("system", "user", "assistant")
        },
        "stop": ("<|end_of_text|>",),
    },
}

# (words that must all be in the lower-cased model path, words that must not be, template name), first match
# wins; SGLang's order, so a path picks the template it picks there.
_PATH_RULES: tuple[tuple[tuple[str, ...], tuple[str, ...], str], ...] = (
    (("deepseek-v3",), ("base",), "deepseek-v3"),
    (("deepseek-r1",), ("base",), "deepseek-v3"),
    (("janus",), (), "janus-pro"),
    (("dbrx", "instruct"), (), "dbrx-instruct"),
    (("vicuna",), (), "vicuna_v1.1"),
    (("llava-v1.5",), (), "vicuna_v1.1"),
    (("llava-next-video-7b",), (), "vicuna_v1.1"),
    (("llama-2", "chat"), (), "llama-2-chat"),
    (("mistral", "instruct"), (), "llama-2-chat"),
    (("mixtral", "instruct"), (), "llama-2-chat"),
    (("codellama", "instruct"), (), "llama-2-chat"),
    (("llama-3", "instruct"), (), "llama-3-instruct"),
    (("tinyllama",), (), "chatml"),
    (("qwen", "vl"), (), "qwen2-vl"),
    (("qwen", "chat"), ("llava",), "qwen"),
    (("qwen", "instruct"), ("llava",), "qwen"),
    (("llava-v1.6-34b",), (), "chatml-llava"),
    (("llava-v1.6-yi-34b",), (), "chatml-llava"),
    (("llava-next-video-34b",), (), "chatml-llava"),
    (("llava-onevision-qwen2",), (), "chatml-llava"),
    (("yi-vl",), ("llava",), "yi-vl"),
    (("yi-1.5", "chat"), (), "yi-1.5"),
    (("gemma", "it"), (), "gemma-it"),
    (("minicpm-v",), (), "minicpmv"),
    (("minicpm-o",), (), "minicpmo"),
    (("c4ai-command-r",), (), "c4ai-command-r"),
    (("granite", "instruct"), (), "granite-3-instruct"),
    (("gemma-3",), ("1b",), "gemma-it"),
)


def template_name_for_model_path(model_path: str) -> Optional[str]:
    """The named template SGLang picks for a model path (by the words in it), None when none matches."""
    path = model_path.lower()
    for needed, excluded, name in _PATH_RULES:
        if all(w in path for w in needed) and not any(w in path for w in excluded):
            return name
    return None
