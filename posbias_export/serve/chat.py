"""POST /v1/chat/completions: the messages rendered by the folder's own chat template (the one
transformers' apply_chat_template renders: tokenizer_config.json's "chat_template", or
chat_template.jinja beside it), then decoded as a completion of those token ids. A folder without
a template (a base model) is refused in one line: its prompt format is the caller's to choose, on
/v1/completions.

The template runs in jinja2's sandbox, as transformers runs it: a folder's template is data, not
code this server trusts.
"""
from __future__ import annotations

import json
from datetime import datetime
from pathlib import Path

from .folder import json_object
from .openai_api import ApiError

ROLES = ("system", "developer", "user", "assistant", "tool")
# chat-only parameters: taken at these values (what clients send when they mean "none"), else refused
CHAT_NEUTRAL = {"tools": ([],), "tool_choice": ("none", "auto"), "parallel_tool_calls": (True, False),
                "response_format": ({"type": "text"},), "logprobs": (False,), "top_logprobs": (0,)}


def chat_template(folder: Path) -> str | None:
    """The folder's default chat template, or None."""
    loose = folder / "chat_template.jinja"
    if loose.is_file():
        return loose.read_text()
    config = json_object(folder / "tokenizer_config.json")
    template = config.get("chat_template")
    if isinstance(template, list):  # named templates: the "default" one
        template = next((t.get("template") for t in template if isinstance(t, dict) and t.get("name") == "default"), None)
    return template if isinstance(template, str) and template else None


def special_tokens(folder: Path) -> dict:
    """bos_token, eos_token, ... as text (the template refers to them by name)."""
    config = json_object(folder / "tokenizer_config.json")
    found = {}
    for name in ("bos_token", "eos_token", "unk_token", "pad_token"):
        value = config.get(name)
        value = value.get("content") if isinstance(value, dict) else value
        if isinstance(value, str):
            found[name] = value
    return found


class ChatTemplate:
    def __init__(self, source: str, tokens: dict):
        from jinja2.exceptions import TemplateError
        from jinja2.sandbox import ImmutableSandboxedEnvironment

        def raise_exception(message):
            raise TemplateError(message)

        env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True, extensions=["jinja2.ext.loopcontrols"])
        env.filters["tojson"] = lambda x, indent=None, **_: json.dumps(x, ensure_ascii=False, indent=indent)
        env.globals.update(raise_exception=raise_exception, strftime_now=lambda f: datetime.now().strftime(f))
        self.tokens, self.template, self.broken = tokens, None, None
        try:
            self.template = env.from_string(source)
        except TemplateError as err:  # the folder's template does not parse: chat refused, completions served
            self.broken = f"the model's chat template does not parse: {err}"

    def render(self, messages: list[dict]) -> str:
        if self.broken:
            raise ApiError(400, self.broken, code="no_chat_template")
        try:
            return self.template.render(messages=messages, add_generation_prompt=True, **self.tokens)
        except Exception as err:  # noqa: BLE001 - its own refusal (roles out of order), a sandbox stop, a type
            raise ApiError(400, f"the model's chat template failed on these messages: {err}", param="messages") from None


def completion_body(body: dict) -> tuple[list[dict], dict]:
    """A chat request -> (its messages, checked; the body /v1/completions' parser takes, less the prompt)."""
    messages = body.get("messages")
    if not isinstance(messages, list) or not messages:
        raise ApiError(400, "'messages' must be a non-empty list", param="messages")
    checked = [_message(m, k) for k, m in enumerate(messages)]
    rest = {k: v for k, v in body.items() if k not in ("messages", "max_completion_tokens", *CHAT_NEUTRAL)}
    for name, neutral in CHAT_NEUTRAL.items():
        if body.get(name) is not None and body[name] not in neutral:
            raise ApiError(400, f"{name!r} = {body[name]!r} is not supported here", param=name)
    limit = body.get("max_completion_tokens")
    return checked, {**rest, **({"max_tokens": limit} if limit is not None else {})}


def _message(message, k: int) -> dict:
    """{"role", "content"}: content a string, or a list of text parts (joined)."""
    if not isinstance(message, dict) or message.get("role") not in ROLES:
        raise ApiError(400, f"messages[{k}] must be an object with a role in {', '.join(ROLES)}", param="messages")
    content = message.get("content")
    if isinstance(content, list):
        if not all(isinstance(p, dict) and p.get("type") == "text" and isinstance(p.get("text"), str) for p in content):
            raise ApiError(400, f"messages[{k}].content: only text parts are taken here", param="messages")
        content = "".join(p["text"] for p in content)
    if not isinstance(content, str):
        raise ApiError(400, f"messages[{k}].content must be a string or a list of text parts", param="messages")
    return {"role": message["role"], "content": content}

