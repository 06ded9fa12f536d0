"""LoRA adapters served over one base model: PEFT adapter loading (`adapter`), llama.cpp GGUF
LoRA files (`gguf_adapter`), the choice between them (`load`) and the resident slots every
target projection reads per step (`slots`)."""
