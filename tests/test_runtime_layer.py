"""The runtime layer is the only door to torch_xla: no other module imports it or sets XLA's
environment variables; the launcher and config validation never import torch; the version check
says one line."""

from __future__ import annotations

import ast
import subprocess
import sys

from helpers import REPO

from torchtitan_xla.runtime.xla.process import TORCH_XLA_VERSION, version_warning

PACKAGE = REPO / "torchtitan_xla"
RUNTIME = PACKAGE / "runtime"
# Everything that is not the runtime layer: the package, the recipe, the scripts.
OUTSIDE = sorted(p for p in [*PACKAGE.rglob("*.py"), REPO / "train.py", *(REPO / "scripts").glob("*.py")]
                 if RUNTIME not in p.parents)


def _imports(tree: ast.AST) -> list[str]:
    names = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            names += [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom) and node.level == 0:
            names.append(node.module or "")
    return names


def _environ_writes(tree: ast.AST) -> list[int]:
    """Lines that change os.environ: item assignment or deletion, setdefault/update/pop, putenv."""
    lines = []
    for node in ast.walk(tree):
        targets = node.targets if isinstance(node, (ast.Assign, ast.Delete)) else (
            [node.target] if isinstance(node, ast.AugAssign) else [])
        for t in targets:
            if isinstance(t, ast.Subscript) and ast.unparse(t.value).endswith("environ"):
                lines.append(node.lineno)
        if isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute):
            owner = ast.unparse(node.func.value)
            if (owner.endswith("environ") and node.func.attr in ("setdefault", "update", "pop", "clear")
                    or node.func.attr in ("putenv", "unsetenv")):
                lines.append(node.lineno)
    return lines


def test_only_the_runtime_layer_touches_torch_xla_or_the_environment():
    assert len(OUTSIDE) > 40 and REPO / "train.py" in OUTSIDE
    offenders = []
    for path in OUTSIDE:
        text = path.read_text()
        tree = ast.parse(text)
        where = path.relative_to(REPO)
        offenders += [f"{where}: imports {m}" for m in _imports(tree)
                      if m == "torch_xla" or m.startswith("torch_xla.")]
        if "_XLAC" in text:
            offenders.append(f"{where}: mentions torch_xla._XLAC")
        offenders += [f"{where}:{line}: changes os.environ" for line in _environ_writes(tree)]
    assert offenders == []
    # The check sees what it looks for: the runtime layer does all of it.
    runtime_text = "".join(p.read_text() for p in RUNTIME.rglob("*.py"))
    assert "_XLAC" in runtime_text and "torch_xla" in _imports(ast.parse(runtime_text))
    assert _environ_writes(ast.parse("import os\nos.environ['XLA_FLAGS'] = ''\n"
                                     "os.environ.setdefault('PJRT_DEVICE', 'CPU')\n")) == [2, 3]


def test_the_shared_code_asks_the_runtime_interface_and_no_runtime_asks_the_other():
    """Outside runtime/, only `torchtitan_xla.runtime` itself is imported (its interface answers
    from the chosen runtime); runtime/xla and runtime/native never import each other."""
    implementations = ("torchtitan_xla.runtime.xla", "torchtitan_xla.runtime.native")
    offenders = [f"{p.relative_to(REPO)}: imports {m}" for p in OUTSIDE
                 for m in _imports(ast.parse(p.read_text())) if m.startswith(implementations)]
    for mine, other in (("xla", "native"), ("native", "xla")):
        offenders += [f"{p.relative_to(REPO)}: imports {m}" for p in (RUNTIME / mine).rglob("*.py")
                      for m in _imports(ast.parse(p.read_text()))
                      if m.startswith(f"torchtitan_xla.runtime.{other}")]
    assert offenders == []
    assert {p.name for p in (RUNTIME / "xla").glob("*.py")} >= {
        p.name for p in (RUNTIME / "native").glob("*.py")}  # the same modules on both sides


def test_validating_a_config_and_planning_the_launch_never_import_torch():
    """The launcher runs on every host before XLA starts and must stay cheap: reading and checking
    a config, resolving the hosts and planning each host's variables import no torch."""
    code = ("import sys\n"
            "from torchtitan_xla.config import parse_args\n"
            "from torchtitan_xla.launch import plan\n"
            "from torchtitan_xla.models import get_model_args\n"
            f"cfg = parse_args(['--job.config_file', {str(REPO / 'train_configs/llama3_8b.toml')!r}])\n"
            "plan(cfg, {'PJRT_DEVICE': 'CPU'})\n"
            "get_model_args(cfg.model.name, cfg.model.flavor, vocab_size=128256).ffn_hidden_dim\n"
            "print(sorted(m for m in sys.modules if m == 'torch' or m.startswith(('torch.', 'torch_xla'))))\n")
    p = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=REPO, timeout=60)
    assert p.returncode == 0, p.stderr[-2000:]
    assert p.stdout.strip() == "[]"


def test_another_torch_xla_release_gives_one_warning_line():
    assert version_warning(TORCH_XLA_VERSION) is None
    assert version_warning(TORCH_XLA_VERSION + "+cpu") is None  # a local build tag
    assert version_warning(None) is None  # not installed: importing it fails on its own
    assert version_warning("2.10.0") == (
        "torch_xla 2.10.0 is installed; torchtitan_xla's runtime layer (torchtitan_xla/runtime) was "
        f"written and tested for {TORCH_XLA_VERSION}: the replayed step and checkpoint helpers use "
        "private torch_xla calls that may have changed (use [compile] step = \"lazy\" if the step fails)")
    assert "\n" not in version_warning("2.10.0")


def test_no_module_of_the_package_is_over_400_lines():
    sizes = {str(p.relative_to(REPO)): len(p.read_text().splitlines()) for p in PACKAGE.rglob("*.py")}
    assert {p: n for p, n in sizes.items() if n > 400} == {}


def _package_imports() -> dict[str, set[str]]:
    """module -> the package's modules it imports (at module level or inside a function);
    `from pkg import sub` counts as importing pkg.sub."""
    modules = {}
    for p in PACKAGE.rglob("*.py"):
        parts = p.relative_to(REPO).with_suffix("").parts
        modules[".".join(parts[:-1] if parts[-1] == "__init__" else parts)] = p
    graph = {m: set() for m in modules}
    for m, p in modules.items():
        package = m if p.name == "__init__.py" else m.rpartition(".")[0]
        for node in ast.walk(ast.parse(p.read_text())):
            if isinstance(node, ast.ImportFrom):
                base = package.split(".")[:len(package.split(".")) - node.level + 1] if node.level else []
                target = ".".join([*base, *([node.module] if node.module else [])])
                subs = {f"{target}.{a.name}" for a in node.names} & modules.keys()
                graph[m] |= subs or ({target} & modules.keys())
            elif isinstance(node, ast.Import):
                graph[m] |= {a.name for a in node.names} & modules.keys()
        graph[m].discard(m)
    return graph


def test_the_package_has_no_import_cycles():
    """Each module can be read (and replaced) without the ones that import it."""
    graph = _package_imports()
    assert graph["torchtitan_xla.config.reference"] >= {"torchtitan_xla.config.schema"}  # edges are found
    cycles, visiting, done = [], [], set()

    def visit(m: str) -> None:
        visiting.append(m)
        for n in sorted(graph[m]):
            if n in visiting:
                cycles.append(visiting[visiting.index(n):] + [n])
            elif n not in done:
                visit(n)
        visiting.pop()
        done.add(m)

    for m in sorted(graph):
        if m not in done:
            visit(m)
    assert cycles == []
