"""ampgraph/train/graphs.py: the whole train step as CUDA graphs. On the CPU the graphs are
ReplayCheck's (GraphCapture(check=True)): each replay reruns the step and fails where a
CUDA graph would not replay it faithfully, so these tests check, on every machine, that the
step is capturable (no host syncs, the same ops on the same memory every replay) and that
the graphed step trains as the eager one. The CUDA-marked tests capture real graphs."""

from __future__ import annotations

import copy

import pytest
import torch
import torch.nn.functional as F
from torch import nn
from torch.utils._python_dispatch import TorchDispatchMode

import ampgraph
from ampgraph.train.graphs import GraphCapture, StepGraphs
from ampgraph.train.loss_scale import DynamicLossScaleManager
from ampgraph.train.replay_check import SYNC_OPS

pytestmark = [
    pytest.mark.filterwarnings("ignore:fp16 on a CPU:RuntimeWarning"),
    pytest.mark.usefixtures("one_thread"),
]
CHECK = GraphCapture(check=True, warmup_steps=2)


class Net(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc1, self.fc2 = nn.Linear(16, 32), nn.Linear(32, 4)
        self.norm = nn.LayerNorm(32)

    def forward(self, x):
        return self.fc2(self.norm(F.gelu(self.fc1(x))))


def data(i, n=8):
    g = torch.Generator().manual_seed(i)
    return torch.randn(n, 16, generator=g), torch.randint(0, 4, (n,), generator=g)


def two_steps(dtype="fp16", device="cpu", **kwargs):
    """The same model trained by an eager step and a graphed one (check engine on CPU)."""
    torch.manual_seed(0)
    model = Net().to(device)
    ref = copy.deepcopy(model)
    capture = kwargs.pop("capture", CHECK if device == "cpu" else GraphCapture(warmup_steps=2))
    steps = []
    for m, graph in ((model, capture), (ref, False)):
        opt = torch.optim.AdamW(m.parameters(), lr=1e-2, fused=True, capturable=True)
        manager = DynamicLossScaleManager(2.0**10, scale_window=4) if dtype == "fp16" else None
        net = ampgraph.compile(m, "O2", dtype, runtime="cuda")
        steps.append(ampgraph.build_train_step(net, F.cross_entropy, opt, loss_scale_manager=(
            manager or "auto"), cuda_graph=graph, **kwargs))
    return (model, steps[0]), (ref, steps[1])


def test_the_graphed_step_trains_as_the_eager_one_through_an_overflow():
    """20 steps, fp16 with dynamic loss scaling; step 9 overflows (an inf input): both skip
    it inside the step and halve the scale, and the losses agree to fp32 rounding."""
    (model, graphed), (ref, eager) = two_steps()
    for i in range(20):
        x, y = data(i)
        if i == 9:
            x[0, 0] = float("inf")
        a, b = graphed(x, y), eager(x, y)
        assert a.overflow == b.overflow == (i == 9), i
        assert a.loss_scale == b.loss_scale
        if i != 9:
            torch.testing.assert_close(a.loss, b.loss, rtol=1e-5, atol=0)
    assert graphed.graphs.captures == 1 and graphed.graphs.replays == 20 - 3
    for p, q in zip(model.parameters(), ref.parameters()):
        torch.testing.assert_close(p, q, rtol=1e-5, atol=1e-7)


class Syncs(TorchDispatchMode):
    """Counts the ops that wait for the device: .item() / _local_scalar_dense, nonzero,
    is_nonzero (and the rest of ReplayCheck's list)."""

    def __init__(self):
        super().__init__()
        self.ops = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if func.overloadpacket.__name__ in SYNC_OPS:
            self.ops.append(func.overloadpacket.__name__)
        return func(*args, **(kwargs or {}))


@pytest.mark.parametrize("accumulation_steps", [1, 2])
def test_a_step_with_a_fused_optimizer_makes_no_host_sync(accumulation_steps):
    assert {"item", "_local_scalar_dense", "nonzero", "is_nonzero"} <= SYNC_OPS
    (model, step), _ = two_steps(capture=False, accumulation_steps=accumulation_steps)
    for i in range(2):
        step(*data(i))
    syncs = Syncs()
    with syncs:
        outs = [step(*data(i)) for i in range(2, 4)]
    assert syncs.ops == []
    assert outs[-1].stepped and not outs[-1].overflow  # read after the step: the caller's


def test_a_transformers_bert_step_is_capturable_and_makes_no_host_sync():
    """An HF model with its own loss, dropout and attention mask, fp16 with dynamic loss
    scaling: every replay checked by ReplayCheck, and no sync in any call."""
    tf = pytest.importorskip("transformers")
    torch.manual_seed(0)
    model = tf.BertForSequenceClassification(tf.BertConfig(
        hidden_size=32, num_hidden_layers=2, num_attention_heads=2, intermediate_size=64,
        vocab_size=100))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3, fused=True, capturable=True)
    step = ampgraph.build_train_step(model, None, opt, "O2", "fp16", runtime="cuda",
                                     cuda_graph=CHECK)
    g = torch.Generator().manual_seed(0)
    syncs = Syncs()
    for _ in range(6):
        ids = torch.randint(1, 100, (4, 16), generator=g)
        with syncs:
            out = step(input_ids=ids, attention_mask=torch.ones_like(ids),
                       labels=torch.randint(0, 2, (4,), generator=g))
        assert torch.isfinite(out.loss)
    assert syncs.ops == [] and step.graphs.captures == 1 and step.graphs.replays == 3


def test_what_the_step_reads_between_steps_keeps_its_address():
    """Gradients, working copies, the loss scale, the flag, optimizer state and the step's
    outputs stay where they are from one replay to the next (ReplayCheck also checks every
    op's inputs made before the step)."""
    (model, graphed), _ = two_steps()

    def addresses():
        opt_state = [t.data_ptr() for s in graphed.optimizer.state.values()
                     for t in s.values() if isinstance(t, torch.Tensor)]
        return ([p.grad.data_ptr() for p in model.parameters()],
                [c.data_ptr() for c in graphed.module.working_copies()],
                graphed.loss_scale_manager.scale.data_ptr(), opt_state,
                [t.data_ptr() for e in graphed.graphs._entries.values() for t in e.outputs
                 if isinstance(t, torch.Tensor)])

    for i in range(4):
        graphed(*data(i))
    before = addresses()
    for i in range(4, 7):
        graphed(*data(i))
    assert addresses() == before and len(before[0]) == 6 and before[1]


def test_accumulation_captures_a_graph_per_phase_and_matches_eager():
    (model, graphed), (ref, eager) = two_steps("bf16", accumulation_steps=3)
    for i in range(15):
        a, b = graphed(*data(i)), eager(*data(i))
        assert a.stepped == b.stepped == (i % 3 == 2)
        torch.testing.assert_close(a.loss, b.loss, rtol=1e-5, atol=0)
    assert graphed.graphs.captures == 3  # first, middle, last
    for p, q in zip(model.parameters(), ref.parameters()):
        torch.testing.assert_close(p, q, rtol=1e-5, atol=1e-7)


def test_new_shapes_capture_new_graphs_within_a_bounded_cache():
    (model, graphed), _ = two_steps("bf16", capture=GraphCapture(check=True, warmup_steps=1,
                                                                max_graphs=2))
    for rows in (8, 8, 4, 4, 6, 6, 8, 8):  # three signatures, two graphs kept
        graphed(*data(rows, n=rows))
        assert len(graphed.graphs) <= 2
    assert graphed.graphs.captures == 4  # 8, 4, 6, then 8 again: evicted by 6


def test_signatures_that_never_repeat_are_not_remembered_without_bound():
    graphs = StepGraphs({"whole": lambda x: (x.sum(), x, None)}, [],
                        torch.optim.SGD([torch.zeros(1)], lr=0.1), refresh=lambda: None,
                        holds=list, engine=None, config=GraphCapture(max_graphs=1))
    graphs.engine = type("Eager", (), {"warmup": staticmethod(lambda f, a, k: f(*a, **k))})()
    for n in range(1, 60):  # a new length every call: warm-up calls only
        graphs("whole", (torch.ones(n),), {})
    assert len(graphs._entries) <= 16


def test_an_optimizer_that_cannot_be_captured_is_refused_with_the_fix():
    model = Net()
    for opt in (torch.optim.AdamW(model.parameters()),  # decides on the host
                torch.optim.AdamW(model.parameters(), fused=True),  # torch refuses: capturable
                torch.optim.Adam(model.parameters(), capturable=False, foreach=True)):
        with pytest.raises(ValueError, match=r"fused=True.*capturable=True"):
            ampgraph.build_train_step(model, F.cross_entropy, opt, "O2", "bf16",
                                      cuda_graph=True)


def test_without_a_cuda_device_the_step_runs_eagerly_and_says_why():
    model = Net()
    opt = torch.optim.AdamW(model.parameters(), fused=True, capturable=True)
    with pytest.warns(RuntimeWarning, match="runs eagerly: the model is on cpu: CUDA graphs need"):
        step = ampgraph.build_train_step(model, F.cross_entropy, opt, "O2", "bf16",
                                         cuda_graph=True)
    assert step.graphs is None
    assert step(*data(0)).stepped


class _FailingEngine:
    def warmup(self, fn, args, kwargs):
        return fn(*args, **kwargs)

    def capture(self, fn, args, kwargs, prepare):
        prepare()
        raise RuntimeError("operation not permitted when stream is capturing")


def test_a_failed_capture_warns_once_and_runs_that_signature_eagerly():
    calls, refreshes = [], []

    def phase(x):
        calls.append(x.shape)
        return x.sum(), torch.zeros(2), None

    graphs = StepGraphs({"whole": phase}, [], torch.optim.SGD([torch.zeros(1)], lr=0.1),
                        refresh=lambda: refreshes.append(1), holds=list,
                        engine=_FailingEngine(), config=GraphCapture(warmup_steps=1))
    graphs("whole", (torch.ones(2),), {})
    with pytest.warns(RuntimeWarning, match="could not be captured.*not permitted"):
        loss, _, _ = graphs("whole", (torch.ones(2),), {})
    assert loss.item() == 2.0 and len(calls) == 2 and len(refreshes) == 2
    graphs("whole", (torch.ones(2),), {})  # no second warning: eager from now on
    assert len(calls) == 3 and len(graphs) == 0


def test_a_changed_float_hyperparameter_is_refused_and_reset_graphs_recaptures():
    (model, graphed), _ = two_steps("bf16")
    for i in range(3):
        graphed(*data(i))
    graphed.optimizer.param_groups[0]["lr"] = 1e-3
    with pytest.raises(RuntimeError, match=r"lr 0.01 -> 0.001.*lr=torch.tensor"):
        graphed(*data(3))
    graphed.reset_graphs()
    for i in range(3):
        graphed(*data(i))
    assert graphed.graphs.captures == 2


def test_a_tensor_learning_rate_changed_in_place_is_replayed():
    torch.manual_seed(0)
    model = Net()
    lr = torch.tensor(1e-2)
    opt = torch.optim.AdamW(model.parameters(), lr=lr, fused=True, capturable=True)
    step = ampgraph.build_train_step(model, F.cross_entropy, opt, "O2", "bf16", runtime="cuda",
                                     cuda_graph=CHECK)
    for i in range(3):
        step(*data(i))
    before = [p.detach().clone() for p in model.parameters()]
    lr.fill_(0.0)  # what a scheduler does to a tensor lr
    step(*data(3))
    assert all(torch.equal(p, q) for p, q in zip(model.parameters(), before))


def test_eager_evaluation_after_graphed_steps_sees_the_updated_weights():
    (model, graphed), _ = two_steps("bf16")
    for i in range(5):
        graphed(*data(i))
    net = graphed.module
    net.eval()
    with torch.no_grad():
        out = net(data(0)[0])
        expected = ampgraph.compile(copy.deepcopy(model), "O2", "bf16", runtime="cuda").eval()(
            data(0)[0])
    assert torch.equal(out, expected)


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA GPU")
@pytest.mark.parametrize("accumulation_steps", [1, 2])
def test_cuda_graphs_train_as_the_eager_step_through_an_overflow(accumulation_steps):
    (model, graphed), (ref, eager) = two_steps("fp16", "cuda",
                                               accumulation_steps=accumulation_steps)
    for i in range(20):
        x, y = (t.cuda() for t in data(i))
        if i == 9:
            x[0, 0] = float("inf")
        a, b = graphed(x, y), eager(x, y)
        assert a.overflow == b.overflow, i
        torch.testing.assert_close(a.loss, b.loss, rtol=1e-5, atol=0)
    assert graphed.graphs.captures == len(set(graphed._phases)) and graphed.graphs.replays > 10
    for p, q in zip(model.parameters(), ref.parameters()):
        torch.testing.assert_close(p, q, rtol=1e-4, atol=1e-6)
