"""Assisted decoding: candidate generators propose, the target verifies.

    verify.py         a row's candidates checked in one model run, the accepted prefix kept
    prompt_lookup.py  candidates from the row's own n-grams (transformers' prompt lookup)
    draft.py          candidates from a small draft decoder with the target's tokenizer
    budget.py         which rows' candidates pay for a verification run
"""
