"""Faithfulness: PEFT's LoRA on a transformers model trains, switches its adapter off and on,
and merges it, as in eager (the adapter's flags are guarded; merged weights are seen)."""

from __future__ import annotations

import pytest
import torch

from tests.ampgraph.faithfulness.harness import Case, check, compiled_whole

peft = pytest.importorskip("peft")
transformers = pytest.importorskip("transformers")

IDS = torch.randint(1, 64, (2, 12), generator=torch.Generator().manual_seed(4))


def lora_llama():
    base = transformers.LlamaForCausalLM(transformers.LlamaConfig(
        vocab_size=64, hidden_size=32, num_hidden_layers=2, num_attention_heads=2,
        num_key_value_heads=1, intermediate_size=64, use_cache=False))
    config = peft.LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"],
                             lora_dropout=0.0, init_lora_weights=False)
    return peft.get_peft_model(base, config)


def lora_grads(model):
    return [p.grad.clone() for n, p in model.named_parameters() if "lora_" in n]


def trained(call, model):
    model.train()
    out = []
    for _ in range(2):
        model.zero_grad(set_to_none=True)
        logits = call(input_ids=IDS).logits
        logits.float().square().mean().backward()
        out += [logits.detach(), *lora_grads(model)]
    frozen = [p.grad for n, p in model.named_parameters() if "lora_" not in n]
    return out + [all(g is None for g in frozen)]


def adapter_switched(call, model):
    model.eval()
    with torch.no_grad():
        with_adapter = call(input_ids=IDS).logits
        with model.disable_adapter():
            without = call(input_ids=IDS).logits
        again = call(input_ids=IDS).logits
        model.merge_adapter()
        merged = call(input_ids=IDS).logits
        model.unmerge_adapter()
        unmerged = call(input_ids=IDS).logits
    return [with_adapter, without, again, merged, unmerged]


CASES = [
    Case("LoRA fine-tuning steps", lora_llama, trained, after=compiled_whole),
    Case("LoRA disabled, enabled, merged and unmerged after the first call", lora_llama,
         adapter_switched, after=compiled_whole),
]


@pytest.mark.parametrize("case", CASES, ids=str)
def test_peft(case):
    check(case)
