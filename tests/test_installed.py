"""Installed use: a non-editable install of the wheel runs ``LLM`` and ``inkfw-infer`` from a
folder outside the checkout, with the configs that ship inside the package.

The wheel is built from a copy of the sources (the checkout gets no build/ folder) and installed
into a temporary venv without pip; that venv sees this environment's dependencies through a
``.pth`` line naming our site-packages. A ``.pth`` line only extends ``sys.path``: the ``.pth``
files in that folder (among them the editable install's finder) are not run, so ``import inkfw``
in the temporary venv can only find the installed copy.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import sysconfig
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
CHECKPOINT = ROOT / "checkpoints" / "inkling-tiny"
MAX_TOKENS = 3
PROMPT = "def main():"

LLM_SCRIPT = f"""
import json, sys
import inkfw
from inkfw import LLM, SamplingParams
from inkfw.paths import config_dir
llm = LLM(model=sys.argv[1], mtp_depths=2, device="cpu")
out = llm.generate([{PROMPT!r}], SamplingParams(temperature=0), max_tokens={MAX_TOKENS})
print(json.dumps({{"inkfw": inkfw.__file__, "config_dir": str(config_dir()), "token_ids": out[0].token_ids}}))
"""


def venv_python(venv: Path) -> Path:
    return venv / ("Scripts/python.exe" if os.name == "nt" else "bin/python")


def run(cmd: list[str], cwd: Path, timeout: float = 120) -> subprocess.CompletedProcess:
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "PYTHONHOME", "VIRTUAL_ENV")}
    env["OMP_NUM_THREADS"] = "1"
    return subprocess.run(cmd, cwd=cwd, env=env, capture_output=True, text=True, timeout=timeout)


@pytest.fixture(scope="module")
def installed(tmp_path_factory) -> dict[str, Path]:
    """A temporary venv holding the installed wheel, and an empty working folder."""
    tmp = tmp_path_factory.mktemp("installed")
    src = tmp / "src"
    ignore = shutil.ignore_patterns("__pycache__", "*.pyc")
    shutil.copytree(ROOT / "inkfw", src / "inkfw", ignore=ignore)
    for file in ("pyproject.toml", "README.md"):
        shutil.copy2(ROOT / file, src / file)
    wheels = tmp / "wheels"
    built = run(
        [sys.executable, "-m", "pip", "wheel", str(src), "--no-deps", "--no-build-isolation", "-q", "-w", str(wheels)],
        cwd=tmp,
    )
    assert built.returncode == 0, built.stderr
    (wheel,) = wheels.glob("inkfw-*.whl")

    venv = tmp / "venv"
    made = run([sys.executable, "-m", "venv", "--without-pip", str(venv)], cwd=tmp)
    assert made.returncode == 0, made.stderr
    python = venv_python(venv)
    site = Path(
        run([str(python), "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"], cwd=tmp).stdout.strip()
    )
    ours = dict.fromkeys(sysconfig.get_paths()[key] for key in ("purelib", "platlib"))
    (site / "inkfw_test_dependencies.pth").write_text("".join(f"{p}\n" for p in ours))
    installed = run(
        [sys.executable, "-m", "pip", "--python", str(python), "install", "--no-deps", "-q", str(wheel)], cwd=tmp
    )
    assert installed.returncode == 0, installed.stderr
    work = tmp / "work"
    work.mkdir()
    return {"venv": venv, "python": python, "work": work}


def test_wheel_ships_every_config(installed):
    site = Path(
        run(
            [str(installed["python"]), "-c", "import inkfw.paths as p; print(p.config_dir())"], cwd=installed["work"]
        ).stdout.strip()
    )
    shipped = sorted(p.relative_to(site).as_posix() for p in site.rglob("*.yaml"))
    ours = sorted(p.relative_to(ROOT / "inkfw" / "conf").as_posix() for p in (ROOT / "inkfw" / "conf").rglob("*.yaml"))
    assert shipped == ours and "infer.yaml" in shipped


def test_llm_and_console_script_from_another_folder(installed):
    venv, work = installed["venv"], installed["work"]
    api = run([str(installed["python"]), "-c", LLM_SCRIPT, str(CHECKPOINT)], cwd=work)
    assert api.returncode == 0, api.stderr
    result = json.loads(api.stdout.strip().splitlines()[-1])
    assert Path(result["inkfw"]).resolve().is_relative_to(venv.resolve())
    assert Path(result["config_dir"]).resolve().is_relative_to(venv.resolve())
    assert 1 <= len(result["token_ids"]) <= MAX_TOKENS

    # the console script: the same config and engine, so the same greedy tokens
    script = venv / "bin" / "inkfw-infer"
    out_json = work / "infer.json"
    cli = run(
        [
            str(script),
            f"model.path={CHECKPOINT}",
            "mtp.depths=2",
            "device=cpu",
            f"prompt={PROMPT}",
            f"max_new_tokens={MAX_TOKENS}",
            f"output.json={out_json}",
        ],
        cwd=work,
    )
    assert cli.returncode == 0, cli.stderr
    requests = json.loads(out_json.read_text())["requests"]
    assert [r["token_ids"] for r in requests] == [result["token_ids"]]
    run_dirs = list((work / "runs" / "hydra" / "infer").iterdir())  # Hydra's run folder, under the cwd
    assert len(run_dirs) == 1 and (run_dirs[0] / ".hydra" / "config.yaml").is_file()


def test_relative_checkpoint_missing_outside_the_checkout_is_one_line(installed):
    """The default model.path (checkpoints/inkling-tiny) is relative: an installed inkfw has no
    checkout to fall back to, so from another folder it is one error line and exit code 2."""
    cli = run([str(installed["venv"] / "bin" / "inkfw-infer"), "max_new_tokens=2", "device=cpu"], cwd=installed["work"])
    lines = [ln for ln in cli.stderr.splitlines() if ln.strip()]
    assert cli.returncode == 2 and len(lines) == 1, cli.stderr
    assert lines[0].startswith("error: ") and "checkpoints/inkling-tiny" in lines[0]
