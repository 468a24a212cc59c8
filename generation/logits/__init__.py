"""From logits to tokens: the processors of transformers 4.57 `_get_logits_processor` over a
whole batch (processors.py) with per-row settings (row_settings.py: RowSettings and `apply`), the sampling warpers and the choice of each
row's token and its log-probability (selection.py), and prompt log-probabilities
(prompt_logprobs.py).
"""
