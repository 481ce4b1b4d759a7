"""`srsd-local bench --rpc`: the same modes on this machine alone and split across RPC
workers, in one run, with the network round trips each forward pass pays.

Injecting latency with tc/netem needs privileges a benchmark should not ask for, so the
workers are reached through `CountingRelay`, a loopback TCP relay that counts round trips
(a burst of bytes to the worker answered by a burst back); the time a network with a given
round-trip time would add is then estimated as round trips x RTT, and said to be an
estimate.
"""

from __future__ import annotations

import json
import selectors
import socket
import sys
import threading
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

from .runner import parse_modes, run_bench, summarise
from .workloads import first_per_category, load_workload

RTTS_MS = (0.2, 1.0, 5.0)  # a switched LAN, Wi-Fi or a slow LAN, a nearby WAN


class CountingRelay:
    """127.0.0.1:PORT -> a worker, in a thread; `turns` counts answers (worker -> client
    bursts that follow client -> worker bytes): one per synchronous round trip."""

    def __init__(self, target: str) -> None:
        host, _, port = target.rpartition(":")
        self.target = (host, int(port))
        self.listener = socket.socket()
        self.listener.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        self.listener.bind(("127.0.0.1", 0))
        self.listener.listen(8)
        self.endpoint = f"127.0.0.1:{self.listener.getsockname()[1]}"
        self.turns = 0
        self.bytes_up = self.bytes_down = 0
        self._stop = False
        self._thread = threading.Thread(target=self._run, daemon=True, name="rpc-relay")
        self._thread.start()

    def _run(self) -> None:
        sel = selectors.DefaultSelector()
        sel.register(self.listener, selectors.EVENT_READ, None)
        peer: dict[socket.socket, tuple[socket.socket, bool]] = {}
        pending: dict[socket.socket, bool] = {}  # client socket -> waiting for an answer
        while not self._stop:
            for key, _ in sel.select(timeout=0.2):
                sock = key.fileobj
                if sock is self.listener:
                    client, _ = self.listener.accept()
                    upstream = socket.create_connection(self.target)
                    for s in (client, upstream):
                        s.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
                        sel.register(s, selectors.EVENT_READ, None)
                    peer[client], peer[upstream] = (upstream, True), (client, False)
                    pending[client] = False
                    continue
                other, from_client = peer[sock]
                try:
                    data = sock.recv(1 << 20)
                except OSError:
                    data = b""
                if not data:
                    for s in (sock, other):
                        sel.unregister(s)
                        s.close()
                        peer.pop(s, None)
                    continue
                client = sock if from_client else other
                if from_client:
                    self.bytes_up += len(data)
                    pending[client] = True
                else:
                    self.bytes_down += len(data)
                    if pending.get(client):
                        self.turns += 1
                        pending[client] = False
                other.sendall(data)
        for s in list(peer):
            s.close()

    def close(self) -> None:
        self._stop = True
        self._thread.join(2)
        self.listener.close()


def _measure(load: Callable[[], Any], prompts: list, modes: list[str], repeats: int,
             verify: bool, relays: Sequence[CountingRelay] = ()) -> dict[str, Any]:
    engine = load()
    out: dict[str, Any] = {"placement": engine.placement}
    try:
        if relays:  # round trips and bytes per forward pass, from plain steps
            engine.generate(prompts[0].prompt, max_tokens=8, mode="ar")  # warm
            turns, moved = _traffic(relays)
            stats = engine.generate(prompts[0].prompt, max_tokens=32, mode="ar").stats
            turns2, moved2 = _traffic(relays)
            out["round_trips_per_pass"] = (turns2 - turns) / max(stats.steps, 1)
            out["bytes_per_pass"] = (moved2 - moved) / max(stats.steps, 1)
        records = run_bench(engine, prompts, modes, repeats, {},
                            verify=engine.verify_output if verify else None)
        out["modes"] = summarise(records, modes)["modes"]
    finally:
        engine.close()
    return out


def _traffic(relays: Sequence[CountingRelay]) -> tuple[int, int]:
    return (sum(r.turns for r in relays),
            sum(r.bytes_up + r.bytes_down for r in relays))


def main_rpc_bench(args: Any, load: Callable[..., Any], endpoints: Sequence[str]) -> int:
    """Modes of --modes on this machine alone, then split across `endpoints` (through
    counting relays); prints the table and writes --json."""
    prompts = first_per_category(load_workload(args.workload), args.max_prompts)
    modes = parse_modes(args.modes)
    bad = [m for m in modes if m not in ("ar", "pld", "ngram", "retrieval", "srsd", "hybrid")]
    if bad:
        raise ValueError(f"bench --rpc runs srsd-local's own modes only, not {bad}")
    verify = not getattr(args, "no_verify", False)
    local = _measure(lambda: load(rpc_servers=()), prompts, modes, args.repeats, verify)
    relays = [CountingRelay(ep) for ep in endpoints]
    try:
        split = _measure(lambda: load(rpc_servers=tuple(r.endpoint for r in relays)), prompts,
                         modes, args.repeats, verify, relays)
    finally:
        for r in relays:
            r.close()
    result = {"workload": args.workload, "workers": list(endpoints), "modes": modes,
              "local": local, "rpc": split, "command": "srsd-local " + " ".join(sys.argv[1:])}
    print(rpc_table(result))
    if args.json:
        Path(args.json).parent.mkdir(parents=True, exist_ok=True)
        Path(args.json).write_text(json.dumps(result, indent=1, default=str), encoding="utf-8")
    return 0


def rpc_table(result: dict[str, Any]) -> str:
    """Markdown: per setup and mode, tokens/s, speed-up over ar, tokens per step, and for the
    split setup the round trips per step and the tokens/s estimated at longer RTTs."""
    modes = result["modes"]
    est = " | ".join(f"est. tok/s @ {r:g} ms RTT" for r in RTTS_MS)
    lines = [f"| setup | mode | tokens/s | vs ar | tokens/step | round trips/step | {est} |",
             "|---|---|---|---|---|---|" + "---|" * len(RTTS_MS)]
    for setup in ("local", "rpc"):
        data = result[setup]["modes"]
        base = data.get("ar", {}).get("tokens_per_second")
        per_pass = result[setup].get("round_trips_per_pass")
        for mode in modes:
            row = data[mode]
            tps = row.get("tokens_per_second") or 0.0
            vs = f"{tps / base:.2f}x" if base else "-"
            steps = row.get("steps") or 0
            if per_pass is not None and steps:
                secs = row.get("seconds") or 0.0
                toks = row.get("tokens") or 0
                ests = " | ".join(
                    f"{toks / (secs + steps * per_pass * r / 1000):.1f}" if secs else "-"
                    for r in RTTS_MS)
                rts = f"{per_pass:.1f}"
            else:
                rts, ests = "-", " | ".join("-" for _ in RTTS_MS)
            name = "local" if setup == "local" else f"RPC, {len(result['workers'])} workers"
            lines.append(f"| {name} | {mode} | {tps:.1f} | {vs} | "
                         f"{row.get('mean_accepted_length') or 0:.2f} | {rts} | {ests} |")
    rpc = result["rpc"]
    lines.append("")
    lines.append("layers: " + " · ".join(f"{p['device']} ({p['where']}): {p['layers']}"
                                         for p in rpc.get("placement") or []))
    if rpc.get("bytes_per_pass") is not None:
        lines.append(f"per forward pass (plain steps): {rpc['round_trips_per_pass']:.1f} "
                     f"round trips, {rpc['bytes_per_pass'] / 1024:.1f} KiB over the network; "
                     "the est. columns add steps x round trips x RTT to the measured time "
                     "(an estimate: no latency was injected)")
    return "\n".join(lines)
