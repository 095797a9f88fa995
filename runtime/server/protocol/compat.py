"""Request fields of other servers' APIs that plait does not implement, accepted so that their clients work
unchanged (SGLang's `bench_serving` sends `return_routed_experts`, the openai client `prompt_cache_key`, ...).

One row per field: the APIs that define it (current SGLang's `GenerateReqInput` and OpenAI-route models,
OpenAI's own request parameters, vLLM's request models), its type, and what plait does with it:

- IGNORED: a hint or an extra output plait has no use for (priority, routing keys, trace headers, metric
  labels, MoE routing records). Any value of the right type is accepted; a value other than the "off" one
  is logged once per server, so an operator can see what clients ask for.
- REFUSED_UNLESS_OFF: a feature that would change the answer (images, LoRA adapters, custom logit
  processors, beam search, ...). Accepted with its off value (clients send `lora_path: null` on every
  request); any other value is a 400 naming the field and why, as ignoring it would be a wrong answer.

Wrong types stay 400s that name the field. Fields plait implements under another server's name (vLLM's
`include_stop_str_in_output`, SGLang's `stop_regex`) are ordinary fields of the request models; fields no
API defines are ignored with a warning (`review`), except where a misplaced field changes the result.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from functools import cache
from typing import Any, Literal, Optional, Union

from pydantic import BaseModel, Field, create_model
from starlette.requests import Request

from ..errors import APIError

logger = logging.getLogger("plait.server")

IGNORED = "ignored"
REFUSED_UNLESS_OFF = "refused unless off"
# The APIs a row belongs to: native /generate, /v1/completions, /v1/chat/completions, /v1/responses.
NATIVE, COMPLETIONS, CHAT, RESPONSES = "native", "completions", "chat", "responses"
OPENAI = (COMPLETIONS, CHAT)
OPENAI_ALL = (COMPLETIONS, CHAT, RESPONSES)
EVERY_API = (NATIVE, COMPLETIONS, CHAT)
# The response header that lists the top-level fields a request sent that no API defines.
IGNORED_FIELDS_HEADER = "x-plait-ignored-fields"
_OFF = (None, False, "", [], {})


@dataclass(frozen=True)
class CompatField:
    apis: tuple[str, ...]
    type: Any
    use: str
    why: str
    off: tuple = _OFF  # values that ask for nothing

    def is_off(self, value: Any) -> bool:
        return any(value is o or (type(value) is type(o) and value == o) for o in self.off)


def _ignored(apis: tuple[str, ...], type_: Any, why: str, off: tuple = _OFF) -> CompatField:
    return CompatField(apis, type_, IGNORED, why, off)


def _refused(apis: tuple[str, ...], type_: Any, why: str, off: tuple = _OFF) -> CompatField:
    return CompatField(apis, type_, REFUSED_UNLESS_OFF, why, off)


StrOrList = Union[str, list[Optional[str]]]
IntOrList = Union[int, list[Optional[int]]]
Json = Any

_NO_MOE = "plait serves dense models: there are no routed experts to report"
_ONE_RANK = "plait runs one data-parallel rank"
_NO_PD = "plait does not run prefill/decode disaggregation"
_NO_MM = "plait's vision models take images only (image_data, image_url parts), no video or audio fields"
_NO_LORA = "plait names LoRA adapters by lora_path (their names)"
_NO_REASONING = "plait has no reasoning parser: a reasoning model's thinking stays in the content"
_CACHE_KEY = (
    "plait's prefix cache matches tokens exactly, so requests that share a prefix share its cache whatever their key"
)
_NO_STORAGE = "plait stores no requests or responses"
_EXTRA_OUTPUT = "plait does not return this extra output; the rest of the response is unchanged"
_TRACE = "plait keeps no request traces"

FIELDS: dict[str, CompatField] = {
    # ---- hints: routing, scheduling, caching keys, bookkeeping (SGLang, vLLM, OpenAI)
    "routing_key": _ignored(EVERY_API, str, _ONE_RANK),
    "routed_dp_rank": _ignored(EVERY_API, int, _ONE_RANK),
    "data_parallel_rank": _ignored(EVERY_API, int, _ONE_RANK),
    "disagg_prefill_dp_rank": _ignored(EVERY_API, int, _ONE_RANK),
    "kv_router_hint": _ignored((NATIVE,), dict[str, Json], _ONE_RANK),
    "extra_key": _ignored(EVERY_API, StrOrList, _CACHE_KEY),
    "ngram_corpus_id": _ignored(OPENAI, StrOrList, "plait has no n-gram speculative decoding"),
    "prompt_cache_key": _ignored(OPENAI_ALL, str, _CACHE_KEY),
    "prompt_cache_retention": _ignored(OPENAI_ALL, str, "cached prefixes stay until evicted by newer ones"),
    "prompt_cache_options": _ignored(OPENAI_ALL, dict[str, Json], "cached prefixes stay until evicted by newer ones"),
    "session_id": _ignored(EVERY_API, str, "requests of a session share their prefixes in the cache anyway"),
    "conversation_id": _ignored((NATIVE,), str, "requests of a conversation share their prefixes anyway"),
    "request_id": _ignored(OPENAI, str, "the response id is plait's own (send `rid` to choose it)"),
    "no_logs": _ignored((NATIVE,), bool, "plait does not log request contents"),
    "custom_labels": _ignored(EVERY_API, dict[str, str], "plait's metrics carry no per-request labels"),
    "external_trace_header": _ignored((NATIVE,), dict[str, Json], _TRACE),
    "received_time": _ignored((NATIVE,), float, _TRACE),
    "http_worker_ipc": _ignored((NATIVE,), str, "plait has one HTTP worker"),
    "store": _ignored(OPENAI, bool, _NO_STORAGE),
    "metadata": _ignored(OPENAI, dict[str, Json], _NO_STORAGE),
    "service_tier": _ignored(OPENAI_ALL, str, "plait has one service tier", off=(None, "auto", "default")),
    "safety_identifier": _ignored(OPENAI_ALL, str, "plait does no abuse monitoring"),
    "moderation": _ignored(OPENAI_ALL, dict[str, Json], "plait runs no moderation"),
    "prediction": _ignored(
        OPENAI, dict[str, Json], "a predicted output only speeds decoding up; the output is the same"
    ),
    "verbosity": _ignored(OPENAI, Literal["low", "medium", "high"], "plait passes no verbosity to the model"),
    "max_tool_calls": _ignored((RESPONSES,), int, "a turn makes the calls its tool_choice allows"),
    "context_management": _ignored((RESPONSES,), list[Json], "the input is never compacted"),
    "truncation": _ignored(
        (RESPONSES,),
        Literal["auto", "disabled"],
        "an input too long for the context is a 400, never truncated",
        off=(None, "disabled"),
    ),
    "vllm_xargs": _ignored(OPENAI, dict[str, Json], "plait has no custom extensions"),
    "truncation_side": _ignored(OPENAI, Literal["left", "right"], "prompts are never truncated"),
    "media_io_kwargs": _ignored(OPENAI, dict[str, Json], _NO_MM),
    "mm_processor_kwargs": _ignored(OPENAI, dict[str, Json], _NO_MM),
    "max_dynamic_patch": _ignored(EVERY_API, int, _NO_MM),
    "min_dynamic_patch": _ignored(EVERY_API, int, _NO_MM),
    "image_max_dynamic_patch": _ignored((NATIVE,), int, _NO_MM),
    "video_max_dynamic_patch": _ignored((NATIVE,), int, _NO_MM),
    "images_config": _ignored(EVERY_API, dict[str, Json], _NO_MM),
    "video_config": _ignored((NATIVE,), dict[str, Json], _NO_MM),
    "use_audio_in_video": _ignored(EVERY_API, bool, _NO_MM),
    "need_wait_for_mm_inputs": _ignored((NATIVE,), bool, _NO_MM),
    "num_items_assigned": _ignored((NATIVE,), dict[str, Json], _NO_MM),
    "encoder_urls": _ignored((NATIVE,), list[str], _NO_MM),
    "separate_reasoning": _ignored((CHAT,), bool, _NO_REASONING, off=(None, True, False)),
    "stream_reasoning": _ignored((CHAT,), bool, _NO_REASONING, off=(None, True, False)),
    "include_reasoning": _ignored((CHAT,), bool, _NO_REASONING, off=(None, True, False)),
    "require_reasoning": _ignored((NATIVE,), bool, _NO_REASONING),
    "reasoning": _ignored((CHAT,), dict[str, Json], _NO_REASONING + " (send reasoning_effort for the template)"),
    # ---- extra outputs plait does not produce
    "return_routed_experts": _ignored(EVERY_API, bool, _NO_MOE),
    "routed_experts_start_len": _ignored(EVERY_API, int, _NO_MOE, off=(None, 0)),
    "routed_experts_prompt_start": _ignored(OPENAI, int, _NO_MOE, off=(None, 0)),
    "return_indexer_topk": _ignored((NATIVE,), bool, "plait has no sparse-attention indexer"),
    "return_entropy": _ignored((NATIVE,), bool, _EXTRA_OUTPUT),
    "return_bytes": _ignored((NATIVE,), bool, _EXTRA_OUTPUT),
    "return_prompt_token_ids": _ignored(EVERY_API, bool, _EXTRA_OUTPUT),
    "return_token_ids": _ignored(OPENAI, bool, _EXTRA_OUTPUT),
    "return_meta_info": _ignored((CHAT,), bool, _EXTRA_OUTPUT),
    "return_cached_tokens_details": _ignored(
        OPENAI, bool, _EXTRA_OUTPUT + " (usage.prompt_tokens_details has cached_tokens)"
    ),
    "return_token_offsets": _ignored(OPENAI, bool, _EXTRA_OUTPUT),
    "return_prompt_text": _ignored(OPENAI, bool, _EXTRA_OUTPUT),
    "return_mm_kwargs": _ignored(OPENAI, bool, _EXTRA_OUTPUT, off=(None, True, False)),
    # ---- features that change the answer: accepted only off
    "video_data": _refused((NATIVE,), Json, _NO_MM),
    "audio_data": _refused((NATIVE,), Json, _NO_MM),
    "modalities": _refused(EVERY_API, list[Optional[str]], _NO_MM, off=_OFF + (["text"],)),
    "mm_hashes": _refused((NATIVE,), Json, _NO_MM),
    "mm_content_hashes": _refused((NATIVE,), Json, _NO_MM),
    "audio": _refused((CHAT,), dict[str, Json], "plait generates text only"),
    "input_embeds": _refused((NATIVE,), Json, "prompts are text or token ids"),
    "prompt_embeds": _refused((COMPLETIONS,), Json, "prompts are text or token ids"),
    "positional_embed_overrides": _refused((NATIVE,), Json, "prompts are text or token ids"),
    "input_ids": _refused(
        (CHAT,), list[int], "the prompt is rendered from messages (send token ids to /v1/completions or /generate)"
    ),
    "lora_path": _refused(OPENAI, StrOrList, "the OpenAI routes name a LoRA adapter by `model` (base:adapter)"),
    "lora_id": _refused((NATIVE,), StrOrList, _NO_LORA),
    "custom_logit_processor": _refused(EVERY_API, StrOrList, "plait runs no custom logit processors"),
    "logits_processors": _refused((COMPLETIONS,), list[Json], "plait runs no custom logit processors"),
    "session_params": _refused(EVERY_API, dict[str, Json], "plait has no sessions: send the whole conversation"),
    "return_hidden_states": _refused(EVERY_API, Union[bool, str], "plait does not return hidden states"),
    "token_ids_logprob": _refused(
        (NATIVE,), Union[list[int], list[list[int]]], "logprobs are for the sampled token and the top ones"
    ),
    "logprob_token_ids": _refused(OPENAI, list[int], "logprobs are for the sampled token and the top ones"),
    "return_sampling_mask": _refused((NATIVE,), Union[bool, list[bool]], _EXTRA_OUTPUT),
    "return_flat_raw_top_logprobs": _refused((NATIVE,), bool, "logprobs come as SGLang's nested lists"),
    "return_flat_raw_top_logprobs_b64": _refused((NATIVE,), bool, "logprobs come as SGLang's nested lists"),
    "return_tokens_as_token_ids": _refused(OPENAI, bool, "logprob tokens are their text"),
    "prompt_logprobs": _refused(
        OPENAI, int, "prompt logprobs come with echo and logprobs on /v1/completions", off=_OFF + (0,)
    ),
    "multi_item_delimiter_indices": _refused((NATIVE,), Json, "plait has no multi-item scoring"),
    "bootstrap_host": _refused(EVERY_API, StrOrList, _NO_PD),
    "bootstrap_port": _refused(EVERY_API, IntOrList, _NO_PD),
    "bootstrap_room": _refused(EVERY_API, IntOrList, _NO_PD),
    "bootstrap_pair_key": _refused((NATIVE,), StrOrList, _NO_PD),
    "decode_tp_size": _refused((NATIVE,), IntOrList, _NO_PD),
    "kv_transfer_params": _refused(OPENAI, dict[str, Json], _NO_PD),
    "ec_transfer_params": _refused(OPENAI, dict[str, Json], _NO_PD),
    "max_thinking_tokens": _refused((NATIVE,), int, "plait cannot enforce a thinking budget"),
    "thinking_token_budget": _refused(OPENAI, Json, "plait cannot enforce a thinking budget"),
    "task": _refused((CHAT,), str, "plait has no DeepSeek-V4 quick-instruction encoder"),
    "use_beam_search": _refused(OPENAI, bool, "plait has no beam search"),
    "length_penalty": _refused(OPENAI, float, "plait has no beam search", off=(None, 1.0, 1)),
    "watermarking": _refused(OPENAI, bool, "plait does not watermark"),
    "allowed_token_ids": _refused(OPENAI, list[int], "send logit_bias, or a regex constraint"),
    "bad_words": _refused(OPENAI, list[str], "send logit_bias, or a regex constraint"),
    "repetition_detection": _refused(OPENAI, dict[str, Json], "send repetition_penalty or stop strings"),
    "truncate_prompt_tokens": _refused(OPENAI, int, "prompts are never truncated: a prompt that is too long is a 400"),
    "add_special_tokens": _refused(
        (COMPLETIONS,),
        bool,
        "a text prompt is tokenized with the model's special tokens (send token ids for any other encoding)",
        off=(None, True),
    ),
    "echo": _refused((CHAT,), bool, "chat responses hold the new message only"),
    "chat_template": _refused(
        (CHAT,), str, "a chat template sent with the request is not accepted; the model's own is used"
    ),
    "background": _refused((NATIVE, RESPONSES), bool, "a response is made while its request waits (or streams)"),
    "conversation": _refused(
        (RESPONSES,),
        Union[str, dict[str, Json]],
        "plait has no Conversations API: send previous_response_id, or the whole input",
    ),
    "prompt": _refused((RESPONSES,), dict[str, Json], "plait has no stored prompt templates"),
    "web_search_options": _refused((CHAT,), dict[str, Json], "plait has no web search"),
}

# The OpenAI-route names of sampling parameters a native /generate request must send inside
# sampling_params: at the top level they would be ignored, and the answer would silently differ.
MISPLACED_ON_NATIVE_NOTE = "is a sampling parameter: send it inside sampling_params"


@cache
def compat_model(api: str) -> type[BaseModel]:
    """A model with every FIELDS row of `api` as an optional field (None = not sent): request models of
    that API inherit it, so wrong types are 400s naming the field and the OpenAPI schema lists them."""
    fields = {
        name: (Optional[row.type], Field(default=None, description=f"accepted; {row.use}: {row.why}"))
        for name, row in FIELDS.items()
        if api in row.apis
    }
    return create_model(f"{api.title()}CompatFields", __base__=BaseModel, **fields)


def review(
    body: BaseModel, api: str, request: Optional[Request], once: set[str], misplaced: frozenset[str] = frozenset()
) -> None:
    """After validation: a 400 for a refused field that is on, a log line (once per server, `once` holds
    what was logged) for an ignored one that is set, and for top-level fields no API defines a warning
    and the `x-plait-ignored-fields` header. `misplaced` names extra fields that are a 400 instead."""
    for name, row in FIELDS.items():
        if api not in row.apis:
            continue
        value = getattr(body, name)
        if row.is_off(value):
            continue
        if row.use == REFUSED_UNLESS_OFF:
            raise APIError(400, f"'{name}' is not supported by plait: {row.why}", param=name)
        _log_once(once, f"{api}:{name}", "request field '%s' accepted and ignored: %s", name, row.why)
    unknown = sorted(body.model_extra or {})
    wrong_place = next((name for name in unknown if name in misplaced), None)
    if wrong_place is not None:
        raise APIError(400, f"'{wrong_place}' {MISPLACED_ON_NATIVE_NOTE}", param=wrong_place)
    if unknown:
        for name in unknown:
            _log_once(
                once,
                f"{api}:unknown:{name}",
                "request field '%s' is unknown to plait (and to the SGLang, OpenAI and vLLM APIs); ignored",
                name,
                level=logging.WARNING,
            )
        if request is not None:
            request.state.ignored_fields = unknown


def _log_once(once: set[str], key: str, message: str, *args: Any, level: int = logging.INFO) -> None:
    if key not in once:
        once.add(key)
        logger.log(level, message, *args)
