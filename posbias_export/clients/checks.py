"""benchmarks/clients.md: the serving folders `--model DIR --out-dir OUT` writes, loaded by the
clients people already run, against transformers: our generate (ONNX Runtime), transformers.js
in Node, onnxruntime-web (the WebAssembly build a page loads), onnxruntime-genai, and Optimum (in
its own environment: it pins an older transformers) on our folder and on Optimum's own export of
the same model. Per client, model and prompt (short, and 1024 tokens): whether the greedy tokens
equal transformers' generate, and the largest difference of the prefill logits from transformers'
(float32 both). The same clients on the `--quantize int8|int4` folders of each decoder-only model,
judged against ONNX Runtime running that same file (the quantized ops are the client's to run),
with how many of the tokens equal the float folder's.

Models: random-weight transformers models of hidden 64, 4 heads, 2 layers, vocabulary 1000,
untied heads (a tied tiny head mostly repeats its last token), made here.
"""
from __future__ import annotations

import json
import re
import shutil
import subprocess
import tempfile
from pathlib import Path

import numpy as np
import torch

from ..environment import describe, environment, without_local_paths
from ..runners import runtimes_common
from ..export.quantize.schemes import SCHEMES as ALL_SCHEMES
from ..export.files import output_folder, write_text_atomic
from ..hf.models import ARCHITECTURES, PARTS  # registered once the architectures are imported
from ..hf.tiny import EOS, PAD, Sizes, save_tiny_folder
from ..parity import load_runner
from ..parity.tokens import agreeing, same_tokens, until_stop

COMMAND = "python -m posbias_export bench-clients"
JS = Path(__file__).with_name("js")  # the Node clients (package data); `npm install` there once
OPTIMUM = Path(__file__).with_name("optimum_env.sh")  # package data: runs from an installed package
VOCAB, HIDDEN, HEADS, LAYERS = 1000, 64, 4, 2

PROMPTS = {"short": 10, "long": 1024}
NEW_TOKENS = 16
CLIENTS = ("posbias generate (ORT)", "transformers.js", "onnxruntime-web (wasm)", "onnxruntime-genai",
           "Optimum, this folder", "Optimum, its own export")
SCHEMES = tuple(ALL_SCHEMES)
QUANTIZED_CLIENTS = ("transformers.js", "onnxruntime-web (wasm)", "onnxruntime-genai", "Optimum, this folder")


def seq2seq(model_type: str) -> bool:
    """An architecture with a decoder part (T5, UMT5): its client folder is the encoder-decoder pair."""
    return (model_type, "decoder") in PARTS


# the architectures whose folders the text-generation clients load: a causal LM, or a seq2seq pair
# (an encoder alone, an embedder, has its own clients: tests/test_embedders.py, bench-embed)
SUPPORTED = tuple(k for k, cls in ARCHITECTURES.items() if cls.arch == "lm" or seq2seq(k))


def make_folder(model_type: str, folder: Path) -> Path:
    """The client folder of an architecture (its tiny variant of the same name; a T5: the whole
    encoder-decoder), weights + 0.5 noise."""
    extra = {"encoder_decoder": True} if seq2seq(model_type) else {}
    return save_tiny_folder(model_type, folder, Sizes(VOCAB, HIDDEN, HEADS, LAYERS, 2048), noise=0.5, client=True, **extra)


def reference(model_type: str, source: Path, prompt: list[int]) -> tuple[list[int], np.ndarray]:
    """transformers' greedy tokens and prefill logits ([L, V]; T5: the decoder's first step)."""
    import transformers as tf

    cls = tf.AutoModelForSeq2SeqLM if seq2seq(model_type) else tf.AutoModelForCausalLM
    model = cls.from_pretrained(str(source)).eval()
    ids = torch.tensor([prompt])
    with torch.no_grad():
        tokens = model.generate(input_ids=ids, attention_mask=torch.ones_like(ids), max_new_tokens=NEW_TOKENS,
                                do_sample=False, pad_token_id=PAD)[0].tolist()
        extra = {"decoder_input_ids": torch.tensor([[PAD]])} if seq2seq(model_type) else {}
        logits = model(input_ids=ids, attention_mask=torch.ones_like(ids), **extra).logits[0].double().numpy()
    return tokens, logits


def ours(model_type: str, folder: Path, prompt: list[int]) -> tuple[list[int], np.ndarray]:
    ids = np.array([prompt], np.int64)
    if seq2seq(model_type):
        import onnxruntime as ort

        tokens = load_runner("ort/seq2seq.py").greedy_generate(
            str(folder / "encoder_model.onnx"), str(folder / "decoder_model_merged.onnx"), ids, np.ones_like(ids),
            NEW_TOKENS, PAD, eos_ids=(EOS,))[0].tolist()
        enc = ort.InferenceSession(str(folder / "encoder_model.onnx"), providers=["CPUExecutionProvider"])
        dec = ort.InferenceSession(str(folder / "decoder_model_merged.onnx"), providers=["CPUExecutionProvider"])
        states = enc.run(None, {"input_ids": ids, "attention_mask": np.ones_like(ids)})[0]
        past = {i.name: np.zeros((1, i.shape[1], 0, i.shape[3]), np.float32) for i in dec.get_inputs()
                if runtimes_common("cache").is_cache_input(i.name)}  # empty caches, the file's heads and head size
        merged = any(i.name == "use_cache_branch" for i in dec.get_inputs())
        first = {"use_cache_branch": np.array([False])} if merged else {}  # the merged decoder's first step
        logits = dec.run(None, {"input_ids": np.array([[PAD]]), "encoder_hidden_states": states,
                                "encoder_attention_mask": np.ones_like(ids), **past, **first})[0][0]
        return [PAD, *tokens], logits
    gen = load_runner("ort/generate.py")
    decoder = gen.CachedDecoder(str(folder / "model.onnx"))
    logits, _ = decoder.step(ids, np.ones_like(ids), decoder.empty_past(1))
    return prompt + gen.generate(decoder, [prompt], NEW_TOKENS, eos_ids=(EOS,), pad_id=PAD)[0], logits[0]


def node_error(stderr: str) -> str:
    """The message of Node's uncaught error ("Error: ..."), not the source line it quotes above it."""
    lines = [line.strip() for line in stderr.splitlines()]
    message = next((line for line in lines if re.match(r"^\w*Error\b.*:", line)), None)
    return message or next((line for line in lines if "Error" in line), "node failed")


def transformers_js(model_type: str, folder: Path, prompt: list[int], tmp: Path) -> tuple[list[int], np.ndarray]:
    if shutil.which("node") is None or not (JS / "node_modules" / "@huggingface").is_dir():
        raise RuntimeError(f"not installed (cd {JS} && npm install --ignore-scripts)")
    mode = "seq2seq" if seq2seq(model_type) else "causal"

    def node(script, *args):
        proc = subprocess.run(["node", str(JS / script), mode, str(folder.resolve()), *args], capture_output=True,
                              text=True, timeout=900, cwd=JS)
        if proc.returncode:
            raise RuntimeError(node_error(proc.stderr))
        return proc.stdout.strip().splitlines()[-1]

    tokens = json.loads(node("generate.mjs", json.dumps([prompt]), str(NEW_TOKENS)))[0]
    dims = json.loads(node("logits.mjs", json.dumps(prompt), str(tmp / "logits.bin")))
    return tokens, np.fromfile(tmp / "logits.bin", np.float32).reshape(dims)[0]


def web(model_type: str, folder: Path, prompt: list[int]) -> tuple[list[int], np.ndarray]:
    if seq2seq(model_type):
        raise RuntimeError("not measured: the page script (js/web.mjs) drives decoder-only folders")
    if shutil.which("node") is None or not (JS / "node_modules" / "onnxruntime-web").is_dir():
        raise RuntimeError(f"not installed (cd {JS} && npm install --ignore-scripts)")
    proc = subprocess.run(["node", str(JS / "web.mjs"), str(folder.resolve()), json.dumps(prompt), str(NEW_TOKENS),
                           str(EOS)], capture_output=True, text=True, timeout=1800, cwd=JS)
    if proc.returncode:
        raise RuntimeError(node_error(proc.stderr))
    out = json.loads(proc.stdout.strip().splitlines()[-1])
    return out["tokens"], np.asarray(out["logits"], np.float32)[None]


def genai(model_type: str, folder: Path, prompt: list[int]) -> tuple[list[int], np.ndarray]:
    if seq2seq(model_type):
        raise RuntimeError("not applicable: onnxruntime-genai has no T5 (encoder-decoder) model type")
    import onnxruntime_genai as og

    model = og.Model(str(folder))
    params = og.GeneratorParams(model)
    params.set_search_options(max_length=len(prompt) + NEW_TOKENS, do_sample=False)
    generator = og.Generator(model, params)
    generator.append_tokens(np.array([prompt], np.int32))
    last = np.asarray(generator.get_logits()).reshape(-1)  # the prompt's last position only: [V]
    while not generator.is_done():
        generator.generate_next_token()
    return list(map(int, generator.get_sequence(0))), last[None]


def judge(tokens: list[int], logits: np.ndarray, ref_tokens: list[int], ref_logits: np.ndarray, start: int) -> dict:
    """logits may cover the prompt's last position only (genai): compared with that row."""
    ref = ref_logits[-len(logits):] if logits.shape[0] < ref_logits.shape[0] else ref_logits
    return {"tokens_equal": same_tokens(tokens, ref_tokens, start, (EOS,)),
            "logit_error": float(np.abs(logits.astype(np.float64) - ref).max())}


def run(model_types=SUPPORTED, optimum: bool = True, progress=None) -> list[dict]:
    from ..hf.ship import ship

    rows = []
    with tempfile.TemporaryDirectory(prefix="posbias-clients-") as tmp:
        tmp = Path(tmp)
        cases = []
        for model_type in model_types:
            source = make_folder(model_type, tmp / model_type)
            shipped = tmp / f"{model_type}_out"
            ship(source, shipped, check_growth=False)
            for label, length in PROMPTS.items():
                prompt = np.random.default_rng(length).integers(3, VOCAB, length).tolist()
                ref_tokens, ref_logits = reference(model_type, source, prompt)
                np.save(tmp / f"{model_type}_{label}.npy", ref_logits)
                start = 1 if seq2seq(model_type) else length
                rows += _client_rows(model_type, shipped, prompt, label, ref_tokens, ref_logits, tmp,
                                     ("posbias generate (ORT)", "transformers.js", "onnxruntime-web (wasm)",
                                      "onnxruntime-genai"))
                cases.append({"id": f"{model_type}/{label}", "model_type": model_type, "seq2seq": seq2seq(model_type), "source": str(source), "shipped": str(shipped),
                              "prompt": prompt, "new": NEW_TOKENS, "pad": PAD, "start": PAD,
                              "reference_logits": str(tmp / f"{model_type}_{label}.npy"), "reference_tokens": ref_tokens})
                if not seq2seq(model_type):
                    float_tokens = ours(model_type, shipped, prompt)[0]
                    for scheme in SCHEMES:
                        rows_q, case = _quantized(model_type, source, tmp, scheme, prompt, label, float_tokens)
                        rows += rows_q
                        cases.append(case)
            if progress:
                progress(1)
        rows += run_optimum(cases, tmp) if optimum else []
    return rows


def _client_rows(model_type, folder, prompt, label, ref_tokens, ref_logits, tmp, clients, scheme=None) -> list[dict]:
    calls = {"posbias generate (ORT)": lambda: ours(model_type, folder, prompt),
             "transformers.js": lambda: transformers_js(model_type, folder, prompt, tmp),
             "onnxruntime-web (wasm)": lambda: web(model_type, folder, prompt),
             "onnxruntime-genai": lambda: genai(model_type, folder, prompt)}
    start = 1 if seq2seq(model_type) else len(prompt)
    rows = []
    for client in clients:
        row = {"client": client, "model": model_type, "prompt": label, **({"scheme": scheme} if scheme else {})}
        try:
            row.update(judge(*calls[client](), ref_tokens, ref_logits, start))
        except Exception as err:  # noqa: BLE001 - a client that fails or does not apply is a result
            row["error"] = str(err).splitlines()[0][:200] if str(err) else type(err).__name__
        rows.append(row)
    return rows


def _quantized(model_type, source, tmp, scheme, prompt, label, float_tokens) -> tuple[list[dict], dict]:
    """The clients on the `--quantize SCHEME` folder, judged against ONNX Runtime on that file; and
    how many new tokens ONNX Runtime's greedy run on it shares with the float folder's."""
    from ..export.quantize.schemes import scheme as quant_scheme
    from ..hf.ship import ship

    folder = tmp / f"{model_type}_{scheme}"
    if not folder.is_dir():
        ship(source, folder, check_growth=False, quantize=quant_scheme(scheme))
    ref_tokens, ref_logits = ours(model_type, folder, prompt)
    np.save(tmp / f"{model_type}_{scheme}_{label}.npy", ref_logits)
    start = len(prompt)
    shared = agreeing(ref_tokens, float_tokens, start, (EOS,))
    float_new = until_stop(float_tokens, start, (EOS,))[start:]
    rows = [{"client": "ORT: tokens shared with the float folder", "model": model_type, "prompt": label, "scheme": scheme,
             "shared": shared, "of": len(float_new)}]
    rows += _client_rows(model_type, folder, prompt, label, ref_tokens, ref_logits, tmp, QUANTIZED_CLIENTS[:-1], scheme)
    case = {"id": f"{model_type}-{scheme}/{label}", "model_type": model_type, "seq2seq": seq2seq(model_type), "source": str(source), "shipped": str(folder),
            "prompt": prompt, "new": NEW_TOKENS, "pad": PAD, "start": PAD, "own_export": False,
            "reference_logits": str(tmp / f"{model_type}_{scheme}_{label}.npy"), "reference_tokens": ref_tokens}
    return rows, case


def run_optimum(cases: list[dict], tmp: Path) -> list[dict]:
    """Optimum in its side environment (clients/optimum_env.sh), on our folders and on its own
    export of the same source folders."""
    (tmp / "cases.json").write_text(json.dumps(cases))
    proc = subprocess.run(["bash", str(OPTIMUM), str(tmp / "cases.json")], capture_output=True, text=True, timeout=7200)
    results = {r["case"]: r for r in (json.loads(l) for l in proc.stdout.splitlines() if l.startswith("{"))}
    why = (proc.stderr.strip().splitlines() or [f"exit {proc.returncode}"])[-1][:200]
    rows = []
    for case in cases:
        model_type, label = case["model_type"], case["id"].split("/")[1]
        scheme = case["id"].split("/")[0].partition("-")[2]
        start = 1 if seq2seq(model_type) else len(case["prompt"])
        result = results.get(case["id"], {})
        which = (("Optimum, this folder", "ours"),) + (() if scheme else (("Optimum, its own export", "optimum"),))
        for client, key in which:
            row = {"client": client, "model": model_type, "prompt": label, "environment": result.get("transformers"),
                   **({"scheme": scheme} if scheme else {})}
            measured = result.get(key, {"error": f"the Optimum environment failed: {why}"})
            if "error" in measured:
                row["error"] = measured["error"]
            else:
                row["tokens_equal"] = same_tokens(measured["tokens"], case["reference_tokens"], start, (EOS,))
                row["logit_error"] = measured["logit_error"]
            rows.append(row)
    return rows


def client_versions() -> dict:
    import transformers

    versions = {"transformers": transformers.__version__}
    try:
        import onnxruntime_genai

        versions["onnxruntime_genai"] = onnxruntime_genai.__version__
    except ImportError:
        versions["onnxruntime_genai"] = None
    package = JS / "node_modules" / "@huggingface" / "transformers" / "package.json"
    versions["transformers_js"] = json.loads(package.read_text())["version"] if package.is_file() else None
    web_package = JS / "node_modules" / "onnxruntime-web" / "package.json"
    versions["onnxruntime_web"] = json.loads(web_package.read_text())["version"] if web_package.is_file() else None
    return versions


def _cell(row: dict | None) -> str:
    if row is None:
        return "-"
    if "shared" in row:
        return f"{row['shared']}/{row['of']}"
    if "error" in row:
        return row["error"].replace("|", "/")
    return f"{'equal' if row['tokens_equal'] else 'DIFFER'}, {row['logit_error']:.1e}"


def markdown(rows: list[dict], env: dict) -> str:
    optimum_env = next((r["environment"] for r in rows if r.get("environment")), None)
    lines = ["# Clients: the serving folder in the tools people run", "", f"Generated by `{COMMAND}`.", "",
             describe(env), f"Clients: transformers {env['transformers']}, transformers.js {env['transformers_js']}, "
             f"onnxruntime-web {env.get('onnxruntime_web')}, onnxruntime-genai {env['onnxruntime_genai']}, Optimum's environment: transformers {optimum_env}.", "",
             "Each model's folder is written by `python -m posbias_export --model DIR --out-dir OUT` and loaded "
             "unchanged. A cell: whether the greedy tokens (16 new, up to the end-of-sequence token) equal "
             "transformers' generate, and the largest |logit - transformers' logit| of the prefill (every prompt "
             f"position; onnxruntime-genai exposes the last one). Prompts: {PROMPTS['short']} and {PROMPTS['long']} "
             "tokens. Optimum runs in its own environment (it pins transformers < 4.58).", ""]
    model_types = list(dict.fromkeys(r["model"] for r in rows))
    for label in PROMPTS:
        lines += [f"## {label} prompt ({PROMPTS[label]} tokens)", "", "| client | " + " | ".join(model_types) + " |",
                  "|---|" + "---|" * len(model_types)]
        for client in CLIENTS:
            cells = [_cell(next((r for r in rows if (r["client"], r["model"], r["prompt"]) == (client, k, label)
                                 and "scheme" not in r), None)) for k in model_types]
            lines.append(f"| {client} | " + " | ".join(cells) + " |")
        lines.append("")
    return "\n".join(lines + _quantized_markdown(rows))


def _quantized_markdown(rows: list[dict]) -> list[str]:
    quantized = [r for r in rows if "scheme" in r]
    if not quantized:
        return []
    columns = list(dict.fromkeys((r["model"], r["scheme"]) for r in quantized))
    lines = ["## quantized folders (`--out-dir OUT --quantize int8|int4`)", "",
             "A cell: whether the client's greedy tokens equal ONNX Runtime's on the same quantized file, and the "
             "largest |logit - ONNX Runtime's logit| of the prefill: the quantized ops (int8: MatMulInteger, "
             "its activations quantized per row in standard ops; int4: MatMulNBits and GatherBlockQuantized) are each client's to run. The first row: "
             "how many new tokens ONNX Runtime's greedy run on the quantized file shares with the float folder's "
             "before the first that differs (a flip is quantization's doing, judged by validate's policy; these "
             "random-weight models, weights of spread 0.5, are harder on 4 bits than trained ones). onnxruntime-web's "
             "MatMulNBits computes with float activations whatever the file's accuracy_level (ONNX Runtime's CPU kernel "
             "at our default level 4 quantizes them to int8 per block): its int4 logits differ by that, and on a "
             "level-0 file it agrees with ONNX Runtime (tests/test_clients.py).", ""]
    for label in PROMPTS:
        lines += [f"### {label} prompt ({PROMPTS[label]} tokens)", "",
                  "| client | " + " | ".join(f"{m} {s}" for m, s in columns) + " |", "|---|" + "---|" * len(columns)]
        for client in ("ORT: tokens shared with the float folder", *QUANTIZED_CLIENTS):
            cells = [_cell(next((r for r in quantized if (r["client"], r["model"], r["scheme"], r["prompt"])
                                 == (client, m, s, label)), None)) for m, s in columns]
            lines.append(f"| {client} | " + " | ".join(cells) + " |")
        lines.append("")
    return lines


def run_and_write(model_types=SUPPORTED, out_dir="benchmarks", optimum: bool = True, progress=None) -> list[Path]:
    unknown = [k for k in model_types if k not in SUPPORTED]
    if unknown:  # names first: a refused run makes no folder
        embedders = [k for k in unknown if k in ARCHITECTURES]
        if embedders:
            raise ValueError(f"{embedders[0]} is an encoder (an embedder): its clients (fastembed, sentence-transformers, "
                             "transformers.js feature-extraction, Triton) are checked by tests/test_embedders.py and "
                             f"timed by bench-embed; bench-clients takes {', '.join(SUPPORTED)}")
        raise ValueError(f"unknown model(s) {', '.join(unknown)}; choose from {', '.join(SUPPORTED)}")
    out = output_folder(out_dir)
    rows = [without_local_paths(r) for r in run(model_types, optimum, progress)]
    env = {**environment(), **client_versions()}
    md, js = out / "clients.md", out / "clients.json"
    write_text_atomic(md, markdown(rows, env))
    write_text_atomic(js, json.dumps({"environment": env, "rows": rows}, indent=1))
    return [md, js]

