// transformers.js as a user runs it in Node: a local folder, no download, the library's own
// generate. argv: causal|seq2seq FOLDER PROMPTS_JSON MAX_NEW_TOKENS. PROMPTS_JSON: token id
// lists, left-padded (causal) or right-padded (seq2seq sources) into one batch with id 0.
// Prints the generated ids as JSON [B][T].
import { env, AutoModelForCausalLM, AutoModelForSeq2SeqLM, Tensor } from "@huggingface/transformers";

const [kind, folder, promptsJson, maxNew] = process.argv.slice(2);
env.allowRemoteModels = false;
env.allowLocalModels = true;
env.localModelPath = "/";  // FOLDER is absolute

const Model = kind === "seq2seq" ? AutoModelForSeq2SeqLM : AutoModelForCausalLM;
const model = await Model.from_pretrained(folder, { local_files_only: true, dtype: "fp32", device: "cpu" });
const prompts = JSON.parse(promptsJson);
const width = Math.max(...prompts.map((p) => p.length));
const ids = [];
const mask = [];
for (const p of prompts) {
  const pad = Array(width - p.length).fill(0);
  const row = kind === "seq2seq" ? [...p, ...pad] : [...pad, ...p];
  ids.push(...row);
  mask.push(...(kind === "seq2seq" ? [...p.map(() => 1), ...pad] : [...pad, ...p.map(() => 1)]));
}
const shape = [prompts.length, width];
const out = await model.generate({
  input_ids: new Tensor("int64", BigInt64Array.from(ids.map(BigInt)), shape),
  attention_mask: new Tensor("int64", BigInt64Array.from(mask.map(BigInt)), shape),
  max_new_tokens: Number(maxNew),
  do_sample: false,
});
const [rows, cols] = out.dims;
const data = Array.from(out.data, Number);
console.log(JSON.stringify(Array.from({ length: rows }, (_, r) => data.slice(r * cols, (r + 1) * cols))));
