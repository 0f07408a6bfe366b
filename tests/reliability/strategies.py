"""Random programs for the fuzz suites: a list of ops over earlier values, built into a model.

A program is data (:class:`Program`): each op names a kind, the indices of the earlier
values it reads and an integer parameter (which shared layer, which constant ...). The
same program is drawn either by hypothesis (:func:`fx_programs`, the README suite) or by a
seeded ``random.Random`` (:func:`random_fx_program`, the soak run in benchmarks/soak.py):
both go through :func:`build_program` with a different ``draw(lo, hi)``.

Every float value has shape (B, T, D) with T == D == 8, so transposes, attention and
``a @ b.T`` keep the shape and any op can read any earlier value. Values 0 and 1 are the
model's two inputs. Magnitudes stay bounded by construction (gates go through tanh,
activation products through softmax or 1/sqrt(D), scale constants are at most 1.5; the
deliberate range hazards ``x * 1e5`` scale back down inside their op), so an fp16 overflow
in a result is a finding, not a property of the program.

Discrete ops (argmax, comparisons) read an input with probability 2/3; when one reads a
computed value, rounding may flip its decision and the low-precision result may legitimately
differ: such programs are marked ``discrete_on_computed`` and checked for structure and
finiteness only (see docs/reliability.md).
"""

from __future__ import annotations

import math
import random
from collections.abc import Callable
from dataclasses import dataclass, field

import torch
import torch.nn.functional as F
from hypothesis import strategies as st
from torch import nn

B, T, D = 2, 8, 8
N_INPUTS = 2
N_SHARED_LINEAR = 3
N_SHARED_CONV = 2
LEVELS = ("O0", "O1", "O2", "O3")
DTYPES = (torch.bfloat16, torch.float16)

# kind -> number of float values read. The first value read by a DISCRETE kind feeds an
# integer op (argmax) or a comparison mask.
ARITY: dict[str, int] = {
    "linear": 1, "conv1d": 1, "conv2d": 1, "layer_norm": 1, "batch_norm": 1, "group_norm": 1,
    "rms_norm": 1, "softmax": 1, "log_softmax": 1, "act": 1, "scale": 1, "center": 1,
    "sum_bcast": 1, "reshape": 1, "transpose": 1, "exp_tanh": 1, "big_scale": 1,
    "scale_linear": 1, "amax": 2,
    "half_round": 1, "add": 2, "sub": 2, "gate": 2, "matmul": 2, "cat_split": 2,
    "cat_linear": 2, "sdpa": 3, "attention": 3, "argmax_gather": 2, "argmax_embed": 2,
    "where": 3, "masked_softmax": 2, "masked_zero": 2, "count_scale": 2,
}
KINDS = tuple(ARITY)
DISCRETE = frozenset({"argmax_gather", "argmax_embed", "where", "masked_softmax",
                      "masked_zero", "count_scale"})
ACTS = (F.gelu, F.relu, torch.tanh, torch.sigmoid, F.silu)
SCALES = (0.5, -1.0, 0.25, 1.5)
RMS_EPS = (1e-6, 1e-8)  # 1e-8 is below fp16's smallest subnormal: a range hazard
MASK_FILLS = (-1e9, torch.finfo(torch.float32).min, -1e4)
MASK_THRESHOLDS = (0.5, -1.0)  # -1.0 masks ~84%: fully masked rows are common


@dataclass(frozen=True)
class Op:
    kind: str
    srcs: tuple[int, ...]
    param: int


@dataclass(frozen=True)
class Program:
    """Ops over values 0..N_INPUTS-1 (inputs) and earlier ops; ``outputs`` index values."""

    ops: tuple[Op, ...]
    outputs: tuple[int, ...]
    seed: int = 0
    meta: dict = field(default_factory=dict, compare=False, hash=False)

    @property
    def discrete_on_computed(self) -> bool:
        return any(op.kind in DISCRETE and op.srcs[0] >= N_INPUTS for op in self.ops)

    def describe(self) -> str:
        lines = [f"seed={self.seed}"]
        for i, op in enumerate(self.ops):
            lines.append(f"v{i + N_INPUTS} = {op.kind}[{op.param}]"
                         f"({', '.join(f'v{s}' for s in op.srcs)})")
        lines.append(f"return {', '.join(f'v{o}' for o in self.outputs)}")
        return "\n".join(lines)


Draw = Callable[[int, int], int]  # draw(lo, hi) -> an int in [lo, hi]


def build_program(draw: Draw, max_ops: int = 10, kinds: tuple[str, ...] = KINDS,
                  rotate: int = 0, arity: dict[str, int] = ARITY) -> Program:
    """A random program from ``draw``; the same code serves hypothesis and ``random``.

    ``rotate`` shifts the op kinds and the weight seed: derandomized hypothesis replays one
    choice sequence per test function, so parametrized copies of a test pass different
    ``rotate`` values to see different programs.
    """
    n_ops = draw(1, max_ops)
    ops = []
    for i in range(n_ops):
        n_values = N_INPUTS + i
        kind = kinds[(draw(0, len(kinds) - 1) + rotate) % len(kinds)]
        srcs = []
        for j in range(arity[kind]):
            if j == 0 and kind in DISCRETE and draw(0, 2) < 2:
                srcs.append(draw(0, N_INPUTS - 1))  # discrete decisions on an input: exact
            elif j == 0 and i > 0 and draw(0, 3) > 0:
                srcs.append(n_values - 1)  # mostly chain on the last value: deeper graphs
            else:
                srcs.append(draw(0, n_values - 1))
        ops.append(Op(kind, tuple(srcs), draw(0, 5)))
    last = N_INPUTS + n_ops - 1
    outputs = (last,) if draw(0, 2) else (last, draw(N_INPUTS - 1, last))
    return Program(tuple(ops), outputs, seed=draw(0, 2**16) + 7919 * rotate)


@st.composite
def fx_programs(draw: st.DrawFn, max_ops: int = 10, rotate: int = 0) -> Program:
    """Hypothesis strategy: a random :class:`Program`."""
    return build_program(lambda lo, hi: draw(st.integers(lo, hi)), max_ops, rotate=rotate)


def random_fx_program(rng: random.Random, max_ops: int = 10) -> Program:
    """The soak run's generator: a :class:`Program` from a seeded ``random.Random``."""
    return build_program(rng.randint, max_ops)


class FuzzNet(nn.Module):
    """The model a :class:`Program` describes, with deterministic weights (its seed).

    Shared layers: ``linears[k]`` and ``convs[k]`` are reused by every op whose parameter
    selects them, so weight sharing (one parameter, several uses) is common.
    """

    def __init__(self, program: Program):
        super().__init__()
        self.program = program
        torch.manual_seed(program.seed)
        self.linears = nn.ModuleList(nn.Linear(D, D) for _ in range(N_SHARED_LINEAR))
        self.convs = nn.ModuleList(nn.Conv1d(D, D, 3, padding=1) for _ in range(N_SHARED_CONV))
        self.per_op = nn.ModuleDict()
        for i, op in enumerate(program.ops):
            layer = _layer(op.kind)
            if layer is not None:
                self.per_op[f"op{i}"] = layer
        with torch.no_grad():
            for m in self.modules():
                if isinstance(m, (nn.LayerNorm, nn.GroupNorm, nn.BatchNorm1d)):
                    m.weight.copy_(1 + 0.2 * torch.randn_like(m.weight))
                    m.bias.copy_(0.2 * torch.randn_like(m.bias))
                if isinstance(m, nn.BatchNorm1d):
                    m.running_mean.copy_(0.2 * torch.randn_like(m.running_mean))
                    m.running_var.copy_(0.5 + torch.rand_like(m.running_var))
        self.magnitudes: list[float] | None = None

    def forward(self, x: torch.Tensor, y: torch.Tensor) -> tuple[torch.Tensor, ...]:
        values = [x, y]
        for i, op in enumerate(self.program.ops):
            v = getattr(self, f"_{op.kind}")(i, op.param, *(values[s] for s in op.srcs))
            if self.magnitudes is not None:
                self.magnitudes.append(float(v.detach().abs().max()))
            values.append(v)
        return tuple(values[o] for o in self.program.outputs)

    def max_magnitude(self, x: torch.Tensor, y: torch.Tensor) -> float:
        """Largest |value| any op produces on these inputs, in fp32 (eager)."""
        self.magnitudes = []
        try:
            with torch.no_grad():
                self(x, y)
            return max(self.magnitudes, default=0.0)
        finally:
            self.magnitudes = None

    # -- ops: (op index, parameter, *values) -> value of shape (B, T, D) ----------------

    def _linear(self, i, p, a):
        return self.linears[p % N_SHARED_LINEAR](a)

    def _conv1d(self, i, p, a):
        return self.convs[p % N_SHARED_CONV](a.transpose(1, 2)).transpose(1, 2)

    def _conv2d(self, i, p, a):
        h = a.reshape(-1, T, 2, D // 2).permute(0, 2, 1, 3)
        return self.per_op[f"op{i}"](h).permute(0, 2, 1, 3).reshape(-1, T, D)

    def _layer_norm(self, i, p, a):
        return self.per_op[f"op{i}"](a)

    def _batch_norm(self, i, p, a):
        return self.per_op[f"op{i}"](a.transpose(1, 2)).transpose(1, 2)

    _group_norm = _batch_norm

    def _rms_norm(self, i, p, a):
        return a * torch.rsqrt(a.pow(2).mean(-1, keepdim=True) + RMS_EPS[p % 2])

    def _softmax(self, i, p, a):
        return torch.softmax(a, -1 - p % 2)

    def _log_softmax(self, i, p, a):
        return torch.log_softmax(a, -1) * 0.25

    def _act(self, i, p, a):
        return ACTS[p % len(ACTS)](a)

    def _scale(self, i, p, a):
        return a * SCALES[p % len(SCALES)]

    def _center(self, i, p, a):
        return a - a.mean(-1, keepdim=True)

    def _sum_bcast(self, i, p, a):
        return a + 0.1 * a.sum(1, keepdim=True)

    def _reshape(self, i, p, a):
        if p % 2:
            return torch.relu(a.permute(0, 2, 1)).permute(0, 2, 1).contiguous()
        return torch.relu(a.flatten(1)).view(-1, T, D)

    def _transpose(self, i, p, a):
        return a.transpose(1, 2)

    def _exp_tanh(self, i, p, a):
        return torch.exp(torch.tanh(a))

    def _big_scale(self, i, p, a):
        return torch.relu(a * 1e5) / 1e5  # 1e5 overflows fp16: a range hazard

    def _scale_linear(self, i, p, a):  # a large scale factor through a matmul and back
        return self.linears[p % N_SHARED_LINEAR](a * 1e5) * 1e-5

    def _amax(self, i, p, a, b):
        return b - a.amax(-1, keepdim=True)

    def _half_round(self, i, p, a):  # a user-written cast in the model: kept as it is
        return a.to(DTYPES[p % 2]).float()

    def _add(self, i, p, a, b):
        return a + b

    def _sub(self, i, p, a, b):
        return a - b

    def _gate(self, i, p, a, b):
        return a * torch.tanh(b)

    def _matmul(self, i, p, a, b):
        return (a @ b.transpose(1, 2)) / math.sqrt(D)

    def _cat_split(self, i, p, a, b):
        dim = 1 + p % 2
        u, v = torch.cat([a, b], dim).split(T, dim)
        return v - 0.5 * u

    def _cat_linear(self, i, p, a, b):
        return self.per_op[f"op{i}"](torch.cat([a, b], -1))

    def _sdpa(self, i, p, a, b, c):
        return F.scaled_dot_product_attention(a, b, c, is_causal=bool(p % 2))

    def _attention(self, i, p, a, b, c):
        return torch.softmax(a @ b.transpose(1, 2) / math.sqrt(D), -1) @ c

    def _argmax_gather(self, i, p, a, b):
        idx = a.argmax(-1, keepdim=True)
        return b - torch.gather(b, -1, idx)

    def _argmax_embed(self, i, p, a, b):
        idx = (a.argmax(-1) * 3 + p) % D  # integer arithmetic on the indices
        return self.per_op[f"op{i}"](idx) + b

    def _where(self, i, p, a, b, c):
        return torch.where(a > 0, b, c)

    def _masked_softmax(self, i, p, a, b):
        mask = a > MASK_THRESHOLDS[p % 2]
        return torch.softmax(b.masked_fill(mask, MASK_FILLS[p % 3]), -1)

    def _masked_zero(self, i, p, a, b):
        return b.masked_fill(a < 0, 0.0)

    def _count_scale(self, i, p, a, b):
        count = (a > 0).sum(-1, keepdim=True)  # int64
        return b * count.float() / D


def _layer(kind: str) -> nn.Module | None:
    return {
        "conv2d": lambda: nn.Conv2d(2, 2, 3, padding=1),
        "layer_norm": lambda: nn.LayerNorm(D),
        "batch_norm": lambda: nn.BatchNorm1d(D),
        "group_norm": lambda: nn.GroupNorm(2, D),
        "cat_linear": lambda: nn.Linear(2 * D, D),
        "argmax_embed": lambda: nn.Embedding(D, D),
    }.get(kind, lambda: None)()


def example_inputs(program: Program, batch: int = B) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(program.seed + 1)
    return torch.randn(batch, T, D, generator=g), torch.randn(batch, T, D, generator=g)
