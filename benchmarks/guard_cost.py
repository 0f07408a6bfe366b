"""What the guards cost on every call (a benchmark, not a test).

Run on demand from the repository root:

    python benchmarks/guard_cost.py                       # tiny12 and bert-base, CPU
    python benchmarks/guard_cost.py --models tiny12 --steps 30
    python benchmarks/guard_cost.py --smoke               # tiny sizes: harness check

For each model (HF BERT from a config, random weights): ``ampgraph.compile(model, "O2",
"bf16")``, then

- the guard check (``StateGuards.check`` of the graph a call runs, ``capture/guards.py``)
  timed alone, many times (median and minimum of blocks);
- a training step (forward, a loss, backward, AdamW) and an inference call (no_grad), timed
  whole (median of ``--steps``);
- the check as a share of each; and, for reference, dynamo's own guard check on the same
  model (``torch.compile(model, backend="eager")``: its cache entry's C++ guard manager,
  ``check`` on the frame's locals), where this torch exposes it.

``tiny12``: 12 layers of width 32 (2 heads, 64 intermediate), batch 2 x 16 tokens: a
model whose step is all host time, where a guard's cost shows most. ``bert-base``: 12
layers of width 768, batch 2 x 128.
"""

from __future__ import annotations

import argparse
import inspect
import json
import os
import platform
import statistics
import sys
import time
import timeit
import warnings

import torch

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

import ampgraph  # noqa: E402

MODELS = {
    "tiny12": dict(hidden_size=32, num_hidden_layers=12, num_attention_heads=2,
                   intermediate_size=64, vocab_size=1000, batch=2, seq=16),
    "bert-base": dict(hidden_size=768, num_hidden_layers=12, num_attention_heads=12,
                      intermediate_size=3072, vocab_size=30522, batch=2, seq=128),
    "smoke": dict(hidden_size=16, num_hidden_layers=2, num_attention_heads=2,
                  intermediate_size=32, vocab_size=100, batch=2, seq=8),
}


def build(name: str) -> tuple[torch.nn.Module, torch.Tensor]:
    import transformers

    spec = dict(MODELS[name])
    batch, seq = spec.pop("batch"), spec.pop("seq")
    torch.manual_seed(0)
    config = transformers.BertConfig(hidden_dropout_prob=0.0,
                                     attention_probs_dropout_prob=0.0, **spec)
    model = transformers.BertModel(config)
    ids = torch.randint(0, spec["vocab_size"], (batch, seq),
                        generator=torch.Generator().manual_seed(1))
    return model, ids


def timed(fn, n: int) -> list[float]:
    out = []
    for _ in range(n):
        t = time.perf_counter()
        fn()
        out.append(time.perf_counter() - t)
    return out


def guard_check_seconds(check, blocks: int = 20, per_block: int = 200) -> tuple[float, float]:
    """(median, min) seconds of one check, over blocks of ``per_block`` calls."""
    times = [timeit.timeit(check, number=per_block) / per_block for _ in range(blocks)]
    return statistics.median(times), min(times)


def dynamo_guard_seconds(model: torch.nn.Module, ids: torch.Tensor) -> float | None:
    """Dynamo's guard check for the same model, from its cache entry (None where this
    torch does not expose it)."""
    try:
        import torch._dynamo
        from torch._dynamo.eval_frame import _debug_get_cache_entry_list

        torch._dynamo.reset()
        compiled = torch.compile(model, backend="eager")
        with torch.no_grad():
            compiled(input_ids=ids)
        forward = type(model).forward
        entries = _debug_get_cache_entry_list(forward.__code__)
        if not entries:
            return None
        manager = entries[0].guard_manager
        bound = inspect.signature(forward, follow_wrapped=False).bind(model, input_ids=ids)
        bound.apply_defaults()
        f_locals = dict(bound.arguments)  # the frame's locals when forward is entered,
        f_locals.update(zip(forward.__code__.co_freevars,  # its closure's cells among them
                            (c.cell_contents for c in forward.__closure__ or ())))
        with torch.no_grad():  # as it was compiled: grad mode is a guard too
            if not manager.check(f_locals):
                return None
            return guard_check_seconds(lambda: manager.check(f_locals))[1]
    except Exception:  # noqa: BLE001 - a reference only: absent on this torch
        return None


def measure(name: str, steps: int) -> dict:
    model, ids = build(name)
    net = ampgraph.compile(model, "O2", "bf16")
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4)

    def train_step() -> None:
        loss = net(input_ids=ids).last_hidden_state.float().square().mean()
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)

    for _ in range(3):
        train_step()
    state = net._amp_last.captured.state
    assert state.check(), "the guards fail on the state they were made from"
    train_check = guard_check_seconds(state.check)
    train = statistics.median(timed(train_step, steps))
    model.eval()
    with torch.no_grad():
        for _ in range(3):
            net(input_ids=ids)
        infer_state = net._amp_last.captured.state
        infer_check = guard_check_seconds(infer_state.check)
        infer = statistics.median(timed(lambda: net(input_ids=ids), steps))
    return {
        "model": name, "guards_compared": len(state),
        "check_us_median": round(train_check[0] * 1e6, 1),
        "check_us_min": round(train_check[1] * 1e6, 1),
        "train_step_ms": round(train * 1e3, 2),
        "check_share_of_train_step_pct": round(100 * train_check[1] / train, 3),
        "inference_ms": round(infer * 1e3, 2),
        "check_share_of_inference_pct": round(100 * infer_check[1] / infer, 3),
        "dynamo_guard_us": (None if (d := dynamo_guard_seconds(model, ids)) is None
                            else round(d * 1e6, 1)),
    }


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--models", default="tiny12,bert-base")
    p.add_argument("--steps", type=int, default=20)
    p.add_argument("--json", default=None, help="also write the rows here")
    p.add_argument("--smoke", action="store_true")
    args = p.parse_args(argv)
    names = ["smoke"] if args.smoke else args.models.split(",")
    warnings.simplefilter("ignore")
    rows = [measure(n, 3 if args.smoke else args.steps) for n in names]
    print(f"# torch {torch.__version__}, {platform.processor() or platform.machine()}, "
          f"{torch.get_num_threads()} threads")
    for row in rows:
        print(json.dumps(row))
    if args.json:
        with open(args.json, "w") as f:
            json.dump(rows, f, indent=1)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
