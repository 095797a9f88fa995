"""OpenAI: programs on any OpenAI-compatible server (api.openai.com, plait's /v1, vLLM, ...).

Chat models receive `s.messages()`, so a gen must open an assistant turn — `s += assistant(gen(...))`
— exactly as in SGLang. Completion models receive the raw text. Constraints the OpenAI API lacks
(regex, top_k, min_p, ...) go in `extra_body`, which SGLang-style servers (plait's included) read.
"""

from __future__ import annotations

import json
import logging
import os
import threading
from dataclasses import dataclass, field
from typing import Any, Iterator, Optional, Sequence, Union

from ..chat_template import ChatTemplate, get_chat_template, get_chat_template_by_model_path
from ..choices import ChoicesDecision, ChoicesSamplingMethod
from ..gen_params import ResolvedGen
from .base import BaseBackend
from .native import mean_logprob

logger = logging.getLogger(__name__)

INSTRUCT_MODEL_NAMES = ("gpt-3.5-turbo-instruct", "davinci-002", "babbage-002")


@dataclass
class TokenUsage:
    """The tokens a backend's requests used, summed (`OpenAI.token_usage`; `reset()` starts over)."""

    prompt_tokens: int = 0
    completion_tokens: int = 0
    _lock: threading.Lock = field(default_factory=threading.Lock, repr=False, compare=False)

    def add(self, usage: Any) -> None:
        if usage is None:
            return
        with self._lock:  # run_batch's programs report from their own threads
            self.prompt_tokens += getattr(usage, "prompt_tokens", 0) or 0
            self.completion_tokens += getattr(usage, "completion_tokens", 0) or 0

    def reset(self) -> None:
        with self._lock:
            self.prompt_tokens = self.completion_tokens = 0


class OpenAI(BaseBackend):
    def __init__(
        self,
        model_name: str,
        is_chat_model: Optional[bool] = None,
        chat_template: Optional[Union[ChatTemplate, str]] = None,
        is_azure: bool = False,
        base_url: Optional[str] = None,
        api_key: Optional[str] = None,
        **client_kwargs: Any,
    ) -> None:
        """`is_azure=True`: an Azure OpenAI deployment through `openai.AzureOpenAI` (pass `api_version` and
        `azure_endpoint` as its client takes them); other keyword arguments go to the client as well."""
        import openai

        if isinstance(chat_template, str):
            chat_template = get_chat_template(chat_template)
        super().__init__(chat_template or get_chat_template_by_model_path(model_name))
        if api_key is None and base_url is not None and not os.environ.get("OPENAI_API_KEY"):
            api_key = "EMPTY"  # local OpenAI-compatible servers usually need no key
        client_class = openai.AzureOpenAI if is_azure else openai.OpenAI
        if base_url is not None:
            client_kwargs["base_url"] = base_url
        self.client = client_class(api_key=api_key, **client_kwargs)
        self.model_name = model_name
        self.is_chat_model = model_name not in INSTRUCT_MODEL_NAMES if is_chat_model is None else is_chat_model
        self.token_usage = TokenUsage()

    def check_api_speculation(self, num_api_spec_tokens: int) -> None:
        if self.is_chat_model:
            raise NotImplementedError(
                f"@function(num_api_spec_tokens={num_api_spec_tokens}): API speculative execution is not "
                "supported by plait's OpenAI backend; drop num_api_spec_tokens and write each gen as the "
                "start of its own assistant turn, `s += assistant(gen(...))` (one request per gen)"
            )

    def get_model_name(self) -> str:
        return self.model_name

    # ---- requests ----
    def _request_kwargs(self, params: ResolvedGen) -> dict:
        sp = params.sampling
        kwargs: dict[str, Any] = {
            # a LoRA adapter named as vLLM's servers and plait's take it: its own name as the model
            "model": params.options.lora_path or self.model_name,
            "max_tokens": sp.max_new_tokens,
            "temperature": sp.temperature,
            "top_p": sp.top_p,
            "n": sp.n,
        }
        if sp.stop_strs:
            kwargs["stop"] = sp.stop_strs
        for name in ("frequency_penalty", "presence_penalty", "seed"):
            if getattr(sp, name):
                kwargs[name] = getattr(sp, name)
        extra: dict[str, Any] = {}
        for name, unset in (
            ("top_k", -1),
            ("min_p", 0.0),
            ("min_new_tokens", 0),
            ("ignore_eos", False),
            ("regex", None),
            ("stop_token_ids", None),
            ("repetition_penalty", 1.0),
        ):
            if getattr(sp, name) != unset:
                extra["min_tokens" if name == "min_new_tokens" else name] = getattr(sp, name)
        if sp.json_schema is not None:
            kwargs["response_format"] = {
                "type": "json_schema",
                "json_schema": {"name": "output", "schema": json.loads(sp.json_schema)},
            }
        if extra:
            kwargs["extra_body"] = extra
        return kwargs

    def _prompt(self, s: Any) -> dict:
        if not self.is_chat_model:
            return {"prompt": s.text_}
        if s.cur_role != "assistant" or s.text_[s.cur_role_begin_pos :].strip():
            raise RuntimeError(
                "for OpenAI chat models, gen() must open an assistant turn, e.g. "
                "`s += assistant(gen('answer'))`: the API continues a conversation, not arbitrary text"
            )
        return {"messages": list(s.messages_)}

    def _logprob_kwargs(self, params: ResolvedGen) -> dict:
        """gen(return_logprob=True, top_logprobs_num=k) as the OpenAI API spells it (it has no prompt
        logprobs for chat models, so logprob_start_len does not apply)."""
        if not params.options.return_logprob:
            return {}
        top = params.options.top_logprobs_num
        if self.is_chat_model:
            return {"logprobs": True, "top_logprobs": top}
        return {"logprobs": top}

    def generate(self, s: Any, params: ResolvedGen):
        kwargs = {**self._request_kwargs(params), **self._prompt(s), **self._logprob_kwargs(params)}
        if self.is_chat_model:
            ret = self.client.chat.completions.create(**kwargs)
            texts = [c.message.content or "" for c in ret.choices]
        else:
            ret = self.client.completions.create(**kwargs)
            texts = [c.text for c in ret.choices]
        self.token_usage.add(ret.usage)
        metas = [
            {
                "id": ret.id,
                "finish_reason": c.finish_reason,
                "prompt_tokens": getattr(ret.usage, "prompt_tokens", None),
                "completion_tokens": getattr(ret.usage, "completion_tokens", None),
            }
            for c in ret.choices
        ]
        if params.options.return_logprob:
            # NOTE: they were dropped silently; get_meta_info(name)["output_token_logprobs"] then failed
            # far from the gen. The API gives no token ids: entries are (logprob, None, token text).
            for meta, choice in zip(metas, ret.choices):
                meta.update(_output_logprobs(choice.logprobs, self.is_chat_model))
        if params.sampling.n > 1:
            return texts, metas
        return texts[0], metas[0]

    def generate_stream(self, s: Any, params: ResolvedGen) -> Iterator[tuple[str, dict]]:
        if params.sampling.n > 1:
            raise ValueError("gen(n > 1) cannot stream; run the program with stream=False")
        kwargs = {**self._request_kwargs(params), **self._prompt(s), "stream": True}
        kwargs["stream_options"] = {"include_usage": True}  # the last chunk: token_usage
        create = self.client.chat.completions.create if self.is_chat_model else self.client.completions.create
        for chunk in create(**kwargs):
            self.token_usage.add(getattr(chunk, "usage", None))
            if not chunk.choices:
                continue
            choice = chunk.choices[0]
            piece = (choice.delta.content if self.is_chat_model else choice.text) or ""
            yield piece, {"id": chunk.id, "finish_reason": choice.finish_reason}

    def select(
        self, s: Any, choices: Sequence[str], temperature: float, choices_method: ChoicesSamplingMethod
    ) -> ChoicesDecision:
        """Completion models: score each choice from echoed prompt logprobs (one batched request)."""
        if self.is_chat_model:
            raise NotImplementedError(
                "select() needs prompt logprobs, which OpenAI chat models do not "
                "return; use a completion model or the plait Runtime/RuntimeEndpoint"
            )
        if choices_method.requires_unconditional_logprobs:
            raise NotImplementedError(f"{choices_method!r} is not supported by the OpenAI backend")
        prefix = s.text_
        ret = self.client.completions.create(
            model=self.model_name,
            prompt=[prefix + c for c in choices],
            max_tokens=1,
            echo=True,
            logprobs=0,
            temperature=0,
        )
        self.token_usage.add(ret.usage)
        by_index = sorted(ret.choices, key=lambda c: c.index)
        input_logprobs = []
        for choice, c in zip(by_index, choices):
            lp = choice.logprobs
            end = len(prefix) + len(c)
            entries = [
                (v, None, t)
                for v, t, off in zip(lp.token_logprobs, lp.tokens, lp.text_offset)
                if off < end and off + len(t) > len(prefix)
            ]
            input_logprobs.append(entries)
        normalized = [mean_logprob(e) for e in input_logprobs]
        return choices_method(
            choices=list(choices),
            normalized_prompt_logprobs=normalized,
            input_token_logprobs=input_logprobs,
            output_token_logprobs=[[] for _ in choices],
        )


def _output_logprobs(logprobs: Any, is_chat: bool) -> dict:
    """An OpenAI choice's logprobs in SGLang's meta_info shape: output_token_logprobs (one
    (logprob, None, token) per token) and output_top_logprobs (a list of those per token)."""
    if logprobs is None:
        return {"output_token_logprobs": [], "output_top_logprobs": []}
    if is_chat:
        entries = logprobs.content or []
        tokens = [(e.logprob, None, e.token) for e in entries]
        tops = [[(t.logprob, None, t.token) for t in e.top_logprobs or []] for e in entries]
    else:
        tokens = [(lp, None, tok) for lp, tok in zip(logprobs.token_logprobs, logprobs.tokens)]
        tops = [[(lp, None, tok) for tok, lp in (top or {}).items()] for top in logprobs.top_logprobs or []]
    return {"output_token_logprobs": tokens, "output_top_logprobs": tops}
