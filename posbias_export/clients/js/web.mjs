// onnxruntime-web (the WebAssembly build a browser page loads) running a serving folder's
// model.onnx in Node, as a page would: the file's bytes and its external data handed over, the
// `wasm` execution provider, greedy decoding through the file's own KV cache.
// argv: FOLDER IDS_JSON MAX_NEW_TOKENS EOS_ID. Prints {"tokens": [...], "logits": [V]} (the
// prompt's last position) as JSON.
import { existsSync, readFileSync } from "node:fs";
import { join } from "node:path";
import * as ort from "onnxruntime-web";

const [folder, idsJson, maxNew, eosId] = process.argv.slice(2);
ort.env.wasm.numThreads = 1;  // a page without cross-origin isolation runs one thread
const path = join(folder, "model.onnx");
const options = { executionProviders: ["wasm"] };
if (existsSync(`${path}.data`)) options.externalData = [{ path: "model.onnx.data", data: readFileSync(`${path}.data`) }];
const session = await ort.InferenceSession.create(readFileSync(path), options);

const pastNames = session.inputNames.filter((n) => n.startsWith("past_key_values."));
const meta = session.inputMetadata ?? [];
const headsAndSize = (name) => {
  const shape = meta.find((m) => m.name === name)?.shape ?? [];
  return [shape[1], shape[3]];
};
const ints = (values, dims) => new ort.Tensor("int64", BigInt64Array.from(values.map(BigInt)), dims);

let past = Object.fromEntries(pastNames.map((n) => {
  const [heads, size] = headsAndSize(n);
  return [n, new ort.Tensor("float32", new Float32Array(0), [1, heads, 0, size])];
}));
const tokens = JSON.parse(idsJson);
let step = tokens.slice();
let lastLogits = null;
for (let i = 0; i < Number(maxNew); i++) {
  const feeds = { input_ids: ints(step, [1, step.length]), attention_mask: ints(tokens.map(() => 1), [1, tokens.length]), ...past };
  const out = await session.run(feeds);
  const [, length, vocab] = out.logits.dims;
  const row = out.logits.data.subarray((length - 1) * vocab, length * vocab);
  if (lastLogits === null) lastLogits = Array.from(row);
  let best = 0;
  for (let v = 1; v < vocab; v++) if (row[v] > row[best]) best = v;
  tokens.push(best);
  if (best === Number(eosId)) break;
  past = Object.fromEntries(pastNames.map((n) => [n, out[n.replace("past_key_values.", "present.")]]));
  step = [best];
}
console.log(JSON.stringify({ tokens, logits: lastLogits }));
