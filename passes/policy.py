"""Precision policy as data: what both dialects share: op classes, level tables, user
overrides. Each dialect's op groups live with it (``passes.fx.policy``,
``passes.onnx.policy``).

Every op belongs to one of four classes (the TensorFlow grappler vocabulary):

- ``ALLOW``: always worth running in low precision (matrix multiply, convolution).
- ``INFER``: low precision when fed low precision (elementwise math, activations).
- ``DENY``: numerically fragile, always FP32 at O1/O2 (norms, softmax, losses,
  transcendental ops, large reductions).
- ``CLEAR``: moves data without arithmetic and follows its neighbours.

Adding an op is one line in a dialect's group; each group says why it is there. Ops not
listed are ``INFER``. Keys are dialect-qualified op names: ``aten.softmax`` for FX
(an overload such as ``aten.softmax.int`` may be listed too, it wins), plain ONNX op
types (``Softmax``) for ONNX.
"""

from __future__ import annotations

import fnmatch
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field, replace

ALLOW = "allow"
INFER = "infer"
DENY = "deny"
CLEAR = "clear"
CLASSES = (ALLOW, INFER, DENY, CLEAR)

LOW = "low"
FP32 = "fp32"
NA = "n/a"

LEVELS = ("O0", "O1", "O2", "O3")

# Group name -> (class, reason, ops). The NORM group is separate because
# keep_batchnorm_fp32 moves it between DENY and the low-precision side.
NORM = "norm"


@dataclass(frozen=True)
class OpGroup:
    """A named set of ops sharing a class and a reason."""

    name: str
    cls: str
    reason: str
    ops: frozenset[str]


def op_group(name: str, cls: str, reason: str, ops: str) -> OpGroup:
    """A group from its ops written as one space-separated string.

    Example:
        >>> op_group("softmax", DENY, "exp overflows", "Softmax LogSoftmax").ops
        frozenset({'LogSoftmax', 'Softmax'})
    """
    return OpGroup(name, cls, reason, frozenset(ops.split()))


@dataclass(frozen=True)
class OpInfo:
    """What the policy says of one op: its class, group and reason."""

    cls: str
    group: str
    reason: str


DEFAULT_INFO = OpInfo(
    INFER, "default", "not in the policy tables: elementwise by default, follows its inputs"
)


class OpTable:
    """Lookup from op key to :class:`OpInfo`, built from groups.

    A key ``aten.softmax.int`` is looked up as itself, then as its packet ``aten.softmax``;
    an in-place variant ``aten.relu_`` falls back to ``aten.relu``.
    """

    def __init__(self, groups: Iterable[OpGroup]):
        self.groups = tuple(groups)
        self._info: dict[str, OpInfo] = {}
        for g in self.groups:
            for op in g.ops:
                if op in self._info:
                    raise ValueError(f"op {op!r} is listed in two policy groups")
                self._info[op] = OpInfo(g.cls, g.name, g.reason)
        # key -> lookup result; the table never changes after construction
        self._looked_up: dict[str, OpInfo | None] = {}

    def __contains__(self, key: str) -> bool:
        return self.lookup(key) is not None

    def lookup(self, key: str) -> OpInfo | None:
        try:
            return self._looked_up[key]
        except KeyError:
            pass
        found = None
        for candidate in key_candidates(key):
            if candidate in self._info:
                found = self._info[candidate]
                break
        if len(self._looked_up) < 65536:  # op keys: bounded in practice; a cap all the same
            self._looked_up[key] = found
        return found

    def info(self, key: str) -> OpInfo:
        return self.lookup(key) or DEFAULT_INFO


def key_candidates(key: str) -> list[str]:
    """The keys an op is looked up under, most specific first: itself, its packet
    (``aten.softmax.int`` -> ``aten.softmax``), its out-of-place form (``aten.relu_`` ->
    ``aten.relu``).

    Example:
        >>> key_candidates("aten.relu_.default")
        ['aten.relu_.default', 'aten.relu_', 'aten.relu']
    """
    out = [key]
    parts = key.split(".")
    if len(parts) >= 3:  # aten.softmax.int -> aten.softmax
        out.append(".".join(parts[:2]))
    base = out[-1]
    if base.endswith("_") and not base.endswith("__"):  # in-place: aten.relu_ -> aten.relu
        out.append(base[:-1])
    return out


# What each level does with each class. "paint" means the grappler painting rules decide;
# "follow" means the node takes the precision of its compute neighbours. (O2's INFER ops
# between fp32 ops stay fp32: passes/paint.py, rule 6.)
LEVEL_TABLE: dict[str, dict[str, str]] = {
    "O0": {ALLOW: FP32, INFER: FP32, DENY: FP32, CLEAR: FP32},
    "O1": {ALLOW: LOW, INFER: "paint", DENY: FP32, CLEAR: "paint"},
    "O2": {ALLOW: LOW, INFER: LOW, DENY: FP32, CLEAR: "follow"},
    "O3": {ALLOW: LOW, INFER: LOW, DENY: LOW, CLEAR: LOW},
}
LEVEL_REASON = {
    "O0": "O0: everything fp32",
    "O1": "O1",
    "O2": "O2: whole network low precision except deny ops",
    "O3": "O3: everything low precision",
}
# Groups whose precision holds at every level but O0: the user asked for it, or the ops
# have no 16-bit kernels (complex numbers, FFTs: fp32 even at O3, as autocast keeps them).
NORM_FP32 = "norm_fp32"
FP32_ONLY = "fp32_only"
# Ops that pick entries by comparing values (top-k, sort, argmax): their float inputs are
# made in fp32 back to the last matrix op or fp32 op (passes/paint.py, rule 7).
SELECTION = "selection"
SELECTION_REASON = (
    "selects by comparing values: 16-bit values tie (a sigmoid's outputs near 0.5 are 2**-8 "
    "apart in bf16) and the choice changes; its inputs are computed in fp32")
FORCED_GROUPS = {"custom_allow": LOW, "custom_deny": FP32, NORM_FP32: FP32, FP32_ONLY: FP32}
KEEP_NORM_FP32_DEFAULT = {"O0": True, "O1": True, "O2": True, "O3": False}


@dataclass(frozen=True)
class Overrides:
    """User overrides, normalised.

    Attributes:
        ops: op key -> class (ALLOW or DENY), from custom_allow/custom_deny op names.
        modules: (pattern or class name, precision LOW/FP32, origin) in the order given;
            the most specific match (longest path) wins.
        prefix: the compiled module's path in the model its patterns name ("" at the root;
            a child compiled on its own: the eager fallback's, a region's).
    """

    ops: Mapping[str, str] = field(default_factory=dict)
    modules: tuple[tuple[str, str, str], ...] = ()
    prefix: str = ""

    def op_class(self, key: str) -> str | None:
        for candidate in key_candidates(key):
            if candidate in self.ops:
                return self.ops[candidate]
        return None

    def module_precision(self, path: str, classes: Iterable[str]) -> tuple[str, str] | None:
        """Precision forced on a node by module path/class overrides, with the reason."""
        best: tuple[int, str, str] | None = None
        classes = tuple(classes)
        path = ".".join(p for p in (self.prefix, path) if p)
        for pattern, precision, origin in self.modules:
            score = module_match(pattern, path, classes)
            if score is not None and (best is None or score >= best[0]):
                best = (score, precision, f"{origin} {pattern!r}")
        return None if best is None else (best[1], best[2])


def module_match(pattern: str, path: str, classes: tuple[str, ...]) -> int | None:
    """How specifically ``pattern`` (a module-path pattern, or ``"class:Name"``) matches a
    node of module ``path`` inside modules of ``classes``: the matched path's depth (0 for
    a class), or None.

    Example:
        >>> module_match("encoder.*", "encoder.layer.0", ())
        2
    """
    if pattern.startswith("class:"):
        name = pattern[len("class:"):]
        return 0 if any(c == name or c.rsplit(".", 1)[-1] == name for c in classes) else None
    if not path:
        return None
    parts = path.split(".")
    for i in range(len(parts), 0, -1):  # the path itself or any ancestor
        prefix = ".".join(parts[:i])
        if fnmatch.fnmatchcase(prefix, pattern):
            return i
    return None


@dataclass(frozen=True)
class LevelPolicy:
    """Everything the painter needs for one compile: level, norm handling, overrides."""

    level: str
    keep_norm_fp32: bool
    table: OpTable
    overrides: Overrides = field(default_factory=Overrides)
    # (op key from passes/fx/calibration.py's node_keys, reason): ops a calibration run
    # saw exceed the low dtype's range, kept fp32
    calibrated: tuple[tuple[str, str], ...] = ()
    # a child compiled on its own by an eager fallback: fp32 code makes its inputs and takes
    # its outputs, so at O1/O2 a graph of it without an ALLOW op stays fp32 (paint rule 8)
    fallback_part: bool = False

    def under(self, path: str, fallback_part: bool | None = None) -> LevelPolicy:
        """This policy for a module at ``path`` of the model its module patterns name (a
        child of an eager fallback when ``fallback_part``; None keeps this policy's flag).

        Example:
            >>> policy.under("model.layers.0").overrides.prefix
            'model.layers.0'
        """
        part = self.fallback_part if fallback_part is None else fallback_part
        return replace(self, overrides=replace(self.overrides, prefix=path), fallback_part=part)

    def op_info(self, key: str) -> OpInfo:
        """Class and reason for an op key, with user overrides and the norm switch applied."""
        forced = self.overrides.op_class(key)
        if forced is not None:
            origin = "custom_allow" if forced == ALLOW else "custom_deny"
            return OpInfo(forced, origin, f"{origin}: forced by the user")
        info = self.table.info(key)
        if info.group == NORM:
            if self.keep_norm_fp32:
                return OpInfo(DENY, NORM_FP32, info.reason + " (keep_batchnorm_fp32=True)")
            return OpInfo(INFER, NORM, "normalisation in low precision (keep_batchnorm_fp32=False)")
        return info

    def base(self, info: OpInfo) -> str:
        """LOW, FP32, "paint" or "follow" for an op at this level; user op overrides are
        absolute (custom_deny stays fp32 even at O3)."""
        if self.level != "O0" and info.group in FORCED_GROUPS:
            return FORCED_GROUPS[info.group]
        return LEVEL_TABLE[self.level][info.cls]


def make_policy(
    level: str,
    *,
    table: OpTable,
    keep_norm_fp32: bool | None = None,
    allow_ops: Iterable[str] = (),
    deny_ops: Iterable[str] = (),
    module_rules: Iterable[tuple[str, str, str]] = (),
) -> LevelPolicy:
    """Build the policy of one compile, rejecting contradictory overrides.

    Args:
        level: "O0".."O3".
        table: the dialect's op table (``passes.fx.policy.make_policy`` and
            ``passes.onnx.policy.make_policy`` pass their own).
        keep_norm_fp32: None takes the level's default.
        allow_ops / deny_ops: op keys forced to ALLOW / DENY.
        module_rules: (pattern, LOW|FP32, origin) module-path or ``class:Name`` rules.

    Raises:
        ValueError: unknown level, an op both allowed and denied, or one module pattern
            given two precisions.

    Example:
        >>> make_policy("O2", table=ONNX_TABLE, deny_ops=["MatMul"]).op_info("MatMul").cls
        'deny'
    """
    if level not in LEVEL_TABLE:
        raise ValueError(f"unknown amp_level {level!r}: choose one of O0, O1, O2, O3")
    ops: dict[str, str] = {}
    for cls, keys in ((ALLOW, allow_ops), (DENY, deny_ops)):
        for key in keys:
            if ops.get(key, cls) != cls:
                raise ValueError(
                    f"conflicting overrides: op {key!r} is in both custom_allow and custom_deny; "
                    "remove it from one of them"
                )
            ops[key] = cls
    seen: dict[str, tuple[str, str]] = {}
    rules = []
    for pattern, precision, origin in module_rules:
        if pattern in seen and seen[pattern][0] != precision:
            raise ValueError(
                f"conflicting overrides: module {pattern!r} is {seen[pattern][0]} by "
                f"{seen[pattern][1]} and {precision} by {origin}; keep one"
            )
        seen[pattern] = (precision, origin)
        rules.append((pattern, precision, origin))
    if keep_norm_fp32 is None:
        keep_norm_fp32 = KEEP_NORM_FP32_DEFAULT[level]
    return LevelPolicy(level, keep_norm_fp32, table, Overrides(ops, tuple(rules)))
