"""The serving folder (hf/ship.py) checked in the clients people load it with: our generate,
transformers.js and onnxruntime-web (js/, Node), onnxruntime-genai, Optimum (its own
environment: optimum_env.sh, optimum_client.py), tokens and logits against transformers
(checks.py; `python -m posbias_export bench-clients` writes benchmarks/clients.md)."""
