"""The training recipe end to end: tokenizer -> pretrain -> export -> MTP depths -> infer."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parent.parent
ENV = {**os.environ, "OMP_NUM_THREADS": "1", "WANDB_MODE": "offline", "WANDB_SILENT": "true"}


def _run(script: str, *args: str, cwd: Path) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, str(ROOT / "scripts" / script), *args],
        cwd=cwd,
        env=ENV,
        capture_output=True,
        text=True,
        timeout=600,
    )


@pytest.fixture(scope="module")
def pretrained(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("train")
    tok = tmp / "tokenizer.json"
    r = _run("train_tokenizer.py", "vocab_size=400", f"out={tok}", "max_documents=40", cwd=tmp)
    assert r.returncode == 0, r.stderr
    r = _run(
        "train.py",
        "experiment=debug-pretrain",
        f"data.tokenizer={tok}",
        f"output_dir={tmp}/pre",
        "checkpoint_every=2",
        cwd=tmp,
    )
    assert r.returncode == 0, r.stderr[-3000:]
    return tmp


def test_pretrain_exports_a_checkpoint_that_infer_loads(pretrained):
    export = pretrained / "pre" / "export"
    assert json.loads((export / "config.json").read_text())["mtp_config"]["num_nextn_predict_layers"] == 4
    assert (export / "tokenizer.json").is_file()
    # the W&B offline run holds the logged keys (the .wandb record log stores key names verbatim)
    runs = list((pretrained / "pre" / "wandb").glob("offline-run-*/run-*.wandb"))
    assert len(runs) == 1, "no offline W&B run"
    data = runs[0].read_bytes()
    for key in (
        "train/loss",
        "train/lr",
        "train/lm_ce",
        "train/depth0/agreement",
        "train/depth3/ce",
        "train/simulated_acceptance_length",
        "train/tokens_per_s",
        "val/loss",
        "val/depth0/agreement",
        "val/engine_acceptance_length",
    ):
        assert key.encode() in data, key
    out = pretrained / "infer.json"
    r = _run(
        "infer.py",
        "model=inkling",
        f"model.path={export}",
        'prompt="def f():"',
        "max_new_tokens=4",
        f"output.json={out}",
        f"hydra.run.dir={pretrained}/h",
        cwd=pretrained,
    )
    assert r.returncode == 0, r.stderr
    assert len(json.loads(out.read_text())["requests"][0]["token_ids"]) == 4


def test_mtp_task_adds_depths(pretrained):
    export = pretrained / "pre" / "export"
    r = _run(
        "train.py",
        "task=mtp",
        f"model.path={export}",
        "mtp.depths=6",
        "trainer.max_steps=2",
        "data.seq_len=32",
        "data.batch_size=2",
        "data.max_documents=20",
        "logger=csv",
        f"output_dir={pretrained}/mtp",
        cwd=pretrained,
    )
    assert r.returncode == 0, r.stderr[-3000:]
    cfg = json.loads((pretrained / "mtp" / "export" / "config.json").read_text())
    assert cfg["mtp_config"]["num_nextn_predict_layers"] == 6


@pytest.mark.parametrize(
    "args, message",
    [
        (["mtp.train_from=6"], "train_from"),
        (["data.sources=[/nonexistent/corpus]"], "does not exist"),
        (["task=finetune"], "unknown task 'finetune'"),
        (["loss.objective=mse"], "loss.objective"),
        (["data.batch_size=0"], "data.batch_size must be an integer >= 1, got 0"),
        (["trainer.max_stepz=2"], "unknown option 'trainer.max_stepz'"),
        (["optim.lr=abc"], "optim.lr must be a number, got 'abc'"),  # a partial node: called in fit
        (["trainer.max_steps=abc"], "trainer.max_steps must be an integer"),  # not scheduler.max_steps
        (["data.seq_len=abc"], "data.seq_len must be an integer, got 'abc'"),  # checked before the data is read
        (["activation_checkpointing=maybe"], "activation_checkpointing must be true or false"),  # bool() took it
        (["eval.num_prompts=abc"], "eval.num_prompts must be an integer >= 0, got 'abc'"),
    ],
)
def test_bad_input_is_one_line(pretrained, args, message):
    export = pretrained / "pre" / "export"
    r = _run(
        "train.py",
        "task=mtp",
        f"model.path={export}",
        "mtp.depths=6",
        "logger=csv",
        f"output_dir={pretrained}/bad",
        *args,
        cwd=pretrained,
    )
    assert r.returncode == 2
    lines = [line for line in r.stderr.splitlines() if line.strip()]
    assert len(lines) == 1 and lines[0].startswith("error: ") and message in lines[0], r.stderr


def test_tokenizer_that_does_not_fit_is_rejected(pretrained, tmp_path):
    big = tmp_path / "big.json"
    assert _run("train_tokenizer.py", "vocab_size=700", f"out={big}", "max_documents=40", cwd=tmp_path).returncode == 0
    export = pretrained / "pre" / "export"
    r = _run(
        "train.py",
        "task=mtp",
        f"model.path={export}",
        f"data.tokenizer={big}",
        "logger=csv",
        f"output_dir={tmp_path}/run",
        cwd=tmp_path,
    )
    assert r.returncode == 2 and "tokenizer has" in r.stderr, r.stderr


def test_export_on_demand_equals_the_end_of_training_export(pretrained):
    out = pretrained / "again"
    r = _run("export.py", f"ckpt_path={pretrained}/pre/checkpoints/last.ckpt", f"out={out}", cwd=pretrained)
    assert r.returncode == 0, r.stderr[-2000:]  # the checkpoint alone: its training config comes with it
    from safetensors.torch import load_file

    end = pretrained / "pre" / "export"
    files = sorted(p.name for p in end.glob("*.safetensors"))
    assert files and files == sorted(p.name for p in out.glob("*.safetensors"))
    for name in files:
        a, b = load_file(out / name), load_file(end / name)
        assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a), name
    assert (out / "config.json").read_text() == (end / "config.json").read_text()
    assert (out / "tokenizer.json").is_file()
    # Hydra's run dirs land under runs/ (git-ignored), none in the working directory itself
    for script in ("export", "train_tokenizer"):
        assert list((pretrained / "runs" / "hydra" / script).glob("*/.hydra/config.yaml")), script
    assert not (pretrained / "outputs").exists()


def test_resume_reproduces_the_uninterrupted_run(pretrained):
    """4 steps straight == 2 steps, checkpoint, resume for 2 more: the same weights, bit for bit."""
    mid = pretrained / "pre" / "checkpoints" / "step-2.ckpt"  # no '=' in names: Hydra overrides take them
    assert mid.is_file()
    r = _run(
        "train.py",
        "experiment=debug-pretrain",
        f"data.tokenizer={pretrained / 'tokenizer.json'}",
        f"output_dir={pretrained}/resumed",
        f"ckpt_path={mid}",
        "logger=csv",
        cwd=pretrained,
    )
    assert r.returncode == 0, r.stderr[-3000:]
    from safetensors.torch import load_file

    a = load_file(pretrained / "resumed" / "export" / "model.safetensors")
    b = load_file(pretrained / "pre" / "export" / "model.safetensors")
    assert a.keys() == b.keys()
    assert all(torch.equal(a[k], b[k]) for k in a), [k for k in a if not torch.equal(a[k], b[k])][:5]
