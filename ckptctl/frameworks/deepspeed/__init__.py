"""DeepSpeed ZeRO 0-3 save folders: `latest` + `global_stepN/` tags of per-rank model/optim states."""
