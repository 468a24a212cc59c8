"""Text in and out: the model's tokenizer and streamed detokenizing (tokenizer.py), and its chat
template rendered as transformers renders it (chat.py); tools (tool_calls.py: their schemas
checked, a template family's call format, the grammar a required call follows, calls read out of
the output).
"""
