"""`sglang.test.test_utils`: the two helpers SGLang's benchmark scripts open with."""

from plait.script_args import add_common_sglang_args_and_parse, select_sglang_backend

__all__ = ["add_common_sglang_args_and_parse", "select_sglang_backend"]
