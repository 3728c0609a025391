"""``python -m parts.export CHECKPOINT_DIR OUT_DIR``: a DCP checkpoint to safetensors (see ``parts.export``)."""

from __future__ import annotations

import argparse
import sys
from typing import Optional, Sequence

import torch

from parts.export import export

_DTYPES = {"float32": torch.float32, "fp32": torch.float32, "bfloat16": torch.bfloat16, "bf16": torch.bfloat16,
           "float16": torch.float16, "fp16": torch.float16}


def main(argv: Optional[Sequence[str]] = None) -> int:
    """Parse the command line, export, print what was written."""
    parser = argparse.ArgumentParser(prog="python -m parts.export", description=__doc__)
    parser.add_argument("checkpoint_dir", help="a DCP checkpoint directory (parts, torch dcp.save, FSDP2), "
                        "or a parts Trainer (checkpoint-N) or accelerate save_state folder holding one")
    parser.add_argument("out_dir", help="where the safetensors files go")
    parser.add_argument("--max-shard-size", default="5GB", help="largest output file (default 5GB)")
    parser.add_argument("--dtype", choices=sorted(_DTYPES), default=None,
                        help="cast floating tensors to this dtype (default: as stored)")
    parser.add_argument("--prefix", default=None, help='export only the keys under this top-level key, without it '
                        '("model" for dcp.save({"model": state_dict, "optimizer": ...}); "" keeps the keys as '
                        'they are; default: the one top-level key holding the model, where there is one)')
    parser.add_argument("--config", default=None, help="a config.json (or a folder holding one) to check the "
                        "keys against and copy (default: the config.json beside the checkpoint)")
    parser.add_argument("--merge", action="store_true", help="a peft LoRA checkpoint: write the base model "
                        "with the adapter merged (default: the adapter in peft's layout)")
    args = parser.parse_args(argv)
    result = export(args.checkpoint_dir, args.out_dir, max_shard_size=args.max_shard_size,
                    dtype=_DTYPES[args.dtype] if args.dtype else None, prefix=args.prefix, merge=args.merge,
                    config=args.config)
    what = {"adapter": "the peft adapter: ", "merged": "the model with its LoRA adapter merged: "}.get(result.kind, "")
    left = [k for k in result.skipped if k.split(".", 1)[0] not in result.left_out]
    print(f"read {result.checkpoint}"
          + (f"; exported the model under {result.prefix!r} (its keys without '{result.prefix}.'; --prefix)"
             if result.prefix else "")
          + f"; wrote {what}{result.tensors} tensors ({result.total_bytes} bytes) into "
          f"{len(result.files)} file(s) in {args.out_dir}; {result.checked}"
          + (f"; removed the earlier export's {[p.name for p in result.removed]}" if result.removed else "")
          + (f"; left out the checkpoint's entries {result.left_out}" if result.left_out else "")
          + (f"; left out non-tensor keys {left}" if left else ""))
    return 0


if __name__ == "__main__":
    sys.exit(main())
