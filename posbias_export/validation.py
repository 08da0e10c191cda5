"""A validate session: which runtimes and lengths by default, every file judged by the matrix
that fits it (our own exports: parity/matrix.py; files of a Hugging Face model, whoever wrote
them: hf/validate.py), and the reports written. Sits above parity/ and hf/ (it routes between
them); the command line calls it and prints."""
from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path

DEFAULT_LENGTH_FACTOR = 64  # besides 1 and 17: 64x the trace length, far past what the trace saw


@dataclass
class Validation:
    matrices: list = field(default_factory=list)
    runtimes: tuple[str, ...] = ()
    skipped: dict[str, str] = field(default_factory=dict)  # default runtimes not installed here, and why

    @property
    def ok(self) -> bool:
        return all(m.ok for m in self.matrices)


def choose_runtimes(runtimes) -> tuple[tuple[str, ...], dict[str, str]]:
    """The runtimes asked for, or the installed defaults and why the others are skipped."""
    from .parity import installed_defaults

    if runtimes is not None:
        if not runtimes:  # `--runtimes ""`: an empty table would say nothing was checked, and exit 1 silently
            from .parity.runtimes import RUNTIMES

            raise ValueError(f"--runtimes names no runtime; choose from {', '.join(RUNTIMES)}")
        return tuple(runtimes), {}
    chosen, missing = installed_defaults()
    if not chosen:
        raise ValueError("none of the default runtimes is installed; name some with --runtimes")
    return chosen, missing


def default_lengths(meta: dict) -> tuple[int, ...]:
    return (1, 17, DEFAULT_LENGTH_FACTOR * int(meta.get("trace_len", 16)))


def is_imported(meta: dict, model_dir) -> bool:
    """A file to judge against a Hugging Face model: --model given, or our export of one."""
    return bool(model_dir) or meta.get("source") == "huggingface"


def own_file_bytes(meta: dict, length: int, batch: int) -> float:
    """Memory of one case of our own file: the float64 reference in the file's attention form,
    or a runtime's float32 run, whichever is larger, and the logits of both."""
    import json

    from .limits import attention_bytes

    cfg = json.loads(meta.get("config", "{}"))
    heads, dim, layers, vocab = (int(cfg.get(k, d)) for k, d in (("num_heads", 4), ("dim", 128), ("num_layers", 2),
                                                                  ("vocab_size", 256)))
    rows = min(length, int(meta.get("attention_block", length))) if meta.get("attention") == "blocked" else length
    reference = attention_bytes(batch, heads, rows, length, 8) + 12.0 * batch * length * dim * 8 * layers
    runtime = attention_bytes(batch, heads, rows, length, 4, 4)
    return max(reference, runtime) + 3.0 * batch * length * vocab * 8


def check_sizes(models, lengths, batch: int, ignore: bool) -> None:
    """Refuse, before anything runs, a length or batch this machine cannot hold."""
    from .export.metadata import read_metadata
    from .limits import check_fits
    from .parity.reference import read_onnx

    for model in models:
        meta = read_metadata(read_onnx(model))
        if meta.get("source") == "huggingface":
            continue  # hf/validate.py estimates with the folder's model
        for length in lengths or default_lengths(meta):
            check_fits(own_file_bytes(meta, length, batch), f"validating {model} at length {length}, batch {batch}",
                       ignore)


def check_input_sizes(models, feeds: dict, ignore: bool) -> None:
    """--inputs: the batch and length the user's tensors imply ([B, L, ...]), refused as a
    generated length would be (a million tokens is a run this machine cannot hold)."""
    from .export.metadata import read_metadata
    from .limits import check_fits
    from .parity.reference import read_onnx

    shaped = [a.shape for a in feeds.values() if a.ndim >= 2]
    if not shaped:
        return
    batch, length = max(s[0] for s in shaped), max(s[1] for s in shaped)
    for model in models:
        meta = read_metadata(read_onnx(model))
        if meta.get("source") != "huggingface":
            check_fits(own_file_bytes(meta, length, batch), f"validating {model} on --inputs (batch {batch}, length "
                       f"{length})", ignore)


def validate(models, runtimes=None, lengths=None, batch: int = 3, checkpoint=None, inputs=None, model_dir=None,
             progress=None, ignore_size_limits: bool = False, order: bool = True) -> Validation:
    """Every file on every runtime against its float64 reference, and the order protocol unless
    order=False. `inputs`: a path to an .npz of the user's own tensors (instead of generated
    lengths). Lengths and batches this machine cannot hold are refused first (limits.py) unless
    ignore_size_limits."""
    from .export.metadata import read_metadata
    from .parity import load_model_file, run_matrix
    from .parity.reference import read_npz, read_onnx

    chosen, skipped = choose_runtimes(runtimes)
    if not inputs:
        check_sizes(models, lengths, batch, ignore_size_limits)
    feeds = read_npz(inputs, ignore_size_limits) if inputs else None
    if feeds:
        check_input_sizes(models, feeds, ignore_size_limits)
    result = Validation(runtimes=chosen, skipped=skipped)
    for model in models:
        meta = read_metadata(read_onnx(model))
        model_lengths = lengths or default_lengths(meta)
        model_runtimes = runnable(chosen, runtimes is None, [meta], result)
        if is_imported(meta, model_dir):
            from .hf.validate import run_hf_matrix

            result.matrices.append(run_hf_matrix(model, model_dir, model_runtimes, model_lengths, batch,
                                                 progress=progress, ignore_size_limits=ignore_size_limits, order=order))
            continue
        load_model_file(model)  # our own export: its metadata must be complete
        result.matrices.append(run_matrix(model, model_runtimes, model_lengths, batch, checkpoint, feeds,
                                          progress=progress, order=order))
    for encoder, decoder, folder in seq2seq_pairs(models, model_dir):  # as a client runs them: one into the other
        from .hf.validate_seq2seq import run_seq2seq_matrix

        metas = [read_metadata(read_onnx(encoder)), read_metadata(read_onnx(decoder))]
        result.matrices.append(run_seq2seq_matrix(
            encoder, decoder, folder, runnable(chosen, runtimes is None, metas, result),
            lengths or default_lengths(metas[1]), batch, progress=progress, ignore_size_limits=ignore_size_limits,
            order=False))  # each file's order protocol ran in its own matrix
    return result


def runnable(chosen: tuple[str, ...], defaults: bool, metas: list[dict], result: Validation) -> tuple[str, ...]:
    """The runtimes to run files with these metadata on: the default runtimes leave out the
    reference evaluator for a quantized file (it implements no quantized op), saying why."""
    if not (defaults and "reference" in chosen and any(m.get("quantized") for m in metas)):
        return chosen
    result.skipped["reference"] = ("the ONNX reference evaluator implements no quantized op "
                                   "(GatherBlockQuantized, int8 DequantizeLinear at opset 18)")
    return tuple(r for r in chosen if r != "reference")


def seq2seq_pairs(models, model_dir=None) -> list[tuple]:
    """(encoder file, decoder file, folder) for each folder of which exactly one encoder and one
    decoder file were given (the folder: --model, else each file's recorded model_dir)."""
    from .export.metadata import read_metadata
    from .hf.validate_seq2seq import seq2seq_role
    from .parity.reference import read_onnx

    roles: dict = {}
    for model in models:
        proto = read_onnx(model)
        meta = read_metadata(proto)
        folder = model_dir or meta.get("model_dir")
        if not is_imported(meta, model_dir) or not folder:
            continue
        role = seq2seq_role(proto)
        if role:
            roles.setdefault(str(Path(folder).resolve()), {}).setdefault(role, []).append(model)
    return [(found["encoder"][0], found["decoder"][0], folder) for folder, found in roles.items()
            if len(found.get("encoder", [])) == 1 and len(found.get("decoder", [])) == 1]


def write_reports(result: Validation, json_path=None, markdown=None, lengths=None, batch: int = 3) -> list[Path]:
    from .export.files import write_text_atomic
    from .parity import parity_markdown

    written = []
    if json_path:
        report = {"ok": result.ok, "models": [m.as_dict() for m in result.matrices]}
        written.append(write_text_atomic(json_path, json.dumps(report, indent=1)))
    if markdown:
        written.append(write_text_atomic(markdown, parity_markdown(result.matrices, result.runtimes, lengths, batch)))
    return written
