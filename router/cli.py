"""`specgate router ...` subcommands, hooked into gateway/cli.py's parser by `add_router_commands`."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from router.config import RouterSettings


def _settings(config: str | None) -> RouterSettings:
    # Imports stay inside so `specgate --help` does not pay for pydantic and yaml.
    import yaml

    from router.config import RouterSettings

    if config is None:
        return RouterSettings()
    data = yaml.safe_load(Path(config).read_text(encoding="utf-8")) or {}
    return RouterSettings.model_validate(data.get("router") or {})


def _calibrate(args: argparse.Namespace) -> int:
    from pydantic import ValidationError

    from router.calibrate import calibrate, render

    try:
        print(render(calibrate(args.examples, _settings(args.config))))
    except (OSError, ValueError, ValidationError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 1
    return 0


def add_router_commands(subparsers: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    router = subparsers.add_parser("router", help="the complexity router").add_subparsers(
        dest="router_cmd", required=True
    )
    cal = router.add_parser("calibrate", help="fit tier thresholds to labelled example prompts")
    cal.add_argument("examples", help="JSON lines: {prompt|messages, tier[, max_tokens]}")
    cal.add_argument("--config", help="YAML settings file whose `router:` section defines the tiers")
    cal.set_defaults(func=_calibrate)
