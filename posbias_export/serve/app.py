"""`serve DIR` on Ray Serve: an OpenAI-compatible HTTP ingress (FastAPI) in front of N model
replicas (replica.py), on a local Ray or an existing cluster.

    ingress   parses and checks each request (openai_api.py: every bad input a 4xx with OpenAI's
              error object), tokenizes, sends token ids to a replica through Ray Serve's handle,
              detokenizes, streams server-sent events, counts what /metrics reports; a replica that
              dies under a request is a 503 with the same error object, never a hang
    replicas  the folder's engine: embeddings batched by token budget, completions continuously
              batched over the in-place cache; Ray restarts one that dies
"""
# no `from __future__ import annotations` here: FastAPI reads the handlers' annotations (Request)
# at run time, and a string it cannot resolve turns the request into a query parameter (422)
import asyncio
import json
import time
import uuid

from ..errors import first_line
from .chat import ChatTemplate, chat_template, completion_body, special_tokens
from .folder import ServedFolder
from .openai_api import (MAX_BODY_BYTES, ApiError, CompletionRequest, EmbeddingsRequest, check_model,
                         encode_embedding, parse_body)
from .replica import Replica

DRAIN_S = 30  # after a stop signal, requests in flight get this long to finish
REPLICA_TIMEOUT_S = 600  # a replica's answer to one call: past this the request is a 504, not a hang
CLIENT_LEFT = 499  # /metrics' status of a request whose client left before its answer's end (nginx's code)
# /metrics' route of a failed request: one per answer kind (a label per unknown path would grow without bound)
METRIC_ROUTES = {"/v1/embeddings": "embeddings", "/v1/completions": "completions", "/v1/chat/completions": "completions"}


def build_app(folder: str, replicas: int = 1, threads: int = 0, max_batch_tokens: int | None = None,
              slots: int | None = None, max_replicas: int | None = None, allow_origins=(), cpus: int | None = None):
    """The Ray Serve application for `folder` (deployments bound, not yet run); `allow_origins`:
    the web origins whose pages may call it from a browser (CORS), none by default. Each model
    replica reserves `cpus` in Ray (default: its `threads`) and runs ONNX Runtime on `threads`; with
    neither, one of each (Ray's own default for a replica: a cluster's node sizes are not known here).
    A local `serve` passes threads 0 and this machine's cores for a lone replica (launch.py)."""
    served = ServedFolder.read(folder)
    api = _api(served.name, allow_origins)
    # absolute: a cluster's replicas run in the cwd their node's raylet gave them, not the caller's
    path = str(served.path.absolute())
    reserve, threads = cpus or threads or 1, threads or (0 if cpus else 1)  # 0: ONNX Runtime's own choice
    model = _model_deployment().options(**replica_options(served.role, replicas, max_replicas, slots, reserve))
    return _ingress_deployment(api).bind(model.bind(path, threads, max_batch_tokens, slots), path)


# requests a replica works on at once before Serve's autoscaler adds another: a decoder's rows
# decode together (its slots); an embedder's inputs of concurrent requests share its batches, and
# a second waiting request already means its CPU is full
EMBEDDER_TARGET = 2


def replica_options(role: str, replicas: int, max_replicas: int | None, slots: int | None, cpus: int = 1) -> dict:
    """A fixed number of model replicas, or (max_replicas above it) Serve's autoscaling between the
    two. Each replica reserves the `cpus` its ONNX Runtime threads run on: Ray places a replica only
    where that many are free (never two sessions on the same cores), and a cluster whose autoscaler
    adds nodes (KubeRay) adds one for a replica that has no room."""
    reserve = {"ray_actor_options": {"num_cpus": cpus}}
    if not max_replicas or max_replicas <= replicas:
        return {"num_replicas": replicas, **reserve}
    from .decoder import DEFAULT_SLOTS

    target = EMBEDDER_TARGET if role == "embedder" else slots or DEFAULT_SLOTS
    return {"autoscaling_config": {"min_replicas": replicas, "initial_replicas": replicas, "max_replicas": max_replicas,
                                   "target_ongoing_requests": target}, **reserve}


def check_origin(text: str) -> str:
    """A web origin as browsers send it (scheme://host[:port], no path), or *; ValueError otherwise."""
    from urllib.parse import urlsplit

    parts = urlsplit(text)
    if text != "*" and (parts.scheme not in ("http", "https") or not parts.netloc or parts.path or parts.query):
        raise ValueError(f"an origin is scheme://host[:port] (or *), got {text!r}")
    return text


def _api(name: str, allow_origins=()):
    """The FastAPI app: every error, ours or the router's (404, 405), as OpenAI's error object.
    With origins, browsers' cross-origin calls from pages there are answered (Starlette's CORS
    middleware: the preflight, then the headers on each answer); without, a page on another origin
    cannot read an answer (a server on loopback is not open to every site its user visits)."""
    from fastapi import FastAPI
    from fastapi.responses import JSONResponse
    from starlette.exceptions import HTTPException as StarletteHTTPException
    from starlette.middleware.cors import CORSMiddleware

    api = FastAPI(title=f"posbias_export serve: {name}")
    if allow_origins:  # the openai JS client sends Authorization and its own x-stainless-* headers
        api.add_middleware(CORSMiddleware, allow_origins=list(allow_origins), allow_methods=["GET", "POST"],
                           allow_headers=["*"])

    def answer(request, err: ApiError):
        metrics = getattr(request.app.state, "metrics", None)  # the ingress's, once it is up
        if metrics is not None:
            metrics.failed(METRIC_ROUTES.get(request.url.path, "other"), err.status)
        return JSONResponse(err.body(), status_code=err.status)

    @api.exception_handler(ApiError)
    async def api_error(request, err: ApiError):
        return answer(request, err)

    @api.exception_handler(StarletteHTTPException)
    async def http_error(request, err):
        return answer(request, ApiError(err.status_code, str(err.detail), kind="invalid_request_error"))

    @api.exception_handler(Exception)
    async def server_error(request, err):  # a fault of ours: still OpenAI's error object, and counted
        return answer(request, ApiError(500, f"the server failed: {first_line(err)}", kind="server_error"))

    return api


def _model_deployment():
    """The model replicas: a Replica each (replica.py), called by the ingress through Ray's handle."""
    from ray import serve

    @serve.deployment(name="model", max_ongoing_requests=256, health_check_period_s=5,
                      graceful_shutdown_timeout_s=DRAIN_S, ray_actor_options={"num_cpus": 0})
    class Model:
        def __init__(self, folder_path: str, threads: int, max_batch_tokens, slots):
            self.replica = Replica(folder_path, threads, max_batch_tokens, **({"slots": slots} if slots else {}))

        async def embed(self, rows):
            return await self.replica.embed(rows)

        async def complete(self, prompt, max_tokens, temperature, stop_ids, seed, top_p=1.0):
            async for item in self.replica.complete(prompt, max_tokens, temperature, stop_ids, seed, top_p):
                yield item

        def ready(self) -> str:
            return self.replica.id

        def check_health(self):
            if not self.replica.healthy():
                raise RuntimeError("the decoding loop stopped")

    return Model


def _ingress_deployment(api):
    """The HTTP ingress: FastAPI's routes on the Ray Serve deployment, each handing to Answers."""
    from fastapi import Request as HttpRequest
    from ray import serve

    @serve.deployment(name="ingress", max_ongoing_requests=1024, graceful_shutdown_timeout_s=DRAIN_S,
                      ray_actor_options={"num_cpus": 0})
    @serve.ingress(api)
    class Ingress(Answers):
        def __init__(self, model, folder_path: str):
            super().__init__(model, folder_path)
            api.state.metrics = self.metrics  # the error handlers count failures there

        @api.get("/health")
        async def health(self):
            return await self.health_answer()

        @api.get("/v1/models")
        async def models(self):
            return self.models_answer()

        @api.get("/v1/models/{model:path}")
        async def model(self, model: str):
            return self.model_answer(model)

        @api.get("/metrics")
        async def metrics(self):
            return self.metrics_answer()

        @api.post("/v1/embeddings")
        async def embeddings(self, request: HttpRequest):
            return await self.embeddings_answer(request)

        @api.post("/v1/completions")
        async def completions(self, request: HttpRequest):
            return await self.completions_answer(request)

        @api.post("/v1/chat/completions")
        async def chat_completions(self, request: HttpRequest):
            return await self.chat_answer(request)

    return Ingress


class Answers:
    """What the ingress answers, apart from FastAPI's routing: parses and checks each request,
    tokenizes, calls the model replicas through Ray's handle, detokenizes, counts for /metrics."""

    def __init__(self, model, folder_path: str):
        from tokenizers import Tokenizer

        from .metrics import Metrics

        self.model = model
        self.served = ServedFolder.read(folder_path)
        self.tokenizer = Tokenizer.from_file(str(self.served.files["tokenizer"]))
        self.tokenizer.no_truncation()
        self.tokenizer.no_padding()
        # token ids are judged against the model's table (it may be larger than the tokenizer's)
        vocab = self.served.settings.get("vocab_size")
        self.vocab = vocab if isinstance(vocab, int) and vocab > 0 else self.tokenizer.get_vocab_size()
        self.eos = _eos_ids(self.served.settings)
        self.metrics = Metrics()
        template = chat_template(self.served.path) if self.served.role != "embedder" else None
        self.chat = ChatTemplate(template, special_tokens(self.served.path)) if template else None

    async def _body(self, request) -> dict:
        """The JSON body; one past MAX_BODY_BYTES is read to its end and dropped, then refused
        (413): a client still sending would otherwise see its connection reset, not the answer."""
        kept, size = [], 0
        async for chunk in request.stream():
            size += len(chunk)
            if size <= MAX_BODY_BYTES:
                kept.append(chunk)
        if size > MAX_BODY_BYTES:
            raise ApiError(413, f"the request body is {size} bytes; the limit is {MAX_BODY_BYTES}",
                           code="body_too_large")
        return parse_body(b"".join(kept))

    def _need(self, role: str, route: str) -> None:
        if self.served.role != role and not (role == "decoder" and self.served.role == "seq2seq"):
            raise ApiError(400, f"{route} is not served here: {self.served.name} is a {self.served.role}")

    async def health_answer(self):
        from fastapi.responses import JSONResponse

        try:
            await self.model.ready.remote()
        except Exception as err:  # noqa: BLE001 - a replica not up yet
            return JSONResponse({"status": "starting", "detail": str(err).splitlines()[0] if str(err) else ""},
                                status_code=503)
        return {"status": "ok"}

    def models_answer(self) -> dict:
        return {"object": "list", "data": [self.model_answer(self.served.name)]}

    def model_answer(self, model: str) -> dict:
        """GET /v1/models/{model} (the openai client's models.retrieve): the served folder, or a 404."""
        check_model({"model": model}, self.served.name)
        return {"id": self.served.name, "object": "model", "created": int(self.served.path.stat().st_mtime),
                "owned_by": "posbias_export"}

    def metrics_answer(self):
        from fastapi.responses import Response

        return Response(self.metrics.render(), media_type="text/plain; version=0.0.4")

    async def embeddings_answer(self, request) -> dict:
        started = time.perf_counter()
        self._need("embedder", "/v1/embeddings")
        parsed = EmbeddingsRequest.parse(await self._body(request), self.served.name, self.vocab)
        rows = parsed.ids or [e.ids for e in self.tokenizer.encode_batch(parsed.texts)]
        for k, row in enumerate(rows):
            if len(row) > self.served.context:
                raise ApiError(400, f"input {k} has {len(row)} tokens; this model's maximum is "
                               f"{self.served.context}", param="input", code="context_length_exceeded")
            if not row:
                raise ApiError(400, f"input {k} has no token", param="input")
        try:
            got = await self._call(self.model.embed.remote(rows))
        except asyncio.CancelledError:  # the client left (Ray Serve cancels its request): the replica drops its inputs
            self.metrics.failed("embeddings", CLIENT_LEFT)
            raise
        tokens = sum(len(r) for r in rows)
        self.metrics.observe("embeddings", tokens, 0, [got], time.perf_counter() - started)
        data = [{"object": "embedding", "index": k, "embedding": encode_embedding(v, parsed.encoding)}
                for k, v in enumerate(got["vectors"])]
        return {"object": "list", "data": data, "model": self.served.name,
                "usage": {"prompt_tokens": tokens, "total_tokens": tokens}}

    async def completions_answer(self, request):
        started = time.perf_counter()
        self._need("decoder", "/v1/completions")
        parsed = CompletionRequest.parse(await self._body(request), self.served.name, self.vocab)
        prompts = [p if isinstance(p, list) else self.tokenizer.encode(p).ids for p in parsed.prompts]
        return await self._complete(parsed, prompts, started, _Completion)

    async def chat_answer(self, request):
        """The messages through the folder's chat template, then a completion of those tokens."""
        started = time.perf_counter()
        self._need("decoder", "/v1/chat/completions")
        body = await self._body(request)
        check_model(body, self.served.name)  # a wrong model is a 404 before anything else is judged
        if self.chat is None:
            raise ApiError(400, f"{self.served.name} has no chat template (tokenizer_config.json's chat_template or "
                           "chat_template.jinja): send its prompt format to /v1/completions", code="no_chat_template")
        messages, rest = completion_body(body)
        ids = self.tokenizer.encode(self.chat.render(messages), add_special_tokens=False).ids  # the template adds them
        parsed = CompletionRequest.parse({**rest, "prompt": ids or [0]}, self.served.name, self.vocab)
        return await self._complete(parsed, [ids], started, _ChatCompletion)

    async def _complete(self, parsed: CompletionRequest, prompts: list, started: float, kind):
        from fastapi.responses import StreamingResponse

        for prompt in prompts:
            if not prompt:
                raise ApiError(400, "the prompt has no token", param="prompt")
            parsed.check_length(len(prompt), self.served.context)
        runs = [kind(self, parsed, prompt, self.model.options(stream=True).complete.remote(
            prompt, parsed.max_tokens, parsed.temperature, self.eos, parsed.seed, parsed.top_p), started, index)
            for index, prompt in enumerate(prompts)]
        if parsed.stream:
            return StreamingResponse(runs[0].events() if len(runs) == 1 else _merged_events(runs),
                                     media_type="text/event-stream")
        return await _whole(runs)

    async def _call(self, response):
        async def answer():
            return await response

        try:
            return await asyncio.wait_for(answer(), REPLICA_TIMEOUT_S)
        except ApiError:
            raise
        except asyncio.TimeoutError:
            response.cancel()
            raise ApiError(504, f"the model replica gave no answer in {REPLICA_TIMEOUT_S} s; retry",
                           kind="server_error", code="timeout") from None
        except Exception as err:  # noqa: BLE001 - a replica that died or failed: a 503, not a 500
            raise ApiError(503, f"the model replica failed: {first_line(err)}; retry",
                           kind="server_error", code="replica_failed") from None


def _eos_ids(settings: dict) -> tuple[int, ...]:
    eos = settings.get("eos_token_id")
    if eos is None:
        return ()
    return tuple(eos) if isinstance(eos, list) else (eos,)


class _Completion:
    """One completion's tokens -> text, stop strings, the OpenAI objects (whole or as events)."""

    def __init__(self, ingress, parsed: CompletionRequest, prompt: list[int], tokens, started: float, index: int = 0):
        self.ingress, self.parsed, self.prompt, self.tokens, self.started = ingress, parsed, prompt, tokens, started
        self.index, self.id, self.created = index, f"cmpl-{uuid.uuid4().hex[:24]}", int(time.time())
        self.made: list[int] = []
        self.text, self.finish, self.stats = "", None, {}

    async def _pieces(self):
        """Text deltas as tokens arrive; stops at a stop string (the text before it kept)."""
        sent = 0
        try:
            async for item in self.tokens:
                if isinstance(item, dict):
                    if "error" in item and item.get("status") == 400:  # a slot's context, smaller than the folder's
                        raise ApiError(400, item["error"], param="max_tokens", code="context_length_exceeded")
                    if "error" in item:
                        raise ApiError(503, f"the model replica failed: {item['error']}",
                                       kind="server_error", code="replica_failed")
                    self.finish, self.stats = self.finish or item["finish"], item
                    break
                for k, token in enumerate(item):  # the tokens made since the last item (several when this reader is behind)
                    self.made.append(token)
                    if k < len(item) - 1 and not self.parsed.stop:
                        continue  # no stop string to look for after each token: the item's text at its end
                    self.text = self.ingress.tokenizer.decode(self.made, skip_special_tokens=True)
                    cut = min((self.text.find(s) for s in self.parsed.stop if s in self.text), default=-1)
                    if cut >= 0:
                        self.text, self.finish = self.text[:cut], "stop"
                        if len(self.text) > sent:
                            yield self.text[sent:]
                        self.tokens.cancel()
                        return
                piece = ""  # one event an item, empty while a split character waits for its other bytes
                if len(self.text) > sent and not self.text.endswith("\ufffd"):
                    piece, sent = self.text[sent:], len(self.text)
                yield piece
        except ApiError:
            raise
        except Exception as err:  # noqa: BLE001 - the replica died under the request
            raise ApiError(503, f"the model replica failed: {first_line(err)}; retry",
                           kind="server_error", code="replica_failed") from None
        if len(self.text) > sent:
            yield self.text[sent:]

    def _object(self, text: str, finish):
        return {"id": self.id, "object": "text_completion", "created": self.created, "model": self.ingress.served.name,
                "choices": [{"text": text, "index": self.index, "logprobs": None, "finish_reason": finish}]}

    def _usage(self) -> dict:
        return {"prompt_tokens": len(self.prompt), "completion_tokens": len(self.made),
                "total_tokens": len(self.prompt) + len(self.made)}

    async def whole(self) -> dict:
        async for _ in self._pieces():
            pass
        return {**self._object(self.text, self.finish or "length"), "usage": self._usage()}

    async def events(self):
        try:
            async for piece in self._pieces():
                yield f"data: {json.dumps(self._object(piece, None))}\n\n"
            yield f"data: {json.dumps({**self._object('', self.finish or 'length'), 'usage': self._usage()})}\n\n"
        except ApiError as err:
            self.ingress.metrics.failed("completions", err.status)
            yield f"data: {json.dumps(err.body())}\n\n"
        except (GeneratorExit, asyncio.CancelledError):  # the client left: its row was freed (replica.py)
            self.ingress.metrics.failed("completions", CLIENT_LEFT)
            raise
        else:
            _record([self])
        yield "data: [DONE]\n\n"


def _record(runs: list[_Completion]) -> None:
    """One request answered whole, however many prompts it held: their tokens summed, each one's
    wait in its replica (a failed request or a client that left is counted as a failure only)."""
    first = runs[0]
    first.ingress.metrics.observe("completions", sum(len(r.prompt) for r in runs), sum(len(r.made) for r in runs),
                                  [r.stats for r in runs], time.perf_counter() - first.started)


async def _whole(runs: list[_Completion]) -> dict:
    """Every prompt's answer, a choice each (the first's id); a failure cancels the others."""
    try:
        answers = await asyncio.gather(*(run.whole() for run in runs))
    except BaseException as err:
        for run in runs:
            run.tokens.cancel()
        if isinstance(err, asyncio.CancelledError):  # the client left before its answer (Ray Serve cancels)
            runs[0].ingress.metrics.failed("completions", CLIENT_LEFT)
        raise
    _record(runs)
    usage = {k: sum(a["usage"][k] for a in answers) for k in answers[0]["usage"]}
    return {**answers[0], "choices": [a["choices"][0] for a in answers], "usage": usage}


async def _merged_events(runs: list[_Completion]):
    """Several prompts' events as they come, each choice with its prompt's index; after the last
    one's end, one chunk with no choice and the whole request's usage (OpenAI's include_usage)."""
    events: asyncio.Queue = asyncio.Queue()

    async def pump(run: _Completion):
        try:
            async for piece in run._pieces():
                await events.put(run._object(piece, None))
            await events.put(run._object("", run.finish or "length"))
        except ApiError as err:
            await events.put(err)
        finally:
            await events.put(None)

    tasks, left = [asyncio.create_task(pump(run)) for run in runs], len(runs)
    try:
        while left:
            event = await events.get()
            left -= event is None
            if isinstance(event, ApiError):
                runs[0].ingress.metrics.failed("completions", event.status)
                yield f"data: {json.dumps(event.body())}\n\n"
                break
            if event is not None:
                yield f"data: {json.dumps(event)}\n\n"
        else:
            usage = [run._usage() for run in runs]
            last = {**runs[0]._object("", None), "choices": [], "usage": {k: sum(u[k] for u in usage) for k in usage[0]}}
            yield f"data: {json.dumps(last)}\n\n"
            _record(runs)  # after its last chunk went: a client gone at that point is a 499 only
    except (GeneratorExit, asyncio.CancelledError):
        runs[0].ingress.metrics.failed("completions", CLIENT_LEFT)
        raise
    finally:
        for task, run in zip(tasks, runs):
            task.cancel()
            run.tokens.cancel()
    yield "data: [DONE]\n\n"


class _ChatCompletion(_Completion):
    """The same tokens as OpenAI's chat objects: a message whole, deltas streamed."""

    sent_role = False

    def _object(self, text: str, finish):
        delta = {"content": text} if text or finish is None else {}
        if not self.sent_role:  # the first chunk names the speaker
            delta, self.sent_role = {"role": "assistant", **delta}, True
        return {"id": self.id.replace("cmpl-", "chatcmpl-"), "object": "chat.completion.chunk", "created": self.created,
                "model": self.ingress.served.name,
                "choices": [{"index": self.index, "delta": delta, "logprobs": None, "finish_reason": finish}]}

    async def whole(self) -> dict:
        chunk = await super().whole()
        choice = chunk["choices"][0]
        message = {"role": "assistant", "content": self.text}
        return {**chunk, "object": "chat.completion",
                "choices": [{"index": self.index, "message": message, "logprobs": None,
                             "finish_reason": choice["finish_reason"]}]}
