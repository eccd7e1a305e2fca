"""The frameworks' own loads of a checkpoint, one module per framework, each run as a process of its own
(`python -m tests.faults.loaders.NAME SPEC.json`, see `tests.faults.cells` and `.common`)."""
