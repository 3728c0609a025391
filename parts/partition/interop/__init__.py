"""parts.partition meets the training loops people already have: ``model.zero_grad()``,
gradient clipping, ``.to()``/``.float()``, buffers, pretrained weights, ``torch.compile``."""

from parts.partition.interop.clip import clip_grad_norm_, grad_norm
from parts.partition.interop.pretrained import load_pretrained, num_parameters
from parts.partition.interop.resize import resize_token_embeddings
from parts.partition.interop.zero_grad import install_zero_grad, remove_zero_grad, zero_grad_shards

__all__ = ["load_pretrained", "num_parameters", "resize_token_embeddings", "clip_grad_norm_", "grad_norm",
           "install_zero_grad", "remove_zero_grad", "zero_grad_shards"]
