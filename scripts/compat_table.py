"""Print (or, with --write, update in docs/) the tables the documentation takes from the code: TrainingArguments'
fields and transformers.Trainer's methods (docs/hugging-face.md), every error the package raises
(docs/troubleshooting.md).

    .venv/bin/python scripts/compat_table.py           # print them
    .venv/bin/python scripts/compat_table.py --write   # replace the tables between the pages' markers

The tables are generated from `shardtrain.train.arguments` / `hf_compat` (fields), `hf_methods` (methods) and the
`raise` statements of `src/shardtrain` (errors); tests/unit/test_compat_table.py, test_hf_methods.py and
test_docs.py fail when a page and the code disagree.
"""

import ast
import inspect
import sys
from pathlib import Path

from shardtrain import Trainer, errors
from shardtrain.train.args.hf_methods import methods_table
from shardtrain.train.arguments import compatibility_markdown

REPO = Path(__file__).resolve().parents[1]
SOURCE = REPO / "src" / "shardtrain"


def error_classes() -> dict[str, type]:
    """The package's error classes (`UserError` and its subclasses in `shardtrain.errors`)."""
    return {name: cls for name, cls in vars(errors).items()
            if inspect.isclass(cls) and issubclass(cls, errors.UserError)}


def _message(node: ast.expr) -> str:
    """An error message as written: f-string fields shown as `{expression}`."""
    if isinstance(node, ast.Constant) and isinstance(node.value, str):
        return node.value
    if isinstance(node, ast.JoinedStr):
        return "".join(v.value if isinstance(v, ast.Constant) else "{" + ast.unparse(v.value) + "}"
                       for v in node.values)
    if isinstance(node, ast.BinOp) and isinstance(node.op, ast.Add):
        return _message(node.left) + _message(node.right)
    return "{" + ast.unparse(node) + "}"


def raised_errors() -> dict[str, list[tuple[str, str]]]:
    """For each error class, (module, message) of every `raise ErrorClass(message, ...)` in the package."""
    names = set(error_classes())
    found: dict[str, list[tuple[str, str]]] = {name: [] for name in names}
    for path in sorted(SOURCE.rglob("*.py")):
        module = ".".join(path.relative_to(SOURCE.parent).with_suffix("").parts)
        for node in ast.walk(ast.parse(path.read_text())):
            call = node.exc if isinstance(node, ast.Raise) else None
            if isinstance(call, ast.Call) and isinstance(call.func, ast.Name) and call.func.id in names:
                message = _message(call.args[0]) if call.args else "(no message)"
                found[call.func.id].append((module, " ".join(message.split())))
    return found


def _escaped(text: str) -> str:
    """Plain text in Markdown: no emphasis, HTML or table cells made of a message's characters."""
    for char, code in (("&", "&amp;"), ("<", "&lt;"), (">", "&gt;"), ("|", "&#124;"), ("*", "&#42;"),
                       ("_", "&#95;"), ("`", "&#96;"), ("[", "&#91;")):
        text = text.replace(char, code)
    return text


def errors_markdown() -> str:
    """The troubleshooting reference: each error class, what it means, and every message it is raised with."""
    out = []
    raised = raised_errors()
    for name, cls in sorted(error_classes().items()):
        bases = ", ".join(b.__name__ for b in cls.__bases__)
        out.append(f"### {name}\n\n*{bases}* — {inspect.getdoc(cls) or ''}\n")
        for module, message in dict.fromkeys(raised[name]):  # each message once, in source order
            out.append(f"- `{module}`: {_escaped(message)}")
        out.append("")
    return "\n".join(out) + "\n"


API_GROUPS = {
    "Trainer and arguments": ["Trainer", "TrainingArguments", "Seq2SeqTrainer", "Seq2SeqTrainingArguments",
                              "TrainerCallback", "TrainerControl", "TrainerState", "EvalPrediction"],
    "Other libraries' trainers on the engine": ["on_engine", "arguments_on_engine"],
    "FSDP2 without the Trainer": ["FSDPConfig", "apply_fsdp", "load_pretrained", "init_distributed",
                                  "destroy_distributed", "CheckpointManager"],
    "Planning": ["plan"],
    "Errors": ["UserError", "CheckpointError", "DataError", "FSDPConfigError", "TrainingArgumentsError"],
}


def api_markdown() -> str:
    """The API reference: every name `shardtrain` exports, in `API_GROUPS`. A name defined in shardtrain's
    source is rendered by mkdocstrings (`::: path`); one built at run time or taken from transformers gets its
    docstring as text and where it comes from."""
    import importlib

    from shardtrain import _EXPORTS

    listed = [name for names in API_GROUPS.values() for name in names]
    assert sorted(listed) == sorted(_EXPORTS), \
        f"API_GROUPS and shardtrain's exports differ: {set(listed) ^ set(_EXPORTS)}"
    out = []
    for title, names in API_GROUPS.items():
        out += [f"## {title}", ""]
        for name in names:
            module = _EXPORTS[name]
            if module == f"shardtrain.{name}":  # a callable subpackage
                out += [f"::: {module}", "    options:", "      heading_level: 3", ""]
                continue
            obj = getattr(importlib.import_module(module), name)
            source = (SOURCE.parent / (obj.__module__.replace(".", "/") + ".py"))
            defined = source.exists() and any(line.startswith((f"class {name}", f"def {name}"))
                                              for line in source.read_text().splitlines())
            if defined:
                out += [f"::: {obj.__module__}.{name}", "    options:", "      heading_level: 3", ""]
            else:
                summary = (inspect.getdoc(obj) or "").split("\n\n")[0]
                out += [f"### {name}", "", f"`shardtrain.{name}` is `{obj.__module__}.{obj.__qualname__}`"
                        + (" (built on shardtrain's engine at import)." if obj.__module__.startswith("shardtrain")
                           else ", re-exported unchanged."), "", summary, ""]
    return "\n".join(out) + "\n"


PAGES = {
    "hugging-face.md": {"compat-table": compatibility_markdown,
                        "methods-table": lambda: methods_table(set(vars(Trainer)))},
    "troubleshooting.md": {"errors-table": errors_markdown},
    "reference/api.md": {"api-table": api_markdown},
}


def page_with_tables(text: str, tables: dict) -> str:
    """`text` with the part between each table's markers replaced by the current table."""
    for name, render in tables.items():
        start, end = f"<!-- {name}:start -->\n", f"<!-- {name}:end -->\n"
        head, rest = text.split(start, 1)
        _, tail = rest.split(end, 1)
        text = head + start + render() + end + tail
    return text


if __name__ == "__main__":
    for page, tables in PAGES.items():
        path = REPO / "docs" / page
        if "--write" in sys.argv:
            path.write_text(page_with_tables(path.read_text(), tables))
        else:
            print("".join(render() for render in tables.values()), end="")
