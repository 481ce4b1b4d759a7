"""The benchmark harness: workload parsing, aggregation, outputs; and one real run."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from srsd_local.bench import (
    BUILTIN_WORKLOADS,
    RunRecord,
    load_workload,
    parse_modes,
    summarise,
    table,
    write_doc,
)


def test_builtin_workloads_load_with_provenance_fields():
    for name in BUILTIN_WORKLOADS:
        prompts = load_workload(name)
        assert len(prompts) == 8 and all(p.category == name for p in prompts)
        assert len({p.id for p in prompts}) == 8
    assert all(p.temperature > 0 and p.seed is not None for p in load_workload("open"))
    assert len(load_workload("all")) == 40


@pytest.mark.parametrize("line,msg", [
    ("{not json", "line 2: not valid JSON"),
    ('{"id": "a", "category": "c", "prompt": "p"}', "line 2: missing 'max_tokens'"),
    ('{"id": "a", "category": "c", "prompt": "p", "max_tokens": "9"}', "must be a int"),
    ('{"id": "a", "category": "c", "prompt": "p", "max_tokens": 0}', ">= 1"),
    ('{"id": "a", "category": "c", "prompt": "p", "max_tokens": 9, "temperature": -1}',
     "temperature"),
    ("[1, 2]", "expected an object"),
])
def test_bad_workload_lines_name_the_line(tmp_path, line, msg):
    f = tmp_path / "w.jsonl"
    f.write_text('{"id": "ok", "category": "c", "prompt": "p", "max_tokens": 4}\n' + line + "\n")
    with pytest.raises(ValueError, match=msg):
        load_workload(str(f))
    with pytest.raises(ValueError, match="accepted are"):
        load_workload("no_such_workload")


def test_parse_modes():
    assert parse_modes("srsd,pld") == ["ar", "srsd", "pld"]
    assert parse_modes("ar,lcp-pld") == ["ar", "lcp-pld"]
    with pytest.raises(ValueError, match="accepted are"):
        parse_modes("srsd,warp")


def _rec(cat, mode, tokens, seconds, steps, same=None, acc=(), pred=()):
    return RunRecord("p", cat, mode, 0, tokens, seconds, steps, draft_tokens=10,
                     accepted_tokens=sum(acc), accepted_per_depth=list(acc),
                     predicted_per_depth=list(pred), drafts=len(acc) and 5,
                     identical_to_ar=same)


def test_summary_uses_ratios_of_totals():
    recs = [_rec("a", "ar", 100, 1.0, 100), _rec("a", "srsd", 100, 0.5, 40, True, (4, 2), (4, 3)),
            _rec("b", "ar", 100, 3.0, 100), _rec("b", "srsd", 100, 1.0, 50, False)]
    s = summarise(recs, ["ar", "srsd"])
    assert s["modes"]["srsd"]["speedup_vs_ar"] == pytest.approx((200 / 1.5) / (200 / 4.0))
    assert s["categories"]["a"]["srsd"]["speedup_vs_ar"] == pytest.approx(2.0)
    assert s["modes"]["srsd"]["identical_to_ar"] == (1, 2)
    assert s["modes"]["srsd"]["mean_accepted_length"] == pytest.approx(200 / 90)
    assert s["categories"]["a"]["srsd"]["accepted_rate_per_depth"] == [0.8, 0.4]
    assert s["categories"]["a"]["srsd"]["predicted_rate_per_depth"] == [0.8, 0.6]
    t = table(s, ["ar", "srsd"])
    assert "| overall | srsd |" in t and "1/2" in t


def test_write_doc_replaces_only_its_section(tmp_path):
    doc = tmp_path / "b.md"
    doc.write_text("# Benchmarks\n\nintro\n")
    write_doc(str(doc), "CPU", "table one")
    write_doc(str(doc), "GPU", "gpu table")
    write_doc(str(doc), "CPU", "table two")
    text = doc.read_text()
    assert "intro" in text and "table two" in text and "gpu table" in text
    assert "table one" not in text and text.count("<!-- bench:CPU -->") == 1


@pytest.mark.model
def test_real_bench_run_writes_table_json_plot_and_doc(tmp_path):
    w = tmp_path / "w.jsonl"
    w.write_text(json.dumps({"id": "x", "category": "code_edit", "max_tokens": 24,
                             "prompt": "a = [1, 2, 3]\nb = [1, 2, 3]\nc = [1, 2,"}) + "\n")
    out, png, doc = tmp_path / "r.json", tmp_path / "r.png", tmp_path / "b.md"
    proc = subprocess.run([sys.executable, "-m", "srsd_local.cli", "bench", "--workload",
                           str(w), "--modes", "ar,srsd,lcp-pld", "--json", str(out), "--plot",
                           str(png), "--doc", str(doc), "--label", "test"],
                          capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert "| overall | srsd |" in proc.stdout and "| overall | lcp-pld |" in proc.stdout
    data = json.loads(out.read_text())
    for m in ("ar", "srsd", "lcp-pld"):
        assert {"tokens", "seconds", "tokens_per_second", "speedup_vs_ar",
                "mean_accepted_length"} <= set(data["modes"][m])
        assert data["modes"][m]["tokens"] == 24
    assert data["modes"]["ar"]["speedup_vs_ar"] == 1.0
    assert data["categories"]["code_edit"]["srsd"]["tokens"] == 24
    assert data["machine"]["cores"] >= 1 and len(data["prompts"]) == 3
    assert png.stat().st_size > 10_000 and png.read_bytes()[:4] == b"\x89PNG"
    assert "<!-- bench:test -->" in doc.read_text()
