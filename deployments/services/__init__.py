"""Each replica's work, free of Ray: the deployments in app.py hold one of these and call it.

    generator.py      the decoder replica: requests in, text chunks out (TextGenerator)
    batching.py       the generator's thread running the engine's Scheduler (ContinuousBatcher)
    encoder.py        an encoder-decoder's encoder replica (texts, audio)
    vision.py         a vision-language model's vision replica (images to features)
    feature_cache.py  the encoder and vision replicas' cache by content
"""
