"""The OpenAI API's requests as `serve` takes them, checked before any work: each bad input is an
ApiError (an HTTP status and OpenAI's error object), never a 500.

    POST /v1/embeddings    input: a string, a list of strings, a list of token ids or of lists of
                           them; encoding_format "float" | "base64"; model: the served folder's name
    POST /v1/completions   prompt: a string, token ids, or a list of up to 64 of either (a choice
                           each); max_tokens >= 1; temperature in [0, 2] (0: greedy); top_p in
                           (0, 1]; stop: a string or up to 4; stream; seed; n, best_of, the
                           penalties, logprobs, logit_bias, echo, suffix at their neutral values only
    A null is the parameter's default (OpenAI's reading; clients send them).
"""
from __future__ import annotations

import base64
import json
from dataclasses import dataclass, field

import numpy as np

MAX_BODY_BYTES = 16 << 20  # a request body past this is refused before it is parsed (413)
MAX_INPUTS = 2048  # inputs of one embeddings request (OpenAI's own limit)
MAX_STOPS = 4


class ApiError(Exception):
    """An OpenAI-style error: status, message, type, param, code."""

    def __init__(self, status: int, message: str, param: str | None = None, code: str | None = None,
                 kind: str = "invalid_request_error"):
        super().__init__(message)
        self.status, self.message, self.param, self.code, self.kind = status, message, param, code, kind

    def body(self) -> dict:
        return {"error": {"message": self.message, "type": self.kind, "param": self.param, "code": self.code}}


def parse_body(raw: bytes) -> dict:
    if len(raw) > MAX_BODY_BYTES:
        raise ApiError(413, f"the request body is {len(raw)} bytes; the limit is {MAX_BODY_BYTES}", code="body_too_large")
    try:
        body = json.loads(raw)
    except (ValueError, UnicodeDecodeError) as err:
        raise ApiError(400, f"the request body is not JSON: {err}") from None
    except RecursionError:  # [[[[...]]]] deeper than the parser's stack: a bad request, not a 500
        raise ApiError(400, "the request body is not JSON we read: nested too deeply") from None
    if not isinstance(body, dict):
        raise ApiError(400, "the request body must be a JSON object")
    return body


def check_model(body: dict, served: str) -> None:
    model = body.get("model")
    if model is None:
        raise ApiError(400, "you must give a model (GET /v1/models lists it)", param="model")
    if model != served:
        raise ApiError(404, f"the model {model!r} does not exist; this server serves {served!r}", param="model",
                       code="model_not_found")


def _is_int(x) -> bool:
    return isinstance(x, int) and not isinstance(x, bool)


def _token_list(value, vocab: int, param: str) -> list[int]:
    if not value:
        raise ApiError(400, f"'{param}' holds an empty list of token ids", param=param)
    for token in value:
        if not _is_int(token) or not 0 <= token < vocab:
            raise ApiError(400, f"'{param}' holds {token!r}, not a token id in [0, {vocab})", param=param)
    return list(value)


@dataclass
class EmbeddingsRequest:
    texts: list[str] | None  # the inputs as text, or None where they came as token ids
    ids: list[list[int]] | None
    encoding: str = "float"

    @classmethod
    def parse(cls, body: dict, served: str, vocab: int) -> "EmbeddingsRequest":
        check_model(body, served)
        unknown = set(body) - {"input", "model", "encoding_format", "user", "dimensions"}
        if unknown:
            raise ApiError(400, f"unknown parameter {sorted(unknown)[0]!r}", param=sorted(unknown)[0])
        if body.get("dimensions") is not None:
            raise ApiError(400, "'dimensions' is not supported: this model's embeddings have one size",
                           param="dimensions")
        encoding = body.get("encoding_format") or "float"
        if encoding not in ("float", "base64"):
            raise ApiError(400, f"'encoding_format' must be 'float' or 'base64', got {encoding!r}",
                           param="encoding_format")
        value = body.get("input")
        if value is None:
            raise ApiError(400, "you must give an 'input'", param="input")
        if isinstance(value, str):
            value = [value]
        if not isinstance(value, list) or not value:
            raise ApiError(400, "'input' must be a string, a non-empty list of strings, or token ids", param="input")
        if len(value) > MAX_INPUTS:
            raise ApiError(400, f"'input' holds {len(value)} inputs; at most {MAX_INPUTS}", param="input")
        if all(isinstance(v, str) for v in value):
            if any(not v for v in value):
                raise ApiError(400, "'input' holds an empty string", param="input")
            return cls(value, None, encoding)
        if all(_is_int(v) for v in value):
            return cls(None, [_token_list(value, vocab, "input")], encoding)
        if all(isinstance(v, list) for v in value):
            return cls(None, [_token_list(v, vocab, "input") for v in value], encoding)
        raise ApiError(400, "'input' must be a string, a list of strings, a list of token ids, or a list of such lists",
                       param="input")


def _prompts(prompt, vocab: int) -> list:
    """OpenAI's four forms: a string, token ids, a list of strings, a list of token-id lists."""
    if isinstance(prompt, str) or (isinstance(prompt, list) and prompt and all(_is_int(t) for t in prompt)):
        prompt = [prompt]
    if not isinstance(prompt, list) or not prompt or not all(isinstance(p, (str, list)) for p in prompt):
        raise ApiError(400, "'prompt' must be a non-empty string, token ids, or a list of either", param="prompt")
    if len(prompt) > MAX_PROMPTS:
        raise ApiError(400, f"'prompt' holds {len(prompt)} prompts; at most {MAX_PROMPTS}", param="prompt")
    if any(p == "" for p in prompt):
        raise ApiError(400, "'prompt' is empty", param="prompt")
    return [p if isinstance(p, str) else _token_list(p, vocab, "prompt") for p in prompt]


def encode_embedding(vector: np.ndarray, encoding: str):
    """OpenAI's two encodings: a list of floats, or base64 of the little-endian float32 bytes."""
    if encoding == "base64":
        return base64.b64encode(np.asarray(vector, "<f4").tobytes()).decode("ascii")
    return [float(x) for x in vector]


# parameters clients send at their neutral value (LangChain's OpenAI sends every one of these on
# each request): accepted there, refused in one line at any other value (nothing here does them)
NEUTRAL = {"frequency_penalty": (0,), "presence_penalty": (0,), "logprobs": (), "logit_bias": ({},), "echo": (False,),
           "best_of": (1,), "suffix": ("",), "n": (1,)}
MAX_PROMPTS = 64  # prompts of one completions request (each its own row of the batch)


@dataclass
class CompletionRequest:
    prompts: list  # each a string or a list of token ids
    max_tokens: int = 16
    temperature: float = 1.0
    stop: list[str] = field(default_factory=list)
    stream: bool = False
    seed: int | None = None
    top_p: float = 1.0

    @classmethod
    def parse(cls, body: dict, served: str, vocab: int) -> "CompletionRequest":
        check_model(body, served)
        body = {k: v for k, v in body.items() if v is not None}  # null: the parameter's default, as OpenAI's
        unknown = set(body) - {"prompt", "model", "max_tokens", "temperature", "top_p", "stop", "stream", "seed",
                               "user", "stream_options", *NEUTRAL}
        if unknown:
            raise ApiError(400, f"unknown or unsupported parameter {sorted(unknown)[0]!r}", param=sorted(unknown)[0])
        for name, neutral in NEUTRAL.items():
            value = body.get(name, neutral[0] if neutral else None)
            if name in body and not any(value == v and isinstance(value, bool) == isinstance(v, bool) for v in neutral):
                taken = f"only {neutral[0]!r} is taken" if neutral else "only null is taken"
                raise ApiError(400, f"{name!r} = {value!r} is not supported here ({taken})", param=name)
        max_tokens = body.get("max_tokens", 16)
        if not _is_int(max_tokens) or max_tokens < 1:
            raise ApiError(400, f"'max_tokens' must be an integer >= 1, got {max_tokens!r}", param="max_tokens")
        temperature = body.get("temperature", 1.0)
        if isinstance(temperature, bool) or not isinstance(temperature, (int, float)) or not 0 <= temperature <= 2:
            raise ApiError(400, f"'temperature' must be a number in [0, 2], got {temperature!r}", param="temperature")
        top_p = body.get("top_p", 1.0)
        if isinstance(top_p, bool) or not isinstance(top_p, (int, float)) or not 0 < top_p <= 1:
            raise ApiError(400, f"'top_p' must be a number in (0, 1], got {top_p!r}", param="top_p")
        stop = body.get("stop") or []
        stop = [stop] if isinstance(stop, str) else stop
        if not isinstance(stop, list) or len(stop) > MAX_STOPS or not all(isinstance(s, str) and s for s in stop):
            raise ApiError(400, f"'stop' must be a string or a list of at most {MAX_STOPS} non-empty strings", param="stop")
        stream = body.get("stream", False)
        if not isinstance(stream, bool):
            raise ApiError(400, "'stream' must be true or false", param="stream")
        if not isinstance(body.get("stream_options", {}), dict):
            raise ApiError(400, "'stream_options' must be an object", param="stream_options")
        seed = body.get("seed")
        if seed is not None and (not _is_int(seed) or seed < 0):
            raise ApiError(400, "'seed' must be a non-negative integer", param="seed")
        return cls(_prompts(body.get("prompt"), vocab), max_tokens, float(temperature), stop, stream, seed,
                   float(top_p))

    def check_length(self, prompt_tokens: int, context: int) -> None:
        if prompt_tokens + self.max_tokens > context:
            raise ApiError(400, f"this model's context is {context} tokens; the prompt has {prompt_tokens} and "
                           f"max_tokens asks for {self.max_tokens} more", param="max_tokens",
                           code="context_length_exceeded")
