"""The documentation site (`docs/`, built by `mkdocs build --strict` in the test command): every exported name and
every error class has its entry, every page is in the navigation, and the README stays a page or two that links
to pages which exist."""

import re
from pathlib import Path

import yaml

import shardtrain
from shardtrain import errors

REPO = Path(__file__).resolve().parents[2]
DOCS = REPO / "docs"


def _nav_pages(nav) -> list[str]:
    pages = []
    for item in nav:
        for value in item.values():
            pages += _nav_pages(value) if isinstance(value, list) else [value]
    return pages


def test_every_exported_name_has_an_api_entry():
    page = (DOCS / "reference" / "api.md").read_text()
    for name in shardtrain.__all__:
        assert re.search(rf"^(::: [\w.]*\b{name}|### {name})$", page, flags=re.M), f"{name} has no entry in api.md"


def test_every_error_class_has_a_troubleshooting_entry():
    page = (DOCS / "troubleshooting.md").read_text()
    classes = [n for n, c in vars(errors).items() if isinstance(c, type) and issubclass(c, errors.UserError)]
    assert len(classes) >= 15
    for name in classes:
        assert f"### {name}\n" in page, f"{name} has no entry in troubleshooting.md"


def test_every_page_is_in_the_navigation():
    config = yaml.safe_load((REPO / "mkdocs.yml").read_text())
    nav = set(_nav_pages(config["nav"]))
    pages = {str(p.relative_to(DOCS)) for p in DOCS.rglob("*.md")}
    assert pages == nav, pages ^ nav


def test_readme_fits_on_a_screen_or_two_and_links_to_pages_that_exist():
    text = (REPO / "README.md").read_text()
    assert len(text.splitlines()) <= 150
    assert text.splitlines()[9:11] == [
        "bash scripts/demo.sh      # main job: 2-rank FSDP2 training on built-in data -> checkpoint, final model, "
        "summary",
        "bash scripts/test.sh      # tests: creates .venv (torch==2.13.0 CPU + shardtrain[dev]) and the XLA venv, "
        "runs pytest"]
    links = re.findall(r"\]\((docs/[^)]+)\)", text)
    assert len(links) >= 10
    for link in links:
        assert (REPO / link).is_file(), link


def _help(*command: str) -> str:
    import argparse

    from shardtrain.cli.main import build_parser

    parser = build_parser()
    sub = next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction)).choices[command[0]]
    return sub.format_help()


def test_help_texts_name_every_choice_the_code_has():
    from shardtrain.parallel.pipeline_settings import SCHEDULES

    plan = " ".join(_help("plan").split())  # argparse wraps lines
    for schedule in SCHEDULES:
        assert re.search(rf"\b{schedule}\b", plan), f"`shardtrain plan --help` leaves out the {schedule} schedule"
    lighthouse = _help("lighthouse")
    assert "quorum" in lighthouse and "example:" in lighthouse and "--lighthouse http://" in lighthouse
    launch = _help("launch")
    flags = set(re.findall(r"--(parallelism_config_\w+?)_size", launch))
    page = (DOCS / "command-line.md").read_text()
    named = set(re.findall(r"--parallelism_config_\{([\w,]+)\}_size", page)[0].split(","))
    assert {f.removeprefix("parallelism_config_") for f in flags} == named, "command-line.md's parallelism flags"
