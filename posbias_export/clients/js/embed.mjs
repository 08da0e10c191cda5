// transformers.js's feature-extraction pipeline on a folder, as embedding users call it: argv
// FOLDER TEXTS_JSON [DTYPE] (fp32; q8 and q4 load onnx/model_quantized.onnx, onnx/model_q4.onnx). Mean pooling over the mask and L2 normalisation (the jina-embeddings-v2
// recipe), texts padded to one batch. Prints {ids, mask, embeddings} as one JSON line: the token
// ids the client's own tokenizer made, so the caller can compute the reference on them.
import { env, pipeline } from "@huggingface/transformers";

const [folder, textsJson, dtype = "fp32"] = process.argv.slice(2);
env.allowRemoteModels = false;
env.allowLocalModels = true;
env.localModelPath = "/";

const texts = JSON.parse(textsJson);
const extractor = await pipeline("feature-extraction", folder, { local_files_only: true, dtype, device: "cpu" });
const encoded = extractor.tokenizer(texts, { padding: true, truncation: false });
const embeddings = await extractor(texts, { pooling: "mean", normalize: true });
const rows = (t) => Array.from({ length: t.dims[0] }, (_, r) => Array.from(t.data.slice(r * t.dims[1], (r + 1) * t.dims[1]), Number));
console.log(JSON.stringify({ ids: rows(encoded.input_ids), mask: rows(encoded.attention_mask), embeddings: rows(embeddings) }));
