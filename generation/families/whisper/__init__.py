"""Whisper (transformers 4.57): log-mel features from audio (audio.py), the timestamp rules a
window's tokens follow and how they become segments (timestamps.py), and decoding a clip window
after window (longform.py).
"""
