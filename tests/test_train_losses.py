"""MTP training losses: targets, document boundaries, depth weights, frozen depths."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from helpers.models import randomize_, tiny_config
from inkfw.errors import ConfigError
from inkfw.models.inkling.model import InklingLM
from inkfw.train.losses import depth_weights, mtp_losses, target_mask


@pytest.fixture(scope="module")
def lm() -> InklingLM:
    torch.manual_seed(0)
    return randomize_(InklingLM(tiny_config(), mtp_depths=3)).eval()


def test_depth_weights():
    w = depth_weights(4, beta=0.5)
    assert torch.allclose(w.sum(), torch.tensor(1.0))
    assert torch.allclose(w[1:] / w[:-1], torch.full((3,), 0.5))
    assert torch.allclose(depth_weights(2, weights=[1, 3]), torch.tensor([0.25, 0.75]))
    for bad in ({"weights": [1, 2, 3]}, {"weights": [-1, 2]}, {"beta": 0.0}, {"beta": 1.5}):
        with pytest.raises(ConfigError):
            depth_weights(2, **bad)


def test_target_mask_respects_document_boundaries():
    doc = torch.tensor([[0, 0, 0, 1, 1, 1, 1]])
    assert target_mask(doc, 2).tolist() == [[True, False, False, True, True, False, False]]
    assert target_mask(doc, 7).sum() == 0


def _reference_ce(model, ids, doc, depth):
    """Per-position restatement: depth d at t predicts x[t+d+2] from the uncached chain."""
    h = model(ids)
    g = model.mtp_chain(h, ids, depth + 1)[depth]
    losses = []
    for b in range(ids.shape[0]):
        for t in range(ids.shape[1] - depth - 2):
            if doc[b, t] == doc[b, t + depth + 2]:
                losses.append(F.cross_entropy(model.logits(g[b, t]).float()[None], ids[b, t + depth + 2][None]))
    return torch.stack(losses).mean()


def test_ce_matches_per_position_restatement(lm):
    g = torch.Generator().manual_seed(1)
    ids = torch.randint(0, 90, (2, 12), generator=g)
    doc = torch.tensor([[0] * 5 + [1] * 7, [2] * 12])
    stats = mtp_losses(lm, ids, doc, weights=torch.tensor([1.0, 0.0, 0.0]))
    for d in range(3):
        assert torch.allclose(stats.ce[d], _reference_ce(lm, ids, doc, d), atol=1e-5)
    assert torch.allclose(stats.loss, stats.ce[0], atol=1e-6)
    assert stats.num_targets[0] == (5 - 2) + (7 - 2) + (12 - 2)


def test_boundary_tokens_of_other_documents_do_not_leak(lm):
    """Changing the next document's tokens changes no loss term of the previous one."""
    g = torch.Generator().manual_seed(2)
    a = torch.randint(0, 90, (1, 8), generator=g)
    b1, b2 = torch.randint(0, 90, (1, 3), generator=g), torch.randint(0, 90, (1, 3), generator=g)
    doc = torch.tensor([[0] * 8 + [1] * 3])
    s1 = mtp_losses(lm, torch.cat([a, b1], 1), doc)
    s2 = mtp_losses(lm, torch.cat([a, b2], 1), doc)
    # document 1 has 3 tokens: only depth 0 has one target there (t=8 -> x[10])
    assert s1.num_targets == [6 + 1, 5, 4]
    for d in (1, 2):  # these depths only see document 0
        assert torch.allclose(s1.ce[d], s2.ce[d], atol=1e-6)


def test_kl_objective_and_agreement(lm):
    ids = torch.randint(0, 90, (2, 10), generator=torch.Generator().manual_seed(3))
    stats = mtp_losses(lm, ids, objective="kl")
    h = lm(ids)
    g0 = lm.mtp_chain(h, ids, 1)[0]
    q = lm.logits(g0[:, :-2]).float().log_softmax(-1)
    p = lm.logits(h[:, 1:-1]).float().log_softmax(-1)
    kl = (p.exp() * (p - q)).sum(-1).mean()
    assert torch.allclose(stats.kl[0], kl, atol=1e-5)
    agree = (q.argmax(-1) == p.argmax(-1)).float().mean()
    assert torch.allclose(stats.agreement[0], agree)
    assert 1.0 <= stats.simulated_acceptance_length <= 4.0
    with pytest.raises(ConfigError):
        mtp_losses(lm, ids, objective="mse")


def test_only_trained_depths_get_gradients(lm):
    ids = torch.randint(0, 90, (2, 10), generator=torch.Generator().manual_seed(4))
    lm.zero_grad()
    mtp_losses(lm, ids, train_from=2).loss.backward()
    assert all(p.grad is None or p.grad.abs().sum() == 0 for p in lm.mtp.depths[0].parameters())
    assert any(p.grad is not None and p.grad.abs().sum() > 0 for p in lm.mtp.depths[2].parameters())
    assert all(p.grad is None for p in lm.backbone.layers.parameters())
    lm.zero_grad()
