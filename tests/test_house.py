"""The package's shape: imports point down the layers with no circle (lazy imports inside functions
count), no module is over 600 lines, few modules sit at the top, `--help` needs no jax, the encoder
is a small facade and nothing outside runtime/ reaches into its private members."""

from __future__ import annotations

import ast
import pathlib
import re
import subprocess
import sys

import pytest

ROOT = pathlib.Path(__file__).resolve().parents[1] / "qwen_vit_jax"
# Lowest first: a module may import its own subpackage's modules and any lower layer, nothing else.
LAYERS = {
    "files": 0,
    "errors": 0,
    "processes": 0,
    "families": 1,
    "config": 2,
    "presets": 3,
    "plan": 4,
    "preprocess": 5,
    "model": 6,
    "weights": 7,
    "prompt": 8,
    "runtime": 9,
    "data": 10,
    "vllm": 11,  # vLLM's request form and encoder-cache store: below the service and the CLI that write it
    "serve": 12,
    "tools": 13,
    "__init__": 14,
    "__main__": 14,
}
MAX_LINES = 600
_LAZY = ("_EXPORTS", "_MODULES")  # a package __init__'s tables of modules imported on first use
MAX_TOP_MODULES = 7


def _modules() -> dict[str, pathlib.Path]:
    """Dotted name -> file of every module of the package (a package is its __init__)."""
    out = {}
    for path in sorted(ROOT.rglob("*.py")):
        parts = list(path.relative_to(ROOT.parent).with_suffix("").parts)
        if parts[-1] == "__init__":
            parts = parts[:-1]
        out[".".join(parts)] = path
    return out


MODULES = _modules()


def _imports(name: str, path: pathlib.Path) -> set[str]:
    """The package's modules that `name` imports anywhere in its file (functions included), and the
    modules of a package's lazy tables (`_LAZY`)."""
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    found = set()
    tree = ast.parse(path.read_text())
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            found.update(a.name for a in node.names)
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                anchor = package.split(".")[: len(package.split(".")) - node.level + 1]
                base = ".".join([*anchor, base] if base else anchor)
            for a in node.names:
                found.add(f"{base}.{a.name}" if f"{base}.{a.name}" in MODULES else base)
        elif path.name == "__init__.py" and isinstance(node, ast.Assign) and ast.unparse(node.targets[0]) in _LAZY:
            found.update(f"{name}.{v.value}" for v in node.value.values)  # a lazy name -> module table
    return {m for m in found if m in MODULES and m != name}


GRAPH = {name: _imports(name, path) for name, path in MODULES.items()}


def _layer(name: str) -> tuple[str, int]:
    parts = name.split(".")
    top = parts[1] if len(parts) > 1 else "__init__"
    assert top in LAYERS, f"{name}: a module outside the layers of this test ({', '.join(LAYERS)})"
    return top, LAYERS[top]


def test_every_import_points_down_the_layers():
    upward = []
    for name, targets in GRAPH.items():
        own, rank = _layer(name)
        for t in sorted(targets):
            theirs, their_rank = _layer(t)
            if theirs != own and their_rank >= rank:
                upward.append(f"{name} -> {t}")
    assert not upward, "imports that do not point down the layers:\n" + "\n".join(upward)


def test_no_test_imports_another_test_file():
    """Tests share helpers through helper modules (tests/towers.py, benchmarks/workloads, ...), never
    by importing a test file: lazy imports inside functions count."""
    offenders = []
    for f in sorted(ROOT.parent.glob("tests/*.py")):
        for node in ast.walk(ast.parse(f.read_text())):
            names = [a.name for a in node.names] if isinstance(node, ast.Import) else []
            if isinstance(node, ast.ImportFrom) and node.module:
                names = [node.module] + (
                    [f"{node.module}.{a.name}" for a in node.names] if node.module == "tests" else []
                )
            offenders += [f"{f.name}: {n}" for n in names if n.rpartition(".")[2].startswith("test_")]
    assert not offenders, "tests importing test files:\n" + "\n".join(offenders)


def test_no_import_circle():
    state: dict[str, int] = {}  # 1: on the current path, 2: done
    path: list[str] = []

    def visit(m: str):
        state[m] = 1
        path.append(m)
        for t in sorted(GRAPH[m]):
            if state.get(t) == 1:
                raise AssertionError("import circle: " + " -> ".join(path[path.index(t) :] + [t]))
            if t not in state:
                visit(t)
        path.pop()
        state[m] = 2

    for m in sorted(GRAPH):
        if m not in state:
            visit(m)


def test_the_graph_is_read():
    """The walk sees lazy imports inside functions and the top-level lazy table (so the two tests
    above would see an upward or circular import there)."""
    assert "qwen_vit_jax.weights.sources" in GRAPH["qwen_vit_jax.runtime.encoder"]  # inside from_pretrained
    assert "qwen_vit_jax.runtime.encoder" in GRAPH["qwen_vit_jax"]  # the _EXPORTS table
    assert "qwen_vit_jax.data" in GRAPH["qwen_vit_jax"]  # the _MODULES table
    assert "qwen_vit_jax.data.pipeline" in GRAPH["qwen_vit_jax.data"]
    assert "qwen_vit_jax.plan.grid" in GRAPH["qwen_vit_jax.plan.assembly"]  # a relative import


def test_module_sizes():
    long = {n: len(p.read_text().splitlines()) for n, p in MODULES.items()}
    over = {n: k for n, k in long.items() if k > MAX_LINES}
    assert not over, f"modules over {MAX_LINES} lines: {over}"
    top = sorted(p.name for p in ROOT.glob("*.py"))
    assert len(top) <= MAX_TOP_MODULES, f"{len(top)} modules directly in qwen_vit_jax/: {top}"


def test_help_imports_no_jax():
    code = (
        "import sys; from qwen_vit_jax.tools.cli import main; rc = main(['--help']); "
        "assert rc == 0; heavy = [m for m in ('jax', 'flax', 'numba', 'torch') if m in sys.modules]; "
        "assert not heavy, heavy"
    )
    p = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert p.returncode == 0, p.stderr


@pytest.mark.parametrize("command", ["encode", "aot", "demo", "convert", "serve"])
def test_command_help_imports_no_jax(command):
    code = (
        f"import sys; from qwen_vit_jax.tools.cli import main; rc = main(['{command}', '--help']); "
        "assert rc == 0; heavy = [m for m in ('jax', 'flax', 'numba', 'torch') if m in sys.modules]; "
        "assert not heavy, heavy"
    )
    p = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert p.returncode == 0, p.stderr


def test_a_worker_imports_no_jax():
    """A preprocessing worker process unpickles `pipeline.Prepare` and runs it: neither may import
    the plan, jax or flax (a worker's start-up is Python + Grain's own imports)."""
    code = (
        "import sys, numpy as np; from qwen_vit_jax.data.pipeline import Prepare; "
        "from qwen_vit_jax.preprocess.config import PreprocessConfig; c = PreprocessConfig(); "
        "out = Prepare(c, c, 'qwen2_5_vl', False)(('x', np.zeros((56, 56, 3), np.uint8))); "
        "assert out['data'].shape == (16, 1, 14, 14, 3), out; "
        "heavy = [m for m in ('jax', 'flax', 'torch', 'qwen_vit_jax.plan') if m in sys.modules]; "
        "assert not heavy, heavy"
    )
    p = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert p.returncode == 0, p.stderr


REPO = ROOT.parent
MAX_ENCODER_LINES = 250
# Where code may use the encoder: everything but runtime/, which holds the encoder and its parts.
OUTSIDE = ["benchmarks", "tests", "examples", "notebooks", *(f"qwen_vit_jax/{p.name}" for p in ROOT.iterdir())]


def _private_names() -> set[str]:
    """The private members of the encoder and its parts: every `self._name` the facade and the parts
    define (runtime/*.py and the plan layer's bucket choice)."""
    names = set()
    for path in [*(ROOT / "runtime").glob("*.py"), ROOT / "plan" / "choice.py"]:
        names.update(re.findall(r"\bself\.(_[a-z]\w*)\s*(?::[^=\n]*)?=", path.read_text()))
        names.update(re.findall(r"^\s+def (_[a-z]\w*)\(", path.read_text(), re.M))
    return names


def test_no_private_encoder_access_outside_runtime():
    """Benchmarks, tests, examples, notebooks and the package outside runtime/ use the encoder's and
    its parts' public names (enc.programs, enc.bucket_choice, enc.prepare / run, ...), never a
    private member: `enc._x`, `encoder._x`, or any name.`_x` where `_x` is one of the parts' own."""
    names = _private_names()
    assert {"_compiled", "_declared"} <= names  # the parts' members are seen
    own = re.compile(r"\b(?!self\b)\w+\.(" + "|".join(sorted(names)) + r")\b")
    named = re.compile(r"\b\w*(?:enc|encoder)\._\w")
    found = []
    for top in OUTSIDE:
        base = REPO / top
        files = [base] if base.is_file() else sorted(base.rglob("*"))
        for path in files:
            if path.suffix not in (".py", ".ipynb", ".sh") or path.name == "test_house.py" or "runtime" in path.parts:
                continue
            for i, line in enumerate(path.read_text().splitlines(), 1):
                if named.search(line) or own.search(line):
                    found.append(f"{path.relative_to(REPO)}:{i}: {line.strip()}")
    assert not found, "private encoder members used outside runtime/:\n" + "\n".join(found)


def test_encoder_is_a_small_facade():
    n = len((ROOT / "runtime" / "encoder.py").read_text().splitlines())
    assert n < MAX_ENCODER_LINES, f"runtime/encoder.py has {n} lines; its parts hold the work (<{MAX_ENCODER_LINES})"


def _names(path: pathlib.Path) -> set[str]:
    """Every name and attribute a module's code uses (ast.Name ids and ast.Attribute attrs)."""
    tree = ast.parse(path.read_text())
    return {n.id for n in ast.walk(tree) if isinstance(n, ast.Name)} | {
        n.attr for n in ast.walk(tree) if isinstance(n, ast.Attribute)
    }


GROUPING_CALLERS = ("runtime/encoder.py", "data/encode_files.py", "serve/batcher.py")


def test_one_grouping_rule_serves_every_caller():
    """Which items share a device call is decided in runtime/batching.py alone: encode_patches, the
    CLI's encode loop and the service's batcher all group with its `Grouping`, and no module outside
    runtime/ and plan/ reads the pieces of the rule (frame classes, batch rows, pixel tables)."""
    for rel in GROUPING_CALLERS:
        name = "qwen_vit_jax." + rel[:-3].replace("/", ".")
        assert "qwen_vit_jax.runtime.batching" in GRAPH[name], f"{rel} does not group with runtime/batching.py"
        used = _names(ROOT / rel)
        assert "Grouping" in used and used & {"pack", "take", "joins", "Packer"}, f"{rel} does not use Grouping"
    pieces = {"frame_class", "batch_rows", "make_batch_plan", "batch_plans"}
    for name, path in MODULES.items():
        if _layer(name)[0] not in ("runtime", "plan"):
            assert not _names(path) & pieces, f"{name} reads a piece of the grouping rule: {_names(path) & pieces}"
    assert "table" not in _names(ROOT / "data" / "encode_files.py")  # the pixel form is the rule's


def test_the_batcher_keeps_only_the_queue():
    """serve/batcher.py keeps the queue, the wait, the futures and the compile thread: it imports
    nothing from plan/ but `Patches` and touches neither the encoder's programs nor its bucket choice
    (the encoder plans, checks and compiles a batch: prepare_batch, ready, compile)."""
    path = ROOT / "serve" / "batcher.py"
    tree = ast.parse(path.read_text())
    from_plan = [
        a.name
        for n in ast.walk(tree)
        if isinstance(n, ast.ImportFrom) and (n.module or "").startswith("qwen_vit_jax.plan")
        for a in n.names
    ]
    assert from_plan == ["Patches"], from_plan
    assert not {m for m in GRAPH["qwen_vit_jax.serve.batcher"] if m.startswith("qwen_vit_jax.plan.")} - {
        "qwen_vit_jax.plan.contract"
    }
    assert not _names(path) & {"programs", "bucket_choice", "policy", "mesh", "devices"}, _names(path)


def test_one_device_is_a_mesh_of_one():
    """Only runtime/program.py (`Programs`) asks how many devices there are: no `mesh is None`, no
    `len(devices) > 1` or `== 1` anywhere else."""
    asks = re.compile(r"mesh is (not )?None|len\([\w.]*devices\) (>|==|<=|!=) 1|devices if len")
    found = [
        f"{name}: {line.strip()}"
        for name, path in MODULES.items()
        if name != "qwen_vit_jax.runtime.program"
        for line in path.read_text().splitlines()
        if asks.search(line)
    ]
    assert not found, "one-device-or-mesh checks outside Programs:\n" + "\n".join(found)
