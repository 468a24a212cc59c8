"""The HTTP side of the ingress, free of Ray's deployments: the routes by group, and the rooms they
share.

    routes/           the routes, a file per group (completions, audio, embeddings, tokens,
                      models, meta); its docstring maps each path to its file
    openai.py         OpenAI's request and response shapes (pydantic), ApiError
    validation.py     a body checked and validated into its shape; problems name the field
    to_decoder.py     an OpenAI request as the decoder's GenerateRequest (settings_of,
                      generate_request), a decoder refusal as the request's field (for_request)
    answers.py        the response bodies built from the decoder's answers
    assembly.py       a completion's answer: whole, or as server-sent events
    media.py          an audio upload's multipart form; chat images and videos by URL
    decoder_calls.py  the decoder called by handle, with retries; a failure as its ApiError
    ingress_state.py  what the routes and the handle API share (API key, model card, counting)
    edge.py           bodies within their limit, errors in OpenAI's shape, the OpenAPI document
"""
