"""Folders of random weights at the sizes people serve, built from published configurations
(bytes are what matter for memory and speed; tiny.py makes the small ones): what the real-size
benches and the GPU lease measure."""
from __future__ import annotations

from pathlib import Path

# Published configurations (the sizes of the Hugging Face checkpoints; random weights here).
PUBLISHED = {
    "bloom-560m": ("BloomForCausalLM", "BloomConfig", dict(vocab_size=250880, hidden_size=1024, n_layer=24, n_head=16)),
    "bloom-3b": ("BloomForCausalLM", "BloomConfig", dict(vocab_size=250880, hidden_size=2560, n_layer=30, n_head=32)),
    "mpt-1b": ("MptForCausalLM", "MptConfig", dict(vocab_size=50432, d_model=2048, n_layers=24, n_heads=16,
                                                   max_seq_len=2048, expansion_ratio=4)),
    "falcon-rw-1b": ("FalconForCausalLM", "FalconConfig", dict(
        vocab_size=50304, hidden_size=2048, num_hidden_layers=24, num_attention_heads=32, alibi=True,
        multi_query=False, new_decoder_architecture=False, parallel_attn=False, bias=True)),
    "t5-base": ("T5ForConditionalGeneration", "T5Config", dict(vocab_size=32128, d_model=768, d_kv=64, d_ff=3072,
                                                               num_layers=12, num_heads=12)),
    "mpt-7b": ("MptForCausalLM", "MptConfig", dict(vocab_size=50432, d_model=4096, n_layers=32, n_heads=32,
                                                   max_seq_len=2048, expansion_ratio=4)),
    # google/umt5-xxl's encoder: the text encoder of current video-generation pipelines (5.7B)
    "umt5-xxl-encoder": ("UMT5EncoderModel", "UMT5Config", dict(
        vocab_size=256384, d_model=4096, d_kv=64, d_ff=10240, num_layers=24, num_heads=64,
        feed_forward_proj="gated-gelu", relative_attention_num_buckets=32,
        relative_attention_max_distance=128)),
}
# Written as published, tensor by tensor into bfloat16 shards (13.3 GB, 11.4 GB): the whole model in
# memory would not leave room for what is measured on a 24 GB machine.
SHARDED = {"mpt-7b": "bfloat16", "umt5-xxl-encoder": "bfloat16"}


def write_folder(name: str, out: Path, dtype: str = "float32", seed: int = 0) -> Path:
    """A folder of random weights for a published configuration (save_pretrained, safetensors)."""
    import torch
    import transformers as tf

    if name in SHARDED:
        from .shards import write_sharded

        return write_sharded(PUBLISHED[name], out, SHARDED[name], seed)
    model_class, config_class, fields = PUBLISHED[name]
    torch.manual_seed(seed)
    config = getattr(tf, config_class)(**fields)
    model = getattr(tf, model_class)._from_config(config, torch_dtype=getattr(torch, dtype))
    model.save_pretrained(out, max_shard_size="2GB")
    return out


def published_folder(name: str, work: Path, dtype: str = "float32", progress=print) -> Path:
    """WORK/<name>: written with random weights for the published configuration if absent; if
    present, checked to BE that configuration (its config.json's fields), so a figure reported for
    a published size was measured on it. ValueError (one line) names the first field that differs."""
    folder = work / name
    if not check_published_folder(name, work):
        progress(f"{name}: writing a random-weight folder ({SHARDED.get(name, dtype)})")
        return write_folder(name, folder, dtype)
    return folder


def check_published_folder(name: str, work: Path) -> bool:
    """True when WORK/<name> is the published configuration, False when it is absent (or empty);
    ValueError (one line) for anything else. Writes nothing: a bench checks every model before it
    makes any folder."""
    from .folder import FolderError, read_json_object

    folder = work / name
    if not (folder / "config.json").is_file():
        if folder.exists() and any(folder.iterdir()):
            raise ValueError(f"{folder} holds files but no config.json: not a model folder this bench made; "
                             "give another --work")
        return False
    try:
        config = read_json_object(folder / "config.json")
    except FolderError as err:
        raise ValueError(str(err)) from None
    for key, value in PUBLISHED[name][2].items():
        if config.get(key) != value:
            raise ValueError(f"{folder} is not the published {name} configuration ({key} is {config.get(key)!r}, "
                             f"not {value!r}); give another --work")
    return True
