"""Soak run of the reliability fuzzers: thousands of random programs, FX and ONNX.

The README suite runs a few dozen derandomized hypothesis examples per property
(tests/reliability); this runs the same checks on many more programs drawn by a seeded
``random.Random(case)``, so any case is reproducible alone::

    python benchmarks/soak.py                      # 10,000 FX + 10,000 ONNX cases
    python benchmarks/soak.py --fx 2000 --onnx 10000 --workers 2 --json soak.json
    python benchmarks/soak.py --fx 1 --start 4250 --show     # one case, with its program

Case ``k`` is level ``O0..O3`` = ``k % 4`` and dtype bf16/fp16 = ``(k // 4) % 2``. Every
``--train-every``-th FX case also runs the training check. The summary counts passes,
known bugs (by name; see tests/reliability), failures (with their case numbers) and the
largest relative error against FP32 per level and dtype. docs/reliability.md records runs.
"""

from __future__ import annotations

import argparse
import json
import multiprocessing as mp
import os
import random
import sys
import time
import warnings
from collections import Counter, defaultdict
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

LEVELS = ("O0", "O1", "O2", "O3")


def fx_case(k: int, max_ops: int, train: bool) -> dict[str, Any]:
    import torch

    from tests.reliability.fx_checks import KnownBug, check_fx_program, check_fx_training
    from tests.reliability.strategies import DTYPES, random_fx_program

    program = random_fx_program(random.Random(k), max_ops)
    level, dtype = LEVELS[k % 4], DTYPES[(k // 4) % 2]
    row: dict[str, Any] = {"case": k, "level": level, "dtype": str(dtype)[6:]}
    try:
        out = check_fx_program(program, level, dtype)
        row.update(status="pass", rel=out.rel_err, checked=out.numerics_checked)
        if train:
            row["trained"] = True
            row["grad_rel"] = check_fx_training(program, level, dtype)
    except KnownBug as exc:
        row.update(status="known", bug=str(exc))
    except Exception as exc:
        row.update(status="fail", error=f"{type(exc).__name__}: {str(exc)[:300]}")
    del torch
    return row


def onnx_case(k: int, max_ops: int) -> dict[str, Any]:
    from tests.reliability.fx_checks import KnownBug
    from tests.reliability.onnx_checks import check_onnx_program
    from tests.reliability.onnx_programs import random_onnx_program

    program = random_onnx_program(random.Random(k), max_ops)
    level, dtype = LEVELS[k % 4], ("fp16", "bf16")[(k // 4) % 2]
    row: dict[str, Any] = {"case": k, "level": level, "dtype": dtype}
    try:
        out = check_onnx_program(program, level, dtype)
        row.update(status="pass", rel=out.rel_err, checked=out.numerics_checked)
    except KnownBug as exc:
        row.update(status="known", bug=str(exc))
    except Exception as exc:
        row.update(status="fail", error=f"{type(exc).__name__}: {str(exc)[:300]}")
    return row


def _init_worker() -> None:
    import torch

    torch.set_num_threads(1)
    warnings.simplefilter("ignore")


def _run(task: tuple[str, int, int, bool]) -> dict[str, Any]:
    kind, k, max_ops, train = task
    return fx_case(k, max_ops, train) if kind == "fx" else onnx_case(k, max_ops)


def summarise(kind: str, rows: list[dict[str, Any]], seconds: float) -> dict[str, Any]:
    status = Counter(r["status"] for r in rows)
    worst: dict[str, float] = defaultdict(float)
    worst_grad: dict[str, float] = defaultdict(float)
    for r in rows:
        key = f"{r['level']}-{r['dtype']}"
        if r["status"] == "pass" and r.get("checked"):
            worst[key] = max(worst[key], r["rel"])
        if r.get("grad_rel") is not None:
            worst_grad[key] = max(worst_grad[key], r["grad_rel"])
    return {
        "kind": kind, "cases": len(rows), "seconds": round(seconds, 1),
        "passed": status["pass"], "known_bugs": dict(Counter(r["bug"] for r in rows
                                                             if r["status"] == "known")),
        "failed": status["fail"],
        "numerics_checked": sum(1 for r in rows if r.get("checked")),
        "trained": sum(1 for r in rows if r.get("trained")),
        "gradients_checked": sum(1 for r in rows if r.get("grad_rel") is not None),
        "max_rel_err": {k: round(v, 5) for k, v in sorted(worst.items())},
        "max_grad_rel_err": {k: round(v, 5) for k, v in sorted(worst_grad.items())},
        "failures": [f"case {r['case']} {r['level']} {r['dtype']}: {r['error']}"
                     for r in rows if r["status"] == "fail"],
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--fx", type=int, default=10_000, help="FX cases (default 10,000)")
    parser.add_argument("--onnx", type=int, default=10_000, help="ONNX cases (default 10,000)")
    parser.add_argument("--start", type=int, default=0, help="first case number")
    parser.add_argument("--max-ops", type=int, default=10, help="ops per program (default 10)")
    parser.add_argument("--train-every", type=int, default=4,
                        help="run the FX training check on one block of 8 cases in N "
                             "(0: never)")
    parser.add_argument("--workers", type=int, default=max(1, (os.cpu_count() or 1)),
                        help="worker processes (default: CPU count)")
    parser.add_argument("--json", type=Path, help="also write the summary as JSON here")
    parser.add_argument("--show", action="store_true", help="print each case's program")
    args = parser.parse_args(argv)

    from tests.reliability.onnx_programs import random_onnx_program
    from tests.reliability.strategies import random_fx_program

    summaries = []
    for kind, n in (("fx", args.fx), ("onnx", args.onnx)):
        if n <= 0:
            continue
        # blocks of 8 consecutive cases (every level x dtype) every --train-every blocks
        tasks = [(kind, k, args.max_ops, kind == "fx" and args.train_every > 0
                  and k % (8 * args.train_every) < 8)
                 for k in range(args.start, args.start + n)]
        if args.show:
            make = random_fx_program if kind == "fx" else random_onnx_program
            for _, k, max_ops, _ in tasks:
                print(f"--- {kind} case {k}\n{make(random.Random(k), max_ops).describe()}")
        start = time.perf_counter()
        rows: list[dict[str, Any]] = []
        with mp.get_context("fork").Pool(args.workers, _init_worker) as pool:
            for i, row in enumerate(pool.imap_unordered(_run, tasks, chunksize=4), 1):
                rows.append(row)
                if row["status"] == "fail":
                    print(f"FAIL {kind} case {row['case']} {row['level']} {row['dtype']}: "
                          f"{row['error']}", flush=True)
                if i % 500 == 0:
                    print(f"{kind}: {i}/{n} in {time.perf_counter() - start:.0f}s", flush=True)
        summaries.append(summarise(kind, rows, time.perf_counter() - start))
    for s in summaries:
        print(json.dumps({k: v for k, v in s.items() if k != "failures"}, indent=1))
        for line in s["failures"]:
            print("  ", line)
    if args.json is not None:
        args.json.write_text(json.dumps(summaries, indent=1))
    return 1 if any(s["failed"] for s in summaries) else 0


if __name__ == "__main__":
    raise SystemExit(main())
