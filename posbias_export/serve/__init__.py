"""`serve`: a folder written by --out-dir behind an OpenAI-compatible API on Ray Serve.

    folder.py      what is served (decoder, embedder; seq2seq refused for now), read once
    embedder.py    an embedder's engine and the token-budget batches
    decoder.py     a decoder's engine: continuous batching over the in-place cache
    replica.py     one replica's work, apart from Ray (tests drive it directly)
    openai_api.py  the OpenAI requests, checked (each bad input a 4xx with OpenAI's error object)
    metrics.py     what GET /metrics reports
    app.py         the Ray Serve application: the HTTP ingress and the model replicas
    launch.py      Ray started or joined, the application run until a stop signal, drained
"""
