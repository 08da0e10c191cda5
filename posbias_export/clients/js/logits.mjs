// transformers.js's forward pass on one prompt, as a client calls the model: argv
// causal|seq2seq FOLDER IDS_JSON OUT. Writes the logits (float32, row-major [L, V]; seq2seq:
// the decoder's first step from its start token, [1, V]) to OUT and prints their dims.
import { writeFileSync } from "node:fs";
import { env, AutoModelForCausalLM, AutoModelForSeq2SeqLM, Tensor } from "@huggingface/transformers";

const [kind, folder, idsJson, outPath] = process.argv.slice(2);
env.allowRemoteModels = false;
env.allowLocalModels = true;
env.localModelPath = "/";

const ids = JSON.parse(idsJson);
const tensor = (values) => new Tensor("int64", BigInt64Array.from(values.map(BigInt)), [1, values.length]);
const inputs = { input_ids: tensor(ids), attention_mask: tensor(ids.map(() => 1)) };
const Model = kind === "seq2seq" ? AutoModelForSeq2SeqLM : AutoModelForCausalLM;
const model = await Model.from_pretrained(folder, { local_files_only: true, dtype: "fp32", device: "cpu" });
if (kind === "seq2seq") inputs.decoder_input_ids = tensor([model.generation_config?.decoder_start_token_id ?? 0]);
const { logits } = await model(inputs);
writeFileSync(outPath, Buffer.from(logits.data.buffer, logits.data.byteOffset, logits.data.byteLength));
console.log(JSON.stringify(logits.dims));
