"""serve/chat.py without a server: where a folder's chat template is found, its special tokens, the
sandbox (a template is the folder's data: one reaching for Python's internals is a 400, as is one
that does not parse or refuses the messages), and the chat request's checks."""
from __future__ import annotations

import json

import pytest

pytest.importorskip("jinja2")

from posbias_export.serve.chat import ChatTemplate, chat_template, completion_body, special_tokens  # noqa: E402
from posbias_export.serve.openai_api import ApiError  # noqa: E402

SIMPLE = "{% for m in messages %}[{{ m['role'] }}] {{ m['content'] }}\n{% endfor %}{% if add_generation_prompt %}>{% endif %}"


def test_the_template_is_found_where_transformers_saves_it(tmp_path):
    assert chat_template(tmp_path) is None
    (tmp_path / "tokenizer_config.json").write_text(json.dumps({
        "chat_template": [{"name": "tool_use", "template": "T"}, {"name": "default", "template": "D"}],
        "bos_token": {"content": "<s>", "lstrip": False}, "eos_token": "</s>"}))
    assert chat_template(tmp_path) == "D"
    assert special_tokens(tmp_path) == {"bos_token": "<s>", "eos_token": "</s>"}
    (tmp_path / "chat_template.jinja").write_text(SIMPLE)  # the loose file wins, as in transformers
    assert chat_template(tmp_path) == SIMPLE


def test_rendering_matches_transformers():
    transformers = pytest.importorskip("transformers")
    from tokenizers import Tokenizer, models

    messages = [{"role": "system", "content": "a"}, {"role": "user", "content": "b"}]
    theirs = transformers.PreTrainedTokenizerFast(tokenizer_object=Tokenizer(models.WordLevel({"x": 0}, unk_token="x")),
                                                  chat_template=SIMPLE)
    assert ChatTemplate(SIMPLE, {}).render(messages) == theirs.apply_chat_template(
        messages, add_generation_prompt=True, tokenize=False)


@pytest.mark.parametrize("source, said", [
    ("{{ ''.__class__.__mro__[1].__subclasses__() }}", "failed on these messages"),  # the sandbox
    ("{{ raise_exception('roles must alternate') }}", "roles must alternate"),
    ("{% for m in messages %}", "does not parse"),
    ("{{ messages[0]['content'] + 5 }}", "failed on these messages"),
])
def test_a_template_that_fails_is_a_400(source, said):
    with pytest.raises(ApiError, match=said) as err:
        ChatTemplate(source, {}).render([{"role": "user", "content": "x"}])
    assert err.value.status == 400


@pytest.mark.parametrize("body, said", [
    ({}, "'messages' must be a non-empty list"),
    ({"messages": [{"role": "robot", "content": "x"}]}, "a role in"),
    ({"messages": [{"role": "user", "content": [{"type": "image_url", "image_url": {}}]}]}, "only text parts"),
    ({"messages": [{"role": "user", "content": None}]}, "must be a string"),
    ({"messages": [{"role": "user", "content": "x"}], "tools": [{"type": "function"}]}, "'tools'"),
    ({"messages": [{"role": "user", "content": "x"}], "response_format": {"type": "json_object"}}, "'response_format'"),
])
def test_chat_requests_are_checked(body, said):
    with pytest.raises(ApiError, match=said):
        completion_body(body)


def test_text_parts_join_and_neutral_chat_parameters_pass():
    messages, rest = completion_body({"model": "m", "messages": [{"role": "user", "content": [
        {"type": "text", "text": "a"}, {"type": "text", "text": "b"}]}], "tools": [], "logprobs": False,
        "max_completion_tokens": 5, "temperature": 0})
    assert messages == [{"role": "user", "content": "ab"}]
    assert rest == {"model": "m", "max_tokens": 5, "temperature": 0}
