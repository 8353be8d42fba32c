"""Entry points: the smoke run works, bad input gives one line on stderr and exit code != 0,
and Hydra's run folders go under runs/, never outputs/."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

ROOT = Path(__file__).resolve().parent.parent


def run(script: str, *overrides: str, cwd: Path) -> subprocess.CompletedProcess:
    return subprocess.run(
        [
            sys.executable,
            str(ROOT / "scripts" / script),
            *overrides,
            "hydra.run.dir=" + str(cwd / "hydra"),
            "hydra.output_subdir=null",
        ],
        capture_output=True,
        text=True,
        cwd=cwd,
        timeout=300,
    )


@pytest.mark.parametrize(
    "script, overrides",
    [
        ("infer.py", ["model=inkling-debug", "max_new_tokens=2", "device=cpu"]),
        ("smoke.py", ["max_new_tokens=2", "device=cpu"]),
        (
            "bench.py",
            [
                "model=inkling-debug",
                "prompt_sets=[random]",
                "hf=[]",
                "modes=[eager]",
                "batch_sizes=[1]",
                "drafters=[none]",
                "repeats=1",
                "max_new_tokens=2",
                "warmup_tokens=0",
                "output_dir=null",
            ],
        ),
    ],
)
def test_hydra_run_dir_is_under_runs(tmp_path, script, overrides):
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    out = subprocess.run(
        [sys.executable, str(ROOT / "scripts" / script), *overrides],
        capture_output=True,
        text=True,
        cwd=tmp_path,
        timeout=300,
        env=env,
    )
    assert out.returncode == 0, out.stderr
    assert not (tmp_path / "outputs").exists()
    run_dirs = list((tmp_path / "runs" / "hydra" / script.removesuffix(".py")).iterdir())
    assert len(run_dirs) == 1 and (run_dirs[0] / ".hydra" / "config.yaml").is_file()


def test_smoke_run_succeeds(tmp_path):
    out = run("smoke.py", "max_new_tokens=8", cwd=tmp_path)
    assert out.returncode == 0, out.stderr
    assert "cached greedy == uncached greedy" in out.stdout and "yes" in out.stdout


@pytest.mark.parametrize(
    "overrides, needle",
    [
        (["model=inkling", "model.path=/nonexistent/ckpt"], "/nonexistent/ckpt"),
        (["mtp.depths=9"], "mtp.depths=9"),
        (["max_new_tokens=0"], "max_new_tokens"),
        (["dtype=float64"], "dtype"),
        (["mtp.embed_source=normed"], "embed_source"),
        (["prompt_token_ids=[1,2,100000]"], "prompt token ids"),
    ],
)
def test_bad_input_gives_one_line_no_traceback(tmp_path, overrides, needle):
    out = run("smoke.py", *overrides, cwd=tmp_path)
    assert out.returncode != 0
    lines = [ln for ln in out.stderr.strip().splitlines() if ln.strip()]
    assert len(lines) == 1, out.stderr
    assert lines[0].startswith("error: ") and needle in lines[0]
    assert "Traceback" not in out.stderr


@pytest.mark.parametrize("script", ["train.py", "bench.py", "count_ops.py"])
def test_scripts_reject_an_unknown_option_in_one_line(tmp_path, script):
    """Hydra's own report of an unknown key is seven lines and exit code 1; the entry points
    check their overrides first (``check_command_line``) and say it in one."""
    out = run(script, "no_such_option=1", cwd=tmp_path)
    assert out.returncode == 2, out.stderr
    assert out.stderr.strip() == "error: unknown option 'no_such_option'; to add a new key write +no_such_option=1."


@pytest.mark.parametrize(
    "script, option, message",
    [
        ("smoke.py", "max_new_tokens=abc", "max_new_tokens must be an integer >= 1, got 'abc'."),
        ("count_ops.py", "repeats=abc", "repeats must be an integer >= 1, got 'abc'."),
        ("train_tokenizer.py", "vocab_size=abc", "vocab_size must be an integer >= 260"),
        ("smoke.py", "debug=maybe", "debug must be true or false, got 'maybe'."),  # was taken as true
    ],
)
def test_a_value_of_the_wrong_type_is_one_line(tmp_path, script, option, message):
    """Each of these died in a traceback (``int('abc')``'s ValueError; ``debug=maybe`` counted as
    ``debug=true``, which shows tracebacks); inkfw.options checks them."""
    out = run(script, option, cwd=tmp_path)
    assert out.returncode == 2, out.stderr
    assert out.stderr.strip().startswith("error: " + message) and len(out.stderr.strip().splitlines()) == 1


def test_every_script_checks_its_command_line_against_its_own_config():
    """Each script's ``__main__`` calls ``check_command_line`` (directly, or through
    ``inkfw.entrypoints``) with the config its ``@hydra.main`` app composes."""
    entrypoints = (ROOT / "inkfw" / "entrypoints.py").read_text()
    for path in sorted((ROOT / "scripts").glob("*.py")):
        text = path.read_text()
        program = re.search(r"from inkfw.entrypoints import (\w+)_main", text)
        if program:  # infer, serve, train, bench: the check is in their *_main()
            name = program.group(1)
            body = entrypoints[entrypoints.index(f"def {name}_main()") :]
            assert f'check_command_line("{name}"' in body.split("\ndef ")[0], name
            assert f'config_name="{name}"' in entrypoints, name
            continue
        config = re.search(r'config_name="(\w+)"', text)
        assert config, f"{path.name} has no @hydra.main app"
        main = text[text.index('if __name__ == "__main__":') :]
        assert f'check_command_line("{config.group(1)}")' in main, path.name


def test_debug_true_shows_traceback(tmp_path):
    out = run("smoke.py", "model=inkling", "model.path=/nonexistent/ckpt", "debug=true", cwd=tmp_path)
    assert out.returncode != 0
    assert "Traceback" in out.stderr or "CheckpointError" in out.stderr


def test_corrupt_checkpoint_via_script(tmp_path):
    ckpt = tmp_path / "ckpt"
    ckpt.mkdir()
    (ckpt / "config.json").write_text('{"model_type": "inkling_model", "num_hidden_layers": 2}')
    (ckpt / "model.safetensors").write_bytes(b"\x00garbage" * 10)
    out = run("smoke.py", "model=inkling", f"model.path={ckpt}", cwd=tmp_path)
    assert out.returncode != 0
    assert "model.safetensors" in out.stderr and "Traceback" not in out.stderr


@pytest.mark.parametrize(
    "preset, total, active, published",
    [
        ("inkling-release", "975,340,270,146", "41,059,054,146", ("975B", "41B")),
        ("inkling-small", "276,240,214,570", "11,999,062,570", ("276B", "12B")),
    ],
)
def test_count_params_prints_table(tmp_path, preset, total, active, published):
    """The count, and the model card's figure beside it."""
    out = run("count_params.py", f"model={preset}", cwd=tmp_path)
    assert out.returncode == 0, out.stderr
    line = next(line for line in out.stdout.splitlines() if "published" in line)
    assert f"{total} total / {active} active counted" in line
    assert f"published: {published[0]} total / {published[1]} active" in line


def test_every_program_help_names_each_of_its_options():
    """``--help`` is the header and footer of each program's config (``hydra.help``): every
    top-level option the config introduces appears there as ``name=`` or ``name.``. A preset
    of another program's config (``bench_gpu`` of ``bench``) introduces none of its own."""
    from hydra import compose, initialize_config_dir
    from omegaconf import OmegaConf

    from inkfw.paths import config_dir

    conf = config_dir()
    programs = {p.stem: yaml.safe_load(p.read_text()) or {} for p in sorted(conf.glob("*.yaml"))}
    unnamed = {}
    with initialize_config_dir(str(conf), version_base="1.3"):
        for name, node in programs.items():
            parents = [d for d in node.get("defaults", []) if isinstance(d, str) and d in programs]
            inherited = {key for parent in parents for key in programs[parent]}
            options = [k for k in node if k not in ("hydra", "defaults") and k not in inherited]
            help_node = OmegaConf.to_container(compose(name, return_hydra_config=True).hydra.help, resolve=False)
            text = f"{help_node['header']}\n{help_node['footer']}"
            assert "powered by Hydra" not in text, name
            missing = [k for k in options if not re.search(rf"(?<![\w.]){re.escape(k)}[=.]", text)]
            if missing:
                unnamed[name] = missing
    assert not unnamed, f"options missing from --help: {unnamed}"
