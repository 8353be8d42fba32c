"""Verbatim ``prompt=`` / ``stop=`` on the command line, and one-line errors for bad overrides."""

from __future__ import annotations

import io
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from inkfw.cli_args import extract_verbatim, prepare_argv
from inkfw.paths import config_dir, project_root
from inkfw.speculative.factory import serving_config

UGLY = [
    "def main():",
    "print(f(a, b)[0], {'k': \"v\"})",
    "x = y == z; key=value: [1, 2]",
    "it's \"quoted\" 'twice'",
    "${oc.env:HOME} and ${seed} stay text",
    "line one\nline two\n\ttabbed\\n",
    "=leading equals, trailing comma,",
    "",
]


@pytest.mark.parametrize("text", UGLY)
def test_prompt_and_stop_reach_the_config_unchanged(text):
    argv = ["infer.py", f"prompt={text}", "max_new_tokens=3", f"stop={text}", "stop=###", "+stop=(,)"]
    values = prepare_argv(config_dir(), "infer", argv)
    assert values == {"prompt": text, "stop": [s for s in (text, "###", "(,)") if s]}
    cfg = serving_config(argv[1:])  # what @hydra.main composes from the rewritten argv
    assert cfg.prompt == text
    assert list(cfg.stop) == values["stop"]
    assert cfg.max_new_tokens == 3


def test_stdin_prompt_and_options_that_take_a_value():
    rest, values = extract_verbatim(["prompt=-", "-cn", "prompt=x", "drafter=none"], stdin=io.StringIO("a(b)\n"))
    assert values == {"prompt": "a(b)\n"}
    assert rest == ["-cn", "prompt=x", "drafter=none"]  # the value of -cn is not a prompt
    rest, values = extract_verbatim(["stop=", "prompt=first", "prompt=second", "prompt_token_ids=[1]"])
    assert values == {"stop": [], "prompt": "second"} and rest == ["prompt_token_ids=[1]"]


def test_hydra_options_keep_their_values_and_go_after_the_overrides():
    argv = ["infer.py", "drafter=none", "--cfg", "job", "prompt=(a, b)", "--info", "max_new_tokens=2", "-i", "config"]
    values = prepare_argv(config_dir(), "infer", argv)
    assert values == {"prompt": "(a, b)"}
    # Hydra's argparse takes no override after an option, so they come first, in order
    assert argv[1:] == [
        "drafter=none",
        "max_new_tokens=2",
        "prompt=${inkfw.verbatim:prompt}",
        "--cfg",
        "job",
        "--info",
        "-i",
        "config",
    ]


@pytest.mark.parametrize(
    "arg, message",
    [
        ("max_new_tokens=(", "cannot parse the argument 'max_new_tokens=('"),
        ("no_such_key=1", "unknown option 'no_such_key'; to add a new key write +no_such_key=1."),
        ("engine.max_num_seq=2", "unknown option 'engine.max_num_seq'"),
        ("drafter=bogus", "unknown drafter 'bogus'; choose one of mtp, ngram, none."),
        ("sampler=a,b", "Ambiguous value for argument 'sampler=a,b'"),
        (
            "mtp=8",
            "mtp is a group of settings (depths, embed_source), not one value; set one of them, for example mtp.depths=8.",
        ),
        ("output=out.json", "output is a group of settings (json), not one value"),
    ],
)
def test_bad_overrides_are_one_error_line_and_exit_2(arg, message, capsys):
    with pytest.raises(SystemExit) as exit_info:
        prepare_argv(config_dir(), "infer", ["infer.py", arg])
    assert exit_info.value.code == 2
    err = capsys.readouterr().err
    assert err.startswith(f"error: {message}") and err.count("\n") == 1, err


@pytest.mark.parametrize("arg", ["mtp.depths=8", "output=null", "drafter=ngram", "+mtp.extra=1", "stop=[]"])
def test_values_and_group_choices_pass_the_node_check(arg):
    """Only a value in place of a node of settings is refused: a setting inside one, a node set
    to null, a group choice and an added key all compose."""
    prepare_argv(config_dir(), "infer", ["infer.py", arg], verbatim=False)


# ----------------------------------------------------------------------------- the script
def _infer(*args: str, stdin: str | None = None) -> subprocess.CompletedProcess:
    env = dict(os.environ, PYTHONPATH=str(project_root()))
    return subprocess.run(
        [sys.executable, str(project_root() / "scripts" / "infer.py"), *args],
        input=stdin,
        capture_output=True,
        text=True,
        cwd=project_root(),
        env=env,
        timeout=120,
    )


def test_infer_takes_ugly_prompts_verbatim(tmp_path: Path):
    prompt = "def main():\n    x = f(a, b)[0]  # {'k': \"v\"}, key=value: ${HOME}\n"
    out = tmp_path / "out.json"
    run = _infer(f"prompt={prompt}", "max_new_tokens=2", "drafter=none", f"output.json={out}")
    assert run.returncode == 0, run.stderr
    request = json.loads(out.read_text())["requests"][0]
    assert request["prompt"] == prompt and len(request["token_ids"]) == 2

    run = _infer("prompt=-", "max_new_tokens=2", "drafter=none", f"output.json={out}", stdin="a, (b)\n[c]: 'd'\n")
    assert run.returncode == 0, run.stderr
    assert json.loads(out.read_text())["requests"][0]["prompt"] == "a, (b)\n[c]: 'd'\n"


def test_infer_def_main_and_a_bad_override():
    run = _infer("prompt=def main():", "max_new_tokens=2", "mtp.depths=2")
    assert run.returncode == 0, run.stderr
    assert "def main():" in run.stdout
    run = _infer("prompt=def main():", "max_new_tokens=(2")
    assert run.returncode == 2
    assert run.stderr.startswith("error: cannot parse the argument 'max_new_tokens=(2'")
    assert run.stderr.count("\n") == 1 and "HYDRA_FULL_ERROR" not in run.stderr
