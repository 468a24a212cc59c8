"""onnxruntime underneath: a model folder loaded into sessions, what its graphs take and give,
and the feeds of one run.

    model.py       `load()`: a Hugging Face or onnxruntime-genai folder (or hub id) into sessions
    graph.py       a decoder graph's inputs, outputs and the cache modes it can run in
    positions.py   where a graph without position_ids places tokens: append or grow, and why
    onnx_graph.py  an ONNX file's nodes, read without the `onnx` package
    feeds.py       one decoder run's inputs, bound to onnxruntime without copies
    head.py        the LM head cut to the positions whose logits are read (a graph rewrite at load)
    fusion/        Optimum / transformers.js decoders rewritten into the fused graph, cached on disk
    encoders.py    an encoder-decoder's encoder runs (text, log-mel windows, pixels) and their cache
"""
