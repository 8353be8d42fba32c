"""The engine factory: every node of the serving groups builds through ``build_engine``, every
EngineConfig field is a command-line option, the verifier is a seam chosen by config, the
sampler given by config is the only source of probabilities and draws, and bad options are
one sentence."""

from __future__ import annotations

import dataclasses
import os
import subprocess
import sys

import pytest
from hydra import compose, initialize_config_dir
from hydra.core.global_hydra import GlobalHydra
from omegaconf import OmegaConf

from helpers.engine import FixedTokenSampler, RandomAcceptVerifier, double, mtp, one_thread, spec_model  # noqa: F401
from inkfw.errors import ConfigError
from inkfw.paths import config_dir, project_root
from inkfw.speculative.engine import DraftCheckError, EngineConfig
from inkfw.speculative.factory import build_engine, serving_config
from inkfw.speculative.sampling import SamplingParams
from inkfw.speculative.verifier import TargetVerifier

GROUPS = ("drafter", "verifier", "sampler", "kv", "engine", "kernels")
# a value other than the default for every EngineConfig field, as a command line writes it
NON_DEFAULT = {
    "max_num_seqs": ("3", 3),
    "max_num_batched_tokens": ("40", 40),
    "max_model_len": ("64", 64),
    "check_drafts": ("true", True),
    "check_drafts_atol": ("0.5", 0.5),
    "compile": ("true", True),
    "cuda_graphs": ("false", False),
    "batch_buckets": ("[8,1]", (1, 8)),
    "pad_batches": ("true", True),
}


@pytest.fixture(scope="module")
def model():
    return spec_model(seed=0)


def options(group: str) -> list[str]:
    return sorted(p.stem for p in (config_dir() / group).glob("*.yaml"))


def built(model, *overrides: str):
    engine, tokenizer = build_engine(serving_config(["model=inkling-debug", *overrides]), model=model)
    assert tokenizer is None  # the model node names no checkpoint
    return engine


# --------------------------------------------------------------------------- the engine node
def test_engine_node_holds_every_field_with_its_default():
    node = OmegaConf.load(config_dir() / "engine" / "default.yaml")
    fields = {f.name: f.default for f in dataclasses.fields(EngineConfig)}
    assert node._target_ == "inkfw.speculative.engine.EngineConfig"
    assert set(node) - {"_target_"} == set(fields) == set(NON_DEFAULT)
    assert {name: node[name] for name in fields} == fields


@pytest.mark.parametrize("field", sorted(NON_DEFAULT))
def test_every_engine_field_is_an_override(model, field):
    text, value = NON_DEFAULT[field]
    engine = built(model, f"engine.{field}={text}")
    assert getattr(engine.config, field) == value
    assert dataclasses.replace(engine.config, **{field: getattr(EngineConfig(), field)}) == EngineConfig()
    assert engine.max_model_len == (64 if field == "max_model_len" else model.cfg.max_position_embeddings)


@pytest.mark.parametrize("atol, passes", [(None, False), (0.5, True)])
def test_check_drafts_atol_reaches_the_check(model, atol, passes):
    """Draft logits off by 0.01 (argmax unchanged): the default tolerance (1e-3) catches them,
    engine.check_drafts_atol=0.5 lets them through."""
    engine = built(
        model,
        *mtp(2, 3),
        "engine.check_drafts=true",
        *([f"engine.check_drafts_atol={atol}"] if atol is not None else []),
    )
    propose = engine.drafter.propose

    def off_by_a_little(*args, **kwargs):
        drafts = propose(*args, **kwargs)
        drafts.logits = drafts.logits + 0.01 if drafts.logits is not None else None
        return drafts

    engine.drafter.propose = off_by_a_little
    request = engine.add_request([5, 6, 7, 8], max_new_tokens=6)
    if passes:
        engine.generate([request])
        assert request.num_draft_tokens > 0
    else:
        with pytest.raises(DraftCheckError, match="> 0.001"):
            engine.generate([request])


@pytest.mark.parametrize(
    "override, needle",
    [
        ("engine.max_num_seqs=0", "engine.max_num_seqs must be an integer >= 1, got 0."),
        ("engine.max_num_batched_tokens=-3", "engine.max_num_batched_tokens must be an integer >= 1, got -3."),
        ("engine.max_model_len=1", "engine.max_model_len must be null or an integer >= 2"),
        ("engine.check_drafts=maybe", "engine.check_drafts must be true or false, got 'maybe'."),
        ("engine.check_drafts_atol=-0.5", "engine.check_drafts_atol must be a finite number >= 0, got -0.5."),
        ("engine.pad_batches=sometimes", "engine.pad_batches must be null, true or false, got 'sometimes'."),
        ("+engine.bogus=1", "bogus"),
    ],
)
def test_bad_engine_value_is_one_sentence_before_loading(override, needle):
    # the model node points nowhere: the error must come before any model is read
    cfg = serving_config(["model=inkling", "model.path=/nonexistent/ckpt", override])
    with pytest.raises(ConfigError) as info:
        build_engine(cfg)
    msg = str(info.value)
    assert needle in msg and "\n" not in msg and msg.endswith(".") and msg.startswith("engine")


# --------------------------------------------------------------------------- every node builds
@pytest.mark.parametrize("group, option", [(g, o) for g in GROUPS for o in options(g)])
def test_every_node_builds_through_the_factory(model, group, option):
    node = OmegaConf.load(config_dir() / group / f"{option}.yaml")
    engine = built(model, f"{group}={option}")
    component = {
        "drafter": engine.drafter,
        "verifier": engine.verifier,
        "sampler": engine.sampler,
        "kv": engine.kv,
        "engine": engine.config,
        "kernels": engine.verifier.kernels,
    }[group]
    assert type(component).__name__ == node._target_.rsplit(".", 1)[-1]
    reqs = [
        engine.add_request([3, 1, 4, 1, 5], max_new_tokens=4),
        engine.add_request([2, 7], SamplingParams(temperature=1.0, seed=3), max_new_tokens=4),
    ]
    engine.generate(reqs)
    assert all(r.finish_reason in ("length", "stop") for r in reqs)


def test_the_default_serving_config_lists_every_group():
    cfg = serving_config()
    assert all(g in cfg for g in GROUPS)
    assert cfg.verifier._target_ == "inkfw.speculative.verifier.TargetVerifier" and cfg.verifier._partial_


def test_verifier_target_shares_the_model_and_the_sampler(model):
    engine = built(model, "verifier=target", *mtp(2, 2))
    assert type(engine.verifier) is TargetVerifier
    assert engine.verifier.model is model
    assert engine.verifier.sampler is engine.sampler is engine.drafter.sampler


def test_a_verifier_test_double_is_chosen_by_config(model):
    engine = built(model, *double("verifier", RandomAcceptVerifier, seed=2), *mtp(2, 2))
    assert type(engine.verifier) is RandomAcceptVerifier and engine.verifier.seed == 2
    assert engine.verifier.model is model and engine.verifier.sampler is engine.sampler
    engine.generate([engine.add_request([4, 5, 6], max_new_tokens=8)])
    assert engine.verifier.history  # it, not the target verifier, decided
    with pytest.raises(ConfigError, match="verifier"):
        built(model, "verifier._target_=inkfw.speculative.verifier.NoSuchVerifier")
    with pytest.raises(ConfigError, match="verifier: .*bogus"):
        built(model, "+verifier.bogus=1")


# --------------------------------------------------------------------------- the sampler seam
@pytest.mark.parametrize("drafts", [mtp(2, 3), ["drafter=none"]])
def test_verification_and_drafts_use_the_configured_sampler(model, drafts):
    """A sampler whose processed distribution is one-hot at token 7: if the drafter and the
    verifier take probabilities and draws from it (and nowhere else), every sampled token is 7
    and, with MTP, every draft is accepted; greedy rows are untouched."""
    engine = built(
        model,
        *drafts,
        f"sampler._target_={FixedTokenSampler.__module__}.FixedTokenSampler",
        "+sampler.token=7",
        "engine.check_drafts=false",
    )
    assert isinstance(engine.sampler, FixedTokenSampler)
    sampled = engine.add_request([9, 8, 7, 6, 5], SamplingParams(temperature=1.0, seed=1), max_new_tokens=9)
    greedy = engine.add_request([9, 8, 7, 6, 5], max_new_tokens=9)
    engine.generate([sampled, greedy])
    assert sampled.output_token_ids == [7] * 9
    assert greedy.output_token_ids != [7] * 9
    if drafts != ["drafter=none"]:
        assert sampled.num_accepted_tokens == sampled.num_draft_tokens > 0


# --------------------------------------------------------------------------- serving_config
def test_serving_config_overrides_and_errors():
    cfg = serving_config(["drafter=none", "engine.max_num_seqs=4"])
    assert cfg.drafter._target_.endswith("NoDrafter") and cfg.engine.max_num_seqs == 4
    with pytest.raises(ConfigError, match="serving config") as info:
        serving_config(["drafter=nope"])
    assert "\n" not in str(info.value)


def test_serving_config_inside_a_running_hydra_app():
    """Called while another Hydra config is initialised (as inside ``@hydra.main``), it composes
    inkfw/conf/infer.yaml and leaves the running app's Hydra as it was."""
    with initialize_config_dir(config_dir=str(config_dir()), version_base="1.3"):
        outer = compose("smoke")
        cfg = serving_config(["drafter=ngram"])
        assert GlobalHydra.instance().is_initialized()
        assert compose("smoke") == outer
    assert cfg.drafter._target_.endswith("NgramDrafter") and "engine" in cfg


def test_script_cfg_job_shows_the_verifier_node(tmp_path):
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    script = str(project_root() / "scripts" / "infer.py")
    out = subprocess.run(
        [
            sys.executable,
            script,
            "verifier=target",
            "engine.check_drafts_atol=0.5",
            "--cfg",
            "job",
            f"hydra.run.dir={tmp_path / 'hydra'}",
        ],
        capture_output=True,
        text=True,
        cwd=tmp_path,
        timeout=300,
        env=env,
    )
    assert out.returncode == 0, out.stderr
    job = OmegaConf.create(out.stdout)
    assert job.verifier == {"_target_": "inkfw.speculative.verifier.TargetVerifier", "_partial_": True}
    assert job.engine._target_ == "inkfw.speculative.engine.EngineConfig" and job.engine.check_drafts_atol == 0.5
    bad = subprocess.run(
        [sys.executable, script, "verifier=nope"], capture_output=True, text=True, cwd=tmp_path, timeout=300, env=env
    )
    assert bad.returncode == 2 and bad.stderr.strip() == "error: unknown verifier 'nope'; choose one of target."
