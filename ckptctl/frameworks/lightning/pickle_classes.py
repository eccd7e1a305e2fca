"""The classes a Lightning checkpoint pickles besides torch's (lightning 2.6.6), each read as an inert
`FrameworkObject` stand-in by the torch-pickle allowlist (`formats.framework_classes`).

`Trainer.save_checkpoint` stores `dict(module.hparams)` under `hyper_parameters`
(`pytorch/trainer/connectors/checkpoint_connector.py` `dump_checkpoint`), so its values are whatever the
module was given: Lightning's own `AttributeDict`, an `argparse.Namespace` nested in it, or, for an OmegaConf
config, the `DictConfig` itself with its class under `hparams_type`. Those are what Lightning writes; any other
class there is the user's own, and is refused (nothing of it runs).
"""

from __future__ import annotations

from ckptctl.formats.framework_classes import FrameworkClasses

CLASSES = FrameworkClasses(
    classes=frozenset({("argparse", "Namespace")}),
    # `AttributeDict` is a dict: its items are set one by one.
    mappings=frozenset(
        {
            ("lightning.fabric.utilities.data", "AttributeDict"),
            ("lightning.pytorch.utilities.parsing", "AttributeDict"),
            ("lightning_fabric.utilities.data", "AttributeDict"),
            ("pytorch_lightning.utilities.parsing", "AttributeDict"),
        }
    ),
    # OmegaConf's containers and the node and metadata classes they pickle (plain data, rebuilt by state).
    modules=(
        ("omegaconf.dictconfig", ""),
        ("omegaconf.listconfig", ""),
        ("omegaconf.nodes", ""),
        ("omegaconf.base", ""),
    ),
)
