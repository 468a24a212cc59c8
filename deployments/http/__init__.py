"""The HTTP edge: OpenAI's request and response shapes and how they map onto the engine
(openai.py), bodies read within their limit and errors in OpenAI's shape for every status
(edge.py).
"""
