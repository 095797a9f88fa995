"""The OpenAI routes: /v1/models and /v1/completions with what every OpenAI route shares (`api.py`),
/v1/chat/completions (`chat.py`), Engine outputs shaped as OpenAI bodies (`outputs.py`), structured-output
fields into constraints (`response_format.py`, vLLM's `structured_outputs.py`), a token's raw bytes
(`token_bytes.py`)."""
