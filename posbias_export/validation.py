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
        from .parity.loop import check_runtimes

        check_runtimes(runtimes)
        return tuple(runtimes), {}
    chosen, missing = installed_defaults()
    if not chosen:
        raise ValueError("none of the default runtimes is installed; name some with --runtimes")
    return chosen, missing


def default_lengths(contract) -> tuple[int, ...]:
    return (1, 17, DEFAULT_LENGTH_FACTOR * contract.trace_len)


def is_imported(contract, model_dir) -> bool:
    """A file to judge against a Hugging Face model: --model given, or our export of one."""
    return bool(model_dir) or contract.imported


def own_file_bytes(contract, length: int, batch: int) -> float:
    """Memory of one case of our own file: the float64 reference in the file's attention form,
    or a runtime's float32 run, whichever is larger, and the logits of both."""
    from .limits import attention_bytes

    heads, dim, layers, vocab = (int(contract.config_value(k, d)) for k, d in (
        ("num_heads", 4), ("dim", 128), ("num_layers", 2), ("vocab_size", 256)))
    blocked = contract.attention == "blocked" and contract.attention_block
    rows = min(length, contract.attention_block) if blocked else length
    reference = attention_bytes(batch, heads, rows, length, 8) + 12.0 * batch * length * dim * 8 * layers
    runtime = attention_bytes(batch, heads, rows, length, 4, 4)
    return max(reference, runtime) + 3.0 * batch * length * vocab * 8


def check_sizes(files, lengths, batch: int, ignore: bool) -> None:
    """Refuse, before anything runs, a length or batch this machine cannot hold."""
    from .limits import check_fits

    for file in files:
        if file.contract.imported:
            continue  # hf/validate.py estimates with the folder's model
        for length in lengths or default_lengths(file.contract):
            check_fits(own_file_bytes(file.contract, length, batch),
                       f"validating {file.path} at length {length}, batch {batch}", ignore)


def check_input_sizes(files, feeds: dict, ignore: bool) -> None:
    """--inputs: the batch and length the user's tensors imply ([B, L, ...]), refused as a
    generated length would be (a million tokens is a run this machine cannot hold)."""
    from .limits import check_fits

    shaped = [a.shape for a in feeds.values() if a.ndim >= 2]
    if not shaped:
        return
    batch, length = max(s[0] for s in shaped), max(s[1] for s in shaped)
    for file in files:
        if not file.contract.imported:
            check_fits(own_file_bytes(file.contract, length, batch), f"validating {file.path} on --inputs (batch "
                       f"{batch}, length {length})", ignore)


@dataclass(frozen=True)
class Session:
    """What every file of one validate run is judged with."""

    runtimes: tuple[str, ...]
    defaults: bool  # the runtimes are validate's defaults (a quantized file leaves the reference out)
    lengths: tuple[int, ...] | None
    batch: int
    checkpoint: str | None = None
    feeds: dict | None = None
    model_dir: str | None = None
    progress: object = None
    ignore_size_limits: bool = False
    order: bool = True


def file_plan(file, session: Session, lengths):
    """The one place that says which plan a file gets: our own export (parity/matrix.py), a
    T5 decoder or quantized encoder by the logits it leads to (hf/validate_seq2seq.py), any
    other file of a Hugging Face model against that model (hf/validate.py; a quantized
    encoder of a folder without a decoder, an embedder, on its embeddings)."""
    if not is_imported(file.contract, session.model_dir):
        from .parity.matrix import own_plan
        from .parity.reference import load_model_file

        return own_plan(load_model_file(file), lengths, session.batch, session.checkpoint, session.feeds)
    role = file.seq2seq_role
    if role == "decoder" or (role == "encoder" and file.scheme and not is_embedder(file, session)):
        from .hf.validate_seq2seq import seq2seq_plan

        return seq2seq_plan({role: file}, session.model_dir, lengths, session.batch, session.ignore_size_limits)
    from .hf.validate import hf_plan

    return hf_plan(file, session.model_dir, lengths, session.batch, session.ignore_size_limits)


def is_embedder(file, session: Session) -> bool:
    """An encoder file whose folder has no decoder: what it is for is its embeddings."""
    from .hf.models import has_decoder

    folder = session.model_dir or file.contract.model_dir
    return bool(folder) and Path(folder).is_dir() and not has_decoder(folder)


def judge_file(file, session: Session, result: Validation):
    from .parity.loop import measure

    runtimes = runnable(session.runtimes, session.defaults, [file], result)
    plan = file_plan(file, session, session.lengths or default_lengths(file.contract))
    return measure(plan, runtimes, order=session.order, progress=session.progress)


def validate(models, runtimes=None, lengths=None, batch: int = 3, checkpoint=None, inputs=None, model_dir=None,
             progress=None, ignore_size_limits: bool = False, order: bool = True) -> Validation:
    """Every file on every runtime against its float64 reference, and the order protocol unless
    order=False. `inputs`: a path to an .npz of the user's own tensors (instead of generated
    lengths). Each file is read and checked once. Lengths and batches this machine cannot hold
    are refused first (limits.py) unless ignore_size_limits."""
    from .parity.reference import ModelFile, read_npz

    chosen, skipped = choose_runtimes(runtimes)
    files = [ModelFile.read(m) for m in models]
    imported = [f for f in files if is_imported(f.contract, model_dir)]
    if inputs and imported:  # its plan is built from the Hugging Face model, on lengths: the inputs would go unread
        from .parity.reference import ParityInputError

        raise ParityInputError(f"--inputs judges our own exports on the user's tensors; {imported[0].path.name} was "
                               "exported from a Hugging Face folder and is judged against transformers on generated "
                               "lengths: drop --inputs (choose lengths with --lengths)")
    if not inputs:
        check_sizes(files, lengths, batch, ignore_size_limits)
    feeds = read_npz(inputs, ignore_size_limits) if inputs else None
    if feeds:
        check_input_sizes(files, feeds, ignore_size_limits)
    result = Validation(runtimes=chosen, skipped=skipped)
    session = Session(chosen, runtimes is None, lengths, batch, checkpoint, feeds, model_dir, progress,
                      ignore_size_limits, order)
    result.matrices += [judge_file(file, session, result) for file in files]
    for encoder, decoder, folder in seq2seq_pairs(files, model_dir):  # as a client runs them: one into the other
        result.matrices.append(judge_pair(encoder, decoder, folder, session, result))
    return result


def judge_pair(encoder, decoder, folder, session: Session, result: Validation):
    """An encoder file's states fed to the decoder file on each runtime (no order rows: each
    file's ran in its own matrix)."""
    from .hf.validate_seq2seq import seq2seq_plan
    from .parity.loop import measure

    runtimes = runnable(session.runtimes, session.defaults, [encoder, decoder], result)
    plan = seq2seq_plan({"encoder": encoder, "decoder": decoder}, folder,
                        session.lengths or default_lengths(decoder.contract), session.batch, session.ignore_size_limits)
    return measure(plan, runtimes, order=False, progress=session.progress)


def runnable(chosen: tuple[str, ...], defaults: bool, files: list, result: Validation) -> tuple[str, ...]:
    """The runtimes to run these files (ModelFile) on: the runtimes named, or of the defaults
    those the capability table (parity/capabilities.py) says can run them, noting why the others
    cannot, with those a file's feature adds (ort-cpu-shared for an in-place cache)."""
    if not defaults:
        return chosen
    from .parity.capabilities import runnable as capable

    out, skipped = capable(chosen, files)
    result.skipped.update(skipped)
    return out


def seq2seq_pairs(files, model_dir=None) -> list[tuple]:
    """(encoder file, decoder file, folder) for each folder of which exactly one encoder and one
    decoder file were given (the folder: --model, else each file's recorded model_dir)."""
    roles: dict = {}
    for file in files:
        folder = model_dir or file.contract.model_dir
        if not is_imported(file.contract, model_dir) or not folder:
            continue
        if file.seq2seq_role:
            roles.setdefault(str(Path(folder).resolve()), {}).setdefault(file.seq2seq_role, []).append(file)
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
