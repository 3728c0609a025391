"""What the Lightning tests share: a tiny GPT LightningModule, its data, and a Trainer as a user makes one.

The data gives every step the same global batch at any world size: 120 rows, no shuffling,
``GLOBAL_BATCH // world`` rows per rank (Lightning's ``DistributedSampler`` deals rows out in
turn), so a step's mean loss over the ranks and its gradient are those of the same rows at
world 2 and 3, and an epoch is 10 steps (checkpoints at steps 10 and 20 fall between epochs).
"""

from __future__ import annotations

import contextlib
import os
import sys
import warnings
from pathlib import Path
from typing import Any, Iterator, Optional

import torch
import torch.distributed as dist

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "recipes"))
from gpt_model import GPT, GPTConfig  # noqa: E402

CONFIG = GPTConfig(vocab_size=32, block_size=16, n_layer=2, n_head=2, n_embd=32)
ROWS, GLOBAL_BATCH = 120, 12


def rows() -> torch.Tensor:
    """The dataset: token rows of 17 (16 inputs, 16 shifted targets)."""
    return torch.randint(0, CONFIG.vocab_size, (ROWS, CONFIG.block_size + 1),
                         generator=torch.Generator().manual_seed(1))


def loader(world: Optional[int] = None) -> Any:
    """The training batches of this rank: ``GLOBAL_BATCH // world`` rows per step."""
    world = world or dist.get_world_size()
    return torch.utils.data.DataLoader(torch.utils.data.TensorDataset(rows()),
                                       batch_size=GLOBAL_BATCH // world, shuffle=False)


@contextlib.contextmanager
def lightning_run() -> Iterator[None]:
    """Lightning inside a harness rank: its notes are not the test's warnings, and the environment
    it edits (``WORLD_SIZE``, ``PL_GLOBAL_SEED``) is put back for the next job."""
    env = dict(os.environ)
    try:
        with warnings.catch_warnings():
            warnings.filterwarnings("ignore", module=r"lightning(\.|$)")
            warnings.filterwarnings("ignore", message=r".*(LeafSpec|litlogger|does not have many workers)")
            yield
    finally:
        os.environ.clear()
        os.environ.update(env)


def module_class() -> type:
    """The LightningModule class (made on first use: importing Lightning takes seconds)."""
    import lightning.pytorch as pl

    class TinyLM(pl.LightningModule):
        """A tiny GPT (built in ``configure_model`` unless given), AdamW or SGD; records every loss it computes."""

        def __init__(self, model: Optional[torch.nn.Module] = None, lr: float = 1e-2, sgd: bool = False) -> None:
            super().__init__()
            self.lr, self.sgd, self.losses, self.val_losses = lr, sgd, [], []
            if model is not None:
                self.model = model

        def configure_model(self) -> None:
            if not hasattr(self, "model"):
                self.model = GPT(CONFIG)

        def _loss(self, batch: Any) -> torch.Tensor:
            (x,) = batch
            return self.model(x[:, :-1].contiguous(), x[:, 1:].contiguous())

        def training_step(self, batch: Any, index: int) -> torch.Tensor:
            loss = self._loss(batch)
            self.losses.append(loss.item())
            return loss

        def validation_step(self, batch: Any, index: int) -> None:
            self.val_losses.append(self._loss(batch).item())

        def predict_step(self, batch: Any, index: int) -> torch.Tensor:
            return self.model.generate(batch[0][:, :4], 4, top_k=1)

        def configure_optimizers(self) -> torch.optim.Optimizer:
            if self.sgd:
                return torch.optim.SGD(self.parameters(), lr=self.lr)
            return torch.optim.AdamW(self.parameters(), lr=self.lr)

    return TinyLM


def trainer(strategy: Any, root: str, **kwargs: Any) -> Any:
    """A CPU Trainer on the harness ranks, quiet: no logger, progress bar or summary."""
    import lightning.pytorch as pl
    kwargs.setdefault("enable_checkpointing", False)
    return pl.Trainer(strategy=strategy, accelerator="cpu", devices=dist.get_world_size(), logger=False,
                      enable_progress_bar=False, enable_model_summary=False, num_sanity_val_steps=0,
                      default_root_dir=root, **kwargs)


def checkpointing(directory: str) -> Any:
    """A ModelCheckpoint every 10 steps, keeping all of them and ``last.ckpt``."""
    from lightning.pytorch.callbacks import ModelCheckpoint
    return ModelCheckpoint(dirpath=directory, every_n_train_steps=10, save_top_k=-1, save_last=True)


def fit(strategy: Any, root: str, max_steps: int, ckpt_path: Any = None, save: bool = False,
        module: Any = None, **kwargs: Any) -> Any:
    """Seed, build the module (unless given), fit it to ``max_steps`` with checkpoints every 10 steps
    if ``save``; return the module (its ``losses``: the steps it ran on this rank)."""
    import lightning.pytorch as pl
    pl.seed_everything(0, verbose=False)
    module = module if module is not None else module_class()()
    callbacks = [checkpointing(os.path.join(root, "checkpoints"))] if save else []
    run = trainer(strategy, root, max_steps=max_steps, callbacks=callbacks, enable_checkpointing=save, **kwargs)
    run.fit(module, loader(), ckpt_path=ckpt_path)
    return module
