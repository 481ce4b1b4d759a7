"""Side-by-side benchmark: every mode on every prompt, one process, one model (README.md,
"Benchmarks"; results and method in docs/benchmarks.md).

Modes are interleaved per prompt (peers included) so machine noise hits all of them alike; one
warm-up pass per mode is excluded from timing. The engine is driven through its public API
only; workloads come from srsd_local/bench/workloads, peers from srsd_local/bench/peers.py,
totals and tables from srsd_local/bench/report.py.
"""

from __future__ import annotations

import json
import os
import platform
import re
import sys
from collections.abc import Callable, Mapping, Sequence
from datetime import date
from pathlib import Path
from typing import Any

from ..config import MODES
from ..llama.grammar import schema_problem
from .peers import (
    PEER_MODES,
    SERVER_MODES,
    Peer,
    PeerSettings,
    close_peers,
    display_command,
    start_peers,
)
from .report import CUT, RunRecord, doc_section, plot, summarise, table, write_doc
from .workloads import BenchPrompt, first_per_category, load_workload

ALL_MODES = MODES + PEER_MODES


def parse_modes(text: str) -> list[str]:
    """Comma-separated modes, `ar` added first when missing (every speed-up is relative to it)."""
    modes = [m.strip() for m in text.split(",") if m.strip()]
    bad = [m for m in modes if m not in ALL_MODES]
    if bad or not modes:
        raise ValueError(f"unknown mode(s) {bad or text!r}: accepted are {', '.join(ALL_MODES)}")
    modes = list(dict.fromkeys(modes))
    if "ar" not in modes:
        modes.insert(0, "ar")
    return modes


Verifier = Callable[..., Any]  # (prompt, output ids[, json_schema=]) -> a VerifyReport


def run_bench(engine: Any, prompts: Sequence[BenchPrompt], modes: Sequence[str],
              repeats: int = 1, peers: Mapping[str, Peer] | None = None,
              progress: bool = True, verify: Verifier | None = None,
              host_replay: bool = False) -> list[RunRecord]:
    """Every mode on every prompt, `repeats` times, modes interleaved per prompt; a greedy
    run's tokens are compared with the same prompt's `ar` run and, with `verify`, checked
    against plain decoding at every position (after the timed run; an output seen before for
    the same prompt is checked once). With `host_replay`, once every mode of a prompt ran,
    each engine run of it (greedy or seeded) is recorded and replayed without the forward
    passes (`Engine.replayed_stats`): the host times of the replay go with its record."""
    from tqdm import tqdm  # noqa: PLC0415

    peers = peers or {}
    missing = [m for m in modes if m in PEER_MODES and m not in peers]
    if missing:
        raise ValueError(f"no peer started for {', '.join(missing)}")

    def one(p: BenchPrompt, mode: str, repeat: int) -> RunRecord:
        if mode in peers:
            res = peers[mode].run(p)
            rec = RunRecord(p.id, p.category, mode, repeat, res.to_stats(mode), res.token_ids,
                            peer=True,
                            follows_schema=getattr(peers[mode], "follows_schema", True))
            text = None
            if p.json_schema is not None and res.token_ids is not None:
                text = engine.backend.detokenize(res.token_ids)
        else:
            # no run may draft from another run's output of the same prompt (the n-gram
            # pool keeps outputs across requests); the prompt's KV cells stay for reuse
            engine.forget_outputs()
            out = engine.generate(p.prompt, max_tokens=p.max_tokens, temperature=p.temperature,
                                  seed=p.seed, mode=mode, **p.constraint)
            rec = RunRecord(p.id, p.category, mode, repeat, out.stats, list(out.token_ids))
            text = out.text
        if p.json_schema is not None and text is not None:  # untimed
            problem = schema_problem(p.json_schema, text)
            if problem is not None and problem.startswith("not JSON") and \
                    rec.token_ids is not None and len(rec.token_ids) >= p.max_tokens:
                problem = f"{CUT} ({p.max_tokens} tokens): {problem}"
            rec.valid, rec.invalid_reason = problem is None, problem
        return rec

    first = prompts[0]
    warm = BenchPrompt("warm-up", "warm-up", first.prompt, min(16, first.max_tokens),
                       json_schema=first.json_schema)
    for mode in modes:  # excluded from timing
        one(warm, mode, -1)
    records: list[RunRecord] = []
    checked: dict[tuple[str, tuple[int, ...], bool], dict[str, Any] | str] = {}

    def replay(p: BenchPrompt, recs: list[RunRecord]) -> None:
        if not host_replay or (p.temperature != 0.0 and p.seed is None):
            return
        for rec in recs:
            if not rec.peer:
                bar.set_postfix_str(f"{p.id} {rec.mode} (replay)")
                rec.replay = engine.replayed_stats(
                    p.prompt, max_tokens=p.max_tokens, temperature=p.temperature,
                    seed=p.seed, mode=rec.mode, **p.constraint)

    def check(p: BenchPrompt, rec: RunRecord) -> None:
        """The output against plain decoding (under the prompt's schema where the run
        followed it). A check that fails is recorded with its reason and reported; the
        runs go on (an hour of measurements is not lost to one output)."""
        if verify is None or rec.token_ids is None or p.temperature != 0.0:
            return
        constraint = p.constraint if rec.follows_schema else {}
        key = (p.id, tuple(rec.token_ids), bool(constraint))
        if key not in checked:
            try:
                checked[key] = verify(p.prompt, rec.token_ids, **constraint).to_dict()
            except Exception as exc:  # noqa: BLE001 - reported with the run
                checked[key] = f"{type(exc).__name__}: {exc}"
                bar.write(f"bench: the check of {p.id} ({rec.mode}) against plain decoding "
                          f"failed: {checked[key]}", file=sys.stderr)
        if isinstance(checked[key], str):
            rec.verify_error = checked[key]
        else:
            rec.verify = checked[key]

    bar = tqdm(total=len(prompts) * len(modes) * repeats, desc="bench", unit="run",
               disable=not progress)
    try:
        for p in prompts:
            for r in range(repeats):
                ar_ids: list[int] | None = None
                group: list[RunRecord] = []
                for mode in modes:
                    bar.set_postfix_str(f"{p.id} {mode}")
                    rec = one(p, mode, r)
                    if mode == "ar":
                        ar_ids = rec.token_ids
                    elif ar_ids is not None and rec.token_ids is not None \
                            and p.temperature == 0.0:
                        rec.identical_to_ar = rec.token_ids == ar_ids
                    check(p, rec)
                    records.append(rec)
                    group.append(rec)
                    bar.update(1)
                replay(p, group)
    finally:
        bar.close()
    return records


def machine_info(engine: Any) -> dict[str, Any]:
    import llama_cpp  # noqa: PLC0415

    from ..llama.backend import gpu_offload_supported  # noqa: PLC0415
    from ..spec.index import gpu_available  # noqa: PLC0415

    cpu = platform.processor()
    try:
        with open("/proc/cpuinfo", encoding="utf-8") as f:
            m = re.search(r"model name\s*:\s*(.+)", f.read())
            cpu = m.group(1).strip() if m else cpu
    except OSError:
        pass
    return {
        "cpu": cpu, "cores": os.cpu_count(), "threads": engine.config.threads,
        "platform": platform.platform(), "python": platform.python_version(),
        "llama_cpp_python": llama_cpp.__version__,
        "gpu_offload": gpu_offload_supported(), "n_gpu_layers": engine.config.n_gpu_layers,
        "faiss_gpu": gpu_available(), "index_backend": engine.index_backend,
        "model": engine.model_name, "model_file": Path(engine.model_path).name,
        "repacked_weights": getattr(engine, "repacked_weights", None),
        "graph_sampler": getattr(getattr(engine, "backend", None), "graph_sampler", ""),
    }


def _peer_info(peers: Mapping[str, Peer]) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for mode, peer in peers.items():
        cmd = getattr(peer, "command", None)
        out[mode] = {"command": display_command(cmd) if cmd else None,
                     "binary": cmd[0] if cmd else None}
    return out


def parse_levels(text: str) -> list[int]:
    """`--concurrency 1,2,4,8`: client counts, each >= 1."""
    try:
        levels = [int(x) for x in text.split(",") if x.strip()]
    except ValueError:
        levels = []
    if not levels or any(n < 1 for n in levels):
        raise ValueError(f"--concurrency {text!r}: accepted are comma-separated client counts "
                         ">= 1, e.g. 1,2,4,8")
    return sorted(set(levels))


def main_concurrency(args: Any, engine_factory: Callable[[], Any], levels: list[int]) -> int:
    """`srsd-local bench --concurrency ...`: clients at once (bench/concurrency.py)."""
    from .concurrency import concurrency_table, run_concurrency  # noqa: PLC0415

    prompts = first_per_category(load_workload(args.workload), args.max_prompts)
    modes = [m for m in parse_modes(args.modes) if m != "ar" or "ar" in args.modes]
    engine = engine_factory()
    peers: dict[str, Peer] = {}
    try:
        modes, peers = start_peers([m for m in modes if m not in ("lcp-pld", "c-loop")],
                                   PeerSettings.of(engine), getattr(args, "llama_server", None))
        data = run_concurrency(engine, prompts, levels, modes, peers)
        data["machine"] = machine_info(engine)
        data["peers"] = _peer_info({m: p for m, p in peers.items() if m in SERVER_MODES})
    finally:
        close_peers(peers)
        engine.close()
    command = "srsd-local " + " ".join(sys.argv[1:])
    data.update(workload=args.workload, command=command)
    text = concurrency_table(data)
    print(text)
    if args.json:
        Path(args.json).parent.mkdir(parents=True, exist_ok=True)
        Path(args.json).write_text(json.dumps(data, indent=1), encoding="utf-8")
    if args.doc:
        m = data["machine"]
        head = [f"## {args.label}: concurrency, {args.workload}", "",
                f"- date: {date.today().isoformat()}",
                f"- machine: {m['cpu']}, {m['cores']} cores, {m['threads']} threads; GPU "
                f"offload: {m['gpu_offload']} (n_gpu_layers {m['n_gpu_layers']})",
                f"- model: {m['model']} ({m['model_file']})", f"- command: `{command}`"]
        head += [f"- {mode}: `{info['command']}`" for mode, info in data["peers"].items()]
        write_doc(args.doc, args.label, "\n".join(head) + "\n\n" + text)
    return 0


def main_bench(args: Any, engine_factory: Callable[[], Any]) -> int:
    """`srsd-local bench`: run, print the table, write --json / --plot / --doc."""
    prompts = first_per_category(load_workload(args.workload), args.max_prompts)
    modes = parse_modes(args.modes)
    if args.repeats < 1:
        raise ValueError(f"--repeats {args.repeats}: accepted is an integer >= 1")
    engine = engine_factory()
    peers: dict[str, Peer] = {}
    try:
        modes, peers = start_peers(modes, PeerSettings.of(engine),
                                   getattr(args, "llama_server", None))
        verify = None if getattr(args, "no_verify", False) else engine.verify_output
        records = run_bench(engine, prompts, modes, args.repeats, peers, verify=verify,
                            host_replay=getattr(args, "host_replay", False))
        summary = summarise(records, modes)
        summary["machine"] = machine_info(engine)
        summary["config"] = engine.config.to_dict()
        summary["peers"] = _peer_info({m: p for m, p in peers.items() if m in SERVER_MODES})
    finally:
        close_peers(peers)
        engine.close()
    summary["workload"] = args.workload
    command = "srsd-local " + " ".join(sys.argv[1:])
    summary["command"] = command
    print(table(summary, modes))
    if args.json:
        Path(args.json).parent.mkdir(parents=True, exist_ok=True)
        Path(args.json).write_text(json.dumps(summary, indent=1), encoding="utf-8")
    if args.plot:
        plot(summary, modes, args.plot)
    if args.doc:
        write_doc(args.doc, args.label, doc_section(summary, modes, summary["machine"],
                                                    command, args.label, args.workload))
    return 0
