"""LoRA adapters per batch row: PEFT's adapters on a decoder graph, each row with its own.

    adapter      a PEFT LoRA folder (adapter_config.json, adapter_model.safetensors) read and
                 checked: what the engine cannot apply exactly is refused, naming the setting
    projections  the decoder graph's projections an adapter can target, per layer, in every
                 layout (Optimum, merged, onnxruntime-genai, the fused rewrite; q|k|v or
                 gate|up packed into one MatMul or apart)
    rewrite      the load-time rewrite: each projection y = x W gets y + (x A_p) B_p for each row's
                 place p, the rows grouped by place in one batched MatMul, A and B fed per run
    bank         the resident adapters' stacked buffers, their places, and a run's feeds

A row's adapter is a place in the bank (0: none, zeros). Each projection's buffers hold every
place's A and B one after the other; a run feeds the range of places its rows use, so a batch of
rows without an adapter multiplies by nothing, and a row of one adapter by that adapter only.
"""
