"""Each replica's work, free of Ray: the deployments in app.py hold one of these and call it.

    generator.py      the decoder replica: requests in, text chunks out (TextGenerator)
    embeddings.py     an embedding model's decoder replica (EmbeddingService)
    encoder.py        an encoder-decoder's encoder replica (texts, audio)
    vision.py         a vision-language model's vision replica (images to features)
    encoding.py       the one shape of the encoder and vision services (model, metrics, cache)
    feature_cache.py  the encoder and vision replicas' cache by content
    loading.py        each replica's service, loaded as the application's config says
    routing.py        the prefix-aware request router of the decoder deployment
"""
