"""Request bodies: the OpenAI routes' (`openai.py`, their tools in `tools.py`), the Responses API's
(`responses.py`), SGLang's native routes' (`native.py`), and the fields other servers' APIs define that plait
accepts, ignores or refuses (`compat.py`). Strict pydantic models, so a wrong field is a 400 that names it."""
