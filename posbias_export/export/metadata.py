"""Where an export's weights came from (a checkpoint and its hash, or the init seed), and what
torch's exporter writes about this machine that a file must not carry. What a file records about
itself is its FileContract (contract.py)."""
from __future__ import annotations

from pathlib import Path

import onnx

from ..nn import file_sha256


def checkpoint_metadata(checkpoint: str | Path) -> dict[str, str]:
    """Where the weights are (absolute: the file may be validated from another folder) and their hash."""
    return {"checkpoint": str(Path(checkpoint).resolve()), "checkpoint_sha256": file_sha256(checkpoint)}


def source_metadata(checkpoint: str | Path | None, seed: int = 0) -> dict[str, str]:
    """Where an export's weights come from: a checkpoint (its path and hash), else the init seed."""
    return checkpoint_metadata(checkpoint) if checkpoint else {"seed": str(seed)}


# Node metadata torch.onnx writes that names files on the exporting machine (our source and the
# virtual environment's, absolute): nothing a user of the file needs, and not ours to publish.
MACHINE_NODE_KEYS = ("pkg.torch.onnx.stack_trace",)


def drop_machine_paths(proto: onnx.ModelProto) -> None:
    """Remove MACHINE_NODE_KEYS from every node: the graph's, the local functions', and those of
    every subgraph (If / Loop bodies)."""
    from .functions import all_nodes

    for node in [*all_nodes(proto.graph.node), *(n for f in proto.functions for n in all_nodes(f.node))]:
        kept = [p for p in node.metadata_props if p.key not in MACHINE_NODE_KEYS]
        if len(kept) != len(node.metadata_props):
            del node.metadata_props[:]
            node.metadata_props.extend(kept)
