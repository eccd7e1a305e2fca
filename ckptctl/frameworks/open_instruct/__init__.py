"""open-instruct (AllenAI): DeepSpeed tags with `driver_state.pt` and the shared `ref_policy/`."""
