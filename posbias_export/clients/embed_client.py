"""sentence-transformers' ONNX backend on an embedder folder written with --out-dir, in Optimum's
side environment (optimum_env.sh: the backend needs optimum-onnx, which pins transformers below
the project's): no posbias_export import. argv: the folder, the file inside it (onnx/model.onnx,
or a quantized one), a JSON list of texts. Prints one JSON line: the normalised embeddings, the
token ids and mask its own tokenizer made (the reference runs on those), and the versions."""
from __future__ import annotations

import json
import sys
import warnings

warnings.simplefilter("ignore")


def main() -> int:
    import sentence_transformers
    import transformers

    folder, file_name, texts = sys.argv[1], sys.argv[2], json.loads(sys.argv[3])
    model = sentence_transformers.SentenceTransformer(folder, backend="onnx", device="cpu",
                                                      model_kwargs={"file_name": file_name})
    embeddings = model.encode(texts, normalize_embeddings=True)
    features = model.tokenize(texts)
    print(json.dumps({"embeddings": embeddings.tolist(), "ids": features["input_ids"].tolist(),
                      "mask": features["attention_mask"].tolist(),
                      "versions": {"sentence_transformers": sentence_transformers.__version__,
                                   "transformers": transformers.__version__}}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
