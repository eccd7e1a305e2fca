"""The version of ckptctl, in a module of its own: the core records it in every manifest, and importing it
from the package's face (`ckptctl/__init__.py`, which reaches the core lazily) would tie the two in a loop."""

__version__ = "0.1.0"
