"""Imported models at the sizes people serve: folders of random weights built from published
configurations (bytes are what matter for memory and speed), exported and run side by side.

For each configuration: export time and peak RSS (each export its own process, peak read from
the kernel's accounting of that process), file size; on ONNX Runtime CPU a prefill of 512 and
4096 tokens (time, peak RSS) and the per-token decode time, beside transformers eager's decode
on the same weights and the memory-bandwidth floor (weight bytes / measured copy bandwidth);
greedy tokens compared with transformers'. `python -m posbias_export bench-real`.
"""
from __future__ import annotations

import json
import sys
from dataclasses import asdict, dataclass, field
from pathlib import Path

from ..peers import eager_runs, llama_cpp_runs, ort_runs
from ..peers.baselines import optimum_cli
from ..peers.eager_runs import prompt_ids
from ..hf.published import PUBLISHED, SHARDED, published_folder
from ..environment import copy_bandwidth_gbs
from ..export.files import scratch
from .harness import failure, kept_rows, md_table, measured_python, median, targets_section, write_results

SEQ2SEQ = {"t5-base"}  # an encoder file and a cached decoder file; the encoder's prefill is run
# What an export's process holds whatever the model (Python, torch, onnx, onnxscript, transformers):
# exporting a model of a 300-token vocabulary peaks at 0.45-0.46 GB here. Export targets allow it.
FIXED_OVERHEAD_GB = 0.5


def weight_bytes(onnx_path: Path) -> int:
    """The model file and its external data (ours: NAME.data; Optimum's: NAME_data)."""
    extra = [Path(str(onnx_path) + ".data"), Path(str(onnx_path) + "_data")]
    return onnx_path.stat().st_size + sum(p.stat().st_size for p in extra if p.exists())


def folder_weight_bytes(folder: Path) -> int:
    """A published folder's safetensors (the whole model once, in the dtype it was written in)."""
    return sum(p.stat().st_size for p in folder.glob("*.safetensors"))


def folder_bytes(folder: Path) -> int:
    """An exported folder's model files (Optimum writes model.onnx_data, or one file per tensor)."""
    return sum(f.stat().st_size for f in folder.iterdir() if f.is_file() and f.suffix != ".json")


@dataclass
class RealRow:
    name: str
    config: dict
    source_gb: float
    exports: list[dict] = field(default_factory=list)  # dtype, seconds, peak GB, file GB, ratio
    runs: list[dict] = field(default_factory=list)  # prefill / decode figures
    command: str = ""  # the bench-real command that measured this row


def worker_run(kind: str, target, prompt: int, new_tokens: int, threads: int, *extra: str, warm: int = 0) -> dict:
    """One of main_worker's runs in its own process: its JSON, with `peak_gb` (that process's peak
    RSS; also the prefill's where the run has no decode) and `decode_ms` the median of the steps
    after the first `warm` (a new session's first steps allocate)."""
    _, peak, text = measured_python(["-m", "posbias_export.bench.real_models", kind, str(target), str(prompt),
                                     str(new_tokens), str(threads), *extra])
    got = {"prefill_peak_gb": peak, **json.loads(text.strip().splitlines()[-1]), "peak_gb": peak}
    if "decode_cpu_ms" in got:
        got["decode_cpu_ms"] = median(got["decode_cpu_ms"][warm:])
    return {**got, "decode_ms": median(got["decode_ms"][warm:])} if "decode_ms" in got else got


def _optimum_export(row: RealRow, folder: Path, out: Path, task: str, label: str, size, progress) -> bool:
    """Optimum's export of `folder` (side environment) measured as one more export row: True
    when it wrote its files; a failure is a row saying why. `size()`: the bytes it wrote."""
    cli = optimum_cli()
    if cli is None:
        return False
    progress(f"{row.name}: Optimum export")
    try:
        seconds, peak, _ = measured_python(["export", "onnx", "--model", str(folder), "--task", task, str(out)],
                                           program=str(cli))
    except (RuntimeError, ValueError) as err:  # a failed child: harness.ChildFailed is a RuntimeError
        row.exports.append({"dtype": label, "error": failure(err)})
        return False
    gb = size() / 1e9
    row.exports.append({"dtype": label, "seconds": seconds, "peak_gb": peak, "file_gb": gb, "ratio": peak / gb})
    return True


def _encoder_runs(row: RealRow, folder: Path, work: Path, threads: int, progress) -> RealRow:
    """T5: the encoder's prefill at 512 and 4096 tokens, ours, Optimum's and transformers eager."""
    ours = work / f"{row.name}_encoder_float32.onnx"
    files = {"ours": ours}
    out = work / f"{row.name}_optimum"
    three = ("encoder_model.onnx", "decoder_model.onnx", "decoder_with_past_model.onnx")
    if _optimum_export(row, folder, out, "text2text-generation-with-past", "float32 (Optimum, its three files)",
                       lambda: sum(weight_bytes(out / f) for f in three if (out / f).exists()), progress):
        files["Optimum's file"] = out / "encoder_model.onnx"
    for prompt in (512, 4096):
        for label, path in files.items():
            progress(f"{row.name}: encoder prefill {prompt} ({label})")
            got = worker_run("encoder", path, prompt, 0, threads)
            row.runs.append({"prompt": prompt, "encoder": label, "prefill_s": got["prefill_s"], "peak_gb": got["peak_gb"],
                             "weights_gb": weight_bytes(path) / 1e9})
        progress(f"{row.name}: transformers encoder prefill {prompt}")
        got = worker_run("transformers-encoder", folder, prompt, 0, threads)
        row.runs.append({"prompt": prompt, "encoder": "transformers eager", "prefill_s": got["prefill_s"],
                         "peak_gb": got["peak_gb"]})
    return row


def measure(name: str, work: Path, files: Path, dtypes: tuple[str, ...], run: bool, threads: int, new_tokens: int,
            source_dtype: str, progress=print) -> RealRow:
    """WORK/<name> (published_folder) exported and run; every file made goes to `files` (export/files.scratch)."""
    import transformers as tf

    folder = published_folder(name, work, source_dtype, progress)
    source = folder_weight_bytes(folder) / 1e9
    row = RealRow(name, {**PUBLISHED[name][2], "model_type": getattr(tf, PUBLISHED[name][1])().model_type}, source)
    parts = ((" encoder", []), (" decoder", ["--part", "decoder"])) if name in SEQ2SEQ else (("", ["--kv-cache",
                                                                                                   "--logits", "last"]),)
    for dtype in dtypes:
        for part, flags in parts:
            path = files / f"{name}{part.replace(' ', '_')}_{dtype}.onnx"
            progress(f"{name}: export{part} {dtype}")
            seconds, peak, _ = measured_python(["-m", "posbias_export", "--model", str(folder), *flags, "--dtype", dtype,
                                                "--out", str(path)])
            size = weight_bytes(path) / 1e9
            row.exports.append({"dtype": dtype + part, "seconds": seconds, "peak_gb": peak, "file_gb": size,
                                "ratio": peak / size})
    if not run:
        return row
    if name in SEQ2SEQ:
        return _encoder_runs(row, folder, files, threads, progress)
    bandwidth = copy_bandwidth_gbs()
    _optimum_runs(row, folder, files, bandwidth, threads, new_tokens, progress)
    _our_runs(row, folder, files, bandwidth, threads, new_tokens, progress)
    return row


def _decode_entry(got: dict, keys: dict, floor_ms: float, bandwidth: float, weights: int) -> dict:
    """A run's row of the prefill-and-decode table."""
    return {**keys, **{k: got[k] for k in ("prefill_s", "peak_gb", "prefill_peak_gb", "decode_ms", "tokens")},
            "floor_ms": floor_ms, "bandwidth_gbs": bandwidth, "weights_gb": weights / 1e9}


def _optimum_runs(row: RealRow, folder: Path, work: Path, bandwidth: float, threads: int, new_tokens: int,
                  progress) -> None:
    """Optimum's export of the folder (if its side environment exists), prefill and decode."""
    name = row.name
    floor_ms = 1e3 * weight_bytes(work / f"{name}_float32.onnx") / 1e9 / bandwidth  # bytes a token must read
    out = work / f"{name}_optimum"
    if not _optimum_export(row, folder, out, "text-generation-with-past", "float32 (Optimum)", lambda: folder_bytes(out),
                           progress):
        return
    for prompt in (512, 4096) if (out / "model.onnx").is_file() else ():
        progress(f"{name}: Optimum's file, prefill {prompt} + decode")
        try:
            got = worker_run("ort", out / "model.onnx", prompt, new_tokens, threads)
        except RuntimeError as err:  # a failed child (harness.ChildFailed)
            row.runs.append({"prompt": prompt, "optimum": True, "error": failure(err)})
            continue
        row.runs.append(_decode_entry(got, {"prompt": prompt, "lean": False, "optimum": True}, floor_ms, bandwidth,
                                      folder_bytes(out)))


def _our_runs(row: RealRow, folder: Path, work: Path, bandwidth: float, threads: int, new_tokens: int,
              progress) -> None:
    """Our float32 file: prefill 512 and 4096 (and a lean session) + decode; transformers eager at 512."""
    name, path = row.name, work / f"{row.name}_float32.onnx"
    for prompt, lean in ((512, False), (4096, False), (4096, True)):
        progress(f"{name}: ORT prefill {prompt} + decode{' (lean session)' if lean else ''}")
        ours = worker_run("ort", path, prompt, new_tokens, threads, "lean" if lean else "prepack")
        entry = _decode_entry(ours, {"prompt": prompt, "lean": lean}, 1e3 * weight_bytes(path) / 1e9 / bandwidth,
                              bandwidth, weight_bytes(path))
        if prompt == 512:
            progress(f"{name}: transformers eager prefill {prompt} + decode")
            theirs = worker_run("transformers", folder, prompt, new_tokens, threads)
            entry.update(transformers_decode_ms=theirs["decode_ms"], transformers_prefill_s=theirs["prefill_s"],
                         transformers_peak_gb=theirs["peak_gb"], tokens_equal=theirs["tokens"] == ours["tokens"])
        row.runs.append(entry)


DECODE_HEADER = ["model", "prompt", "session", "prefill s", "prefill peak RSS GB",
                 "prefill peak / weights (target at 4096 <= 1.5)", "peak RSS with 16 decode steps GB",
                 "decode ms/token (median)", "bandwidth floor ms", "decode / floor (target <= 1.2)",
                 "transformers eager ms/token", "eager / ours (target >= 2)", "tokens equal transformers"]


def _decode_cells(r: RealRow, x: dict) -> list:
    eager = x.get("transformers_decode_ms")
    peak = _prefill_peak(x)
    return [r.name, x["prompt"], _session(x), f"{x['prefill_s']:.2f}", f"{peak:.2f}", f"{peak / x['weights_gb']:.2f}",
            f"{x['peak_gb']:.2f}", f"{x['decode_ms']:.1f}", f"{x['floor_ms']:.1f} ({x['bandwidth_gbs']:.1f} GB/s)",
            f"{x['decode_ms'] / x['floor_ms']:.2f}", "" if eager is None else f"{eager:.1f}",
            "" if eager is None else f"{eager / x['decode_ms']:.2f}",
            "" if "tokens_equal" not in x else ("yes" if x["tokens_equal"] else "NO")]


def render(rows: list[RealRow], command: str) -> str:
    made = sorted({r.command for r in rows if r.command and r.command != command})
    lines = [f"<!-- generated by: {command} -->", "# Imported models at real size (random weights, published configs)", "",
             *([f"Rows of earlier runs kept: {'; '.join(f'`{c}`' for c in made)}.", ""] if made else []),
             "Machine: 2 CPU cores, ONNX Runtime CPU, 2 threads; each export and each run its own process; peak RSS is "
             "that process's, from the kernel (wait4). Files exported with `--model DIR --kv-cache --logits last`.", ""]
    lines += md_table(["model", "configuration"], [[r.name, json.dumps(r.config)] for r in rows])
    lines += ["", "## Export: time and peak memory", ""] + md_table(
        ["model", "dtype", "export s", "peak RSS GB", "file GB", "peak / file", "target: peak <= 1.5 x file + 0.5 GB"],
        [[r.name, e["dtype"], f"failed: {e['error']}", "", "", "", ""] if "error" in e else
         [r.name, e["dtype"], f"{e['seconds']:.0f}", f"{e['peak_gb']:.2f}", f"{e['file_gb']:.2f}", f"{e['ratio']:.2f}",
          _export_verdict(e)] for r in rows for e in r.exports])
    runs = [(r, x) for r in rows for x in r.runs if "encoder" not in x and "error" not in x]
    if runs:
        lines += ["", "## Prefill and decode, float32 file, ONNX Runtime CPU", "",
                  "Decode: greedy steps after the prompt, the cache kept as ONNX Runtime values (as `generate` runs); "
                  "the floor is the weight bytes over the measured copy bandwidth (bytes read + written per second). "
                  "Lean: `--lean-memory` (no prepacked weight copies; weights stay memory-mapped).", ""]
        lines += md_table(DECODE_HEADER, [_decode_cells(r, x) for r, x in runs])
    failed = [(r, x) for r in rows for x in r.runs if "error" in x]
    lines += [""] + [f"- {r.name}, prompt {x['prompt']}, {_session(x)}: failed: {x['error']}" for r, x in failed] if failed else []
    encoder_runs = [[r.name, x["prompt"], x["encoder"], f"{x['prefill_s']:.2f}", f"{x['peak_gb']:.2f}"]
                    for r in rows for x in r.runs if "encoder" in x]
    if encoder_runs:
        lines += ["", "## Encoder prefill (T5), float32, ONNX Runtime CPU", ""]
        lines += md_table(["model", "prompt", "file", "prefill s", "peak RSS GB"], encoder_runs)
    return "\n".join(lines + targets_section(targets(rows))) + "\n"


def targets(rows: list[RealRow]) -> list[tuple[str, str, str, bool]]:
    """(model, target, measured, met) for every target the issue set and this run measured."""
    out = []
    for r in rows:
        for e in r.exports:
            if "Optimum" not in e["dtype"] and "error" not in e:
                out.append((r.name, f"export {e['dtype']}: peak RSS <= 1.5 x the file's weights + {FIXED_OVERHEAD_GB} GB",
                            f"{e['peak_gb']:.2f} GB / {e['file_gb']:.2f} GB = {e['ratio']:.2f}", _export_ok(e)))
        ours = {(x["prompt"], x.get("lean", False)): x for x in r.runs
                if not x.get("optimum") and "encoder" not in x and "error" not in x}
        theirs = {x["prompt"]: x for x in r.runs if x.get("optimum") and "error" not in x}
        encoder = {(x["prompt"], x["encoder"]): x for x in r.runs if "encoder" in x}
        if (4096, "ours") in encoder and (4096, "Optimum's file") in encoder:
            a, b = encoder[4096, "ours"]["peak_gb"], encoder[4096, "Optimum's file"]["peak_gb"]
            out.append((r.name, "encoder prefill 4096: peak RSS below Optimum's file", f"{a:.2f} vs {b:.2f} GB", a < b))
        if 512 in {p for p, _ in ours}:
            x = ours[512, False]
            out.append((r.name, "decode <= 1.2 x the bandwidth floor", f"{x['decode_ms']:.1f} / {x['floor_ms']:.1f} ms = "
                        f"{x['decode_ms'] / x['floor_ms']:.2f}", x["decode_ms"] <= 1.2 * x["floor_ms"]))
            if "transformers_decode_ms" in x:
                ratio = x["transformers_decode_ms"] / x["decode_ms"]
                out.append((r.name, "decode >= 2x faster than transformers eager",
                            f"{x['transformers_decode_ms']:.1f} / {x['decode_ms']:.1f} ms = {ratio:.2f}", ratio >= 2))
                out.append((r.name, "greedy tokens equal transformers'", "yes" if x["tokens_equal"] else "no",
                            bool(x["tokens_equal"])))
        for lean in (False, True):
            x = ours.get((4096, lean))
            if x is None:
                continue
            label = "ours, lean" if lean else "ours"
            peak = _prefill_peak(x)
            out.append((r.name, f"prefill 4096 ({label}): peak RSS <= 1.5 x the weights",
                        f"{peak:.2f} / {x['weights_gb']:.2f} GB = {peak / x['weights_gb']:.2f}",
                        peak <= 1.5 * x["weights_gb"]))
            if 4096 in theirs:
                other = _prefill_peak(theirs[4096])
                out.append((r.name, f"prefill 4096 ({label}): peak RSS below Optimum's file",
                            f"{peak:.2f} vs {other:.2f} GB", peak < other))
    return out


def _export_ok(export: dict) -> bool:
    return export["peak_gb"] <= 1.5 * export["file_gb"] + FIXED_OVERHEAD_GB


def _export_verdict(export: dict) -> str:
    if "Optimum" in export["dtype"]:
        return "(Optimum's, for comparison)"
    return "met" if _export_ok(export) else "NOT met"


def _prefill_peak(run: dict) -> float:
    return run.get("prefill_peak_gb", run["peak_gb"])


def _session(run: dict) -> str:
    return "Optimum's file" if run.get("optimum") else ("ours, lean" if run.get("lean") else "ours")


def run_and_write(names: list[str], work: Path, out_dir: Path, run_names: set[str], threads: int = 2,
                  new_tokens: int = 16, command: str = "python -m posbias_export bench-real") -> list[Path]:
    out_dir.mkdir(parents=True, exist_ok=True)
    # a slow bench runs in parts: the rows of models this run does not measure are kept
    kept = [RealRow(**r) for r in kept_rows(out_dir / "real_models.json", set(names))]
    rows, paths = [], []
    for name in names:
        source_dtype = "float16" if name == "bloom-3b" else "float32"  # 12 GB of float32 would not fit beside its export
        with scratch(work) as files:
            dtypes = ("float16",) if name in SHARDED else ("float32", "float16")  # 7B float32: 27 GB of disk
            rows.append(measure(name, work, Path(files), dtypes, name in run_names, threads, new_tokens,
                                source_dtype, progress=lambda m: print(m, file=sys.stderr, flush=True)))
        rows[-1].command = command
        every = sorted(kept + rows, key=lambda r: list(PUBLISHED).index(r.name))
        paths = write_results(out_dir, "real_models", [asdict(r) for r in every], render(every, command))
    return paths


def main_worker(argv: list[str]) -> None:
    """python -m posbias_export.bench.real_models KIND FILE|FOLDER PROMPT NEW THREADS [lean|prepack]
    [--device D] [--dtype T] [--vocab V] [--save STATES.npy]"""
    kind, target, prompt, new, threads, *rest = argv
    prompt, new, threads = int(prompt), int(new), int(threads)
    device, dtype, vocab, save = (rest[rest.index(flag) + 1] if flag in rest else default for flag, default in
                                  (("--device", "cpu"), ("--dtype", "float32"), ("--vocab", "30000"), ("--save", None)))
    ids = prompt_ids(prompt, int(vocab))
    lean = True if "lean" in rest else False if "prepack" in rest else None  # None: as generate chooses
    steps = {"ort": lambda: ort_runs.ort_steps(target, prompt + new, threads, lean, device),
             "transformers": lambda: eager_runs.causal_lm_steps(target, device, dtype, threads),
             "llama.cpp": lambda: llama_cpp_runs.causal_steps(target, prompt + new, threads)}
    runs = {"encoder": lambda: ort_runs.encoder_forward(target, prompt, threads, save),
            "transformers-encoder-streamed": lambda: eager_runs.encoder_streamed_timed(target, prompt, threads, save),
            "seq2seq": lambda: ort_runs.seq2seq_greedy(target, prompt, new),
            "transformers-seq2seq": lambda: eager_runs.seq2seq_greedy(target, prompt, new, threads),
            "transformers-encoder": lambda: eager_runs.encoder_forward(target, prompt, threads),
            "generate": lambda: eager_runs.generate_timed(target, ids, new, device, dtype)}
    if kind in steps:
        make_step = steps[kind]()
        got = eager_runs.timed_greedy(make_step, ids, new, warmup=device != "cpu")
        print(json.dumps({**got, "ran_on": getattr(make_step, "ran_on", "torch " + device),
                          **eager_runs.device_peak(device)}))
    else:
        print(json.dumps(runs[kind]()))


if __name__ == "__main__":
    main_worker(sys.argv[1:])
