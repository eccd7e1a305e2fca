"""PEFT adapters (`adapter_config.json` + `adapter_model.safetensors`) and LoRA modules inside model state dicts."""
