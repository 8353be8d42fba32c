"""scripts/infer.py, inkfw.infer and inkfw.prompts: config groups, the output.json contract, greedy equality
across drafters, and one clear line for every kind of bad input.

Most checks call :func:`run_infer` in-process on a config composed with Hydra's compose API;
a handful run the script to see exit codes, stderr and the Hydra wrapper.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
from hydra import compose, initialize_config_dir
from omegaconf import OmegaConf, open_dict

from helpers.engine import slow_first_calls
from inkfw.errors import CheckpointError, ConfigError, InkfwError
from inkfw.infer import run_infer
from inkfw.paths import config_dir
from inkfw.prompts import DEMO_TEXT_PROMPTS, read_prompts_file
from inkfw.reporting import write_json_atomic
from inkfw.speculative.factory import build_engine

ROOT = Path(__file__).resolve().parent.parent
CONF = config_dir()
# the random-init debug preset (not the shipped checkpoint), a small KV pool, short runs
FAST = ["model=inkling-debug", "device=cpu", "engine.max_model_len=96", "max_new_tokens=6"]
CONTRACT_REQUEST_KEYS = {
    "prompt_token_ids",
    "token_ids",
    "text",
    "num_verify_steps",
    "num_draft_tokens",
    "num_accepted_tokens",
    "finish_reason",
}
CONTRACT_METRIC_KEYS = {"mean_acceptance_length", "acceptance_per_position", "tokens_per_s"}


@pytest.fixture(autouse=True, scope="module")
def one_thread():
    """The debug model's tiny ops run far faster on one thread (OpenMP barriers spin on busy CPUs)."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


def make_cfg(*overrides: str, fast: bool = True):
    with initialize_config_dir(config_dir=str(CONF), version_base="1.3"):
        fast_options = [
            o for o in FAST if not (o.startswith("model=") and any(x.startswith("model=") for x in overrides))
        ]
        return compose("infer", overrides=[*(fast_options if fast else []), *overrides])


def group_options(group: str) -> list[str]:
    return sorted(p.stem for p in (CONF / group).glob("*.yaml"))


def write_jsonl(path: Path, lines: list) -> Path:
    path.write_text("".join((ln if isinstance(ln, str) else json.dumps(ln)) + "\n" for ln in lines))
    return path


def run_script(*overrides: str, cwd: Path) -> subprocess.CompletedProcess:
    env = {**os.environ, "WANDB_MODE": "offline", "OMP_NUM_THREADS": "1"}
    return subprocess.run(
        [
            sys.executable,
            str(ROOT / "scripts" / "infer.py"),
            *overrides,
            "hydra.run.dir=" + str(cwd / "hydra"),
            "hydra.output_subdir=null",
        ],
        capture_output=True,
        text=True,
        cwd=cwd,
        timeout=300,
        env=env,
    )


def error_lines(stderr: str) -> list[str]:
    return [ln for ln in stderr.strip().splitlines() if ln.strip()]


@pytest.fixture(scope="module")
def ckpt_with_tokenizer(tmp_path_factory) -> Path:
    """The inkling-debug preset exported as a checkpoint, with a word-level tokenizer.json."""
    from tokenizers import Tokenizer
    from tokenizers.models import WordLevel
    from tokenizers.pre_tokenizers import Whitespace

    from inkfw.models.inkling.checkpoint import export_checkpoint
    from inkfw.presets import build_model

    words = ["[UNK]", "<s>", "</s>"] + [
        "the",
        "capital",
        "of",
        "france",
        "is",
        "def",
        "fibonacci",
        "(",
        "n",
        ")",
        ":",
        "speculative",
        "decoding",
        "makes",
        "generation",
        "faster",
        "because",
        "hello",
        "world",
        "a",
        "b",
        "c",
    ]
    vocab = {w: i for i, w in enumerate(words)}
    vocab.update({f"w{i}": i for i in range(len(words), 500)})
    tok = Tokenizer(WordLevel(vocab, unk_token="[UNK]"))
    tok.pre_tokenizer = Whitespace()
    root = tmp_path_factory.mktemp("ckpt")
    tok.save(str(root / "tokenizer.json"))
    model = build_model(OmegaConf.load(CONF / "model" / "inkling-debug.yaml"))
    return export_checkpoint(model, root / "inkling-debug", tokenizer_json=root / "tokenizer.json")


# ------------------------------------------------------------------ config groups
@pytest.mark.parametrize("drafter", group_options("drafter"))
@pytest.mark.parametrize("sampler", group_options("sampler"))
@pytest.mark.parametrize("kv", group_options("kv"))
def test_every_group_combination_builds(drafter, sampler, kv):
    cfg = make_cfg(f"drafter={drafter}", f"sampler={sampler}", f"kv={kv}")
    engine, tokenizer = build_engine(cfg)
    assert tokenizer is None  # random-init preset
    assert type(engine.drafter).__name__ == OmegaConf.load(CONF / "drafter" / f"{drafter}.yaml")._target_.split(".")[-1]
    if drafter == "mtp":
        assert (engine.drafter.num_tokens, engine.drafter.num_depths) == (4, 4)  # k = D = all that ship
    assert engine.kv.block_size == 16 and engine.kv.enable_prefix_caching
    assert engine.sampler.defaults.greedy


def test_group_options_reach_the_components():
    cfg = make_cfg(
        "drafter=ngram",
        "drafter.min_n=2",
        "drafter.max_n=5",
        "spec.num_tokens=3",
        "kv.block_size=8",
        "kv.num_blocks=64",
        "kv.enable_prefix_caching=false",
        "sampler.temperature=0.7",
        "sampler.top_k=20",
        "sampler.top_p=0.9",
        "engine.max_num_seqs=3",
        "engine.max_num_batched_tokens=40",
    )
    engine, _ = build_engine(cfg)
    d, kv, c = engine.drafter, engine.kv, engine.config
    assert (d.min_n, d.max_n, d.num_tokens) == (2, 5, 3)
    assert (kv.block_size, kv.enable_prefix_caching) == (8, False)
    assert {g.pool.num_blocks for g in kv.groups if g.window is None} == {64}
    assert (engine.sampler.defaults.temperature, engine.sampler.defaults.top_k, engine.sampler.defaults.top_p) == (
        0.7,
        20,
        0.9,
    )
    assert (c.max_num_seqs, c.max_num_batched_tokens, c.max_model_len, c.check_drafts) == (3, 40, 96, False)


def test_mtp_depths_and_num_tokens():
    engine, _ = build_engine(make_cfg("mtp.depths=2", "spec.num_tokens=5"))
    assert (engine.drafter.num_depths, engine.drafter.num_tokens, engine.drafter.lookahead) == (2, 5, 2)
    assert {g.name.split(":")[0] for g in engine.kv.groups if g.name.startswith("draft/")} == {"draft/0", "draft/1"}


# ------------------------------------------------------------------ outputs
def check_contract(result: dict, max_new: dict[int, int] | int) -> None:
    reqs, m = result["requests"], result["metrics"]
    assert set(m) >= CONTRACT_METRIC_KEYS
    steps = accepted = drafted = 0
    for i, r in enumerate(reqs):
        assert set(r) >= CONTRACT_REQUEST_KEYS
        if r["finish_reason"] == "error":
            assert r["error"] and r["token_ids"] == [] and r["num_verify_steps"] == 0
            continue
        limit = max_new if isinstance(max_new, int) else max_new[i]
        assert 1 <= len(r["token_ids"]) <= limit
        assert r["finish_reason"] in ("length", "stop")
        assert 0 <= r["num_accepted_tokens"] <= r["num_draft_tokens"]
        assert r["num_verify_steps"] >= 1
        steps, accepted, drafted = (
            steps + r["num_verify_steps"],
            accepted + r["num_accepted_tokens"],
            drafted + r["num_draft_tokens"],
        )
    assert m["num_verify_steps"] == steps and m["num_accepted_tokens"] == accepted
    assert m["num_draft_tokens"] == drafted
    assert m["mean_acceptance_length"] == pytest.approx(1 + accepted / steps)
    assert m["mean_acceptance_length"] == pytest.approx(1 + sum(m["acceptance_per_position"]))
    assert m["tokens_per_s"] > 0


def test_demo_writes_the_json_contract(tmp_path, capsys):
    out = tmp_path / "deep" / "dir" / "out.json"
    result = run_infer(make_cfg(f"output.json={out}"))
    written = json.loads(out.read_text())
    assert written["requests"] == result["requests"] and written["metrics"]["num_errors"] == 0
    assert len(written["requests"]) == 3 and len({len(r["prompt_token_ids"]) for r in written["requests"]}) == 3
    check_contract(written, 6)
    assert written["metrics"]["drafter"] == "mtp" and written["metrics"]["num_tokens"] == 4
    assert not list(out.parent.glob("*.tmp"))  # atomic write leaves nothing behind
    stdout = capsys.readouterr().out
    assert "ids: [" in stdout and "mean acceptance length" in stdout and "forward share" in stdout


def test_greedy_drafters_match_the_autoregressive_baseline(tmp_path):
    prompts = write_jsonl(
        tmp_path / "p.jsonl",
        [
            {"token_ids": [5, 6, 7, 8, 5, 6, 7]},
            {"token_ids": list(range(10, 40)), "max_new_tokens": 9},
            {"token_ids": [42]},  # shorter than P - 1
        ],
    )
    runs = {}
    for name, extra in [
        ("none", ["drafter=none"]),
        ("mtp", ["drafter=mtp", "engine.check_drafts=true"]),
        ("mtp-k6-d2", ["drafter=mtp", "mtp.depths=2", "spec.num_tokens=6"]),
        ("ngram", ["drafter=ngram"]),
    ]:
        result = run_infer(make_cfg(f"prompts_file={prompts}", "max_new_tokens=8", *extra))
        check_contract(result, {0: 8, 1: 9, 2: 8})
        runs[name] = [r["token_ids"] for r in result["requests"]]
        if name != "none":
            assert result["metrics"]["num_draft_tokens"] > 0
    assert runs["mtp"] == runs["none"] == runs["ngram"] == runs["mtp-k6-d2"]
    assert [len(t) for t in runs["none"]] == [8, 9, 8]


def test_auto_k_measures_its_costs_before_generating(tmp_path):
    """``spec.num_tokens=auto``: infer warms the engine up for the prompts' batch (adaptive k's
    step and prompt-pass costs, not in tokens/s), reports the seconds and the k chosen, and
    emits plain decoding's tokens."""
    prompts = write_jsonl(tmp_path / "p.jsonl", [{"token_ids": [5, 6, 7, 8, 5, 6, 7]}, {"token_ids": [9, 10, 11]}])
    auto = run_infer(make_cfg(f"prompts_file={prompts}", "max_new_tokens=8", "drafter=mtp", "spec.num_tokens=auto"))
    plain = run_infer(make_cfg(f"prompts_file={prompts}", "max_new_tokens=8", "drafter=none"))
    metrics = auto["metrics"]
    assert metrics["warmup_s"] > 0 and sum(metrics["chosen_k"].values()) > 0
    assert plain["metrics"]["chosen_k"] is None
    assert [r["token_ids"] for r in auto["requests"]] == [r["token_ids"] for r in plain["requests"]]


def test_first_compiles_while_generating_stay_out_of_tokens_per_s(tmp_path, monkeypatch):
    """A step shape compiled or captured while generating is warm-up: ``warmup_s`` reports it,
    and ``wall_s`` (tokens/s) leaves it out."""
    compile_s = 0.4
    slow_first_calls(monkeypatch, compile_s)
    t = time.perf_counter()
    metrics = run_infer(make_cfg("prompt_token_ids=[3,4,5,6]", "max_new_tokens=6", "drafter=mtp"))["metrics"]
    elapsed = time.perf_counter() - t
    assert metrics["warmup_s"] >= 2 * compile_s  # the verify step and the drafting round, at least
    assert 0 < metrics["wall_s"] <= elapsed - metrics["warmup_s"]
    assert metrics["tokens_per_s"] == pytest.approx(metrics["num_generated_tokens"] / metrics["wall_s"])


def test_sampling_is_seeded_and_consistent(tmp_path):
    over = ["prompt_token_ids=[3,4,5,6]", "sampler.temperature=1.0", "sampler.top_k=50", "sampler.top_p=0.95"]
    a = run_infer(make_cfg(*over, "seed=3"))
    b = run_infer(make_cfg(*over, "seed=3"))
    check_contract(a, 6)
    assert a["requests"][0]["token_ids"] == b["requests"][0]["token_ids"]


def test_text_prompts_stop_strings_and_demo_with_tokenizer(ckpt_with_tokenizer, tmp_path, capsys):
    base = ["model=inkling", f"model.path={ckpt_with_tokenizer}"]
    result = run_infer(make_cfg(*base, "prompt='hello world'"))
    r = result["requests"][0]
    assert r["prompt"] == "hello world" and r["prompt_token_ids"] == [20, 21]
    first_word = r["text"].split()[0]
    stopped = run_infer(make_cfg(*base, "prompt='hello world'", f"stop=['{first_word}']"))["requests"][0]
    assert stopped["finish_reason"] == "stop" and first_word not in stopped["text"]
    capsys.readouterr()
    demo = run_infer(make_cfg(*base, "drafter=none", "max_new_tokens=2"))
    assert [q["prompt"] for q in demo["requests"]] == list(DEMO_TEXT_PROMPTS)
    assert DEMO_TEXT_PROMPTS[0].splitlines()[0] in capsys.readouterr().out


# ------------------------------------------------------------------ bad input
@pytest.mark.parametrize(
    "overrides, error, needle",
    [
        (["model=inkling", "model.path=/nonexistent/ckpt"], CheckpointError, "checkpoint directory not found"),
        (["mtp.depths=0"], ConfigError, "mtp.depths"),
        (["mtp.depths=5"], ConfigError, "mtp.depths=5"),
        (["drafter=none", "mtp.depths=5"], ConfigError, "mtp.depths=5"),
        (["spec.num_tokens=0"], ConfigError, "spec.num_tokens"),
        (["drafter=ngram", "spec.num_tokens=0"], ConfigError, "spec.num_tokens"),
        (["drafter=ngram", "drafter.min_n=0"], ConfigError, "min_n"),
        (["prompt_token_ids=[]"], ConfigError, "empty"),
        (["prompt_token_ids=[1,2,100000]"], ConfigError, "prompt token ids"),
        (["prompt='hello'"], ConfigError, "prompt_token_ids=[1,2,3]"),
        (["stop=[x]"], ConfigError, "stop strings need a tokenizer"),
        (["sampler.temperature=-1"], ConfigError, "temperature"),
        (["sampler.top_p=0"], ConfigError, "top_p"),
        (["sampler.top_k=-2"], ConfigError, "top_k"),
        (["sampler.seed=-1"], ConfigError, "seed"),
        (["max_new_tokens=0"], ConfigError, "max_new_tokens"),
        (["engine.max_num_seqs=0"], ConfigError, "engine.max_num_seqs"),
        (["engine.cuda_graphs=true"], ConfigError, "needs the model on a CUDA device"),
        (["engine.compile=true", "engine.pad_batches=false"], ConfigError, "pad_batches=false needs eager steps"),
        (["kv.block_size=0"], ConfigError, "kv.block_size"),
        # the cache would take 'maybe' as true
        (["kv.enable_prefix_caching=maybe"], ConfigError, "kv.enable_prefix_caching must be true or false"),
        (["prompts_file=/nonexistent/p.jsonl"], ConfigError, "file not found"),
        (["prompt_token_ids=[1,2]", "prompts_file=/x.jsonl"], ConfigError, "only one of"),
        (["dtype=float64"], ConfigError, "dtype"),
        (["+kv.bogus=1"], ConfigError, "bogus"),
    ],
)
def test_bad_input_raises_one_sentence(overrides, error, needle):
    with pytest.raises(error) as info:
        run_infer(make_cfg(*overrides))
    msg = str(info.value)
    assert needle in msg and "\n" not in msg


def test_prompt_longer_than_the_model_limit():
    cfg = make_cfg()
    with open_dict(cfg):
        cfg.prompt_token_ids = [5] * 96  # engine.max_model_len=96: no room for a new token
    with pytest.raises(ConfigError, match="the model limit is 96"):
        run_infer(cfg)


def test_unreadable_checkpoint(tmp_path):
    ckpt = tmp_path / "ckpt"
    ckpt.mkdir()
    (ckpt / "config.json").write_text("{not json")
    with pytest.raises(InkfwError, match="config.json"):
        run_infer(make_cfg("model=inkling", f"model.path={ckpt}"))


def test_batch_rejects_bad_requests_and_runs_the_rest(tmp_path, capsys):
    prompts = write_jsonl(
        tmp_path / "p.jsonl",
        [
            {"token_ids": [5, 6, 7]},
            "{not json",
            {"token_ids": []},
            "",  # blank lines are skipped
            {"token_ids": [5, 99999]},
            {"prompt": "needs a tokenizer"},
            {"token_ids": [1, 2], "max_tokens": 3},
            {"token_ids": [9, 8, 7], "max_new_tokens": 3},
        ],
    )
    out = tmp_path / "out.json"
    result = run_infer(make_cfg(f"prompts_file={prompts}", f"output.json={out}"))
    errs = error_lines(capsys.readouterr().err)
    assert [e.split(":")[0] for e in errs] == ["error"] * 5
    assert [e.split(": ")[1] for e in errs] == ["request 2", "request 3", "request 4", "request 5", "request 6"]
    assert "not valid JSON" in errs[0] and "empty" in errs[1] and "99999" in errs[2]
    assert "tokenizer" in errs[3] and "max_tokens" in errs[4]
    written = json.loads(out.read_text())
    assert result["num_errors"] == 5 and written["metrics"]["num_errors"] == 5
    reasons = [r["finish_reason"] for r in written["requests"]]
    assert reasons[1:6] == ["error"] * 5 and reasons[0] != "error" and reasons[6] != "error"
    check_contract(written, {0: 6, 6: 3})


def test_prompts_file_parsing(tmp_path):
    items = read_prompts_file(
        write_jsonl(
            tmp_path / "p.jsonl",
            [
                {"prompt": "hi", "max_new_tokens": 4},
                {"token_ids": [1]},
                [1, 2],
                {"prompt": "a", "token_ids": [1]},
                {"token_ids": [1.5]},
                {"token_ids": [1], "max_new_tokens": 0},
                {"prompt": 3},
            ],
        )
    )
    assert (items[0].text, items[0].max_new_tokens, items[0].error) == ("hi", 4, None)
    assert items[1].token_ids == [1] and items[1].error is None
    assert all(it.error for it in items[2:]) and [it.index for it in items] == list(range(1, 8))
    (tmp_path / "empty.jsonl").write_text("\n\n")
    with pytest.raises(ConfigError, match="holds no prompts"):
        read_prompts_file(tmp_path / "empty.jsonl")


def test_write_json_atomic_replaces(tmp_path):
    path = tmp_path / "a" / "b.json"
    write_json_atomic(path, {"x": 1})
    write_json_atomic(path, {"x": 2})
    assert json.loads(path.read_text()) == {"x": 2} and os.listdir(path.parent) == ["b.json"]
    with pytest.raises(ConfigError, match="directory"):
        run_infer(make_cfg(f"output.json={tmp_path}"))


# ------------------------------------------------------------------ the script
@pytest.mark.parametrize(
    "overrides, needle",
    [
        (["drafter=foo"], "error: unknown drafter 'foo'; choose one of mtp, ngram, none."),
        (["model=inkling", "model.path=/nonexistent/ckpt"], "checkpoint directory not found"),
    ],
)
def test_script_bad_input_one_line(tmp_path, overrides, needle):
    out = run_script(*overrides, cwd=tmp_path)
    assert out.returncode != 0
    lines = error_lines(out.stderr)
    assert len(lines) == 1, out.stderr
    assert lines[0].startswith("error: ") and needle in lines[0]
    assert "Traceback" not in out.stderr


def test_script_debug_shows_traceback(tmp_path):
    out = run_script("mtp.depths=0", "debug=true", cwd=tmp_path)
    assert out.returncode != 0 and "Traceback" in out.stderr


def test_script_batch_with_a_bad_line_exits_2(tmp_path):
    prompts = write_jsonl(tmp_path / "p.jsonl", [{"token_ids": [5, 6, 7]}, "{bad", {"token_ids": [8, 9]}])
    out = tmp_path / "res" / "out.json"
    proc = run_script(f"prompts_file={prompts}", f"output.json={out}", *FAST, cwd=tmp_path)
    assert proc.returncode == 2, proc.stderr
    lines = error_lines(proc.stderr)
    assert len(lines) == 1 and lines[0].startswith("error: request 2: ") and "Traceback" not in proc.stderr
    written = json.loads(out.read_text())
    assert [r["finish_reason"] for r in written["requests"]][1] == "error"
    check_contract(written, 6)
    assert "mean acceptance length" in proc.stdout and "ids: [" in proc.stdout
    assert not (tmp_path / "outputs").exists()


def test_script_help_and_cfg_job(tmp_path):
    helped = run_script("--help", cwd=tmp_path)
    assert helped.returncode == 0
    for option in (
        "drafter=mtp|ngram|none",
        "mtp.depths",
        "spec.num_tokens",
        "prompts_file",
        "output.json",
        "engine.check_drafts",
        "sampler.temperature",
    ):
        assert option in helped.stdout
    job = run_script("--cfg", "job", "drafter=ngram", cwd=tmp_path)
    assert job.returncode == 0
    cfg = OmegaConf.create(job.stdout)
    assert cfg.drafter._target_.endswith("NgramDrafter") and cfg.kv.block_size == 16


def test_group_choice_precheck(capsys):
    from inkfw.cli import check_group_choices

    check_group_choices(CONF, ["drafter=ngram", "sampler=default", "kv.block_size=8", "prompt=a=b", "--cfg", "job"])
    for arg, line in [
        ("drafter=foo", "error: unknown drafter 'foo'; choose one of mtp, ngram, none."),
        ("+kv=nope", "error: unknown kv 'nope'; choose one of paged."),
        ("drafter=mtp,bar", "error: unknown drafter 'bar'; choose one of mtp, ngram, none."),
    ]:
        with pytest.raises(SystemExit) as info:
            check_group_choices(CONF, [arg])
        assert info.value.code == 2 and capsys.readouterr().err.strip() == line
