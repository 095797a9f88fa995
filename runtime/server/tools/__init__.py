"""OpenAI tool calling: tools into the prompt and a forcing tool_choice into a constraint (`calls.py`), the
output read back into tool_calls, whole or streamed (`parser.py`) with the scanner of growing JSON
(`json_scan.py`)."""
