"""`python -m posbias_export serve DIR` end to end: a local Ray Serve on 127.0.0.1 (a free port,
stopped by SIGTERM at the end), driven by the `openai` client. Embeddings equal the folder's file
run directly; completions' greedy tokens equal `generate`'s (and seq2seq.py's for a T5 pair), streamed
or not; 16 concurrent requests of mixed lengths are all answered right; a short request sent while
a long one decodes finishes first; every bad input is a 4xx with OpenAI's error object; a replica
killed under load is restarted and no request hangs; SIGTERM drains and stops Ray."""
from __future__ import annotations

import json
import os
import signal
import subprocess
import threading
import time
import urllib.error
import urllib.request
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import numpy as np
import pytest

openai = pytest.importorskip("openai")
pytest.importorskip("ray.serve")

from test_serve_engines import PROMPTS, generate_alone  # noqa: E402  (puts runtimes/ on the path)
from common.loading import load_runner  # noqa: E402
from hf_folders import save_client_model, save_tiny_folder, save_tokenizer  # noqa: E402
from posbias_export.hf.ship import ship  # noqa: E402
from posbias_export.peers.servers import STARTUP_S, tree_pids  # noqa: E402
from posbias_export.serve.process import ServeProcess  # noqa: E402

REPO = Path(__file__).resolve().parents[1]


class Server(ServeProcess):
    """serve DIR (one ONNX Runtime thread a replica) with an openai client and a raw poster."""

    def __init__(self, folder: Path, *extra: str):
        super().__init__(folder, "--threads", "1", *extra, cwd=REPO)
        self.client = openai.OpenAI(base_url=f"{self.url}/v1", api_key="-", max_retries=0, timeout=300)

    def post(self, path: str, body: bytes) -> tuple[int, dict]:
        request = urllib.request.Request(self.url + path, data=body, headers={"Content-Type": "application/json"})
        try:
            with urllib.request.urlopen(request, timeout=120) as answer:
                return answer.status, json.loads(answer.read())
        except urllib.error.HTTPError as err:
            return err.code, json.loads(err.read())


def kill_model_replica(name: str) -> None:
    found = subprocess.run(["pgrep", "-f", f"ServeReplica:{name}:model"], capture_output=True, text=True).stdout.split()
    assert found, "no model replica process"
    os.kill(int(found[0]), signal.SIGKILL)


def failures(server: Server) -> dict[tuple[str, str], float]:
    """/metrics' failed requests: (route, status) -> count, read with Prometheus' own parser."""
    from prometheus_client.parser import text_string_to_metric_families

    text = urllib.request.urlopen(server.url + "/metrics", timeout=10).read().decode()
    return {(s.labels["route"], s.labels["status"]): s.value for family in text_string_to_metric_families(text)
            if family.name == "posbias_request_failures" for s in family.samples if s.name.endswith("_total")}


def check_errors(server: Server, route: str, bodies: dict) -> None:
    """Each body -> its status, with OpenAI's error object, and counted in /metrics under its
    route and status; the replica serves on after all of them."""
    before = failures(server)
    for name, (body, status) in bodies.items():
        raw = body if isinstance(body, bytes) else json.dumps(body).encode()
        got, answer = server.post(route, raw)
        assert got == status, (name, got, answer)
        assert set(answer["error"]) >= {"message", "type", "param", "code"} and answer["error"]["message"], name
    after, label = failures(server), route.rsplit("/", 1)[-1]
    for status in {status for _, status in bodies.values()}:
        key = (label, str(status))
        assert after.get(key, 0) - before.get(key, 0) == sum(s == status for _, s in bodies.values()), (key, after)


@pytest.fixture(scope="module")
def root(tmp_path_factory):
    return tmp_path_factory.mktemp("serve")


def test_served_embedder(root):
    source = save_tiny_folder("jina_bert", root / "jina")
    save_tokenizer(source, max_length=8192)
    folder = root / "jina_served"
    ship(source, folder, check_growth=False)
    from posbias_export.serve.embedder import EmbedderEngine
    from posbias_export.serve.folder import ServedFolder

    direct = EmbedderEngine(ServedFolder.read(folder))  # the folder's file, run on each input alone
    server = Server(folder, "--max-batch-tokens", "256")
    tree = tree_pids(server.process.pid)
    try:
        assert not cluster_only_processes(tree)
        client = server.client
        assert [m.id for m in client.models.list().data] == [folder.name]
        assert client.models.retrieve(folder.name).id == folder.name
        with pytest.raises(openai.NotFoundError):
            client.models.retrieve("nope")
        texts = ["To be, or not to be", "that is the question: whether tis nobler in the mind to suffer", "To"]
        got = client.embeddings.create(model=folder.name, input=texts)
        assert got.usage.prompt_tokens == sum(len(r) for r in direct.tokenize(texts))
        for text, item in zip(texts, got.data):
            alone = direct.embed(direct.tokenize([text]))[0]
            assert float(np.dot(item.embedding, alone)) >= 0.99999
        b64 = client.embeddings.create(model=folder.name, input=texts[:1], encoding_format="base64").data[0].embedding
        import base64

        assert np.array_equal(np.frombuffer(base64.b64decode(b64), "<f4"), np.float32(got.data[0].embedding))
        # LangChain's class, told to send text (by default it sends tiktoken's ids, OpenAI's vocabulary)
        from langchain_openai import OpenAIEmbeddings

        chain = OpenAIEmbeddings(base_url=f"{server.url}/v1", api_key="-", model=folder.name, max_retries=0,
                                 check_embedding_ctx_length=False)
        for vector, text in zip(chain.embed_documents(texts), texts):
            assert float(np.dot(vector, direct.embed(direct.tokenize([text]))[0])) >= 0.99999
        ids = client.embeddings.create(model=folder.name, input=[PROMPTS[0], PROMPTS[2]])
        assert float(np.dot(ids.data[1].embedding, direct.embed([PROMPTS[2]])[0])) >= 0.99999

        # 16 concurrent requests, one input of 700 tokens beside short ones: the 256-token budget
        # splits the batches and runs the long one alone, refusing none
        inputs = [[(7 * k + j) % 290 + 3 for j in range(700 if k == 5 else 3 + 9 * k)] for k in range(16)]
        with ThreadPoolExecutor(16) as pool:
            answers = list(pool.map(lambda row: client.embeddings.create(model=folder.name, input=[row]), inputs))
        for row, answer in zip(inputs, answers):
            assert float(np.dot(answer.data[0].embedding, direct.embed([row])[0])) >= 0.99999
        metrics = urllib.request.urlopen(server.url + "/metrics", timeout=10).read().decode()
        assert 'posbias_requests_total{route="embeddings"}' in metrics and "posbias_batch_size_bucket" in metrics

        check_errors(server, "/v1/embeddings", {
            "empty string": ({"model": folder.name, "input": ""}, 400),
            "empty list": ({"model": folder.name, "input": []}, 400),
            "floats": ({"model": folder.name, "input": [1.5, 2]}, 400),
            "mixed": ({"model": folder.name, "input": [[1, 2], "x"]}, 400),
            "id past the vocabulary": ({"model": folder.name, "input": [[1, 10**9]]}, 400),
            "past the context": ({"model": folder.name, "input": [[5] * 9000]}, 400),
            "encoding": ({"model": folder.name, "input": "x", "encoding_format": "hex"}, 400),
            "unknown model": ({"model": "nope", "input": "x"}, 404),
            "no model": ({"input": "x"}, 400),
            "not JSON": (b"{bad", 400),
            "not an object": (b"[1, 2]", 400),
            "100 MB": (b'{"model": "x", "input": "' + b"a" * (100 << 20) + b'"}', 413),
            "completions here": ({"model": folder.name, "prompt": "x"}, 400),
            "nested deeply": (b"[" * 100_000 + b"]" * 100_000, 400),
            "not UTF-8": (b'{"model": "\xff\xfe", "input": "x"}', 400),
            "an empty row of ids": ({"model": folder.name, "input": [[1, 2], []]}, 400),
            "model not a string": ({"model": 123, "input": "x"}, 404),
        })
        assert server.status("/v1/nothing") == 404
        kill_model_replica(folder.name)
        deadline, answered = time.time() + STARTUP_S, None
        while time.time() < deadline and answered is None:
            status, body = server.post("/v1/embeddings", json.dumps({"model": folder.name, "input": texts}).encode())
            assert status in (200, 503), (status, body)  # a dead replica is a clean 503 until Ray restarts it
            answered = body if status == 200 else time.sleep(2)
        assert answered is not None, "the replica was not restarted"
        assert float(np.dot(answered["data"][0]["embedding"], got.data[0].embedding)) >= 0.99999
    finally:
        tree |= tree_pids(server.process.pid)  # the restarted replica's too
        assert server.stop() == 0
    assert "stopping" in server.log.read_text()
    assert_gone(tree)


def assert_gone(pids) -> None:
    time.sleep(2)  # SIGKILLed stragglers leave /proc within moments
    assert not [pid for pid in pids if Path(f"/proc/{pid}").exists()], "Ray processes outlived serve"


def cluster_only_processes(pids) -> list[str]:
    """The command lines of Ray's cluster daemons a local serve does not start (serve/local_ray.py):
    the autoscaler's monitor, the log monitor, the dashboard's API server."""
    daemons = ("autoscaler/_private/monitor.py", "log_monitor.py", "dashboard/dashboard.py")
    return [command for command in map(command_line, pids) if any(part in command for part in daemons)]


def command_line(pid: int) -> str:
    """A process's command line ("" once it is gone); Ray renames its workers' (ray::ServeReplica:...)."""
    try:
        return Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
    except OSError:
        return ""


def completion_tokens(client, model: str, prompt, max_tokens: int, stream: bool = False) -> tuple[str, int]:
    if stream:
        text, usage = "", None
        for event in client.completions.create(model=model, prompt=prompt, max_tokens=max_tokens, temperature=0,
                                               stream=True):
            text += event.choices[0].text
            usage = event.usage or usage
        return text, usage.completion_tokens
    answer = client.completions.create(model=model, prompt=prompt, max_tokens=max_tokens, temperature=0)
    return answer.choices[0].text, answer.usage.completion_tokens


def check_many_prompts(server, name: str, prompts: list, expected) -> None:
    """Several prompts in one request (a choice each, streamed interleaved with usage last), and
    LangChain's OpenAI class, which sends its prompts as a list beside penalties at 0 and nulls."""
    from langchain_openai import OpenAI as LangChainOpenAI

    want = [expected(p, 7) for p in prompts]
    answer = server.client.completions.create(model=name, prompt=prompts, max_tokens=7, temperature=0)
    assert [c.index for c in answer.choices] == list(range(len(prompts)))
    assert [c.text for c in answer.choices] == want
    streamed, usage = [""] * len(prompts), None
    for event in server.client.completions.create(model=name, prompt=prompts, max_tokens=7, temperature=0, stream=True):
        for choice in event.choices:
            streamed[choice.index] += choice.text
        usage = event.usage or usage
    assert streamed == want and usage.prompt_tokens == answer.usage.prompt_tokens
    texts = [p for p in prompts if isinstance(p, str)]
    chain = LangChainOpenAI(base_url=f"{server.url}/v1", api_key="-", model=name, temperature=0, max_tokens=7,
                            max_retries=0)
    assert chain.invoke(texts[0]) == expected(texts[0], 7)
    assert chain.batch(texts) == [expected(t, 7) for t in texts]
    assert "".join(chain.stream(texts[-1])) == expected(texts[-1], 7)


CHAT_TEMPLATE = ("{{ bos_token }}{% for m in messages %}{{ '<|' + m['role'] + '|>' + m['content'] + '\\n' }}{% endfor %}"
                 "{% if add_generation_prompt %}{{ '<|assistant|>' }}{% endif %}")


def check_chat(server, name: str, folder: Path, expected) -> None:
    """/v1/chat/completions: the messages rendered as transformers' apply_chat_template renders them
    (the folder's chat_template.jinja, shipped beside the tokenizer), the tokens `generate`'s; the
    openai client whole and streamed, and LangChain's ChatOpenAI."""
    import transformers
    from langchain_openai import ChatOpenAI

    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "To be, or not to be?"}]
    ids = transformers.AutoTokenizer.from_pretrained(str(folder)).apply_chat_template(
        messages, add_generation_prompt=True, tokenize=True, return_dict=False)
    want = expected(list(ids), 6)
    answer = server.client.chat.completions.create(model=name, messages=messages, max_tokens=6, temperature=0)
    assert answer.choices[0].message.content == want and answer.usage.prompt_tokens == len(ids)
    streamed = "".join(e.choices[0].delta.content or "" for e in server.client.chat.completions.create(
        model=name, messages=messages, max_completion_tokens=6, temperature=0, stream=True) if e.choices)
    assert streamed == want
    chain = ChatOpenAI(base_url=f"{server.url}/v1", api_key="-", model=name, temperature=0, max_tokens=6, max_retries=0)
    assert chain.invoke([(m["role"], m["content"]) for m in messages]).content == want


def test_served_decoder(root):
    from tokenizers import Tokenizer

    folder = root / "bloom_served"
    source = save_client_model("bloom", root / "bloom")
    (source / "chat_template.jinja").write_text(CHAT_TEMPLATE)  # where transformers saves a chat model's
    ship(source, folder, check_growth=False)
    tokenizer = Tokenizer.from_file(str(folder / "tokenizer.json"))
    eos = (json.loads((folder / "generation_config.json").read_text())["eos_token_id"],)

    def expected(prompt: list[int], n: int) -> tuple[str, int]:
        made = generate_alone(folder, prompt, n, eos)
        return tokenizer.decode(made, skip_special_tokens=True), len(made)

    server = Server(folder, "--slots", "4", "--allow-origin", "http://localhost:5173")
    tree = tree_pids(server.process.pid)
    try:
        assert not cluster_only_processes(tree)
        client, name = server.client, folder.name
        # a browser page at the allowed origin: its preflight is answered through Ray's proxy
        preflight = urllib.request.Request(server.url + "/v1/completions", method="OPTIONS", headers={
            "Origin": "http://localhost:5173", "Access-Control-Request-Method": "POST",
            "Access-Control-Request-Headers": "authorization,content-type"})
        with urllib.request.urlopen(preflight, timeout=60) as answer:
            assert answer.headers["access-control-allow-origin"] == "http://localhost:5173"
        assert client.models.retrieve(name).id == name and server.status("/v1/models/nope") == 404
        assert completion_tokens(client, name, PROMPTS[0], 12) == expected(PROMPTS[0], 12)
        assert completion_tokens(client, name, PROMPTS[0], 12, stream=True) == expected(PROMPTS[0], 12)
        text_prompt = "To be, or not to be"
        ids = tokenizer.encode(text_prompt).ids
        assert completion_tokens(client, name, text_prompt, 8) == expected(ids, 8)
        check_many_prompts(server, name, [text_prompt, PROMPTS[1], "that is the question"],
                           lambda p, n: expected(p if isinstance(p, list) else tokenizer.encode(p).ids, n)[0])
        check_chat(server, name, folder, lambda ids, n: expected(ids, n)[0])

        # 16 concurrent requests of mixed prompts and lengths through 4 slots
        jobs = [(PROMPTS[k % len(PROMPTS)], 3 + 2 * k) for k in range(16)]
        with ThreadPoolExecutor(16) as pool:
            answers = list(pool.map(lambda job: completion_tokens(client, name, *job), jobs))
        assert answers == [expected(*job) for job in jobs]

        # continuous batching: a short request sent while a long one streams ends first, unchanged
        stream = client.completions.create(model=name, prompt=PROMPTS[2], max_tokens=400, temperature=0, stream=True)
        events = iter(stream)
        long_text = "".join(next(events).choices[0].text for _ in range(3))
        assert completion_tokens(client, name, PROMPTS[1], 5) == expected(PROMPTS[1], 5)
        for event in events:  # the long one is still running: the rest of its text comes after
            long_text += event.choices[0].text
            usage = event.usage
        assert usage.completion_tokens > 5 and (long_text, usage.completion_tokens) == expected(PROMPTS[2], 400)

        # a client that leaves mid-stream: counted as 499 (its row is freed: test_serve_engines)
        stream = client.completions.create(model=name, prompt=PROMPTS[2], max_tokens=400, temperature=0, stream=True)
        next(iter(stream))
        stream.close()
        deadline = time.time() + 30
        while failures(server).get(("completions", "499")) != 1:
            assert time.time() < deadline, failures(server)
            time.sleep(0.2)

        check_errors(server, "/v1/completions", {
            "empty prompt": ({"model": name, "prompt": ""}, 400),
            "prompt type": ({"model": name, "prompt": 123}, 400),
            "prompt past the context": ({"model": name, "prompt": [5] * 9000, "max_tokens": 1}, 400),
            "max_tokens 0": ({"model": name, "prompt": "x", "max_tokens": 0}, 400),
            "max_tokens text": ({"model": name, "prompt": "x", "max_tokens": "5"}, 400),
            "max_tokens huge": ({"model": name, "prompt": "x", "max_tokens": 10**9}, 400),
            "temperature": ({"model": name, "prompt": "x", "temperature": 7}, 400),
            "stop type": ({"model": name, "prompt": "x", "stop": 5}, 400),
            "unknown model": ({"model": "nope", "prompt": "x"}, 404),
            "not JSON": (b"{bad", 400),
            "100 MB": (b'{"model": "x", "prompt": "' + b"a" * (100 << 20) + b'"}', 413),
            "embeddings here": ({"model": name, "input": "x"}, 400),
            "nested deeply": (b'{"model": "x", "prompt": ' + b"[" * 100_000 + b"]" * 100_000 + b"}", 400),
            "temperature NaN": (b'{"model": "%s", "prompt": "x", "temperature": NaN}' % name.encode(), 400),
            "temperature text": ({"model": name, "prompt": "x", "temperature": "0.5"}, 400),
            "n 3": ({"model": name, "prompt": "x", "n": 3}, 400),
            "logprobs": ({"model": name, "prompt": "x", "logprobs": 2}, 400),
            "a penalty": ({"model": name, "prompt": "x", "frequency_penalty": 0.5}, 400),
            "top_p 0": ({"model": name, "prompt": "x", "top_p": 0}, 400),
            "top_p 1.5": ({"model": name, "prompt": "x", "top_p": 1.5}, 400),
            "an empty prompt among others": ({"model": name, "prompt": ["x", ""]}, 400),
            "65 prompts": ({"model": name, "prompt": ["x"] * 65}, 400),
        })

        check_errors(server, "/v1/chat/completions", {
            "no messages": ({"model": name}, 400),
            "a message without a role": ({"model": name, "messages": [{"content": "x"}]}, 400),
            "an image part": ({"model": name, "messages": [{"role": "user", "content": [{"type": "image_url"}]}]}, 400),
            "tools": ({"model": name, "messages": [{"role": "user", "content": "x"}], "tools": [{"type": "function"}]},
                      400),
            "unknown model": ({"model": "nope", "messages": [{"role": "user", "content": "x"}]}, 404),
        })

        # a replica killed while requests decode: each fails cleanly (503) or is answered, none hangs
        with ThreadPoolExecutor(4) as pool:
            running = [pool.submit(completion_tokens, client, name, PROMPTS[k], 300) for k in range(4)]
            time.sleep(1.0)
            kill_model_replica(name)
            for job in running:
                try:
                    job.result(timeout=STARTUP_S)
                except openai.APIStatusError as err:
                    assert err.status_code == 503, err
        deadline = time.time() + STARTUP_S
        while True:
            try:
                assert completion_tokens(client, name, PROMPTS[3], 6) == expected(PROMPTS[3], 6)
                break
            except openai.APIStatusError as err:
                assert err.status_code == 503 and time.time() < deadline, err
                time.sleep(2)
    finally:
        tree |= tree_pids(server.process.pid)  # the restarted replica's too
        assert server.stop() == 0
    assert_gone(tree)


def test_served_seq2seq(root):
    from posbias_export.serve.folder import ServedFolder

    folder = root / "t5_served"
    ship(save_client_model("t5_gated", root / "t5"), folder, check_growth=False)
    served = ServedFolder.read(folder)
    seq2seq = load_runner("ort/seq2seq.py")
    from tokenizers import Tokenizer

    tokenizer, eos = Tokenizer.from_file(str(folder / "tokenizer.json")), served.settings["eos_token_id"]
    server = Server(folder)
    try:
        jobs = [(PROMPTS[k], 4 + k) for k in range(len(PROMPTS))]
        with ThreadPoolExecutor(len(jobs)) as pool:
            answers = list(pool.map(lambda job: server.client.completions.create(
                model=folder.name, prompt=job[0], max_tokens=job[1], temperature=0), jobs))
        for (prompt, n), answer in zip(jobs, answers):
            ids = np.asarray([prompt], np.int64)
            alone = seq2seq.greedy_generate(str(served.files["encoder"]), str(served.files["decoder"]), ids,
                                            np.ones_like(ids), n, start_token=0, eos_ids=(eos,))[0].tolist()
            alone = alone[:alone.index(eos) + 1] if eos in alone else alone
            assert (answer.choices[0].text, answer.usage.completion_tokens) == (
                tokenizer.decode(alone, skip_special_tokens=True), len(alone))
        status, body = server.post("/v1/chat/completions", json.dumps(  # a folder without a chat template
            {"model": folder.name, "messages": [{"role": "user", "content": "x"}]}).encode())
        assert (status, body["error"]["code"]) == (400, "no_chat_template"), body
    finally:
        assert server.stop() == 0


def test_replicas_are_added_under_load(root):
    """--max-replicas: Serve's autoscaler adds a model replica while requests keep more than its
    target waiting (here after ~45 s: its 30 s upscale delay, then a replica's start)."""
    source = save_tiny_folder("jina_bert", root / "jina_scaling")
    save_tokenizer(source, max_length=8192)
    folder = root / "jina_scaling_served"
    ship(source, folder, check_growth=False)
    server = Server(folder, "--replicas", "1", "--max-replicas", "2")
    done = threading.Event()

    def replicas() -> int:
        return sum(f"ServeReplica:{folder.name}:model" in command_line(pid) for pid in tree_pids(server.process.pid))

    def client():
        while not done.is_set():
            server.client.embeddings.create(model=folder.name, input=[[5] * 1500])

    workers = [threading.Thread(target=client) for _ in range(8)]
    try:
        assert replicas() == 1
        for worker in workers:
            worker.start()
        deadline = time.time() + 240
        while replicas() < 2 and time.time() < deadline:
            time.sleep(5)
        assert replicas() == 2, "no second replica under load"
    finally:
        done.set()
        for worker in (w for w in workers if w.ident):  # started
            worker.join()
        assert server.stop() == 0
