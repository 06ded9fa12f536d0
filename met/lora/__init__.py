"""LoRA adapters served over one base model: PEFT adapter loading (`adapter`) and the
resident slots every target projection reads per step (`slots`)."""
