"""VertexAI: programs on Gemini models through Google's Vertex AI SDK (`vertexai`, in the
`google-cloud-aiplatform` package). The project comes from GCP_PROJECT_ID (GCP_LOCATION optional), as in
SGLang; Vertex has no system role, so a system turn is sent as a user turn the model acknowledges."""

from __future__ import annotations

import os
from typing import Any, Iterator, Optional

from ..chat_template import get_chat_template
from ..gen_params import ResolvedGen
from .base import BaseBackend
from .chat_api import conversation, import_sdk, refuse_unsupported, stop_list, top_k


class VertexAI(BaseBackend):
    is_chat_model = True

    def __init__(self, model_name: str, safety_settings: Optional[Any] = None, **init_kwargs: Any) -> None:
        vertexai = import_sdk("vertexai", "VertexAI", "google-cloud-aiplatform")
        self.models = import_sdk("vertexai.generative_models", "VertexAI", "google-cloud-aiplatform")
        project = init_kwargs.pop("project", None) or os.environ.get("GCP_PROJECT_ID")
        if not project:
            raise ValueError("plait.VertexAI needs a Google Cloud project: set GCP_PROJECT_ID (or pass project=)")
        location = init_kwargs.pop("location", None) or os.environ.get("GCP_LOCATION")
        vertexai.init(project=project, location=location, **init_kwargs)
        super().__init__(get_chat_template("default"))
        self.model_name = model_name
        self.safety_settings = safety_settings

    def get_model_name(self) -> str:
        return self.model_name

    def _contents(self, s: Any) -> list[dict]:
        system, messages = conversation(s)
        contents = []
        if system:
            contents.append({"role": "user", "parts": [{"text": f"System prompt: {system}"}]})
            contents.append({"role": "model", "parts": [{"text": "Understood."}]})
        for m in messages:
            contents.append(
                {"role": "model" if m["role"] == "assistant" else "user", "parts": [{"text": m["content"]}]}
            )
        return contents

    def _config(self, params: ResolvedGen) -> Any:
        refuse_unsupported("VertexAI", params)
        sp = params.sampling
        config: dict[str, Any] = {
            "candidate_count": 1,
            "max_output_tokens": sp.max_new_tokens,
            "temperature": sp.temperature,
            "top_p": sp.top_p,
        }
        if top_k(params) is not None:
            config["top_k"] = top_k(params)
        if stop_list(params):
            config["stop_sequences"] = stop_list(params)
        return self.models.GenerationConfig(**config)

    def _call(self, s: Any, params: ResolvedGen, stream: bool) -> Any:
        model = self.models.GenerativeModel(self.model_name)
        return model.generate_content(
            self._contents(s),
            generation_config=self._config(params),
            safety_settings=self.safety_settings,
            stream=stream,
        )

    def generate(self, s: Any, params: ResolvedGen) -> tuple[str, dict]:
        return self._call(s, params, stream=False).text, {}

    def generate_stream(self, s: Any, params: ResolvedGen) -> Iterator[tuple[str, dict]]:
        for chunk in self._call(s, params, stream=True):
            yield chunk.text, {}
