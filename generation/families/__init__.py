"""What a model family adds to the engine: its inputs turned into prompt ids and encoder
inputs, and its encoder.

    whisper/        Whisper: audio front end (audio.py), timestamp rules (timestamps.py), windows
                    of long clips (longform.py)
    vision.py       vision-language prompts: image features in inputs_embeds, Qwen2-VL's M-RoPE
                    positions and vision encoder
    images.py       image decoding and Qwen2-VL / ViT preprocessing, equal to transformers'
    idefics3.py     Idefics3 (SmolVLM) frames, prompts and vision encoder
    vl_prompts.py   images to a vision-language prompt's ids and image inputs, either family
"""
