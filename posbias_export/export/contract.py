"""The package's side of FileContract (runtimes/common/contract.py, which the runners read too):
writing it into a file, and the checks only the package can make on reading one (our models'
`config` is a ModelConfig; the quantization scheme is what the graph shows)."""
from __future__ import annotations

import dataclasses

import onnx

from ..nn import AttentionSettings
from ..runners import runtimes_common

_contract = runtimes_common("contract")
FileContract = _contract.FileContract
PREFIX, FORMAT_VERSION, IMPORTED = _contract.PREFIX, _contract.FORMAT_VERSION, _contract.IMPORTED


def write_contract(proto: onnx.ModelProto, contract: FileContract) -> None:
    """The file's `posbias.*` metadata_props become exactly `contract`'s; other keys stay."""
    others = {p.key: p.value for p in proto.metadata_props if not p.key.startswith(PREFIX)}
    onnx.helper.set_model_props(proto, {**others, **contract.to_props()})


def read_contract(proto: onnx.ModelProto) -> FileContract:
    """A file's contract, checked as far as the package can: ValueError names what is wrong."""
    contract = FileContract.of(proto)
    if contract.ours:
        model_config(contract)
    return contract


def model_config(contract: FileContract):
    """The ModelConfig our own file records, or ValueError (a forged or damaged `config`)."""
    from ..nn import ModelConfig

    try:
        return ModelConfig.from_dict(dict(contract.config))
    except RecursionError:
        raise ValueError(f"the file's metadata {PREFIX}config is not a model config: nested too deeply") from None
    except (ValueError, TypeError, KeyError) as err:
        raise ValueError(f"the file's metadata {PREFIX}config is not a model config: "
                         f"{str(err).splitlines()[0][:200] if str(err) else type(err).__name__}") from None


def attention_settings_of(contract: FileContract) -> AttentionSettings:
    """The attention form the file was exported in: a reference run in the same form computes
    equal math on real tokens and the same (arbitrary) output on fully padded query rows, and
    in blocks a float64 reference fits at 16k tokens too."""
    from .targets import attention_settings

    block = contract.attention_block or AttentionSettings.block
    return attention_settings(contract.opset, contract.attention, contract.target, block, functions=False)


def with_fields(contract: FileContract, **changes) -> FileContract:
    return dataclasses.replace(contract, **changes)


def split_fields(keys: dict[str, str]) -> dict:
    """Loose string keys (a caller's `metadata=`: where the weights came from, its own notes) as
    contract fields: the known ones typed, the rest kept as the caller's own."""
    known = {f.name for f in dataclasses.fields(FileContract)} - {"quant", "extra"}
    typed = FileContract.from_props({PREFIX + k: v for k, v in keys.items() if k in known})
    return {**{k: getattr(typed, k) for k in keys if k in known},
            "extra": tuple((k, str(v)) for k, v in keys.items() if k not in known)}
