"""`sglang.lang.chat_template`: plait's chat templates under SGLang's module path."""

from plait.chat_template import ChatTemplate, get_chat_template, get_chat_template_by_model_path

__all__ = ["ChatTemplate", "get_chat_template", "get_chat_template_by_model_path"]
