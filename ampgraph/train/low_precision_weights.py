"""16-bit weights without fp32 master copies: Kahan-compensated or stochastically rounded updates.

``build_train_step(..., master_weights=...)``:

- ``"fp32"``: parameters stay fp32 (master weights), ``optimizer.step()`` as usual.
- ``"kahan"``: parameters are stored in the low dtype; each carries a 16-bit compensation
  buffer holding what rounding lost, added back on the next update (``optimi``'s Kahan
  summation): ``c += u; p' = round(p + c); c -= p' - p``.
- ``"stochastic"``: parameters are stored in bf16; the fp32 sum ``p + u`` is rounded up or
  down at random with probability proportional to the distance (torchao's
  ``_fp32_to_bf16_sr``), so updates below half an ulp survive in expectation.
- ``"none"``: 16-bit parameters with plain round-to-nearest updates (the baseline whose
  small updates are swamped).

Norm parameters (those owned by BatchNorm/LayerNorm/GroupNorm/InstanceNorm/RMSNorm modules)
stay fp32 and are updated in fp32. The update ``u`` is computed in fp32 from the optimizer's
own hyper-parameters (``param_groups``) with optimizer state kept in the parameter's dtype
in ``optimizer.state[p]`` (so the optimizer's ``state_dict`` checkpoints it): SGD (momentum,
dampening, nesterov, weight decay), Adam, AdamW, and :class:`ModifiedMomentumSGD`.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from ampgraph.train.network import amp_of

__all__ = ["MASTER_WEIGHTS", "LowPrecisionUpdate", "ModifiedMomentumSGD", "NORM_TYPES",
           "check_supported", "convert_weights", "state_bytes", "stochastic_round_bf16",
           "weight_update"]

MASTER_WEIGHTS = ("fp32", "kahan", "stochastic", "none")
NORM_TYPES: tuple[type, ...] = (nn.modules.batchnorm._NormBase, nn.LayerNorm, nn.GroupNorm,
                                nn.RMSNorm)


class ModifiedMomentumSGD(torch.optim.Optimizer):
    """Momentum SGD whose buffer accumulates raw gradients (``b = mu * b + g``) and whose
    update multiplies by the learning rate (``p -= lr * b``), computed in the parameters'
    own dtype with round-to-nearest: the 16-bit-weights baseline of ``benchmarks/numerics.py``.

    Example:
        >>> p = nn.Parameter(torch.ones(2)); p.grad = torch.ones(2)
        >>> opt = ModifiedMomentumSGD([p], lr=0.5, momentum=0.9); opt.step(); p.tolist()
        [0.5, 0.5]
    """

    def __init__(self, params: Any, lr: float = 0.01, momentum: float = 0.9,
                 weight_decay: float = 0.0) -> None:
        if not lr > 0 or not 0 <= momentum < 1:
            raise ValueError(f"ModifiedMomentumSGD: need lr > 0 and 0 <= momentum < 1, got "
                             f"lr={lr!r}, momentum={momentum!r}")
        super().__init__(params, {"lr": lr, "momentum": momentum, "weight_decay": weight_decay})

    @torch.no_grad()
    def step(self, closure: Any = None) -> Any:
        loss = closure() if closure is not None else None
        for group in self.param_groups:
            for p in group["params"]:
                if p.grad is not None:
                    wd = group["weight_decay"]
                    g = p.grad.add(p, alpha=wd) if wd else p.grad
                    buf = self.state[p].setdefault("momentum_buffer", torch.zeros_like(p))
                    buf.mul_(group["momentum"]).add_(g)
                    p.add_(buf, alpha=-group["lr"])
        return loss


def _is_norm_param(name: str, owners: dict[str, nn.Module]) -> bool:
    return isinstance(owners.get(name.rpartition(".")[0]), NORM_TYPES)


def convert_weights(model: nn.Module, dtype: torch.dtype) -> list[str]:
    """Store ``model``'s floating parameters in ``dtype`` in place (norm parameters stay fp32).

    Returns the names converted. Parameter objects keep their identity, so an optimizer built
    on ``model.parameters()`` still holds them.

    Example:
        >>> m = nn.Sequential(nn.Linear(2, 2), nn.LayerNorm(2))
        >>> convert_weights(m, torch.bfloat16)
        ['0.weight', '0.bias']
    """
    owners = dict(model.named_modules())
    done = []
    for name, p in model.named_parameters():
        if p.is_floating_point() and p.dtype != dtype and not _is_norm_param(name, owners):
            p.data = p.data.to(dtype)
            done.append(name)
    return done


def stochastic_round_bf16(x: torch.Tensor, generator: torch.Generator | None = None
                          ) -> torch.Tensor:
    """Round fp32 ``x`` to bf16 up or down at random, unbiased (torchao's recipe).

    Example:
        >>> x = torch.full((10000,), 1.0 + 2.0**-10)     # 1/8 of a bf16 ulp above 1.0
        >>> 0.08 < (stochastic_round_bf16(x) > 1).float().mean().item() < 0.17
        True
    """
    bits = x.float().contiguous().view(torch.int32)
    noise = torch.randint(0, 1 << 16, x.shape, dtype=torch.int32, device=x.device,
                          generator=generator)
    down = bits & -65536  # 0xFFFF0000: truncated towards zero
    up = torch.where(noise < (bits & 0xFFFF), down + 0x10000, down)
    return up.view(torch.float32).to(torch.bfloat16)


class LowPrecisionUpdate:
    """``update(optimizer)``: the optimizer's rule applied to 16-bit parameters.

    Args:
        mode: "kahan", "stochastic" or "none" (round to nearest).
        seed: seed of the stochastic-rounding generator.
        track_swamping: count, per step, the elements whose fp32 update was non-zero but
            whose stored value did not change (``swamped`` / ``updated`` attributes).

    Example:
        >>> p = nn.Parameter(torch.ones(1, dtype=torch.bfloat16)); p.grad = torch.ones_like(p)
        >>> opt = torch.optim.SGD([p], lr=2.0**-10)
        >>> upd = LowPrecisionUpdate("kahan")
        >>> for _ in range(8):
        ...     upd(opt)
        >>> p.item()                      # plain bf16 would stay at 1.0
        0.9921875
    """

    def __init__(self, mode: str, *, seed: int = 0, track_swamping: bool = False) -> None:
        if mode not in MASTER_WEIGHTS[1:]:
            raise ValueError(f"LowPrecisionUpdate: mode must be one of {MASTER_WEIGHTS[1:]}, "
                             f"got {mode!r}")
        self.mode = mode
        self.generator: torch.Generator | None = None
        self.seed = seed
        self.track_swamping = track_swamping
        self.swamped = 0
        self.updated = 0

    @torch.no_grad()
    def __call__(self, optimizer: torch.optim.Optimizer) -> None:
        if isinstance(optimizer, ModifiedMomentumSGD) and self.mode == "none":
            optimizer.step()  # already its own 16-bit rule
            return
        for group in optimizer.param_groups:
            for p in group["params"]:
                if p.grad is None:
                    continue
                state = optimizer.state[p]
                if not _chunked(optimizer, p):
                    self._update(p, _delta(optimizer, group, p, p.grad, state), state)
                    continue
                # a large parameter by flat chunks: fp32 temporaries of UPDATE_CHUNK elements
                _adam_state(state, p, self.mode == "kahan")
                flat, grad, n = p.view(-1), p.grad.reshape(-1), p.numel()
                for s in range(0, n, UPDATE_CHUNK):
                    views = {k: v.view(-1)[s:s + UPDATE_CHUNK] if isinstance(v, torch.Tensor)
                             and v.numel() == n else v for k, v in state.items()}
                    part = flat[s:s + UPDATE_CHUNK]
                    self._update(part, _adam_delta(group, optimizer, part,
                                                   grad[s:s + UPDATE_CHUNK], views), views)

    def _update(self, p: torch.Tensor, delta: torch.Tensor, state: dict) -> None:
        if p.dtype == torch.float32:
            p.add_(delta)
        else:
            self._apply(p, delta, state)

    def _apply(self, p: torch.Tensor, delta: torch.Tensor, state: dict) -> None:
        old = p.float()
        if self.mode == "kahan":
            comp = state.get("kahan_comp")
            if comp is None:
                comp = state["kahan_comp"] = torch.zeros_like(p)
            total = comp.float() + delta
            new = (old + total).to(p.dtype)
            comp.copy_(total - (new.float() - old))
        elif self.mode == "stochastic":
            if self.generator is None or self.generator.device != p.device:
                self.generator = torch.Generator(p.device).manual_seed(self.seed)
            new = stochastic_round_bf16(old + delta, self.generator)
        else:
            new = (old + delta).to(p.dtype)
        if self.track_swamping:
            moved = delta != 0
            self.updated += int(moved.sum())
            self.swamped += int((moved & (new == p)).sum())
        p.copy_(new)


def check_supported(optimizer: torch.optim.Optimizer) -> None:
    """Raise ValueError unless 16-bit weights have an update rule for ``optimizer``.

    Example:
        >>> check_supported(torch.optim.SGD([nn.Parameter(torch.ones(1))], lr=0.1))
    """
    if not isinstance(optimizer, (torch.optim.SGD, torch.optim.Adam, torch.optim.AdamW,
                                  ModifiedMomentumSGD)):
        raise ValueError(
            f"master_weights other than 'fp32' support torch.optim.SGD, Adam, AdamW and "
            f"ModifiedMomentumSGD; got {type(optimizer).__name__}: use master_weights='fp32'")


def _state(state: dict, key: str, like: torch.Tensor) -> torch.Tensor:
    if key not in state:
        state[key] = torch.zeros_like(like)
    return state[key]


# Adam's and AdamW's update of a contiguous parameter larger than this many elements runs
# over flat chunks this size (``_chunked``): its fp32 temporaries (the gradient, the moments,
# the update, the rounding's) are a chunk's, not a 128256 x 512 head's 250 MiB each.
UPDATE_CHUNK = 1 << 20


def _chunked(optimizer: torch.optim.Optimizer, p: torch.Tensor) -> bool:
    return (p.numel() > UPDATE_CHUNK and p.is_contiguous()
            and isinstance(optimizer, (torch.optim.Adam, torch.optim.AdamW)))


def _adam_state(state: dict, p: torch.Tensor, kahan: bool) -> None:
    """Adam's state for ``p`` made whole before its chunks take views of it, and its step
    counted once."""
    for key in ("exp_avg", "exp_avg_sq", *(["kahan_comp"] if kahan and p.dtype != torch.float32
                                          else [])):
        _state(state, key, p)
    _count_step(state)


def _count_step(state: dict) -> None:
    """Adam's step counter, counted once per update of a parameter."""
    if "step" not in state:
        state["step"] = torch.zeros((), dtype=torch.float32)
    state["step"] += 1


def _delta(optimizer: torch.optim.Optimizer, group: dict, p: torch.Tensor, grad: torch.Tensor,
           state: dict) -> torch.Tensor:
    """The fp32 update ``p_new - p`` of ``optimizer``'s rule; state kept in p's dtype."""
    if isinstance(optimizer, (torch.optim.AdamW, torch.optim.Adam)):
        _count_step(state)
        return _adam_delta(group, optimizer, p, grad, state)
    g = grad.float()
    lr, wd = group["lr"], group.get("weight_decay", 0.0)
    if group.get("maximize", False):
        g = -g
    if isinstance(optimizer, ModifiedMomentumSGD):
        if wd:
            g = g + wd * p.float()
        buf = _state(state, "momentum_buffer", p)
        total = buf.float() * group["momentum"] + g
        buf.copy_(total)
        return -lr * total
    if isinstance(optimizer, torch.optim.SGD):
        if wd:
            g = g + wd * p.float()
        mu = group["momentum"]
        if mu:
            if "momentum_buffer" not in state:
                buf = state["momentum_buffer"] = p.grad.new_zeros(p.shape).to(p.dtype)
                total = g
            else:
                buf = state["momentum_buffer"]
                total = buf.float() * mu + (1 - group["dampening"]) * g
            buf.copy_(total)
            g = g + mu * total if group["nesterov"] else total
        return -lr * g
    raise ValueError(
        f"master_weights other than 'fp32' support torch.optim.SGD, Adam, AdamW and "
        f"ModifiedMomentumSGD; got {type(optimizer).__name__}: use master_weights='fp32'")


def _adam_delta(group: dict, optimizer: torch.optim.Optimizer, p: torch.Tensor,
                grad: torch.Tensor, state: dict) -> torch.Tensor:
    """Adam's or AdamW's fp32 update of ``p`` (or of a chunk of it, with views of its
    state) at the step ``state["step"]`` already counts."""
    g = grad.float()
    lr, wd = group["lr"], group.get("weight_decay", 0.0)
    if group.get("maximize", False):
        g = -g
    decoupled = isinstance(optimizer, torch.optim.AdamW) or group.get("decoupled_weight_decay")
    beta1, beta2 = group["betas"]
    t = float(state["step"])
    if wd and not decoupled:
        g = g + wd * p.float()
    m, v = _state(state, "exp_avg", p), _state(state, "exp_avg_sq", p)
    m32 = m.float().mul_(beta1).add_(g, alpha=1 - beta1)
    v32 = v.float().mul_(beta2).addcmul_(g, g, value=1 - beta2)
    m.copy_(m32)
    v.copy_(v32)
    denom = (v32 / (1 - beta2**t)).sqrt_().add_(group["eps"])
    delta = -(lr / (1 - beta1**t)) * m32 / denom
    if wd and decoupled:
        delta = delta - lr * wd * p.float()
    return delta


def state_bytes(model: nn.Module, optimizer: torch.optim.Optimizer,
                extra: list[torch.Tensor] | None = None) -> dict[str, int]:
    """Bytes of parameters, gradients and optimizer state, counted from the tensors.

    Example:
        >>> m = nn.Linear(2, 2); opt = torch.optim.SGD(m.parameters(), lr=0.1)
        >>> state_bytes(m, opt)["params"]
        24
    """
    def size(t: Any) -> int:
        return t.numel() * t.element_size() if isinstance(t, torch.Tensor) else 0

    params = list(model.parameters())
    out = {
        "params": sum(size(p) for p in params),
        "grads": sum(size(p.grad) for p in params),
        "optimizer": sum(size(v) for s in optimizer.state.values() for v in s.values()
                         if isinstance(v, torch.Tensor) and v.dim() > 0),
        "working_copies": sum(size(t) for t in extra or []),
    }
    out["total"] = sum(out.values())
    out["per_param"] = out["total"] / max(1, sum(p.numel() for p in params))
    return out


def weight_update(mode: Any, module: nn.Module, optimizer: torch.optim.Optimizer
                  ) -> LowPrecisionUpdate | None:
    """``build_train_step``'s ``master_weights=mode``: convert the compiled module's
    parameters to 16 bits in place and return their update rule (None for "fp32").

    Raises:
        ValueError: an unknown mode, a level or dtype without 16-bit weights, an optimizer
            the rules do not cover.
    """
    if mode not in MASTER_WEIGHTS:
        raise ValueError(f"master_weights must be one of {MASTER_WEIGHTS}, got {mode!r}")
    if mode == "fp32":
        return None
    amp = amp_of(module)
    low, level = amp.amp_dtype, amp.amp_config.amp_level
    if level == "O0" or low not in (torch.bfloat16, torch.float16):
        raise ValueError(f"master_weights={mode!r} stores weights in the low dtype: compile "
                         f"at O1-O3 with dtype bf16 or fp16, not {level}")
    if mode == "stochastic" and low != torch.bfloat16:
        raise ValueError("master_weights='stochastic' rounds into bf16: use dtype='bf16' "
                         "(or master_weights='kahan' for fp16)")
    check_supported(optimizer)
    convert_weights(module.original_module, low)
    module.drop_graphs()  # graphs captured with fp32 parameters are stale
    update = LowPrecisionUpdate(mode)
    return update
