"""LoRA adapters as PEFT saves them: their settings, the factors and their merge into base weights, an adapter
folder, and the rule that finds adapters inside a PEFT-wrapped model's own state dict."""
