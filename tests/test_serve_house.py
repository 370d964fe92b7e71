"""The service's shape, as test_house.py checks the package's: HTTP status codes are chosen in one
module of serve/ (statuses.py), and `qwen-vit-jax serve`'s flags and defaults come from `Settings`
(one source, which the Ray app reads too)."""

from __future__ import annotations

import ast
import dataclasses
import http
import pathlib
import re

SERVE = pathlib.Path(__file__).resolve().parents[1] / "qwen_vit_jax" / "serve"
HOME = "statuses.py"  # the one module that chooses status codes, metric labels and bodies
CODES = {int(s) for s in http.HTTPStatus} | {499}  # (499: a client that went away, nginx's)
STATUS_LINE = re.compile(r"HTTP/1\.[01] \d{3}")


def test_status_codes_are_chosen_in_one_module():
    """No other module of serve/ writes a status code: no integer that is one (a count that happens
    to equal one gets another value or a name from statuses.py), no status line."""
    found = []
    for path in sorted(SERVE.glob("*.py")):
        if path.name == HOME:
            continue
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Constant) and type(node.value) is int and node.value in CODES:
                found.append(f"{path.name}:{node.lineno}: {node.value}")
            elif isinstance(node, ast.Constant) and isinstance(node.value, str) and STATUS_LINE.search(node.value):
                found.append(f"{path.name}:{node.lineno}: a status line")
    assert not found, "status codes outside serve/statuses.py:\n" + "\n".join(found)
    home = (SERVE / HOME).read_text()
    assert all(str(code) in home for code in (400, 401, 408, 413, 415, 429, 431, 500, 503, 504))


def test_the_serve_flags_and_defaults_come_from_settings():
    """Every Settings field is a flag of `serve` and every flag but --log-level a field; no flag has a
    default of its own (the parser's are None: an absent flag leaves the field's default); and
    `serve CKPT` with no flags makes exactly Settings(checkpoint=CKPT)."""
    from qwen_vit_jax.serve.cli import settings_from
    from qwen_vit_jax.serve.settings import FIELDS, Settings
    from qwen_vit_jax.tools.cli import build_parser

    tree = ast.parse((SERVE / "cli.py").read_text())
    own = [
        ast.unparse(c.args[0]) if c.args else "?"
        for c in ast.walk(tree)
        if isinstance(c, ast.Call)
        and getattr(c.func, "attr", "") == "add_argument"
        and any(k.arg == "default" for k in c.keywords)
    ]
    assert own == ["'--log-level'"], own  # the one flag that is not a setting: the process's logging
    args = build_parser().parse_args(["serve", "ckpt"])
    dests = set(vars(args)) - {"command", "func", "log_level"}
    assert dests == set(FIELDS), dests ^ set(FIELDS)
    assert all(getattr(args, d) is None for d in dests - {"checkpoint"})
    assert settings_from(args) == Settings(checkpoint="ckpt")
    assert all(f.metadata.get("help") for f in dataclasses.fields(Settings))
