"""Raymuter's serving layer on Ray Serve: the engine (`generation`) behind an HTTP ingress and
Python handles. Serving passes text, bytes, token ids and opaque engine objects; it never touches
arrays.

    app.py       the application: its config, the thin deployments (ingress, decoder, encoder,
                 vision) and how they are bound together (`build`)
    http/        the HTTP side: the routes, a file per group (http/routes/), OpenAI's shapes, the
                 mapping to the decoder's requests, answer assembly, media, the decoder calls
    services/    each replica's work, free of Ray (generator, embeddings, encoder, vision)
    schema.py    the typed requests and responses of the Python handle API
    errors.py    the errors a request gets, carrying their field or status as data
    metrics.py   Prometheus metrics, named after vLLM's
    fake.py      an engine whose outputs are known, for testing serving alone
    cli.py       the `raymuter` command (`serve`, and the engine's `generate`); haproxy.py and
                 loopback.py are what `raymuter serve` runs Ray with

This package imports nothing, so Ray replicas can import it cheaply.
"""
