"""Backends the interpreter runs programs on: colocated Engine, HTTP endpoint, OpenAI."""
