"""AReaL: Saver exports and the RecoverHandler's DCP slot with `recover_info/`."""
