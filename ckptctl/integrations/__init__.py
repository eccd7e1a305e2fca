"""Hooks into training frameworks. Each module imports its framework, so import only the one you use:
`from ckptctl.integrations.transformers import CkptctlCallback`."""
