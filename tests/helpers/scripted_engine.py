"""A scripted stand-in for the Engine, for interpreter tests: it honours the Engine API contract
(docs/structure.md) with one character per token, so tests pin exact requests and exact text in
milliseconds (test_lang_interpreter.py, test_lang_control_flow.py)."""

import threading
import time

from plait.backend.engine_backend import EngineBackend
from plait.runtime.request_options import RequestOptions
from plait.runtime.sampling_params import SamplingParams


class ScriptedEngine:
    """Engine API over a fixed reply function; a character is a token (id = ord)."""

    def __init__(self, reply=lambda prompt: "ok", tokenizer=None, favored="", delay=None):
        self.reply = reply
        self.tokenizer = tokenizer
        self.favored = favored  # characters the "model" likes: logprob -0.1 instead of -2.0
        self.delay = delay
        self.requests = []
        self.pinned, self.unpinned = [], []
        self.lock = threading.Lock()
        self.model_path = "/models/scripted"

    def _logprob(self, ch):
        return -0.1 if ch in self.favored else -2.0

    def _one(self, text, ids, sp, options):
        tokens = [chr(i) for i in ids] if ids is not None else list(text)
        prompt = "".join(tokens)
        if self.delay:
            time.sleep(self.delay(prompt))
        out = "" if sp.max_new_tokens == 0 else self.reply(prompt)
        out = out[: sp.max_new_tokens]
        for stop in sp.stop_strs:
            if stop in out:
                out = out[: out.index(stop)]
        meta = {
            "prompt_tokens": len(tokens),
            "completion_tokens": len(out),
            "cached_tokens": 0,
            "finish_reason": {"type": "stop", "matched": None},
            "e2e_latency": 0.0,
        }
        if options.return_logprob:
            start = max(options.logprob_start_len, 0)
            with_text = options.return_text_in_logprobs
            entries = [
                (None if i == 0 else self._logprob(c), ord(c), c if with_text else None) for i, c in enumerate(tokens)
            ][start:]
            meta["input_token_logprobs"] = entries
            meta["output_token_logprobs"] = [(self._logprob(c), ord(c), None) for c in out]
        return {"text": out, "output_ids": [ord(c) for c in out], "meta_info": meta}

    def _record(self, prompt, sampling_params, input_ids, options, stream):
        with self.lock:
            self.requests.append(
                dict(
                    prompt=prompt,
                    sampling_params=sampling_params,
                    input_ids=input_ids,
                    options=options,
                    stream=stream,
                )
            )

    def generate(self, prompt=None, sampling_params=None, input_ids=None, options=None, image_data=None):
        """Engine.generate as the DSL calls it: one SamplingParams and one RequestOptions; n > 1 gives a list."""
        assert isinstance(sampling_params, SamplingParams) and isinstance(options, RequestOptions)
        self._record(prompt, sampling_params, input_ids, options, False)
        if isinstance(prompt, list):
            return [self._one(p, None, sampling_params, options) for p in prompt]
        if input_ids is not None and input_ids and isinstance(input_ids[0], list):
            return [self._one(None, ids, sampling_params, options) for ids in input_ids]
        if sampling_params.n > 1:
            return [self._one(prompt, input_ids, sampling_params, options) for _ in range(sampling_params.n)]
        return self._one(prompt, input_ids, sampling_params, options)

    def stream_deltas(self, prompt=None, sampling_params=None, input_ids=None, options=None, image_data=None):
        """Engine.stream_deltas: a token (a character) per chunk, each chunk only the new text."""
        self._record(prompt, sampling_params, input_ids, options, True)
        result = self._one(prompt, input_ids, sampling_params, options)
        text = result["text"]
        for i in range(len(text)):
            time.sleep(0.01)  # a token at a time, so readers see pieces
            yield {"text": text[i], "text_offset": i, "meta_info": {**result["meta_info"], "completion_tokens": i + 1}}

    def flush_cache(self):
        return True

    def pin_prefix(self, prefix):
        with self.lock:
            self.pinned.append(prefix)
            return {"pin_id": len(self.pinned), "pinned_tokens": len(prefix)}

    def unpin_prefix(self, pin_id):
        with self.lock:
            self.unpinned.append(pin_id)
        return True

    def get_server_info(self):
        return {"model_path": self.model_path}


def backend_for(**kw):
    return EngineBackend(ScriptedEngine(**kw))
