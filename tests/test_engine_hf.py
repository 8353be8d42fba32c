"""The engine's greedy output equals Hugging Face transformers 5.23 greedy ``generate`` on the
same exported checkpoint, with no drafter and with multi-depth MTP drafting (fp32)."""

from __future__ import annotations

import random

import pytest
import torch
from reference.hf import TINY_AUDIO, TINY_VISION

from helpers.engine import NO_DRAFTER, make_engine, mtp, one_thread  # noqa: F401
from helpers.models import randomize_, tiny_config
from inkfw.models.inkling.checkpoint import export_checkpoint, load_model
from inkfw.models.inkling.model import InklingLM

NEW = 14
_rng = random.Random(0)
# 1 token, short, and longer than the sliding window (8) so generation runs past it
PROMPTS = [[11], [5, 17, 3], [_rng.randrange(90) for _ in range(21)], [_rng.randrange(90) for _ in range(30)]]


@pytest.fixture(scope="module")
def exported(tmp_path_factory):
    cfg = tiny_config(max_position_embeddings=256)
    torch.manual_seed(0)
    model = randomize_(InklingLM(cfg, mtp_depths=3), seed=5).eval()
    out = export_checkpoint(
        model,
        tmp_path_factory.mktemp("engine_hf") / "ckpt",
        extra_config={"vision_config": dict(TINY_VISION), "audio_config": dict(TINY_AUDIO)},
    )
    return out


@pytest.fixture(scope="module")
def hf_outputs(exported):
    from transformers import InklingForConditionalGeneration

    hf = InklingForConditionalGeneration.from_pretrained(str(exported), dtype=torch.float32).eval()
    eos = load_model(exported, mtp_depths=0)[0].cfg.eos_token_ids
    outs = []
    with torch.no_grad():
        for p in PROMPTS:  # batch 1: no padding
            ids = torch.tensor([p])
            gen = hf.generate(
                ids,
                attention_mask=torch.ones_like(ids),
                do_sample=False,
                max_new_tokens=NEW,
                eos_token_id=eos,
                pad_token_id=0,
            )
            outs.append(gen[0, len(p) :].tolist())
    return outs


def _engine_outputs(model, drafter: list[str], max_num_batched_tokens: int = 512) -> list[list[int]]:
    eng, kv = make_engine(
        model,
        drafter,
        num_blocks=64,
        max_model_len=64,
        check_drafts=True,
        max_num_batched_tokens=max_num_batched_tokens,
    )
    reqs = [eng.add_request(p, max_new_tokens=NEW) for p in PROMPTS]
    eng.generate(reqs)
    assert kv.is_whole()
    return [r.output_token_ids for r in reqs]


def test_hf_reference_is_not_trivial(hf_outputs):
    assert [len(o) for o in hf_outputs] != [0] * len(PROMPTS)
    assert len({tuple(o) for o in hf_outputs}) == len(PROMPTS)
    assert all(len(set(o)) > 3 for o in hf_outputs if len(o) == NEW)


def test_none_matches_hf_generate(exported, hf_outputs):
    model, _ = load_model(exported, mtp_depths=0, dtype=torch.float32)
    assert _engine_outputs(model, NO_DRAFTER) == hf_outputs
    assert _engine_outputs(model, NO_DRAFTER, max_num_batched_tokens=7) == hf_outputs  # chunked prefill


@pytest.mark.parametrize("D,k", [(3, 3), (2, 5)])
def test_mtp_matches_hf_generate(exported, hf_outputs, D, k):
    model, _ = load_model(exported, mtp_depths=3, dtype=torch.float32)
    assert model.num_mtp_depths == 3
    assert _engine_outputs(model, mtp(D, k)) == hf_outputs
