"""Beam search as transformers 4.57 `_beam_search`, each search a group of rows of the shared
decode state (beam.py: the search's math; the state and the scheduler step the groups).
"""
