"""The Python API: ``LLM`` composes the CLI's config, generates, streams, and cleans up."""

from __future__ import annotations

import pytest
from omegaconf import OmegaConf

from inkfw import LLM, SamplingParams
from inkfw.errors import ConfigError
from inkfw.llm import options_to_overrides
from inkfw.speculative.factory import serving_config

PROMPTS = ["def add(a, b):\n", "import os\n", "class Queue:\n    def __init__(self):\n"]


@pytest.fixture(scope="module")
def llm():
    return LLM(model="checkpoints/inkling-tiny", mtp_depths=8)


@pytest.fixture(scope="module")
def plain_llm():
    return LLM(model="checkpoints/inkling-tiny", drafter="none")


def test_options_become_the_clis_overrides():
    assert options_to_overrides(
        "inkling-debug",
        drafter="ngram",
        mtp_depths=2,
        num_speculative_tokens=3,
        engine={"max_num_seqs": 4, "max_model_len": None},
        dtype="bfloat16",
    ) == [
        "model=inkling-debug",
        "drafter=ngram",
        "mtp.depths=2",
        "spec.num_tokens=3",
        "engine.max_num_seqs=4",
        "engine.max_model_len=null",
        "dtype='bfloat16'",
    ]
    # a path is a checkpoint of the `inkling` preset; text is quoted so Hydra takes it as is
    assert options_to_overrides("ckpts/my model (v2)") == ["model=inkling", "model.path='ckpts/my model (v2)'"]


def test_llm_config_is_the_cli_config(llm):
    cli = serving_config(["model=inkling", "model.path=checkpoints/inkling-tiny", "mtp.depths=8"])
    assert OmegaConf.to_container(llm.config) == OmegaConf.to_container(cli)
    assert llm.engine.drafter.num_depths == 8 and llm.engine.drafter.num_tokens == 8
    assert llm.model_name == "inkling-tiny"


def test_bad_options_are_one_sentence_config_errors():
    with pytest.raises(ConfigError, match=r"\(unknown option 'no_such_option'; to add a new key write"):
        LLM(model="inkling-debug", no_such_option=3)
    with pytest.raises(ConfigError, match="drafter"):
        LLM(model="inkling-debug", drafter="bogus")
    # were taken silently: max_tokens fell back to 64, a bad stop list dropped its bad items
    with pytest.raises(ConfigError, match=r"^max_new_tokens must be an integer >= 1, got 'abc'\.$"):
        LLM(model="inkling-debug", max_new_tokens="abc")
    with pytest.raises(ConfigError, match=r"^stop must be a list of non-empty strings"):
        LLM(model="inkling-debug", stop=["", 3])


def test_greedy_generate_equals_plain_decoding_and_keeps_order(llm, plain_llm):
    outs = llm.generate(PROMPTS, SamplingParams(temperature=0.0), max_tokens=20)
    plain = plain_llm.generate(PROMPTS, SamplingParams(temperature=0.0), max_tokens=20)
    assert [o.prompt for o in outs] == PROMPTS
    for o, p in zip(outs, plain):
        assert o.token_ids == p.token_ids and o.text == p.text
        assert o.finish_reason == "length" and len(o.token_ids) == 20
        assert o.prompt_token_ids == list(llm.tokenizer.encode(o.prompt).ids)
    assert sum(o.num_accepted_tokens for o in outs) > 0  # MTP drafts are accepted
    assert all(p.num_draft_tokens == 0 for p in plain)
    o = outs[0]
    assert o.mean_acceptance_length == pytest.approx(1 + o.num_accepted_tokens / o.num_verify_steps)
    # token ids, and a mix of both kinds in one call, give the same
    mixed = llm.generate([outs[1].prompt_token_ids, PROMPTS[0]], max_tokens=20)
    assert [m.token_ids for m in mixed] == [outs[1].token_ids, outs[0].token_ids]
    assert mixed[0].prompt is None and mixed[0].text == outs[1].text
    assert not llm.engine.has_unfinished() and llm.engine.kv.is_whole()


def test_stream_increments_add_up_to_generate(llm):
    ref = llm.generate(PROMPTS, max_tokens=24)
    texts, ids = ["", "", ""], [[], [], []]
    finished = []
    for delta in llm.stream(PROMPTS, max_tokens=24):
        assert not finished.count(delta.index)  # nothing after a request's last increment
        texts[delta.index] += delta.text
        ids[delta.index] += delta.token_ids
        if delta.finished:
            finished.append(delta.index)
            assert delta.output.token_ids == ref[delta.index].token_ids
    assert sorted(finished) == [0, 1, 2]
    assert texts == [r.text for r in ref] and ids == [r.token_ids for r in ref]


def test_stop_strings_cut_the_text_and_never_leak_in_a_stream(llm):
    ref = llm.generate(PROMPTS[1], max_tokens=24)[0]
    assert ref.text.count("import os") >= 2
    stop = "\nimport"
    out = llm.generate(PROMPTS[1], max_tokens=24, stop=[stop])[0]
    assert out.finish_reason == "stop" and out.text == ref.text[: ref.text.index(stop)]
    pieces = [d.text for d in llm.stream(PROMPTS[1], max_tokens=24, stop=stop)]
    assert "".join(pieces) == out.text  # pieces are never taken back, so none held the stop's start


def test_closing_a_stream_early_aborts_its_requests(llm):
    stream = llm.stream(PROMPTS[1], max_tokens=500)
    first = next(stream)
    assert first.token_ids and not first.finished
    assert llm.engine.has_unfinished()
    stream.close()
    assert not llm.engine.has_unfinished() and llm.engine.kv.is_whole()


def test_seeded_sampling_is_reproducible_and_per_prompt_params(llm):
    params = SamplingParams(temperature=1.0, top_p=0.95, seed=11)
    a = llm.generate(PROMPTS[2], params, max_tokens=16)[0]
    b = llm.generate(PROMPTS[2], params, max_tokens=16)[0]
    assert a.token_ids == b.token_ids
    greedy = llm.generate(PROMPTS[2], max_tokens=16)[0]
    both = llm.generate([PROMPTS[2], PROMPTS[2]], [params, SamplingParams(temperature=0.0)], max_tokens=16)
    assert [o.token_ids for o in both] == [a.token_ids, greedy.token_ids]
    with pytest.raises(ConfigError, match="one per prompt"):
        llm.generate(PROMPTS, [params], max_tokens=4)


def test_a_bad_prompt_queues_nothing(llm):
    with pytest.raises(ConfigError, match="model limit"):
        llm.generate([PROMPTS[0], [5] * (llm.max_model_len + 1)], max_tokens=4)
    with pytest.raises(ConfigError, match="empty"):
        llm.generate([PROMPTS[0], ""], max_tokens=4)
    # named as the caller wrote it (the engine's own check says max_new_tokens)
    with pytest.raises(ConfigError, match=r"^max_tokens must be an integer >= 1, got 'x'\.$"):
        llm.generate(PROMPTS[0], max_tokens="x")
    with pytest.raises(ConfigError, match=r"^stop must be a list of non-empty strings, got \[3\]\.$"):
        llm.generate(PROMPTS[0], max_tokens=4, stop=[3])
    assert not llm.engine.has_unfinished() and llm.engine.kv.is_whole()


def test_a_tokenizer_less_preset_takes_token_ids():
    debug = LLM(model="inkling-debug", num_speculative_tokens=2)
    assert debug.tokenizer is None and debug.engine.drafter.num_tokens == 2
    out = debug.generate([3, 17, 42, 99], max_tokens=6)[0]
    assert 1 <= len(out.token_ids) <= 6 and out.text == ""
    with pytest.raises(ConfigError, match="tokenizer"):
        debug.generate("text needs a tokenizer", max_tokens=2)


def test_llm_warms_up_what_serving_would_pay_for_in_its_first_requests():
    """``LLM(...)`` with adaptive k measures its step costs at every batch bucket it can run
    before any request; an eager engine at a fixed k has nothing to warm, and a compiled one
    compiles at first use unless asked (``llm.warmup()``)."""
    auto = LLM(model="inkling-debug", num_speculative_tokens="auto", engine={"max_num_seqs": 3})
    adaptive = auto.engine.adaptive
    assert adaptive is not None and auto.engine.needs_warmup
    assert all(adaptive.has_costs(b) for b in (1, 2, 4)) and auto.engine.warmup_s > 0
    assert not auto.engine.has_unfinished() and auto.engine.metrics.num_steps == 0  # warm-up leaves no trace
    fixed = LLM(model="inkling-debug", num_speculative_tokens=2)
    assert not fixed.engine.needs_warmup and fixed.warmup() == 0.0 and fixed.engine.warmup_s == 0.0
    compiled = LLM(model="inkling-debug", num_speculative_tokens=2, engine={"compile": True})
    assert compiled.engine.needs_warmup and compiled.engine.warmup_s == 0.0  # nothing compiled yet
