"""benchmarks/embedders.md: a JinaBERT v2 embedder at jina-embeddings-v2-base's published size
(random weights: bytes decide memory and speed) on ONNX Runtime CPU, side by side in one run:
our file (bidirectional ALiBi, blocked: memory linear in L), the dense form of the same model (the
[H, L, L] bias and scores in the graph, as the embedding tools' files hold it: our exporter's plain
form) and PyTorch eager (our module, plain), each configuration in its own process (its own peak
RSS). Batch 1 at each length, and a right-padded batch of short texts. llama.cpp's jina-bert-v2
is a row where llama_cpp is importable. `python -m posbias_export bench-embed`."""
from __future__ import annotations

import json
import sys
import tempfile
from dataclasses import asdict, dataclass
from pathlib import Path

from ..environment import describe, environment
from ..peers import llama_cpp_runs
from .harness import ChildFailed, Measured, measured_python, one_line, run_into, targets_section, write_results

COMMAND = "python -m posbias_export bench-embed"
# jina-embeddings-v2-base-en's configuration (its config.json); random weights here
BASE = dict(vocab=30528, hidden=768, heads=12, layers=12, max_len=8192)
LENGTHS = (512, 2048, 8192, 16384, 32768)
COLD_FROM = 16384  # one cold forward from here on: a warm-up would double a run of many minutes
SHORT_BATCH = (32, 128)  # 32 texts of at most 128 tokens, right-padded: what embedding servers batch all day
FORMS = ("ours", "dense", "eager", "llama.cpp")  # llama.cpp where llama_cpp_runs.missing() is None
WORKER = Path(__file__).with_name("worker.py")
PEAK_TARGET_GB = 1.5  # 8192 tokens, the whole process, float32
TIME_TARGET = {"single": 1.0, "batch": 1.1}  # ours / dense at 2048 (batch 1), and on the short batch


@dataclass
class EmbedCell(Measured):
    form: str
    length: int
    batch: int = 1

    @property
    def per_token_ms(self) -> float | None:
        return None if self.min is None else 1e3 * self.min / (self.length * self.batch)


def make_files(work: Path, gguf: bool, progress) -> tuple[Path, dict[str, Path]]:
    """The folder (published size, random weights), its two ONNX files and, with `gguf`, llama.cpp's
    file of it (its own converter, float32)."""
    from ..hf.export import export_model
    from ..hf.tiny import Sizes, save_tiny_folder

    folder = work / "jina-v2-base"
    progress("writing the jina-v2-base folder")
    save_tiny_folder("jina_bert", folder, Sizes(**BASE), noise=0.0)
    files = {"ours": work / "ours.onnx", "dense": work / "dense.onnx"}
    for form, path in files.items():
        progress(f"exporting {form}")
        export_model(folder, path, attention="plain" if form == "dense" else None, check_growth=False)
    if gguf:
        progress("converting to GGUF (llama.cpp's converter)")
        files["llama.cpp"] = llama_cpp_runs.to_gguf(folder, work / "model.gguf")
    return folder, files


def run_onnx(cell: EmbedCell, path: Path, timeout: float) -> None:
    cmd = [sys.executable, str(WORKER), "--runner", "ort", "--variant", "model", "--model", str(path), "--length",
           str(cell.length), "--vocab", str(BASE["vocab"]), "--repeats", "1", "--batch", str(cell.batch), "--session", "runners",
           *(["--cold"] if cell.length >= COLD_FROM else [])]
    run_into(cell, cmd, timeout)  # the dense form at length: killed for memory is its row


def run_python(cell: EmbedCell, args: list[str], timeout: float) -> None:
    """A Python worker (-m ... LENGTH BATCH RUNS) that prints {"times": [...]}: eager, llama.cpp."""
    runs = "1" if cell.length >= COLD_FROM else "2"
    try:
        _, peak, out = measured_python([*args, str(cell.length), str(cell.batch), runs], timeout)
        cell.times, cell.peak_rss = json.loads(out.strip().splitlines()[-1])["times"], int(peak * 1e9)
    except ChildFailed as err:
        cell.skipped = one_line(err.reason)


def eager_worker(folder: str, length: int, batch: int, runs: int) -> None:
    """Our module in float32, plain attention, on the worker's inputs: the last of `runs` timed."""
    from ..peers.eager_runs import module_forward
    from ..runners import runtimes_common

    vocab = json.loads((Path(folder) / "config.json").read_text())["vocab_size"]
    case = runtimes_common("inputs").padded_batch(length, batch, vocab)
    print(json.dumps(module_forward(folder, case.ids, case.mask, runs=runs)))


def run(lengths=LENGTHS, forms=FORMS, timeout: float = 1800.0, progress=print) -> list[EmbedCell]:
    cells, forms = [], [f for f in forms if f != "llama.cpp" or not llama_cpp_runs.missing()]
    with tempfile.TemporaryDirectory(prefix="posbias-bench-embed-") as tmp:
        folder, files = make_files(Path(tmp), "llama.cpp" in forms, progress)
        workers = {"eager": ["-m", "posbias_export.bench.embedders", "eager", str(folder)],
                   "llama.cpp": ["-m", "posbias_export.peers.llama_cpp_runs", "embed", str(files.get("llama.cpp"))]}
        for length, batch in [(n, 1) for n in lengths] + [SHORT_BATCH[::-1]]:
            for form in forms:
                cell = EmbedCell(form=form, length=length, batch=batch)
                progress(f"{form} L={length} B={batch}")
                run_python(cell, workers[form], timeout) if form in workers else run_onnx(cell, files[form], timeout)
                cells.append(cell)
    return cells


def _find(cells, form, length, batch=1):
    return next((c for c in cells if (c.form, c.length, c.batch) == (form, length, batch)), None)


def targets(cells) -> list[tuple[str, str, bool | None]]:
    out = []
    ours8k = _find(cells, "ours", 8192)
    if ours8k and ours8k.peak_rss:
        gb = ours8k.peak_rss / 1e9
        out.append((f"8192 tokens, float32: our file's whole process <= {PEAK_TARGET_GB} GB", f"{gb:.2f} GB",
                    gb <= PEAK_TARGET_GB))
    longest = _find(cells, "ours", max(LENGTHS))
    if longest:
        out.append((f"{max(LENGTHS)} tokens run (our file)", "ran" if longest.ok else f"did not run: {longest.skipped}",
                    longest.ok))
    for label, (length, batch), limit in (("2048 tokens, batch 1", (2048, 1), TIME_TARGET["single"]),
                                          (f"{SHORT_BATCH[0]} short texts (<= {SHORT_BATCH[1]} tokens), padded",
                                           SHORT_BATCH[::-1], TIME_TARGET["batch"])):
        ours, dense = _find(cells, "ours", length, batch), _find(cells, "dense", length, batch)
        if ours and dense and ours.min and dense.min:
            ratio = ours.min / dense.min
            out.append((f"{label}: ours <= {limit}x the dense form's time", f"{ratio:.2f}x", ratio <= limit))
    ours, theirs = _find(cells, "ours", 8192), _find(cells, "llama.cpp", 8192)
    if ours and theirs and ours.min and theirs.min:
        out += [("8192 tokens beside llama.cpp: time no worse", f"{ours.min / theirs.min:.2f}x", ours.min <= theirs.min),
                ("8192 tokens beside llama.cpp: peak RSS no worse", f"{ours.peak_rss / 1e9:.2f} vs "
                 f"{theirs.peak_rss / 1e9:.2f} GB", ours.peak_rss <= theirs.peak_rss)]
    return out


def _cell(cell) -> str:
    if cell is None:
        return "-"
    if cell.min is None:
        return f"did not run: {one_line(cell.skipped or '')}"
    return f"{cell.min:.2f} s ({cell.per_token_ms:.3f} ms/token), {cell.peak_rss / 1e9:.2f} GB"


def markdown(cells, env: dict) -> str:
    forms = [f for f in FORMS if any(c.form == f for c in cells)]
    lines = [f"<!-- generated by: {COMMAND} -->", "# Embedders at length: JinaBERT v2 base, our file vs the dense form", "",
             f"jina-embeddings-v2-base's configuration ({BASE['layers']} layers, hidden {BASE['hidden']}, {BASE['heads']} "
             "heads, vocabulary 30528; random weights, float32). ONNX Runtime CPU, 2 threads, our runners' session "
             "options for both files (memory patterns and planned memory reuse off, subnormals flushed by "
             "session.set_denormal_as_zero: runtimes/ort/run.py; docs/cpu-kinds.md), each cell in its own "
             "process: one forward after a warm-up, the process's peak RSS. dense: the same model exported with its "
             "[H, L, L] bias and scores in the graph (the embedding tools' files); eager: our PyTorch module, plain "
             f"attention. Batch rows after the first are right-padded. From {COLD_FROM} tokens on, one cold forward (no "
             "warm-up: it would double a run of many minutes; an embedding call at that length is a first call too).",
             describe(env), "",
             "| L | batch | " + " | ".join(forms) + " | ours / dense time |", "|---" * (len(forms) + 3) + "|"]
    for length, batch in dict.fromkeys((c.length, c.batch) for c in cells):
        row = [_find(cells, f, length, batch) for f in forms]
        ours, dense = _find(cells, "ours", length, batch), _find(cells, "dense", length, batch)
        ratio = f"{ours.min / dense.min:.2f}" if ours and dense and ours.min and dense.min else "-"
        lines.append(f"| {length} | {batch} | " + " | ".join(_cell(c) for c in row) + f" | {ratio} |")
    reason = None if "llama.cpp" in forms else llama_cpp_runs.missing()  # cells kept from an earlier run count
    lines += ["", f"llama.cpp: not measured: {reason}" if reason else
              "llama.cpp: llama-cpp-python on a GGUF from llama.cpp's converter (float32), mean pooling, flash "
              "attention on (llama.cpp's own default on this CPU), all rows of a batch in one call."]
    return "\n".join(lines + targets_section(targets(cells))) + "\n"


def run_and_write(lengths=LENGTHS, out_dir="benchmarks", forms=FORMS, progress=print) -> list[Path]:
    """Runs `forms` at `lengths`; the cells of an earlier embedders.json this run does not measure are
    kept (a slow bench measured in parts: a form added later, one length again)."""
    from ..export.files import output_folder

    out = output_folder(out_dir)
    cells = run(tuple(lengths), forms, progress=progress)
    earlier, measured = out / "embedders.json", {(c.form, c.length, c.batch) for c in cells}
    if earlier.is_file():
        cells += [EmbedCell(**c) for c in json.loads(earlier.read_text())["cells"]
                  if (c["form"], c["length"], c["batch"]) not in measured]
        cells.sort(key=lambda c: (c.batch, c.length))  # the tables' row order: each length, then the batch
    env = environment()
    return write_results(out, "embedders", {"environment": env, "cells": [asdict(c) for c in cells],
                                            "targets": targets(cells)}, markdown(cells, env))


if __name__ == "__main__":  # the eager worker: python -m posbias_export.bench.embedders eager FOLDER LENGTH BATCH RUNS
    eager_worker(sys.argv[2], *map(int, sys.argv[3:6]))
