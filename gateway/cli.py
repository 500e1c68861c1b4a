"""The ``specgate`` command: ``serve``, ``models pull|list|verify``, ``generate``, ``router calibrate``.

argparse keeps the CLI dependency-free; heavy imports (torch, the web stack) happen inside the
subcommand that needs them, so ``specgate models list`` answers instantly.
"""

from __future__ import annotations

import argparse
import logging
import sys
from typing import Any

from router.cli import add_router_commands


def _models_pull(args: argparse.Namespace) -> int:
    from decoding import store

    names = args.names or list(store.PINNED)
    for name in names:
        try:
            path = store.pull(name)
        except store.StoreError as exc:
            print(f"error: {exc}", file=sys.stderr)
            return 1
        print(f"{store.canonical(name)}: {path}")
    return 0


def _models_verify(args: argparse.Namespace) -> int:
    from decoding import store

    bad = 0
    for name in args.names or [a for a in store.PINNED if store.is_cached(a)]:
        alias = store.canonical(name)
        if alias not in store.PINNED:
            print(
                f"error: unknown model alias '{name}'; pinned models: {', '.join(store.PINNED)}",
                file=sys.stderr,
            )
            return 1
        problems = store.check(alias)
        if problems and problems[0].endswith("(no checksums were recorded for this directory)"):
            bad += 1
            print(
                f"{alias}: not verifiable yet; `specgate models pull {alias}` records its checksums",
                file=sys.stderr,
            )
        elif problems:
            bad += 1
            for line in problems:
                print(f"error: {line}", file=sys.stderr)
            print(f"{alias}: damaged; run `specgate models pull {alias}` to rebuild it", file=sys.stderr)
        else:
            print(f"{alias}: ok")
    return 1 if bad else 0


def _models_list(args: argparse.Namespace) -> int:
    from decoding import store

    rows = store.cached()
    print(f"store: {store.home()}")
    if not rows:
        print("no models cached; run `specgate models pull`")
    for alias, path, size in rows:
        print(f"{alias:24s} {size / 1e9:6.2f} GB  {path}")
    missing = [a for a in store.PINNED if not store.is_cached(a)]
    for alias in missing:
        print(f"{alias:24s} (not pulled) {store.PINNED[alias].description}")
    return 0


def _generate(args: argparse.Namespace) -> int:
    from decoding.engine import Engine
    from decoding.loader import ModelSpec, load_all
    from decoding.params import GenerationRequest, SamplingParams, SpecMode, SpecParams

    specs = [ModelSpec("target", args.model, draft=None if args.no_spec else "draft", dtype=args.dtype)]
    if not args.no_spec:
        specs.append(ModelSpec("draft", args.draft, dtype=args.dtype))
    models = load_all(specs)
    engine = Engine(models)
    tok: Any = models["target"].tokenizer
    if args.raw:
        ids = tok(args.prompt)["input_ids"]
    else:
        ids = tok.apply_chat_template(
            [{"role": "user", "content": args.prompt}], add_generation_prompt=True, tokenize=True
        )["input_ids"]
    mode = SpecMode.OFF if args.no_spec else SpecMode(args.drafter)
    req = GenerationRequest(
        "cli",
        "target",
        list(ids),
        SamplingParams(max_tokens=args.max_tokens, temperature=args.temperature, seed=args.seed),
        SpecParams(mode=mode, max_k=args.k, adaptive=not args.fixed_k),
    )
    out, stats, finish = engine.generate(req)
    print(tok.decode(out, skip_special_tokens=True))
    tps = stats.completion_tokens / stats.decode_s if stats.decode_s else 0.0
    print(
        f"\n-- {stats.completion_tokens} tokens, finish={finish.value}, {tps:.2f} tok/s decode, "
        f"prefill {stats.prefill_s:.2f}s, drafter={stats.drafter}, steps={stats.steps}, "
        f"drafted={stats.drafted}, accepted={stats.accepted} ({stats.acceptance_rate:.0%}), "
        f"tokens/step={stats.tokens_per_step:.2f}",
        file=sys.stderr,
    )
    return 0


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="specgate", description=__doc__)
    p.add_argument("-v", "--verbose", action="store_true")
    sub = p.add_subparsers(dest="command", required=True)

    serve = sub.add_parser("serve", help="run the OpenAI-compatible gateway")
    serve.add_argument("--config", help="YAML settings file")
    serve.add_argument("--host")
    serve.add_argument("--port", type=int)
    serve.add_argument(
        "--api-key", action="append", dest="api_keys", help="require this bearer key (repeatable)"
    )
    serve.add_argument(
        "--stream-granularity", choices=["step", "token"], help="SSE chunk per engine step or per token"
    )
    serve.set_defaults(func=_serve)

    models = sub.add_parser("models", help="the local model store").add_subparsers(
        dest="models_cmd", required=True
    )
    pull = models.add_parser("pull", help="download, verify and convert pinned models")
    pull.add_argument("names", nargs="*", help="aliases (default: the default pair)")
    pull.set_defaults(func=_models_pull)
    models.add_parser("list", help="show cached models").set_defaults(func=_models_list)
    verify = models.add_parser("verify", help="check pulled models against their recorded sha256s")
    verify.add_argument("names", nargs="*", help="aliases (default: every pulled one)")
    verify.set_defaults(func=_models_verify)

    gen = sub.add_parser("generate", help="generate one completion without the server")
    gen.add_argument("prompt")
    gen.add_argument("--model", default="qwen2.5-coder-1.5b")
    gen.add_argument("--draft", default="qwen2.5-coder-0.5b")
    gen.add_argument("--no-spec", action="store_true", help="plain decoding")
    gen.add_argument("--drafter", choices=["auto", "draft", "ngram"], default="draft")
    gen.add_argument("--k", type=int, default=8, help="maximum draft length")
    gen.add_argument("--fixed-k", action="store_true", help="always draft k tokens")
    gen.add_argument("--max-tokens", type=int, default=128)
    gen.add_argument("--temperature", type=float, default=0.0)
    gen.add_argument("--seed", type=int)
    gen.add_argument("--dtype", default="auto")
    gen.add_argument("--raw", action="store_true", help="no chat template")
    gen.set_defaults(func=_generate)
    add_router_commands(sub)  # `specgate router calibrate` (router/cli.py)
    return p


def _serve(args: argparse.Namespace) -> int:
    from gateway.server import serve

    flags: dict[str, object] = {"stream_granularity": args.stream_granularity}
    if args.api_keys:
        flags["auth"] = {"api_keys": args.api_keys}
    return serve(config=args.config, host=args.host, port=args.port, **flags)


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    logging.basicConfig(
        level=logging.DEBUG if args.verbose else logging.INFO, format="%(levelname)s %(name)s: %(message)s"
    )
    return int(args.func(args) or 0)


if __name__ == "__main__":
    sys.exit(main())
