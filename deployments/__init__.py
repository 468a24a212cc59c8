"""Ray Serve deployments of Raymuter (encoder, vision, decoder, ingress): not built yet.

The engine they will drive is `generation` (its decode-state verbs are what continuous batching
needs). This package imports nothing, so Ray replicas can import it cheaply.
"""
