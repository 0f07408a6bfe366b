"""Sharded checkpoints through ``torch.distributed.checkpoint`` (DCP): a train step's model,
optimizer, loss-scale manager and counters, each rank writing its own shards.

A compiled model keeps its parameters' names (an ``AmpModule`` shares its module's
parameter dicts), so the checkpoint's keys are the uncompiled model's, and a checkpoint
loads into the model compiled or not, sharded over another number of ranks, or unsharded.
"""

from __future__ import annotations

import os
from typing import Any

from ampgraph.train.step import TrainStep


def save_checkpoint(checkpoint_id: str | os.PathLike, step: TrainStep) -> None:
    """Save ``step``'s model, optimizer, loss-scale and counter state with DCP.

    Every rank calls it (with no process group, the one process writes everything).

    Example:
        >>> save_checkpoint(f"ckpt/step{k}", step)  # doctest: +SKIP
    """
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_state_dict

    model, optimizer = get_state_dict(step.module, step.optimizer)
    dcp.save({"model": model, "optimizer": optimizer, "ampgraph": step.progress_state_dict()},
             checkpoint_id=checkpoint_id)


def load_checkpoint(checkpoint_id: str | os.PathLike, step: TrainStep) -> None:
    """Load what :func:`save_checkpoint` saved into ``step``'s model, optimizer and manager,
    in place; the next step continues the saved run exactly.

    The step must be built as the saved one was (the same model structure, optimizer type
    and loss-scale manager type); the process count may differ.

    Raises:
        ValueError: the step has a loss-scale manager and the checkpoint none, or the
            reverse.

    Example:
        >>> load_checkpoint(f"ckpt/step{k}", step)  # doctest: +SKIP
    """
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict

    model, optimizer = get_state_dict(step.module, step.optimizer)
    state: dict[str, Any] = {"model": model, "optimizer": optimizer,
                             "ampgraph": step.progress_state_dict()}
    dcp.load(state, checkpoint_id=checkpoint_id)
    set_state_dict(step.module, step.optimizer, model_state_dict=state["model"],
                   optim_state_dict=state["optimizer"])
    step.load_progress_state_dict(state["ampgraph"])
