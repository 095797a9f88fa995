"""Role markup derived from a tokenizer's own chat template (SmolLM2's, and other template styles)."""

import copy
import logging

import pytest
from plait.chat_template import chat_template_from_tokenizer, get_chat_template
from test_lang_interpreter import smollm2_tokenizer

LLAMA3_STYLE = (
    "{{ bos_token }}{% for m in messages %}<|start_header_id|>{{ m['role'] }}<|end_header_id|>\n\n"
    "{{ m['content'] | trim }}<|eot_id|>{% endfor %}"
    "{% if add_generation_prompt %}<|start_header_id|>assistant<|end_header_id|>\n\n{% endif %}"
)

# Llama-2 style: the system prompt is folded into the first user turn, so turns are not separable.
LLAMA2_STYLE = (
    "{% for m in messages %}{% if m['role'] == 'system' %}{% set sys = m['content'] %}"
    "{% elif m['role'] == 'user' %}[INST] {% if loop.index0 == 1 %}<<SYS>>{{ messages[0]['content'] }}<</SYS>> "
    "{% endif %}{{ m['content'] }} [/INST]{% else %} {{ m['content'] }}</s>{% endif %}{% endfor %}"
)

NO_SYSTEM = (
    "{% for m in messages %}{% if m['role'] == 'system' %}{{ raise_exception('System role not supported') }}"
    "{% endif %}<turn>{{ m['role'] }}\n{{ m['content'] }}<end>\n{% endfor %}"
)


@pytest.fixture(scope="module")
def tok():
    return smollm2_tokenizer()


def with_template(tok, template):
    t = copy.deepcopy(tok)
    t.chat_template = template
    return t


def test_smollm2_roles_default_system_and_stop(tok):
    ct = chat_template_from_tokenizer(tok)
    assert ct.role_prefix_and_suffix == {
        "system": ("<|im_start|>system\n", "<|im_end|>\n"),
        "user": ("<|im_start|>user\n", "<|im_end|>\n"),
        "assistant": ("<|im_start|>assistant\n", "<|im_end|>\n"),
    }
    assert ct.default_system_prompt == "You are a helpful AI assistant named SmolLM, trained by Hugging Face"
    assert ct.stop_str == ("<|im_end|>",)
    assert ct.source == "tokenizer"


def test_llama3_style_template_keeps_bos_the_tokenizer_does_not_add(tok):
    ct = chat_template_from_tokenizer(with_template(tok, LLAMA3_STYLE))
    # SmolLM2's tokenizer adds no BOS itself, so the template's BOS stays at the conversation start
    assert ct.role_prefix_and_suffix["system"] == (
        tok.bos_token + "<|start_header_id|>system<|end_header_id|>\n\n",
        "<|eot_id|>",
    )
    assert ct.role_prefix_and_suffix["assistant"] == ("<|start_header_id|>assistant<|end_header_id|>\n\n", "<|eot_id|>")
    assert ct.stop_str == ("<|eot_id|>",)
    assert ct.default_system_prompt is None


def test_bos_is_dropped_when_the_tokenizer_adds_it(tok):
    t = with_template(tok, LLAMA3_STYLE)

    class AddsBos:  # the same tokenizer, but encoding starts with BOS (as Llama 3's does)
        def __getattr__(self, name):
            return getattr(t, name)

        def __call__(self, text):
            out = t(text)
            out["input_ids"] = [t.bos_token_id] + out["input_ids"]
            return out

    ct = chat_template_from_tokenizer(AddsBos())
    assert ct.role_prefix_and_suffix["system"][0] == "<|start_header_id|>system<|end_header_id|>\n\n"


def test_untranslatable_templates_fall_back_to_default_with_a_warning(tok, caplog):
    with caplog.at_level(logging.WARNING):
        assert chat_template_from_tokenizer(with_template(tok, LLAMA2_STYLE)) == get_chat_template("default")
        assert chat_template_from_tokenizer(with_template(tok, NO_SYSTEM)) == get_chat_template("default")
        assert chat_template_from_tokenizer(with_template(tok, None)) == get_chat_template("default")
    assert "role markup" in caplog.text


def test_named_templates_and_unknown_names():
    assert get_chat_template("chatml").stop_str == ("<|im_end|>",)
    with pytest.raises(ValueError, match="unknown chat template"):
        get_chat_template("nope")
    with pytest.raises(ValueError, match="role 'tool'"):
        get_chat_template("default").get_prefix_and_suffix("tool")
