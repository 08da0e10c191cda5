"""The PyTorch side of a parity check: the model a file was exported from, rebuilt from the
file's metadata, the inputs to compare on, and its outputs in any dtype."""
from __future__ import annotations

import copy
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import onnx
import torch

from ..errors import first_line
from ..runners import runtimes_common
from ..export import INPUT_NAMES
from ..export.contract import FileContract, model_config, read_contract
from ..nn import EAGER, AttentionSettings, build_model, file_sha256, load_checkpoint


class ParityInputError(ValueError):
    pass


def read_onnx(path: str | Path) -> onnx.ModelProto:
    """Any ONNX file's graph, checked (external weights are not read: what validate asks of the
    proto is its graph and contract; the runners load the file themselves); a missing or corrupt
    file is one ParityInputError line."""
    path = Path(path)
    if not path.is_file():
        raise ParityInputError(f"model {path} does not exist")
    try:
        proto = onnx.load(str(path), load_external_data=False)
        # the checker finds a proto's external files in the WORKING folder; given the path, beside it
        external = any(t.data_location == onnx.TensorProto.EXTERNAL for t in proto.graph.initializer)
        onnx.checker.check_model(str(path) if external else proto)
    except Exception as err:
        raise ParityInputError(f"model {path} is not a valid ONNX file: {first_line(err, 200)}") from None
    return proto


def read_npz(path: str | Path, ignore_size_limits: bool = False) -> dict[str, np.ndarray]:
    """Named arrays from an .npz archive; anything else (an .npy, random bytes, pickles, a
    member that is not an array) is one line. The members' unpacked sizes are checked against
    this machine's memory before any is read (a 1 MB archive may unpack to gigabytes)."""
    import zipfile

    from ..limits import TooBig, check_fits

    if not zipfile.is_zipfile(path):
        reason = "does not exist" if not Path(path).exists() else "is not an .npz archive (np.savez(path, input_ids=...))"
        raise ParityInputError(f"inputs {path} {reason}")
    try:
        with zipfile.ZipFile(path) as archive:
            unpacked = sum(info.file_size for info in archive.infolist())
        check_fits(unpacked, f"reading inputs {path} ({unpacked / 1e9:.1f} GB unpacked)", ignore_size_limits)
        with np.load(path, allow_pickle=False) as data:
            arrays = {k: data[k] for k in data.files}
    except TooBig:
        raise
    except Exception as err:  # noqa: BLE001 - numpy's and zipfile's errors for a damaged member vary
        raise ParityInputError(f"cannot read inputs {path}: {first_line(err)} (each member must be an array)") from None
    bad = [k for k, v in arrays.items() if not isinstance(v, np.ndarray) or v.dtype == object]
    if bad:
        raise ParityInputError(f"cannot read inputs {path}: member {bad[0]} is not an array of numbers")
    return arrays


@dataclass(frozen=True)
class ModelFile:
    """An ONNX file read and checked once per validate run: the parsed model, what it says it is
    (its FileContract, checked), and the quantization scheme its graph shows (the policy that
    judges it: a label alone never chooses one, export/quantize/schemes.py)."""

    path: Path
    proto: onnx.ModelProto
    contract: FileContract
    scheme: str | None = None

    @classmethod
    def read(cls, path: str | Path) -> "ModelFile":
        from ..export.quantize.schemes import checked_scheme

        proto = read_onnx(path)
        try:
            contract = read_contract(proto)
            scheme = checked_scheme(proto, contract.quantized)
        except ValueError as err:
            raise ParityInputError(f"{path}: {err}") from None
        return cls(Path(path), proto, contract, scheme)

    @property
    def inplace_cache(self) -> bool:
        """Whether the file writes its cache in place: from its graph (GroupQueryAttention), not its
        label (runtimes/common/graph_facts.py)."""
        from .runtimes import runtimes_common

        return runtimes_common("graph_facts").facts_of(self.proto).inplace_cache

    @property
    def float16_cache(self) -> bool:
        """A float32 file whose cache is float16 (--kv-dtype float16): from its graph."""
        from ..export.quantize.kv_float16 import has_float16_cache

        return has_float16_cache(self.proto)

    @property
    def seq2seq_role(self) -> str | None:
        """"decoder" for a file fed an encoder's states, "encoder" for one whose output is
        last_hidden_state, else None."""
        if any(i.name == "encoder_hidden_states" for i in self.proto.graph.input):
            return "decoder"
        out = self.proto.graph.output
        return "encoder" if out and out[0].name == "last_hidden_state" else None


def model_file(model: "str | Path | ModelFile") -> ModelFile:
    return model if isinstance(model, ModelFile) else ModelFile.read(model)


def load_model_file(path: "str | Path | ModelFile") -> ModelFile:
    """A file we wrote from one of our own models."""
    file = model_file(path)
    if file.contract.imported:
        raise ParityInputError(f"model {file.path} was exported from a Hugging Face folder: validate it with --model DIR")
    if not file.contract.ours:
        raise ParityInputError(f"model {file.path} has no posbias metadata: export it with posbias_export")
    return file


def reference_model(contract: FileContract, checkpoint: str | None = None) -> torch.nn.Module:
    """The PyTorch model a file was exported from, rebuilt from its contract."""
    cfg, arch = model_config(contract), contract.arch
    checkpoint = checkpoint or contract.checkpoint
    if checkpoint:
        if not Path(checkpoint).is_file():
            raise ParityInputError(f"checkpoint {checkpoint} (needed for this model's weights) does not exist; "
                                   "pass --checkpoint with its new path")
        recorded = contract.checkpoint_sha256
        if recorded and file_sha256(checkpoint) != recorded:
            raise ParityInputError(f"checkpoint {checkpoint} is not the file this model was exported from "
                                   f"(sha256 differs from the recorded {recorded[:12]}...)")
        model = load_checkpoint(checkpoint, cfg, arch)
    else:
        model = build_model(cfg, seed=contract.seed or 0, arch=arch)
    return CachedLogits(model, contract.logits == "last") if contract.kv_cache else model


class CachedLogits(torch.nn.Module):
    """A --kv-cache file's first output from its flat inputs: (input_ids [B, L], attention_mask
    [B, P+L], past_key.0, past_value.0, ...) -> logits [B, L, V] (last: [B, 1, V], the last
    position's, as a file exported with logits="last" returns), through the model's cache path."""

    def __init__(self, lm: torch.nn.Module, last: bool = False):
        super().__init__()
        self.lm, self.last = lm, last

    def forward(self, input_ids, attention_mask, *past_flat, settings: AttentionSettings = EAGER):
        past = [(past_flat[2 * i], past_flat[2 * i + 1]) for i in range(len(past_flat) // 2)]
        logits = self.lm.step(input_ids, attention_mask, past, settings=settings)[0]  # [B, L, V]
        return logits[:, -1:] if self.last else logits


CACHE_LEN = 5  # a --kv-cache file is validated on a step with this many cached positions before it


def generated_inputs(contract: FileContract, length: int, batch: int, seed: int,
                     inplace: bool = False) -> dict[str, np.ndarray]:
    """inplace: the file writes its cache in place (ModelFile.inplace_cache, from its graph)."""
    cfg, arch = model_config(contract), contract.arch
    gen = torch.Generator().manual_seed(seed)
    dtype = np.float16 if contract.dtype == "float16" else np.float32
    cache_dtype = np.float16 if contract.kv_dtype == "float16" else dtype  # --kv-dtype float16
    if arch == "lm":
        feeds = {"input_ids": torch.randint(0, cfg.vocab_size, (batch, length), generator=gen).numpy()}
    elif arch == "attention":
        shape = (batch, cfg.num_heads, length, cfg.head_dim)
        return {name: torch.randn(shape, generator=gen).numpy().astype(dtype) for name in INPUT_NAMES[arch]}
    else:
        feeds = {"hidden_states": torch.randn(batch, length, cfg.dim, generator=gen).numpy().astype(dtype)}
    if contract.kv_cache:  # a decode step after CACHE_LEN cached positions (random keys and values)
        # an in-place file as its clients run it: a prompt into an empty cache, or one token after
        # cached ones (GroupQueryAttention's CPU kernel takes several new tokens after a cache at batch 1 only)
        cached = CACHE_LEN if length == 1 or not inplace else 0
        feeds["attention_mask"] = np.ones((batch, cached + length), dtype=np.int64)
        shape = (batch, cfg.num_heads, cached, cfg.head_dim)
        for layer in range(cfg.num_layers):
            for kind in ("key", "value"):
                feeds[f"past_{kind}.{layer}"] = torch.randn(shape, generator=gen).numpy().astype(cache_dtype)
        return feeds
    if contract.attention_mask:
        feeds["attention_mask"] = np.ones((batch, length), dtype=np.int64)
    return feeds


def torch_args(contract: FileContract, feeds: dict[str, np.ndarray]) -> tuple:
    """The model's positional arguments for a runner's named inputs."""
    arch = contract.arch
    if arch == "attention":
        return tuple(torch.from_numpy(feeds[name]) for name in INPUT_NAMES[arch])
    first = torch.from_numpy(feeds[INPUT_NAMES[arch][0]])
    if "attention_mask" not in feeds:
        return (first,)
    mask = torch.from_numpy(feeds["attention_mask"])
    if contract.kv_cache:  # CachedLogits' order: past_key.0, past_value.0, past_key.1, ...
        past_entry = runtimes_common("cache").past_entry
        layers = sum(1 for name in feeds if (past_entry(name) or (0, ""))[1] == "key")
        # an int8 cache (--kv-dtype int8) is judged on prompts into an empty one: its values never reach the reference
        past = [torch.from_numpy(feeds[f"past_{kind}.{i}"]).float() if feeds[f"past_{kind}.{i}"].dtype == np.int8
                else torch.from_numpy(feeds[f"past_{kind}.{i}"]) for i in range(layers) for kind in ("key", "value")]
        return (first, mask, *past)
    return (first, mask) if arch == "lm" else (first, None, mask)


_DEVICE = ["cpu"]  # where torch_outputs runs: validate --reference-device


def use_reference_device(device: str) -> None:
    """Run the PyTorch references (float64 and the floors) on `device`: "cuda" makes a float64
    reference at 32768 tokens take seconds instead of minutes; matmuls stay exact (TF32 off)."""
    if device == "cuda":
        if not torch.cuda.is_available():
            raise ParityInputError("--reference-device cuda: PyTorch sees no CUDA GPU here")
        torch.backends.cuda.matmul.allow_tf32 = False
        torch.backends.cudnn.allow_tf32 = False
    elif device != "cpu":
        raise ParityInputError(f"unknown reference device {device!r}; choose cpu or cuda")
    _DEVICE[0] = device


@torch.no_grad()
def torch_outputs(model: torch.nn.Module, inputs: tuple, dtype: torch.dtype,
                  settings: AttentionSettings = EAGER) -> np.ndarray:
    """Run a copy of `model` in `dtype` (float inputs cast too) on the reference device;
    returns a float64 numpy array."""
    device = _DEVICE[0]
    m = copy.deepcopy(model).to(device=device, dtype=dtype).eval()
    cast = tuple(t.to(device=device, dtype=dtype if t.is_floating_point() else t.dtype)
                 if isinstance(t, torch.Tensor) else t for t in inputs)
    return m(*cast, settings=settings).to(torch.float64).cpu().numpy()

