"""Readers of the format families several framework plugins share (DCP folder, HF model folder, ZeRO tag, LoRA,
torch files, pointers, value heads, in-progress rule). They build on the plugin contract (`ckptctl.contract`),
`formats` and `io`, and never import the registry (`ckptctl.layouts`) or a framework plugin."""
