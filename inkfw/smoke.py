"""The model smoke run behind ``scripts/smoke.py``.

Greedy-decodes a batch with the dense position-indexed cache, checks every step against an
uncached forward over the whole sequence, and drafts one round with every MTP depth.
"""

from __future__ import annotations

import time
from typing import Any

import torch
from rich.console import Console
from rich.progress import Progress
from rich.table import Table

from inkfw.cache.dense import DenseModelCache
from inkfw.errors import ConfigError
from inkfw.options import int_option
from inkfw.presets import build_model
from inkfw.speculative.reference import greedy_reference_drafts


def smoke_run(cfg: Any) -> dict[str, Any]:
    console = Console()
    max_new = int_option(cfg.max_new_tokens, "max_new_tokens")
    batch_size = int_option(cfg.batch_size, "batch_size")
    seed = int_option(cfg.seed, "seed", 0)
    model = build_model(
        cfg.model, mtp_depths=cfg.mtp.depths, dtype=cfg.dtype, device=cfg.device, embed_source=cfg.mtp.embed_source
    )
    mcfg = model.cfg
    g = torch.Generator().manual_seed(seed)
    if cfg.prompt_token_ids is not None:
        prompt = torch.tensor([list(cfg.prompt_token_ids)] * batch_size, dtype=torch.long)
    else:
        prompt = torch.randint(
            3, mcfg.logits_vocab_size, (batch_size, int_option(cfg.prompt_len, "prompt_len")), generator=g
        )
    if prompt.shape[1] < 1 or int(prompt.max()) >= mcfg.vocab_size or int(prompt.min()) < 0:
        raise ConfigError(f"prompt token ids must be non-empty and lie in [0, {mcfg.vocab_size}).")
    B, T0 = prompt.shape
    total = T0 + max_new
    if total > mcfg.max_position_embeddings:
        raise ConfigError(f"prompt + max_new_tokens = {total} exceeds the model limit {mcfg.max_position_embeddings}.")
    prompt = prompt.to(next(model.parameters()).device)

    cache = DenseModelCache(model, B, total)
    seq = prompt
    positions = torch.arange(T0, device=prompt.device).expand(B, T0)
    t0 = time.perf_counter()
    with torch.no_grad(), Progress(console=console, transient=True) as progress:
        task = progress.add_task("decoding", total=max_new)
        hidden = model(seq, positions, caches=cache.layers)  # prefill [B, T0, H]
        for _ in range(max_new):
            next_tok = model.logits(hidden[:, -1]).argmax(-1, keepdim=True)  # [B, 1]
            seq = torch.cat([seq, next_tok], dim=1)
            pos = torch.full((B, 1), seq.shape[1] - 1, device=seq.device)
            hidden = model(next_tok, pos, caches=cache.layers)
            progress.advance(task)
        decode_s = time.perf_counter() - t0
        # check: the cached hidden state of the last token equals an uncached forward
        full = model(seq)
        max_diff = (full[:, -1] - hidden[:, -1]).abs().max().item()
        uncached_greedy = model.logits(full[:, T0 - 1 : -1]).argmax(-1)
        greedy_match = bool((uncached_greedy == seq[:, T0:]).all())
        # one drafting round after the sequence: the target's next token, then one draft per depth
        drafts = greedy_reference_drafts(model, seq, hidden=full)[:, 1:].T.tolist() if model.mtp is not None else []

    table = Table(title=f"inkfw smoke run: {cfg.model.name}")
    table.add_column("metric")
    table.add_column("value", justify="right")
    table.add_row("batch x prompt tokens", f"{B} x {T0}")
    table.add_row("generated tokens", f"{B * max_new}")
    table.add_row("decode tokens/s", f"{B * max_new / decode_s:.1f}")
    table.add_row("cached vs uncached max |diff|", f"{max_diff:.2e}")
    table.add_row("cached greedy == uncached greedy", "yes" if greedy_match else "NO")
    table.add_row("MTP depths", str(model.num_mtp_depths))
    for d, toks in enumerate(drafts):
        table.add_row(f"depth {d} drafts (per row)", str(toks))
    console.print(f"generated ids (row 0): {seq[0, T0:].tolist()}")
    console.print(table)
    if not greedy_match or max_diff > 1e-3:
        raise RuntimeError("cached decoding disagrees with the uncached forward")
    return {"token_ids": seq[:, T0:].tolist(), "max_diff": max_diff, "drafts": drafts}
