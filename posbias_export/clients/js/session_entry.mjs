// Does transformers.js hand an ONNX Runtime session config entry through to the session? argv:
// FOLDER KEY VALUE (KEY without "session."). Loads the folder's causal LM with
// session_options.extra.session[KEY] = VALUE and prints one JSON line {loaded, error}: a key
// that ONNX Runtime acts on at load (load_model_format ORT) must then fail the load.
import { env, AutoModelForCausalLM } from "@huggingface/transformers";

const [folder, key, value] = process.argv.slice(2);
env.allowRemoteModels = false;
env.allowLocalModels = true;
env.localModelPath = "/";  // FOLDER is absolute
try {
  await AutoModelForCausalLM.from_pretrained(folder, {
    local_files_only: true, dtype: "fp32", device: "cpu", session_options: { extra: { session: { [key]: value } } },
  });
  console.log(JSON.stringify({ loaded: true, error: null }));
} catch (err) {
  console.log(JSON.stringify({ loaded: false, error: String(err).split("\n")[0] }));
}
