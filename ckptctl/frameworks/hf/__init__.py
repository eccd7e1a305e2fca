"""Hugging Face model folders: `config.json` + safetensors (single or sharded with an index)."""
