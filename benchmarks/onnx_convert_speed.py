"""How long ``convert_onnx`` takes on a BERT-base-sized ONNX graph, against onnxconverter-common.

    python benchmarks/onnx_convert_speed.py [--repeat 5] [--cache DIR] [--json FILE] [--tiny]

Builds ``transformers.BertModel(BertConfig())`` (the default BERT-base config: 12 layers,
hidden 768, ~110 M parameters; random weights, nothing downloaded), exports it once with
``torch.onnx.export(dynamo=True)`` and caches the FP32 file (``--cache``, default a folder
in the system temp dir; the export takes a while). The timed work goes from a ModelProto in
memory to a ModelProto in memory, nothing is read or written:

- ampgraph: ``convert_onnx(proto, "O2", "fp16")``;
- onnxconverter-common: ``float16.convert_float_to_float16(proto, keep_io_types=True)``.

The tools alternate, after one untimed warm-up run each, and each run starts from a
collected heap; the median, min and max of ``--repeat`` runs are printed, with ampgraph's
time split by phase (the medians of each phase over the same runs; "other" is what the
phases leave: copying the input, option checks, the stamp). ``--tiny`` uses a one-layer
BERT of width 32 (for the smoke test; its times mean nothing). This is a benchmark, not a
test: the machine is shared and times are noisy, compare medians and the spread.
"""

from __future__ import annotations

import argparse
import contextlib
import gc
import hashlib
import json
import os
import statistics
import sys
import tempfile
import time
import warnings
from collections import defaultdict
from collections.abc import Callable, Iterator
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

import onnx  # noqa: E402

import passes.onnx.convert as pconvert  # noqa: E402
import passes.onnx.io as pio  # noqa: E402
from ampgraph.onnx import convert_onnx  # noqa: E402
from passes.onnx.casts import Rewriter  # noqa: E402
from passes.onnx.graph import ModelIndex  # noqa: E402

TINY = dict(vocab_size=128, hidden_size=32, num_hidden_layers=1, num_attention_heads=2,
            intermediate_size=64, max_position_embeddings=64)
# phase -> (owner, attribute): what each phase of convert_onnx calls, timed by a wrapper
PHASES = {
    "load + input check": (pio, "load_model"),
    "index + type inference": (ModelIndex, "build"),
    "paint": (pconvert, "paint"),
    "range checks": (pconvert, "unsafe_range_consumers"),
    "range checks (cones)": (pconvert, "large_constant_cones"),
    "rewrite (casts, initializers)": (Rewriter, "run"),
    "verify": (pconvert, "verify_model"),
}


def bert_onnx(tiny: bool, cache: Path) -> Path:
    """The FP32 BERT exported once with the dynamo exporter, cached by config."""
    import torch
    import transformers

    config = transformers.BertConfig(**(TINY if tiny else {}))
    key = hashlib.sha256(config.to_json_string().encode()).hexdigest()[:12]
    path = cache / f"bert_{'tiny' if tiny else 'base'}_{key}_fp32.onnx"
    if path.exists():
        return path
    cache.mkdir(parents=True, exist_ok=True)
    torch.manual_seed(0)
    model = transformers.BertModel(config).eval()
    ids = torch.randint(0, config.vocab_size, (2, 16))
    kwargs = {"input_ids": ids, "attention_mask": torch.ones_like(ids)}
    start = time.perf_counter()
    with warnings.catch_warnings(), contextlib.redirect_stdout(sys.stderr):
        warnings.simplefilter("ignore")
        program = torch.onnx.export(model, (), kwargs=kwargs, dynamo=True)
        tmp = path.with_name(f".{path.name}.tmp")
        program.save(str(tmp))
    os.replace(tmp, path)
    print(f"exported {path} in {time.perf_counter() - start:.1f} s", file=sys.stderr)
    return path


@contextlib.contextmanager
def phase_timer() -> Iterator[dict[str, float]]:
    """Wrap the phases of ``convert_onnx``; yield phase -> seconds (summed over calls)."""
    spent: dict[str, float] = defaultdict(float)
    saved = []
    for phase, (owner, attr) in PHASES.items():
        raw = owner.__dict__[attr]
        func = raw.__func__ if isinstance(raw, classmethod) else raw

        def timed(*args, _f=func, _p=phase, **kwargs):
            start = time.perf_counter()
            try:
                return _f(*args, **kwargs)
            finally:
                spent[_p] += time.perf_counter() - start

        setattr(owner, attr, classmethod(timed) if isinstance(raw, classmethod) else timed)
        saved.append((owner, attr, raw))
    try:
        yield spent
    finally:
        for owner, attr, raw in saved:
            setattr(owner, attr, raw)


def timed_run(fn: Callable[[], object]) -> float:
    gc.collect()
    start = time.perf_counter()
    result = fn()
    elapsed = time.perf_counter() - start
    del result
    return elapsed


def stats(times: list[float]) -> dict[str, float]:
    return {"median_s": statistics.median(times), "min_s": min(times), "max_s": max(times)}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeat", type=int, default=5, help="timed runs per tool")
    parser.add_argument("--cache", type=Path,
                        default=Path(tempfile.gettempdir()) / "ampgraph_onnx_speed",
                        help="folder for the exported FP32 model")
    parser.add_argument("--tiny", action="store_true", help="a tiny BERT (smoke test)")
    parser.add_argument("--no-occ", action="store_true", help="skip onnxconverter-common")
    parser.add_argument("--json", type=Path, help="write the results here")
    opts = parser.parse_args(argv)

    path = bert_onnx(opts.tiny, opts.cache)
    proto = onnx.load(str(path))
    params = sum(onnx.numpy_helper.to_array(t).size for t in proto.graph.initializer)
    print(f"model: {path.name}: {len(proto.graph.node)} nodes, {params / 1e6:.2f} M "
          f"parameters, {path.stat().st_size / 1e6:.0f} MB")
    before = proto.SerializeToString() if opts.tiny else None

    def ours():
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            return convert_onnx(proto, "O2", "fp16")

    tools = {"ampgraph": ours}
    if not opts.no_occ:
        from onnxconverter_common import float16

        def theirs():
            with warnings.catch_warnings():
                warnings.simplefilter("ignore")
                return float16.convert_float_to_float16(proto, keep_io_types=True)

        tools["onnxconverter-common"] = theirs
    for fn in tools.values():  # warm-up: imports, schema caches, the IR version probe
        timed_run(fn)
    times: dict[str, list[float]] = {name: [] for name in tools}
    phases: dict[str, list[float]] = defaultdict(list)
    for _ in range(opts.repeat):
        for name, fn in tools.items():
            if name != "ampgraph":
                times[name].append(timed_run(fn))
                continue
            with phase_timer() as spent:
                total = timed_run(fn)
            times[name].append(total)
            for phase in PHASES:
                phases[phase].append(spent.get(phase, 0.0))
            phases["other"].append(total - sum(spent.values()))
    if before is not None:
        assert proto.SerializeToString() == before, "a tool modified its input model"

    results = {"model": path.name, "nodes": len(proto.graph.node), "parameters": params,
               "repeat": opts.repeat, "tools": {k: stats(v) for k, v in times.items()},
               "ampgraph_phases_median_s": {k: statistics.median(v) for k, v in phases.items()}}
    print(f"\nfrom ModelProto to ModelProto, O2 fp16, {opts.repeat} runs (median / min / max s):")
    for name, s in results["tools"].items():
        print(f"  {name:22s} {s['median_s']:7.3f} / {s['min_s']:.3f} / {s['max_s']:.3f}")
    print("\nampgraph by phase (median s):")
    for phase, sec in results["ampgraph_phases_median_s"].items():
        print(f"  {phase:32s} {sec:7.3f}")
    if opts.json:
        opts.json.write_text(json.dumps(results, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
