"""The test models: tiny random-weight models built with torch / transformers and exported to
every ONNX layout the engine serves.  Nothing is downloaded.

    common     what the builders share: ids and init, the tokenizer, file copies, the cache
               folder and its keys, the worker subprocess a build runs in
    text       decoder-only models (Llama, Qwen2, GPT-2) in their layouts; ``ensure_test_models``,
               the entry point of every build; ``llama-merged`` and ``gpt2-grow`` by
               ``generation.default_model.export``
    seq2seq    encoder-decoders (Marian, T5, BART, Whisper), built with the text models
    vision     vision-language models (Qwen2-VL, Idefics3, ViT + GPT-2), built on demand
    embedding  feature-extraction exports of the text models, built on demand
    windows    sliding-window models (Mistral, GPT-Neo; window 8) in the append and in_place
               layouts, built on demand
    matrix     the support matrix: every decoder-only architecture optimum-onnx exports, tiny, in
               the Optimum layout (those above reused, not rebuilt), built on demand
    layouts    the matrix's other layouts from its Hugging Face folders: onnxruntime-genai builds of
               every architecture its builder takes, the transformers.js onnx/ folder (with q4, int8
               and fp16 variants) and merged decoder, built on demand

Each set is cached under ``$RAYMUTER_TEST_MODELS`` (else ``~/.cache/raymuter/test-models``) in a
folder named by a hash of the builder files that make it (``generation/default_model/export.py``
included) and of the package versions, so editing a test leaves the models as they are.
tests/conftest.py puts tests/ on the import path: tests and bench import ``model_builders.text`` etc.
(Not ``builders``: onnxruntime-genai's model builder imports a top-level ``builders`` of its own,
and a worker's genai build would find this package instead.)  No module here has import-time side
effects.
"""
