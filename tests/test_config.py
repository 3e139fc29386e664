"""Config: precedence, flag syntax, the help text, the generated reference, and every bad input
as the user sees it (one line, exit code 2)."""

import os
import subprocess
import sys
from pathlib import Path

import pytest

from torchtitan_xla.config import ConfigError, job_config, parse_args, reference
from torchtitan_xla.config import manager as cm

REPO = Path(__file__).resolve().parent.parent


def write(tmp_path: Path, text: str, name: str = "job.toml") -> str:
    path = tmp_path / name
    path.write_text(text)
    return str(path)


def test_precedence_cli_over_toml_over_default(tmp_path):
    path = write(tmp_path, "[training]\nsteps = 7\nseq_len = 128\n[optimizer]\nlr = 0.01\n")
    cfg = parse_args(["--job.config_file", path, "--training.steps", "3"])
    assert cfg.training.steps == 3  # command line beats TOML
    assert cfg.training.seq_len == 128  # TOML beats default
    assert cfg.optimizer.lr == 0.01
    assert cfg.training.local_batch_size == job_config.Training().local_batch_size  # default


def test_cli_syntax_forms(tmp_path):
    path = write(tmp_path, "[metrics]\nenable_tensorboard = true\n[job]\nprint_config = false\n")
    cfg = parse_args(["--job.config_file", path, "--metrics.no-enable_tensorboard", "--job.print_config",
                      "--training.seq_len=32", "--lr_scheduler.decay-type", "cosine",
                      "--debug.seed", "5"])
    assert cfg.metrics.enable_tensorboard is False
    assert cfg.job.print_config is True
    assert cfg.training.seq_len == 32
    assert cfg.lr_scheduler.decay_type == "cosine"
    assert cfg.debug.seed == 5
    cfg = parse_args(["--metrics.enable_tensorboard", "false", "--debug.seed", "none"])
    assert cfg.metrics.enable_tensorboard is False and cfg.debug.seed is None
    assert parse_args(["--metrics.enable_tensorboard", "true"]).metrics.enable_tensorboard is True


def test_list_values_parse_from_text_and_toml():
    assert cm._from_text("a, b,c", list[str]) == ["a", "b", "c"]
    assert cm._from_text("1,2", list[int]) == [1, 2]
    assert cm._from_toml(["x"], list[str]) == ["x"]
    with pytest.raises(ValueError, match="expected a list"):
        cm._from_toml("x", list[str])


def test_effective_config_round_trips_through_toml(tmp_path):
    cfg = parse_args(["--training.steps", "11", "--optimizer.lr", "0.002"])
    saved = write(tmp_path, cfg.to_toml(), "saved.toml")
    loaded = parse_args(["--job.config_file", saved]).to_dict()
    assert loaded["job"].pop("config_file") == saved
    expected = cfg.to_dict()
    expected["job"].pop("config_file")
    assert loaded == expected


def test_help_lists_every_option_with_type_default_and_help():
    out = subprocess.run([sys.executable, str(REPO / "train.py"), "--help"], capture_output=True,
                         text=True, check=True).stdout
    for section, cls in cm.sections().items():
        for key, (tp, f) in cm.fields_of(cls).items():
            line = f"--{section}.{key} {cm.type_name(tp)}  (default: {reference._default_text(f)})"
            assert line in out
            assert f.metadata["help"] in out
    assert "--training.mixed_precision_param {float32,bfloat16}  (default: 'bfloat16')" in out


def test_docs_config_md_is_generated_from_the_dataclasses():
    committed = (REPO / "docs" / "config.md").read_text()
    assert committed == reference.markdown_reference(), (
        "docs/config.md is stale: python -m torchtitan_xla.config --markdown > docs/config.md")


# -- bad input -------------------------------------------------------------------------------

BAD_TOML = [
    ("[training]\nsteps = 3\nseq_len = \n", r"job\.toml: TOML syntax error: .*\(at line 3, column \d+\)"),
    ("[trainng]\nsteps = 3\n", r"job\.toml: unknown section \[trainng\] \(did you mean 'training'\?\)"),
    ("[training]\nstpes = 3\n", r"job\.toml: unknown key \[training\] stpes \(did you mean 'steps'\?\)"),
    ('[training]\nsteps = "ten"\n', r"job\.toml: \[training\] steps: expected an integer, got 'ten'"),
    ("[training]\nsteps = 0\n", r"job\.toml: \[training\] steps = 0: must be > 0"),
    ("[training]\nseq_len = -4\n", r"job\.toml: \[training\] seq_len = -4: must be > 0"),
    ('[model]\nflavor = "9B"\n', r"job\.toml: \[model\] flavor = '9B': unknown flavor for llama3; expected one of debugmodel, 8B, 70B, 405B"),
    ('[lr_scheduler]\ndecay_type = "step"\n', r"\[lr_scheduler\] decay_type: expected one of 'linear', 'sqrt', 'cosine', got 'step'"),
    ("[metrics]\nenable_tensorboard = 1\n", r"\[metrics\] enable_tensorboard: expected true or false, got 1"),
    ("training = 3\n", r"\[training\] must be a table"),
]


@pytest.mark.parametrize("text,message", BAD_TOML)
def test_bad_toml_is_one_clear_error(tmp_path, text, message):
    with pytest.raises(ConfigError, match=message):
        parse_args(["--job.config_file", write(tmp_path, text)])


BAD_CLI = [
    (["--training.steps", "ten"], r"command line: --training.steps: expected an integer, got 'ten'"),
    (["--training.steps", "-1"], r"command line: --training.steps = -1: must be > 0"),
    (["--trainig.steps", "3"], r"unknown option --trainig.steps \(did you mean --training.steps\?\)"),
    (["--training.steps"], r"--training.steps needs a value \(int\)"),
    (["--training.no-steps"], r"--training.no-steps is only valid for boolean options"),
    (["train.toml"], r"unexpected argument 'train.toml'"),
    (["--job.config_file", "/nonexistent/x.toml"], r"config file not found: /nonexistent/x.toml"),
    (["--parallelism.data_parallel_shard_degree", "0"], r"must be -1 \(all remaining devices\) or > 0"),
    (["--optimizer.name", "SGD"],
     r"command line: --optimizer.name: expected one of AdamW, Adam, Muon, Lion, Adafactor, got 'SGD'"),
    (["--loss.chunk_size", "100", "--training.seq_len", "64"],
     r"^command line: --loss.chunk_size = 100: must divide the tokens of one data-parallel rank per "
     r"microbatch, local_batch_size x seq_len = 8 x 64 = 512$"),
]


@pytest.mark.parametrize("argv,message", BAD_CLI)
def test_bad_command_line_is_one_clear_error(argv, message):
    with pytest.raises(ConfigError, match=message):
        parse_args(argv)


VALIDATION_TOML = "[validation]\nenable = true\ndataset_split = \"test\"\n"


@pytest.mark.parametrize("argv,message", [
    (["--job.config_file", "missing.toml"], "error: config file not found: missing.toml"),
    (["--training.steps", "0"], "error: command line: --training.steps = 0: must be > 0"),
    # Errors found while building the run name the flag, or the file and key, that set the value.
    (["--model.tokenizer_path", "/nonexistent/tok.model"],
     "error: command line: --model.tokenizer_path: file not found: /nonexistent/tok.model; llama3's "
     "tokenizer is original/tokenizer.model in the gated HuggingFace repository meta-llama/Llama-3.1-8B: "
     "accept its licence at https://huggingface.co/meta-llama/Llama-3.1-8B, then run `python "
     "scripts/download_tokenizer.py llama3 --out /nonexistent/tok.model` with HF_TOKEN set (README, "
     "'Tokenizers')"),
    (["--training.dataset", "json", "--training.dataset_path", "/nonexistent/c4.json"],
     "error: command line: --training.dataset_path: not found: /nonexistent/c4.json"),
    (["--validation.enable", "--validation.dataset_split", "test"],
     "error: command line: --validation.dataset_split: python_docs has splits train and validation, "
     "not 'test'"),
    (["--job.config_file", VALIDATION_TOML],
     "error: {toml}: [validation] dataset_split: python_docs has splits train and validation, not 'test'"),
    (["--parallelism.tensor_parallel_degree", "2"],
     "error: [parallelism] data_parallel_replicate_degree (1) x tensor_parallel_degree (2) = 2 does "
     "not divide the 1 devices (tensor_parallel_degree from the command line)"),
    (["--loss.chunk_size", "3000"],
     "error: command line: --loss.chunk_size = 3000: must divide the tokens of one data-parallel "
     "rank per microbatch, local_batch_size x seq_len = 8 x 2048 = 16384"),
    (["--lora.rank", "8", "--lora.target_modules", ""],
     "error: command line: --lora.target_modules is empty with [lora] rank = 8: nothing would be "
     "trained; name the layers that get adapters (wq, wk, wv, wo, w1, w2, w3), or set rank = 0 to "
     "train every weight"),
])
def test_train_py_reports_bad_input_in_one_line_with_exit_code_2(tmp_path, argv, message):
    if "--job.config_file" in argv and argv[1].startswith("["):  # a TOML text: written to a file
        toml = tmp_path / "job.toml"
        toml.write_text(argv[1])
        argv, message = ["--job.config_file", str(toml), *argv[2:]], message.format(toml=toml)
    dump = tmp_path / "out"
    p = subprocess.run([sys.executable, str(REPO / "train.py"), "--job.dump_folder", str(dump), *argv],
                       capture_output=True, text=True, env=dict(os.environ, PJRT_DEVICE="CPU"))
    assert p.returncode == 2, p.stderr
    error_lines = [line for line in p.stderr.splitlines() if line.startswith("error:")]
    assert error_lines == [message]
    assert "Traceback" not in p.stderr
    # The effective config is shown only for a run that starts, not above its error line.
    assert "Effective config" not in p.stderr + p.stdout
    assert not dump.exists()  # nothing written on bad input


def test_errors_found_after_parsing_name_the_file_or_flag_of_their_key(tmp_path):
    """Code that builds the run raises `[section] key: ...`; the entry points rewrite it into where
    the value came from (config/sources.py), and name the origins of the other keys it mentions."""
    from torchtitan_xla.config import attributed, renamed_keys

    path = write(tmp_path, "[training]\nseq_len = 64\n[parallelism]\ntensor_parallel_degree = 4\n")
    cfg = parse_args(["--job.config_file", path, "--training.local_batch_size", "3",
                      "--training.dataset_path", "/data/x.jsonl"])
    cases = {
        "[training] seq_len: too long": f"{path}: [training] seq_len: too long",
        "[training] local_batch_size = 3: odd": "command line: --training.local_batch_size = 3: odd",
        "[training] steps: a default": "[training] steps: a default",  # no file or flag to name
        "[training] global_batch_size (16) must be a multiple of local_batch_size (3) x seq_len":
            "[training] global_batch_size (16) must be a multiple of local_batch_size (3) x seq_len "
            f"(local_batch_size from the command line; seq_len from {path})",
        "config file not found: x.toml": "config file not found: x.toml",  # names no key
        # A message about a path or URL a key was set to: that key.
        "/data/x.jsonl: unreadable": "command line: --training.dataset_path: /data/x.jsonl: unreadable",
        # A key of another section named in the message: its origin too.
        "[parallelism] tensor_parallel_degree (4) must divide seq_len (64)":
            f"{path}: [parallelism] tensor_parallel_degree (4) must divide seq_len (64) (seq_len from {path})",
    }
    for raised, shown in cases.items():
        with pytest.raises(ConfigError) as e, attributed(cfg):
            raise ConfigError(raised)
        assert str(e.value) == shown
    # Values read through another section's keys are named by their own key.
    cfg = parse_args(["--validation.dataset_split", "test"])
    with pytest.raises(ConfigError) as e, attributed(cfg), renamed_keys(
            {("training", "dataset_split"): ("validation", "dataset_split")}):
        raise ConfigError("[training] dataset_split: no such split")
    assert str(e.value) == "command line: --validation.dataset_split: no such split"
