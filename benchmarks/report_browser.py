"""Open ``ampgraph inspect``'s HTML reports in headless Chromium and check what a user sees.

The reports are the 12-layer BERT (HF ``BertModel``, O2 bf16) and a 4-layer HF LLaMA with
FP8 products (O2 bf16, ``FP8Recipe(rule="all")``), as ``ampgraph inspect --format html``
writes them. For each page, at 1400 x 1000 CSS pixels:

- no console error and no uncaught exception; no request for anything but the page;
- the module tree and its folded blocks are on the first screen, without scrolling;
- a node of any block is two clicks away: open the folded blocks, open the block's ops;
- the model's graph draws, fits the width, and hides its shape and data-movement ops
  until asked;
- a legend chip hides its precision in the tables.

Screenshots go to ``--out`` (docs/img holds the ones docs/cli.md shows). Chromium is
Debian's ``chromium`` package (``apt-get install chromium``); ``.ci/run`` installs it
where it can, and ``tests/ampgraph/cli/test_report_pages.py`` runs the same checks
wherever a Chromium is found.

    python benchmarks/report_browser.py --out /tmp/report_shots
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
import time
import warnings
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from benchmarks.browser import Page, find_browser  # noqa: E402

VIEW = (1400, 1000)


def bert12_report() -> Any:
    """The Inspection of a 12-layer HF BERT (narrow: the plan is BERT-base's) at O2 bf16."""
    import torch
    import transformers as tf

    from ampgraph.cli.inspect import inspect_module

    cfg = tf.BertConfig(num_hidden_layers=12, hidden_size=64, num_attention_heads=4,
                        intermediate_size=128, vocab_size=1000)
    torch.manual_seed(0)
    model = tf.BertModel(cfg).eval()
    ids = torch.randint(0, 1000, (2, 16))
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return inspect_module("hf:bert-12", model, (ids,), "O2", "bf16", False)


def fp8_llama_report() -> tuple[Any, Any, tuple]:
    """The Inspection of a 4-layer HF LLaMA with FP8 products at O2 bf16, its model and
    inputs."""
    import torch
    import transformers as tf

    import ampgraph
    from ampgraph.cli.inspect import inspect_module

    cfg = tf.LlamaConfig(hidden_size=256, intermediate_size=512, num_hidden_layers=4,
                         num_attention_heads=4, num_key_value_heads=2, vocab_size=512)
    torch.manual_seed(0)
    model = tf.LlamaForCausalLM(cfg).eval()
    ids = torch.randint(0, 512, (2, 32))
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        insp = inspect_module("hf:llama-fp8", model, (ids,), "O2", "bf16", False,
                              fp8=ampgraph.FP8Recipe(rule="all"))
    return insp, model, (ids,)


def visible_tree(page: Page) -> dict[str, Any]:
    """Where the tree's entries and folds are, in viewport pixels, right after loading."""
    return page.eval("""(function(){
      var rows=Array.from(document.querySelectorAll('#tree .entry')).filter(function(e){
        return e.offsetParent!==null; });
      return {height: window.innerHeight, scrolled: window.scrollY,
        entries: rows.map(function(e){ var r=e.getBoundingClientRect();
          return {path: e.getAttribute('data-path'), fold: e.classList.contains('fold'),
                  name: e.querySelector('.nm').textContent, bottom: r.bottom}; })};
    })()""")


def open_block_ops(page: Page, fold_index: int, member: int) -> list[str]:
    """Two clicks: open the ``fold_index``-th folded entry, then its ``member``-th block's
    ops; the names of the rows the opened table shows."""
    return page.eval(f"""(function(){{
      var fold=document.querySelectorAll('#tree .entry.fold')[{fold_index}];
      fold.querySelector('.tog').click();
      var li=fold.parentNode, block=li.querySelectorAll(':scope>ul>li')[{member}];
      block.querySelector('.entry button[data-open=ops]').click();
      return Array.from(block.querySelectorAll('table.nodes tbody tr')).map(function(tr){{
        return tr.firstChild.textContent; }});
    }})()""")


def check_page(page: Page, html: Path, shots: Path | None, name: str) -> dict[str, Any]:
    """Load ``html`` and run every check; the findings as a dict (``problems`` empty when
    all hold)."""
    t0 = time.perf_counter()
    page.open(html)
    load_s = time.perf_counter() - t0
    problems: list[str] = []
    if not page.eval("window.ampgraphReady === true"):
        problems.append("the page's script did not finish")
    tree = visible_tree(page)
    folds = [e for e in tree["entries"] if e["fold"]]
    if not folds:
        problems.append("no folded block in the tree")
    low = [e["name"] for e in tree["entries"] if e["bottom"] > tree["height"]]
    if folds and any(f["bottom"] > tree["height"] for f in folds):
        problems.append(f"a folded block is below the first screen: {folds}")
    if shots:
        page.screenshot(shots / f"{name}.png")
    data = json.loads(page.eval("document.getElementById('amp-data').textContent"))
    ops = {}
    if folds:
        names = open_block_ops(page, 0, 1)
        path = page.eval("document.querySelectorAll('#tree .entry.fold')[0].parentNode"
                         ".querySelectorAll(':scope>ul>li')[1].firstChild"
                         ".getAttribute('data-path')")
        strings = data["s"]
        want = [r[0] for r in data["rows"] if r[6] == 0 and (
            strings[r[2]] == path or strings[r[2]].startswith(path + "."))]
        ops = {"block": path, "rows": len(names)}
        if not names or names != want:
            problems.append(f"the ops of {path} after two clicks: {names[:5]}.. != {want[:5]}..")
    graph = page.eval("""(function(){
      var b=document.querySelector('#tree .entry button[data-open=graph]'); b.click();
      return new Promise(function(done){ setTimeout(function(){
        var box=document.querySelector('.panel .graph'), svg=box.querySelector('svg');
        var shown=svg.querySelectorAll('g.node').length, width=svg.getBoundingClientRect().width;
        box.parentNode.querySelector('input[type=checkbox]').click();
        var all=box.querySelector('svg').querySelectorAll('g.node').length;
        done({shown: shown, all: all, width: width, box: box.clientWidth});
      }, 50); });
    })()""")
    if not 0 < graph["shown"] < graph["all"] or not 0 < graph["width"] <= graph["box"] + 1:
        problems.append(f"the model's graph: {graph}")
    chip = page.eval("""(function(){
      var b=document.querySelector('.legend button[data-p=fp32]');
      var rows=function(){ return Array.from(document.querySelectorAll(
        'table.nodes tbody tr[data-p=fp32]')).filter(function(tr){
          return tr.style.display!=='none'; }).length; };
      var before=rows(); b.click(); var after=rows(); b.click();
      return {before: before, after: after, again: rows()};
    })()""")
    if not (chip["before"] > 0 and chip["after"] == 0 and chip["again"] == chip["before"]):
        problems.append(f"the fp32 chip does not filter the rows: {chip}")
    if shots:
        page.eval("document.querySelector('.panel .graph').scrollIntoView()")
        page.screenshot(shots / f"{name}_graph.png")
    problems += [f"console: {e}" for e in page.errors()]
    problems += [f"request: {u}" for u in page.external_requests()]
    return {"page": name, "bytes": html.stat().st_size, "load_s": round(load_s, 2),
            "folds": [f["name"] for f in folds], "below_first_screen": low, "ops": ops,
            "graph": graph, "chip": chip, "problems": problems}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", type=Path, default=None, help="folder for the screenshots")
    args = ap.parse_args(argv)
    if find_browser() is None:
        print("no Chromium found: apt-get install chromium")
        return 2
    from ampgraph.cli.html_report import to_html

    work = Path(tempfile.mkdtemp(prefix="ampgraph-report-"))
    if args.out:
        args.out.mkdir(parents=True, exist_ok=True)
    pages = {"bert12": bert12_report(), "llama_fp8": fp8_llama_report()[0]}
    failed = 0
    with Page(*VIEW) as page:
        for name, insp in pages.items():
            html = work / f"{name}.html"
            html.write_text(to_html(insp), encoding="utf-8")
            found = check_page(page, html, args.out, name)
            failed += bool(found["problems"])
            print(json.dumps(found))
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
