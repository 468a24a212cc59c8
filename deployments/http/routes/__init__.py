"""The HTTP routes, a file per route group; each route a FastAPI function that reaches the
ingress replica's state through `ingress_state.replica_state`:

    completions.py   POST /v1/completions, /v1/chat/completions
    audio.py         POST /v1/audio/transcriptions, /v1/audio/translations
    embeddings.py    POST /v1/embeddings
    responses.py     POST /v1/responses; GET, DELETE /v1/responses/{id}; its input_items and cancel
    files.py         POST, GET /v1/files; GET, DELETE /v1/files/{id}; GET /v1/files/{id}/content
    batches.py       POST, GET /v1/batches; GET /v1/batches/{id}; POST /v1/batches/{id}/cancel
    tokens.py        POST /tokenize, /detokenize
    models.py        GET /v1/models, /v1/models/{id}
    meta.py          GET /health, /version, /metrics, /openapi.json, /docs

`ROUTERS` are what deployments.app's `api` includes.
"""

from . import audio, batches, completions, embeddings, files, meta, models, responses, tokens

ROUTERS = (meta.router, models.router, completions.router, tokens.router, embeddings.router, audio.router,
           responses.router, files.router, batches.router)
