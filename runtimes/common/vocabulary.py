"""Text to token ids and back for the generation runners: bytes for our byte-level models, the
folder's tokenizer.json (the `tokenizers` library: no transformers at serving time) for models
from a Hugging Face folder, with the end-of-sequence and padding ids from its
generation_config.json / config.json."""
from __future__ import annotations

from pathlib import Path

from .json_files import read_json_object, token_id, token_ids
from .tensor_io import RunnerError

BYTE_VOCABULARY = 256


def utf8(text: str) -> bytes:
    """A prompt given as text (--prompt) is UTF-8: bytes that are not (which Python passes on from
    the command line as lone surrogates) are refused in one line; --prompt-file takes raw bytes."""
    try:
        return text.encode("utf-8")
    except UnicodeEncodeError:
        raise RunnerError("--prompt is not valid UTF-8 text (give raw bytes with --prompt-file)") from None


class Vocabulary:
    """Our byte-level models: a token is a byte (UTF-8 text in; bytes out, escaped when shown)."""

    eos_ids: tuple[int, ...] = ()  # generation stops at any of them
    pad_id: int = 0
    is_bytes = True
    files: list = []  # the files it read (none: bytes need no file)

    def encode(self, text: str) -> list[int]:
        return list(utf8(text))

    def encode_bytes(self, data: bytes) -> list[int]:
        return list(data)

    def decode(self, ids) -> str:
        return bytes(int(i) for i in ids).decode("utf-8", errors="backslashreplace")

    def until_eos(self, tokens) -> list[int]:
        """The tokens up to and with the first end-of-sequence id of any kind."""
        tokens = list(tokens)
        return next((tokens[:i + 1] for i, t in enumerate(tokens) if t in self.eos_ids), tokens)


class TokenizerVocabulary(Vocabulary):
    """A Hugging Face tokenizer.json, read with the `tokenizers` library."""

    is_bytes = False

    def __init__(self, path: Path):
        try:
            from tokenizers import Tokenizer
        except ImportError:
            raise RunnerError("text generation with a Hugging Face tokenizer needs the tokenizers package "
                              "(pip install tokenizers)") from None
        try:
            self.tokenizer = Tokenizer.from_file(str(path))
        except Exception as err:  # the library raises a bare Exception for a bad file
            raise RunnerError(f"cannot read tokenizer {path}: {str(err).splitlines()[0] if str(err) else err}") from None
        self.path = path
        self.files = [path]  # every file this vocabulary read: an output may be none of them
        vocab = self.tokenizer.get_vocab_size()
        settings = {}
        for name in ("config.json", "generation_config.json"):  # generation settings win over the model config
            file = path.parent / name
            if file.is_file():
                self.files.append(file)
                data = read_json_object(file)
                if data.get("eos_token_id") is not None:
                    settings["eos_token_id"] = token_ids(data["eos_token_id"], file, "eos_token_id", vocab)
                if data.get("pad_token_id") is not None:
                    settings["pad_token_id"] = token_id(data["pad_token_id"], file, "pad_token_id", vocab)
        self.eos_ids = settings.get("eos_token_id", ())
        pad = settings.get("pad_token_id")
        self.pad_id = pad if pad is not None else (self.eos_ids[0] if self.eos_ids else 0)  # as transformers pads


    def encode(self, text: str) -> list[int]:
        utf8(text)  # refused here: the tokenizer would fail on it with its own traceback
        return self.tokenizer.encode(text).ids

    def encode_bytes(self, data: bytes) -> list[int]:
        try:
            return self.encode(data.decode("utf-8"))
        except UnicodeDecodeError:
            raise RunnerError("a prompt file for a tokenizer must be UTF-8 text") from None

    def decode(self, ids) -> str:
        return self.tokenizer.decode([int(i) for i in ids], skip_special_tokens=True)


def vocabulary_for(model_path: str, contract, tokenizer: str | None = None) -> Vocabulary:
    """The vocabulary a file generates with: --tokenizer if given, else the tokenizer.json beside
    the file (a folder written with --out-dir) or in the folder it was exported from; bytes for
    our own byte-level models. A model of another vocabulary without a tokenizer is refused."""
    if tokenizer:
        path = Path(tokenizer)
        if not path.is_file():
            raise RunnerError(f"tokenizer {tokenizer} " + ("is not a file" if path.exists() else "does not exist"))
        return TokenizerVocabulary(path)
    vocab = contract.vocab_size
    imported = contract.imported or (vocab is not None and vocab != BYTE_VOCABULARY)
    candidates = [Path(model_path).resolve().parent / "tokenizer.json"]
    if contract.model_dir:
        candidates.append(Path(contract.model_dir) / "tokenizer.json")
    found = next((p for p in candidates if p.is_file()), None)
    if found is not None and imported:
        return TokenizerVocabulary(found)
    if imported:
        raise RunnerError(f"{model_path} comes from a Hugging Face folder with its own vocabulary: pass --tokenizer "
                          "PATH/tokenizer.json (none lies beside the file or in its folder)")
    return Vocabulary()
