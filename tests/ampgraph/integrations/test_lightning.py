"""AmpGraphPrecision in a Lightning Trainer: two DDP ranks on CPU (gloo).

One pair of processes runs three fits: bf16 training, an fp16 run where only rank 1's
loss is infinite at one step (the flag all-reduce must make both ranks skip exactly that
step), and a resume from that run's checkpoint (the loss scale comes back).
"""

from __future__ import annotations

import os

import pytest
import torch
from torch import nn

from tests.distributed import free_port, spawn

pl = pytest.importorskip("lightning.pytorch", reason="lightning is not installed "
                         "(pip install -r requirements-pinned.txt)")

WORLD = 2
FP16_STEPS = 5
INF_STEP = 2  # rank 1's loss is inf here; its gradients stay finite


class Classifier(pl.LightningModule):
    def __init__(self, inject: bool = False):
        super().__init__()
        torch.manual_seed(0)
        self.net = nn.Sequential(nn.Linear(8, 16), nn.LayerNorm(16), nn.GELU(),
                                 nn.Linear(16, 4))
        self.loss = nn.CrossEntropyLoss()
        self.inject = inject
        self.records: list[tuple[float, bool, bool]] = []

    def training_step(self, batch, batch_idx):
        x, y = batch
        loss = self.loss(self(x), y)
        if self.inject and self.global_rank == 1 and self.global_step == INF_STEP:
            loss = loss + float("inf")
        return loss

    def forward(self, x):
        return self.net(x)

    def on_train_batch_start(self, batch, batch_idx):
        self._before = [p.detach().clone() for p in self.parameters()]

    def on_train_batch_end(self, outputs, batch, batch_idx):
        plugin = self.trainer.precision_plugin
        changed = any(not torch.equal(a, p) for a, p in zip(self._before, self.parameters()))
        self.records.append((plugin.loss_scale, plugin.last_step_skipped, changed))

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.2)


def _data(n: int = 64):
    g = torch.Generator().manual_seed(1)
    x = torch.randn(n, 8, generator=g)
    return torch.utils.data.DataLoader(torch.utils.data.TensorDataset(x, x[:, :4].argmax(1)),
                                       batch_size=8)


def _trainer(plugin, max_steps: int, root: str):
    return pl.Trainer(accelerator="cpu", devices=WORLD, strategy="ddp", plugins=[plugin],
                      max_steps=max_steps, logger=False, enable_checkpointing=False,
                      enable_progress_bar=False, enable_model_summary=False,
                      default_root_dir=root)


def _worker(rank: int, port: int, out_dir: str) -> None:
    from ampgraph.integrations.lightning import AmpGraphPrecision
    from ampgraph.module import AmpModule
    from ampgraph.train.loss_scale import DynamicLossScaleManager

    # launched here, not by Lightning: its environment then treats this process as rank
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), WORLD_SIZE=str(WORLD),
                      NODE_RANK="0", LOCAL_RANK=str(rank), PL_DISABLE_FORK="1")
    torch.set_num_threads(1)
    out: dict = {}
    # 1. bf16: trains, children compiled in place, keys unchanged
    model = Classifier()
    keys = list(model.state_dict())
    plugin = AmpGraphPrecision("O2", dtype="bf16")
    trainer = _trainer(plugin, 16, out_dir)
    trainer.fit(model, _data())
    x, y = next(iter(_data()))
    out["bf16"] = {
        "compiled": plugin.compiled, "is_amp": isinstance(model.net, AmpModule),
        "keys_same": list(model.state_dict()) == keys, "precision": trainer.precision,
        "manager": plugin.loss_scale_manager, "records": model.records,
        "params": [p.detach().clone() for p in model.parameters()],
        "loss_after": float(model.loss(model(x), y)),
        "loss_before": float(Classifier().loss(Classifier()(x), y)),
    }
    # 2. fp16, rank 1's loss overflows at one step
    model = Classifier(inject=True)
    plugin = AmpGraphPrecision("O2", dtype="fp16", loss_scale_manager=DynamicLossScaleManager(
        init_loss_scale=2.0**8, scale_window=1000))
    trainer = _trainer(plugin, FP16_STEPS, out_dir)
    trainer.fit(model, _data())
    ckpt = os.path.join(out_dir, "fp16.ckpt")
    trainer.save_checkpoint(ckpt)
    out["fp16"] = {"records": model.records, "scale": plugin.loss_scale,
                   "params": [p.detach().clone() for p in model.parameters()]}
    # 3. resume: the scale state comes back from the checkpoint
    model = Classifier()
    plugin = AmpGraphPrecision("O2", dtype="fp16")  # a fresh manager at 2**16
    trainer = _trainer(plugin, FP16_STEPS + 2, out_dir)
    trainer.fit(model, _data(), ckpt_path=ckpt)
    out["resume"] = {"records": model.records, "state": plugin.state_dict()}
    torch.save(out, os.path.join(out_dir, f"rank{rank}.pt"))  # spawn() ends the group


def test_ddp_bf16_trains_fp16_skips_together_and_the_scale_resumes(tmp_path):
    spawn(_worker, free_port(), str(tmp_path), nprocs=WORLD)
    r0, r1 = (torch.load(tmp_path / f"rank{r}.pt", weights_only=False) for r in range(WORLD))
    bf16 = r0["bf16"]
    assert bf16["compiled"] == ["net"] and bf16["is_amp"] and bf16["keys_same"]
    assert bf16["precision"] == "bf16-mixed" and bf16["manager"] is None
    assert bf16["loss_after"] < 0.7 * bf16["loss_before"]
    assert all(changed for _, _, changed in bf16["records"])
    for p, q in zip(bf16["params"], r1["bf16"]["params"]):
        assert torch.equal(p, q)  # DDP kept the ranks identical
    # fp16: both ranks skip exactly INF_STEP and back off once
    for rank, r in enumerate((r0, r1)):
        records = r["fp16"]["records"]
        assert [skipped for _, skipped, _ in records] == [
            i == INF_STEP for i in range(FP16_STEPS)], f"rank {rank}"
        assert [changed for _, _, changed in records] == [
            i != INF_STEP for i in range(FP16_STEPS)], f"rank {rank}"
        assert r["fp16"]["scale"] == 2.0**7
    for p, q in zip(r0["fp16"]["params"], r1["fp16"]["params"]):
        assert torch.equal(p, q)
    ckpt = torch.load(tmp_path / "fp16.ckpt", weights_only=False)
    assert ckpt["AmpGraphPrecision"]["loss_scale"] == 2.0**7
    assert ckpt["AmpGraphPrecision"]["manager"] == "DynamicLossScaleManager"
    # resumed at step FP16_STEPS with the saved scale, not a fresh 2**16
    resumed = r0["resume"]
    assert len(resumed["records"]) == 2
    assert resumed["records"][0][0] == 2.0**7
    assert resumed["state"]["scale_window"] == 1000


def test_plugin_state_waits_for_auto_and_refuses_a_mismatch():
    from ampgraph.integrations.lightning import AmpGraphPrecision
    from ampgraph.train.loss_scale import DynamicLossScaleManager

    saved = AmpGraphPrecision("O2", dtype="fp16").state_dict()
    assert saved["loss_scale"] == 2.0**16 and saved["manager"] == "DynamicLossScaleManager"
    # "auto" resolves at convert_module, on the Trainer's device; the state waits for it
    auto = AmpGraphPrecision(loss_scale_manager=DynamicLossScaleManager())
    auto.load_state_dict({**saved, "loss_scale": 64.0})
    assert auto.amp_dtype is None
    auto.convert_module(Classifier())
    assert auto.amp_dtype == torch.bfloat16 and auto.loss_scale == 64.0
    assert AmpGraphPrecision().state_dict() == {}  # bf16: nothing to save
    with pytest.raises(ValueError, match="resume with the saved run's dtype"):
        AmpGraphPrecision("O2", dtype="bf16").load_state_dict(saved)
    with pytest.raises(ValueError, match="loss_scale_manager must be"):
        AmpGraphPrecision(loss_scale_manager=2.0)


class TwoChildren(pl.LightningModule):
    def __init__(self):
        super().__init__()
        self.encoder = nn.Linear(8, 16)
        self.heads = nn.ModuleList([nn.Linear(16, 4), nn.Linear(16, 2)])
        self.loss = nn.CrossEntropyLoss()


def test_plugin_resolves_once_and_compiles_every_child_with_it(monkeypatch):
    from ampgraph.config import AmpConfig
    from ampgraph.integrations.lightning import AmpGraphPrecision

    calls = []
    real = AmpConfig.resolve
    monkeypatch.setattr(AmpConfig, "resolve",
                        lambda self, device: calls.append(device) or real(self, device))
    plugin = AmpGraphPrecision("o1", custom_deny=["softmax"])  # "auto": at convert_module
    assert calls == [] and plugin.resolved is None
    module = plugin.convert_module(TwoChildren())
    assert calls == [torch.device("cpu")]
    assert plugin.compiled == ["encoder", "heads.0", "heads.1"]
    children = [module.encoder, *module.heads]
    assert all(c.amp_resolved is plugin.resolved for c in children)
    assert plugin.resolved.level == "O1" and plugin.amp_dtype == torch.bfloat16
    assert plugin.resolved.config.custom_deny == ("softmax",)


def test_plugin_refuses_a_bad_level_when_built():
    from ampgraph.integrations.lightning import AmpGraphPrecision

    with pytest.raises(ValueError, match=r"unknown amp_level 'O4': choose one of O0, O1, O2, "
                                         r"O3"):
        AmpGraphPrecision("O4")
