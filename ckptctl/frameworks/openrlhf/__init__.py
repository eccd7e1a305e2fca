"""OpenRLHF: DeepSpeed tags of `_actor`/`_critic`, best tags, `*_hf` exports, `metric.json`."""
