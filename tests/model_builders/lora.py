"""PEFT LoRA adapters of the tiny test models, saved by `peft` itself from random non-zero weights
(`init_lora_weights=False`: PEFT's default init leaves lora_B at zero, an adapter that changes
nothing). Each adapter differs in rank, targets and scaling, so a row given the wrong one, or its
own in the wrong place, gets other tokens:

    a1  r 4, alpha 8, q_proj and v_proj
    a2  r 8, alpha 16, every linear layer but the LM head, rsLoRA (alpha / sqrt(r))
    a3  r 2, alpha 4, gate_proj, o_proj and down_proj of layer 1 only; down_proj at rank 6
        (rank_pattern), o_proj at alpha 3 (alpha_pattern)

Phi-3's modules are packed (qkv_proj, gate_up_proj), so its specs name those; `all-linear` reaches
them as they are. Built in process in a second or two a model (torch and peft are test
dependencies); `build_adapters` writes them under `out/<name>`.
"""

from __future__ import annotations

from pathlib import Path

SPECS = {
    "a1": dict(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"]),
    "a2": dict(r=8, lora_alpha=16, target_modules="all-linear", use_rslora=True),
    "a3": dict(r=2, lora_alpha=4, target_modules=["gate_proj", "o_proj", "down_proj"], rank_pattern={"down_proj": 6},
               alpha_pattern={"o_proj": 3}, layers_to_transform=[1]),
}
PACKED = {  # Phi-3's own module names
    "a1": dict(r=4, lora_alpha=8, target_modules=["qkv_proj"]),
    "a2": SPECS["a2"],
    "a3": dict(r=2, lora_alpha=4, target_modules=["gate_up_proj", "o_proj", "down_proj"],
               rank_pattern={"down_proj": 6}, alpha_pattern={"o_proj": 3}, layers_to_transform=[1]),
}


def build_adapters(hf_dir: Path, out: Path, specs: dict | None = None, seed: int = 0) -> dict[str, Path]:
    """Each of `specs` (default SPECS) as a PEFT adapter of the model in `hf_dir`, saved under
    `out`; {name: folder}."""
    import torch
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM

    folders = {}
    for i, (name, spec) in enumerate((specs or SPECS).items()):
        torch.manual_seed(seed + i)
        model = AutoModelForCausalLM.from_pretrained(hf_dir, dtype=torch.float32)
        get_peft_model(model, LoraConfig(init_lora_weights=False, **spec)).save_pretrained(out / name)
        folders[name] = out / name
    return folders


def peft_model(hf_dir: Path, folders: dict[str, Path]):
    """The transformers model of `hf_dir` with every adapter of `folders` loaded (none active
    until `set_adapter`), in eval mode: the oracle."""
    import torch
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    names = list(folders)
    model = PeftModel.from_pretrained(AutoModelForCausalLM.from_pretrained(hf_dir, dtype=torch.float32),
                                      folders[names[0]], adapter_name=names[0])
    for name in names[1:]:
        model.load_adapter(folders[name], adapter_name=name)
    return model.eval()
