"""PEFT adapter folders (`adapter_config.json` + `adapter_model.safetensors`), read with `families.lora`."""
