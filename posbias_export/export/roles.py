"""What a file takes and gives, declared by its role (as Optimum declares its ONNX configs by
task): the export's signature names its inputs and outputs from here, and every input name of
every role is made by one generator (runtimes/common/inputs.py) for validate's cases, the benches
and the client checks. A new architecture declares its role (hf/imported.py ImportedModel.role)
and the extra inputs it takes (token_type_ids for a BERT); "past" stands for the cache pairs."""
from __future__ import annotations

from dataclasses import dataclass

PAST = "past"  # the cache pairs in (past_key.N, past_value.N) and out (present_*.N)


@dataclass(frozen=True)
class Role:
    name: str
    inputs: tuple[str, ...]
    outputs: tuple[str, ...]


ROLES = {r.name: r for r in (
    Role("causal-lm", ("input_ids", "attention_mask"), ("logits",)),
    Role("causal-lm-with-past", ("input_ids", "attention_mask", PAST), ("logits", PAST)),
    Role("encoder", ("input_ids", "attention_mask"), ("last_hidden_state",)),
    Role("seq2seq-decoder-with-past",
         ("input_ids", "attention_mask", "encoder_hidden_states", "encoder_attention_mask", PAST), ("logits", PAST)),
    # the clients' merged layout (Optimum's): no mask of its own, a branch flag, the cross cache in PAST too
    Role("seq2seq-decoder-merged", ("input_ids", "encoder_hidden_states", "encoder_attention_mask", "use_cache_branch",
                                    PAST), ("logits", PAST)),
)}


def role(name: str) -> Role:
    if name not in ROLES:
        raise ValueError(f"unknown role {name!r}; roles: {', '.join(ROLES)}")
    return ROLES[name]


def leading_inputs(name: str, extra: tuple[str, ...] = ()) -> list[str]:
    """The role's inputs before the cache, with an architecture's extra inputs after its mask."""
    inputs = [i for i in role(name).inputs if i != PAST]
    at = inputs.index("attention_mask") + 1 if "attention_mask" in inputs else len(inputs)
    return inputs[:at] + list(extra) + inputs[at:]
