"""Every end-of-sequence id stops generation, as transformers does: a folder whose
generation_config.json names several (`eos_token_id: [2, 21]`, common in instruct models) stops
`generate`, the T5 runner and onnxruntime-genai (through the genai_config.json --out-dir writes)
at the first token that is any of them. Before, only the first id of the list stopped anything."""
from __future__ import annotations

import json

import numpy as np
import pytest
import torch

from posbias_export.hf.tiny import EOS, PAD, save_tiny_folder, save_tokenizer
from posbias_export.parity.runtimes import load_runner
from posbias_export.runners import runtimes_common

tf = pytest.importorskip("transformers")
PROMPT = [5, 9, 14, 3, 22, 7]
NEW = 12


def with_second_stop(folder, model_class, **call) -> list[int]:
    """Names a second end-of-sequence id: a token transformers generates greedily after at least one
    other (the first that is new, and not the first id), in generation_config.json; returns transformers' tokens
    with both ids stopping it (they end at that token)."""
    model = model_class.from_pretrained(folder).eval()
    ids = torch.tensor([PROMPT])
    with torch.no_grad():
        free = model.generate(input_ids=ids, max_new_tokens=NEW, do_sample=False, eos_token_id=None, pad_token_id=PAD,
                              **call)[0].tolist()
    new = free[len(free) - NEW:]
    stop = next(t for i, t in enumerate(new) if i >= 1 and t not in new[:i] and t != EOS)
    config_file = folder / "generation_config.json"
    config = json.loads(config_file.read_text())
    config["eos_token_id"] = [EOS, stop]
    config_file.write_text(json.dumps(config))
    model = model_class.from_pretrained(folder).eval()
    with torch.no_grad():
        stopped = model.generate(input_ids=ids, max_new_tokens=NEW, do_sample=False, pad_token_id=PAD, **call)[0].tolist()
    assert stopped[-1] == stop and len(stopped) < len(free)  # transformers stops at the second id
    return stopped[len(stopped) - len(new[:new.index(stop) + 1]):]


def test_the_runtimes_vocabulary_keeps_every_stop_id(tmp_path):
    save_tokenizer(tmp_path)
    (tmp_path / "generation_config.json").write_text(json.dumps({"eos_token_id": [2, 21]}))
    vocab = runtimes_common("vocabulary").TokenizerVocabulary(tmp_path / "tokenizer.json")
    assert vocab.eos_ids == (2, 21) and vocab.pad_id == 2  # no pad id: transformers pads with the first
    assert vocab.until_eos([5, 21, 2, 7]) == [5, 21]


def test_generate_and_genai_stop_at_any_stop_id(tmp_path):
    from posbias_export.hf.ship import ship

    source = save_tiny_folder("bloom", tmp_path / "bloom", client=True)
    save_tokenizer(source)
    want = with_second_stop(source, tf.AutoModelForCausalLM)
    ship(source, tmp_path / "out", check_growth=False)
    vocab = runtimes_common("vocabulary").TokenizerVocabulary(tmp_path / "out" / "tokenizer.json")
    gen = load_runner("ort/generate.py")
    decoder = gen.CachedDecoder(str(tmp_path / "out" / "model.onnx"))
    assert gen.generate(decoder, [PROMPT], NEW, eos_ids=vocab.eos_ids, pad_id=vocab.pad_id)[0] == want
    og = pytest.importorskip("onnxruntime_genai", reason="onnxruntime-genai not installed")
    assert json.loads((tmp_path / "out" / "genai_config.json").read_text())["model"]["eos_token_id"] == [EOS, want[-1]]
    model = og.Model(str(tmp_path / "out"))
    params = og.GeneratorParams(model)
    params.set_search_options(max_length=len(PROMPT) + NEW, do_sample=False)
    generator = og.Generator(model, params)
    generator.append_tokens(np.array([PROMPT], np.int32))
    while not generator.is_done():
        generator.generate_next_token()
    assert list(map(int, generator.get_sequence(0)))[len(PROMPT):] == want[:-1]  # genai leaves the stop token out


def test_the_t5_runner_stops_at_any_stop_id(tmp_path):
    from posbias_export.hf.ship import ship

    source = save_tiny_folder("t5", tmp_path / "t5", client=True, noise=0.3, encoder_decoder=True)  # varied tokens
    save_tokenizer(source)
    want = with_second_stop(source, tf.T5ForConditionalGeneration)
    ship(source, tmp_path / "out", check_growth=False)
    vocab = runtimes_common("vocabulary").TokenizerVocabulary(tmp_path / "out" / "tokenizer.json")
    ids = np.array([PROMPT], np.int64)
    got = load_runner("ort/seq2seq.py").greedy_generate(
        str(tmp_path / "out" / "encoder_model.onnx"), str(tmp_path / "out" / "decoder_model_merged.onnx"), ids,
        np.ones_like(ids), NEW, PAD, eos_ids=vocab.eos_ids)[0].tolist()
    assert got == want


@pytest.mark.slow
def test_the_t5_runner_takes_zero_new_tokens_as_generate_does(tmp_path, capsys):
    from posbias_export.hf.ship import ship

    source = save_tiny_folder("t5", tmp_path / "t5", client=True, encoder_decoder=True)
    save_tokenizer(source)
    ship(source, tmp_path / "out", check_growth=False)
    capsys.readouterr()
    runner = load_runner("ort/seq2seq.py")
    assert runner.main([str(tmp_path / "out"), "--prompt", "To be", "--prompt", "or not", "--max-new-tokens", "0"]) == 0
    assert capsys.readouterr().out == "\n\n"  # nothing generated for either prompt
    assert runner.main([str(tmp_path / "out"), "--prompt", "To be", "--max-new-tokens", "-1"]) == 2
