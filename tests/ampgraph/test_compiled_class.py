"""ampgraph/compiled_class.py: a compiled module's class is named like the model's, has its
forward signature, and is a ``PreTrainedModel`` whose HF attributes are the model's."""

from __future__ import annotations

import inspect

import pytest
import torch
from torch import nn

import ampgraph
from ampgraph.compiled_class import ModelAttribute, compiled_class, pretrained_base
from ampgraph.module import AmpModule
from tests.helpers import Keyworded


def test_the_class_is_named_like_the_models_made_once_and_keeps_its_forward_signature():
    cls = compiled_class(AmpModule, Keyworded)
    assert compiled_class(AmpModule, Keyworded) is cls
    assert issubclass(cls, AmpModule) and cls.__bases__ == (AmpModule,)
    assert (cls.__name__, cls.__qualname__, cls.__module__) == (
        "Keyworded", "AmpModule[Keyworded]", "ampgraph.module")
    assert inspect.signature(cls.forward) == inspect.signature(Keyworded.forward)
    assert compiled_class(AmpModule, nn.Linear) is not cls
    net = ampgraph.compile(Keyworded(), "O2", "bf16")
    assert type(net) is cls and "Keyworded(" in repr(net)


def test_a_forward_without_a_signature_keeps_the_generic_one():
    class Unsigned(nn.Module):
        def forward(self, x):
            return x

    Unsigned.forward.__signature__ = "not a signature"  # inspect.signature raises TypeError
    try:
        cls = compiled_class(AmpModule, Unsigned)
    finally:
        del Unsigned.forward.__signature__
    assert list(inspect.signature(cls.forward).parameters) == ["self", "args", "kwargs"]


def test_a_plain_module_is_no_pretrained_model():
    assert pretrained_base(nn.Linear) is None and pretrained_base(Keyworded) is None


# -- transformers models ------------------------------------------------------------------


def _bert(cls_name: str):
    transformers = pytest.importorskip("transformers")
    config = transformers.BertConfig(vocab_size=64, hidden_size=32, num_hidden_layers=1,
                                     num_attention_heads=2, intermediate_size=64,
                                     max_position_embeddings=32, num_labels=2)
    return getattr(transformers, cls_name)(config)


def test_a_pretrained_model_compiles_to_a_pretrained_model_whose_hf_attributes_are_its():
    from transformers import PreTrainedModel

    model = _bert("BertForSequenceClassification")
    net = ampgraph.compile(model, "O2", "bf16")
    cls = type(net)
    assert cls.__bases__ == (AmpModule, PreTrainedModel)
    assert pretrained_base(type(model)) is PreTrainedModel
    assert isinstance(net, AmpModule) and isinstance(net, PreTrainedModel)
    assert not isinstance(net, type(model))
    # PreTrainedModel's attributes (and its mixins') are the model's, as __getattr__ gives
    assert isinstance(vars(cls)["save_pretrained"], ModelAttribute)
    assert net.save_pretrained.__self__ is model
    assert net.get_input_embeddings() is model.get_input_embeddings()
    assert net.base_model_prefix == "bert" and net.base_model is model.bert
    assert net.supports_gradient_checkpointing == model.supports_gradient_checkpointing
    assert cls.config_class is type(model).config_class and net.config is model.config
    assert net.num_parameters() == model.num_parameters() and net.can_generate() is False
    # nn.Module's own methods PreTrainedModel overrides stay nn.Module's (AmpModule's)
    assert cls.to is nn.Module.to and cls.half is nn.Module.half and cls.train is AmpModule.train
    assert net.to(torch.float32) is net
    assert net.eval() is net and not model.training
    # the shared state is untouched: the model's keys, parameters and forward
    assert list(net.state_dict()) == list(model.state_dict())
    assert [p for p in net.parameters()] == [p for p in model.parameters()]
    ids = torch.randint(0, 64, (2, 8))
    out = net(input_ids=ids, labels=torch.tensor([0, 1]))
    assert torch.isfinite(out.loss) and net.amp_parts()[0]
