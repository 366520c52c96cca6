"""Command line: ``ds-capture run | serve | plan | verify | inspect | compare | regenerate`` (``python -m ds_capture``).

In: argv. Out: an exit code. A user mistake (``CaptureError``) prints one paragraph and exits 2
for ``run`` (1 for an invalid cache in ``verify``), never a traceback; ``--debug`` shows it. A ``run``
stopped by SIGTERM / SIGINT (preemption, Ctrl-C) exits 75 (``errors.RERUN_EXIT_CODE``): rerun to continue; so
does a ``regenerate`` whose server stopped answering, and any command whose peer rank died (``RerunError``).

    ds-capture run -c configs/demo.yaml --set recipe_args.seq_length=256 [--restart] [--verify-checksums]
    ds-capture serve -c configs/demo_eagle3.yaml --port 8000 [--host 0.0.0.0] [--exit-on-disconnect]
    ds-capture plan -c configs/glm5.yaml --world-size 64 [--gpu-memory-gib 80] [--json]
    ds-capture plan -c configs/demo_eagle3.yaml --serve [--max-batch-rows 8]
    ds-capture verify outputs/demo_cache [--checksums] [--json]
    ds-capture inspect outputs/demo_cache
    ds-capture regenerate --data IN.jsonl --output OUT.jsonl --url http://localhost:8000/v1 --model NAME
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import sys
from pathlib import Path
from typing import Any

from ds_capture import __version__
from ds_capture.capture.interrupt import Interrupted
from ds_capture.errors import RERUN_EXIT_CODE, CaptureError, RerunError
from ds_capture.log_setup import configure_logging
from ds_capture.parallel.dist import AgreedError
from ds_capture.parallel.torchrun_exit import record_exit_code
from ds_capture.sizing.session_plan import SERVE_MAX_BATCH_ROWS

_LOG = logging.getLogger("ds_capture")


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="ds-capture", description=__doc__.split("\n\n")[0])
    parser.add_argument("--version", action="version", version=f"ds_capture {__version__}")
    parser.add_argument("--debug", action="store_true", help="show tracebacks for errors")
    parser.add_argument("--verbose", action="store_true",
                        help="also show other libraries' warnings (import noise included); DS_CAPTURE_LOG_LEVEL sets "
                             "their level (default ERROR)")
    sub = parser.add_subparsers(dest="command", required=True)
    _add_run(sub)
    _add_serve(sub)
    _add_plan(sub)
    _add_cache_commands(sub)
    _add_regenerate(sub)
    return parser


def _add_recipe(command: argparse.ArgumentParser, config_help: str,
                set_help: str = "override a YAML value (repeatable)") -> None:
    """``-c/--config`` and ``--set``: the recipe every target command reads."""
    command.add_argument("-c", "--config", required=True, help=config_help)
    command.add_argument("--set", dest="overrides", action="append", default=[], metavar="dotted.key=value",
                         help=set_help)


def _add_run(sub: Any) -> None:
    run = sub.add_parser("run", help="capture a target's hidden states into a cache")
    _add_recipe(run, "YAML recipe (see configs/)",
                "override a YAML value, e.g. --set recipe_args.seq_length=512 (repeatable)")
    run.add_argument("--restart", action="store_true", help="recompute every shard even where valid ones exist")
    run.add_argument("--verify-checksums", action="store_true",
                     help="over a cache marked complete, also re-hash every shard against its checksum sidecar "
                          "(finds a changed byte; reads the whole cache) before recomputing only the damaged ones")
    run.add_argument("--no-progress", action="store_true", help="no progress bar")
    run.add_argument("--verbose", action="store_true", default=argparse.SUPPRESS,
                     help="as ds-capture --verbose: also show other libraries' warnings")


def _add_serve(sub: Any) -> None:
    serve = sub.add_parser("serve", help="serve the target to NeMo's EAGLE-3 trainer (target_model_backend: remote)")
    _add_recipe(serve, "YAML recipe with cache_kind: eagle3 (see docs/serve.md)")
    serve.add_argument("--host", default="127.0.0.1",
                       help="address to listen on (default 127.0.0.1; NeMo's client sends no credentials)")
    serve.add_argument("--port", type=int, default=8000,
                       help="TCP port of replica 0; replica d listens on PORT + d (default 8000; 0: free ones, logged)")
    serve.add_argument("--exit-on-disconnect", action="store_true",
                       help="stop once a trainer disconnects and nothing waits (NeMo's serve_target behaviour)")
    serve.add_argument("--max-batch-rows", type=int, default=SERVE_MAX_BATCH_ROWS,
                       help="most rows per request, and per forward shared by waiting requests (default "
                            f"{SERVE_MAX_BATCH_ROWS}); ds-capture plan --serve --max-batch-rows N sizes it")
    serve.add_argument("--batch-requests", action="store_true",
                       help="let waiting requests of one length share a forward (answers may then differ from an "
                            "idle service's in the last bits; default: one forward per request, deterministic)")
    serve.add_argument("--no-batching", action="store_true", help=argparse.SUPPRESS)  # the default now
    serve.add_argument("--max-queued-rows", type=int, default=None,
                       help="rows waiting in the queue past which requests are held (default 4 x --max-batch-rows)")
    serve.add_argument("--max-held", type=int, default=256,
                       help="requests queued plus held past which one is refused with Retry-After (default 256)")
    serve.add_argument("--vocab-idle-s", type=float, default=60.0,
                       help="seconds after its last request a draft vocabulary stops being live (default 60)")
    serve.add_argument("--vocab-dir", type=Path, default=None,
                       help="keep the trainers' draft vocabularies here and restore them on a restart, so a trainer "
                            "rides through a requeue (launch/slurm.sbatch sets it; default: memory only)")
    serve.add_argument("--max-body-mib", type=float, default=256.0, help="largest request body (default 256 MiB)")
    serve.add_argument("--log-interval", type=float, default=30.0,
                       help="seconds between progress lines (default 30; 0: none)")


def _add_plan(sub: Any) -> None:
    plan = sub.add_parser("plan", help="size a run on every rank from the target's config.json (no weights)")
    _add_recipe(plan, "YAML recipe (see configs/)")
    plan.add_argument("--world-size", type=int, default=None,
                      help="ranks of the job (default: the smallest world the degrees allow)")
    plan.add_argument("--gpu-memory-gib", type=float, default=None,
                      help="GPU memory per rank (default: capture.gpu_memory_gib, else this machine's GPU, else 80 GB)")
    plan.add_argument("--json", action="store_true", help="print one JSON object")
    plan.add_argument("--serve", action="store_true",
                      help="size `ds-capture serve` (each forward --max-batch-rows rows, the listeners' supervision)")
    plan.add_argument("--max-batch-rows", type=int, default=None,
                      help=f"with --serve: serve's --max-batch-rows (default {SERVE_MAX_BATCH_ROWS}, serve's own)")


def _add_cache_commands(sub: Any) -> None:
    """verify, inspect and compare: commands over cache directories (no target, no recipe)."""
    verify = sub.add_parser("verify", help="check a cache against the format contract")
    verify.add_argument("cache_dir", type=Path)
    verify.add_argument("--checksums", action="store_true", help="re-hash every shard against its recorded sha256")
    verify.add_argument("--json", action="store_true", help="print a machine-readable report")

    inspect = sub.add_parser("inspect", help="summarise a cache for humans")
    inspect.add_argument("cache_dir", type=Path)
    inspect.add_argument("--json", action="store_true")

    compare = sub.add_parser("compare", help="compare two caches (exit 0 equal within tolerance, 1 different, "
                                             "2 not a valid cache)")
    compare.add_argument("cache_a", type=Path)
    compare.add_argument("cache_b", type=Path, help="the reference (relative tolerance is taken against it)")
    compare.add_argument("--atol", type=float, default=None, help="absolute tolerance (default: by cache dtype)")
    compare.add_argument("--rtol", type=float, default=None, help="relative tolerance (default: by cache dtype)")
    compare.add_argument("--json", action="store_true", help="print a machine-readable report")


def _add_regenerate(sub: Any) -> None:
    regenerate = sub.add_parser("regenerate", help="rewrite a dataset's assistant turns with the target, through an "
                                                   "OpenAI-compatible server (vLLM, SGLang, transformers serve)")
    regenerate.add_argument("--data", required=True, help="any dataset ds-capture run reads, or demo:conversations")
    regenerate.add_argument("--output", required=True, type=Path, help="the regenerated dataset (.jsonl)")
    regenerate.add_argument("--url", required=True, help="the server's OpenAI base URL, e.g. http://localhost:8000/v1")
    regenerate.add_argument("--model", required=True, help="the model name the server serves")
    regenerate.add_argument("--max-tokens", type=int, default=1024,
                            help="most tokens per reply (default 1024); a reply cut there is kept and counted")
    regenerate.add_argument("--temperature", type=float, default=0.0, help="0 (the default) decodes greedily")
    regenerate.add_argument("--seed", type=int, default=None, help="sent with every request (default: none)")
    regenerate.add_argument("--concurrency", type=int, default=32, help="requests in flight (default 32)")
    regenerate.add_argument("--split", default=None, help="split expression, as recipe_args.train_split")
    regenerate.add_argument("--shuffle-seed", type=int, default=42, help="as recipe_args.shuffle_seed (default 42)")
    regenerate.add_argument("--max-retries", type=int, default=5,
                            help="retries of a failed request, 0.5 s apart and doubling (default 5)")
    regenerate.add_argument("--timeout", type=float, default=600.0, help="seconds per request (default 600)")
    regenerate.add_argument("--no-progress", action="store_true", help="no progress bar")


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(_drop_local_rank(sys.argv[1:] if argv is None else argv))
    from ds_capture.parallel.dist import quiet_deepspeed_accelerator

    quiet_deepspeed_accelerator()
    configure_logging(rank0=_is_rank0(), verbose=args.verbose)
    try:
        return _COMMANDS[args.command](args)
    except RerunError as error:
        if args.debug:
            raise
        print(f"ds-capture {args.command}: {error}", file=sys.stderr)
        return RERUN_EXIT_CODE
    except CaptureError as error:
        if args.debug:
            raise
        # A failure all ranks agreed on is printed once, by rank 0; a rank's own failure by that rank.
        if not isinstance(error, AgreedError) or _is_rank0():
            print(f"ds-capture {args.command}: error: {error}", file=sys.stderr)
        return 2
    except Interrupted as stop:
        # Every rank stopped at the same step with the same counts: rank 0 says so once.
        if _is_rank0():
            print(f"ds-capture {args.command}: {stop}", file=sys.stderr)
        return RERUN_EXIT_CODE
    except KeyboardInterrupt:
        # Ctrl-C before the run installed its handlers (nothing written yet), or in another command.
        if args.command in ("run", "regenerate"):
            print(f"ds-capture {args.command}: interrupted; rerun the same command to continue.", file=sys.stderr)
            return RERUN_EXIT_CODE
        print(f"ds-capture {args.command}: interrupted.", file=sys.stderr)
        return 130


def entry() -> None:
    """The console script and ``python -m ds_capture``: :func:`main`, then an exit without interpreter
    teardown.

    Once a command returns, everything of ours is closed (shards fsynced, the manifest published, the
    process group destroyed, every thread joined); what is left is the interpreter freeing torch's and
    transformers' module graph, which costs 1 to 2 s per process (measured: ``import torch`` alone adds
    0.9 s at exit). The output streams and log handlers are flushed first."""
    code = main()
    record_exit_code(code)  # read by launch/torchrun.sh's wrapper (torchrun does not report it on a shutdown)
    logging.shutdown()
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except (OSError, ValueError):  # a closed pipe: nothing more can be said
            pass
    os._exit(code)


def _drop_local_rank(argv: list[str]) -> list[str]:
    """Remove ``--local_rank=N`` / ``--local_rank N`` wherever the launcher put it (deepspeed puts it
    before the subcommand); the rank comes from the environment."""
    kept, skip = [], False
    for arg in argv:
        if skip:
            skip = False
        elif arg in ("--local_rank", "--local-rank"):
            skip = True
        elif not arg.startswith(("--local_rank=", "--local-rank=")):
            kept.append(arg)
    return kept


def _is_rank0() -> bool:
    for key in ("RANK", "OMPI_COMM_WORLD_RANK", "PMI_RANK", "SLURM_PROCID"):
        if key in os.environ:
            return os.environ[key] == "0"
    return True


def _cmd_run(args: argparse.Namespace) -> int:
    from ds_capture.recipe.config import load_config
    from ds_capture.runner import run_capture

    cfg = load_config(args.config, args.overrides)
    summary = run_capture(cfg, restart=args.restart, verify_checksums=args.verify_checksums,
                          show_progress=not args.no_progress)
    if _is_rank0():
        print(summary.format())
    return 0


def _cmd_serve(args: argparse.Namespace) -> int:
    from ds_capture.recipe.config import load_config
    from ds_capture.serve.loop import ServeOptions, serve_target

    options = ServeOptions(host=args.host, port=args.port, exit_on_disconnect=args.exit_on_disconnect,
                           max_batch_rows=args.max_batch_rows,
                           batch_requests=args.batch_requests and not args.no_batching,
                           max_body_mib=args.max_body_mib, log_interval_s=args.log_interval,
                           max_queued_rows=args.max_queued_rows, max_held=args.max_held,
                           vocab_idle_s=args.vocab_idle_s, vocab_dir=args.vocab_dir)
    summary = serve_target(load_config(args.config, args.overrides), options)
    if _is_rank0():
        print(summary.format(), flush=True)
    return 0


def _cmd_plan(args: argparse.Namespace) -> int:
    from ds_capture.recipe.config import load_config
    from ds_capture.sizing.command import plan_capture

    report = plan_capture(load_config(args.config, args.overrides), world_size=args.world_size,
                          gpu_memory_gib=args.gpu_memory_gib, serve_rows=_serve_rows(args))
    print(json.dumps(report.to_dict(), indent=2, sort_keys=True) if args.json else report.format())
    return 0


def _serve_rows(args: argparse.Namespace) -> int | None:
    """``plan``'s driver: None sizes ``run``; ``--serve`` sizes ``serve`` at its ``--max-batch-rows``."""
    if args.max_batch_rows is not None and not args.serve:
        raise CaptureError("--max-batch-rows sizes ds-capture serve: add --serve (run's forward is "
                           "recipe_args.micro_batch_size rows).")
    if not args.serve:
        return None
    return SERVE_MAX_BATCH_ROWS if args.max_batch_rows is None else args.max_batch_rows


def _cmd_verify(args: argparse.Namespace) -> int:
    from ds_capture.cache.registry import verify_cache

    report = verify_cache(args.cache_dir, checksums=args.checksums)
    if args.json:
        print(json.dumps(report.to_dict(), indent=2, sort_keys=True))
    elif report.ok:
        print(report.summary())
    else:
        print("\n".join(report.lines()))
    return 0 if report.ok else 1


def _cmd_inspect(args: argparse.Namespace) -> int:
    from ds_capture.cache.registry import format_inspect, inspect_cache

    info = inspect_cache(args.cache_dir)
    print(json.dumps(info, indent=2, sort_keys=True, default=str) if args.json else format_inspect(info))
    return 0


def _cmd_compare(args: argparse.Namespace) -> int:
    from ds_capture.cache.registry import compare_caches

    report = compare_caches(args.cache_a, args.cache_b, atol=args.atol, rtol=args.rtol)
    print(json.dumps(report.to_dict(), indent=2, sort_keys=True) if args.json else report.format())
    return 0 if report.equal else 1


def _cmd_regenerate(args: argparse.Namespace) -> int:
    import signal
    import threading

    from ds_capture.demo import resolve_special_path
    from ds_capture.regenerate.client import GenerationSettings, ServerUnavailable
    from ds_capture.regenerate.driver import RegenerateOptions, regenerate

    options = RegenerateOptions(
        data=resolve_special_path(args.data), output=args.output, url=args.url, split=args.split,
        shuffle_seed=args.shuffle_seed,
        generation=GenerationSettings(model=args.model, max_tokens=args.max_tokens, temperature=args.temperature,
                                      seed=args.seed),
        concurrency=args.concurrency, max_retries=args.max_retries, timeout_s=args.timeout,
        show_progress=not args.no_progress)
    logging.getLogger("httpx").setLevel(logging.WARNING)  # one INFO line per request otherwise

    def stop(signum, frame):  # SIGTERM as Ctrl-C: every finished row is already recorded
        raise KeyboardInterrupt

    main_thread = threading.current_thread() is threading.main_thread()  # (tests call main from threads)
    previous = signal.signal(signal.SIGTERM, stop) if main_thread else None
    try:
        print(regenerate(options).format())
    except ServerUnavailable as error:
        if args.debug:
            raise
        print(f"ds-capture regenerate: error: {error}", file=sys.stderr)
        return RERUN_EXIT_CODE
    finally:
        if main_thread:
            signal.signal(signal.SIGTERM, previous)
    return 0


_COMMANDS = {"run": _cmd_run, "serve": _cmd_serve, "plan": _cmd_plan, "verify": _cmd_verify, "inspect": _cmd_inspect,
             "compare": _cmd_compare, "regenerate": _cmd_regenerate}


# Recipe headers: the "ds-capture plan says:" block of a recipe in configs/ lists the plan command lines it was
# made from; these rerun them (tests/unit/test_plan_recipes.py, tools/plan_headers.py).


def plan_from_command(command: str) -> Any:
    """Run the ``ds-capture plan ...`` command line of a header (relative paths from the repository root)."""
    import shlex

    from ds_capture.recipe.config import load_config
    from ds_capture.sizing.command import plan_capture

    args = build_parser().parse_args(shlex.split(command)[1:])
    return plan_capture(load_config(args.config, args.overrides), world_size=args.world_size,
                        gpu_memory_gib=args.gpu_memory_gib, serve_rows=_serve_rows(args))


def regenerate_header(text: str) -> tuple[str, list[tuple[str, Any]]]:
    """``text`` (a recipe) with its plan block rewritten from its own commands; also (command, report) pairs."""
    from ds_capture.sizing.report import BLOCK_END, BLOCK_START, COMMAND_PREFIX, header_lines

    lines = text.split("\n")
    start, end = lines.index(BLOCK_START), lines.index(BLOCK_END)
    commands = [line[len(COMMAND_PREFIX):] for line in lines[start + 1:end] if line.startswith(COMMAND_PREFIX)]
    block, runs = [BLOCK_START], []
    for command in commands:
        report = plan_from_command(command)
        runs.append((command, report))
        block += [COMMAND_PREFIX + command, *header_lines(report)]
    return "\n".join(lines[:start] + block + lines[end:]), runs
