"""Draft-span preparation for re-prefill (docs/design.md §2): the torch reference against the
host-list construction the MTP drafter used (its index formulas restated here), the Triton
kernel (interpreter, fp32) against the reference, and one hand-built span checked row by row."""

from __future__ import annotations

import random

import pytest
import torch

from inkfw.kernels.draft_span import prepare_draft_spans_reference, prepare_draft_spans_triton

pytestmark = pytest.mark.kernel

IMPLEMENTATIONS = {"reference": prepare_draft_spans_reference, "triton": prepare_draft_spans_triton}


def host_lists(tail, hidden, slots, starts, takes, lengths, width):
    """The drafter's construction: index lists built on the host from the four ints per row, then
    ``src = cat(tail[slots], hidden)``, one gather for the span and one for the new tail."""
    P = tail.shape[1] + 1
    T = width
    gather = [[P - 1 - r + min(j, max(n - 1, 0)) for j in range(T)] for r, n in zip(takes, lengths)]
    new_tail = [[n - r + i for i in range(P - 1)] for r, n in zip(takes, lengths)]
    positions = [[s + min(j, max(n - 1, 0)) for j in range(T)] for s, n in zip(starts, lengths)]
    valid = [[j < n for j in range(T)] for n in lengths]
    last = [max(n - 1, 0) for n in lengths]
    slots_t = torch.tensor(slots)
    gather_t = torch.tensor(gather)
    src = torch.cat([tail[slots_t], hidden.to(tail.dtype)], dim=1)  # [B, P-1+Th, H]
    g = src.gather(1, gather_t[:, :, None].expand(-1, -1, src.shape[-1]))
    if P > 1:
        new_tail_t = torch.tensor(new_tail)
        tail.index_copy_(0, slots_t, src.gather(1, new_tail_t[:, :, None].expand(-1, -1, src.shape[-1])))
    return g, torch.tensor(positions), torch.tensor(valid, dtype=torch.bool), torch.tensor(last)


def random_batch(seed: int, P: int, H: int, k: int, num_real: int, pad: int, static: bool):
    """A ragged batch as the drafter builds it after a verify step: each real row has a distinct
    slot, a tail holding ``tail_len`` <= P-1 valid rows (fewer for prompts shorter than P), r =
    min(max(0, P-1-a'), tail_len) re-prefilled positions and 1..k+1 new ones; padding rows use the
    scratch slot with length 0."""
    rng = random.Random(seed)
    gen = torch.Generator().manual_seed(seed)
    num_slots = num_real + 3
    scratch = num_slots
    slots, starts, takes, lengths, news = [], [], [], [], []
    for row, slot in enumerate(rng.sample(range(num_slots), num_real)):
        # row 0 re-prefills its whole tail; row 1 is a prompt shorter than P (r capped at 0)
        tail_len = P - 1 if row == 0 else 0 if row == 1 else rng.randint(0, P - 1)
        accepted = 0 if row < 2 else rng.randint(0, k)
        r = min(max(0, P - 1 - accepted), tail_len)
        new = rng.randint(1, k + 1)
        start = rng.randint(r, 50)  # span.start; the row starts r earlier
        slots.append(slot)
        starts.append(start - r)
        takes.append(r)
        lengths.append(r + new)
        news.append(new)
    slots += [scratch] * pad
    starts += [0] * pad
    takes += [0] * pad
    lengths += [0] * pad
    Th = max(news)
    width = max(lengths) if not static else max(*lengths, k + 1)
    tail = torch.randn(num_slots + 1, P - 1, H, generator=gen)  # [num_slots + 1, P-1, H]
    hidden = torch.randn(len(slots), Th, H, generator=gen)  # [B, Th, H]; rows past a row's new ones unread
    return tail, hidden, slots, starts, takes, lengths, width


CASES = [  # (P, H, k, real rows, padding rows, static width)
    (1, 24, 1, 3, 1, False),  # P = 1: no tail
    (2, 40, 3, 4, 2, True),
    (3, 24, 5, 5, 0, False),
    (3, 36, 2, 2, 3, True),
    (4, 20, 7, 6, 2, True),  # k > D
    (4, 33, 3, 3, 1, False),
]


@pytest.mark.parametrize("name", list(IMPLEMENTATIONS))
@pytest.mark.parametrize("case", range(len(CASES)))
def test_matches_host_list_construction(name, case):
    P, H, k, num_real, pad, static = CASES[case]
    tail, hidden, slots, starts, takes, lengths, width = random_batch(case, P, H, k, num_real, pad, static)
    assert takes[0] == P - 1 and takes[1] == 0  # full re-prefill, and a short prompt capping r
    expected_tail = tail.clone()
    want = host_lists(expected_tail, hidden, slots, starts, takes, lengths, width)
    got_tail = tail.clone()
    got = IMPLEMENTATIONS[name](
        got_tail,
        hidden,
        torch.tensor(slots),
        torch.tensor(starts),
        torch.tensor(takes),
        torch.tensor(lengths),
        width=width,
    )
    for g, w in zip(got, want):
        assert g.dtype == w.dtype and g.shape == w.shape
        torch.testing.assert_close(g, w, rtol=0, atol=0)
    # every slot but the scratch row (written by all padding rows, never read) is exact
    torch.testing.assert_close(got_tail[:-1], expected_tail[:-1], rtol=0, atol=0)


@pytest.mark.parametrize("name", list(IMPLEMENTATIONS))
def test_hand_built_span_reads_old_tail(name):
    """P = 3, H = 5. Row 0 (slot 1): both tail rows re-prefilled (r = 2) plus one new position, so
    the new tail shifts inside the slot and the span must still read the old rows. Row 1 (slot 0):
    a prompt shorter than P with no re-prefill and three new positions. Row 2: padding."""
    H = 5
    tail = torch.arange(3 * 2 * H, dtype=torch.float32).reshape(3, 2, H)  # [num_slots + 1, P-1, H]
    hidden = -1.0 - torch.arange(3 * 3 * H, dtype=torch.float32).reshape(3, 3, H)  # [B, Th, H]
    old = tail.clone()
    g, positions, valid, last = IMPLEMENTATIONS[name](
        tail,
        hidden,
        torch.tensor([1, 0, 2]),
        torch.tensor([10, 4, 0]),
        torch.tensor([2, 0, 0]),
        torch.tensor([3, 3, 0]),
        width=4,
    )
    torch.testing.assert_close(g[0], torch.stack([old[1, 0], old[1, 1], hidden[0, 0], hidden[0, 0]]))
    torch.testing.assert_close(g[1], torch.stack([hidden[1, 0], hidden[1, 1], hidden[1, 2], hidden[1, 2]]))
    torch.testing.assert_close(g[2], hidden[2, 0].expand(4, H))
    assert positions.tolist() == [[10, 11, 12, 12], [4, 5, 6, 6], [0, 0, 0, 0]]
    assert valid.tolist() == [[True, True, True, False], [True, True, True, False], [False] * 4]
    assert last.tolist() == [2, 2, 0]
    torch.testing.assert_close(tail[1], torch.stack([old[1, 1], hidden[0, 0]]))  # ends at the span's last row
    torch.testing.assert_close(tail[0], torch.stack([hidden[1, 1], hidden[1, 2]]))


def test_triton_strided_hidden_and_converted_dtype():
    """Hidden states that are a strided view in another dtype are read through their strides and
    converted to the tail's dtype, as ``hidden.to(tail.dtype)`` does."""
    P, H, k = 3, 24, 4
    tail, hidden, slots, starts, takes, lengths, width = random_batch(7, P, H, k, 4, 1, True)
    wide = torch.randn(hidden.shape[0], hidden.shape[1], 2 * H, generator=torch.Generator().manual_seed(1))
    view = wide[:, :, ::2].to(torch.float64)  # [B, Th, H], not contiguous after the slice below
    view = view.transpose(0, 1).contiguous().transpose(0, 1)
    args = (torch.tensor(slots), torch.tensor(starts), torch.tensor(takes), torch.tensor(lengths))
    ref_tail, tri_tail = tail.clone(), tail.clone()
    want = prepare_draft_spans_reference(ref_tail, view, *args, width=width)
    got = prepare_draft_spans_triton(tri_tail, view, *args, width=width)
    assert not view.is_contiguous()
    for g, w in zip(got, want):
        torch.testing.assert_close(g, w, rtol=0, atol=0)
    torch.testing.assert_close(tri_tail[:-1], ref_tail[:-1], rtol=0, atol=0)
