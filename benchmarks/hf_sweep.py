"""Every architecture of transformers' auto mappings through ampgraph, tiny and random, on demand.

    python benchmarks/hf_sweep.py --json sweep.jsonl --markdown sweep.md   # all (~40 min, 2 cores)
    python benchmarks/hf_sweep.py --only bert,gpt2,vit --json sweep.jsonl
    python benchmarks/hf_sweep.py --kinds image --limit 10 --jobs 2
    python benchmarks/hf_sweep.py --report sweep.jsonl --markdown sweep.md  # rows so far
    python benchmarks/hf_sweep.py --report sweep.jsonl rerun.jsonl          # a rerun's rows win

The architectures are the model types of transformers' auto mappings for causal LM, masked
LM, seq2seq LM, sequence classification and image classification
(``transformers.models.auto.modeling_auto.MODEL_FOR_*_MAPPING_NAMES``), each once, with the
class of the first of those mappings (in that order) that has it. Each is built by
benchmarks/hf_tiny.py from its default config shrunk (width 32, 2 layers, 2 heads,
vocabulary 128, 32 px images, two stages; sub-configs alike; every dropout 0) with random
weights; nothing is downloaded (``HF_HUB_OFFLINE=1``). Each runs in a process of its own
with a timeout, so one crash or hang costs one row.

Per architecture, as benchmarks/zoo.py measures (and with its functions):

- fp32 eager: the eval logits and the train-mode gradients of a cross-entropy loss on them
  (fixed random labels) are the references. An architecture whose tiny config or model cannot
  be built, or whose fp32 forward or backward fails, is listed apart with the reason and not
  counted;
- capture of ``ampgraph.compile(model, amp_level="O2", dtype="bf16")`` in eval and in train
  mode (``net.amp_parts()``);
- O2 eval cosine vs fp32, beside ``torch.autocast`` bf16's; train-mode gradients (finite?)
  and their cosine vs fp32, beside autocast's; torch's grad mode before and after each call;
- seconds of ``ampgraph.compile`` + the first O2 call (the capture).

Criteria (a row passes when all hold): captured whole in eval and train mode; O2 eval cos
>= 0.99 and >= autocast's - 0.005; O2 gradients finite with cos >= autocast's - 0.01; grad
mode unchanged by every call; compile + first call <= 30 s. Where the fp32 model on
bf16-rounded weights and inputs is already below 0.99 against fp32 (the bf16 floor), the
numerics are not judged: such a row that meets the other criteria is listed apart as
ill-conditioned. See docs/zoo.md.
"""

from __future__ import annotations

import argparse
import collections
import datetime
import json
import math
import os
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor, as_completed
from typing import Any

os.environ["HF_HUB_OFFLINE"] = "1"
os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")

import torch  # noqa: E402
from hf_tiny import build, default_fails  # noqa: E402
from torch import nn  # noqa: E402
from zoo import (  # noqa: E402 - zoo puts the repository root on sys.path
    autocast_cosines,
    bf16_floors,
    cosine,
    describe_capture,
    fmt,
    logits_of,
    one_line,
    prepare_weights,
    quiet,
    step,
    train_grads,
    train_reference,
)

import ampgraph  # noqa: E402

KINDS = {  # --kinds name -> mapping, in the order that picks an architecture's class
    "causal": "MODEL_FOR_CAUSAL_LM_MAPPING_NAMES",
    "masked": "MODEL_FOR_MASKED_LM_MAPPING_NAMES",
    "seq2seq": "MODEL_FOR_SEQ_TO_SEQ_CAUSAL_LM_MAPPING_NAMES",
    "seqcls": "MODEL_FOR_SEQUENCE_CLASSIFICATION_MAPPING_NAMES",
    "image": "MODEL_FOR_IMAGE_CLASSIFICATION_MAPPING_NAMES",
}
SLOW_S, TIMEOUT_S = 30.0, 120.0
FLOOR = 0.99  # below this bf16 floor cosine, the numerics are not judged (ill-conditioned)


def architectures(kinds: list[str]) -> list[tuple[str, str, str]]:
    """(model type, kind, model class name) of every architecture of ``kinds``' mappings; an
    architecture in several mappings takes the first in ``KINDS`` order."""
    from transformers.models.auto import modeling_auto

    seen: dict[str, tuple[str, str, str]] = {}
    for kind, mapping in KINDS.items():
        for arch, cls in getattr(modeling_auto, mapping).items():
            if arch not in seen:
                seen[arch] = (arch, kind, cls if isinstance(cls, str) else cls[0])
    return [row for row in seen.values() if row[1] in kinds]


# -- one architecture (in its own process) -----------------------------------------------


def hf_model(arch: str, kind: str, class_name: str) -> tuple[nn.Module, dict]:
    """The tiny random model of a transformers architecture and its inputs (hf_tiny)."""
    return build(arch, kind, class_name)


def hf_build_failed(arch: str, class_name: str, exc: Exception) -> str:
    """Why an architecture whose tiny model does not build is listed apart."""
    default = default_fails(arch, class_name)
    return (f"build failed: {one_line(exc)}" if default is None else
            f"the default config does not build either: {default}")


def measure(arch: str, kind: str, class_name: str, save: Callable[[dict], None],
            make: Callable[[str, str, str], tuple[nn.Module, dict]] = hf_model,
            build_failed: Callable[[str, str, Exception], str] = hf_build_failed) -> dict:
    """Every measurement of one architecture; ``save(row)`` after each stage, so a killed
    worker leaves what it had. ``make(arch, kind, class_name)`` builds the fp32 model and its
    keyword inputs; when it raises, ``build_failed(arch, class_name, exc)`` says why the row
    is listed apart (benchmarks/timm_sweep.py passes its own)."""
    row: dict[str, Any] = {"arch": arch, "kind": kind, "class": class_name, "status": "running",
                           "stage": "build", "errors": {}, "notes": [], "seconds": {}}

    def apart(reason: str) -> dict:
        row.update(status="apart", reason=reason)
        save(row)
        return row

    save(row)
    t0 = time.perf_counter()
    try:
        with quiet():
            model, inputs = make(arch, kind, class_name)
    except Exception as exc:  # noqa: BLE001 - a row, not a crash
        row["errors"]["build"] = one_line(exc)
        return apart(build_failed(arch, class_name, exc))
    row["class"] = type(model).__name__
    row["seconds"]["build"] = round(time.perf_counter() - t0, 2)
    row["params"] = sum(p.numel() for p in model.parameters())
    row["inputs"] = {k: list(v.shape) for k, v in inputs.items()}
    row["stage"] = "fp32"
    save(row)
    step(row, "prepare_weights", lambda: prepare_weights(model, inputs))

    def fp32_eval() -> torch.Tensor:
        model.eval()
        with torch.no_grad():
            return logits_of(model(**inputs)).float()

    ref = step(row, "fp32_eval", fp32_eval)
    if ref is None:
        return apart(f"fp32 forward failed: {row['errors'].pop('fp32_eval')}")
    if not torch.isfinite(ref).all():
        return apart("fp32 logits not finite")
    labels, ref_grads = train_reference(model, inputs, ref, row)
    if ref_grads is None:
        return apart(f"fp32 train step failed: {row['errors'].pop('fp32_train')}")
    if not torch.isfinite(ref_grads).all() or not ref_grads.any():
        return apart("fp32 gradients not finite or all zero")

    row["stage"] = "autocast"
    save(row)

    autocast_cosines(model, inputs, labels, ref, ref_grads, row)
    bf16_floors(model, inputs, labels, ref, ref_grads, row)
    row.update(status="counted", stage="compile", grad_mode_kept=True)
    save(row)
    o2(model, inputs, ref, ref_grads, labels, row, save)
    row["stage"] = "done"
    judge(row)
    save(row)
    return row


def judge(row: dict) -> None:
    """The row's criteria and verdict. A row whose numerics cannot be judged (an
    ill-conditioned measurement, see :func:`criteria`) and that meets every other criterion
    is listed apart, not counted: the harness cannot tell whether it passes."""
    c = row["criteria"] = criteria(row)
    row["passed"] = row["status"] == "counted" and False not in c.values()
    if row["passed"] and None in c.values():
        floors = ", ".join(f"{what} {fmt(row.get(f'bf16_floor_{key}_cos'))}"
                           for what, key in (("eval", "eval"), ("gradients", "grad"))
                           if c[key] is None)
        row.update(status="apart", passed=False, reason=(
            f"ill-conditioned at random init: one bf16 rounding of weights and inputs moves "
            f"fp32's {floors} (cos); numerics not judged"))


def o2(model: nn.Module, inputs: dict, ref: torch.Tensor, ref_grads: torch.Tensor,
       labels: torch.Tensor, row: dict, save: Callable[[dict], None]) -> None:
    """Compile at O2 bf16; time compile + the first (eval) call; the eval cosine, the train
    gradients, both captures, and the grad mode around each call."""
    def kept(expected: bool, where: str) -> None:
        if torch.is_grad_enabled() != expected:
            row["grad_mode_kept"] = False
            row["notes"].append(f"{where}: grad mode left "
                                f"{'enabled' if not expected else 'disabled'}")
            torch.set_grad_enabled(expected)

    t0 = time.perf_counter()

    def compile_() -> nn.Module:
        net = ampgraph.compile(model, amp_level="O2", dtype="bf16")
        kept(True, "compile")
        row["compile_only_s"] = round(time.perf_counter() - t0, 2)
        return net

    net = step(row, "compile", compile_)
    if net is None:
        row["capture"] = {"status": "failed", "eager": [], "graphs": 0,
                          "error": row["errors"]["compile"]}
        return
    row["stage"] = "o2_eval"
    save(row)

    def o2_eval() -> float:
        model.eval()
        net.eval()
        with torch.no_grad():
            out = logits_of(net(**inputs)).float()
            kept(False, "eval call")
        row["compile_s"] = round(time.perf_counter() - t0, 2)
        kept(True, "after the eval call")
        row["capture"] = describe_capture(net)
        return cosine(out, ref)

    row["o2_eval_cos"] = step(row, "o2_eval", o2_eval)
    if row.get("capture") is None:
        row["capture"] = {"status": "failed", "eager": [], "graphs": 0,
                          "error": row["errors"].get("o2_eval", "not run")}
    row["stage"] = "o2_train"
    save(row)

    def o2_train() -> float:
        model.train()
        net.train()
        t1 = time.perf_counter()

        def call() -> Any:
            out = net(**inputs)
            kept(True, "train call")
            return out
        grads = train_grads(model, call, labels)
        row["first_train_call_s"] = round(time.perf_counter() - t1, 2)
        kept(True, "after the train step")
        row["capture_train"] = describe_capture(net)
        row["o2_grads_finite"] = bool(torch.isfinite(grads).all())
        return cosine(grads, ref_grads)

    row["o2_grad_cos"] = step(row, "o2_train", o2_train)
    model.eval()


def criteria(row: dict) -> dict[str, bool | None]:
    """The sweep's checks (every one must hold to pass); a step that failed fails its check.
    The eval and gradient checks are None (not judged) where the measurement is
    ill-conditioned: the fp32 model on bf16-rounded weights and inputs already falls below
    ``FLOOR`` against fp32 (``bf16_floor_*_cos``), so bf16 arithmetic, autocast's or O2's,
    lands anywhere below it (docs/zoo.md)."""
    def num(key: str) -> float | None:
        v = row.get(key)
        return v if isinstance(v, float) and not math.isnan(v) else None

    o2, ac, o2g, acg = (num(k) for k in ("o2_eval_cos", "autocast_eval_cos", "o2_grad_cos",
                                         "autocast_grad_cos"))
    whole = (row.get("capture") or {}).get("status") == "whole graph" and (
        row.get("capture_train") or {}).get("status") == "whole graph"
    eval_ok = o2 is not None and o2 >= 0.99 and (ac is None or o2 >= ac - 0.005)
    grad_ok = bool(row.get("o2_grads_finite")) and o2g is not None and (
        acg is None or o2g >= acg - 0.01)
    ill_eval, ill_grad = ((num(f"bf16_floor_{k}_cos") or 1.0) < FLOOR for k in ("eval", "grad"))
    return {
        "whole graph": whole,
        "eval": None if ill_eval and o2 is not None else eval_ok,
        "grad": None if ill_grad and row.get("o2_grads_finite") and o2g is not None
        else grad_ok,
        "grad mode": bool(row.get("grad_mode_kept")),
        "time": row.get("compile_s") is not None and row["compile_s"] <= SLOW_S,
    }


def failure_reasons(row: dict) -> list[str]:
    """Why a counted row did not pass, one reason per failed check (grouping keys)."""
    if row.get("status") == "timeout":
        return [f"timeout ({row.get('timeout_s')} s) in {row.get('stage')}"]
    errors = row["errors"]
    out = [errors["worker"]] if "worker" in errors else []
    c = row.get("criteria") or criteria(row)
    for key, what in (("compile", "compile failed"), ("o2_eval", "O2 eval call failed"),
                      ("o2_train", "O2 train step failed")):
        if key in errors:
            out.append(f"{what}: {errors[key]}")
    if not c["whole graph"] and not out:
        for cap in (row.get("capture"), row.get("capture_train")):  # eval, train
            for e in (cap or {}).get("eager", [])[:1]:
                why = f"not captured whole: {e['reason']}"[:200]
                if why not in out:
                    out.append(why)
        if not out:
            out.append("not captured whole")
    if c["eval"] is False and "o2_eval" not in errors and "compile" not in errors:
        o2, ac = row.get("o2_eval_cos"), row.get("autocast_eval_cos")
        if not all(isinstance(v, float) and not math.isnan(v) for v in (o2, ac)):
            out.append("O2 eval cos < 0.99 or < autocast's - 0.005")
        elif o2 < ac - 0.005:
            out.append("O2 eval cos < autocast's - 0.005")
        else:  # within 0.005 of autocast's: the absolute bound failed
            out.append("O2 eval cos < 0.99, " + ("as autocast's" if ac < 0.99
                                                 else "autocast's >= 0.99"))
    if c["grad"] is False and "o2_train" not in errors and "compile" not in errors:
        out.append("O2 gradients not finite" if not row.get("o2_grads_finite")
                   else "O2 grad cos < autocast's - 0.01")
    if not c["grad mode"]:
        out.append("grad mode changed by a call")
    if not c["time"] and row.get("compile_s") is not None:
        out.append(f"compile + first call > {SLOW_S:.0f} s")
    return out or ["failed"]


def worker(args: argparse.Namespace) -> int:
    torch.set_num_threads(args.threads)
    from transformers.utils import logging as hf_logging

    hf_logging.set_verbosity_error()
    arch, kind, class_name = args.worker.split(":")
    measure(arch, kind, class_name, row_saver(args.row))
    return 0


def row_saver(path: str) -> Callable[[dict], None]:
    """A worker's ``save(row)``: the row as JSON at ``path``, replaced whole each time."""
    def save(row: dict) -> None:
        with open(path + ".tmp", "w") as f:
            json.dump(row, f, default=str)
        os.replace(path + ".tmp", path)
    return save


# -- the driver --------------------------------------------------------------------------


def run_one(arch: str, kind: str, class_name: str, timeout: float, threads: int,
            script: str = __file__) -> dict:
    """One architecture in a subprocess (``script --worker arch:kind:class``); on timeout or
    crash, its last saved row."""
    with tempfile.TemporaryDirectory() as tmp:
        path = os.path.join(tmp, "row.json")
        cmd = [sys.executable, os.path.abspath(script), "--worker",
               f"{arch}:{kind}:{class_name}", "--row", path, "--threads", str(threads)]
        t0 = time.perf_counter()
        rc, tail = None, ""
        try:
            proc = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout)
            rc, tail = proc.returncode, proc.stderr.strip().splitlines()[-1:] or [""]
            tail = tail[0]
        except subprocess.TimeoutExpired:
            pass
        try:
            with open(path) as f:
                row = json.load(f)
        except (OSError, ValueError):
            row = {"arch": arch, "kind": kind, "class": class_name, "stage": "start",
                   "errors": {}, "notes": [], "seconds": {}}
    row["wall_s"] = round(time.perf_counter() - t0, 2)
    if row.get("stage") != "done" and row.get("status") != "apart":  # killed or crashed
        early = row.get("status") != "counted"  # before its fp32 and autocast references
        if rc is None:
            row["timeout_s"] = timeout
            row.update(status="apart" if early else "timeout",
                       reason=f"timeout ({timeout:.0f} s) in {row['stage']}")
        else:
            reason = f"worker exited with {rc} in {row['stage']}: {tail[:200]}"
            row.update(status="apart" if early else "counted", reason=reason)
            row["errors"]["worker"] = reason
    if row["status"] in ("counted", "timeout"):
        judge(row)
        if not row["passed"]:
            row["failures"] = failure_reasons(row)
    return row


def table(rows: list[dict]) -> str:
    head = ["architecture", "kind", "class", "capture eval / train", "O2 eval cos",
            "autocast eval cos", "O2 grad cos", "autocast grad cos", "compile + 1st call s",
            "passed"]
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for r in rows:
        if r["status"] == "apart":
            continue
        cap = "/".join((r.get(k) or {}).get("status", "-") for k in ("capture",
                                                                     "capture_train"))
        why = "yes" if r.get("passed") else "no: " + "; ".join(
            f if len(f) <= 90 else f[:89] + "…" for f in r.get("failures", []))
        cells = [r["arch"], r["kind"], r["class"], cap, fmt(r.get("o2_eval_cos")),
                 fmt(r.get("autocast_eval_cos")), fmt(r.get("o2_grad_cos")),
                 fmt(r.get("autocast_grad_cos")),
                 "-" if r.get("compile_s") is None else f"{r['compile_s']:.1f}",
                 why.replace("|", "\\|")]
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


def summary(rows: list[dict]) -> str:
    counted = [r for r in rows if r["status"] != "apart"]
    apart = [r for r in rows if r["status"] == "apart"]
    passed = [r for r in counted if r.get("passed")]
    pct = 100.0 * len(passed) / len(counted) if counted else 0.0
    lines = [f"{len(rows)} architectures: {len(counted)} counted, {len(apart)} listed apart; "
             f"passed every criterion: {len(passed)}/{len(counted)} ({pct:.1f}%)"]
    checks = [r["criteria"] for r in counted if "criteria" in r]
    for key in ("whole graph", "eval", "grad", "grad mode", "time"):
        lines.append(f"  {key}: {sum(c[key] is True for c in checks)}/{len(counted)}")

    def grouped(title: str, pairs: list[tuple[str, str]]) -> None:
        groups: dict[str, list[str]] = collections.defaultdict(list)
        for reason, arch in pairs:
            groups[reason].append(arch)
        if groups:
            lines.append(title)
        for reason, archs in sorted(groups.items(), key=lambda kv: (-len(kv[1]), kv[0])):
            lines.append(f"  {len(archs)} x {reason}: {', '.join(sorted(archs))}")

    grouped("failures by reason:", [(why, r["arch"]) for r in counted
                                    for why in r.get("failures", [])])
    grouped("listed apart (not counted):", [(r["reason"], r["arch"]) for r in apart])
    return "\n".join(lines)


def add_sweep_arguments(parser: argparse.ArgumentParser) -> None:
    """The options every sweep shares (this one and benchmarks/timm_sweep.py)."""
    parser.add_argument("--limit", type=int, help="the first N architectures only")
    parser.add_argument("--jobs", type=int, default=1, help="architectures run at once")
    parser.add_argument("--timeout", type=float, default=TIMEOUT_S,
                        help="seconds per architecture (its process is killed after)")
    parser.add_argument("--json", help="JSON lines, written as each architecture finishes")
    parser.add_argument("--markdown", help="write the table and summary here")
    parser.add_argument("--report", metavar="JSONL", nargs="+",
                        help="run nothing: the table and summary of --json files' rows (a "
                             "finished or a killed sweep; an architecture's last row wins, "
                             "so a rerun's file goes after the sweep's)")
    parser.add_argument("--worker", help=argparse.SUPPRESS)
    parser.add_argument("--row", help=argparse.SUPPRESS)
    parser.add_argument("--threads", type=int, default=torch.get_num_threads(),
                        help=argparse.SUPPRESS)


def read_rows(paths: list[str]) -> list[dict]:
    """The architecture rows of --json files, an architecture's last row winning, in the
    order they first appear; each measured row judged again (the criteria and failure
    reasons of this code)."""
    last: dict[str, dict] = {}
    for path in paths:
        with open(path) as f:
            for r in map(json.loads, f):
                if r["record"] == "architecture":
                    last[r["arch"]] = r
    for row in last.values():
        if row["status"] in ("counted", "timeout"):
            judge(row)
            row.pop("failures", None)
            if not row["passed"]:
                row["failures"] = failure_reasons(row)
    return list(last.values())


def sweep(todo: list[tuple[str, str, str]], args: argparse.Namespace, meta: dict,
          script: str = __file__) -> list[dict]:
    """Run every (arch, kind, class) of ``todo``, ``args.jobs`` at once, each in its own
    process of ``script``; rows to ``args.json`` as they finish (after a ``meta`` record),
    then a summary record. The rows, in ``todo``'s order."""
    threads = max(1, (os.cpu_count() or 1) // max(1, args.jobs))
    out = open(args.json, "w") if args.json else None  # noqa: SIM115 - written line by line
    lock = threading.Lock()

    def write(record: dict) -> None:
        if out is not None:
            with lock:
                out.write(json.dumps(record, default=str) + "\n")
                out.flush()

    write({"record": "meta", "date": datetime.date.today().isoformat(),
           "torch": torch.__version__, **meta, "architectures": len(todo),
           "timeout_s": args.timeout, "jobs": args.jobs})
    rows = []
    with ThreadPoolExecutor(max_workers=max(1, args.jobs)) as pool:
        futures = [pool.submit(run_one, *t, args.timeout, threads, script) for t in todo]
        for fut in as_completed(futures):
            row = fut.result()
            rows.append(row)
            write({"record": "architecture", **row})
            verdict = (row.get("reason") if row["status"] == "apart"
                       else "passed" if row.get("passed") else "; ".join(row["failures"]))
            print(f"[{len(rows)}/{len(todo)}] {row['arch']} ({row['status']}, "
                  f"{row['wall_s']} s): {verdict}", file=sys.stderr, flush=True)
    order = {t[0]: i for i, t in enumerate(todo)}
    rows.sort(key=lambda r: order[r["arch"]])
    write({"record": "summary", "text": summary(rows)})
    if out is not None:
        out.close()
    return rows


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--only", help="comma-separated model types (e.g. bert,gpt2,vit)")
    parser.add_argument("--kinds", default=",".join(KINDS),
                        help=f"comma-separated, of {','.join(KINDS)} (default: all)")
    add_sweep_arguments(parser)
    args = parser.parse_args(argv)
    if args.worker:
        return worker(args)
    if args.report:
        return report(read_rows(args.report), args.markdown)

    kinds = args.kinds.split(",")
    if set(kinds) - set(KINDS):
        parser.error(f"unknown kinds {sorted(set(kinds) - set(KINDS))}; known: {list(KINDS)}")
    todo = architectures(kinds)
    if args.only:
        only = args.only.split(",")
        known = {a for a, _, _ in todo}
        if set(only) - known:
            parser.error(f"not an architecture of {kinds}: {sorted(set(only) - known)}")
        todo = [t for t in todo if t[0] in only]
    todo = todo[:args.limit] if args.limit else todo
    meta = {"transformers": __import__("transformers").__version__,
            "command": " ".join(["python", "benchmarks/hf_sweep.py",
                                 *(sys.argv[1:] if argv is None else argv)])}
    return report(sweep(todo, args, meta), args.markdown)


def report(rows: list[dict], markdown: str | None) -> int:
    """Print the table and the summary; with ``markdown``, write both there too."""
    text = summary(rows)
    print(table(rows))
    print("\n" + text)
    if markdown:
        with open(markdown, "w") as f:
            f.write(table(rows) + "\n\n```\n" + text + "\n```\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
