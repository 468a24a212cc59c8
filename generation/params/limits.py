"""The most work one request may ask of a batch it shares.

Every per-request setting has a range that keeps a row's per-step work small beside the model
step, so one request cannot stall the others (bench/worst_case.py measures a batch holding the
worst allowed request against a plain one). The engine checks them when settings are built
(generation.params.settings) and the HTTP layer declares the same bounds in its OpenAPI schema
(deployments.http.openai). Token ids are bounded by the model's vocabulary and lengths by its
context; these are the caps on top of those. Floats are finite everywhere.
"""

MAX_NGRAM_SIZE = 32  # no_repeat_ngram_size, encoder_no_repeat_ngram_size
MAX_LOOKUP_TOKENS = 32  # prompt_lookup_num_tokens, num_assistant_tokens
MAX_MATCHING_NGRAM_SIZE = 32  # max_matching_ngram_size
MAX_STOP_STRINGS = 16  # stop strings per request
MAX_STOP_LENGTH = 256  # characters per stop string
MAX_TOKEN_IDS = 256  # eos_token_id, forced_eos_token_id (stop_token_ids) entries
MAX_SEQUENCES = 256  # bad_words_ids and sequence_bias entries (logit_bias: one-token entries)
MAX_SEQUENCE_LENGTH = 32  # tokens per bad word or biased sequence
MAX_BIAS = 100.0  # |bias| of a sequence_bias / logit_bias entry (OpenAI's logit_bias range)
MAX_BEAMS = 16  # num_beams (and never more than the decoder's slots)
MAX_FLOAT = 1e4  # |value| of the other float settings (repetition_penalty, length_penalty, ...)
MAX_ADDITIVE_PENALTY = 2.0  # |presence_penalty|, |frequency_penalty|: OpenAI's range
MAX_STEP_SLOWDOWN = 1.5  # a shared step that verifies one row's prompt lookup: at most this many plain steps
MAX_CHOICES = 16  # n
MAX_LOGPROBS = 20  # top_logprobs
MAX_PROMPTS = 64  # prompts in one /v1/completions request
MAX_EMBEDDING_INPUTS = 2048  # inputs in one /v1/embeddings request (OpenAI's limit)
MAX_MESSAGES = 2048  # chat messages in one request
MAX_GRAMMAR_LENGTH = 65536  # characters of a structured_outputs schema, regex or grammar
MAX_CONSTRAINT_CHOICES = 256  # strings of a structured_outputs choice
MAX_VIDEO_FRAMES = 768  # frames of one video (Qwen2VLVideoProcessor's max_frames)
SEED_LIMIT = 2**64  # seeds are unsigned 64-bit integers (logits/rng.py hashes them)
