"""The folder `--model DIR --out-dir OUT` writes, loaded unchanged by the clients people serve
with, installed from the registries: transformers.js in Node (@huggingface/transformers, a local
folder, remote models off), onnxruntime-web (its WebAssembly build, as a page runs it),
onnxruntime-genai, Triton's own ModelConfig proto (tritonclient);
and our own runners from text, through the folder's tokenizer. Each generates the greedy tokens
of transformers' generate, a single prompt and a padded batch. Optimum pins an older
transformers: bench-clients (posbias_export/clients/checks.py) checks it in a side environment
(benchmarks/clients.md)."""
from __future__ import annotations

import importlib.util
import json
import shutil
import subprocess
import sys
from pathlib import Path

import numpy as np
import onnx
import onnxruntime as ort
import pytest
import torch

transformers = pytest.importorskip("transformers")

import role_matrix  # noqa: E402
from hf_folders import EOS, PAD, VARIANTS, positions_from_mask, save_client_model, seq2seq  # noqa: E402
from posbias_export.hf.ship import ship  # noqa: E402
from posbias_export.parity import load_runner  # noqa: E402
from posbias_export.parity.tokens import until_stop  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
JS = ROOT / "posbias_export" / "clients" / "js"
PROMPTS = [[5, 60, 7, 81, 9, 100, 11, 12, 140, 33], [20, 210, 22]]  # no special token among them
NEW = 12
# The int8 folder's prompt: after PROMPTS[0] this random model's int8 file (7-bit weights) falls
# into a one-token loop, where equal tokens would say nothing about the clients; after this one
# its continuation varies.
INT8_PROMPT = [40, 41, 42, 43, 44, 45]


# the client variants the default run covers: the first of each role the clients take (role_matrix's tier)
DEFAULT_VARIANTS = sorted(role_matrix.default_tier() & set(role_matrix.variants_for("folder_contents")))


class _Shipped(dict):
    """variant -> (source folder, the folder written for the clients), each made on first use (a
    worker makes only the folders of the tests it runs)."""

    def __init__(self, root: Path, **options):
        super().__init__()
        self.root, self.options = root, options

    def __missing__(self, variant: str):
        source = self.root / variant
        if not source.is_dir():
            save_client_model(variant, source)
        out = self.root / f"{variant}_{self.options.get('target', 'out')}"
        ship(source, out, check_growth=False, **self.options)
        self[variant] = (source, out)
        return self[variant]


@pytest.fixture(scope="module")
def shipped(tmp_path_factory):
    return _Shipped(tmp_path_factory.mktemp("clients"))


def transformers_tokens(source: Path, variant: str, prompts: list[list[int]], side: str = "left") -> list[list[int]]:
    """transformers' greedy generate on the batch padded with PAD on `side` (causal LMs: the prompt
    and the new tokens; T5: the decoder's tokens after its start token)."""
    width = max(len(p) for p in prompts)
    ids = torch.full((len(prompts), width), PAD)
    mask = torch.zeros_like(ids)
    for row, p in enumerate(prompts):
        cols = slice(width - len(p), width) if side == "left" else slice(0, len(p))
        ids[row, cols], mask[row, cols] = torch.tensor(p), 1
    cls = getattr(transformers, role_matrix.seq2seq_class(VARIANTS[variant])) if seq2seq(variant) else \
        transformers.AutoModelForCausalLM
    model = cls.from_pretrained(str(source)).eval()
    with torch.no_grad():
        out = model.generate(input_ids=ids, attention_mask=mask, max_new_tokens=NEW, do_sample=False, pad_token_id=PAD)
    return out.tolist()


def until_eos(rows: list[list[int]], start: int) -> list[list[int]]:
    """Each row up to its first end-of-sequence token after `start` (what a row means: after it,
    transformers pads a finished row while transformers.js and genai may differ)."""
    return [until_stop(row, start, (EOS,)) for row in rows]


def _varied(tokens: list[list[int]]) -> None:
    """A check worth making: the model does not just repeat one token."""
    assert all(len(set(row[-NEW:])) > 3 for row in tokens), tokens


@pytest.mark.skipif(shutil.which("node") is None or not (JS / "node_modules" / "@huggingface").is_dir(),
                    reason="transformers.js not installed (cd posbias_export/clients/js && npm install --ignore-scripts)")
@pytest.mark.parametrize("batch", [1, 2], ids=["single", "padded-batch"])
@pytest.mark.parametrize("variant", role_matrix.cases("transformers_js"))
def test_transformers_js_generates_transformers_tokens(shipped, variant, batch):
    source, folder = shipped[variant]
    prompts = PROMPTS[:batch]
    cmd = ["node", str(JS / "generate.mjs"), "seq2seq" if seq2seq(variant) else "causal", str(folder.resolve()),
           json.dumps(prompts), str(NEW)]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=300, cwd=JS)
    assert proc.returncode == 0, proc.stderr[-2000:]
    got = json.loads(proc.stdout.strip().splitlines()[-1])
    expected = transformers_tokens(source, variant, prompts, side="right" if seq2seq(variant) else "left")
    _varied(expected)
    start = 1 if seq2seq(variant) else max(len(p) for p in prompts)  # after the decoder's start token / the prompts
    assert until_eos(got, start) == until_eos(expected, start)


@pytest.mark.skipif(shutil.which("node") is None or not (JS / "node_modules" / "@huggingface").is_dir(),
                    reason="transformers.js not installed (cd posbias_export/clients/js && npm install --ignore-scripts)")
@pytest.mark.parametrize("variant", ["bloom", "falcon"])
def test_transformers_js_takes_a_last_logits_folder(shipped, tmp_path, variant):
    """--out-dir --logits last: the decoder returns [B, 1, V]; transformers.js reads only the
    last position when it generates, so a left-padded batch gives transformers' tokens."""
    source, _ = shipped[variant]
    folder = tmp_path / "last"
    ship(source, folder, check_growth=False, logits="last")
    cmd = ["node", str(JS / "generate.mjs"), "causal", str(folder.resolve()), json.dumps(PROMPTS), str(NEW)]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=300, cwd=JS)
    assert proc.returncode == 0, proc.stderr[-2000:]
    got = json.loads(proc.stdout.strip().splitlines()[-1])
    start = max(len(p) for p in PROMPTS)
    assert until_eos(got, start) == until_eos(transformers_tokens(source, variant, PROMPTS), start)


WEB = pytest.mark.skipif(shutil.which("node") is None or not (JS / "node_modules" / "onnxruntime-web").is_dir(),
                         reason="onnxruntime-web not installed (cd posbias_export/clients/js && npm install --ignore-scripts)")


def _web_tokens(folder: Path, prompt: list[int]) -> list[int]:
    """onnxruntime-web's WebAssembly build, as a page runs it: greedy through the file's cache."""
    proc = subprocess.run(["node", str(JS / "web.mjs"), str(folder.resolve()), json.dumps(prompt), str(NEW), str(EOS)],
                          capture_output=True, text=True, timeout=300, cwd=JS)
    assert proc.returncode == 0, proc.stderr[-2000:]
    return json.loads(proc.stdout.strip().splitlines()[-1])["tokens"]


@WEB
@pytest.mark.parametrize("variant", role_matrix.cases("web"))
def test_onnxruntime_web_generates_transformers_tokens(shipped, variant):
    """The browser's runtime (WebAssembly, one thread) runs the folder's model.onnx with its
    cache: transformers' greedy tokens."""
    source, folder = shipped[variant]
    start = len(PROMPTS[0])
    expected = transformers_tokens(source, variant, PROMPTS[:1])
    _varied(expected)
    assert until_eos([_web_tokens(folder, PROMPTS[0])], start) == until_eos(expected, start)


def right_padded_greedy(source: Path, prompts: list[list[int]]) -> list[list[int]]:
    """transformers' model, greedy, fed as onnxruntime-genai feeds a batch: padded on the right,
    each row's first token read at its last real position, every new token appended after the
    padding (holes in the mask from then on), a row that ended padded with PAD."""
    model = transformers.AutoModelForCausalLM.from_pretrained(str(source)).eval()
    width = max(len(p) for p in prompts)
    ids = torch.tensor([p + [PAD] * (width - len(p)) for p in prompts])
    mask = (torch.arange(width)[None] < torch.tensor([[len(p)] for p in prompts])).long()
    done = torch.zeros(len(prompts), dtype=torch.bool)
    with torch.no_grad():
        for step in range(NEW):
            logits = model(input_ids=ids, attention_mask=mask).logits
            last = logits[torch.arange(len(prompts)), [len(p) - 1 for p in prompts]] if step == 0 else logits[:, -1]
            token = torch.where(done, PAD, last.argmax(-1))
            done |= token == EOS
            ids, mask = torch.cat([ids, token[:, None]], 1), torch.cat([mask, torch.ones(len(prompts), 1, dtype=torch.long)], 1)
    return ids.tolist()


@pytest.mark.parametrize("variant", role_matrix.cases("genai"))
def test_onnxruntime_genai_generates_transformers_tokens(shipped, variant):
    """genai runs our decoder as its generic "llama" type from genai_config.json. It pads a batch
    on the right and decodes after the padding, which leaves holes in the mask: the file counts
    positions as transformers does (BLOOM, Falcon: cumsum of the mask, so each row is its prompt
    alone; MPT: the index), so genai's tokens are transformers' under the same inputs."""
    source, folder = shipped[variant]
    _genai_generates_transformers_tokens(source, folder, variant)


@pytest.fixture(scope="module")
def shipped_inplace(shipped):
    """variant -> (source, the folder written with --target ort: an in-place cache; genai shares its buffer)."""
    return _Shipped(shipped.root, target="ort")


@pytest.mark.parametrize("variant", role_matrix.cases("genai_inplace"))
def test_onnxruntime_genai_shares_the_buffer_of_an_inplace_folder(shipped, shipped_inplace, variant):
    """--target ort: genai_config.json says past_present_share_buffer, genai binds one
    [B, H, max_length, d] buffer as past and present, and its tokens are still transformers'
    (a single prompt, and a right-padded batch that decodes with holes in the mask)."""
    folder = shipped_inplace[variant][1]
    config = json.loads((folder / "genai_config.json").read_text())
    assert config["search"]["past_present_share_buffer"] is True
    assert config["model"]["decoder"]["session_options"]["provider_options"] == []  # not a GPU folder
    _genai_generates_transformers_tokens(shipped[variant][0], folder, variant)
    if shutil.which("node") and (JS / "node_modules" / "@huggingface").is_dir():  # transformers.js grows the cache
        cmd = ["node", str(JS / "generate.mjs"), "causal", str(folder.resolve()), json.dumps(PROMPTS), str(NEW)]
        proc = subprocess.run(cmd, capture_output=True, text=True, timeout=300, cwd=JS)
        assert proc.returncode == 0, proc.stderr[-2000:]
        start = max(len(p) for p in PROMPTS)
        expected = until_eos(transformers_tokens(shipped[variant][0], variant, PROMPTS), start)
        assert until_eos(json.loads(proc.stdout.strip().splitlines()[-1]), start) == expected
    if shutil.which("node") and (JS / "node_modules" / "onnxruntime-web").is_dir():  # the browser's runtime (wasm)
        from posbias_export.clients.checks import web

        tokens, _ = web(variant, folder, PROMPTS[0])
        start = len(PROMPTS[0])
        tokens = tokens[:start + NEW]  # web.mjs makes the clients table's 16 new tokens
        assert until_eos([tokens], start) == until_eos(transformers_tokens(shipped[variant][0], variant, [PROMPTS[0]]), start)


def _genai_generates_transformers_tokens(source: Path, folder: Path, variant: str) -> None:
    og = pytest.importorskip("onnxruntime_genai")
    for prompts in ([PROMPTS[0]], PROMPTS):
        width = max(len(p) for p in prompts)
        model = og.Model(str(folder))
        params = og.GeneratorParams(model)
        params.set_search_options(max_length=width + NEW, do_sample=False, batch_size=len(prompts))
        generator = og.Generator(model, params)
        generator.append_tokens(np.array([p + [PAD] * (width - len(p)) for p in prompts], np.int32))
        while not generator.is_done():
            generator.generate_next_token()
        got = until_eos([list(map(int, generator.get_sequence(row))) for row in range(len(prompts))], width)
        expected = until_eos(right_padded_greedy(source, prompts), width)
        _varied(expected)
        assert got == expected, prompts
        if positions_from_mask(variant):  # positions from the mask: the holes are invisible, each row is its prompt alone
            for prompt, row in zip(prompts, expected):
                alone = until_eos(transformers_tokens(source, variant, [prompt]), len(prompt))[0]
                assert prompt + row[width:] == alone


def _triton_model_config():
    """tritonclient's generated ModelConfig module, loaded by path: its package __init__ would
    import grpc, which the proto itself does not need."""
    spec = importlib.util.find_spec("tritonclient")
    if spec is None:
        pytest.skip("tritonclient is not installed")
    path = Path(spec.submodule_search_locations[0]) / "grpc" / "model_config_pb2.py"
    module_spec = importlib.util.spec_from_file_location("triton_model_config_pb2", path)
    module = importlib.util.module_from_spec(module_spec)
    module_spec.loader.exec_module(module)
    return module


@pytest.mark.parametrize("variant", role_matrix.cases("triton"))
def test_triton_config_parses_and_matches_the_file(shipped, variant):
    from google.protobuf import text_format

    pb = _triton_model_config()
    _, folder = shipped[variant]
    entries = sorted((folder / "triton").iterdir())
    assert len(entries) == (2 if seq2seq(variant) else 1)
    types = {"tensor(float)": pb.TYPE_FP32, "tensor(int64)": pb.TYPE_INT64, "tensor(float16)": pb.TYPE_FP16,
             "tensor(bool)": pb.TYPE_BOOL}
    for entry in entries:
        config = text_format.Parse((entry / "config.pbtxt").read_text(), pb.ModelConfig())
        assert config.name == entry.name and config.platform == "onnxruntime_onnx"
        session = ort.InferenceSession(str(entry / "1" / "model.onnx"), providers=["CPUExecutionProvider"])
        # every input batched: Triton owns the first axis; else (the T5 decoder's use_cache_branch [1]) none
        batched = all(isinstance(v.shape[0], str) for v in session.get_inputs())
        assert batched == (not (seq2seq(variant) and entry.name.endswith("_decoder"))), entry.name
        assert (config.max_batch_size > 0 and config.HasField("dynamic_batching")) if batched else (
            config.max_batch_size == 0 and not config.HasField("dynamic_batching"))
        for declared, values in ((config.input, session.get_inputs()), (config.output, session.get_outputs())):
            assert [d.name for d in declared] == [v.name for v in values]
            for d, v in zip(declared, values):
                assert d.data_type == types[v.type]
                shape = v.shape[1:] if batched else v.shape
                assert list(d.dims) == [s if isinstance(s, int) else -1 for s in shape], v.name



def _op_types(proto: onnx.ModelProto) -> set[str]:
    """Every op type in the graph, its functions and their subgraphs (Loop and If bodies)."""
    found, graphs = set(), [proto.graph, *proto.functions]
    while graphs:
        for node in graphs.pop().node:
            found.add(node.op_type)
            graphs += [a.g for a in node.attribute if a.HasField("g")] + [g for a in node.attribute for g in a.graphs]
    return found


@pytest.mark.parametrize("variant", role_matrix.cases("gpu_folder"))
def test_gpu_target_folder_is_gpu_ready(shipped, tmp_path, variant):
    """--out-dir --target cuda-ort --dtype float16: Triton instances on the GPU (KIND_GPU, parsed
    by Triton's own proto), onnxruntime-genai on the CUDA provider, float16 files that ORT CPU
    (which runs MultiHeadAttention too) loads; the default folder stays on the CPU."""
    from google.protobuf import text_format

    pb = _triton_model_config()
    source, cpu_folder = shipped[variant]
    folder = tmp_path / "gpu"
    ship(source, folder, check_growth=False, target="cuda-ort", dtype="float16")
    for entry, cpu_entry in zip(sorted((folder / "triton").iterdir()), sorted((cpu_folder / "triton").iterdir())):
        config = text_format.Parse((entry / "config.pbtxt").read_text(), pb.ModelConfig())
        assert [g.kind for g in config.instance_group] == [pb.ModelInstanceGroup.KIND_GPU]
        assert pb.TYPE_FP16 in [o.data_type for o in config.output]
        cpu = text_format.Parse((cpu_entry / "config.pbtxt").read_text(), pb.ModelConfig())
        assert [g.kind for g in cpu.instance_group] == [pb.ModelInstanceGroup.KIND_CPU]
        ort.InferenceSession(str(entry / "1" / "model.onnx"), providers=["CPUExecutionProvider"])  # loads
        proto = onnx.load(str(entry / "1" / "model.onnx"))
        assert "MultiHeadAttention" in _op_types(proto)
    if not seq2seq(variant):
        genai = json.loads((folder / "genai_config.json").read_text())["model"]["decoder"]["session_options"]
        assert genai["provider_options"] == [{"cuda": {}}]
        assert json.loads((cpu_folder / "genai_config.json").read_text())["model"]["decoder"]["session_options"][
            "provider_options"] == []


@pytest.mark.parametrize("variant", role_matrix.cases("folder_contents"))
def test_the_folder_holds_what_each_client_looks_for(shipped, variant):
    for source, folder in [shipped[variant]]:
        names = {str(p.relative_to(folder)) for p in folder.rglob("*") if p.is_file()}
        models = ["encoder_model.onnx", "decoder_model_merged.onnx"] if seq2seq(variant) else ["model.onnx"]
        assert {*models, *(f"onnx/{m}" for m in models), "config.json", "generation_config.json", "tokenizer.json",
                "tokenizer_config.json"} <= names
        assert ("genai_config.json" in names) == (not seq2seq(variant))
        for name in models:  # names and axes as the clients expect; where it came from, but not its local path
            session = ort.InferenceSession(str(folder / name), providers=["CPUExecutionProvider"])
            inputs = {i.name: i.shape for i in session.get_inputs()}
            assert inputs["input_ids"] == ["batch_size", "sequence_length"]
            cache = [n for n in inputs if n.startswith("past_key_values.")]
            if name != "encoder_model.onnx":
                part = ".decoder" if seq2seq(variant) else ""
                assert cache[:2] == [f"past_key_values.0{part}.key", f"past_key_values.0{part}.value"]
                assert inputs[cache[0]][0] == "batch_size" and inputs[cache[0]][2] == "past_sequence_length"
            meta = session.get_modelmeta().custom_metadata_map
            assert meta["posbias.model_name"] == source.name and "posbias.model_dir" not in meta
            assert str(source.parent) not in json.dumps(meta)


@pytest.mark.parametrize("variant", role_matrix.cases("generate_text"))
def test_our_generate_takes_and_prints_text(shipped, variant):
    """`python -m posbias_export generate OUT --prompt TEXT`: the folder's tokenizer in and
    out (no transformers needed to serve), the text transformers generates from that text."""
    source, folder = shipped[variant]
    texts = ["To be, or not", "the question"]
    cmd = [sys.executable, "-m", "posbias_export", "generate", str(folder), "--max-new-tokens", str(NEW)]
    for text in texts:
        cmd += ["--prompt", text]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr
    tok = transformers.PreTrainedTokenizerFast(tokenizer_file=str(source / "tokenizer.json"), pad_token="<pad>")
    prompts = [tok(t).input_ids for t in texts]
    side = "right" if seq2seq(variant) else "left"
    expected = [tok.decode(row, skip_special_tokens=True) for row in transformers_tokens(source, variant, prompts, side)]
    assert proc.stdout.splitlines() == expected


def test_our_runners_read_the_clients_names(shipped):
    """generate's CachedDecoder finds the cache by Hugging Face's names as by ours."""
    gen = load_runner("ort/generate.py")
    source, folder = shipped["bloom"]
    decoder = gen.CachedDecoder(str(folder / "model.onnx"))
    assert decoder.past_names[:2] == ["past_key_values.0.key", "past_key_values.0.value"]
    tokens = gen.generate(decoder, PROMPTS, NEW, eos_ids=(EOS,), pad_id=PAD)
    expected = transformers_tokens(source, "bloom", PROMPTS)
    width = max(len(p) for p in PROMPTS)
    assert tokens == [e[width:] for e in expected]


def test_out_dir_refusals_are_one_line_and_touch_nothing(shipped, tmp_path):
    source, folder = shipped["bloom"]
    before = sorted(p.name for p in folder.iterdir())
    taken = tmp_path / "taken"
    taken.mkdir()
    (taken / "keep.txt").write_text("mine")
    cases = [
        (["--model", str(source), "--out-dir", str(taken)], "exists and is not an empty folder"),
        (["--model", str(source), "--out-dir", str(source / "serve")], "overlaps the model folder"),
        (["--model", str(source), "--out-dir", str(tmp_path / "new"), "--out", str(tmp_path / "m.onnx")], "give --out"),
        (["--bias", "alibi", "--out-dir", str(tmp_path / "new")], "needs --model DIR"),
        (["--model", str(source), "--out-dir", str(tmp_path / "new"), "--kv-cache"], "drop --kv-cache"),
    ]
    for argv, message in cases:
        proc = subprocess.run([sys.executable, "-m", "posbias_export", *argv], capture_output=True, text=True,
                              timeout=300)
        lines = proc.stderr.strip().splitlines()
        assert proc.returncode == 2 and len(lines) == 1 and message in lines[0], (argv, proc.stderr)
    assert (taken / "keep.txt").read_text() == "mine" and sorted(p.name for p in taken.iterdir()) == ["keep.txt"]
    assert not (source / "serve").exists() and not (tmp_path / "new").exists()
    assert sorted(p.name for p in folder.iterdir()) == before


@pytest.mark.parametrize("variant", role_matrix.cases("validate_shipped"))
def test_validate_judges_the_shipped_decoder(shipped, variant, tmp_path):
    """validate FILE --model DIR on a cached decoder (Hugging Face names): the folder's default
    in-place file on every runtime that runs it (ONNX Runtime bound to one buffer and not, Node);
    the --target portable folder on OpenVINO and the reference evaluator too. An empty cache is a
    prefill, which every runner accepts (only the past axis may be 0; OpenVINO keeps no axis
    names, so its runner reads them from the file)."""
    from posbias_export.hf.validate import run_hf_matrix

    source, folder = shipped[variant]
    matrix = run_hf_matrix(folder / "model.onnx", source, ("ort-cpu", "ort-cpu-shared", "node"), (1, 17))
    assert matrix.ok, [(c.runtime, c.case, c.verdict) for c in matrix.cells if not c.ok]
    ship(source, tmp_path / "portable", check_growth=False, target="portable")
    matrix = run_hf_matrix(tmp_path / "portable" / "model.onnx", source, ("ort-cpu", "openvino", "reference", "node"),
                           (1, 17))
    assert matrix.ok, [(c.runtime, c.case, c.verdict) for c in matrix.cells if not c.ok]


def _js_tokens(folder: Path, prompts: list[list[int]]) -> list[list[int]]:
    cmd = ["node", str(JS / "generate.mjs"), "causal", str(folder.resolve()), json.dumps(prompts), str(NEW)]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=300, cwd=JS)
    assert proc.returncode == 0, proc.stderr[-2000:]
    return json.loads(proc.stdout.strip().splitlines()[-1])


def _genai_tokens(folder: Path, prompt: list[int]) -> list[int]:
    og = pytest.importorskip("onnxruntime_genai")
    model = og.Model(str(folder))
    params = og.GeneratorParams(model)
    params.set_search_options(max_length=len(prompt) + NEW, do_sample=False, batch_size=1)
    generator = og.Generator(model, params)
    generator.append_tokens(np.array([prompt], np.int32))
    while not generator.is_done():
        generator.generate_next_token()
    return list(map(int, generator.get_sequence(0)))


def _stepwise_greedy(model_path: Path, tokens: list[int], start: int) -> list[int]:
    """Our runner's greedy continuation of tokens[:start], one cached step per token, as the
    clients run it: the reference for int8 files, whose rounding of activations to 8 bits can turn
    the float32 difference between a full forward over every position and one-token steps into a
    whole quantization step (measured with per-call scales: a full-forward choice 0.01 logits from
    a tie flipped)."""
    decoder = load_runner("ort/generate.py").CachedDecoder(str(model_path))
    ids = np.array([tokens[:start]])
    mask = np.ones_like(ids)
    logits, past = decoder.step(ids, mask, decoder.empty_past(1))
    out = list(tokens[:start])
    while len(out) < len(tokens):
        out.append(int(logits[0, -1].argmax()))
        mask = np.ones((1, len(out)), np.int64)
        logits, past = decoder.step(np.array([[out[-1]]]), mask, past)
    return out


def _greedy_consistent(model_path: Path, tokens: list[int], start: int) -> list[tuple[int, float]]:
    """Positions where `tokens` is not the greedy choice of the file's own full forward (ONNX
    Runtime, every position at once), with the logit gap: empty when the sequence is greedy."""
    decoder = load_runner("ort/generate.py").CachedDecoder(str(model_path))
    ids = np.array([tokens])
    logits, _ = decoder.step(ids, np.ones_like(ids), decoder.empty_past(1))
    return [(t, float(logits[0, t - 1].max() - logits[0, t - 1, tokens[t]])) for t in range(start, len(tokens))
            if logits[0, t - 1].argmax() != tokens[t]]


@pytest.mark.skipif(shutil.which("node") is None or not (JS / "node_modules" / "@huggingface").is_dir(),
                    reason="transformers.js not installed (cd posbias_export/clients/js && npm install --ignore-scripts)")
@pytest.mark.parametrize("scheme", ["int8", "int4"])
def test_quantized_folder_runs_in_the_clients(shipped, tmp_path, scheme):
    """--out-dir --quantize: transformers.js (onnxruntime-node), onnxruntime-web and
    onnxruntime-genai run the quantized ops (MatMulInteger / DynamicQuantizeLinear; MatMulNBits,
    GatherBlockQuantized), generate the same tokens, and those are the greedy choices of the file's own full forward
    (int8: of our runner's cached steps, see _stepwise_greedy).
    (Against the float folder's tokens a quantized file may flip a choice: this tiny model's
    int8 file follows the float one for 8 of 12 tokens; the policy in validate judges how far.)"""
    from posbias_export.export.quantize.schemes import scheme as quant_scheme

    source, _ = shipped["bloom"]
    folder = tmp_path / scheme
    ship(source, folder, check_growth=False, quantize=quant_scheme(scheme))
    prompt = INT8_PROMPT if scheme == "int8" else PROMPTS[0]
    start = len(prompt)
    js = until_eos(_js_tokens(folder, [prompt]), start)[0]
    _varied([js])
    assert until_eos([_genai_tokens(folder, prompt)], start)[0] == js
    if scheme == "int8":
        assert _stepwise_greedy(folder / "model.onnx", js, start) == js
    else:
        assert _greedy_consistent(folder / "model.onnx", js, start) == []
    if (JS / "node_modules" / "onnxruntime-web").is_dir():
        # onnxruntime-web's MatMulNBits computes with float activations whatever accuracy_level says
        # (ONNX Runtime's CPU kernel at our default level 4 quantizes them to int8 per block), so an
        # int4 file is judged at level 0, where both compute the same thing
        if scheme == "int4":
            folder = tmp_path / "int4-level0"
            ship(source, folder, check_growth=False, quantize=quant_scheme(scheme, accuracy_level=0))
        web = until_eos([_web_tokens(folder, prompt)], start)[0]
        if scheme == "int8":
            assert _stepwise_greedy(folder / "model.onnx", web, start) == web
        else:
            assert _greedy_consistent(folder / "model.onnx", web, start) == []


def test_each_folder_says_how_its_clients_set_the_denormal_flag(shipped, tmp_path):
    """SERVING.md names each client of the folder's role and its knob for
    session.set_denormal_as_zero; genai_config.json sets it, and the two knobs we claim pass
    through really reach ONNX Runtime: a dotted key in genai's session_options, and
    transformers.js's session_options.extra.session (a key ONNX Runtime acts on at load, ORT
    format on an ONNX file, then fails the load)."""
    from posbias_export.hf.cpu_notes import CLIENTS, FLAG

    for variant in DEFAULT_VARIANTS:
        folder = shipped[variant][1]
        notes = (folder / "SERVING.md").read_text()
        role = "seq2seq" if seq2seq(variant) else "lm"
        assert all((client in notes) == (role in roles) for client, (roles, _) in CLIENTS.items()), variant
        # a causal LM's default file is in place: GroupQueryAttention's softmax is unfloored, and the notes say so
        assert ("fused op" in notes) == (role == "lm") and ("no subnormal" in notes), variant
        if not seq2seq(variant):
            options = json.loads((folder / "genai_config.json").read_text())["model"]["decoder"]["session_options"]
            assert options[FLAG] == "1"
    og = pytest.importorskip("onnxruntime_genai")
    bloom = shipped["bloom"][1]
    og.Model(str(bloom))  # the shipped config, the flag in it, loads
    probe = tmp_path / "probe"
    shutil.copytree(bloom, probe)
    config = json.loads((probe / "genai_config.json").read_text())
    config["model"]["decoder"]["session_options"]["session.load_model_format"] = "ORT"
    (probe / "genai_config.json").write_text(json.dumps(config))
    with pytest.raises(Exception, match="ORT model"):
        og.Model(str(probe))
    if shutil.which("node") is None or not (JS / "node_modules" / "@huggingface").is_dir():
        return
    results = {}
    for key, value in (("set_denormal_as_zero", "1"), ("load_model_format", "ORT")):
        proc = subprocess.run(["node", str(JS / "session_entry.mjs"), str(bloom.resolve()), key, value],
                              capture_output=True, text=True, timeout=300, cwd=JS)
        assert proc.returncode == 0, proc.stderr[-2000:]
        results[key] = json.loads(proc.stdout.strip().splitlines()[-1])
    assert results["set_denormal_as_zero"]["loaded"], results
    assert not results["load_model_format"]["loaded"] and "ORT model" in results["load_model_format"]["error"], results
