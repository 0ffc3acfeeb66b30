"""README snippets run verbatim (the ones that need no GPU and no peer)."""

from __future__ import annotations

import gc
import re
from pathlib import Path

from .conftest import tensorxfer_mappings

README = Path(__file__).resolve().parent.parent / "README.md"


def python_blocks(section: str) -> list[str]:
    text = README.read_text()
    start = text.index(f"\n## {section}\n")
    end = text.find("\n## ", start + 1)
    return re.findall(r"```python\n(.*?)```", text[start:end if end != -1 else len(text)], re.S)


def test_first_snippet_under_using_it_runs_verbatim():
    # it leaves the `with` block while `views` still references the region's memory:
    # that must neither raise nor free the memory under the views
    before = len(tensorxfer_mappings())
    code = python_blocks("Using it")[0]
    assert "region.tensors()" in code and "with tx.TensorRegion.from_tensors(weights) as region" in code
    ns: dict = {}
    exec(compile(code, str(README), "exec"), ns)
    region, views, weights = ns["region"], ns["views"], ns["weights"]
    assert region.closed and not region.region.released
    assert all((views[k] == weights[k]).all() for k in weights)      # update_from(weights) landed in the views
    assert ns["layout"].names == ("embed", "norm")
    del region, views, weights
    ns.clear()
    gc.collect()
    assert len(tensorxfer_mappings()) == before


def test_staging_and_handles_snippet_runs_verbatim():
    before = len(tensorxfer_mappings())
    code = python_blocks("Using it")[1]
    assert "read_pieces" in code and "export_handles" in code
    ns: dict = {}
    exec(compile(code, str(README), "exec"), ns)
    assert ns["src"].closed and ns["dst"].closed
    ns.clear()
    gc.collect()
    assert len(tensorxfer_mappings()) == before
