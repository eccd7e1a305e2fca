"""The fault matrix (issue 31): every file of one checkpoint per real writer deleted, truncated and flipped,
judged by the framework's own load and by `ckptctl verify` (see `harness`)."""
