"""Role markup: the text `user(...)`, `assistant(...)` and `system(...)` put around their content.

SGLang keeps a hand-written registry of templates keyed by model name. plait derives the markup from
the tokenizer's own Jinja chat template instead, so any model that ships a template works: render
short conversations with sentinel contents and read off what the template put before and after each
sentinel. SGLang's named templates (`named_templates.py`) remain for backends that have no tokenizer
(OpenAI, Anthropic, tracing) and for programs that name one.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field
from typing import Any, Optional, Sequence

from .named_templates import NAMED_TEMPLATES, template_name_for_model_path

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
    # "llama-2": the system turn sits inside the first user turn ([INST] <<SYS>>...<</SYS>> question [/INST]).
    style: str = "plain"
    # Where each string came from, for error messages and debugging.
    source: str = field(default="builtin", compare=False)

    def get_prefix_and_suffix(self, role: str, hist_messages: Sequence[dict] = ()) -> tuple[str, str]:
        if role not in self.role_prefix_and_suffix:
            raise ValueError(f"role {role!r} is not one of {list(self.role_prefix_and_suffix)}")
        prefix, suffix = self.role_prefix_and_suffix[role]
        if self.style == "llama-2":
            if role == "system" and not hist_messages:
                return self.role_prefix_and_suffix["user"][0] + prefix, suffix
            if role == "user" and len(hist_messages) == 1 and hist_messages[0].get("content") is not None:
                return "", suffix
        return prefix, suffix

    def get_prompt(self, messages: Sequence[dict]) -> str:
        """A conversation as text; a system message whose content is None stands for the default prompt."""
        prompt = ""
        for i, message in enumerate(messages):
            role, content = message["role"], message["content"]
            if role == "system" and content is None:
                content = self.default_system_prompt
                if content is None:
                    continue
            prefix, suffix = self.get_prefix_and_suffix(role, messages[:i])
            prompt += f"{prefix}{content}{suffix}"
        return prompt


def _named(name: str) -> ChatTemplate:
    spec = NAMED_TEMPLATES[name]
    return ChatTemplate(
        name,
        dict(spec["roles"]),
        default_system_prompt=spec.get("system"),
        stop_str=tuple(spec.get("stop", ())),
        image_token=spec.get("image_token", "<image>"),
        style=spec.get("style", "plain"),
    )


_BUILTIN = {name: _named(name) for name in NAMED_TEMPLATES}


def get_chat_template(name: str) -> ChatTemplate:
    """One of SGLang's named templates ("default", "chatml", "llama-2-chat", "qwen", ...) or plait's "plain"."""
    if name not in _BUILTIN:
        raise ValueError(f"unknown chat template {name!r}; known: {sorted(_BUILTIN)}")
    return _BUILTIN[name]


def get_chat_template_by_model_path(model_path: str) -> ChatTemplate:
    """The named template SGLang picks for a model path (words in it such as "llama-3" and "instruct"),
    "default" when none matches."""
    return _BUILTIN[template_name_for_model_path(model_path) or "default"]


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
