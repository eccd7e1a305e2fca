"""The plugin contract: what a layout reader is (`base.Layout`), the capabilities it may provide, its load set,
resume profile and naming rules. The shared format-family readers (`ckptctl.families`) and the framework plugins
build on it; the registry and run walker (`ckptctl.layouts`) use it. It imports only `formats`, `io` and the
vocabulary modules (errors, checkpoint, units), never a reader."""
