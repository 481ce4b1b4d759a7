"""The benchmark harness: workloads, aggregation through GenerationStats.merge, the llama-server
peer (response parsing, command line, lifecycle against a stand-in binary, missing binary), the
runner on a fake engine, outputs; and real runs on the default model."""

from __future__ import annotations

import json
import os
import stat
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest

from srsd_local.bench import peers as peers_mod
from srsd_local.bench.peers import (
    SERVER_MODES,
    LlamaServerPeer,
    PeerResult,
    PeerSettings,
    _model_params,
    completion_request,
    display_command,
    parse_completion,
    server_command,
    start_peers,
)
from srsd_local.bench.report import RunRecord, aggregate, summarise, table, write_doc
from srsd_local.bench.runner import main_bench, parse_modes, run_bench
from srsd_local.bench.workloads import (
    BUILTIN_WORKLOADS,
    BenchPrompt,
    first_per_category,
    load_workload,
)
from srsd_local.config import SRSDConfig
from srsd_local.engine import GenerationResult, GenerationStats

# A /completion response of llama-server (the llama.cpp vendored in llama-cpp-python 0.3.36,
# built by scripts/build_llama_server.sh, `--spec-default`, the default model, the first
# code_edit prompt with n_predict 40, greedy, on a busy 2-core machine), recorded with the
# request of `completion_request`; `generation_settings` and the echoed `prompt` left out.
RECORDED_COMPLETION = {
    "index": 0,
    "content": "def dedent(text):\n    \"\"\"Remove any common leading whitespace from every "
               "line in `text`.\n\n    This can be used to make triple-quoted strings line up "
               "with the left\n    ",
    "tokens": [2063, 5687, 533, 236769, 1005, 1473, 107, 140, 12234, 21848, 1027, 3364, 5830,
               118364, 699, 1418, 1757, 528, 2165, 1005, 21233, 108, 140, 2094, 740, 577, 1456,
               531, 1386, 22178, 236772, 148758, 16587, 1757, 872, 607, 506, 2378, 107, 140],
    "id_slot": 0, "stop": True, "model": "models/gemma-3-270m-q4_k_m.gguf",
    "tokens_predicted": 40, "tokens_evaluated": 463, "has_new_line": True, "truncated": False,
    "stop_type": "limit", "stopping_word": "", "tokens_cached": 502,
    "timings": {"cache_n": 0, "prompt_n": 463, "prompt_ms": 2076.394,
                "prompt_per_token_ms": 4.484652267818574, "prompt_per_second": 222.9827287114103,
                "predicted_n": 40, "predicted_ms": 2448.094,
                "predicted_per_token_ms": 62.771641025641024,
                "predicted_per_second": 15.930760828628312, "draft_n": 19,
                "draft_n_accepted": 19},
}


# -- workloads ---------------------------------------------------------------------------------
def test_builtin_workloads_load_with_provenance_fields():
    for name in BUILTIN_WORKLOADS:
        prompts = load_workload(name)
        assert len(prompts) == 8 and all(p.category == name for p in prompts)
        assert len({p.id for p in prompts}) == 8
    assert all(p.temperature > 0 and p.seed is not None for p in load_workload("open"))
    assert len(load_workload("all")) == 48
    assert all(p.json_schema is not None for p in load_workload("json"))


def test_calibration_is_a_named_workload_but_never_part_of_all():
    calib = load_workload("calibration")
    assert len(calib) == 22 and all(p.id.startswith("calib-") for p in calib)
    assert {p.category for p in calib} == set(BUILTIN_WORKLOADS)
    # the json prompts carry their schema, so seeding constrains them as the bench does
    assert all(p.json_schema is not None for p in calib if p.category == "json")
    everything = load_workload("all")
    assert not {p.id for p in calib} & {p.id for p in everything}
    assert not {p.prompt for p in calib} & {p.prompt for p in everything}


@pytest.mark.parametrize("line,msg", [
    ("{not json", "line 2: not valid JSON"),
    ('{"id": "a", "category": "c", "prompt": "p"}', "line 2: missing 'max_tokens'"),
    ('{"id": "a", "category": "c", "prompt": "p", "max_tokens": "9"}', "must be an integer"),
    ('{"id": 7, "category": "c", "prompt": "p", "max_tokens": 9}', "'id' must be a string"),
    ('{"id": "a", "category": "c", "prompt": "p", "max_tokens": true}', "must be an integer"),
    ('{"id": "a", "category": "c", "prompt": "p", "max_tokens": 0}', ">= 1"),
    ('{"id": "a", "category": "c", "prompt": "p", "max_tokens": 9, "temperature": -1}',
     "temperature"),
    ('{"id": "a", "category": "c", "prompt": "p", "max_tokens": 9, "seed": -3}', "seed"),
    ("[1, 2]", "expected an object"),
])
def test_bad_workload_lines_name_the_line(tmp_path, line, msg):
    f = tmp_path / "w.jsonl"
    f.write_text('{"id": "ok", "category": "c", "prompt": "p", "max_tokens": 4}\n' + line + "\n")
    with pytest.raises(ValueError, match=msg):
        load_workload(str(f))


def test_unknown_and_empty_workloads_say_what_is_accepted(tmp_path):
    with pytest.raises(ValueError, match="accepted are .*calibration, all"):
        load_workload("no_such_workload")
    empty = tmp_path / "e.jsonl"
    empty.write_text("\n  \n")
    with pytest.raises(ValueError, match="no prompts"):
        load_workload(str(empty))


def test_a_jsonl_file_parses_with_defaults(tmp_path):
    f = tmp_path / "w.jsonl"
    f.write_text('{"id": "a", "category": "c", "prompt": "p", "max_tokens": 4}\n\n'
                 '{"id": "b", "category": "c", "prompt": "q", "max_tokens": 5, '
                 '"temperature": 1, "seed": 3}\n')
    a, b = load_workload(str(f))
    assert a == BenchPrompt("a", "c", "p", 4, 0.0, None)
    assert b.temperature == 1.0 and isinstance(b.temperature, float) and b.seed == 3


def test_first_per_category_keeps_file_order():
    ps = [BenchPrompt(f"{c}{i}", c, "x", 1) for c in "ab" for i in range(3)]
    assert [p.id for p in first_per_category(ps, 2)] == ["a0", "a1", "b0", "b1"]
    assert first_per_category(ps, None) == ps


def test_parse_modes():
    assert parse_modes("srsd,pld") == ["ar", "srsd", "pld"]
    assert parse_modes("ar,lcp-pld") == ["ar", "lcp-pld"]
    assert parse_modes("llama-server-spec, srsd,srsd") == ["ar", "llama-server-spec", "srsd"]
    with pytest.raises(ValueError, match="accepted are"):
        parse_modes("srsd,warp")


# -- aggregation -------------------------------------------------------------------------------
def _stats(mode: str, tokens: int, seconds: float, steps: list[tuple[int, int, int]],
           host: float = 0.001) -> GenerationStats:
    """Stats built the engine's way: one observe_step per (decoded, drafted, accepted)."""
    s = GenerationStats(mode=mode, tokens=tokens, seconds=seconds)
    for decoded, drafted, accepted in steps:
        s.observe_step(decoded, accepted, drafted=drafted, forecast=[0.5] * drafted,
                       forecast_depths=list(range(1, drafted + 1)), verify=seconds / 10,
                       host=host * (2 if drafted else 1))
    return s


def test_a_plain_step_observed_by_its_fast_path_counts_as_observe_step_counts_it():
    a, b = GenerationStats(mode="srsd"), GenerationStats(mode="srsd")
    for s in (a, b):
        s.observe_step(5, 3, drafted=4, forecast=[0.9, 0.8, 0.5, 0.2],
                       forecast_depths=[1, 2, 3, 4], draft=0.001, host=0.002)
    a.observe_step(1, 0, draft=0.0004, verify=0.01, index=0.0002, host=0.0007)
    b.observe_plain(0.0004, 0.01, 0.0002, 0.0007)
    assert a.to_dict() == b.to_dict()
    assert b.host_ms_plain == pytest.approx(0.7) and b.mean_accepted_length == 0.0


def test_a_run_of_plain_steps_counts_as_that_many_plain_steps():
    # k plain steps decoded in one call: k steps of one token each, their host time shared
    a, b = GenerationStats(mode="ar"), GenerationStats(mode="ar")
    for _ in range(8):
        a.observe_plain(0.0, 0.01, 0.0, 0.0001)
    b.observe_plain(0.0, 0.08, 0.0, 0.0008, 8)
    assert a.steps == b.steps == 8 and a.tokens_per_step == b.tokens_per_step == [1] * 8
    assert a.tree_sizes == b.tree_sizes and b.host_ms_plain == pytest.approx(0.1)
    assert b.time_verify == pytest.approx(a.time_verify)


def test_host_per_tree_of_9_to_16_nodes_counts_only_those_trees():
    s = GenerationStats(mode="srsd")
    for decoded, host in ((5, 0.002), (9, 0.003), (16, 0.005), (17, 0.009), (40, 0.02)):
        s.observe_step(decoded, 2, drafted=decoded - 1, host=host)
    s.observe_plain(0.0, 0.01, 0.0, 0.0007)
    assert (s.trees16, s.drafts) == (2, 5)
    assert s.host_ms_tree16 == pytest.approx(4.0) and s.host_ms_tree == pytest.approx(7.8)
    assert GenerationStats(mode="srsd").host_ms_tree16 == 0.0
    total = GenerationStats.total([s, s], mode="srsd")
    assert total.trees16 == 4 and total.host_ms_tree16 == pytest.approx(4.0)
    assert aggregate([_rec("a", "srsd", s)], "srsd")["host_ms_tree16"] == pytest.approx(4.0)
    assert aggregate([_rec("a", "ar", _stats("ar", 10, 1.0, [(1, 0, 0)] * 10))],
                     "ar")["host_ms_tree16"] is None


def _rec(cat: str, mode: str, stats: GenerationStats, same: bool | None = None,
         peer: bool = False) -> RunRecord:
    return RunRecord("p", cat, mode, 0, stats, [], same, peer)


def _records() -> list[RunRecord]:
    return [
        _rec("a", "ar", _stats("ar", 100, 1.0, [(1, 0, 0)] * 100)),
        _rec("a", "srsd", _stats("srsd", 100, 0.5, [(1, 0, 0)] * 20 + [(5, 4, 4)] * 20), True),
        _rec("b", "ar", _stats("ar", 100, 3.0, [(1, 0, 0)] * 100)),
        _rec("b", "srsd", _stats("srsd", 100, 1.0, [(1, 0, 0)] * 40 + [(3, 2, 1)] * 30), False),
        _rec("a", "llama-server-spec", PeerResult(100, 0.8, None, 40, 30).to_stats(
            "llama-server-spec"), peer=True),
        _rec("b", "llama-server-spec", PeerResult(100, 2.0, None, 10, 5).to_stats(
            "llama-server-spec"), peer=True),
    ]


def test_aggregate_totals_are_generation_stats_merge(monkeypatch):
    merged: list[str] = []
    original = GenerationStats.merge

    def spy(self, other):
        merged.append(other.mode)
        return original(self, other)

    monkeypatch.setattr(GenerationStats, "merge", spy)
    recs = [r for r in _records() if r.mode == "srsd"]
    a = aggregate(recs, "srsd")
    assert merged == ["srsd", "srsd"]  # one merge per run, nothing summed by hand
    monkeypatch.setattr(GenerationStats, "merge", original)
    total = GenerationStats.total([r.stats for r in recs], mode="srsd")
    assert (a["tokens"], a["seconds"], a["steps"]) == (total.tokens, total.seconds, total.steps)
    assert a["acceptance_rate"] == pytest.approx(total.acceptance_rate) == pytest.approx(
        (80 + 30) / (80 + 60))
    assert a["mean_accepted_length"] == pytest.approx(200 / 110)
    assert a["host_ms_plain"] == pytest.approx(1.0) and a["host_ms_tree"] == pytest.approx(2.0)
    assert a["accepted_per_depth"] == total.accepted_per_depth == [50, 20, 20, 20]
    assert a["accepted_rate_per_depth"] == pytest.approx([1.0, 0.4, 0.4, 0.4])
    assert a["predicted_rate_per_depth"] == pytest.approx([0.5, 0.5, 0.2, 0.2])
    assert a["identical_to_ar"] == (1, 2)


def test_summary_uses_ratios_of_totals_and_the_spec_peer_column():
    s = summarise(_records(), ["ar", "srsd", "llama-server-spec"])
    o = s["modes"]
    assert o["srsd"]["speedup_vs_ar"] == pytest.approx((200 / 1.5) / (200 / 4.0))
    assert s["categories"]["a"]["srsd"]["speedup_vs_ar"] == pytest.approx(2.0)
    assert o["srsd"]["speedup_vs_llama_server_spec"] == pytest.approx((200 / 1.5) / (200 / 2.8))
    assert o["llama-server-spec"]["speedup_vs_llama_server_spec"] == pytest.approx(1.0)
    peer = o["llama-server-spec"]
    assert peer["peer"] and peer["acceptance_rate"] == pytest.approx(35 / 50)
    assert peer["mean_accepted_length"] is None and peer["host_ms_plain"] is None
    assert peer["share_verify"] is None and o["ar"]["acceptance_rate"] is None
    assert len(s["prompts"]) == 6 and s["prompts"][0]["stats"]["tokens"] == 100
    json.dumps(s)  # the --json output


def test_table_columns_follow_the_modes_that_ran():
    modes = ["ar", "srsd", "llama-server-spec"]
    t = table(summarise(_records(), modes), modes)
    head = t.splitlines()[0]
    assert "speedup vs llama-server-spec" in head and "host ms / tree" in head
    assert "host ms / 9-16-node tree" in head
    assert "| overall | srsd | 133.3 | 2.67x | 1.87x | 1.82 | 79% | 1.000 | 2.000 | - | 1/2 |" in t
    assert "| overall | llama-server-spec | 71.4 | 1.43x | 1.00x | - | 70% | - | - | - | - |" in t
    plain = table(summarise(_records()[:4], ["ar", "srsd"]), ["ar", "srsd"])
    assert "llama-server-spec" not in plain and "| a | ar | 100.0 | 1.00x |" in plain


def test_write_doc_replaces_only_its_section(tmp_path):
    doc = tmp_path / "b.md"
    doc.write_text("# Benchmarks\n\nintro\n")
    write_doc(str(doc), "CPU", "table one")
    write_doc(str(doc), "GPU", "gpu table")
    write_doc(str(doc), "CPU", "table two")
    text = doc.read_text()
    assert "intro" in text and "table two" in text and "gpu table" in text
    assert "table one" not in text and text.count("<!-- bench:CPU -->") == 1


# -- llama-server peer -------------------------------------------------------------------------
def test_parse_completion_reads_timings_and_tokens():
    r = parse_completion(RECORDED_COMPLETION)
    assert (r.tokens, r.draft_n, r.draft_n_accepted, r.prompt_tokens) == (40, 19, 19, 463)
    assert r.seconds == pytest.approx(2.448094) and r.prompt_seconds == pytest.approx(2.076394)
    assert r.token_ids == RECORDED_COMPLETION["tokens"]
    s = r.to_stats("llama-server-spec")
    assert (s.tokens, s.draft_tokens, s.accepted_tokens, s.steps) == (40, 19, 19, 0)
    assert s.acceptance_rate == 1.0 and s.tokens_per_second == pytest.approx(40 / 2.448094)


def test_parse_completion_drops_the_end_token_and_odd_token_lists():
    eos = {**RECORDED_COMPLETION, "stop_type": "eos"}
    r = parse_completion(eos)
    assert r.tokens == 39 and r.token_ids == RECORDED_COMPLETION["tokens"][:-1]
    plain = {**RECORDED_COMPLETION, "tokens": [],
             "timings": {"predicted_n": 40, "predicted_ms": 100.0}}
    r = parse_completion(plain)  # no tokens returned, no drafting
    assert r.token_ids is None and (r.draft_n, r.draft_n_accepted) == (0, 0)
    with pytest.raises(ValueError, match="predicted_n"):
        parse_completion({"content": "x", "timings": {"predicted_ms": 1.0}})


def test_completion_request_is_raw_uncached_and_returns_tokens():
    body = completion_request(BenchPrompt("i", "c", "<start_of_turn>x", 7, 0.8, 11))
    assert body["prompt"] == "<start_of_turn>x" and body["n_predict"] == 7
    assert body["cache_prompt"] is False and body["return_tokens"] is True
    assert (body["temperature"], body["seed"], body["top_k"], body["top_p"]) == (0.8, 11, 0, 1.0)
    assert "seed" not in completion_request(BenchPrompt("i", "c", "x", 7))


def test_llama_cpp_python_peer_loads_weights_as_the_engine_does():
    """The lcp-pld peer's `Llama` starts from llama.cpp's default model parameters: without
    repacking, those come with extra buffer types off while it loads, and as before after."""
    import llama_cpp.llama_cpp as lib

    default = lib.llama_model_default_params
    assert default().use_extra_bufts
    with _model_params(False):
        assert not lib.llama_model_default_params().use_extra_bufts
    assert lib.llama_model_default_params is default
    with _model_params(True):
        assert lib.llama_model_default_params is default
    with pytest.raises(RuntimeError), _model_params(False):
        raise RuntimeError("a load that fails")
    assert lib.llama_model_default_params is default


def test_server_command_mirrors_the_engine():
    s = PeerSettings("/m/model.gguf", 4096, 3, -1, 512, 256)
    cmd = server_command("/bin/llama-server", "llama-server-spec", s, 8123)
    flat = " ".join(cmd)
    for part in ("--model /m/model.gguf", "--threads 3", "--threads-batch 3", "--ctx-size 4096",
                 "--ubatch-size 256", "--n-gpu-layers all", "--parallel 1", "--port 8123"):
        assert part in flat
    assert cmd[-1] == "--spec-default"
    ngram = server_command("x", "llama-server-ngram-simple", PeerSettings("m", 64, 1, 0), 1)
    assert ngram[-2:] == ["--spec-type", "ngram-simple"] and "--n-gpu-layers 0" in " ".join(ngram)
    assert not {"--spec-default", "--spec-type"} & set(server_command("x", "llama-server", s, 1))
    assert display_command(cmd) == ("llama-server --model model.gguf --threads 3 --threads-batch"
                                     " 3 --ctx-size 4096 --batch-size 512 --ubatch-size 256 "
                                     "--n-gpu-layers all --fit off --swa-full --parallel 1 "
                                     "--cache-ram 0 --no-webui --spec-default")
    assert "--no-repack" not in cmd  # the engine repacks: so does the peer
    norepack = server_command("x", "llama-server-spec",
                              PeerSettings("m", 64, 1, 0, repack=False), 1)
    assert norepack[-2:] == ["--no-repack", "--spec-default"]
    with pytest.raises(ValueError, match="accepted are"):
        server_command("x", "lcp-pld", s, 1)


def test_missing_binary_skips_server_modes_and_says_how_to_build(tmp_path):
    warnings: list[str] = []
    started: list[str] = []
    modes, peers = start_peers(
        ["ar", "srsd", "lcp-pld", "llama-server", "llama-server-spec"],
        PeerSettings("m.gguf", 512, 1, 0), tmp_path / "nope" / "llama-server",
        warn=warnings.append, make_server=lambda *a: started.append(a[0]),
        make_lcp=lambda s: SimpleNamespace(run=None, close=lambda: None),
        make_loop=lambda s: started.append("c-loop"))
    assert modes == ["ar", "srsd", "lcp-pld"] and list(peers) == ["lcp-pld"] and not started
    assert len(warnings) == 1 and "scripts/build_llama_server.sh" in warnings[0]
    assert "llama-server, llama-server-spec" in warnings[0]


def test_server_modes_without_httpx_are_skipped_with_a_message(tmp_path, monkeypatch):
    binary = tmp_path / "llama-server"
    binary.write_text("#!/bin/sh\n")
    binary.chmod(0o755)
    real = peers_mod.importlib.util.find_spec
    monkeypatch.setattr(peers_mod.importlib.util, "find_spec",
                        lambda name, *a: None if name == "httpx" else real(name, *a))
    warnings: list[str] = []
    modes, peers = start_peers(["ar", "llama-server"], PeerSettings("m", 64, 1, 0), binary,
                               warn=warnings.append)
    assert modes == ["ar"] and peers == {} and "pip install httpx" in warnings[0]


def test_default_binary_lives_in_the_cache_per_version(monkeypatch, tmp_path):
    monkeypatch.setenv("SRSD_CACHE_DIR", str(tmp_path))
    assert peers_mod.default_llama_server("9.9.9") == tmp_path / "llama-server" / "9.9.9" / \
        "llama-server"


def test_start_peers_closes_what_it_started_when_one_fails(tmp_path):
    binary = tmp_path / "llama-server"
    binary.write_text("#!/bin/sh\n")
    binary.chmod(0o755)
    closed: list[str] = []

    def make_server(mode, _binary, _settings):
        if mode == "llama-server-spec":
            raise RuntimeError("no port")
        return SimpleNamespace(close=lambda: closed.append(mode))

    with pytest.raises(RuntimeError, match="no port"):
        start_peers(["ar", "llama-server", "llama-server-spec"], PeerSettings("m", 64, 1, 0),
                    binary, make_server=make_server)
    assert closed == ["llama-server"]


_STAND_IN = '''\
import json, sys
from http.server import BaseHTTPRequestHandler, HTTPServer
args = sys.argv[1:]
if "--fail" in " ".join(args) or "--spec-type" in args:
    print("error: unknown argument", flush=True)
    sys.exit(3)
port = int(args[args.index("--port") + 1])
sample = json.loads(%r)

class H(BaseHTTPRequestHandler):
    def log_message(self, *a):
        pass

    def _send(self, code, obj):
        data = json.dumps(obj).encode()
        self.send_response(code)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)

    def do_GET(self):
        self._send(200 if self.path == "/health" else 404, {"status": "ok"})

    def do_POST(self):
        body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
        out = dict(sample, tokens=sample["tokens"][: body["n_predict"]])
        out["timings"] = dict(sample["timings"], predicted_n=len(out["tokens"]))
        out["echo"] = body
        self._send(200, out)

HTTPServer(("127.0.0.1", port), H).serve_forever()
'''


def _stand_in_binary(tmp_path: Path) -> Path:
    """An executable that answers like llama-server (/health, /completion) for this test."""
    exe = tmp_path / "llama-server"
    exe.write_text(f"#!{sys.executable}\n" + _STAND_IN % json.dumps(RECORDED_COMPLETION))
    exe.chmod(exe.stat().st_mode | stat.S_IXUSR)
    return exe


def test_server_peer_starts_runs_and_stops_a_server(tmp_path):
    exe = _stand_in_binary(tmp_path)
    peer = LlamaServerPeer("llama-server-spec", exe, PeerSettings("m.gguf", 256, 1, 0),
                           startup_timeout=30)
    try:
        res = peer.run(BenchPrompt("i", "c", "a = [1, 2, 3]", 10))
        assert res.tokens == 10 and res.token_ids == RECORDED_COMPLETION["tokens"][:10]
        assert res.draft_n == 19 and peer.proc.poll() is None
    finally:
        peer.close()
    assert peer.proc.poll() is not None and not Path(peer._log.name).exists()


def test_server_peer_that_cannot_start_reports_its_log(tmp_path):
    exe = _stand_in_binary(tmp_path)
    with pytest.raises(RuntimeError, match="exited with status 3:\n.*unknown argument"):
        LlamaServerPeer("llama-server-ngram-simple", exe, PeerSettings("m", 64, 1, 0),
                        startup_timeout=30)


# -- the runner on a fake engine ---------------------------------------------------------------
class FakeEngine:
    """The public Engine surface the benchmark uses, nothing else (no `backend`)."""

    model_path = "/models/fake.gguf"
    model_name = "fake"
    n_ctx = 512
    index_backend = "numpy"

    def __init__(self, fail_mode: str | None = None) -> None:
        self.config = SRSDConfig(n_threads=1)
        self.calls: list[tuple[str, str, int]] = []
        self.fail_mode = fail_mode
        self.closed = False

    def forget_outputs(self) -> None:
        self.calls.append(("forget", "", 0))

    def generate(self, prompt, *, max_tokens, temperature, seed, mode):
        assert self.calls and self.calls[-1][0] == "forget", "a run after another's outputs"
        self.calls.append((prompt, mode, max_tokens))
        if mode == self.fail_mode:
            raise RuntimeError("decode failed")
        ids = [7] * max_tokens
        if mode == "pld":
            ids[-1] = 8
        stats = _stats(mode, max_tokens, 0.01 * max_tokens, [(1, 0, 0)] * max_tokens)
        return GenerationResult("", ids, "length", stats)

    def close(self) -> None:
        self.closed = True


class FakePeer:
    def __init__(self, ids: list[int] | None) -> None:
        self.ids, self.runs = ids, []

    def run(self, p: BenchPrompt) -> PeerResult:
        self.runs.append(p.id)
        ids = None if self.ids is None else self.ids * p.max_tokens
        return PeerResult(p.max_tokens, 0.001 * p.max_tokens, ids, 4, 3)

    def close(self) -> None:
        pass


def test_run_bench_interleaves_modes_warms_up_and_compares_greedy_tokens():
    eng = FakeEngine()
    prompts = [BenchPrompt("g", "c", "P1", 20), BenchPrompt("s", "c", "P2", 20, 0.8, 1)]
    peers = {"llama-server": FakePeer([7]), "llama-server-spec": FakePeer(None)}
    modes = ["ar", "pld", "llama-server", "llama-server-spec"]
    recs = run_bench(eng, prompts, modes, repeats=1, peers=peers, progress=False)
    assert [(c[1], c[2]) for c in eng.calls if c[0] != "forget"] == [
        ("ar", 16), ("pld", 16), ("ar", 20), ("pld", 20), ("ar", 20), ("pld", 20)]
    assert peers["llama-server"].runs == ["warm-up", "g", "s"]
    assert [(r.prompt_id, r.mode) for r in recs] == [(p.id, m) for p in prompts for m in modes]
    same = {(r.prompt_id, r.mode): r.identical_to_ar for r in recs}
    assert same[("g", "pld")] is False and same[("g", "llama-server")] is True
    assert same[("g", "llama-server-spec")] is None  # no tokens returned
    assert same[("s", "llama-server")] is None  # sampled: not compared
    assert all(r.peer == (r.mode in SERVER_MODES) for r in recs)
    with pytest.raises(ValueError, match="no peer started for lcp-pld"):
        run_bench(eng, prompts, ["ar", "lcp-pld"], progress=False)


class ReplayEngine(FakeEngine):
    """Replays report host times of 0.1 ms (ar) or 0.25 ms per plain step, twice that per
    tree (ar's replays have none)."""

    def __init__(self) -> None:
        super().__init__()
        self.replays: list[tuple[str, str, int]] = []

    def replayed_stats(self, prompt, *, max_tokens, temperature, seed, mode):
        self.replays.append((prompt, mode, len(self.calls)))
        trees = [] if mode == "ar" else [(12, 11, 5)] * 2
        return _stats(mode, max_tokens, 1.0, [(1, 0, 0)] * 4 + trees,
                      host=0.0001 if mode == "ar" else 0.00025)


def test_run_bench_host_replay_replays_engine_runs_after_the_prompts_timed_runs():
    eng = ReplayEngine()
    prompts = [BenchPrompt("g", "c", "P1", 8), BenchPrompt("s", "c", "P2", 8, 0.8, 1),
               BenchPrompt("u", "c", "P3", 8, 0.8, None)]  # sampled without a seed: not
    peers = {"llama-server": FakePeer([7])}
    modes = ["ar", "srsd", "llama-server"]
    recs = run_bench(eng, prompts, modes, peers=peers, progress=False, host_replay=True)
    assert [(p, m) for p, m, _ in eng.replays] == [("P1", "ar"), ("P1", "srsd"),
                                                   ("P2", "ar"), ("P2", "srsd")]
    # each prompt's replays come after all of its timed runs
    timed = [i for i, c in enumerate(eng.calls) if c[0] == "P1"]
    assert all(at > max(timed) for p, _, at in eng.replays if p == "P1")
    got = {(r.prompt_id, r.mode): r.replay for r in recs}
    assert got[("g", "llama-server")] is None and got[("u", "srsd")] is None
    assert got[("g", "srsd")] is not None
    s = summarise(recs, modes)
    o = s["modes"]
    assert o["ar"]["replay_host_ms_plain"] == pytest.approx(0.1)
    assert o["srsd"]["replay_host_ms_plain"] == pytest.approx(0.25)
    assert o["srsd"]["replay_host_ms_tree16"] == pytest.approx(0.5)
    assert o["ar"]["replay_host_ms_tree16"] is None  # its replays verified no 9-16 tree...
    assert o["llama-server"]["replay_host_ms_plain"] is None  # ... and peers are not replayed
    assert s["prompts"][1]["replay_stats"]["tokens"] == 8
    t = table(s, modes)
    assert "replayed: host ms / plain step | replayed: host ms / 9-16-node tree" in t
    assert "| overall | srsd | " in t and "| 0.250 | 0.500 |" in t
    plain = run_bench(FakeEngine(), prompts[:1], ["ar"], progress=False)
    assert plain[0].replay is None
    assert "replayed" not in table(summarise(plain, ["ar"]), ["ar"])


def test_run_bench_constrains_json_prompts_and_checks_their_outputs():
    from srsd_local.bench.report import summarise

    schema = {"type": "object", "properties": {"n": {"type": "integer"}}, "required": ["n"]}
    texts = {"ar": '{"n": 1}', "srsd": '{"m": 1}'}

    class JsonEngine(FakeEngine):
        def generate(self, prompt, *, max_tokens, temperature, seed, mode, json_schema=None):
            assert json_schema == (schema if prompt == "J" else None)
            out = super().generate(prompt, max_tokens=max_tokens, temperature=temperature,
                                   seed=seed, mode=mode)
            out.text = texts[mode]
            return out

    prompts = [BenchPrompt("j", "json", "J", 4, json_schema=schema),
               BenchPrompt("c", "code", "C", 4)]
    recs = run_bench(JsonEngine(), prompts, ["ar", "srsd"], progress=False)
    got = {(r.prompt_id, r.mode): (r.valid, r.invalid_reason) for r in recs}
    assert got[("j", "ar")] == (True, None) and got[("c", "srsd")] == (None, None)
    assert got[("j", "srsd")][0] is False and "'n' is a required" in got[("j", "srsd")][1]
    s = summarise(recs, ["ar", "srsd"])
    assert s["categories"]["json"]["srsd"]["valid"] == (0, 1)
    t = table(s, ["ar", "srsd"])
    assert "valid outputs" in t.splitlines()[0] and "| json | ar |" in t
    rows = {tuple(c.strip() for c in line.split("|")[1:3]): line for line in t.splitlines()}
    assert rows[("json", "ar")].endswith("| 0 | 1/1 |")
    assert rows[("json", "srsd")].endswith("| 0 | 0/1 |")
    assert rows[("code", "ar")].endswith("| 0 | - |")
    assert s["categories"]["json"]["srsd"]["valid_cut"] == 0  # complete JSON, wrong keys


def test_an_output_cut_at_max_tokens_before_its_json_closed_is_counted_as_cut():
    from srsd_local.bench.report import summarise

    schema = {"type": "object", "properties": {"n": {"type": "integer"}}, "required": ["n"]}

    class LoopingEngine(FakeEngine):
        def generate(self, prompt, *, max_tokens, temperature, seed, mode, json_schema=None):
            out = super().generate(prompt, max_tokens=max_tokens, temperature=temperature,
                                   seed=seed, mode=mode)
            out.text = '{"n": 1}' if mode == "ar" else '{"n": 1, "s": "again and again'
            return out

    recs = run_bench(LoopingEngine(), [BenchPrompt("j", "json", "J", 4, json_schema=schema)],
                     ["ar", "srsd"], progress=False)
    reason = {r.mode: r.invalid_reason for r in recs}
    assert reason["ar"] is None
    assert reason["srsd"].startswith("cut at max_tokens (4 tokens): not JSON")
    s = summarise(recs, ["ar", "srsd"])
    assert s["categories"]["json"]["srsd"]["valid"] == (0, 1)
    assert s["categories"]["json"]["srsd"]["valid_cut"] == 1
    assert "| 0/1 (1 cut at max_tokens) |" in table(s, ["ar", "srsd"])


def test_run_bench_verifies_each_distinct_greedy_output_once():
    from srsd_local.bench.report import summarise
    from srsd_local.engine.verify import VerifyReport

    seen = []

    def verify(prompt, ids):
        seen.append((prompt, tuple(ids)))
        bad = [5] if prompt == "P1" else []
        return VerifyReport(len(ids), bad, [0.5] * len(bad), [1] * len(bad), 0.3, 0.4)

    eng = FakeEngine()
    prompts = [BenchPrompt("g", "c", "P1", 20), BenchPrompt("s", "c", "P2", 20, 0.8, 1)]
    peers = {"llama-server": FakePeer([7]), "llama-server-spec": FakePeer(None)}
    modes = ["ar", "pld", "llama-server", "llama-server-spec"]
    recs = run_bench(eng, prompts, modes, peers=peers, progress=False, verify=verify)
    by = {(r.prompt_id, r.mode): r.verify for r in recs}
    # greedy outputs only; the peer without token ids is not checked; equal outputs once
    assert by[("s", "ar")] is None and by[("g", "llama-server-spec")] is None
    assert by[("g", "ar")]["positions"] == 20 and by[("g", "ar")]["beyond_noise"] == [5]
    assert len(seen) == len(set(seen)) == 2  # llama-server's output equals ar's: checked once
    assert by[("g", "llama-server")] == by[("g", "ar")]
    v = summarise(recs, modes)["modes"]["ar"]["verify"]
    assert v == {"outputs": 1, "positions": 20, "mismatches": 1, "beyond_noise": 1,
                 "worst_gap": 0.5, "noise": 0.4}
    assert "20 / 1 / 0.50 / 0.40 (1 beyond noise)" in table(summarise(recs, modes), modes)


def test_a_peer_that_ignores_the_schema_is_checked_unconstrained_and_a_failed_check_is_reported():
    """c-loop decodes without the prompt's schema: its output is checked against plain
    unconstrained decoding. A check that raises (here: an output the grammar refuses) is
    recorded and shown in the table; the other runs and checks go on."""
    from srsd_local.bench.report import summarise
    from srsd_local.engine.verify import VerifyReport

    schema = {"type": "object", "properties": {"n": {"type": "integer"}}, "required": ["n"]}
    seen = []

    class SchemaEngine(FakeEngine):
        backend = SimpleNamespace(detokenize=lambda ids: '{"n": 1}')

        def generate(self, prompt, *, max_tokens, temperature, seed, mode, json_schema=None):
            assert json_schema == schema
            return super().generate(prompt, max_tokens=max_tokens, temperature=temperature,
                                    seed=seed, mode=mode)

    def verify(prompt, ids, json_schema=None):
        seen.append((tuple(ids), json_schema is not None))
        if json_schema is not None and ids[0] == 9:
            raise ValueError("output token 9 at position 0 is not admitted by the grammar")
        return VerifyReport(len(ids), [], [], [], 0.3, 0.4)

    class Unconstrained(FakePeer):
        follows_schema = False

    class Constrained(FakePeer):
        follows_schema = True

    peers = {"c-loop": Unconstrained([9]), "llama-server-spec": Constrained([9])}
    modes = ["ar", "c-loop", "llama-server-spec"]
    prompts = [BenchPrompt("j", "json", "J", 4, json_schema=schema),
               BenchPrompt("k", "json", "K", 4, json_schema=schema)]
    recs = run_bench(SchemaEngine(), prompts, modes, peers=peers, progress=False,
                     verify=verify)
    by = {(r.prompt_id, r.mode): r for r in recs}
    # the same tokens [9, 9, 9, 9]: checked once without the schema (c-loop), once with it
    assert seen == [((7,) * 4, True), ((9,) * 4, False), ((9,) * 4, True)] * 2
    assert by[("j", "c-loop")].verify["positions"] == 4
    assert by[("j", "c-loop")].verify_error is None
    assert by[("j", "llama-server-spec")].verify is None
    assert "not admitted by the grammar" in by[("j", "llama-server-spec")].verify_error
    assert by[("k", "ar")].verify["positions"] == 4  # the runs after the failure went on
    s = summarise(recs, modes)
    assert s["modes"]["llama-server-spec"]["verify_errors"] == 2
    assert s["modes"]["c-loop"]["verify_errors"] == 0
    rows = {tuple(c.strip() for c in line.split("|")[1:3]): line
            for line in table(s, modes).splitlines()}
    assert "2 output(s) not checked: the check failed" in rows[("json", "llama-server-spec")]
    assert "not checked" not in rows[("json", "c-loop")]


def _args(tmp_path: Path, modes: str, **kw) -> SimpleNamespace:
    w = tmp_path / "w.jsonl"
    w.write_text("".join(json.dumps({"id": f"p{i}", "category": "code_edit", "prompt": f"x{i}",
                                     "max_tokens": 8}) + "\n" for i in range(3)))
    base = dict(workload=str(w), modes=modes, max_prompts=2, repeats=1, json=None, plot=None,
                doc=None, label="T", llama_server=str(tmp_path / "missing" / "llama-server"),
                no_verify=True)
    return SimpleNamespace(**{**base, **kw})


def test_main_bench_without_the_binary_runs_the_other_modes(tmp_path, capsys):
    eng = FakeEngine()
    out = tmp_path / "r.json"
    rc = main_bench(_args(tmp_path, "srsd,llama-server,llama-server-spec", json=str(out)),
                    lambda: eng)
    cap = capsys.readouterr()
    assert rc == 0 and eng.closed
    assert "scripts/build_llama_server.sh" in cap.err and "| overall | srsd |" in cap.out
    assert "| llama-server" not in cap.out and "speedup vs llama-server-spec" not in cap.out
    data = json.loads(out.read_text())
    assert set(data["modes"]) == {"ar", "srsd"} and len(data["prompts"]) == 4
    assert data["peers"] == {} and data["machine"]["model_file"] == "fake.gguf"


def test_main_bench_closes_the_engine_on_error(tmp_path):
    eng = FakeEngine(fail_mode="srsd")
    with pytest.raises(RuntimeError, match="decode failed"):
        main_bench(_args(tmp_path, "srsd"), lambda: eng)
    assert eng.closed


# -- real runs ---------------------------------------------------------------------------------
def _bench(tmp_path: Path, modes: str, *extra: str,
           prompt: str = "a = [1, 2, 3]\nb = [1, 2, 3]\nc = [1, 2,"
           ) -> tuple[subprocess.CompletedProcess, Path]:
    w = tmp_path / "w.jsonl"
    w.write_text(json.dumps({"id": "x", "category": "code_edit", "max_tokens": 24,
                             "prompt": prompt}) + "\n")
    out = tmp_path / "r.json"
    proc = subprocess.run([sys.executable, "-m", "srsd_local.cli", "bench", "--workload",
                           str(w), "--modes", modes, "--json", str(out), *extra],
                          capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-2000:]
    return proc, out


@pytest.mark.model
def test_real_bench_run_writes_table_json_plot_and_doc(tmp_path):
    png, doc = tmp_path / "r.png", tmp_path / "b.md"
    proc, out = _bench(tmp_path, "ar,srsd,lcp-pld,c-loop", "--plot", str(png), "--doc",
                       str(doc), "--label", "test")
    assert "| overall | srsd |" in proc.stdout and "| overall | lcp-pld |" in proc.stdout
    data = json.loads(out.read_text())
    # the C loop decodes what ar decodes
    assert data["modes"]["c-loop"]["identical_to_ar"] == [1, 1]
    for m in ("ar", "srsd", "lcp-pld", "c-loop"):
        assert {"tokens", "seconds", "tokens_per_second", "speedup_vs_ar",
                "mean_accepted_length", "host_ms_plain", "host_ms_tree"} <= set(data["modes"][m])
        assert data["modes"][m]["tokens"] == 24
    assert data["modes"]["ar"]["speedup_vs_ar"] == 1.0
    assert data["modes"]["ar"]["host_ms_plain"] > 0
    for m in ("ar", "srsd"):  # every greedy output checked at every position
        v = data["modes"][m]["verify"]
        assert v["positions"] == 24 and v["beyond_noise"] == 0 and v["noise"] >= 0
    assert data["categories"]["code_edit"]["srsd"]["tokens"] == 24
    assert data["machine"]["cores"] >= 1 and len(data["prompts"]) == 4
    assert png.stat().st_size > 10_000 and png.read_bytes()[:4] == b"\x89PNG"
    assert "<!-- bench:test -->" in doc.read_text()


@pytest.mark.model
def test_real_bench_host_replay_reports_the_replayed_columns(tmp_path):
    proc, out = _bench(tmp_path, "ar,srsd", "--host-replay", "--no-verify")
    data = json.loads(out.read_text())
    assert "replayed: host ms / plain step" in proc.stdout
    for m in ("ar", "srsd"):
        assert data["modes"][m]["tokens"] == 24
        rs = [p["replay_stats"] for p in data["prompts"] if p["mode"] == m]
        assert len(rs) == 1 and rs[0]["tokens"] == 24
    assert data["modes"]["ar"]["replay_host_ms_plain"] > 0


def test_host_replay_refuses_runs_it_cannot_repeat():
    proc = subprocess.run([sys.executable, "-m", "srsd_local.cli", "bench", "--host-replay",
                           "--concurrency", "1,2"], capture_output=True, text=True, timeout=60)
    assert proc.returncode == 1 and "--host-replay goes with a side-by-side run" in proc.stderr


def _built_llama_server() -> Path | None:
    """The binary scripts/build_llama_server.sh cached in the user's cache (the tests' own
    cache folder is a temporary one), or LLAMA_SERVER."""
    if os.environ.get("LLAMA_SERVER"):
        return Path(os.environ["LLAMA_SERVER"])
    xdg = Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache")
    exe = xdg / "srsd-local" / "llama-server" / peers_mod.llama_cpp_python_version() / \
        "llama-server"
    return exe if exe.is_file() else None


@pytest.mark.model
@pytest.mark.skipif(_built_llama_server() is None,
                    reason="no llama-server built (scripts/build_llama_server.sh)")
def test_real_llama_server_peers_match_plain_decoding(tmp_path):
    # a block repeated: --spec-default (ngram-mod) drafts only after a 24-token match
    block = "def area(width, height):\n    return width * height\n\n\n"
    proc, out = _bench(tmp_path, "ar,llama-server,llama-server-spec", "--llama-server",
                       str(_built_llama_server()), prompt=block * 4 + "def area(")
    data = json.loads(out.read_text())
    plain, spec = data["modes"]["llama-server"], data["modes"]["llama-server-spec"]
    assert plain["tokens"] == spec["tokens"] == 24 and plain["tokens_per_second"] > 0
    assert plain["identical_to_ar"] == [1, 1]
    assert spec["draft_tokens"] > 0 and spec["acceptance_rate"] is not None
    assert "--spec-default" in data["peers"]["llama-server-spec"]["command"]
    assert "| overall | llama-server-spec |" in proc.stdout


def test_calibrate_defaults_to_the_calibration_workload():
    from srsd_local.cli import build_parser

    args = build_parser().parse_args(["calibrate"])
    assert args.workload == "calibration"
    bench = build_parser().parse_args(["bench"])
    assert set(parse_modes(bench.modes)) >= set(SERVER_MODES) | {"lcp-pld", "srsd"}

