"""OpenAI's Responses API: the routes (`api.py`), the streamed events (`stream.py`), a Response's items
(`items.py`), and the responses kept for `previous_response_id`, backed by pinned prefixes (`store.py`)."""
