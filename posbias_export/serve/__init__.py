"""`serve`: a folder written by --out-dir behind an OpenAI-compatible API on Ray Serve.

    folder.py      what is served (decoder, T5/UMT5 pair, embedder), read once
    embedder.py    an embedder's engine and the token-budget batches
    decoder.py     a decoder's engine: continuous batching over the in-place cache
    seq2seq.py     a T5/UMT5 pair's engine: batched by request, the cross cache shared
    replica.py     one replica's work, apart from Ray (tests drive it directly)
    openai_api.py  the OpenAI requests, checked (each bad input a 4xx with OpenAI's error object)
    chat.py        chat messages through the folder's own chat template
    metrics.py     what GET /metrics reports
    app.py         the Ray Serve application: the HTTP ingress and the model replicas
    launch.py      Ray started or joined, the application run until a stop signal, drained
    cluster.py     a cluster that is not ours: joined, shared (its proxy, the route), left as it was
    local_ray.py   the one-machine head started when no cluster is named
    deploy.py      the builder Ray Serve config files (KubeRay) name
    process.py     `serve DIR` as a child process (bench-serve, tests)
"""
