"""Faithfulness: Python state changed after the first call is seen (capture/guards.py): the
graph is pointed at swapped tensors, captured again, or the call runs eagerly with a
warning; a stale graph never runs."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from tests.ampgraph.faithfulness.harness import (
    MLP,
    Case,
    check,
    compiled_whole,
    graphs,
    inputs,
    step,
)


class Tempered(MLP):
    def __init__(self) -> None:
        super().__init__()
        self.temperature = 1.0
        self.scales = [1.0, 2.0]

    def forward(self, x):
        return self.b(self.act(self.a(x)) * self.scales[1]) / self.temperature


def temperature(call, model):
    first = call(inputs())
    model.temperature = 4.0
    return [first, call(inputs()), call(inputs(seed=3))]


def scales_in_place(call, model):
    first = call(inputs())
    model.scales[1] = -3.0
    return [first, call(inputs())]


def churning(call, model):
    out = []
    for i in range(12):
        model.temperature = 1.0 + i
        out.append(call(inputs()))
    return out


def new_head(call, model):
    out = step(call, model, inputs())
    torch.manual_seed(5)
    model.b = nn.Linear(16, 4)
    return out + step(call, model, inputs())


def new_parameter(call, model):
    out = step(call, model, inputs())
    model.a.weight = nn.Parameter(torch.linspace(-1, 1, 128).view(16, 8))
    return out + step(call, model, inputs())


def bias_removed(call, model):
    first = call(inputs())
    model.b.register_parameter("bias", None)
    return [first, call(inputs())]


class Dropped(MLP):
    def __init__(self) -> None:
        super().__init__()
        self.drop = nn.Dropout(0.5)

    def forward(self, x):
        return self.drop(super().forward(x))


def monte_carlo_dropout(call, model):
    model.eval()
    x = inputs(n=256)
    with torch.no_grad():
        plain = call(x)
        model.drop.train()  # Monte-Carlo dropout: the rest stays in eval
        torch.manual_seed(7)
        a = call(x)
        torch.manual_seed(7)
        b = call(x)
        c = call(x)
    kept = a != 0
    return [plain, torch.equal(a, b), torch.equal(a, c), round(1 - kept.float().mean().item(), 1),
            torch.where(kept, a / 2, plain)]  # the kept values: the eval output, doubled


def dropout_rate_changed(call, model):
    model.train()
    call(inputs())
    model.drop.p = 0.0
    return [call(inputs())]


class Normed(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.a = nn.Linear(8, 16)
        self.bn = nn.BatchNorm1d(16)
        self.b = nn.Linear(16, 4)

    def forward(self, x):
        return self.b(torch.relu(self.bn(self.a(x))))


def frozen_batch_norm(call, model):
    model.train()
    out = step(call, model, inputs(n=16))
    model.bn.eval()  # fine-tuning with frozen statistics
    out += step(call, model, inputs(n=16, seed=4))
    return out + [model.bn.running_mean.clone(), model.bn.running_var.clone(),
                  int(model.bn.num_batches_tracked)]


def unfrozen(call, model):
    model.a.requires_grad_(False)
    out = step(call, model, inputs())
    model.a.requires_grad_(True)  # gradual unfreezing
    return out + step(call, model, inputs())


def mode_switches(call, model):
    out = []
    for mode in (True, False, True, False):
        model.train(mode)
        with torch.no_grad():
            out.append(call(inputs(n=16, seed=len(out))))
    return out


def functional_call(call, model):
    params = {k: v.detach() * 1.5 for k, v in model.named_parameters()}
    substituted = torch.func.functional_call(call, params, (inputs(),))
    return [call(inputs()), substituted, call(inputs())]


def functional_ensemble(call, model):
    out = []
    for k in range(3):
        params = {n: v.detach() + 0.1 * k for n, v in model.named_parameters()}
        out.append(torch.func.functional_call(call, params, (inputs(),)))
    return out


def pruned_after_a_step(call, model):
    """torch.nn.utils.prune rewires a module after the first call: a Parameter renamed,
    a mask buffer, a pre-forward hook that computes the weight on every call."""
    from torch.nn.utils import prune

    out = step(call, model, inputs())
    prune.l1_unstructured(model.a, "weight", amount=0.5)
    out += step(call, model, inputs())
    prune.remove(model.a, "weight")  # made permanent: a plain Parameter again
    return out + step(call, model, inputs())


def tiny_bert():
    transformers = pytest.importorskip("transformers")
    return transformers.BertModel(transformers.BertConfig(
        vocab_size=64, hidden_size=32, num_hidden_layers=2, num_attention_heads=2,
        intermediate_size=64, hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0)).eval()


IDS = torch.randint(1, 64, (2, 8), generator=torch.Generator().manual_seed(3))


def hidden_states_flag(call, model):
    with torch.no_grad():
        first = call(input_ids=IDS)
        model.config.output_hidden_states = True
        second = call(input_ids=IDS)
        model.config.output_hidden_states = False
        third = call(input_ids=IDS)
    return [first.last_hidden_state, first.hidden_states is None, len(second.hidden_states),
            *second.hidden_states, third.hidden_states is None]


def tiny_llama():
    transformers = pytest.importorskip("transformers")
    return transformers.LlamaForCausalLM(transformers.LlamaConfig(
        vocab_size=64, hidden_size=32, num_hidden_layers=2, num_attention_heads=2,
        num_key_value_heads=1, intermediate_size=64, use_cache=False)).train()


def checkpointing_enabled_later(call, model):
    import warnings

    def one():
        model.zero_grad(set_to_none=True)
        out = call(input_ids=IDS).logits
        out.float().square().mean().backward()
        return [out.detach(), model.model.layers[0].mlp.up_proj.weight.grad.clone()]

    first = one()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", FutureWarning)
        model.gradient_checkpointing_enable()
    return first + one()


def checkpoint_regions(net):
    from passes.fx.checkpoints import CheckpointedRegion

    compiled_whole(net)
    nodes = net.amp_parts()[0][0][1].gm.graph.nodes
    assert sum(isinstance(n.target, CheckpointedRegion) for n in nodes) == 2


def at_most(n):
    def after(net):
        compiled_whole(net)
        assert graphs(net) <= n, graphs(net)
    return after


CASES = [
    Case("an attribute forward divides by, changed after the first call", Tempered,
         temperature, after=at_most(2)),
    Case("a list attribute changed in place", Tempered, scales_in_place, after=at_most(2)),
    Case("an attribute changed on every call", Tempered, churning,
         warns="captured again 8 times .*model.temperature"),
    Case("the head replaced after a training step", MLP, new_head, after=at_most(2)),
    Case("a weight replaced by a new Parameter", MLP, new_parameter, after=at_most(1)),
    Case("a bias removed", MLP, bias_removed, after=at_most(2)),
    Case("Monte-Carlo dropout: a dropout switched to train in an eval model", Dropped,
         monte_carlo_dropout),
    Case("a dropout rate changed", Dropped, dropout_rate_changed),
    Case("a batch norm frozen (eval) inside a training model", Normed, frozen_batch_norm),
    Case("a frozen layer unfrozen after a step", MLP, unfrozen, after=at_most(1)),
    Case("train, eval, train, eval", Normed, mode_switches, after=at_most(2)),
    Case("parameters substituted by torch.func.functional_call", MLP, functional_call,
         after=at_most(1)),
    Case("functional_call over an ensemble of parameter sets", MLP, functional_ensemble,
         after=at_most(1)),
    Case("torch.nn.utils.prune applied after a step, then made permanent", MLP,
         pruned_after_a_step, warns="a could not be captured whole .*requires grad"),
    Case("HF config.output_hidden_states switched on and off", tiny_bert, hidden_states_flag,
         after=at_most(3)),  # the third: transformers installs its capture hooks lazily
    Case("HF gradient checkpointing enabled after the first step", tiny_llama,
         checkpointing_enabled_later, after=checkpoint_regions),
]


@pytest.mark.parametrize("case", CASES, ids=str)
def test_state(case):
    check(case)
