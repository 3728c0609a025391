"""PyTorch Lightning with parts: ``Trainer(strategy="parts")`` and ``Fabric(strategy="parts")``.

Importing this package registers ``"parts"`` in Lightning's strategy registries (the Trainer's
and Fabric's); ``PartsStrategy`` (Trainer) and ``PartsFabricStrategy`` (Fabric) take the knobs
of ``parts.partition.partitioned`` and ``attach``. See docs/integrations.md.

    import parts.integrations.lightning               # registers "parts"
    trainer = Trainer(strategy="parts", precision="bf16-mixed", devices=8)

Needs the ``[lightning]`` extra (``pip install "parts[lightning]"``).
"""

from parts.integrations.lightning.fabric import PartsFabricStrategy
from parts.integrations.lightning.trainer import PartsStrategy

__all__ = ["PartsStrategy", "PartsFabricStrategy"]
