"""One package per framework: everything ckptctl knows about the checkpoints it writes.

Each package holds its layout (detection, index, structural rules, pointers) and the facts the commands
need from it (resume profile, prune protections, convert specifics), behind the hooks of
`ckptctl.contract.base.Layout`; `ckptctl.layouts` registers them. See docs/architecture.md.
"""
