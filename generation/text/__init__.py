"""Text in and out: the model's tokenizer and streamed detokenizing (tokenizer.py), and its chat
template rendered as transformers renders it (chat.py).
"""
