"""The one adapter between checkpoint tensor names and inkfw module names.

Two layouts are read:

* ``release``: what Thinking Machines ships and vLLM reads (``model.llm.*``, ``model.mtp.*``;
  gate/up rows interleaved in ``w13`` tensors). Vision and audio towers (``model.visual.*``,
  ``model.audio.*``) are skipped by design: inkfw serves the text backbone.
* ``hf``: what Hugging Face transformers saves for ``InklingForCausalLM`` (``model.layers.*``,
  ``lm_head.weight``; MTP depths under ``model.mtp.layers.{d}`` with HF block names).

Export always writes the release layout. Files are memory-mapped and read tensor by tensor,
cast on load; MTP depths beyond those requested are never read.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import tempfile
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal

import torch
from safetensors import SafetensorError, safe_open
from safetensors.torch import save_file

from inkfw.models.inkling.config import InklingConfig
from inkfw.errors import CheckpointError, ConfigError
from inkfw.models.inkling.model import EmbedSource, InklingLM

Layout = Literal["release", "hf"]
INDEX_FILE = "model.safetensors.index.json"
SINGLE_FILE = "model.safetensors"
SKIPPED_PREFIXES = ("model.visual.", "model.audio.")  # multimodal towers: not part of the text model
MTP_DEPTH_RE = re.compile(r"^model\.mtp\.layers\.(\d+)\.")


@dataclass(frozen=True)
class TensorMap:
    """How one inkfw tensor is stored in a checkpoint.

    ``op``: ``copy`` (same tensor), ``interleave`` (gate/up rows alternate along ``dim`` in the
    checkpoint, gate first in inkfw), ``cat`` (inkfw = cat(sources, dim)).
    """

    param: str
    sources: tuple[str, ...]
    op: str = "copy"
    dim: int = 0


# per block: (inkfw suffix, release suffix, hf suffix); "|" separates two HF tensors joined by cat
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
    ("mlp.shared_gate_up", "mlp.shared_experts.shared_w13_weight",
     "mlp.shared_experts.gate_proj|mlp.shared_experts.up_proj", 1),
    ("mlp.shared_down", "mlp.shared_experts.shared_w2_weight", "mlp.shared_experts.down_proj", None),
]


def _block_maps(ours: str, release: str, hf: str, moe: bool, layout: Layout) -> list[TensorMap]:
    out = [TensorMap(ours + a, (release + b if layout == "release" else hf + c,)) for a, b, c in _ATTN]
    for a, b, c, gate_up_dim in (_MOE if moe else _DENSE):
        if layout == "release":
            op = "interleave" if gate_up_dim is not None else "copy"
            out.append(TensorMap(ours + a, (release + b,), op, gate_up_dim or 0))
        else:
            sources = tuple(hf + s for s in c.split("|"))
            out.append(TensorMap(ours + a, sources, "cat" if len(sources) > 1 else "copy", gate_up_dim or 0))
    return out


def tensor_maps(cfg: InklingConfig, num_depths: int, layout: Layout) -> list[TensorMap]:
    """Every tensor of an :class:`InklingLM` with ``num_depths`` MTP depths, and where it lives."""
    rel = layout == "release"
    top = [
        ("backbone.embed.weight", "model.llm.embed.weight", "model.embed_tokens.weight"),
        ("backbone.norm.weight", "model.llm.norm.weight", "model.norm.weight"),
        ("unembed.weight", "model.llm.unembed.weight", "lm_head.weight"),
    ]
    if cfg.use_embed_norm:
        top.append(("backbone.embed_norm.weight", "model.llm.embed_norm.weight",
                    "model.embed_tokens.embed_norm.weight"))
    maps = [TensorMap(a, (b if rel else c,)) for a, b, c in top]
    for i in range(cfg.num_layers):
        maps += _block_maps(f"backbone.layers.{i}.", f"model.llm.layers.{i}.", f"model.layers.{i}.",
                            cfg.is_moe(i), layout)
    for d in range(num_depths):
        p = f"model.mtp.layers.{d}."
        maps += [TensorMap(f"mtp.depths.{d}.{n}.weight", (f"{p}{n}.weight",))
                 for n in ("hidden_norm", "embed_norm", "input_proj")]
        maps += _block_maps(f"mtp.depths.{d}.block.", p + "transformer_block.", p + "transformer_block.",
                            False, layout)
    if num_depths > 0 and cfg.mtp.chain_hidden_post_norm:
        maps.append(TensorMap("mtp.chain_norm.weight", ("model.mtp.chain_norm.weight",)))
    return maps


def _interleave(t: torch.Tensor, dim: int) -> torch.Tensor:
    """inkfw [gate..., up...] -> checkpoint [g0, u0, g1, u1, ...] along ``dim``."""
    shape = list(t.shape)
    shape[dim: dim + 1] = [2, shape[dim] // 2]
    return t.reshape(shape).transpose(dim, dim + 1).reshape(t.shape)


def _deinterleave(t: torch.Tensor, dim: int) -> torch.Tensor:
    shape = list(t.shape)
    shape[dim: dim + 1] = [shape[dim] // 2, 2]
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
class Checkpoint:
    """An opened checkpoint directory: config, tensor -> file map, layout, tokenizer."""

    path: Path
    config: InklingConfig
    raw_config: dict[str, Any]
    layout: Layout
    weight_map: dict[str, Path]  # tensor name -> file
    _handles: dict[Path, Any] = field(default_factory=dict, repr=False)

    @property
    def tokenizer_path(self) -> Path | None:
        p = self.path / "tokenizer.json"
        return p if p.is_file() else None

    def _open(self, file: Path):
        if file not in self._handles:
            try:
                self._handles[file] = safe_open(str(file), framework="pt", device="cpu")
            except (SafetensorError, OSError, ValueError) as exc:
                raise CheckpointError(f"{file}: not a valid safetensors file ({exc}).") from exc
        return self._handles[file]

    def tensor_names(self, file: Path) -> list[str]:
        if not file.is_file():
            raise CheckpointError(f"{file}: checkpoint file not found.")
        return list(self._open(file).keys())

    def shape(self, name: str) -> tuple[int, ...]:
        return tuple(self._open(self.weight_map[name]).get_slice(name).get_shape())

    def read(self, name: str) -> torch.Tensor:
        file = self.weight_map[name]
        try:
            return self._open(file).get_tensor(name)
        except (SafetensorError, OSError, ValueError, RuntimeError) as exc:
            raise CheckpointError(f"{file}: tensor {name} could not be read ({exc}).") from exc

    def close(self) -> None:
        self._handles.clear()


def _detect_layout(names: list[str], path: Path) -> Layout:
    if any(n.startswith("model.llm.") for n in names):
        return "release"
    if any(n.startswith("model.layers.") or n == "lm_head.weight" for n in names):
        return "hf"
    raise CheckpointError(f"{path}: no Inkling text tensors found (expected model.llm.* or model.layers.*).")


def open_checkpoint(path: str | Path) -> Checkpoint:
    """Read ``config.json`` and the tensor index of a checkpoint directory (no tensor data)."""
    path = Path(path)
    if not path.exists():
        raise CheckpointError(f"{path}: checkpoint directory not found.")
    if not path.is_dir():
        raise CheckpointError(f"{path}: a checkpoint must be a directory holding config.json and safetensors.")
    try:
        cfg_path = path / "config.json"
        raw = json.loads(cfg_path.read_text()) if cfg_path.is_file() else None
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise CheckpointError(f"{path / 'config.json'}: not a readable JSON file ({exc}).") from exc
    if raw is None:
        raise CheckpointError(f"{path / 'config.json'}: config.json not found.")
    try:
        config = InklingConfig.from_dict(raw, source=str(path / "config.json"))
    except ConfigError as exc:
        raise CheckpointError(str(exc)) from exc

    index = path / INDEX_FILE
    ckpt = Checkpoint(path, config, raw, "release", {})
    weight_map = ckpt.weight_map
    if index.is_file():
        try:
            entries = json.loads(index.read_text())["weight_map"]
            if not isinstance(entries, dict) or not all(isinstance(v, str) for v in entries.values()):
                raise TypeError("weight_map must map tensor names to file names")
        except (OSError, UnicodeDecodeError, json.JSONDecodeError, KeyError, TypeError) as exc:
            raise CheckpointError(f"{index}: not a valid safetensors index ({exc}).") from exc
        listed: dict[Path, set[str]] = {}
        for name, fname in entries.items():
            listed.setdefault(path / fname, set()).add(name)
        for file, names in listed.items():
            present = set(ckpt.tensor_names(file))
            missing = sorted(names - present)
            if missing:
                raise CheckpointError(f"{file}: tensor {missing[0]} is listed in {INDEX_FILE} but not in the file.")
            weight_map.update({n: file for n in names})
    elif (path / SINGLE_FILE).is_file():
        file = path / SINGLE_FILE
        weight_map.update({n: file for n in ckpt.tensor_names(file)})
    else:
        raise CheckpointError(f"{path}: no {SINGLE_FILE} or {INDEX_FILE} found.")
    ckpt.layout = _detect_layout(list(weight_map), path)
    return ckpt


def read_tokenizer(file: str | Path):
    """A ``tokenizers.Tokenizer`` from ``tokenizer.json``; one clear error if it cannot be read."""
    from tokenizers import Tokenizer

    try:
        return Tokenizer.from_file(str(file))
    except Exception as exc:  # the tokenizers library raises plain Exceptions on bad files
        raise CheckpointError(f"{file}: not a readable tokenizer.json ({str(exc).splitlines()[0]}).") from exc


def load_state(model: InklingLM, ckpt: Checkpoint) -> None:
    """Copy every tensor of ``model`` from ``ckpt`` (cast to the parameter's dtype).

    Errors name the file and tensor: missing, unexpected, wrong shape, unreadable.
    """
    cfg = model.cfg
    depths = model.num_mtp_depths
    maps = tensor_maps(cfg, depths, ckpt.layout)
    expected = {s for m in maps for s in m.sources}
    shipped = cfg.mtp.num_nextn_predict_layers
    for name in ckpt.weight_map:
        if name in expected or name.startswith(SKIPPED_PREFIXES):
            continue
        depth = MTP_DEPTH_RE.match(name)
        if depth and depths <= int(depth.group(1)) < shipped:
            continue  # a shipped depth beyond those requested: never read
        if name == "model.mtp.chain_norm.weight" and depths == 0:
            continue
        raise CheckpointError(f"{ckpt.weight_map[name]}: unexpected tensor {name} "
                              f"(not part of an Inkling text model with this config.json).")

    state = dict(model.named_parameters())
    state.update(model.named_buffers())
    for m in maps:
        param = state[m.param]
        for src, want in zip(m.sources, source_shapes(m, param.shape)):
            if src not in ckpt.weight_map:
                where = ckpt.path / (INDEX_FILE if (ckpt.path / INDEX_FILE).is_file() else SINGLE_FILE)
                raise CheckpointError(f"{where}: missing tensor {src}.")
            got = ckpt.shape(src)
            if got != want:
                raise CheckpointError(f"{ckpt.weight_map[src]}: tensor {src} has shape {list(got)}, "
                                      f"expected {list(want)} from config.json.")
        value = from_checkpoint(m, [ckpt.read(s) for s in m.sources])
        with torch.no_grad():
            param.copy_(value)


def load_model(path: str | Path, mtp_depths: int | None = None, dtype: torch.dtype = torch.float32,
               device: str | torch.device = "cpu", embed_source: EmbedSource = "backbone_norm",
               ) -> tuple[InklingLM, Checkpoint]:
    """Build an :class:`InklingLM` from a checkpoint directory.

    ``mtp_depths``: how many MTP depths to build and read (None: all that ship); asking for
    more than ship is an error (train extra depths with ``scripts/train.py task=mtp``).
    """
    ckpt = open_checkpoint(path)
    depths = ckpt.config.mtp_depths_to_build(mtp_depths, source=str(ckpt.path))
    with torch.device("meta"):
        model = InklingLM(ckpt.config, mtp_depths=depths, embed_source=embed_source)
    # dtypes are set while still on meta, so memory is allocated once, in the final dtype
    model = model.to_dtype(dtype).to_empty(device=device)
    load_state(model, ckpt)
    ckpt.close()
    return model.eval(), ckpt


# --------------------------------------------------------------------------- writing
FP32_TENSORS = re.compile(r"(sconv\.weight|router\.score_bias|router\.global_scale)$")


def release_tensors(model: InklingLM, dtype: torch.dtype | None = None) -> Iterator[tuple[str, torch.Tensor]]:
    """The model's tensors under release-layout names; ``dtype`` casts all but the short convs
    and the router's bias and scale, which stay fp32 (as HF transformers keeps them)."""
    state = dict(model.named_parameters())
    state.update(model.named_buffers())
    for m in tensor_maps(model.cfg, model.num_mtp_depths, "release"):
        t = state[m.param].detach()
        cast = dtype if dtype is not None and not FP32_TENSORS.search(m.param) else None
        for name, out in zip(m.sources, to_checkpoint(m, t)):
            out = out.to(cast) if cast is not None and out.is_floating_point() else out
            yield name, out.contiguous().cpu()


def export_checkpoint(model: InklingLM, out_dir: str | Path, tokenizer_json: str | Path | None = None,
                      extra_config: dict[str, Any] | None = None, dtype: torch.dtype | None = None,
                      max_shard_bytes: int | None = None) -> Path:
    """Write ``model`` in the release layout with its ``config.json`` (and ``tokenizer.json``).

    Written into a temporary directory next to ``out_dir``, then renamed into place, so a
    reader never sees a half-written checkpoint. ``config.json`` records the MTP depths
    written. ``max_shard_bytes`` splits tensors over several files with an index.
    """
    out_dir = Path(out_dir)
    out_dir.parent.mkdir(parents=True, exist_ok=True)
    cfg = model.cfg.with_mtp_depths(model.num_mtp_depths)
    tmp = Path(tempfile.mkdtemp(prefix=f".{out_dir.name}.", suffix=".tmp", dir=out_dir.parent))
    try:
        shards: list[dict[str, torch.Tensor]] = [{}]
        size = 0
        for name, t in release_tensors(model, dtype):
            nbytes = t.numel() * t.element_size()
            if max_shard_bytes is not None and shards[-1] and size + nbytes > max_shard_bytes:
                shards.append({})
                size = 0
            shards[-1][name] = t
            size += nbytes
        if len(shards) == 1:
            save_file(shards[0], str(tmp / SINGLE_FILE), metadata={"format": "pt"})
        else:
            weight_map = {}
            for i, shard in enumerate(shards):
                fname = f"model-{i + 1:05d}-of-{len(shards):05d}.safetensors"
                save_file(shard, str(tmp / fname), metadata={"format": "pt"})
                weight_map.update({n: fname for n in shard})
            total = sum(t.numel() * t.element_size() for s in shards for t in s.values())
            (tmp / INDEX_FILE).write_text(json.dumps(
                {"metadata": {"total_size": total}, "weight_map": weight_map}, indent=2))
        (tmp / "config.json").write_text(json.dumps(cfg.to_release_dict(extra_config), indent=2) + "\n")
        if tokenizer_json is not None:
            shutil.copyfile(tokenizer_json, tmp / "tokenizer.json")
        _replace_dir(tmp, out_dir)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return out_dir


def _replace_dir(src: Path, dst: Path) -> None:
    if not dst.exists():
        os.rename(src, dst)
        return
    old = Path(tempfile.mkdtemp(prefix=f".{dst.name}.", suffix=".old", dir=dst.parent))
    os.rename(dst, old / dst.name)
    os.rename(src, dst)
    shutil.rmtree(old, ignore_errors=True)
