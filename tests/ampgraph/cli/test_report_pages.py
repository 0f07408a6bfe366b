"""The HTML reports a user opens: the 12-layer BERT and an FP8 LLaMA (HF models built from
configs), their size, their folded blocks, their FLOP shares against ``explain``, and,
where a Chromium is installed, what the browser shows (benchmarks/report_browser.py)."""

from __future__ import annotations

import json
from collections import Counter

import pytest

from ampgraph.cli.html_report import page_data, to_html
from ampgraph.cli.render import summary_lines

pytest.importorskip("transformers")

from benchmarks.browser import Page, find_browser  # noqa: E402
from benchmarks.report_browser import VIEW, bert12_report, check_page, fp8_llama_report  # noqa: E402

MAX_BYTES = 200 * 1024


@pytest.fixture(scope="module")
def bert():
    return bert12_report()


@pytest.fixture(scope="module")
def llama():
    return fp8_llama_report()


def test_the_bert12_page_is_small_and_folds_its_layers(bert):
    page = to_html(bert)
    assert len(page.encode()) < MAX_BYTES
    data = page_data(bert)
    layer = data["tree"]["k"][1]["k"][0]  # (model) > encoder > layer
    assert layer["p"] == "encoder.layer"
    fold, last = layer["k"]
    assert fold["fold"] == "layer 0-10" and len(fold["m"]) == 11
    # the last layer's output feeds the pooler: its norm's output cast sits elsewhere
    assert last["p"] == "encoder.layer.11" and last["d"].startswith(
        "plan differs from layer 0's: output.LayerNorm casts: 1 here, 0 there")
    assert data["tree"]["o"] == bert.summary["ops_by_precision"]
    assert sum(r[6] == 1 for r in data["rows"]) == bert.summary["params"] == 201


def expected_flops(model, ids, report) -> Counter:
    """FLOPs by precision computed from the model's own shapes and ``explain``'s rows:
    2 x tokens x in x out per linear, 2 x B x H x L x L x (d_q + d_v) per attention."""
    cfg = model.config
    tokens = ids.numel()
    linears = dict(model.named_modules())
    out: Counter = Counter()
    for r in report.nodes:
        if r["op"] == "aten.linear":
            w = linears[r["module"]].weight
            out[r["precision"]] += 2 * tokens * w.shape[0] * w.shape[1]
        elif r["op"].startswith("aten.scaled_dot_product_attention"):
            d = cfg.hidden_size // cfg.num_attention_heads
            out[r["precision"]] += (2 * ids.shape[0] * cfg.num_attention_heads
                                    * ids.shape[1] ** 2 * 2 * d)
    return out


def test_fp8_bf16_and_fp32_flop_shares_on_the_fp8_llama_equal_explains(llama):
    insp, model, inputs = llama
    report = insp  # inspect_module's rows are ampgraph.explain's
    want = expected_flops(model, inputs[0], report)
    total = sum(want.values())
    assert set(want) == {"bf16", "fp8"} and want["fp8"] / total > 0.85
    s = insp.summary
    assert s["matmul_conv_flops"] == total
    assert s["fp8_flops_share"] == round(want["fp8"] / total, 4)
    assert s["low_flops_share"] == round(want["bf16"] / total, 4)
    shares = dict(summary_lines(insp))["matmul/conv FLOPs"]
    assert shares.endswith(f"bf16 {100 * want['bf16'] / total:.1f}%, "
                           f"fp8 {100 * want['fp8'] / total:.1f}%, fp32 0.0%")
    assert page_data(insp)["tree"]["f"] == [want["bf16"], want["fp8"], 0]
    # the FP8 weight copies: one byte per value of every FP8 product's weight
    fp8_weights = sum(dict(model.named_modules())[r["module"]].weight.numel()
                      for r in report.nodes if r["precision"] == "fp8")
    assert s["param_bytes_fp8"] == fp8_weights > 0
    assert s["param_bytes_runtime"] == (s["param_bytes_fp32"] + s["param_bytes_low"]
                                        + fp8_weights)


def test_fp8_has_its_own_colour_chip_and_bar(llama):
    insp = llama[0]
    page = to_html(insp)
    assert 'data-p="fp8"' in page.split('<p class="legend">')[1].split("</p>")[0]
    data = json.loads(page.split('id="amp-data">')[1].split("</script>")[0])
    assert data["colors"]["fp8"] not in {v for k, v in data["colors"].items() if k != "fp8"}
    layers = data["tree"]["k"][0]["k"][1]
    assert layers["p"] == "model.layers"
    first, fold = layers["k"]  # layer 0's q_proj is the graph's first product: 16-bit
    assert fold["fold"] == "layers 1-3" and "q_proj aten.linear: bf16 here, fp8 there" \
        in first["d"]


@pytest.mark.skipif(find_browser() is None, reason="no Chromium here (apt-get install "
                    "chromium); benchmarks/report_browser.py runs the same checks")
def test_the_pages_in_a_browser(bert, llama, tmp_path):
    with Page(*VIEW) as page:
        for name, insp in (("bert12", bert), ("llama_fp8", llama[0])):
            html = tmp_path / f"{name}.html"
            html.write_text(to_html(insp), encoding="utf-8")
            found = check_page(page, html, None, name)
            assert found["problems"] == [], found
            assert found["folds"] and found["ops"]["rows"] > 10
