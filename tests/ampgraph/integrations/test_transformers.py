"""A compiled HF model in the plain ``transformers.Trainer``, and ``AmpGraphTrainer``."""

from __future__ import annotations

import inspect

import pytest
import torch

import ampgraph

transformers = pytest.importorskip("transformers")
pytest.importorskip("accelerate", reason="accelerate is not installed "
                    "(pip install -r requirements-pinned.txt)")

SEQ = 12


def _config(**kw):
    base = dict(vocab_size=64, hidden_size=32, num_hidden_layers=2, num_attention_heads=2,
                intermediate_size=64, max_position_embeddings=32, num_labels=2)
    return transformers.BertConfig(**{**base, **kw})


class Tokens(torch.utils.data.Dataset):
    """input_ids/labels plus a column forward does not take (the Trainer must drop it)."""

    def __init__(self, n: int = 32, seed: int = 0):
        g = torch.Generator().manual_seed(seed)
        self.ids = torch.randint(0, 64, (n, SEQ), generator=g)
        self.labels = (self.ids[:, 0] >= 32).long()

    def __len__(self):
        return len(self.ids)

    def __getitem__(self, i):
        return {"input_ids": self.ids[i], "labels": self.labels[i], "unused_column": i}


def _args(tmp_path, **kw):
    base = dict(output_dir=str(tmp_path), use_cpu=True, per_device_train_batch_size=8,
                per_device_eval_batch_size=16, report_to=[], disable_tqdm=True,
                save_strategy="no", learning_rate=2e-3, logging_steps=1, seed=0)
    return transformers.TrainingArguments(**{**base, **kw})


def _params(model):
    return {k: v.detach().clone() for k, v in model.state_dict().items()}


def test_plain_trainer_trains_evaluates_and_saves_a_compiled_bert(tmp_path, one_thread):
    torch.manual_seed(0)
    model = transformers.BertForSequenceClassification(_config())
    net = ampgraph.compile(model, "O2", "bf16")
    assert inspect.signature(net.forward) == inspect.signature(model.forward)
    assert net.config is model.config and net.can_generate() == model.can_generate()
    before = _params(model)
    # no label_names: the Trainer finds them by type(net), named and signed like the model's
    args = _args(tmp_path, max_steps=4, bf16=True)
    trainer = transformers.Trainer(model=net, args=args, train_dataset=Tokens(),
                                   eval_dataset=Tokens(16, seed=1))
    trainer.train()
    metrics = trainer.evaluate()
    assert torch.isfinite(torch.tensor(metrics["eval_loss"]))
    assert any(not torch.equal(before[k], v) for k, v in model.state_dict().items())
    assert net.amp_parts()[0], "the compiled graph ran"
    trainer.save_model(str(tmp_path / "final"))
    # net is a PreTrainedModel: the plain Trainer saves it with the model's save_pretrained
    assert (tmp_path / "final" / "config.json").exists()
    reloaded = transformers.BertForSequenceClassification.from_pretrained(
        str(tmp_path / "final"))
    after = model.state_dict()
    assert reloaded.state_dict().keys() == after.keys()
    for k, v in reloaded.state_dict().items():
        assert torch.equal(v, after[k]), k


def _tiny(cls_name: str):
    return getattr(transformers, cls_name)(_config(num_hidden_layers=1))


def test_plain_trainer_finds_a_compiled_models_label_names(tmp_path, one_thread):
    from transformers.utils import can_return_loss, find_labels

    torch.manual_seed(0)
    model = _tiny("BertForSequenceClassification")
    net = ampgraph.compile(model, "O2", "bf16")
    assert find_labels(type(net)) == find_labels(type(model)) == ["labels"]
    assert can_return_loss(type(net)) is can_return_loss(type(model)) is False
    args = transformers.TrainingArguments(output_dir=str(tmp_path), report_to=[], use_cpu=True,
                                          per_device_eval_batch_size=8, disable_tqdm=True)
    trainer = transformers.Trainer(model=net, args=args, eval_dataset=Tokens(16, seed=1))
    assert trainer.label_names == ["labels"]
    metrics = trainer.evaluate()
    assert "eval_loss" in metrics and torch.isfinite(torch.tensor(metrics["eval_loss"]))


def test_find_labels_of_a_compiled_question_answering_model():
    from transformers.utils import find_labels

    model = _tiny("BertForQuestionAnswering")
    net = ampgraph.compile(model, "O2", "bf16")
    assert "QuestionAnswering" in type(net).__name__
    assert find_labels(type(net)) == find_labels(type(model)) == [
        "start_positions", "end_positions"]


def test_can_return_loss_of_a_compiled_model():
    from transformers.utils import can_return_loss

    class Contrastive(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.fc = torch.nn.Linear(4, 4)

        def forward(self, x, return_loss=True):
            return self.fc(x).sum()

    assert can_return_loss(type(ampgraph.compile(Contrastive(), "O2", "bf16"))) is True


def test_plain_trainer_saves_a_compiled_model_with_tied_weights(tmp_path):
    torch.manual_seed(0)
    model = _tiny("BertForMaskedLM")  # tied word embeddings / decoder: no bare state dict
    net = ampgraph.compile(model, "O2", "bf16")
    trainer = transformers.Trainer(model=net, args=_args(tmp_path))
    trainer.save_model(str(tmp_path / "mlm"))
    assert (tmp_path / "mlm" / "config.json").exists()
    reloaded = transformers.BertForMaskedLM.from_pretrained(str(tmp_path / "mlm"))
    assert reloaded.config.architectures == ["BertForMaskedLM"]
    assert reloaded.state_dict().keys() == model.state_dict().keys()
    for k, v in reloaded.state_dict().items():
        assert torch.equal(v, model.state_dict()[k]), k


class Overflowing:
    """Mixed into AmpGraphTrainer: the loss of one optimizer step is inf (its gradients
    stay finite), so only the non-finite-loss check can catch it."""

    INF_STEP = 1

    def compute_loss(self, model, inputs, *args, **kwargs):
        loss = super().compute_loss(model, inputs, *args, **kwargs)
        if model.training and self.state.global_step == self.INF_STEP:
            loss = loss + float("inf")
        return loss


def test_amp_graph_trainer_fp16_skips_an_overflow_without_advancing_the_scheduler(
        tmp_path, one_thread):
    from ampgraph.integrations.transformers import AmpGraphTrainer
    from ampgraph.train.loss_scale import DynamicLossScaleManager

    class Trainer(Overflowing, AmpGraphTrainer):
        pass

    torch.manual_seed(0)
    model = transformers.BertForMaskedLM(_config())  # tied word embeddings / decoder
    assert model.cls.predictions.decoder.weight is model.bert.embeddings.word_embeddings.weight
    records = []

    class Record(transformers.TrainerCallback):
        def on_step_end(self, args, state, control, **kw):
            records.append((trainer.lr_scheduler.last_epoch, trainer.optimizer.step_was_skipped,
                            trainer.loss_scaler.get_loss_scale()))

    class Masked(Tokens):
        def __getitem__(self, i):
            return {"input_ids": self.ids[i], "labels": self.ids[i]}

    trainer = Trainer(model=model, args=_args(tmp_path, max_steps=4, max_grad_norm=1.0),
                      train_dataset=Masked(), callbacks=[Record()], amp_dtype="fp16",
                      loss_scale_manager=DynamicLossScaleManager(init_loss_scale=2.0**6,
                                                                 scale_window=1000))
    assert isinstance(trainer.model, ampgraph.AmpModule)
    assert trainer.model.amp_dtype == torch.float16
    assert trainer.label_names == ["labels"]  # found by the compiled module's class
    trainer.train()
    # step 1 skipped: the scheduler did not advance then, the scale halved once
    assert [skipped for _, skipped, _ in records] == [False, True, False, False]
    assert [epoch for epoch, _, _ in records] == [1, 1, 2, 3]
    assert [scale for _, _, scale in records] == [64.0, 32.0, 32.0, 32.0]
    logged = [h for h in trainer.state.log_history if "loss" in h]
    assert logged and all("loss_scale" in h for h in logged)
    # saved through the wrapped model's save_pretrained: config.json, tied weights
    trainer.save_model(str(tmp_path / "mlm"))
    assert (tmp_path / "mlm" / "config.json").exists()
    reloaded = transformers.BertForMaskedLM.from_pretrained(str(tmp_path / "mlm"))
    for k, v in reloaded.state_dict().items():
        assert torch.equal(v, model.state_dict()[k]), k


def test_amp_graph_trainer_refuses_trainer_autocast(tmp_path):
    from ampgraph.integrations.transformers import AmpGraphTrainer

    model = transformers.BertForSequenceClassification(_config())
    with pytest.raises(ValueError, match="pass amp_dtype="):
        AmpGraphTrainer(model=model, args=_args(tmp_path, bf16=True))


def test_amp_graph_trainer_resolves_once_on_the_training_device(tmp_path, monkeypatch):
    from ampgraph.config import AmpConfig
    from ampgraph.integrations.transformers import AmpGraphTrainer

    calls = []
    real = AmpConfig.resolve
    monkeypatch.setattr(AmpConfig, "resolve",
                        lambda self, device: calls.append(device) or real(self, device))
    args = _args(tmp_path)
    trainer = AmpGraphTrainer(model=transformers.BertForSequenceClassification(_config()),
                              args=args, amp_level="o2", amp_dtype="auto")
    assert calls == [args.device]
    resolved = trainer.model.amp_resolved
    assert (resolved.level, resolved.dtype, resolved.device) == ("O2", torch.bfloat16,
                                                                 args.device)
    assert trainer.loss_scaler is None  # bf16: no loss scaling
