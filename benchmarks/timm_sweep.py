"""timm's families through ampgraph, random weights at small resolutions, on demand.

    .venv-zoo/bin/python benchmarks/timm_sweep.py --jobs 2 --json timm.jsonl --markdown timm.md
    .venv-zoo/bin/python benchmarks/timm_sweep.py --only vit_tiny_patch16_224,convnext_atto
    .venv-zoo/bin/python benchmarks/timm_sweep.py --families convnext,levit --list
    .venv-zoo/bin/python benchmarks/timm_sweep.py --report timm.jsonl --markdown timm.md

A family is a module of ``timm.models`` (``timm.models._registry._model_to_module``) with the
names ``timm.list_models()`` gives it; within a family, the names whose first ``_``-separated
word is the same, less its trailing digits (``resnet``, ``seresnext``, ``ecaresnet``, ``vit``,
``deit``), are one sub-architecture. The sweep takes the smallest model (parameters counted
on the meta device, once per timm version, cached in ``~/.cache/ampgraph``) of each
sub-architecture of each family: the family's smallest always, the others only up to
``MAX_PARAMS``; then up to ``VARIANTS`` more per family, the smallest of each variant (the
name less its size words: ``resnet#d``, ``vit_siglip``, ``mobilenetv#_conv``) not taken
yet, up to ``VARIANT_PARAMS``. The families' smallest run first, then the rest, smallest
first.

Each is built with ``timm.create_model(name, pretrained=False, num_classes=5)`` (every
dropout and drop-path probability 0 afterwards) at the smallest of ``SIZES`` px (then its
own default size) its fp32 forward takes with finite logits, its ``img_size`` passed when
it has one (ViTs, Swins, MaxViTs fix their positions and windows there): 32 px and batch
2, or at least 64 px and batch 4 for a model with batch norm (as benchmarks/zoo.py: two
values per channel make the train-mode gradients noise). Nothing is downloaded.

Everything else is benchmarks/hf_sweep.py's: one process per architecture with a timeout, the
same measurements (fp32 references, autocast, the bf16 floor, O2 eval and train), the same
criteria (whole capture in eval and train, O2 eval cos >= 0.99 and >= autocast's - 0.005,
gradients finite with cos >= autocast's - 0.01, grad mode kept, compile + first call <= 30 s),
rows listed apart when the fp32 model cannot be built or run, or the numerics are
ill-conditioned. ``kind`` in the rows is the family. See docs/zoo.md.
"""

from __future__ import annotations

import argparse
import collections
import json
import os
import pathlib
import re
import sys
import warnings
from collections.abc import Callable

import hf_sweep  # noqa: E402 - benchmarks/ is on sys.path (this script's folder)
import torch
import zoo  # noqa: E402 - prepares torchvision before timm imports it
from torch import nn

SIZES = (32, 64, 96, 128, 160, 192, 224, 256)
BN_SIZE, BATCH, BN_BATCH = 64, 2, 4
MAX_PARAMS = 60_000_000  # a sub-architecture past a family's smallest, only up to this
VARIANT_PARAMS, VARIANTS = 30_000_000, 4  # then per family, variants (``variant``) up to this
CACHE = pathlib.Path.home() / ".cache" / "ampgraph"


def stem(name: str) -> str:
    """The sub-architecture of a timm name: its first word less trailing digits (and a
    version letter): ``seresnext26t_32x4d`` -> ``seresnext``, ``vit_tiny_patch16_224`` ->
    ``vit``, ``efficientnetv2_rw_t`` -> ``efficientnetv``."""
    word = name.split("_")[0]
    return re.sub(r"[\d.]+[a-z]?$", "", word) or word


SIZE_WORD = re.compile(  # after digits became "#": a size, width, patch, window, resolution
    r"^(zepto|atto|femto|pico|nano|micro|x*tiny|small|base|medium|large|huge|giant|gigantic"
    r"|x*[sml]|#[a-z]?|patch#|p#|w#|#x#d?|window#|#[mk]|in#k|r#|#px)$")


def variant(name: str) -> str:
    """A timm name less its size: digits as ``#``, then every word after the first that
    names a size, width, patch, window or resolution dropped: ``resnet50d`` ->
    ``resnet#d``, ``vit_base_patch16_siglip_224`` -> ``vit_siglip``,
    ``mobilenetv4_conv_small_035`` -> ``mobilenetv#_conv``."""
    words = [re.sub(r"\d+", "#", w) for w in name.split("_")]
    return "_".join(words[:1] + [w for w in words[1:] if not SIZE_WORD.match(w)])


def select(families: dict[str, list[str]], params: dict[str, int | None],
           max_params: int = MAX_PARAMS, variant_params: int = VARIANT_PARAMS,
           variants: int = VARIANTS) -> list[tuple[str, str, str]]:
    """(name, family, "-") per sub-architecture of each family, the smallest name of each
    group (unknown sizes last, then shorter names): of each ``stem`` group, the family's
    smallest always and the others up to ``max_params``; then of each ``variant`` group
    not taken yet, the ``variants`` smallest up to ``variant_params``. Every family's
    smallest comes first, then the others, smallest first: a sweep cut short has covered
    every family, and the larger models are what it misses."""
    def size(name: str) -> tuple[float, int, str]:
        n = params.get(name)
        return (float("inf") if n is None else n, len(name), name)

    def smallest(names: list[str], key: Callable[[str], str]) -> list[str]:
        groups = collections.defaultdict(list)
        for name in names:
            groups[key(name)].append(name)
        return sorted((min(group, key=size) for group in groups.values()), key=size)

    firsts, others = [], []
    for family, names in families.items():
        picks = smallest(names, stem)
        firsts.append((picks[0], family, "-"))
        others += [(name, family, "-") for name in picks[1:] if size(name)[0] <= max_params]
        more = [n for n in smallest(names, variant) if n not in picks
                and size(n)[0] <= variant_params]
        others += [(name, family, "-") for name in more[:variants]]
    return sorted(firsts, key=lambda t: size(t[0])) + sorted(others, key=lambda t: size(t[0]))


def timm_families(only_families: list[str] | None = None) -> dict[str, list[str]]:
    """timm's families (modules of ``timm.models``) and their model names."""
    import timm
    from timm.models import _registry

    out: dict[str, list[str]] = collections.defaultdict(list)
    for name in timm.list_models():
        out[_registry._model_to_module.get(name, "?")].append(name)
    return {f: out[f] for f in sorted(out) if only_families is None or f in only_families}


def parameter_counts(names: list[str]) -> dict[str, int | None]:
    """Each name's parameter count, built on the meta device (None where that fails);
    cached per timm version (a first run counts all in a few minutes)."""
    import timm

    path = CACHE / f"timm-{timm.__version__}-params.json"
    known = json.loads(path.read_text()) if path.is_file() else {}
    missing = [n for n in names if n not in known]
    for name in missing:
        try:
            with zoo.quiet(), torch.device("meta"):
                model = timm.create_model(name, pretrained=False, num_classes=zoo.LABELS)
            known[name] = sum(p.numel() for p in model.parameters())
        except Exception:  # noqa: BLE001 - some models read values at build time
            known[name] = None
    if missing:
        CACHE.mkdir(parents=True, exist_ok=True)
        path.write_text(json.dumps(known))
    return {n: known[n] for n in names}


# -- one architecture (in its worker process) --------------------------------------------


def has_batch_norm(model: nn.Module) -> bool:
    return any(isinstance(m, nn.modules.batchnorm._BatchNorm) for m in model.modules())


def create(name: str, size: int) -> tuple[nn.Module, bool]:
    """The random model at ``size`` px, and whether it took ``img_size``."""
    import timm

    torch.manual_seed(0)
    kwargs = dict(pretrained=False, num_classes=zoo.LABELS)
    try:
        model = timm.create_model(name, img_size=size, **kwargs)
        took = True
    except TypeError as exc:
        if "img_size" not in str(exc):
            raise
        model, took = timm.create_model(name, **kwargs), False
    return zoo.no_dropout(model), took


def runs_at(model: nn.Module, size: int) -> None:
    """Raises unless the fp32 model's eval forward takes one ``size`` px image and gives
    finite logits (Swin V2's position bias is not finite at some sizes)."""
    model.eval()
    with torch.no_grad():
        logits = zoo.logits_of(model(torch.randn(1, 3, size, size)))
    if not torch.isfinite(logits).all():
        raise ValueError(f"fp32 logits not finite at {size} px")


def sizes(name: str) -> list[int]:
    """``SIZES``, then the model's own default size if it is not one of them (CrossViT's
    240 px: its two branches' patch grids must match)."""
    import timm

    default = timm.models.get_pretrained_cfg(name)
    own = default.input_size[-1] if default is not None else SIZES[-1]
    return list(SIZES) + ([own] if own not in SIZES else [])


def timm_model(name: str, family: str, class_name: str) -> tuple[nn.Module, dict]:
    """The model and its inputs at the smallest of ``SIZES`` its fp32 forward takes (at
    least ``BN_SIZE`` and ``BN_BATCH`` images with batch norm). Raises the last size's error
    when none works."""
    error: Exception | None = None
    model, took = None, True
    for size in sizes(name):
        try:
            if took or model is None:
                model, took = create(name, size)
            if has_batch_norm(model) and size < BN_SIZE:
                continue
            runs_at(model, size)
        except Exception as exc:  # noqa: BLE001 - the next size
            error = exc
            continue
        batch = BN_BATCH if has_batch_norm(model) else BATCH
        return model, zoo.images(size, batch)()
    assert error is not None
    raise error


def build_failed(name: str, class_name: str, exc: Exception) -> str:
    return f"fp32 model does not build or run at {'/'.join(map(str, sizes(name)))} px: " \
        f"{zoo.one_line(exc)}"


def worker(args: argparse.Namespace) -> int:
    torch.set_num_threads(args.threads)
    warnings.simplefilter("ignore")
    name, family, class_name = args.worker.split(":")
    hf_sweep.measure(name, family, class_name, hf_sweep.row_saver(args.row),
                     make=timm_model, build_failed=build_failed)
    return 0


# -- the driver --------------------------------------------------------------------------


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--only", help="comma-separated timm model names (any, selected or not)")
    parser.add_argument("--families", help="comma-separated timm families (modules)")
    parser.add_argument("--list", action="store_true",
                        help="print the selection (name, family, parameters) and stop")
    hf_sweep.add_sweep_arguments(parser)
    args = parser.parse_args(argv)
    if args.worker:
        return worker(args)
    if args.report:
        return hf_sweep.report(hf_sweep.read_rows(args.report), args.markdown)

    families = timm_families(args.families.split(",") if args.families else None)
    module_of = {n: f for f, names in families.items() for n in names}
    if args.only:
        only = args.only.split(",")
        unknown = sorted(set(only) - set(module_of))
        if unknown:
            parser.error(f"not timm model names: {unknown}")
        todo = [(n, module_of[n], "-") for n in only]
    else:
        params = parameter_counts(sorted(module_of))
        todo = select(families, params)
    todo = todo[:args.limit] if args.limit else todo
    if args.list:
        params = parameter_counts([n for n, _, _ in todo])
        for name, family, _ in todo:
            print(f"{family:28s} {name:40s} {params[name]}")
        print(f"{len(todo)} architectures of {len({f for _, f, _ in todo})} families")
        return 0
    import timm

    meta = {"timm": timm.__version__, "families": len({f for _, f, _ in todo}),
            "command": " ".join(["python", "benchmarks/timm_sweep.py",
                                 *(sys.argv[1:] if argv is None else argv)]),
            "load": os.getloadavg()[0]}
    return hf_sweep.report(hf_sweep.sweep(todo, args, meta, script=__file__), args.markdown)


if __name__ == "__main__":
    sys.exit(main())
