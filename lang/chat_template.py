"""Role markup: the text `user(...)`, `assistant(...)` and `system(...)` put around their content.

SGLang keeps a hand-written registry of templates keyed by model name. plait derives the markup from
the tokenizer's own Jinja chat template instead, so any model that ships a template works: render
short conversations with sentinel contents and read off what the template put before and after each
sentinel. A few named templates remain for backends that have no tokenizer (OpenAI, tracing).
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field
from typing import Any, Optional, Sequence

logger = logging.getLogger(__name__)

ROLES = ("system", "user", "assistant")


@dataclass(frozen=True)
class ChatTemplate:
    name: str
    role_prefix_and_suffix: dict[str, tuple[str, str]]
    # Inserted as a system turn when a program's first role is not "system" (as the template does).
    default_system_prompt: Optional[str] = None
    # End-of-turn strings added to every gen's `stop`.
    stop_str: tuple[str, ...] = ()
    image_token: str = "<image>"
    # Where each string came from, for error messages and debugging.
    source: str = field(default="builtin", compare=False)

    def get_prefix_and_suffix(self, role: str, hist_messages: Sequence[dict] = ()) -> tuple[str, str]:
        if role not in self.role_prefix_and_suffix:
            raise ValueError(f"role {role!r} is not one of {list(self.role_prefix_and_suffix)}")
        return self.role_prefix_and_suffix[role]


_BUILTIN = {
    # SGLang's fallback for models it does not know.
    "default": ChatTemplate(
        "default", {"system": ("SYSTEM:", "\n"), "user": ("USER:", "\n"), "assistant": ("ASSISTANT:", "\n")}
    ),
    # No markup: the OpenAI chat backend sends messages(), so the text is only for reading.
    "plain": ChatTemplate("plain", {"system": ("", "\n"), "user": ("", "\n"), "assistant": ("", "\n")}),
    "chatml": ChatTemplate(
        "chatml", {r: (f"<|im_start|>{r}\n", "<|im_end|>\n") for r in ROLES}, stop_str=("<|im_end|>",)
    ),
    "llama-3-instruct": ChatTemplate(
        "llama-3-instruct",
        {r: (f"<|start_header_id|>{r}<|end_header_id|>\n\n", "<|eot_id|>") for r in ROLES},
        stop_str=("<|eot_id|>",),
    ),
}


def get_chat_template(name: str) -> ChatTemplate:
    if name not in _BUILTIN:
        raise ValueError(f"unknown chat template {name!r}; known: {sorted(_BUILTIN)}")
    return _BUILTIN[name]


class TemplateDerivationError(ValueError):
    pass


def chat_template_from_tokenizer(tokenizer: Any, name: Optional[str] = None) -> ChatTemplate:
    """Derive role markup from `tokenizer.chat_template`; fall back to 'default' with a warning."""
    if not getattr(tokenizer, "chat_template", None):
        logger.warning("the tokenizer has no chat template; using plait's 'default' role markup")
        return _BUILTIN["default"]
    try:
        return _derive(tokenizer, name or getattr(tokenizer, "name_or_path", "") or "tokenizer")
    except Exception as e:  # a template may raise for conversations it does not accept
        logger.warning("could not derive role markup from the chat template (%s); using 'default'", e)
        return _BUILTIN["default"]


# Sentinels: plain words, so templates that trim or escape content leave them intact.
_S, _U, _A, _U2 = "PLAITSYSTEMXQ", "PLAITUSERXQ", "PLAITASSISTANTXQ", "PLAITUSERTWOXQ"


def _derive(tokenizer: Any, name: str) -> ChatTemplate:
    def render(messages: list[dict], generation_prompt: bool = False) -> str:
        return tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=generation_prompt)

    sys_msg = {"role": "system", "content": _S}
    user_msg = {"role": "user", "content": _U}
    asst_msg = {"role": "assistant", "content": _A}

    t_sys = render([sys_msg])
    t_user = render([sys_msg, user_msg])
    t_asst = render([sys_msg, user_msg, asst_msg])
    t_user2 = render([sys_msg, user_msg, asst_msg, {"role": "user", "content": _U2}])
    t_prompt = render([sys_msg, user_msg], generation_prompt=True)

    system = _split(t_sys, _S, "system")
    user = _split(_after(t_user, t_sys, "user"), _U, "user")
    assistant = _split(_after(t_asst, t_user, "assistant"), _A, "assistant")
    second_user = _split(_after(t_user2, t_asst, "second user"), _U2, "second user")
    if second_user != user:
        raise TemplateDerivationError("the template marks the second user turn differently from the first")
    generation_prefix = _after(t_prompt, t_user, "generation prompt")
    if generation_prefix:
        # NOTE: what the model sees before it generates matters most; some templates (Qwen3)
        # render past assistant turns differently from the generation prompt.
        assistant = (generation_prefix, assistant[1])

    system = (_strip_auto_bos(tokenizer, system[0]), system[1])

    # A template that injects its own system turn when none is given (SmolLM2, Qwen2.5) does so
    # before the first user turn; recover that text so plait inserts the same turn.
    default_system = None
    t_only_user = render([user_msg])
    before_user = _strip_auto_bos(tokenizer, t_only_user[: t_only_user.index(_U)])
    injected = before_user[: len(before_user) - len(user[0])] if before_user.endswith(user[0]) else ""
    if injected and injected.startswith(system[0]) and injected.endswith(system[1]):
        default_system = injected[len(system[0]) : len(injected) - len(system[1])]

    end_of_turn = assistant[1].strip()
    stop = (end_of_turn,) if end_of_turn else ()
    if not stop and getattr(tokenizer, "eos_token", None):
        stop = (tokenizer.eos_token,)
    return ChatTemplate(
        name=name,
        role_prefix_and_suffix={"system": system, "user": user, "assistant": assistant},
        default_system_prompt=default_system,
        stop_str=stop,
        source="tokenizer",
    )


def _split(text: str, sentinel: str, what: str) -> tuple[str, str]:
    if text.count(sentinel) != 1:
        raise TemplateDerivationError(f"the {what} content does not appear exactly once in the rendering")
    before, after = text.split(sentinel)
    return before, after


def _after(longer: str, shorter: str, what: str) -> str:
    if not longer.startswith(shorter):
        raise TemplateDerivationError(f"adding a {what} turn rewrites the earlier turns")
    return longer[len(shorter) :]


def _strip_auto_bos(tokenizer: Any, text: str) -> str:
    """Drop a leading BOS string when the tokenizer adds BOS itself (it would appear twice)."""
    bos = getattr(tokenizer, "bos_token", None)
    if not bos or not text.startswith(bos):
        return text
    bos_id = getattr(tokenizer, "bos_token_id", None)
    ids = tokenizer("a").input_ids
    if bos_id is not None and ids and ids[0] == bos_id:
        return text[len(bos) :]
    return text
