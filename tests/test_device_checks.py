"""No device checks outside the runtimes: the passes and the package never ask which device
they run on (``ampgraph/runtime/<device>/`` holds each device's choices)."""

from __future__ import annotations

import pathlib
import re

ROOT = pathlib.Path(__file__).resolve().parents[1]
CHECK = re.compile(r"device\.type|\.is_cuda\b|[=!]=\s*['\"](cpu|cuda)['\"]|"
                   r"['\"](cpu|cuda)['\"]\s*[=!]=|\bin \(['\"](cpu|cuda)['\"]|/proc/cpuinfo")
ALLOWED = {
    "ampgraph/runtime/cpu/": "the CPU runtime's own choices",
    "ampgraph/runtime/cuda/": "the CUDA runtime's own choices",
    "ampgraph/runtime/fp8.py": "emulate=None: _scaled_mm's kernels on CUDA, the exact emulation "
                               "elsewhere (CPU _scaled_mm is far too slow)",
    "ampgraph/config.py": "the resolution: dtype and runtime for the model's device",
    "ampgraph/cli/": "the CLI's own --device option",
    "ampgraph/onnx/session.py": "onnx_session's own device= option (the provider it asks for)",
}


def _offending_lines() -> list[str]:
    found = []
    for folder in ("ampgraph", "passes"):
        for path in sorted((ROOT / folder).rglob("*.py")):
            rel = path.relative_to(ROOT).as_posix()
            if any(rel.startswith(prefix) for prefix in ALLOWED):
                continue
            for i, line in enumerate(path.read_text().splitlines(), 1):
                code = line.strip()
                if code.startswith((">>>", "#")):  # doctest output, comments
                    continue
                if CHECK.search(code):
                    found.append(f"{rel}:{i}: {code}")
    return found


def test_no_device_check_outside_the_runtimes_and_the_resolution():
    assert _offending_lines() == [], "move the choice into ampgraph/runtime/<device>/"


def test_the_check_finds_what_it_looks_for():
    for line in ('if x.device.type == "cpu":', "if t.is_cuda:", "ok = 'cuda' != kind",
                 'open("/proc/cpuinfo")', 'if d.type in ("cpu", "cuda"):'):
        assert CHECK.search(line), line
    assert not CHECK.search("if t.is_meta:")
