"""The serving cache: paged block pools shared by all requests.

Every byte of cache the engine uses lives here. A *cache group* is a set of layers that hold
the same positions and so share one block table per request. Attention state and conv state
live in separate groups because they are kept for different spans:

* ``target/full:kv``: keys/values of the target's global layers, every position;
* ``target/sliding:kv``: keys/values of the sliding-window layers (blocks that left the window
  are freed);
* ``draft/d:kv``: keys/values of MTP depth ``d`` (full or sliding per ``mtp_config.local_layer_ids``);
* ``<group>:conv``: the inputs of the four short convolutions of the same layers, a sliding
  window of ``conv_kernel_size`` positions (conv state is cache state, indexed like KV).

Each group owns a :class:`BlockPool` of blocks of ``block_size`` positions. Slot ``p % bs`` of
the request's block ``p // bs`` holds position ``p``, and every slot records which position it
holds, so a slot that was never written, was invalidated, or belonged to a block's previous
owner is never read (masked for attention, zeros for the convs).

Rules from the design (§3):

* prefix caching registers a block in a group only when that group's state in it is final: all
  its positions and the ``lookahead`` tokens after it are committed (``num_final`` below; draft
  groups may stop earlier, ``num_final_draft``), and the block's hash covers those lookahead
  tokens, because MTP depth ``s`` at position ``t`` reads tokens up to ``t + s + 1``. A lookup
  needs every group a request holds: the target groups, and the groups of the MTP depths it drafts
  with (none for a request that decodes plainly). Freed blocks
  stay findable until evicted (LRU);
* windowed groups (sliding attention, conv state) free blocks no future query can read, but
  keep ``lookahead - 1`` extra positions for the drafter's re-prefill;
* one extra *scratch* block per group absorbs writes of padding tokens.
"""

from __future__ import annotations

import hashlib
import time
from collections import OrderedDict
from collections.abc import Callable, Hashable, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

import numpy as np
import torch

from inkfw.cache.interface import EMPTY_POSITION, conv_channels
from inkfw.errors import ConfigError

if TYPE_CHECKING:
    from inkfw.kernels import Kernels


class BlockPool:
    """Block ids with refcounts, an LRU queue of free blocks and a hash -> block index.

    A free block may still carry a hash (its content is a cached prefix); allocating it
    evicts that entry. Blocks are handed out least-recently-freed first.
    """

    def __init__(self, num_blocks: int):
        self.num_blocks = num_blocks
        self.refcount = [0] * num_blocks
        self.block_hash: list[bytes | None] = [None] * num_blocks
        self.free: OrderedDict[int, None] = OrderedDict((b, None) for b in range(num_blocks))
        self.cached: dict[bytes, int] = {}

    @property
    def num_free(self) -> int:
        return len(self.free)

    def allocate(self) -> int | None:
        if not self.free:
            return None
        block, _ = self.free.popitem(last=False)
        h = self.block_hash[block]
        if h is not None:
            del self.cached[h]
            self.block_hash[block] = None
        self.refcount[block] = 1
        return block

    def acquire_cached(self, h: bytes) -> int | None:
        """Take a reference on the block cached under ``h`` (None if there is none)."""
        block = self.cached.get(h)
        if block is None:
            return None
        if self.refcount[block] == 0:
            del self.free[block]
        self.refcount[block] += 1
        return block

    def release(self, block: int) -> None:
        self.refcount[block] -= 1
        assert self.refcount[block] >= 0, f"block {block} released more often than acquired"
        if self.refcount[block] == 0:
            self.free[block] = None  # most recently freed: evicted last

    def register(self, block: int, h: bytes) -> None:
        """Make ``block`` findable under ``h`` (no-op if that content is cached already)."""
        if self.block_hash[block] is None and h not in self.cached:
            self.cached[h] = block
            self.block_hash[block] = h


@dataclass
class CacheGroup:
    name: str
    window: int | None  # positions a query reads back (sliding window, conv kernel); None: all
    layers: list[list[torch.Tensor]]  # per layer: [k, v] or the four conv streams, each [slots, ...]
    pool: BlockPool
    slot_pos: torch.Tensor  # [(num_blocks + 1) * block_size] position each slot holds, or EMPTY
    draft: bool  # written by drafter spans (else by target forwards)
    block_size: int

    @property
    def scratch_slot(self) -> int:
        return self.pool.num_blocks * self.block_size

    @property
    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for layer in self.layers for t in layer)


def slots_of(
    group: CacheGroup, table: torch.Tensor, base: torch.Tensor, positions: torch.Tensor, valid: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """(slots [N] of ``positions`` [B, ...] through ``table`` [B, W] from logical block ``base`` [B],
    the scratch slot where not ``valid`` or unmapped; ok [B, ...]: the token has a real slot)."""
    bs, W = group.block_size, table.shape[1]
    column = positions.div(bs, rounding_mode="floor") - base.view(-1, *([1] * (positions.dim() - 1)))
    inside = (column >= 0) & (column < W)
    phys = table.gather(1, column.clamp(0, W - 1).reshape(column.shape[0], -1)).view(column.shape)
    ok = valid & inside & (phys >= 0)
    slots = torch.where(ok, phys * bs + positions.remainder(bs), group.scratch_slot)
    return slots.reshape(-1), ok


class StepView:
    """Where one forward's tokens go in one group, and what they may read, from tensors alone.

    ``table`` [B, W] holds the physical blocks of logical blocks ``base .. base + W - 1`` of each
    row (-1: none; ``base`` [B]); the host builds both (:meth:`PagedKVManager.step_tables`), so
    building a view reads nothing back from the device and has the same shapes step after step
    (compile and CUDA-graph friendly). The slot position tags are written here, before the
    layers write the data; padding tokens (``valid`` False) write the scratch slot, tagged empty.
    Shared by all layers of the group in one forward.
    """

    def __init__(
        self, group: CacheGroup, table: torch.Tensor, base: torch.Tensor, positions: torch.Tensor, valid: torch.Tensor
    ):
        self.group, self.table, self.base, self.positions, self.valid = group, table, base, positions, valid
        self.write_slots, ok = slots_of(group, table, base, positions, valid)  # [B*T], [B, T]
        group.slot_pos.index_copy_(0, self.write_slots, torch.where(ok, positions, EMPTY_POSITION).reshape(-1))
        self._keys: tuple[torch.Tensor, torch.Tensor] | None = None
        self._windows: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}

    def keys(self) -> tuple[torch.Tensor, torch.Tensor]:
        """(key_slots [B, S = W * block_size], key_positions [B, S]) of the blocks in the table; a
        slot is readable only while it holds the position its place in the table stands for."""
        if self._keys is None:
            group, table, base = self.group, self.table, self.base
            bs, (B, W) = group.block_size, table.shape
            offsets = torch.arange(bs, device=table.device)
            columns = base[:, None] + torch.arange(W, device=table.device)  # [B, W] logical blocks
            logical = (columns[:, :, None] * bs + offsets).reshape(B, -1)  # [B, S]
            slots = (table[:, :, None] * bs + offsets).reshape(B, -1)
            key_slots = torch.where(slots >= 0, slots, group.scratch_slot)  # [B, S]
            self._keys = key_slots, torch.where(group.slot_pos[key_slots] == logical, logical, EMPTY_POSITION)
        return self._keys

    def conv_window(self, kernel_size: int) -> tuple[torch.Tensor, torch.Tensor]:
        """(slots [B, T, K], ok [B, T, K]) for positions p-K+1 .. p of every token."""
        if kernel_size not in self._windows:
            offsets = torch.arange(-(kernel_size - 1), 1, device=self.positions.device)
            want = self.positions[:, :, None] + offsets  # [B, T, K]
            slots, ok = slots_of(self.group, self.table, self.base, want.clamp(min=0), want >= 0)
            slots = slots.view(want.shape)
            ok = ok & (self.group.slot_pos[slots] == want)
            self._windows[kernel_size] = (slots, ok)
        return self._windows[kernel_size]


class PagedLayerCache:
    """:class:`~inkfw.cache.interface.LayerCache` of one layer: its KV in one group's view, its
    conv inputs in another's.

    ``kernels`` (fused :class:`~inkfw.kernels.Kernels`, or None): the layers then call
    :meth:`attend` and :meth:`short_convs`, which read the pools in place through the block
    tables, instead of :meth:`update_kv` and :meth:`conv_window`."""

    def __init__(
        self,
        kv_view: StepView,
        kv: list[torch.Tensor],
        conv_view: StepView,
        conv: list[torch.Tensor],
        kernels: Kernels | None = None,
    ):
        self.kv_view, self.kv, self.conv_view, self.conv = kv_view, kv, conv_view, conv
        self.kernels = kernels

    def attend(
        self,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        r: torch.Tensor,
        rel_table: torch.Tensor,
        window: int | None,
        tau: torch.Tensor | None,
        scale: float,
    ) -> torch.Tensor:
        """Store ``k, v`` [B, T, Hkv, D], then attend: q [B, T, Hq, D], r [B, T, Hq, d_rel] ->
        [B, T, Hq, D], with the paged span attention kernel (inkfw/kernels/paged_attention.py)."""
        assert self.kernels is not None, "attend() needs fused kernels"
        view = self.kv_view
        self._store_kv(k, v)
        return self.kernels.paged_span_attention(
            q,
            *self.kv,
            view.group.slot_pos,
            view.table,
            view.base,
            view.positions,
            r,
            rel_table,
            block_size=view.group.block_size,
            window=window,
            tau=tau,
            scale=scale,
        )

    def short_convs(
        self, streams: Sequence[int], xs: Sequence[torch.Tensor], weights: Sequence[torch.Tensor]
    ) -> list[torch.Tensor]:
        """``x + conv(x)`` of conv ``streams`` that share a channel count, in one launch of the
        cached short-conv kernel (inkfw/kernels/short_conv.py): xs [B, T, C] each, weights [C, 1, K]
        each -> [B, T, C] each; stores each x at its position first."""
        assert self.kernels is not None, "short_convs() needs fused kernels"
        view = self.conv_view
        y = self.kernels.cached_short_conv(
            torch.stack(list(xs)),  # [S, B, T, C]
            torch.stack([w[:, 0, :] for w in weights]),  # [S, C, K]
            [self.conv[s] for s in streams],
            view.group.slot_pos,
            view.table,
            view.base,
            view.positions,
            view.valid,
            block_size=view.group.block_size,
        )  # [S, B, T, C]
        return list(y.unbind(0))

    def _store_kv(self, k: torch.Tensor, v: torch.Tensor) -> None:
        """Write k, v [B, T, Hkv, D] to this forward's slots (padding: the scratch slot)."""
        slots = self.kv_view.write_slots
        for pool, new in zip(self.kv, (k, v)):
            pool.index_copy_(0, slots, new.reshape(-1, *new.shape[2:]).to(pool.dtype))

    def update_kv(self, k, v, positions):
        self._store_kv(k, v)
        ks, vs = self.kv
        key_slots, key_positions = self.kv_view.keys()
        flat = key_slots.reshape(-1)
        shape = (*key_slots.shape, *ks.shape[1:])
        return (
            ks.index_select(0, flat).view(shape),
            vs.index_select(0, flat).view(shape),
            key_positions,
        )  # [B, S, Hkv, D] x2, [B, S]

    def conv_window(self, stream, x, positions, kernel_size):
        store = self.conv[stream]
        store.index_copy_(0, self.conv_view.write_slots, x.reshape(-1, x.shape[-1]).to(store.dtype))
        slots, ok = self.conv_view.conv_window(kernel_size)
        window = store.index_select(0, slots.reshape(-1)).view(*slots.shape, store.shape[-1])
        return window.masked_fill(~ok[..., None], 0.0)  # [B, T, K, C]


class TimedPagedLayerCache(PagedLayerCache):
    """A :class:`PagedLayerCache` that reports the seconds of each read/write to ``timer``
    (built only while :attr:`PagedKVManager.cache_timer` is set)."""

    def __init__(self, timer: Callable[[float], None], *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.timer = timer

    def _timed(self, read: Callable, *args, **kwargs):
        t = time.perf_counter()
        try:
            return read(*args, **kwargs)
        finally:
            self.timer(time.perf_counter() - t)

    def update_kv(self, k, v, positions):
        return self._timed(super().update_kv, k, v, positions)

    def conv_window(self, stream, x, positions, kernel_size):
        return self._timed(super().conv_window, stream, x, positions, kernel_size)

    def attend(self, *args, **kwargs):
        return self._timed(super().attend, *args, **kwargs)

    def short_convs(self, streams, xs, weights):
        return self._timed(super().short_convs, streams, xs, weights)


def _cdiv(a: int, b: int) -> int:
    return -(-a // b)


class PagedKVManager:
    """Block tables, allocation, prefix caching and window freeing for every request.

    ``lookahead``: how many tokens after a position the drafter's state at that position
    depends on (P for MTP drafting, 0 without a drafter cache); it sets what is final.
    ``num_blocks``: blocks of each full-attention group (None: ``max_num_seqs`` requests of
    ``max_model_len``); ``num_window_blocks``: blocks of each windowed group (sliding
    attention, conv state; None: enough for every request's window plus one step's tokens).
    A pool that runs dry makes the engine preempt a request, never fail.

    ``kernels``: the engine's :class:`~inkfw.kernels.Kernels`; when fused (Triton), the layers
    attend and convolve through them, reading the pools in place.

    ``cache_timer``: an optional timing hook, called with the seconds each cache read/write
    inside a model forward took (``update_kv`` / ``conv_window``, or ``attend`` / ``short_convs``); None (the default) builds
    untimed layer caches, at no cost.
    """

    cache_timer: Callable[[float], None] | None = None

    def __init__(
        self,
        model,
        num_draft_depths: int = 0,
        lookahead: int = 0,
        block_size: int = 16,
        num_blocks: int | None = None,
        num_window_blocks: int | None = None,
        enable_prefix_caching: bool = True,
        max_model_len: int | None = None,
        max_num_seqs: int = 16,
        max_num_batched_tokens: int = 512,
        num_draft_tokens: int | None = None,
        dtype: torch.dtype | None = None,
        device: torch.device | str | None = None,
        kernels: Kernels | None = None,
    ):
        for name, value in (
            ("block_size", block_size),
            ("num_blocks", num_blocks),
            ("num_window_blocks", num_window_blocks),
        ):
            if value is not None and (not isinstance(value, int) or isinstance(value, bool) or value < 1):
                raise ConfigError(
                    f"kv.{name} must be {'null or ' if name != 'block_size' else ''}an integer >= 1, got {value!r}."
                )
        param = next(model.parameters())
        dtype, device = dtype or param.dtype, torch.device(device or param.device)
        cfg = model.cfg
        max_model_len = max_model_len or cfg.max_position_embeddings
        k = lookahead if num_draft_tokens is None else num_draft_tokens
        bs = block_size
        self.block_size, self.lookahead = bs, lookahead
        # fused kernels read the pools in place (PagedLayerCache.attend / short_convs); else the modules' path
        self.kernels = kernels if kernels is not None and kernels.fused else None
        self.enable_prefix_caching = enable_prefix_caching
        self.conv_kernel_size = K = cfg.conv_kernel_size
        full_blocks = num_blocks or max_num_seqs * _cdiv(max_model_len, bs)

        def window_blocks(window: int) -> int:
            if num_window_blocks:
                return num_window_blocks
            per_request = _cdiv(window + lookahead + 2 * k + 2, bs) + 2
            return min(full_blocks + max_num_seqs, max_num_seqs * per_request + _cdiv(max_num_batched_tokens, bs))

        self.groups: list[CacheGroup] = []

        def new_group(name: str, window: int | None, shapes: list[list[tuple[int, ...]]], draft: bool) -> int:
            blocks = full_blocks if window is None else window_blocks(window)
            slots = (blocks + 1) * bs  # + the scratch block
            layers = [[torch.zeros(slots, *s, dtype=dtype, device=device) for s in layer] for layer in shapes]
            slot_pos = torch.full((slots,), EMPTY_POSITION, dtype=torch.long, device=device)
            self.groups.append(CacheGroup(name, window, layers, BlockPool(blocks), slot_pos, draft, bs))
            return len(self.groups) - 1

        def kv_shape(block) -> list[tuple[int, ...]]:
            return [(block.attn.num_kv_heads, block.attn.head_dim)] * 2

        def conv_shape(block) -> list[tuple[int, ...]]:
            return [(c,) for c in conv_channels(block)]

        def add_layers(name: str, window: int | None, blocks: list, draft: bool) -> tuple[int, int]:
            kv = new_group(f"{name}:kv", window, [kv_shape(b) for b in blocks], draft)
            conv = new_group(f"{name}:conv", K, [conv_shape(b) for b in blocks], draft)
            return kv, conv

        layers = list(model.backbone.layers)
        layout: dict[int, tuple[int, int, int]] = {}  # target layer -> (kv group, conv group, index)
        for kind, window in (("full", None), ("sliding", cfg.sliding_window)):
            members = [i for i, layer in enumerate(layers) if (layer.attn.window is not None) == (kind == "sliding")]
            if members:
                kv, conv = add_layers(f"target/{kind}", window, [layers[i] for i in members], draft=False)
                layout.update({i: (kv, conv, j) for j, i in enumerate(members)})
        self.target_layout = [layout[i] for i in range(len(layers))]
        self.draft_layout: list[tuple[int, int]] = []
        for d, depth in enumerate(list(model.mtp.depths)[:num_draft_depths] if num_draft_depths else []):
            self.draft_layout.append(add_layers(f"draft/{d}", depth.block.attn.window, [depth.block], draft=True))
        self._group_depth: list[int | None] = [None] * len(self.groups)  # MTP depth of each draft group
        for d, pair in enumerate(self.draft_layout):
            for gi in pair:
                self._group_depth[gi] = d
        self.device = device
        self._tables: dict[Hashable, list[list[int]]] = {}
        self._fresh_blocks: dict[int, list[int]] = {}  # group -> blocks allocated, tags not yet cleared
        self._tags_by_block = [g.slot_pos.view(-1, bs) for g in self.groups]
        self._hashes: dict[Hashable, list[bytes]] = {}  # block hashes of the registered blocks, in order
        self._num_draft_registered: dict[Hashable, int] = {}  # of those, blocks registered in draft groups
        self._held: dict[Hashable, list[bool]] = {}  # per request and group: holds blocks there (add)

    # ------------------------------------------------------------------ queries
    def num_free_blocks(self) -> list[int]:
        return [g.pool.num_free for g in self.groups]

    def is_whole(self) -> bool:
        """True when no request holds a block (all blocks free, cached or not)."""
        return all(g.pool.num_free == g.pool.num_blocks for g in self.groups) and not self._tables

    def usage(self) -> float:
        """Fraction (0..1) of the first target full-attention group's blocks that requests hold;
        blocks kept only for prefix caching count as free."""
        full = [g for g in self.groups if g.window is None and not g.draft] or self.groups
        pool = full[0].pool
        return 1.0 - pool.num_free / pool.num_blocks if pool.num_blocks else 0.0

    def held_blocks(self, rid: Hashable) -> list[int]:
        """Blocks request ``rid`` holds, per group."""
        return [sum(b >= 0 for b in t) for t in self._tables.get(rid, [[] for _ in self.groups])]

    @property
    def nbytes(self) -> int:
        return sum(g.nbytes for g in self.groups)

    @property
    def draft_groups(self) -> list[int]:
        return [i for i, g in enumerate(self.groups) if g.draft]

    def _needed_from(self, group: CacheGroup, first_query: int) -> int:
        """First position a query at ``first_query`` or later can read in ``group``."""
        return 0 if group.window is None else max(0, first_query - group.window + 1)

    # ------------------------------------------------------------- lifecycle
    def _hash_chain(self, tokens: Sequence[int], num_blocks: int) -> list[bytes]:
        bs, la = self.block_size, self.lookahead
        out, parent = [], b""
        arr = np.asarray(tokens, dtype=np.int64)
        for j in range(num_blocks):
            parent = hashlib.blake2b(parent + arr[j * bs : (j + 1) * bs + la].tobytes(), digest_size=16).digest()
            out.append(parent)
        return out

    def add(self, rid: Hashable, tokens: Sequence[int], draft_depths: int | None = None) -> int:
        """Start request ``rid`` with committed ``tokens``; returns how many leading positions
        are already cached (a multiple of the block size, leaving >= 1 token to compute).
        ``draft_depths``: the MTP depths ``0 .. draft_depths - 1`` whose groups ``rid`` holds
        (None: every depth; 0: it decodes plainly). A prefix hit needs the target groups and
        those; ``rid`` gets no blocks in the others."""
        assert rid not in self._tables, f"request {rid} added twice"
        tables = [[] for _ in self.groups]
        self._tables[rid] = tables
        self._hashes[rid] = []
        self._num_draft_registered[rid] = 0
        # every target group, and the groups of the depths below draft_depths
        wanted = [d is None or draft_depths is None or d < draft_depths for d in self._group_depth]
        self._held[rid] = wanted
        if not self.enable_prefix_caching:
            return 0
        bs = self.block_size
        candidates = (len(tokens) - self.lookahead) // bs  # blocks whose lookahead is committed
        if len(tokens) - candidates * bs < 1:
            candidates -= 1
        if candidates <= 0:
            return 0
        hashes = self._hash_chain(tokens, candidates)
        for j in range(candidates, 0, -1):
            h = j * bs
            if all(
                hashes[i] in g.pool.cached
                for g, want in zip(self.groups, wanted)
                if want
                for i in range(self._needed_from(g, h) // bs, j)
            ):
                break
        else:
            return 0
        for g, table, want in zip(self.groups, tables, wanted):
            if want:
                first = self._needed_from(g, h) // bs
                table.extend([-1] * first)
                table.extend(g.pool.acquire_cached(hashes[i]) for i in range(first, j))
        self._hashes[rid] = hashes[:j]
        self._num_draft_registered[rid] = j if draft_depths != 0 else 0
        return h

    def ensure(self, rid: Hashable, target_end: int, draft_end: int) -> bool:
        """Give ``rid`` blocks for target positions < ``target_end`` and draft positions <
        ``draft_end``. False when a pool ran out (what was allocated stays with ``rid``)."""
        bs = self.block_size
        for gi, (g, table, held) in enumerate(zip(self.groups, self._tables[rid], self._held[rid])):
            if not held:
                continue
            need = _cdiv(draft_end if g.draft else target_end, bs)
            while len(table) < need:
                block = g.pool.allocate()
                if block is None:
                    return False
                self._fresh_blocks.setdefault(gi, []).append(block)  # its old tags go before the next forward
                table.append(block)
        return True

    def drop_draft_depths(self, rid: Hashable, keep: int) -> None:
        """Request ``rid`` drafts with depths ``0 .. keep - 1`` only from now on: its blocks in
        the groups of deeper depths go back to the pool (tail blocks first; those registered for
        prefix caching stay cached), and it gets none there again (:meth:`ensure`,
        :meth:`finalize`)."""
        held = self._held[rid]
        for gi, (g, table) in enumerate(zip(self.groups, self._tables[rid])):
            depth = self._group_depth[gi]
            if depth is None or depth < keep or not held[gi]:
                continue
            for block in reversed(table):
                if block >= 0:
                    g.pool.release(block)
            table.clear()
            held[gi] = False

    def _clear_fresh_blocks(self) -> None:
        """Tag the slots of the blocks allocated since the last forward empty, one op per group
        (per block, a batch of 16 drafting requests cleared ~90 blocks a step: ~270 eager ops on
        a GPU). A block's tags may still name positions of the request that held it last."""
        if not self._fresh_blocks:
            return
        fresh = list(self._fresh_blocks.items())
        ids = torch.tensor([b for _, blocks in fresh for b in blocks], dtype=torch.long, device=self.device)
        for (gi, _), rows in zip(fresh, ids.split([len(blocks) for _, blocks in fresh])):
            self._tags_by_block[gi].index_fill_(0, rows, EMPTY_POSITION)  # [num_blocks + 1, block_size] view
        self._fresh_blocks.clear()

    def free(self, rid: Hashable) -> None:
        """Release every block of ``rid`` (tail blocks first, so they are evicted first); a
        request that holds nothing is ignored."""
        for g, table in zip(self.groups, self._tables.pop(rid, [])):
            for block in reversed(table):
                if block >= 0:
                    g.pool.release(block)
        self._hashes.pop(rid, None)
        self._num_draft_registered.pop(rid, None)
        self._held.pop(rid, None)

    def finalize(
        self, rid: Hashable, tokens: Sequence[int], num_final: int, num_final_draft: int | None = None
    ) -> None:
        """Positions < ``num_final`` of ``rid`` are final in the target groups, and positions <
        ``num_final_draft`` (default and at most ``num_final``) in the draft groups: register
        their full blocks for prefix caching (``tokens`` must hold ``lookahead`` tokens past
        them). A request whose drafter stopped early registers target blocks beyond its draft
        ones, which requests that decode plainly can reuse."""
        if not self.enable_prefix_caching:
            return
        limit, bs = len(tokens) - self.lookahead, self.block_size
        full = min(num_final, limit) // bs
        full_draft = min(num_final if num_final_draft is None else num_final_draft, num_final, limit) // bs
        done, done_draft = self._hashes[rid], self._num_draft_registered[rid]
        if full <= len(done) and full_draft <= done_draft:
            return
        hashes = self._hash_chain(tokens, max(full, len(done)))
        assert hashes[: len(done)] == done, "committed tokens of a request changed"
        for g, table in zip(self.groups, self._tables[rid]):
            first, end = (done_draft, full_draft) if g.draft else (len(done), full)
            for j in range(first, min(end, len(table))):
                if table[j] >= 0:
                    g.pool.register(table[j], hashes[j])
        self._hashes[rid] = hashes
        self._num_draft_registered[rid] = max(done_draft, full_draft)

    def trim(self, rid: Hashable, first_query: int) -> None:
        """Free windowed blocks no query at ``first_query`` or later can read."""
        for g, table in zip(self.groups, self._tables[rid]):
            if g.window is None:
                continue
            keep_from = self._needed_from(g, first_query) // self.block_size
            for j in range(min(keep_from, len(table))):
                if table[j] >= 0:
                    g.pool.release(table[j])
                    table[j] = -1

    # ----------------------------------------------------------------- views
    # A forward's cache views come in two halves: the host builds block tables from what it
    # knows (step_tables: no device reads), and the forward turns them into views (caches_from:
    # tensor ops only, so it can be compiled or captured in a CUDA graph).

    def group_indices(self, draft_depth: int | None = None) -> list[int]:
        """Cache groups a target forward (``draft_depth`` None) or MTP depth ``draft_depth`` uses."""
        if draft_depth is not None:
            return list(self.draft_layout[draft_depth])
        return sorted({g for kv, conv, _ in self.target_layout for g in (kv, conv)})

    def table_rows(
        self, group_index: int, rids: Sequence[Hashable | None], first: Sequence[int], end: Sequence[int]
    ) -> tuple[list[list[int]], list[int]]:
        """(block rows, base) of one group for a forward whose row b queries positions ``first[b]
        .. end[b] - 1``: the blocks those queries may read and write, from logical block ``base[b]``
        on (a windowed group starts at the window of ``first[b]``). A None rid is a padding row."""
        g, bs = self.groups[group_index], self.block_size
        rows, bases = [], []
        for rid, f, e in zip(rids, first, end):
            if rid is None:
                rows.append([])
                bases.append(0)
                continue
            table = self._tables[rid][group_index]
            lo = self._needed_from(g, f) // bs
            hi = min(len(table), _cdiv(e, bs))
            if _cdiv(e, bs) > len(table):
                raise RuntimeError(f"cache group {g.name}: request {rid} has no block for position {e - 1}")
            rows.append(table[lo:hi])
            bases.append(lo)
        return rows, bases

    def step_tables(
        self,
        groups: Sequence[int],
        rids: Sequence[Hashable | None],
        first: Sequence[int],
        end: Sequence[int],
        width: Callable[[int], int] = lambda n: n,
        stage: Callable[[str, list], torch.Tensor] | None = None,
    ) -> dict[int, tuple[torch.Tensor, torch.Tensor]]:
        """{group: (table [B, W] long, base [B] long)} for ``groups`` (see :meth:`table_rows`).
        ``width`` maps the widest row's block count to the table width W (a bucket: static
        shapes); ``stage(name, values)`` puts host values in a tensor on the device (the
        engine's persistent step buffers; default: a new tensor)."""
        stage = stage or (lambda name, values: torch.tensor(values, dtype=torch.long, device=self.device))
        self._clear_fresh_blocks()  # every forward's cache views are built here
        out = {}
        for gi in groups:
            rows, bases = self.table_rows(gi, rids, first, end)
            W = max(1, width(max(len(r) for r in rows)))
            table = stage(f"table{gi}", [r + [-1] * (W - len(r)) for r in rows])
            out[gi] = (table, stage(f"base{gi}", bases))
        return out

    def caches_from(
        self,
        tables: dict[int, tuple[torch.Tensor, torch.Tensor]],
        positions: torch.Tensor,
        valid: torch.Tensor,
        draft_depth: int | None = None,
    ) -> list[PagedLayerCache]:
        """The layer caches of a forward of ``positions`` [B, T] (``valid`` [B, T]: padding is
        False and writes the scratch block) from :meth:`step_tables`: one per target layer, or
        the one layer of MTP depth ``draft_depth``. Tensor ops only."""
        views = {gi: StepView(self.groups[gi], table, base, positions, valid) for gi, (table, base) in tables.items()}
        if draft_depth is not None:
            kv, conv = self.draft_layout[draft_depth]
            return [self._layer_cache(views[kv], self.groups[kv].layers[0], views[conv], self.groups[conv].layers[0])]
        return [
            self._layer_cache(views[kv], self.groups[kv].layers[j], views[conv], self.groups[conv].layers[j])
            for kv, conv, j in self.target_layout
        ]

    def forget_from(
        self, tables: dict[int, tuple[torch.Tensor, torch.Tensor]], positions: torch.Tensor, valid: torch.Tensor
    ) -> None:
        """Mark ``positions`` [B, T] (where ``valid``) as holding nothing in the groups of ``tables``
        (decode-step gaps of the drafter, docs/design.md §2). Tensor ops only."""
        for gi, (table, base) in tables.items():
            slots, _ = slots_of(self.groups[gi], table, base, positions, valid)
            self.groups[gi].slot_pos.index_fill_(0, slots, EMPTY_POSITION)

    # convenience forms that read the positions back (tests, profiling; not the engine's path)
    def target_caches(
        self, rids: Sequence[Hashable], positions: torch.Tensor, valid: torch.Tensor
    ) -> list[PagedLayerCache]:
        """One cache per target layer for a forward of ``positions`` [B, T] (``valid`` [B, T]:
        padding tokens are False and write to the scratch block)."""
        first, end = _spans(positions, valid)
        return self.caches_from(self.step_tables(self.group_indices(), rids, first, end), positions, valid)

    def draft_cache(
        self, depth: int, rids: Sequence[Hashable], positions: torch.Tensor, valid: torch.Tensor
    ) -> PagedLayerCache:
        first, end = _spans(positions, valid)
        tables = self.step_tables(self.group_indices(depth), rids, first, end)
        return self.caches_from(tables, positions, valid, draft_depth=depth)[0]

    def _layer_cache(self, *args) -> PagedLayerCache:
        timer, kernels = self.cache_timer, self.kernels
        if timer is None:
            return PagedLayerCache(*args, kernels=kernels)
        return TimedPagedLayerCache(timer, *args, kernels=kernels)


def _spans(positions: torch.Tensor, valid: torch.Tensor) -> tuple[list[int], list[int]]:
    """(first, end) query positions of each row of ``positions`` [B, T] (host reads)."""
    big = torch.iinfo(torch.long).max
    first = torch.where(valid, positions, big).min(dim=1).values
    end = torch.where(valid, positions + 1, 0).max(dim=1).values
    first = torch.where(first == big, 0, first)
    return first.tolist(), end.tolist()
