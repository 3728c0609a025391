"""parts inside the training loops of other libraries: Hugging Face ``transformers`` and ``accelerate``, Lightning.

- ``parts.integrations.transformers``: ``Trainer`` / ``Seq2SeqTrainer``, drop-in subclasses of
  transformers' own for a model built under ``parts.partition.partitioned()`` (or sharded with
  ``partition_module``): optimizer over the shards, global grad norm, no DDP wrap, sharded DCP
  checkpoints that resume at any world size, ``save_model`` writing full safetensors, and
  host-memory snapshots (``snapshots=``) that a restarted ``train()`` continues from.
- ``parts.integrations.accelerate``: ``prepare(accelerator, model, optimizer, ...)`` and an
  ``Accelerator`` subclass: a parts model is attached with the accelerator's mixed precision
  (``"bf16"`` -> ``parts.partition.MixedPrecision``) and never wrapped in DDP;
  ``parts.integrations.accelerate_snapshots``: host-memory snapshots of such a loop.

- ``parts.integrations.lightning``: ``PartsStrategy`` / ``PartsFabricStrategy``, registered as
  ``Trainer(strategy="parts")`` and ``Fabric(strategy="parts")``: the model sharded at
  construction or on setup, never DDP-wrapped, sharded DCP checkpoints that resume at any world size.

Each submodule imports its library on import (``pip install "parts[hf]"``, ``"parts[lightning]"``);
this package imports none. Integrations import the parts; no part imports them.
"""
