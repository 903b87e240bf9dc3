"""Tracker credentials, checked before the first step: a `report_to` tracker that would stop the run at its
first log (no API key and not offline) is one `error:` line naming the variable to set, before anything runs.

    problem = tracker_problem(["wandb", "tensorboard"], os.environ)   # None, or what to set

Weights & Biases, Comet and SwanLab need an account unless they run offline; each raises at `init` otherwise
(seen with wandb 0.31, comet_ml 3.58, swanlab 0.7). MLflow, TensorBoard and Trackio write locally.
"""

from __future__ import annotations

import netrc
import os
import sys
from collections.abc import Callable, Mapping
from pathlib import Path
from urllib.parse import urlparse

from shardtrain.config.values import FALSE_WORDS, TRUE_WORDS


def _word(environ: Mapping[str, str], name: str) -> str:
    return environ.get(name, "").strip().lower()


def _netrc_has(path: Path, host: str) -> bool:
    try:
        return netrc.netrc(str(path)).authenticators(host) is not None
    except (OSError, netrc.NetrcParseError):
        return False


def _wandb(environ: Mapping[str, str]) -> str | None:
    if _word(environ, "WANDB_MODE") in ("offline", "disabled", "dryrun") or _word(environ, "WANDB_DISABLED") in \
            TRUE_WORDS:
        return None
    if environ.get("WANDB_API_KEY") or environ.get("WANDB_IDENTITY_TOKEN_FILE"):
        return None
    host = urlparse(environ.get("WANDB_BASE_URL") or "https://api.wandb.ai").hostname or "api.wandb.ai"
    file = Path(environ.get("NETRC") or Path.home() / ".netrc")
    if _netrc_has(file, host):
        return None
    return (f"report_to includes 'wandb', but Weights & Biases has no API key here (WANDB_API_KEY is unset and "
            f"{file} has no entry for {host}) and is not offline; set WANDB_API_KEY (or run `wandb login`), or "
            f"set WANDB_MODE=offline")


def _comet(environ: Mapping[str, str]) -> str | None:
    if _word(environ, "COMET_START_ONLINE") in FALSE_WORDS or _word(environ, "COMET_MODE") == "disabled" or \
            environ.get("COMET_API_KEY"):
        return None
    try:  # ~/.comet.config and the other places comet_ml reads (transformers asks it the same way)
        import comet_ml

        if comet_ml.config.get_config("comet.api_key") is not None:
            return None
    except Exception:  # noqa: BLE001 - an unreadable comet config is a missing key
        pass
    return ("report_to includes 'comet_ml', but Comet has no API key here (COMET_API_KEY is unset, no "
            "~/.comet.config) and is online; set COMET_API_KEY, or set COMET_START_ONLINE=false (offline)")


def _swanlab(environ: Mapping[str, str]) -> str | None:
    if _word(environ, "SWANLAB_MODE") in ("local", "offline", "disabled") or environ.get("SWANLAB_API_KEY"):
        return None
    folder = Path(environ.get("SWANLAB_SAVE_DIR") or Path.home() / ".swanlab")
    if (folder / ".netrc").is_file():  # `swanlab login` keeps the key there
        return None
    return (f"report_to includes 'swanlab', but SwanLab has no API key here (SWANLAB_API_KEY is unset, no "
            f"{folder / '.netrc'}) and runs in the cloud; set SWANLAB_API_KEY (or run `swanlab login`), or set "
            f"SWANLAB_MODE=offline")


CHECKS: dict[str, Callable[[Mapping[str, str]], str | None]] = {"wandb": _wandb, "comet_ml": _comet,
                                                                 "swanlab": _swanlab}


def tracker_problem(reporters: list[str], environ: Mapping[str, str] = os.environ) -> str | None:
    """What a `report_to` tracker lacks to start here, or None (also None on a terminal, where it would ask)."""
    if sys.stdin is not None and sys.stdin.isatty():
        return None
    for name in reporters:
        problem = CHECKS.get(name, lambda _: None)(environ)
        if problem is not None:
            return problem
    return None
