"""Serving at length (`python -m posbias_export bench-serving`): the in-place cache (--kv-cache
--target ort, one buffer written where it lies) against the Concat file (the whole cache copied
every step), and in float32 against Optimum's own export (run by the same ONNX Runtime loop) and
transformers eager, on a published configuration with random weights, float32 and int4, after
prompts of several lengths. Each file is exported and each run made in its own process (peak RSS its
own); a run is a prefill, then greedy steps whose median, after the first two (a session's first
steps allocate), is the decode time. The floor a step cannot beat on this machine: the bytes it
must read, weights plus the cache at that length, over the read bandwidth measured in the same
run (copy bandwidth, in earlier runs, overestimated it). Beside each decode time, the step's CPU
time on its calling thread (`--threads 1`: the work itself, without a loaded machine's waits).
Our files are written with --external-data (ONNX Runtime maps the tensors and drops what it
prepacks) and run as `generate` runs them (prepacking off for float weights; subnormals flushed by
session.set_denormal_as_zero since 2026-11-28, which our files no longer need: docs/cpu-kinds.md).
Each run names the CPU it ran on.

llama.cpp (when `llama_cpp` is importable and LLAMA_CPP_CONVERTER names its converter; skipped
with the reason otherwise) is the CPU engine people pick instead of us: its GGUF made from the
same folder by its own converter (f32, Q8_0; Q4_0 by its quantizer), run by llama-cpp-python
through the same greedy loop, with its file size and the process's peak RSS.
"""
from __future__ import annotations

import shutil
from dataclasses import asdict, dataclass, field
from pathlib import Path

from ..environment import cpu_model, read_bandwidth_gbs
from ..export.files import check_work_folder, scratch, work_folder
from .harness import failure, kept_rows, measured_python, targets_section, write_results
from ..hf.published import PUBLISHED, check_published_folder, published_folder
from .real_models import SEQ2SEQ, folder_bytes, folder_weight_bytes, weight_bytes, worker_run

FILES = {"concat": ["--target", "portable"], "in place": ["--target", "ort"],
         "in place, float16 cache": ["--target", "ort", "--kv-dtype", "float16"],
         "in place, int8 cache": ["--target", "ort", "--kv-dtype", "int8"]}
OPTIMUM, EAGER = "Optimum's file", "transformers eager"  # what people run today, beside ours (float32 only)
LLAMA_CPP = "llama.cpp"  # float32, int8, int4: f32, Q8_0, Q4_0 (peers/llama_cpp_runs.GGUF_TYPES)
KINDS = (*FILES, OPTIMUM, EAGER, LLAMA_CPP)
KIND_NAMES = dict(zip(("concat", "inplace", "half", "int8", "optimum", "eager", "llama.cpp"), KINDS))  # --files
SCHEMES = {"float32": [], "float16": ["--dtype", "float16"], "int8": ["--quantize", "int8"],
           "int4": ["--quantize", "int4"], "int4-b64": ["--quantize", "int4", "--quant-block", "64"]}
# llama.cpp's file of the same bits per weight: our int4 blocks of 32 carry a float32 scale and a
# 4-bit zero point (5.125 bits a weight), Q4_0's a float16 scale (4.5); blocks of 64 take 4.56
SAME_BITS = {"int4-b64": "int4"}
CONTEXTS = (512, 4096)
WARM_STEPS = 2  # a new session's first steps allocate: not the steady state a server lives in
# targets (issue 47): in-place int4 at 4096 <= 0.6x the Concat file and <= 1.3x its floor; float32 <= 1.2x
TARGET_CONTEXT = 4096
LONG_CONTEXT = 16384


@dataclass
class ServingRow:
    name: str  # published configuration
    exports: list[dict] = field(default_factory=list)  # scheme, file, seconds, peak_gb, file_gb
    runs: list[dict] = field(default_factory=list)  # scheme, file, context, prefill_s, peak_gb, decode_ms, floor_ms
    bandwidth_gbs: float = 0.0
    command: str = ""


def cache_bytes_per_token(path: Path) -> int:
    """A token's keys and values over every layer (export/pipeline.py reads them off the past inputs)."""
    import onnx

    from ..export.pipeline import cache_bytes_per_token as per_token

    return per_token(onnx.load(str(path), load_external_data=False))


def float_cache_bytes_per_token(folder: Path) -> int:
    """A float32 token's keys and values over every layer, from the folder's config (BLOOM, MPT
    and Falcon-RW: as many key/value heads as query heads)."""
    import transformers as tf

    config = tf.AutoConfig.from_pretrained(str(folder))
    return 2 * config.num_hidden_layers * config.hidden_size * 4


def _timed_runs(row: ServingRow, scheme: str, label: str, argv: list[str], weights: float, per_token: int, contexts,
                new_tokens: int, threads: int, progress) -> None:
    """A bench.real_models worker (argv: its kind and target) at each prompt length -> row.runs."""
    for context in contexts:
        progress(f"{row.name}: {scheme}, {label}, prompt {context} + {new_tokens} steps")
        try:
            got = worker_run(*argv, context, new_tokens + WARM_STEPS, threads, warm=WARM_STEPS)
        except RuntimeError as err:  # a client that cannot serve this prompt: a row saying why, the rest still run
            row.runs.append({"scheme": scheme, "file": label, "context": context, "error": failure(err)})
            continue
        row.runs.append({"scheme": scheme, "file": label, "context": context, "prefill_s": got["prefill_s"],
                         "prefill_peak_gb": got["prefill_peak_gb"], "peak_gb": got["peak_gb"], "decode_ms": got["decode_ms"],
                         "decode_cpu_ms": got.get("decode_cpu_ms"), "file_gb": weights / 1e9, "threads": threads,
                         "floor_ms": 1e3 * (weights + per_token * context) / 1e9 / row.bandwidth_gbs,
                         "tokens": got["tokens"]})


def _optimum(row: ServingRow, folder: Path, files: Path, contexts, new_tokens: int, threads: int, progress) -> None:
    """Optimum's own export of the folder (its side environment, if made) run by the same worker."""
    from .real_models import optimum_cli

    cli = optimum_cli()
    if cli is None:
        progress(f"{row.name}: no Optimum environment (posbias_export/clients/optimum_env.sh): its rows skipped")
        return
    out = files / f"{row.name}_optimum"
    progress(f"{row.name}: export float32, {OPTIMUM}")
    seconds, peak, _ = measured_python(["export", "onnx", "--model", str(folder), "--task", "text-generation-with-past",
                                        str(out)], program=str(cli))
    size = folder_bytes(out)
    row.exports.append({"scheme": "float32", "file": OPTIMUM, "seconds": seconds, "peak_gb": peak, "file_gb": size / 1e9})
    # its floor: the model's float32 weights, as ours (it may store a tied embedding twice, but a
    # step gathers only one row of the copy that is not the head)
    _timed_runs(row, "float32", OPTIMUM, ["ort", str(out / "model.onnx")], folder_weight_bytes(folder),
                float_cache_bytes_per_token(folder), contexts, new_tokens, threads, progress)
    shutil.rmtree(out)


def _llama_cpp(row: ServingRow, folder: Path, files: Path, scheme: str, contexts, new_tokens: int, threads: int,
               progress) -> None:
    """llama.cpp's GGUF of the folder at the scheme's bit width, run by the same greedy loop; its
    floor from its own file's bytes and a float16 cache (llama.cpp's default)."""
    from ..peers import llama_cpp_runs

    if scheme not in llama_cpp_runs.GGUF_TYPES:
        return
    why = llama_cpp_runs.missing()
    if why:
        progress(f"{row.name}: llama.cpp rows skipped: {why}")
        return
    out = files / f"{row.name}_{llama_cpp_runs.GGUF_TYPES[scheme]}.gguf"
    progress(f"{row.name}: GGUF {llama_cpp_runs.GGUF_TYPES[scheme]} by llama.cpp's converter")
    try:
        seconds, peak, _ = measured_python(["-c", "import sys; from pathlib import Path; "
                                            "from posbias_export.peers.llama_cpp_runs import causal_gguf; "
                                            "causal_gguf(Path(sys.argv[1]), Path(sys.argv[2]), sys.argv[3])",
                                            str(folder), str(out), scheme])
    except RuntimeError as err:  # its converter refuses the architecture (transformers' MptForCausalLM): rows saying so
        row.runs += [{"scheme": scheme, "file": LLAMA_CPP, "context": c, "error": failure(err)} for c in contexts]
        return
    size = out.stat().st_size
    row.exports.append({"scheme": scheme, "file": LLAMA_CPP, "seconds": seconds, "peak_gb": peak, "file_gb": size / 1e9})
    _timed_runs(row, scheme, LLAMA_CPP, ["llama.cpp", str(out)], size, float_cache_bytes_per_token(folder) // 2,
                contexts, new_tokens, threads, progress)
    out.unlink()


def measure(name: str, work: Path, files: Path, contexts, schemes, new_tokens: int, threads: int,
            progress=print, kinds=KINDS) -> ServingRow:
    """WORK/<name> (published_folder) exported and run; the files made go to `files` (export/files.scratch),
    each removed once its runs are done (a 1B model's float32 files are 5 GB each)."""
    folder = published_folder(name, work, progress=progress)
    row = ServingRow(name, bandwidth_gbs=read_bandwidth_gbs())
    for scheme, flags in ((s, SCHEMES[s]) for s in schemes):
        for label, target in ((k, v) for k, v in FILES.items() if k in kinds):
            if scheme == "float16" and "float16" in target:  # a float16 file's cache is float16 already
                continue
            path = files / f"{name}_{scheme}_{label.replace(',', '').replace(' ', '_')}.onnx"
            progress(f"{name}: export {scheme}, {label}")
            seconds, peak, _ = measured_python(["-m", "posbias_export", "--model", str(folder), "--kv-cache", "--logits",
                                                "last", *target, *flags, "--skip-growth-check", "--external-data",
                                                "--out", str(path)])
            row.exports.append({"scheme": scheme, "file": label, "seconds": seconds, "peak_gb": peak,
                                "file_gb": weight_bytes(path) / 1e9})
            _timed_runs(row, scheme, label, ["ort", str(path)], weight_bytes(path), cache_bytes_per_token(path), contexts,
                        new_tokens, threads, progress)
            for made in (path, Path(f"{path}.data")):
                made.unlink(missing_ok=True)
        if scheme == "float32" and OPTIMUM in kinds:
            _optimum(row, folder, files, contexts, new_tokens, threads, progress)
        if scheme == "float32" and EAGER in kinds:
            _timed_runs(row, "float32", EAGER, ["transformers", str(folder)], folder_weight_bytes(folder),
                        float_cache_bytes_per_token(folder), contexts, new_tokens, threads, progress)
        if LLAMA_CPP in kinds:
            _llama_cpp(row, folder, files, scheme, contexts, new_tokens, threads, progress)
    return row


def _run(row: ServingRow, scheme: str, label: str, context: int) -> dict | None:
    """The run measured for this file and prompt (None where none was, or it failed)."""
    return next((r for r in row.runs if (r["scheme"], r["file"], r["context"]) == (scheme, label, context)
                 and "error" not in r), None)


def targets(rows: list[ServingRow]) -> list[tuple[str, str, str, bool | None]]:
    """(model, target, measured, met) for each target the runs allow."""
    out = []
    for row in rows:
        for scheme, floor_limit in (("int4", 1.3), ("float32", 1.2)):
            inplace, concat = _run(row, scheme, "in place", TARGET_CONTEXT), _run(row, scheme, "concat", TARGET_CONTEXT)
            if inplace and concat and scheme == "int4":
                ratio = inplace["decode_ms"] / concat["decode_ms"]
                out.append((row.name, f"int4 at {TARGET_CONTEXT}: in place / Concat <= 0.6", f"{ratio:.2f}", ratio <= 0.6))
            if inplace:
                ratio = inplace["decode_ms"] / inplace["floor_ms"]
                out.append((row.name, f"{scheme} at {TARGET_CONTEXT}: in place / floor <= {floor_limit}", f"{ratio:.2f}",
                            ratio <= floor_limit))
        long = _run(row, "float32", "in place", LONG_CONTEXT)  # float32 is held to its floor at 16384 too
        if long:
            ratio = long["decode_ms"] / long["floor_ms"]
            out.append((row.name, f"float32 at {LONG_CONTEXT}: in place / floor <= 1.2", f"{ratio:.2f}", ratio <= 1.2))
        for scheme in SCHEMES:  # prefill memory stays at the Concat file's or below, at every prompt
            for r in (r for r in row.runs if r["scheme"] == scheme and r["file"] == "in place" and "error" not in r):
                concat = _run(row, scheme, "concat", r["context"])
                if concat:
                    out.append((row.name, f"{scheme} prefill peak at {r['context']}: in place <= Concat",
                                f"{r['prefill_peak_gb']:.2f} vs {concat['prefill_peak_gb']:.2f} GB",
                                r["prefill_peak_gb"] <= concat["prefill_peak_gb"]))
    return out


OURS_BESIDE_LLAMA = ("in place", "in place, float16 cache", "in place, int8 cache")  # each judged on its own


def llama_cpp_targets(rows: list[ServingRow]) -> list[tuple[str, str, str, bool | None]]:
    """Issue 60's, for each of our in-place files measured beside a llama.cpp run: file bytes <=
    1.05x llama.cpp's at the same bit width, peak RSS <= 1.1x, decode CPU time per token <= 0.9x
    at 4096 tokens (llama.cpp's cache is float16: the float16-cache file is its like)."""
    out = []
    for row in rows:
        for r in (r for r in row.runs if r["file"] == LLAMA_CPP and "error" not in r):
            ours_schemes = [r["scheme"], *(s for s, like in SAME_BITS.items() if like == r["scheme"])]
            for ours in filter(None, (_run(row, scheme, label, r["context"])
                                      for scheme in ours_schemes for label in OURS_BESIDE_LLAMA)):
                name = f"{ours['scheme']} at {r['context']}, ours ({ours['file']}) / llama.cpp"
                if ours["file"] == "in place":  # the weights are the same in every variant
                    out.append((row.name, f"{name}: file bytes <= 1.05", f"{ours['file_gb'] / r['file_gb']:.2f}",
                                ours["file_gb"] <= 1.05 * r["file_gb"]))
                out.append((row.name, f"{name}: peak RSS <= 1.1", f"{ours['peak_gb'] / r['peak_gb']:.2f}",
                            ours["peak_gb"] <= 1.1 * r["peak_gb"]))
                if r["context"] == TARGET_CONTEXT and ours.get("decode_cpu_ms") and r.get("decode_cpu_ms"):
                    ratio = ours["decode_cpu_ms"] / r["decode_cpu_ms"]
                    out.append((row.name, f"{name}: decode CPU ms/token <= 0.9", f"{ratio:.2f}", ratio <= 0.9))
    return out


def render(rows: list[ServingRow], command: str) -> str:
    lines = [f"<!-- generated by: {command} -->", "# Serving at length: the KV cache in place", "", __doc__.strip(), "",
             "| model | scheme | file | prompt | threads | file GB | prefill s | prefill peak GB | peak GB | decode "
             "ms/token (median) | decode CPU ms/token | floor ms | decode / floor | tokens equal the Concat file's |",
             "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|"]
    for row in rows:
        for r in row.runs:
            if "error" in r:  # the runtime's last sentences (ONNX Runtime's start with a source path)
                said = ". ".join(r["error"].split("Status Message: ")[-1].split(". ")[-2:])
                lines.append(f"| {row.name} | {r['scheme']} | {r['file']} | {r['context']} | | | failed: {said} "
                             "| | | | | | | |")
                continue
            concat = _run(row, r["scheme"], "concat", r["context"])
            same = "-" if r["file"] in ("concat", LLAMA_CPP) or concat is None else (
                "yes" if concat["tokens"] == r["tokens"] else "no")
            cpu = f"{r['decode_cpu_ms']:.1f}" if r.get("decode_cpu_ms") else "-"
            size = f"{r['file_gb']:.2f}" if r.get("file_gb") else "-"
            lines.append(f"| {row.name} | {r['scheme']} | {r['file']} | {r['context']} | {r.get('threads', 2)} | {size} | "
                         f"{r['prefill_s']:.2f} | "
                         f"{r['prefill_peak_gb']:.2f} | {r['peak_gb']:.2f} | {r['decode_ms']:.1f} | {cpu} | "
                         f"{r['floor_ms']:.1f} | {r['decode_ms'] / r['floor_ms']:.2f} | {same} |")
    lines += ["", "Exports (each its own process):", "", "| model | scheme | file | seconds | peak RSS GB | file GB |",
              "|---|---|---|---|---|---|"]
    lines += [f"| {row.name} | {e['scheme']} | {e['file']} | {e['seconds']:.0f} | {e['peak_gb']:.2f} | {e['file_gb']:.2f} |"
              for row in rows for e in row.exports]
    bandwidth = ", ".join(f"{row.name} {row.bandwidth_gbs:.1f} GB/s" for row in rows)
    lines += ["", f"Read bandwidth measured beside each model (the floors' divisor): {bandwidth}."]
    cpus = {}
    for row in rows:
        for r in row.runs:
            cpus.setdefault(r.get("cpu", "not recorded (runs before 2026-11-28's)"), []).append(
                f"{row.name} {r['scheme']} {r['file']} {r['context']}")
    lines += ["", "The CPU of each run:", ""] + [f"- {cpu}: {', '.join(runs)}" for cpu, runs in cpus.items()]
    return "\n".join(lines + targets_section(targets(rows) + llama_cpp_targets(rows))) + "\n"


def merged(earlier: ServingRow | None, row: ServingRow) -> ServingRow:
    """A model measured in parts: the earlier row's runs and exports this run did not repeat stay
    (each with the floor of the bandwidth measured beside it)."""
    if earlier is None:
        return row
    runs = {(r["scheme"], r["file"], r["context"]) for r in row.runs}
    exports = {(e["scheme"], e["file"]) for e in row.exports}
    row.runs = [r for r in earlier.runs if (r["scheme"], r["file"], r["context"]) not in runs] + row.runs
    row.exports = [e for e in earlier.exports if (e["scheme"], e["file"]) not in exports] + row.exports
    order = {k: i for i, k in enumerate(KINDS)}
    row.runs.sort(key=lambda r: (list(SCHEMES).index(r["scheme"]), order[r["file"]], r["context"]))
    row.exports.sort(key=lambda e: (list(SCHEMES).index(e["scheme"]), order[e["file"]]))
    return row


def run_and_write(names, work: Path, out_dir: Path, contexts=CONTEXTS, schemes=tuple(SCHEMES), new_tokens: int = 16,
                  threads: int = 2, command: str = "python -m posbias_export bench-serving", progress=print,
                  kinds=KINDS) -> list[Path]:
    unknown = [n for n in names if n not in PUBLISHED or n in SEQ2SEQ]
    if unknown:
        raise ValueError(f"unknown model(s) {', '.join(unknown)}; choose from "
                         f"{', '.join(n for n in PUBLISHED if n not in SEQ2SEQ)}")
    wrong = [s for s in schemes if s not in SCHEMES]
    if wrong:
        raise ValueError(f"unknown scheme(s) {', '.join(wrong)}; choose from {', '.join(SCHEMES)}")
    kept = [ServingRow(**r) for r in kept_rows(out_dir / "serving.json", set(names))]  # rows of other runs
    for name in names if check_work_folder(work, PUBLISHED).is_dir() else ():  # every refusal before anything is made
        check_published_folder(name, work)
    work = work_folder(work, PUBLISHED)
    out_dir.mkdir(parents=True, exist_ok=True)
    earlier = {r["name"]: ServingRow(**r) for r in kept_rows(out_dir / "serving.json", set())}
    rows = []
    for name in names:
        with scratch(work) as files:
            row = measure(name, work, Path(files), contexts, schemes, new_tokens, threads, progress, kinds)
        row.command = command
        for run in row.runs:  # this run's rows: the CPU they ran on (rows kept from earlier runs say theirs, or none)
            run["cpu"] = cpu_model()
        rows.append(merged(earlier.get(name), row))
    every = sorted(kept + rows, key=lambda r: list(PUBLISHED).index(r.name))
    return write_results(out_dir, "serving", [asdict(r) for r in every], render(every, command))
