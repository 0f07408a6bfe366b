"""The class of a compiled module: a subclass of ``AmpModule`` per model class.

Libraries inspect a model's class, not the instance: HuggingFace's ``find_labels`` and
``can_return_loss`` read ``type(model).forward``'s parameters and ``type(model).__name__``
("QuestionAnswering" models also take ``start_positions``/``end_positions``), the Trainer
compares the class name with its mapping of causal LMs (label smoothing shifts their
labels) and calls ``save_pretrained`` only on a ``PreTrainedModel``. So
``AmpModule(model, ...)`` is an instance of :func:`compiled_class` of the model's class:

- its ``__name__`` is the model class's; its ``__qualname__``
  (``AmpModule[BertForSequenceClassification]``) and ``__module__`` (``ampgraph.module``)
  say what it is;
- its ``forward`` has the model class's signature (:func:`ampgraph.signature.class_forward`);
- for a ``transformers.PreTrainedModel`` it is one too. Every attribute ``PreTrainedModel``
  and its mixins define is then the model's (``save_pretrained``, ``config_class``,
  ``device``, ``num_parameters``, ...), as ``AmpModule.__getattr__`` gives them for any other
  model, except those ``AmpModule`` has itself (``train``) or inherits from ``nn.Module``
  (``to``, ``half``, ``eval``): ``net.to(...)`` still returns ``net``.

Made once per (base, model class); transformers is never imported here (a
``PreTrainedModel`` is recognised in the model class's MRO).
"""

from __future__ import annotations

import inspect
import threading
from typing import Any

from ampgraph.signature import SignedForward, class_forward

PRETRAINED = ("transformers.modeling_utils", "PreTrainedModel")  # (module, qualname)

_CLASSES: dict[tuple[type, type], type] = {}
_LOCK = threading.Lock()


class ModelAttribute:
    """A class attribute of ``PreTrainedModel`` on a compiled class: the compiled module's
    model's attribute (``getattr(net.original_module, name)``), or the model class's when
    read on the class."""

    def __init__(self, name: str, model_cls: type) -> None:
        self.name = name
        self.model_cls = model_cls

    def __get__(self, obj: Any, cls: type | None = None) -> Any:
        if obj is None:
            return getattr(self.model_cls, self.name)
        return getattr(obj.original_module, self.name)


def compiled_class(base: type, model_cls: type) -> type:
    """The subclass of ``base`` (``AmpModule``) that compiled instances of ``model_cls``
    have (see the module docstring); made once per class.

    Example:
        >>> cls = compiled_class(AmpModule, nn.Linear)
        >>> cls.__name__, cls.__qualname__, issubclass(cls, AmpModule)
        ('Linear', 'AmpModule[Linear]', True)
    """
    key = (base, model_cls)
    cls = _CLASSES.get(key)
    if cls is None:
        with _LOCK:
            cls = _CLASSES.get(key)
            if cls is None:
                cls = _CLASSES[key] = _make(base, model_cls)
    return cls


def pretrained_base(model_cls: type) -> type | None:
    """``transformers.PreTrainedModel`` if ``model_cls`` is a subclass, else None (without
    importing transformers).

    Example:
        >>> pretrained_base(nn.Linear) is None
        True
    """
    for klass in model_cls.__mro__:
        if (klass.__module__, klass.__qualname__) == PRETRAINED:
            return klass
    return None


def _make(base: type, model_cls: type) -> type:
    run = base.forward  # the class's function (SignedForward returns it on the class)
    forward = class_forward(model_cls, run)
    namespace: dict[str, Any] = {
        "__module__": base.__module__,
        "__qualname__": f"{base.__qualname__}[{model_cls.__qualname__}]",
        "__doc__": base.__doc__,
        "forward": SignedForward(forward if forward is not None else run),
    }
    pretrained = pretrained_base(model_cls)
    if pretrained is None:
        return type(model_cls.__name__, (base,), namespace)
    for name in _names_defined_by(pretrained, below=base):
        if name not in namespace:
            namespace[name] = (inspect.getattr_static(base, name) if hasattr(base, name)
                               else ModelAttribute(name, model_cls))
    # PreTrainedModel.__init_subclass__ reads config_class (a ModelAttribute: the model's)
    return type(model_cls.__name__, (base, pretrained), namespace)


def _names_defined_by(cls: type, below: type) -> set[str]:
    """The attributes ``cls`` and its bases define that ``below``'s bases do not (those of
    PreTrainedModel and its mixins, not nn.Module's or object's), dunders left out."""
    shared = set(below.__mro__)
    names: set[str] = set()
    for klass in cls.__mro__:
        if klass not in shared:
            names.update(n for n in vars(klass) if not (n.startswith("__") and n.endswith("__")))
    return names
