"""The commands in README.md and docs/ run as written from a fresh clone: every one names files,
modules and options that exist and parse; the cheap ones (--help, --plan, --dry-run) are run."""

import importlib.util
import os
import re
import shlex
import subprocess
import sys
from pathlib import Path

import pytest

from torchtitan_xla.config import ConfigError, parse_args

REPO = Path(__file__).resolve().parent.parent
DOCS = [REPO / "README.md", *sorted(p for p in (REPO / "docs").glob("*.md") if p.name != "config.md")]
# What makes a line a command of this project (a `sbatch` line runs run_train.sh's arguments).
PROGRAMS = re.compile(r"(^|\s)(\./run_train\.sh|python3? |\.venv/bin/python |sbatch )")
PLACEHOLDER = re.compile(r"<[^>]*>|\.\.\.|…|\$|\[--")
SHELL_BLOCKS = ("", "sh", "bash", "console", "shell")


def _commands(text: str) -> list[tuple[str, bool]]:
    """(shell line, whether it is a whole command) for the lines of shell code blocks and the inline
    code spans that run one of the project's programs; an inline span may be a fragment."""
    found, block = [], None  # block: the open fence's language, None outside a fence
    prose = []
    for line in text.replace("\\\n", " ").splitlines():
        if line.lstrip().startswith("```"):
            block = line.strip()[3:] if block is None else None
        elif block is None:
            prose.append(line)
        elif block in SHELL_BLOCKS:
            found.append((line.strip().removeprefix("$ "), True))
    found += [(c, False) for c in re.findall(r"(?<!`)`([^`\n]+)`(?!`)", "\n".join(prose))]
    return [(c, whole) for c, whole in found if PROGRAMS.search(c) and not c.startswith("#")]


COMMANDS = [(doc.relative_to(REPO).as_posix(), c, whole) for doc in DOCS
            for c, whole in _commands(doc.read_text())]


def _split(command: str) -> tuple[dict[str, str], list[str]]:
    """(leading VAR=value assignments, the words up to a shell operator), the comment dropped."""
    words = shlex.split(command, comments=True)
    words = words[:next((i for i, w in enumerate(words) if w in ("&", "&&", "|", ";", ">")), len(words))]
    env = {}
    while words and re.fullmatch(r"[A-Z_]+=.*", words[0]):
        key, _, value = words.pop(0).partition("=")
        env[key] = value
    return env, words


def _config_file(name: str) -> Path:
    """run_train.sh's CONFIG_FILE resolution: the path, else the bare name in train_configs/."""
    path = REPO / name
    return path if path.is_file() else REPO / "train_configs" / name


def test_the_docs_have_the_commands_this_test_checks():
    assert len(COMMANDS) >= 40
    docs = {doc for doc, _, whole in COMMANDS if whole}
    assert {"README.md", "docs/plan.md", "docs/evaluation.md", "docs/finetune.md"} <= docs


@pytest.mark.parametrize("doc, command, whole", COMMANDS, ids=[f"{d}:{c[:50]}" for d, c, _ in COMMANDS])
def test_every_command_names_what_exists_and_parses(doc, command, whole):
    """Files, modules and config files exist; a whole command's options parse."""
    env, words = _split(command)
    if words and words[0] in ("sbatch", "gcloud"):
        script = next((w for w in words if w.endswith(".slurm")), None)
        if script is not None:
            assert (REPO / script).is_file(), f"{doc}: {command}: no {script}"
            words = ["./run_train.sh", *words[words.index(script) + 1:]]
        else:  # gcloud's --command runs a run_train.sh line of its own
            inner = next((w for w in words if "run_train.sh" in w), "")
            env, words = _split(inner.split("&&")[-1])
    if not words:
        return
    program, args = words[0], words[1:]
    config = env.get("CONFIG_FILE")
    if program.endswith("python") or program.startswith("python"):
        if args[:1] == ["-m"]:
            module, args = args[1], args[2:]
            parts = module.split(".")
            if parts[0] == "torchtitan_xla":
                candidates = [REPO / Path(*parts).with_suffix(".py"), REPO / Path(*parts) / "__main__.py"]
                assert any(p.is_file() for p in candidates), f"{doc}: {command}: no module {module}"
            else:  # pytest, a tool the dev install brings
                assert importlib.util.find_spec(module), f"{doc}: {command}: no module {module}"
            parsed = module in ("torchtitan_xla.plan", "torchtitan_xla.eval")
        else:
            script, args = args[0], args[1:]
            assert (REPO / script).is_file(), f"{doc}: {command}: no file {script}"
            parsed = script == "train.py"
    else:
        assert program == "./run_train.sh", f"{doc}: {command}"
        args = [a for a in args if a not in ("--plan", "--dry-run", "--check-hosts")]
        parsed = True
    if config is not None:
        assert _config_file(config).is_file(), f"{doc}: {command}: no config file {config}"
    if not (parsed and whole) or PLACEHOLDER.search(" ".join(args)) or {"-h", "--help"} & set(args):
        return
    if config is not None:
        args = ["--job.config_file", str(_config_file(config)), *args]
    elif "--job.config_file" in args:
        i = args.index("--job.config_file") + 1
        args[i] = str(REPO / args[i])
    try:
        cfg = parse_args(args)
    except ConfigError as e:
        pytest.fail(f"{doc}: {command}: {e}")
    # A checkpoint the command reads must be one the documented runs write: under the job's own
    # dump folder and checkpoint folder.
    for key in ("eval.checkpoint", "checkpoint.initial_load_path"):
        if f"--{key}" in args:
            path = args[args.index(f"--{key}") + 1]
            folder = Path(cfg.job.dump_folder) / cfg.checkpoint.folder
            assert Path(path).parent == folder, (
                f"{doc}: {command}: --{key} {path} is not where {config or 'that config'} saves "
                f"checkpoints ({folder}/step-N)")


def _run_script(args: list[str], env: dict[str, str]) -> subprocess.CompletedProcess:
    full_env = {k: v for k, v in os.environ.items() if not k.startswith(("CPU_NUM_DEVICES", "PJRT_"))}
    full_env |= {"PYTHON": sys.executable, "PJRT_DEVICE": "CPU", **env}
    return subprocess.run([str(REPO / "run_train.sh"), *args], capture_output=True, text=True,
                          env=full_env, cwd=REPO, timeout=300)


CHEAP = [(doc, c) for doc, c, whole in COMMANDS
         if whole and "run_train.sh" in c and any(f in c for f in ("--plan", "--help", "--dry-run"))
         and not PLACEHOLDER.search(c) and not c.lstrip().startswith(("NNODES", "sbatch"))]


@pytest.mark.parametrize("doc, command", CHEAP, ids=[f"{d}:{c[:50]}" for d, c in CHEAP])
def test_the_cheap_commands_run_as_written(doc, command):
    env, words = _split(command)
    if "CONFIG_FILE" in env:
        env["CONFIG_FILE"] = str(_config_file(env["CONFIG_FILE"]))
    p = _run_script(words[1:], env)
    assert p.returncode == 0, f"{doc}: {command}:\n{p.stderr[-2000:]}"
    assert "error:" not in p.stderr and "Traceback" not in p.stderr, p.stderr[-2000:]


def test_cheap_commands_found():
    assert len(CHEAP) >= 4  # README's --plan and --help, plan.md's, multihost.md's --dry-run


# ---- facts the docs state about the code ----------------------------------------------------


def test_readme_names_every_recipe_and_every_parallelism_transform():
    readme = (REPO / "README.md").read_text()
    for recipe in sorted((REPO / "train_configs").glob("*.toml")):
        assert f"`{recipe.name}`" in readme, recipe.name
    source = (REPO / "torchtitan_xla/parallelisms/parallelize_llama.py").read_text()
    for transform in re.findall(r"^def (apply_\w+)\(", source, re.M):
        assert f"`{transform}`" in readme, transform


def test_runtime_md_lists_every_module_of_both_runtimes():
    text = (REPO / "docs/runtime.md").read_text()
    runtime = REPO / "torchtitan_xla/runtime"
    modules = {p.name for side in ("xla", "native") for p in (runtime / side).glob("*.py")
               if p.name != "__init__.py"}
    table = set(re.findall(r"^\| `(\w+\.py)` \|", text, re.M))
    assert table == modules
    assert {p.name for p in runtime.glob("*.py")} == {"__init__.py", "common.py", "host_devices.py"}
    assert "`runtime/common.py`" in text and "`runtime/host_devices.py`" in text


def test_metrics_md_names_the_batch_axes():
    from torchtitan_xla.parallelisms import BATCH_AXES

    assert f"`{' × '.join(BATCH_AXES)}`" in (REPO / "docs/metrics.md").read_text()


def test_float8_md_shows_each_combination_the_config_refuses():
    text = (REPO / "docs/float8.md").read_text()
    for argv in (["--lora.rank", "8", "--float8.enable_float8_linear"],
                 ["--model.name", "mixtral", "--float8.enable_float8_linear"]):
        with pytest.raises(ConfigError) as e:
            parse_args(argv)
        assert f"error: {e.value}" in text


def test_the_embedded_chat_set_has_the_sizes_the_docs_give():
    from torchtitan_xla.datasets import python_docs

    topics = python_docs.conversations()
    held_out = sum(len(t) for i, t in enumerate(topics) if i % 10 == 9)
    train = sum(len(t) for t in topics) - held_out
    datasets_md = (REPO / "docs/datasets.md").read_text()
    assert f"{train + held_out} short question/answer conversations made from the embedded Python docs, " \
           f"{train} for training and {held_out} held out" in datasets_md
    assert f"{train}\nconversations for `train`, {held_out} in `validation`" in (REPO / "docs/finetune.md").read_text()


STATUS_WORDS = {"tested on CPU", "measured on GPU", "not verified on TPU", "refused", "not tested", "TPU only"}


def _status_rows() -> list[dict[str, str]]:
    """README's Status table: one dict per row, by column name."""
    text = (REPO / "README.md").read_text()
    section = text[text.index("## Status"):]
    table = section[section.index("\n|"):].split("\n\n")[0]  # the section's first table
    lines = [ln for ln in table.splitlines() if ln.startswith("|")]
    header = [c.strip() for c in lines[0].strip("|").split("|")]
    return [dict(zip(header, (c.strip() for c in ln.strip("|").split("|")))) for ln in lines[2:]]


def test_the_readme_status_table_says_only_what_holds():
    """Its cells use the table's own words; every key the native runtime refuses is a row marked
    refused there, and no other row is; each row names test files that exist, a native runtime
    tested on CPU among them one that runs the native runtime; nothing claims a TPU run. A row the
    XLA runtime refuses is refused by the config, in a line that names the native runtime."""
    from torchtitan_xla.config import ConfigError, parse_args
    from torchtitan_xla.config.checks import _NOT_ON_NATIVE

    rows = _status_rows()
    assert len(rows) >= 20
    for row in rows:
        for runtime in ("XLA runtime", "native runtime"):
            words = {w.strip() for w in row[runtime].split(",")}
            assert words <= STATUS_WORDS, (row["feature"], words)
            assert "refused" not in words or words == {"refused"}, row["feature"]
        if row["XLA runtime"] == "refused":
            for key in re.findall(r"`([a-z_]+\.[a-z_]+)", row["switch"]):
                with pytest.raises(ConfigError, match='backend = "native"'):
                    parse_args([f"--{key}"])
        else:
            assert "not verified on TPU" in row["XLA runtime"], row["feature"]  # never run on a TPU
        assert "measured on GPU" not in row["XLA runtime"], row["feature"]  # torch_xla 2.9: no GPU
        files = re.findall(r"`(test_\w+\.py)`", row["checked in"])
        assert files and all((REPO / "tests" / f).is_file() for f in files), row
        if "tested on CPU" in row["native runtime"]:
            assert any("native" in (REPO / "tests" / f).read_text() for f in files), row["feature"]
    refused = {key for row in rows if row["native runtime"] == "refused"
               for key in re.findall(r"`([a-z_]+\.[a-z_]+)", row["switch"])}
    assert refused == {f"{section}.{key}" for section, key, _, _ in _NOT_ON_NATIVE}
