"""End to end: digits convergence at FP32 / O2-bf16 / O2-fp16, exact checkpoint/resume of a
deterministic fp16 run, and the HuggingFace recipe.

Digits: the same model (the reference tabular MLP with BatchNorm, sized down so that fp16 stays
affordable on a CPU without fp16 arithmetic), initialisation, batch order and optimizer
settings; each run's accuracy is measured through its own compiled model in eval mode.
"""

from __future__ import annotations

import io
import time

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from ampgraph.train.loss_scale import DynamicLossScaleManager
from ampgraph.train.step import build_train_step
from tests.helpers import load_model_file

pytestmark = pytest.mark.usefixtures("one_thread")

datasets = pytest.importorskip("sklearn.datasets")
model_selection = pytest.importorskip("sklearn.model_selection")

EPOCHS = 15
BATCH = 32


RUNS = {  # name: (amp_level, dtype)
    "fp32": ("O0", "auto"),
    "O2-bf16": ("O2", "bf16"),
    "O2-fp16": ("O2", "fp16"),
}


def _digits() -> tuple[torch.Tensor, ...]:
    x, y = datasets.load_digits(return_X_y=True)
    x_train, x_test, y_train, y_test = model_selection.train_test_split(
        x, y, test_size=0.2, random_state=0, stratify=y
    )
    as_x = lambda a: torch.tensor(a, dtype=torch.float32) / 16.0
    as_y = lambda a: torch.tensor(a, dtype=torch.long)
    return as_x(x_train), as_y(y_train), as_x(x_test), as_y(y_test)


def _train(level: str, dtype: str, data: tuple[torch.Tensor, ...]) -> dict:
    x_train, y_train, x_test, y_test = data
    torch.manual_seed(0)
    model = load_model_file("tabular_mlp").make_model(hidden=64, depth=2)
    opt = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
    step = build_train_step(model, F.cross_entropy, opt, level, dtype)
    order = torch.Generator().manual_seed(1)
    start, skipped = None, 0
    for _ in range(EPOCHS):
        perm = torch.randperm(len(x_train), generator=order)
        for i in range(0, len(perm) - BATCH + 1, BATCH):
            idx = perm[i:i + BATCH]
            skipped += step(x_train[idx], y_train[idx]).overflow
            start = start or time.perf_counter()  # after the first call (graph capture)
    seconds = time.perf_counter() - start
    step.module.eval()
    with torch.no_grad():
        logits = step.module(x_test)
    accuracy = 100.0 * (logits.argmax(1) == y_test).float().mean().item()
    return {"accuracy": accuracy, "skipped": skipped, "seconds": seconds,
            "manager": step.loss_scale_manager}


@pytest.mark.slow
@pytest.mark.filterwarnings("ignore:fp16 on a CPU:RuntimeWarning")
def test_digits_accuracy_matches_fp32_within_1_5_points():
    data = _digits()
    results = {name: _train(level, dtype, data) for name, (level, dtype) in RUNS.items()}
    report = ", ".join(
        f"{name} {r['accuracy']:.2f}% ({r['skipped']} skipped, {r['seconds']:.1f}s)"
        for name, r in results.items()
    )
    print(f"digits test accuracy: {report}")
    fp32 = results["fp32"]["accuracy"]
    assert fp32 > 90.0, report
    assert results["O2-bf16"]["manager"] is None
    assert isinstance(results["O2-fp16"]["manager"], DynamicLossScaleManager)
    assert results["O2-fp16"]["skipped"] < 30, report  # backs off if it must, then trains
    for name in ("O2-bf16", "O2-fp16"):
        assert abs(results[name]["accuracy"] - fp32) <= 1.5, report


@pytest.mark.slow
@pytest.mark.filterwarnings("ignore:fp16 on a CPU:RuntimeWarning")
def test_huggingface_recipe_fp16_with_labels():
    """docs/training.md's recipe: loss_fn=None, the batch as keyword arguments with labels."""
    transformers = pytest.importorskip("transformers")
    config = transformers.BertConfig(
        vocab_size=120, hidden_size=32, num_hidden_layers=2, num_attention_heads=4,
        intermediate_size=64, max_position_embeddings=64, num_labels=3,
        hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0,
    )
    torch.manual_seed(0)
    model = transformers.BertForSequenceClassification(config)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3, fused=True)
    step = build_train_step(model, None, opt, "O2", "fp16", clip_grad_norm=1.0)
    g = torch.Generator().manual_seed(0)
    data = {"input_ids": torch.randint(1, 120, (8, 16), generator=g),
            "attention_mask": torch.ones(8, 16, dtype=torch.long),
            "labels": torch.randint(0, 3, (8,), generator=g)}
    outs = [step(**data) for _ in range(30)]
    overflows = [o.overflow for o in outs]
    assert not any(overflows[-10:])  # backs off if it must, then trains
    assert outs[-1].loss < 0.7 * outs[0].loss
    assert all(p.dtype == torch.float32 for p in model.parameters())


def _mlp(seed: int = 0) -> nn.Module:
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(64, 32), nn.ReLU(), nn.Linear(32, 10))


def _batch(i: int, n: int = 16) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(1000 + i)
    return torch.randn(n, 64, generator=g), torch.randint(0, 10, (n,), generator=g)


def _run(model, manager_state, steps, ckpt=None):
    opt = torch.optim.Adam(model.parameters(), lr=1e-2)
    manager = DynamicLossScaleManager(**manager_state)
    step = build_train_step(model, F.cross_entropy, opt, "O2", "fp16",
                            loss_scale_manager=manager)
    if ckpt is not None:
        step.load_state_dict(torch.load(io.BytesIO(ckpt)))
    record = []
    for i in steps:
        out = step(*_batch(i))
        record.append((out.loss.item(), out.loss_scale, out.overflow))
    buffer = io.BytesIO()
    torch.save(step.state_dict(), buffer)
    return record, buffer.getvalue(), step


@pytest.mark.filterwarnings("ignore:fp16 on a CPU:RuntimeWarning")
def test_checkpoint_resume_reproduces_the_run_exactly():
    config = {"init_loss_scale": 2.0**24, "scale_window": 3}
    full, _, _ = _run(_mlp(), config, range(24))
    assert any(o for _, _, o in full) and len({s for _, s, _ in full}) > 3
    first, ckpt, _ = _run(_mlp(), config, range(11))
    state = torch.load(io.BytesIO(ckpt))
    assert state["model"].keys() == _mlp().state_dict().keys() and state["step"]["step_index"] == 11
    second, _, resumed = _run(_mlp(seed=5), {"init_loss_scale": 2.0}, range(11, 24), ckpt)
    assert first + second == full
    assert resumed.step_index == 24
