"""Inkling's state-dict adapter: every checkpoint tensor name of the family, in both directions.

**Writing** (export) uses the release layout: what Thinking Machines ships and vLLM reads
(``model.llm.*``, ``model.mtp.*``; gate/up rows interleaved in the ``w13`` tensors).

**Reading** accepts every spelling Hugging Face transformers 5.23 loads for Inkling. Its
conversion mapping for ``inkling_mm_model`` (``transformers/conversion_mapping.py``) renames each
part of a name on its own (``model.llm.layers`` -> ``model.language_model.layers``,
``attn.wq_du`` -> ``self_attn.q_proj``, ``mlp.w13_dn.weight`` -> ``mlp.gate_proj``/``up_proj``, ...),
so a checkpoint may spell each tensor either way and mix the two:

* where the text model sits (a "root"): ``model.llm.`` (release); ``model.`` (what
  ``InklingForCausalLM``, model type ``inkling_text``, holds) and ``model.language_model.``
  (``InklingForConditionalGeneration``); each also with HF's base-model prefix ``model.``
  dropped or doubled; ``model.language_model.model.`` and ``language_model.model.model.``
  (HF's "legacy" rename of doubled prefixes). The unembedding is ``model.llm.unembed.weight``,
  ``lm_head.weight`` (or ``model.lm_head.weight`` next to a doubled prefix).
* each block tensor: its release or its HF name. ``inkling_text`` has no conversion mapping,
  so under its roots (``model.``, bare, ``model.model.``) only HF block names load.
* MTP depths (HF's ``MtpModel`` mapping): ``model.mtp.layers.{d}.`` with the depth's norms and
  projection as ``hidden_norm``/``embed_norm``/``input_proj`` or ``hnorm``/``enorm``/``eh_proj``
  (also under ``mtp_block.``); the block under ``transformer_block.``, ``mtp_block.`` or directly
  under the depth, in release or HF names; the chain norm as ``model.mtp.chain_norm.weight`` or
  ``model.mtp.shared_post_norm.weight``.

Not read: rules in those HF lists that serve other families (MTP layers numbered after the
backbone, Mellum's ``fc``/``pre_fc_norm_*``), and names HF reaches only because its patterns
are unanchored (e.g. ``model.model.llm.layers``). Vision and audio towers are skipped by
design: inkfw serves the text backbone. MTP depths beyond those requested are never read.
"""

from __future__ import annotations

import dataclasses
import difflib
import re
from collections import Counter
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Literal

import torch

from inkfw.checkpoint import Checkpoint
from inkfw.errors import CheckpointError
from inkfw.models.inkling.config import InklingConfig
from inkfw.models.inkling.model import InklingLM

Layout = Literal["release", "hf", "mixed"]
MTP_PREFIX = "model.mtp."  # every MTP tensor (HF selects MTP weights by this substring)


@dataclass(frozen=True)
class TensorMap:
    """How one inkfw tensor is stored under one spelling.

    ``op``: ``copy`` (same tensor), ``interleave`` (gate/up rows alternate along ``dim`` in the
    checkpoint, gate first in inkfw), ``cat`` (inkfw = cat(sources, dim)). ``labels`` name the
    naming choices the spelling makes (root, block names, ...): the spelling a checkpoint most
    agrees with is the one an error about a missing tensor shows.
    """

    param: str
    sources: tuple[str, ...]
    op: str = "copy"
    dim: int = 0
    depth: int | None = None  # the MTP depth holding the tensor
    labels: frozenset[str] = frozenset()


# per block: (inkfw suffix, release suffix, HF suffix); "|" separates two HF tensors joined by cat
_ATTN = [
    ("attn_norm.weight", "attn_norm.weight", "input_layernorm.weight"),
    ("mlp_norm.weight", "mlp_norm.weight", "post_attention_layernorm.weight"),
    ("attn_sconv.weight", "attn_sconv.weight", "attn_sconv.conv1d.weight"),
    ("mlp_sconv.weight", "mlp_sconv.weight", "mlp_sconv.conv1d.weight"),
    ("attn.q_proj.weight", "attn.wq_du.weight", "self_attn.q_proj.weight"),
    ("attn.k_proj.weight", "attn.wk_dv.weight", "self_attn.k_proj.weight"),
    ("attn.v_proj.weight", "attn.wv_dv.weight", "self_attn.v_proj.weight"),
    ("attn.r_proj.weight", "attn.wr_du.weight", "self_attn.r_proj.weight"),
    ("attn.o_proj.weight", "attn.wo_ud.weight", "self_attn.o_proj.weight"),
    ("attn.q_norm.weight", "attn.q_norm.weight", "self_attn.q_norm.weight"),
    ("attn.k_norm.weight", "attn.k_norm.weight", "self_attn.k_norm.weight"),
    ("attn.k_sconv.weight", "attn.k_sconv.weight", "self_attn.k_sconv.conv1d.weight"),
    ("attn.v_sconv.weight", "attn.v_sconv.weight", "self_attn.v_sconv.conv1d.weight"),
    ("attn.rel_bias.table", "attn.rel_logits_proj.proj", "self_attn.rel_logits_proj.proj"),
]
# MLPs: (inkfw suffix, release suffix, HF suffix, gate/up dim or None)
_DENSE = [
    ("mlp.gate_up", "mlp.w13_dn.weight", "mlp.gate_proj.weight|mlp.up_proj.weight", 0),
    ("mlp.down", "mlp.w2_md.weight", "mlp.down_proj.weight", None),
    ("mlp.global_scale", "mlp.global_scale", "mlp.global_scale", None),
]
_MOE = [
    ("mlp.router.weight", "mlp.gate.weight", "mlp.gate.weight", None),
    ("mlp.router.global_scale", "mlp.gate.global_scale", "mlp.gate.global_scale", None),
    ("mlp.router.score_bias", "mlp.gate.bias", "mlp.gate.e_score_correction_bias", None),
    ("mlp.experts_gate_up", "mlp.experts.w13_weight", "mlp.experts.gate_up_proj", 1),
    ("mlp.experts_down", "mlp.experts.w2_weight", "mlp.experts.down_proj", None),
    (
        "mlp.shared_gate_up",
        "mlp.shared_experts.shared_w13_weight",
        "mlp.shared_experts.gate_proj|mlp.shared_experts.up_proj",
        1,
    ),
    ("mlp.shared_down", "mlp.shared_experts.shared_w2_weight", "mlp.shared_experts.down_proj", None),
]
# an MTP depth's own tensors: inkfw names, and each naming of them
_MTP_OWN = ("hidden_norm", "embed_norm", "input_proj")
_MTP_OWN_NAMES = {
    "release": _MTP_OWN,
    "hf": ("hnorm", "enorm", "eh_proj"),
    "hf_nested": ("mtp_block.hnorm", "mtp_block.enorm", "mtp_block.eh_proj"),
}
_CHAIN_NAMES = {"release": "model.mtp.chain_norm.weight", "hf": "model.mtp.shared_post_norm.weight"}
_TOWERS = (
    "model.visual.",
    "model.audio.",
    "model.vision_tower.",
    "model.audio_tower.",
    "vision_tower.",
    "audio_tower.",
    "model.model.vision_tower.",
    "model.model.audio_tower.",
)
_BOTH = ("release", "hf")


@dataclass(frozen=True)
class _Root:
    """Where a checkpoint keeps the text model, and the block names HF reads there."""

    layers: str  # block i is under layers + f"{i}."
    embed: str
    embed_norm: str
    norm: str
    unembed: str
    blocks: tuple[str, ...]


def _hf_root(base: str, blocks: tuple[str, ...], unembed: str = "lm_head.weight") -> _Root:
    return _Root(
        base + "layers.",
        base + "embed_tokens.weight",
        base + "embed_tokens.embed_norm.weight",
        base + "norm.weight",
        unembed,
        blocks,
    )


_RELEASE_ROOT = _Root(
    "model.llm.layers.",
    "model.llm.embed.weight",
    "model.llm.embed_norm.weight",
    "model.llm.norm.weight",
    "model.llm.unembed.weight",
    _BOTH,
)
_ROOTS = (
    _RELEASE_ROOT,
    _hf_root("model.", ("hf",)),  # InklingForCausalLM
    _hf_root("", ("hf",)),  # InklingTextModel (HF adds the base-model prefix)
    _hf_root("model.model.", ("hf",), "model.lm_head.weight"),  # (HF strips one)
    _hf_root("model.language_model.", _BOTH),  # InklingForConditionalGeneration
    _hf_root("language_model.", _BOTH),
    _hf_root("model.model.language_model.", _BOTH, "model.lm_head.weight"),
    _hf_root("model.language_model.model.", _BOTH),  # HF's legacy rename of doubled prefixes
    _hf_root("language_model.model.model.", _BOTH),
)


@dataclass(frozen=True)
class _Naming:
    """A set of spellings: roots, how MTP depths name their own tensors, where their block sits."""

    roots: tuple[_Root, ...]
    mtp_own: tuple[str, ...]
    mtp_blocks: tuple[tuple[str, tuple[str, ...]], ...]  # (prefix under the depth, block namings)
    chain: tuple[str, ...]


_READ = _Naming(
    _ROOTS,
    tuple(_MTP_OWN_NAMES),
    (("transformer_block.", _BOTH), ("mtp_block.", _BOTH), ("", _BOTH)),
    tuple(_CHAIN_NAMES),
)
WRITTEN = {  # the two layouts writers produce: release (export, vLLM) and what HF's CausalLM saves
    "release": _Naming(
        (dataclasses.replace(_RELEASE_ROOT, blocks=("release",)),),
        ("release",),
        (("transformer_block.", ("release",)),),
        ("release",),
    ),
    "hf": _Naming((_hf_root("model.", ("hf",)),), ("release",), (("transformer_block.", ("hf",)),), ("release",)),
}


def _block(
    ours: str, prefix: str, moe: bool, namings: tuple[str, ...], labels: frozenset[str], depth: int | None = None
) -> Iterator[TensorMap]:
    for naming in namings:
        lab = labels | {f"blocks:{naming}"}
        for a, b, c in _ATTN:
            yield TensorMap(ours + a, (prefix + (b if naming == "release" else c),), depth=depth, labels=lab)
        for a, b, c, gate_up_dim in _MOE if moe else _DENSE:
            if naming == "release":
                op = "interleave" if gate_up_dim is not None else "copy"
                yield TensorMap(ours + a, (prefix + b,), op, gate_up_dim or 0, depth, lab)
            else:
                sources = tuple(prefix + s for s in c.split("|"))
                yield TensorMap(ours + a, sources, "cat" if len(sources) > 1 else "copy", gate_up_dim or 0, depth, lab)


def _all_maps(cfg: InklingConfig, num_depths: int, naming: _Naming) -> Iterator[TensorMap]:
    for root in naming.roots:
        lab = frozenset({f"root:{root.layers}"})
        yield TensorMap("backbone.embed.weight", (root.embed,), labels=lab)
        if cfg.use_embed_norm:
            yield TensorMap("backbone.embed_norm.weight", (root.embed_norm,), labels=lab)
        yield TensorMap("backbone.norm.weight", (root.norm,), labels=lab)
        yield TensorMap("unembed.weight", (root.unembed,), labels=lab)
        for i in range(cfg.num_layers):
            yield from _block(f"backbone.layers.{i}.", f"{root.layers}{i}.", cfg.is_moe(i), root.blocks, lab)
    for d in range(num_depths):
        p = f"{MTP_PREFIX}layers.{d}."
        for own in naming.mtp_own:
            for ours, theirs in zip(_MTP_OWN, _MTP_OWN_NAMES[own]):
                yield TensorMap(
                    f"mtp.depths.{d}.{ours}.weight", (f"{p}{theirs}.weight",), depth=d, labels=frozenset({f"mtp:{own}"})
                )
        for sub, namings in naming.mtp_blocks:
            yield from _block(f"mtp.depths.{d}.block.", p + sub, False, namings, frozenset({f"mtp_block:{sub}"}), d)
    if num_depths > 0 and cfg.mtp.chain_hidden_post_norm:
        for chain in naming.chain:
            yield TensorMap("mtp.chain_norm.weight", (_CHAIN_NAMES[chain],), labels=frozenset({f"mtp:{chain}"}))


def spellings(cfg: InklingConfig, num_depths: int, naming: _Naming = _READ) -> dict[str, list[TensorMap]]:
    """Every inkfw tensor of a model with ``num_depths`` MTP depths -> the spellings ``naming``
    allows (each distinct; a name two namings share is one spelling carrying both labels)."""
    out: dict[str, list[TensorMap]] = {}
    for m in _all_maps(cfg, num_depths, naming):
        known = out.setdefault(m.param, [])
        same = next((i for i, k in enumerate(known) if k.sources == m.sources), None)
        if same is None:
            known.append(m)
        else:
            known[same] = dataclasses.replace(known[same], labels=known[same].labels | m.labels)
    return out


def tensor_maps(cfg: InklingConfig, num_depths: int, layout: Literal["release", "hf"]) -> list[TensorMap]:
    """Every tensor of an :class:`InklingLM` with ``num_depths`` MTP depths, as ``layout`` writes it."""
    return [maps[0] for maps in spellings(cfg, num_depths, WRITTEN[layout]).values()]


# --------------------------------------------------------------------------- ops
def _interleave(t: torch.Tensor, dim: int) -> torch.Tensor:
    """inkfw [gate..., up...] -> checkpoint [g0, u0, g1, u1, ...] along ``dim``."""
    shape = list(t.shape)
    shape[dim : dim + 1] = [2, shape[dim] // 2]
    return t.reshape(shape).transpose(dim, dim + 1).reshape(t.shape)


def _deinterleave(t: torch.Tensor, dim: int) -> torch.Tensor:
    shape = list(t.shape)
    shape[dim : dim + 1] = [shape[dim] // 2, 2]
    return t.reshape(shape).transpose(dim, dim + 1).reshape(t.shape)


def source_shapes(m: TensorMap, shape: torch.Size) -> list[tuple[int, ...]]:
    if m.op == "cat":
        s = list(shape)
        s[m.dim] //= len(m.sources)
        return [tuple(s)] * len(m.sources)
    return [tuple(shape)]


def from_checkpoint(m: TensorMap, tensors: list[torch.Tensor]) -> torch.Tensor:
    if m.op == "cat":
        return torch.cat(tensors, dim=m.dim)
    if m.op == "interleave":
        return _deinterleave(tensors[0], m.dim)
    return tensors[0]


def to_checkpoint(m: TensorMap, t: torch.Tensor) -> list[torch.Tensor]:
    if m.op == "cat":
        return list(t.chunk(len(m.sources), dim=m.dim))
    if m.op == "interleave":
        return [_interleave(t, m.dim)]
    return [t]


# --------------------------------------------------------------------------- reading
@dataclass
class Resolved:
    """How a checkpoint's names map onto the inkfw tensors of its config (all shipped depths)."""

    layout: Layout
    used: dict[str, TensorMap]  # inkfw tensor -> the spelling the checkpoint uses
    maps: dict[str, list[TensorMap]]  # inkfw tensor -> every spelling
    label_counts: Counter[str]
    depth_files: dict[int, Path]  # MTP depth -> a file holding it

    def score(self, m: TensorMap) -> int:
        """How many of the checkpoint's spellings make the same naming choices as ``m``."""
        return sum(self.label_counts[lab] for lab in m.labels)

    def preferred(self, param: str) -> TensorMap:
        """The spelling of ``param`` the checkpoint's other names agree with most."""
        return max(self.maps[param], key=self.score)


def _closest(name: str, known: list[str]) -> str:
    """The known name most like ``name``; candidates share its prefix up to the first index if any do."""
    stem = re.match(r"^(.*?\.\d+\.)", name)
    pool = [k for k in known if stem and k.startswith(stem.group(1))]
    if not pool:
        head = name.split(".", 1)[0] + "."
        pool = [k for k in known if k.startswith(head)] or known
    return difflib.get_close_matches(name, pool, n=1, cutoff=0.0)[0]


def resolve(cfg: InklingConfig, ckpt: Checkpoint) -> Resolved:
    """Match every tensor name of ``ckpt`` to a spelling; one error for the first name that fits
    none, a tensor spelled twice, or an MTP depth split between two files."""
    shipped = cfg.mtp.num_nextn_predict_layers
    maps = spellings(cfg, shipped)
    index = {src: m for ms in maps.values() for m in ms for src in m.sources}
    names = [n for n in ckpt.weight_map if not n.startswith(_TOWERS)]
    if not any(n in index and not n.startswith(MTP_PREFIX) for n in names):
        raise CheckpointError(
            f"{ckpt.path}: no Inkling text tensors found "
            f"(expected model.llm.*, model.layers.* or model.language_model.*)."
        )
    found: dict[str, dict[TensorMap, list[str]]] = {}
    for name in names:
        m = index.get(name)
        if m is None:
            raise CheckpointError(
                f"{ckpt.weight_map[name]}: unexpected tensor {name} (closest known name: "
                f"{_closest(name, list(index))})."
            )
        found.setdefault(m.param, {}).setdefault(m, []).append(name)
    counts: Counter[str] = Counter(lab for spelled in found.values() for m in spelled for lab in m.labels)
    resolved = Resolved("mixed", {}, maps, counts, {})
    _check_depth_files(ckpt, found, resolved)
    for param, spelled in found.items():
        ranked = sorted(spelled, key=resolved.score, reverse=True)
        if len(ranked) > 1:
            kept, extra = spelled[ranked[0]][0], spelled[ranked[1]][0]
            raise CheckpointError(
                f"{ckpt.weight_map[extra]}: unexpected tensor {extra}, a second copy of {kept} "
                f"in {ckpt.weight_map[kept]}."
            )
        resolved.used[param] = ranked[0]
    for layout in ("release", "hf"):
        written = {s for ms in spellings(cfg, shipped, WRITTEN[layout]).values() for s in ms[0].sources}
        if all(n in written for n in names):
            resolved.layout = layout
            break
    return resolved


def _check_depth_files(ckpt: Checkpoint, found: dict[str, dict[TensorMap, list[str]]], resolved: Resolved) -> None:
    """An MTP depth is read from one place: the main files (index/single file) or one MTP file."""
    sides = set(ckpt.side_files)
    for spelled in found.values():
        for m, names in spelled.items():
            if m.depth is None:
                continue
            for name in names:
                file = ckpt.weight_map[name]
                seen = resolved.depth_files.setdefault(m.depth, file)
                if seen != file and (seen in sides or file in sides):
                    raise CheckpointError(
                        f"MTP depth {m.depth} is in two files, {seen} and {file}; keep each depth in one file."
                    )


def load_state(model: InklingLM, ckpt: Checkpoint) -> None:
    """Copy every tensor of ``model`` from ``ckpt`` (cast to the parameter's dtype).

    Errors name the file and tensor: unexpected (with the closest known name), missing, wrong
    shape, unreadable. MTP depths beyond the model's are never read.
    """
    resolved = resolve(model.cfg, ckpt)
    for param, target in model.state_dict(keep_vars=True).items():  # parameters and persistent buffers
        m = resolved.used.get(param) or resolved.preferred(param)
        for src, want in zip(m.sources, source_shapes(m, target.shape)):
            if src not in ckpt.weight_map:
                where = resolved.depth_files.get(m.depth, ckpt.main_file) if m.depth is not None else ckpt.main_file
                raise CheckpointError(f"{where}: missing tensor {src}.")
            got = ckpt.shape(src)
            if got != want:
                raise CheckpointError(
                    f"{ckpt.weight_map[src]}: tensor {src} has shape {list(got)}, "
                    f"expected {list(want)} from config.json."
                )
        value = from_checkpoint(m, [ckpt.read(s) for s in m.sources])
        with torch.no_grad():
            target.copy_(value)


# --------------------------------------------------------------------------- writing
FP32_TENSORS = re.compile(r"(sconv\.weight|router\.score_bias|router\.global_scale)$")


def release_tensors(model: InklingLM, dtype: torch.dtype | None = None) -> Iterator[tuple[str, torch.Tensor]]:
    """The model's tensors under release-layout names; ``dtype`` casts all but the short convs
    and the router's bias and scale, which stay fp32 (as HF transformers keeps them)."""
    state = model.state_dict(keep_vars=True)
    for m in tensor_maps(model.cfg, model.num_mtp_depths, "release"):
        t = state[m.param].detach()
        cast = dtype if dtype is not None and not FP32_TENSORS.search(m.param) else None
        for name, out in zip(m.sources, to_checkpoint(m, t)):
            out = out.to(cast) if cast is not None and out.is_floating_point() else out
            yield name, out.contiguous().cpu()


def is_mtp_tensor(name: str) -> bool:
    """Whether a checkpoint tensor belongs to the MTP depths (written to ``mtp.safetensors`` on request)."""
    return name.startswith(MTP_PREFIX)
