"""A scripted stand-in for the Engine, for interpreter tests: it honours the Engine API contract
(docs/structure.md) with one character per token, so tests pin exact requests and exact text in
milliseconds (test_lang_interpreter.py, test_lang_control_flow.py)."""

import threading
import time

from plait.backend.engine_backend import EngineBackend


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

    def _one(self, text, ids, sp, return_logprob, start, with_text):
        sp = dict(sp or {})
        tokens = [chr(i) for i in ids] if ids is not None else list(text)
        prompt = "".join(tokens)
        if self.delay:
            time.sleep(self.delay(prompt))
        out = "" if sp.get("max_new_tokens", 128) == 0 else self.reply(prompt)
        out = out[: sp.get("max_new_tokens", 128)]
        for stop in sp.get("stop") or []:
            if stop in out:
                out = out[: out.index(stop)]
        meta = {
            "prompt_tokens": len(tokens),
            "completion_tokens": len(out),
            "cached_tokens": 0,
            "finish_reason": {"type": "stop", "matched": None},
            "e2e_latency": 0.0,
        }
        if return_logprob:
            start = start or 0
            entries = [
                (None if i == 0 else self._logprob(c), ord(c), c if with_text else None) for i, c in enumerate(tokens)
            ][start:]
            meta["input_token_logprobs"] = entries
            meta["output_token_logprobs"] = [(self._logprob(c), ord(c), None) for c in out]
        return {"text": out, "output_ids": [ord(c) for c in out], "meta_info": meta}

    def generate(
        self,
        prompt=None,
        sampling_params=None,
        input_ids=None,
        return_logprob=False,
        logprob_start_len=None,
        top_logprobs_num=None,
        return_text_in_logprobs=False,
        stream=False,
        rid=None,
        group=None,
    ):
        with self.lock:
            self.requests.append(
                dict(
                    prompt=prompt,
                    sampling_params=sampling_params,
                    input_ids=input_ids,
                    return_logprob=return_logprob,
                    logprob_start_len=logprob_start_len,
                    stream=stream,
                    group=group,
                )
            )
        args = (sampling_params, return_logprob, logprob_start_len, return_text_in_logprobs)
        if isinstance(prompt, list):
            return [self._one(p, None, *args) for p in prompt]
        if input_ids is not None and input_ids and isinstance(input_ids[0], list):
            return [self._one(None, ids, *args) for ids in input_ids]
        result = self._one(prompt, input_ids, *args)
        if not stream:
            return result

        def chunks():
            text = result["text"]
            for i in range(1, len(text) + 1):
                time.sleep(0.01)  # a token at a time, so readers see pieces
                yield {"text": text[:i], "meta_info": {**result["meta_info"], "completion_tokens": i}}

        return chunks()

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
