"""Training on several devices: FSDP2 sharding of a model compiled region by region
(:func:`shard`), DDP's gradients in 16 bits (:func:`compress_ddp_gradients`), sharded
checkpoints (:func:`save_checkpoint`, :func:`load_checkpoint`) and the bytes collectives
move (:class:`CollectiveBytes`). ``torch.distributed``'s pieces are imported on first use."""

from __future__ import annotations

from ampgraph.parallel.checkpoint import load_checkpoint, save_checkpoint
from ampgraph.parallel.ddp import compress_ddp_gradients
from ampgraph.parallel.fsdp import mixed_precision_policy, shard
from ampgraph.parallel.regions import compile_regions, find_blocks
from ampgraph.parallel.traffic import CollectiveBytes

__all__ = ["CollectiveBytes", "compile_regions", "compress_ddp_gradients", "find_blocks",
           "load_checkpoint", "mixed_precision_policy", "save_checkpoint", "shard"]
