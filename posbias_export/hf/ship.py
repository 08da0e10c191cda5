"""A folder the tools people serve with load as it is (`--model DIR --out-dir OUT`):

    OUT/model.onnx                 causal LMs: the cached decoder (prefill with an empty cache),
                                   Hugging Face names (Optimum's ORTModelForCausalLM)
    OUT/onnx/model.onnx            the same file where transformers.js looks
    OUT/encoder_model.onnx,        T5 (an encoder-decoder folder): the encoder, and one decoder
    OUT/decoder_model_merged.onnx  that serves with an empty cache and with a full one
    OUT/onnx/...                   (and the same two for transformers.js)
    OUT/genai_config.json          onnxruntime-genai (causal LMs; "type": "llama" runs our IO)
    OUT/triton/<name>/config.pbtxt, 1/model.onnx   a Triton model repository entry per file
    OUT/config.json, generation_config.json, tokenizer files   copied from the folder (config.json
                                   describing the cache our file holds, where it differs: Falcon)
    OUT/modules.json, 1_Pooling/   an embedder's pooling, as sentence-transformers reads it
    OUT/SERVING.md                 how each of those clients sets session.set_denormal_as_zero on a CPU,
                                   and whether these files need it (hf/cpu_notes.py)

The graphs are our exports (blocked, checked), renamed: nothing about the computation changes.
The copies of one file are hard links where the file system allows. Written into a temporary
folder beside OUT and renamed into place at the end: a failed run leaves nothing.
"""
from __future__ import annotations

import json
import os
import re
import shutil
import tempfile
from dataclasses import dataclass, field
from pathlib import Path

import onnx

from ..export.options import ExportOptions, options_from
from ..export.pipeline import ExportReport
from ..export.targets import target
from ..runners import atomic
from .cpu_notes import FLAG, serving_notes
from .export import export_model
from .folder import check_token_ids, own_file, read_json_object
from .models import has_decoder, load_model

COPIED = ("config.json", "generation_config.json", "tokenizer.json", "tokenizer_config.json", "special_tokens_map.json",
          "vocab.json", "merges.txt", "vocab.txt", "spiece.model", "sentencepiece.bpe.model", "added_tokens.json",
          # a chat model's template, where transformers >= 4.43 saves it (beside tokenizer_config.json)
          "chat_template.jinja", "chat_template.json")
# genai_config's context_length unless --context-length says otherwise: what `generate` allows by
# default. Not the config's max_position_embeddings / max_seq_len: ALiBi files have no position
# table and extrapolating past the training length is what they are for.
DEFAULT_CONTEXT = 8192
MAX_CONTEXT = 2 ** 31 - 1  # onnxruntime-genai keeps it in an int32
# a causal LM's folder unless a target is asked for: the in-place cache file, which every client
# the folder names runs (genai with one buffer; Optimum, transformers.js, Triton, onnxruntime-web
# growing it as the portable file does: docs/serving.md); --target portable for OpenVINO, which has no
# GroupQueryAttention
LM_TARGET = "ort"
NO_GENAI_NOTE = ("no genai_config.json: onnxruntime-genai reads each row's last real token of a right-padded batch, "
                 "which a --logits last file does not give (its rows' last positions); ship without --logits last "
                 "for onnxruntime-genai")
TRITON_MAX_BATCH = 8
_TRITON_TYPES = {onnx.TensorProto.FLOAT: "TYPE_FP32", onnx.TensorProto.FLOAT16: "TYPE_FP16",
                 onnx.TensorProto.INT64: "TYPE_INT64", onnx.TensorProto.INT32: "TYPE_INT32",
                 onnx.TensorProto.BOOL: "TYPE_BOOL"}


@dataclass
class ShipReport:
    out_dir: Path
    files: list[str] = field(default_factory=list)  # relative to out_dir
    exports: list[ExportReport] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)  # about the folder (the exports carry their own)

    def summary(self) -> str:
        lines = [f"wrote {self.out_dir}/: " + ", ".join(self.files)]
        lines += [f"  {Path(r.path).name}: {r.arch} with {r.bias} bias, inputs {', '.join(r.inputs)}" for r in self.exports]
        lines += sorted({f"note: {n}" for r in self.exports for n in r.notes}) + [f"note: {n}" for n in self.notes]
        return "\n".join(lines)


def _link(source: Path, target: Path) -> None:
    target.parent.mkdir(parents=True, exist_ok=True)
    try:
        os.link(source, target)
    except OSError:  # another file system, or links not allowed: a copy
        shutil.copy2(source, target)


def _check_out_dir(out: Path, model_dir: Path) -> None:
    if out.is_symlink():  # dangling, or to a folder elsewhere: the rename at the end would not land there
        raise OSError(f"refusing to write {out}: it is a symbolic link (give the real folder's path)")
    if out.exists() and (not out.is_dir() or any(out.iterdir())):
        raise OSError(f"refusing to write into {out}: it exists and is not an empty folder (remove it or choose another)")
    parent = out.parent if str(out.parent) else Path(".")
    if not parent.is_dir():
        raise OSError(f"cannot write {out}: folder {parent} does not exist")
    resolved, source = out.resolve(), model_dir.resolve()
    if resolved == source or resolved.is_relative_to(source) or source.is_relative_to(resolved):
        raise OSError(f"refusing to write {out}: it overlaps the model folder {model_dir}")
    try:  # before the (slow) exports; the only reliable test (root ignores permission bits)
        tempfile.TemporaryDirectory(dir=parent, prefix=f".{out.name}.probe-").cleanup()
    except OSError as err:
        raise OSError(f"cannot write {out}: folder {parent} is not writable ({err.strerror})") from None


def copied_files(source: Path) -> list[Path]:
    """The folder's files copied into the serving folder (tokenizer, configs), each the folder's
    own (folder.own_file: a link to a file elsewhere, a secret, a key, is refused, not copied into
    what people upload), and each JSON file parsed: a truncated tokenizer.json would make every
    client fail later, so it is refused now, by name."""
    found = []
    for name in COPIED:
        path = source / name
        if not path.exists():
            continue  # absent, or a dangling link: nothing to copy
        found.append(own_file(source, path))
        if name.endswith(".json"):
            read_json_object(path)
    return found


def genai_config(model, config: dict, generation: dict, filename: str = "model.onnx", gpu: bool = False,
                 context: int = DEFAULT_CONTEXT, shared_buffer: bool = False) -> dict:
    """onnxruntime-genai's config for our cached decoder: its "llama" type runs any decoder
    with input_ids, attention_mask and a per-layer cache under name templates. shared_buffer (a
    --target ort file, whose cache is written in place): genai binds past and present to one
    [B, H, max_length, d] buffer; otherwise the cache grows by copying. gpu: the CUDA provider.
    Token ids were checked (folder.check_token_ids) when the folder was read."""
    def token(key, default):
        value = generation.get(key, config.get(key))
        if isinstance(value, list):  # only eos may be a list (folder.check_token_ids): genai stops at any of them
            return value if key == "eos_token_id" and len(value) > 1 else value[0]
        return default if value is None else value

    return {
        "model": {
            "bos_token_id": token("bos_token_id", 1), "eos_token_id": token("eos_token_id", 2),
            "pad_token_id": token("pad_token_id", 0), "context_length": context, "vocab_size": model.vocab_size,
            "type": "llama",
            "decoder": {
                # a dotted key there is an ONNX Runtime session config entry (cpu_notes.py: measured)
                "session_options": {"log_id": "onnxruntime-genai", "provider_options": [{"cuda": {}}] if gpu else [],
                                    FLAG: "1"},
                "filename": filename, "head_size": model.head_dim, "hidden_size": model.head_dim * model.num_heads,
                "num_attention_heads": model.num_heads, "num_key_value_heads": model.num_kv_heads,
                "num_hidden_layers": model.num_layers,
                "inputs": {"input_ids": "input_ids", "attention_mask": "attention_mask",
                           "past_key_names": "past_key_values.%d.key", "past_value_names": "past_key_values.%d.value"},
                "outputs": {"logits": "logits", "present_key_names": "present.%d.key",
                            "present_value_names": "present.%d.value"},
            },
        },
        "search": {"do_sample": False, "num_beams": 1, "num_return_sequences": 1, "max_length": context, "min_length": 0,
                   "past_present_share_buffer": shared_buffer, "repetition_penalty": 1.0, "temperature": 1.0, "top_k": 1,
                   "top_p": 1.0, "early_stopping": True, "length_penalty": 1.0, "no_repeat_ngram_size": 0,
                   "diversity_penalty": 0.0},
    }


def triton_config(path: Path, name: str, max_batch: int = TRITON_MAX_BATCH, gpu: bool = False) -> str:
    """A Triton model configuration (onnxruntime backend) for the file at `path`: every input
    and output with its type and dims read from the file, the batch axis (first) left to
    Triton (max_batch_size, dynamic batching), every other symbolic axis -1. A file with an
    input that has no batch axis (the T5 decoder's use_cache_branch [1]: requests batched along
    it would not be one flag) gets max_batch_size 0 and every axis declared. gpu: instances on
    the GPUs (KIND_GPU), else on the CPU."""
    graph = onnx.load(str(path), load_external_data=False).graph
    batched = all(v.type.tensor_type.shape.dim and not v.type.tensor_type.shape.dim[0].HasField("dim_value")
                  for v in graph.input)

    def entries(values) -> str:
        rows = []
        for value in values:
            t = value.type.tensor_type
            dims = [d.dim_value if d.HasField("dim_value") else -1 for d in t.shape.dim][1 if batched else 0:]
            rows.append(f'  {{\n    name: "{value.name}"\n    data_type: {_TRITON_TYPES[t.elem_type]}\n'
                        f'    dims: [ {", ".join(map(str, dims))} ]\n  }}')
        return ",\n".join(rows)

    return (f'name: "{name}"\nplatform: "onnxruntime_onnx"\nmax_batch_size: {max_batch if batched else 0}\n'
            f"input [\n{entries(graph.input)}\n]\noutput [\n{entries(graph.output)}\n]\n"
            + ("dynamic_batching { }\n" if batched else "")
            + f"instance_group [ {{ kind: {'KIND_GPU' if gpu else 'KIND_CPU'} }} ]\n")


def _triton_name(text: str) -> str:
    """A model name Triton accepts and a path cannot climb out with ('..' names none)."""
    return re.sub(r"[^A-Za-z0-9_.-]", "_", text).lstrip(".") or "model"


def _position_limit(config: dict) -> int | None:
    return next((config[k] for k in ("max_seq_len", "n_positions", "max_position_embeddings", "seq_length")
                 if isinstance(config.get(k), int)), None)


def ship(model_dir, out_dir, options: ExportOptions | None = None, **option_fields) -> ShipReport:
    """Write the serving folder of the model in `model_dir` to `out_dir` (see the module
    docstring); ValueError for a bad folder or option, OSError for an output that exists or
    overlaps. `options`: an ExportOptions or its fields as keywords; the folder decides the
    files (kv_cache, part), so those are refused. logits: the cached decoder's: "all" (every
    position), or "last" ([B, 1, V]: no [B, L, V] tensor for a long prompt; Optimum,
    transformers.js and our generate read only that, but onnxruntime-genai reads each row's last
    real token of a right-padded batch, which the last position is not: such a folder has no
    genai_config.json, and the report says why). dtype, target: as
    export_model's; a GPU target makes the folder GPU-ready (onnxruntime-genai on the CUDA
    provider, Triton instances KIND_GPU). quantize: a schemes.Scheme for the folder's files.
    context_length: genai_config's (default DEFAULT_CONTEXT, not the config's position limit).
    target: a causal LM's folder is LM_TARGET's unless `options` (its target not None) or a
    `target` keyword says otherwise. Everything the folder supplies is checked before the first
    export starts."""
    chosen = "target" in option_fields or (options is not None and options.target is not None)
    options = options_from(options, option_fields)
    source, out = Path(model_dir), Path(out_dir)
    source = source.resolve() if source.name in ("", ".", "..") else source  # its name names Triton's entry
    _check_request(options, out, source)
    model = load_model(source, lazy=True)
    if not chosen:
        options = options.replace(target=LM_TARGET if model.arch == "lm" else "portable")
    _check_lm_options(model, options)
    config = read_json_object(source / "config.json")
    generation_file = source / "generation_config.json"
    generation = read_json_object(generation_file) if generation_file.is_file() else {}
    check_token_ids(generation, generation_file, model.vocab_size)
    copied = copied_files(source)
    chosen_target, context = target(options.target), options.context_length
    gpu = chosen_target.gpu  # the GPU targets; ort's in-place cache runs on either
    # a --logits last file gives each row's last position, and genai reads each row's last real token of a
    # right-padded batch there: a folder names only the clients that run it right
    genai = genai_config(model, config, generation, gpu=gpu, shared_buffer=chosen_target.inplace_cache,
                         context=DEFAULT_CONTEXT if context is None else context) \
        if model.arch == "lm" and options.logits != "last" else None
    report = ShipReport(out)
    if model.arch == "lm" and genai is None:
        report.notes.append(NO_GENAI_NOTE)
    with atomic().temporary_folder(out) as tmp:  # named after this process: a killed run's is swept later
        stage = Path(tmp) / "out"
        stage.mkdir()
        files = _export_files(source, stage, model, options, report)
        if genai is not None:
            (stage / "genai_config.json").write_text(json.dumps(genai, indent=1))
            report.notes.append(_context_note(genai["model"]["context_length"], context, config))
        _lay_out(stage, files, gpu=gpu, onnx_names=_transformers_js_names(source, model, options))
        _write_companions(stage, source, copied, model, config)
        role = "lm" if model.arch == "lm" else "seq2seq" if has_decoder(source) else "encoder"
        fused = chosen_target.inplace_cache or chosen_target.fused_op is not None
        (stage / "SERVING.md").write_text(serving_notes(role, fused))
        if out.exists():
            out.rmdir()  # checked empty above
        os.replace(stage, out)
    report.files = sorted(str(p.relative_to(out)) for p in out.rglob("*") if p.is_file())
    for r in report.exports:
        r.path = str(out / Path(r.path).name)
    return report


def _check_request(options: ExportOptions, out: Path, source: Path) -> None:
    """What a serving folder refuses before it reads the model: options the folder decides, an
    output that exists or overlaps, a context length out of range."""
    decided = [name for name, on in (("kv_cache", options.kv_cache), ("part", options.part != "encoder"),
                                     ("attention_mask", options.attention_mask)) if on]
    if decided:
        raise ValueError(f"a serving folder decides its files' {', '.join(decided)}; drop it")
    _check_out_dir(out, source)
    context = options.context_length
    if context is not None and (isinstance(context, bool) or not isinstance(context, int)
                                or not 0 < context <= MAX_CONTEXT):
        raise ValueError(f"context_length must be an integer in [1, {MAX_CONTEXT}], got {context!r}")


def _check_lm_options(model, options: ExportOptions) -> None:
    """--logits last and --context-length name a causal LM's generation file and genai_config.json."""
    if model.arch == "lm":
        return
    dropped = [f for f, on in (("--logits last", options.logits == "last"),
                               ("--context-length", options.context_length is not None)) if on]
    if dropped:
        raise ValueError(f"{', '.join(dropped)} apply to a causal LM's folder (a generation file and "
                         f"genai_config.json); {model.model_type}'s folder has neither")


def _write_companions(stage: Path, source: Path, copied, model, config: dict) -> None:
    """Beside the ONNX files: the tokenizer files copied, the config as shipped, the model's own
    serving files (e.g. sentence-transformers' pooling)."""
    for path in copied:
        shutil.copy2(path.resolve(), stage / path.name)
    (stage / "config.json").write_text(json.dumps(model.shipped_config(config), indent=2))
    for name, content in model.serving_files().items():
        (stage / name).parent.mkdir(parents=True, exist_ok=True)
        (stage / name).write_text(json.dumps(content, indent=1))


def _export_files(source: Path, stage: Path, model, options: ExportOptions, report: ShipReport) -> dict[str, str]:
    """The folder's ONNX files, exported into `stage`: file name -> its Triton entry's name."""
    def export(name: str, **changes):
        report.exports.append(export_model(source, stage / name, options.replace(**changes), names="huggingface",
                                           shipped=True))

    if model.arch == "lm":
        export("model.onnx", kv_cache=True)
        return {"model.onnx": _triton_name(source.name)}
    if has_decoder(source):
        export("encoder_model.onnx")
        export("decoder_model_merged.onnx", part="decoder")
        return {"encoder_model.onnx": _triton_name(source.name + "_encoder"),
                "decoder_model_merged.onnx": _triton_name(source.name + "_decoder")}
    export("model.onnx")  # an encoder alone (T5EncoderModel): feature extraction
    return {"model.onnx": _triton_name(source.name)}


# transformers.js picks an embedder's file in onnx/ by its dtype option: "q8" model_quantized.onnx,
# "q4" model_q4.onnx ("fp32" model.onnx)
TRANSFORMERS_JS_NAMES = {"int8": "model_quantized.onnx", "int4": "model_q4.onnx"}


def _transformers_js_names(source: Path, model, options: ExportOptions) -> dict[str, str]:
    """A quantized embedder's file under the name transformers.js loads it by, so that its fp32
    name never holds quantized weights; {} for every other folder (their clients take one name)."""
    if options.quantize is None or model.arch != "encoder" or has_decoder(source):
        return {}
    return {"model.onnx": TRANSFORMERS_JS_NAMES[options.quantize.name]}


def _lay_out(stage: Path, files: dict[str, str], gpu: bool, onnx_names: dict[str, str]) -> None:
    """Each file linked where its clients look: onnx/ (transformers.js; onnx_names: a file's own
    name there) and triton/NAME/1/."""
    for name, triton in files.items():
        _link(stage / name, stage / "onnx" / onnx_names.get(name, name))
        _link(stage / name, stage / "triton" / triton / "1" / "model.onnx")
        data = name + ".data"  # the tensors of a model over ~2 GB: the file names it, beside itself
        if (stage / data).is_file():
            _link(stage / data, stage / "onnx" / data)
            _link(stage / data, stage / "triton" / triton / "1" / data)
        (stage / "triton" / triton / "config.pbtxt").write_text(triton_config(stage / name, triton, gpu=gpu))


def _context_note(context: int, given: int | None, config: dict) -> str:
    limit = _position_limit(config)
    return (f"genai_config.json: context_length {context} ("
            + ("--context-length" if given is not None else "the default; --context-length sets it")
            + (f"; the config's position limit {limit} is not a cap: these files extrapolate" if limit else "") + ")")
