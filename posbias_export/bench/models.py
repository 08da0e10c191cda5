"""benchmarks/models.md: imported models (BLOOM, MPT, Falcon with ALiBi, the T5 encoder) as our
blocked export, a plain dynamo export and Optimum's (where it installs), each on ONNX Runtime
CPU in its own process (worker.py) at 2048 / 8192 / 16384 tokens: time per forward,
peak RSS, and the error of the output against PyTorch (transformers float32, one run).

The models are random-weight transformers models of the issue's size (hidden 256, 4 heads,
2 layers), made here: numerics and memory depend on the architecture, not on trained values.
"""
from __future__ import annotations

import sys
import tempfile
from dataclasses import asdict, dataclass
from pathlib import Path

import numpy as np
import torch

from ..environment import describe, environment, exporter_versions
from ..errors import first_line
from ..limits import total_memory_share
from ..hf.models import ARCHITECTURES

# the architectures transformers implements (each cell is judged against it); JinaBERT's code is
# remote, so validate judges it against our float64 model and bench-embed times it
MODEL_TYPES = tuple(k for k, cls in ARCHITECTURES.items() if cls.transformers_class)
from .harness import Measured, run_into, write_results

LENGTHS = (2048, 8192, 16384)
EXPORTERS = ("posbias", "dynamo", "optimum")
WORKER = Path(__file__).with_name("worker.py")
VOCAB = 1000
COMMAND = "python -m posbias_export bench-models"


@dataclass
class ModelCell(Measured):
    model_type: str
    exporter: str
    length: int
    error_vs_torch: float | None = None


def make_folder(model_type: str, folder: Path, hidden: int = 256, heads: int = 4, layers: int = 2,
                max_len: int = max(LENGTHS)) -> Path:
    """A random transformers model of architecture `model_type` saved as a local folder."""
    from ..hf.tiny import Sizes, save_tiny_folder

    return save_tiny_folder(model_type, folder, Sizes(VOCAB, hidden, heads, layers, max_len), noise=0.0)


def export_all(model_type: str, folder: Path, work: Path) -> dict[str, Path | str]:
    """exporter -> file, or the one line saying why there is none."""
    from ..peers.baselines import dynamo_export, optimum_export
    from ..hf.export import export_model

    files: dict[str, Path | str] = {}
    export_model(folder, work / f"{model_type}_posbias.onnx")
    files["posbias"] = work / f"{model_type}_posbias.onnx"
    try:
        files["dynamo"] = dynamo_export(folder, work / f"{model_type}_dynamo.onnx", model_type)
    except Exception as err:  # a failed baseline is a result, not a crash
        files["dynamo"] = f"export failed: {first_line(err, 160)}"
    try:
        out = work / f"{model_type}_optimum"
        out.mkdir()
        files["optimum"] = optimum_export(folder, out, model_type)
    except ImportError:
        files["optimum"] = "optimum-onnx is not installed (it pins transformers < 4.58)"
    except Exception as err:
        files["optimum"] = f"not compared: {str(err).splitlines()[0][:200]}"
    return files


@torch.no_grad()
def torch_reference(model_type: str, folder: Path, length: int) -> np.ndarray:
    """transformers float32 on the worker's inputs (seed 0, no padding)."""
    from ..hf.models import architecture
    from ..hf.validate import transformers_model

    ids = torch.from_numpy(np.random.default_rng(0).integers(0, VOCAB, (1, length), dtype=np.int64))
    out = transformers_model(folder, model_type)(input_ids=ids, attention_mask=torch.ones_like(ids))
    # what the architecture's file gives (an encoder's states, an LM's logits), not its name
    return (out.last_hidden_state if architecture(model_type).arch == "encoder" else out.logits).numpy()


def run_cell(cell: ModelCell, model: Path, work: Path, repeats: int, timeout: float) -> np.ndarray | None:
    saved = work / f"out_{cell.model_type}_{cell.exporter}_{cell.length}.npy"
    cmd = [sys.executable, str(WORKER), "--runner", "ort", "--variant", "model", "--model", str(model), "--length",
           str(cell.length), "--vocab", str(VOCAB), "--repeats", str(repeats), "--save", str(saved)]
    if run_into(cell, cmd, timeout) is None:
        return None
    output = np.load(saved)
    saved.unlink()
    return output


def check_model_types(model_types) -> None:
    """Names bench-models measures, refused in one line before anything is made."""
    unknown = [k for k in model_types if k not in MODEL_TYPES]
    if unknown:
        if unknown[0] in ARCHITECTURES:
            raise ValueError(f"{unknown[0]} has no transformers implementation to judge the exports against "
                             f"(its code is remote): bench-embed measures it; bench-models takes {', '.join(MODEL_TYPES)}")
        raise ValueError(f"unknown model(s) {', '.join(unknown)}; choose from {', '.join(MODEL_TYPES)}")


def run(model_types=MODEL_TYPES, lengths=LENGTHS, exporters=EXPORTERS, repeats: int = 2, timeout: float = 900.0,
        progress=None) -> list[ModelCell]:
    check_model_types(model_types)
    cells = []
    budget = total_memory_share()
    with tempfile.TemporaryDirectory(prefix="posbias-bench-models-") as tmp:
        work = Path(tmp)
        for model_type in model_types:
            folder = make_folder(model_type, work / model_type)
            files = export_all(model_type, folder, work)
            peaks: dict[str, tuple[int, int]] = {}  # exporter -> (length, peak) of its last run
            for length in lengths:
                reference = None
                for exporter in exporters:
                    cell = ModelCell(model_type, exporter, length)
                    cells.append(cell)
                    model = files.get(exporter)
                    if isinstance(model, str):
                        cell.skipped = model
                        continue
                    last = peaks.get(exporter)
                    predicted = 0 if last is None else last[1] * (length / last[0]) ** 2
                    if exporter != "posbias" and predicted > budget:  # plain attention: quadratic
                        cell.skipped = (f"not run: predicted {predicted / 1e9:.0f} GB (quadratic from "
                                        f"{last[1] / 1e9:.1f} GB at {last[0]}) > {budget / 1e9:.0f} GB here")
                        continue
                    output = run_cell(cell, model, work, repeats, timeout)
                    if cell.peak_rss:
                        peaks[exporter] = (length, cell.peak_rss)
                    if output is not None:
                        if reference is None:
                            reference = torch_reference(model_type, folder, length)
                        cell.error_vs_torch = float(np.abs(output.astype(np.float64) - reference).max())
                    if progress:
                        progress(1)
    return cells


def _fmt(cell: ModelCell | None) -> str:
    if cell is None:
        return "-"
    if cell.min is None:
        return cell.skipped or "-"
    return f"{cell.min:.2f} s, {cell.peak_rss / 1e9:.2f} GB, err {cell.error_vs_torch:.1e}"


def markdown(cells: list[ModelCell], env: dict) -> str:
    lengths = sorted({c.length for c in cells})
    exporters = [e for e in EXPORTERS if any(c.exporter == e for c in cells)]
    find = {(c.model_type, c.exporter, c.length): c for c in cells}
    lines = [
        "# Imported models: our export vs a plain dynamo export vs Optimum",
        "",
        f"Regenerate with `{COMMAND}` (about 10 minutes on 2 cores). Random-weight transformers models of "
        "hidden 256, 4 heads, 2 layers, vocabulary 1000, saved as local folders; batch 1; ONNX Runtime CPU with 2 "
        "threads, each cell in its own process. Time: fastest of 2 forwards after a warm-up. RSS: the process's "
        "peak. err: max |output - transformers float32| on the same input.",
        "",
        describe(env) + " " + ", ".join(f"{k} {v}" for k, v in env.get("exporters", {}).items()) + ".",
        "",
        "The plain exports materialise the [heads, L, L] scores (several copies per layer): their memory is "
        "quadratic in L, so 16384 is predicted from 8192 and not run when it would not fit. The dynamo export of "
        "Falcon cannot be loaded by ONNX Runtime (a bfloat16 Mul from Falcon's ALiBi builder); Optimum's loads but "
        "drops that bfloat16 rounding, hence its error growing with L.",
        "",
    ]
    for model_type in dict.fromkeys(c.model_type for c in cells):
        lines += [f"## {model_type}", "", "| L | " + " | ".join(exporters) + " |", "|---" * (len(exporters) + 1) + "|"]
        for length in lengths:
            lines.append(f"| {length} | " + " | ".join(_fmt(find.get((model_type, e, length))) for e in exporters) + " |")
        lines.append("")
    return "\n".join(lines)


def write(cells: list[ModelCell], out_dir: Path) -> list[Path]:
    out_dir.mkdir(parents=True, exist_ok=True)
    env = {**environment(), "exporters": exporter_versions()}
    return write_results(out_dir, "models", {"environment": env, "cells": [asdict(c) for c in cells]},
                         markdown(cells, env))


def run_and_write(model_types=MODEL_TYPES, lengths=LENGTHS, repeats: int = 2, out_dir="benchmarks", progress=None) -> list[Path]:
    """`bench-models`: every cell, then models.md/.json."""
    from ..export.files import output_folder

    check_model_types(model_types)  # before the results folder is made
    out = output_folder(out_dir)
    return write(run(tuple(model_types), tuple(lengths), repeats=repeats, progress=progress), out)
