"""Hidden-state datasets: the backbone runs once over a corpus; MTP depths train from its stored states.

MTP depth 0 reads the backbone's final-normed hidden state of every position (docs/design.md §1),
so with those states stored, a depth's loss needs only the embedding, the depths and the
unembedding: a backbone too large for a training loop runs once, in inference, and the depths
train many times from its states (``data=hidden data.path=DIR`` with ``task=mtp``).

``scripts/dump_hidden.py`` (:func:`run_dump_hidden`) makes the rows a ``data=`` node makes for
training (:class:`inkfw.train.data.TextDataModule`: the same documents, split, tokenisation and
packing with document ids) and writes, per split, safetensors shards of ``shard_size`` rows::

    DIR/train-00000.safetensors  input_ids [N, T] int64, doc_ids [N, T] int64, hidden [N, T, H] (dtype)
    DIR/val-00000.safetensors    ...
    DIR/manifest.json            backbone config and its sha256, tokenizer.json's sha256, dtype,
                                 shapes, shards and rows per split, the model and data nodes

* A shard is written to a temporary file and renamed into place, so a shard that exists is
  whole; its safetensors metadata records what it holds (split, rows, the hashes, the sha256
  of its token ids).
* A rerun skips the shards that exist and hold what this run would write (another dump's shard
  is refused), and writes the rest.
* Processes split the work by rank (torch.distributed when initialised, else ``RANK`` /
  ``WORLD_SIZE`` as torchrun sets them): rank r writes shard i when i % world == r, i counting
  the shards of every split in order. After its own shards (and a barrier under
  torch.distributed), a process that finds every shard present and right writes
  ``manifest.json`` (atomically; processes that do write the same bytes). A reader needs the
  manifest, so a dump is usable only once complete.

:class:`HiddenDataModule` (``data=hidden``) serves batches ``(input_ids [B, T], doc_ids [B, T],
hidden [B, T, H])`` through the same loader as ``TextDataModule`` (same seed: same batches in
the same order), reading rows from the shards on demand. It refuses a dump of another backbone
config or another tokenizer, and any task but ``task=mtp``.
"""

from __future__ import annotations

import hashlib
import json
import os
from bisect import bisect_right
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from itertools import accumulate
from pathlib import Path
from typing import Any, cast

import torch
from omegaconf import OmegaConf
from safetensors import safe_open
from safetensors.torch import save_file
from torch.utils.data import Dataset, TensorDataset

from inkfw.errors import ConfigError
from inkfw.models.inkling.checkpoint import load_model
from inkfw.models.inkling.config import InklingConfig
from inkfw.models.inkling.model import InklingLM
from inkfw.nodes import build_node
from inkfw.options import int_option
from inkfw.presets import build_model, model_config, parse_dtype, plain, resolve_device, resolve_path
from inkfw.train.data import SplitDataModule

FORMAT = "inkfw-hidden-states"
FORMAT_VERSION = 1
MANIFEST = "manifest.json"
SPLITS = ("train", "val")
FIELDS = ("input_ids", "doc_ids", "hidden")  # the tensors of every shard, and of every row served


# ----------------------------------------------------------------------------- identity
def backbone_config(cfg: InklingConfig) -> dict[str, Any]:
    """The config dict the stored states depend on: the backbone's (HF ``inkling_text`` names).
    MTP fields are left out: depths neither make nor change the states, and training adds depths."""
    return cfg.to_text_dict()


def config_hash(cfg: InklingConfig) -> str:
    """sha256 of :func:`backbone_config` as canonical JSON."""
    text = json.dumps(backbone_config(cfg), sort_keys=True, separators=(",", ":"))
    return hashlib.sha256(text.encode()).hexdigest()


def file_sha256(path: str | Path) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            digest.update(chunk)
    return digest.hexdigest()


def _short(value: Any) -> str:
    text = str(value)
    return text[:12] + "..." if len(text) > 16 else text


@dataclass(frozen=True)
class DumpSpec:
    """What every shard of one dump shares; recorded in each shard and in the manifest."""

    config_hash: str
    tokenizer_hash: str  # "" when the rows were made without a tokenizer (pre-tokenised data)
    dtype: str  # of the stored hidden states, e.g. "bfloat16"
    seq_len: int
    hidden_size: int
    shard_size: int


@dataclass(frozen=True)
class Shard:
    """Rows ``[start, start + rows)`` of one split, in file ``DIR/<split>-<index>.safetensors``."""

    split: str
    index: int
    start: int
    rows: int

    @property
    def file(self) -> str:
        return f"{self.split}-{self.index:05d}.safetensors"


def plan_shards(rows_per_split: Mapping[str, int], shard_size: int) -> list[Shard]:
    """Every shard of a dump, split by split in order: ``shard_size`` rows each, the last one shorter."""
    if shard_size < 1:
        raise ConfigError(f"shard_size must be >= 1, got {shard_size}.")
    return [
        Shard(split, index, start, min(shard_size, rows - start))
        for split, rows in rows_per_split.items()
        for index, start in enumerate(range(0, rows, shard_size))
    ]


def shards_of_rank(shards: Sequence[Shard], rank: int, world_size: int) -> list[Shard]:
    """The shards process ``rank`` of ``world_size`` writes: the i-th when i % world_size == rank."""
    return [s for i, s in enumerate(shards) if i % world_size == rank]


def dump_rank() -> tuple[int, int]:
    """(rank, world size): torch.distributed's when initialised, else the ``RANK`` and
    ``WORLD_SIZE`` environment variables (torchrun sets them), else (0, 1)."""
    if torch.distributed.is_available() and torch.distributed.is_initialized():
        return torch.distributed.get_rank(), torch.distributed.get_world_size()
    raw_rank, raw_world = os.environ.get("RANK", "0"), os.environ.get("WORLD_SIZE", "1")
    try:
        rank, world = int(raw_rank), int(raw_world)
    except ValueError as exc:
        raise ConfigError(
            f"RANK and WORLD_SIZE must be integers, got RANK={raw_rank!r} WORLD_SIZE={raw_world!r}."
        ) from exc
    if not 0 <= rank < world:
        raise ConfigError(f"RANK must lie in [0, WORLD_SIZE={world}), got {rank}.")
    return rank, world


# ----------------------------------------------------------------------------- shards
def shard_metadata(spec: DumpSpec, shard: Shard, input_ids: torch.Tensor) -> dict[str, str]:
    """What a shard records about itself (safetensors metadata: strings only)."""
    return {
        "format": FORMAT,
        "version": str(FORMAT_VERSION),
        "split": shard.split,
        "index": str(shard.index),
        "start": str(shard.start),
        "rows": str(shard.rows),
        "seq_len": str(spec.seq_len),
        "hidden_size": str(spec.hidden_size),
        "dtype": spec.dtype,
        "config_hash": spec.config_hash,
        "tokenizer_hash": spec.tokenizer_hash,
        "input_ids_sha256": hashlib.sha256(input_ids.contiguous().numpy().tobytes()).hexdigest(),
    }


def read_shard_metadata(path: Path) -> dict[str, str] | None:
    """A shard's metadata; None when the file is missing or not readable safetensors."""
    if not path.is_file():
        return None
    try:
        with safe_open(str(path), framework="pt") as f:
            return dict(f.metadata() or {})
    except Exception:  # safetensors raises several kinds on a damaged file
        return None


def write_shard(
    out_dir: Path,
    shard: Shard,
    metadata: dict[str, str],
    input_ids: torch.Tensor,
    doc_ids: torch.Tensor,
    hidden: torch.Tensor,
) -> Path:
    """Write one shard atomically: a temporary file in ``out_dir``, renamed into place."""
    final = out_dir / shard.file
    tmp = out_dir / f".{shard.file}.{os.getpid()}.tmp"
    tensors = {
        "input_ids": input_ids.to(torch.long).contiguous(),  # [N, T]
        "doc_ids": doc_ids.to(torch.long).contiguous(),  # [N, T]
        "hidden": hidden.contiguous(),  # [N, T, H]
    }
    try:
        save_file(tensors, str(tmp), metadata=metadata)
        os.chmod(tmp, 0o666 & ~_umask())  # safetensors creates files readable by their owner only
        os.replace(tmp, final)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise
    return final


def _umask() -> int:
    mask = os.umask(0)
    os.umask(mask)
    return mask


def write_json_atomic(path: Path, obj: Any) -> None:
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    try:
        tmp.write_text(json.dumps(obj, indent=2) + "\n")
        os.replace(tmp, path)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise


def manifest_dict(
    spec: DumpSpec,
    cfg: InklingConfig,
    rows_per_split: Mapping[str, int],
    shards: Sequence[Shard],
    source: Mapping[str, Any] | None = None,
) -> dict[str, Any]:
    """The content of ``manifest.json`` (deterministic: every process that writes it writes the same)."""
    T, H = spec.seq_len, spec.hidden_size
    return {
        "format": FORMAT,
        "version": FORMAT_VERSION,
        "model_config_hash": spec.config_hash,
        "model_config": backbone_config(cfg),
        "tokenizer_hash": spec.tokenizer_hash,
        "dtype": spec.dtype,
        "seq_len": T,
        "hidden_size": H,
        "shard_size": spec.shard_size,
        "tensors": {
            "input_ids": {"dtype": "int64", "shape": ["rows", T]},
            "doc_ids": {"dtype": "int64", "shape": ["rows", T]},
            "hidden": {"dtype": spec.dtype, "shape": ["rows", T, H]},
        },
        "splits": {
            split: {
                "rows": int(rows),
                "shards": [{"file": s.file, "rows": s.rows} for s in shards if s.split == split],
            }
            for split, rows in rows_per_split.items()
        },
        "source": dict(source or {}),
    }


# ----------------------------------------------------------------------------- the dump
@torch.no_grad()
def backbone_hidden(model: InklingLM, input_ids: torch.Tensor, batch_size: int, dtype: torch.dtype) -> torch.Tensor:
    """The backbone's final hidden states [N, T, H] (what MTP depth 0 reads) of rows [N, T], on
    the CPU in ``dtype``, ``batch_size`` rows per forward.

    Each row is one sequence from position 0 with nothing cached, run as one batched uncached
    forward: the computation of the engine's batched prefill of those rows (docs/design.md §5),
    without a KV cache to fill, which nothing here would read."""
    device = next(model.parameters()).device
    out = []
    for i in range(0, input_ids.shape[0], batch_size):
        out.append(model(input_ids[i : i + batch_size].to(device)).to("cpu", dtype))  # [b, T, H]
    return torch.cat(out)


@dataclass
class DumpResult:
    written: list[str] = field(default_factory=list)  # shard files this process wrote
    skipped: list[str] = field(default_factory=list)  # its shards that were already there
    manifest: Path | None = None  # written by this process (every shard present), else None
    rows: dict[str, int] = field(default_factory=dict)  # rows per split
    missing: list[str] = field(default_factory=list)  # shards of other ranks not there yet


def _differs(there: Mapping[str, str], here: Mapping[str, str]) -> str:
    key = next(k for k in here if there.get(k) != here[k])
    return f"{key}: {_short(there.get(key))} there, {_short(here[key])} now"


def dump_hidden_states(
    model: InklingLM,
    splits: Mapping[str, tuple[torch.Tensor, torch.Tensor]],
    out_dir: str | Path,
    *,
    tokenizer_file: str | Path | None,
    batch_size: int = 8,
    shard_size: int = 256,
    dtype: torch.dtype = torch.bfloat16,
    rank: int = 0,
    world_size: int = 1,
    source: Mapping[str, Any] | None = None,
    progress: bool = False,
) -> DumpResult:
    """Store ``model``'s final hidden states of ``splits`` (split -> (input_ids [N, T], doc_ids
    [N, T])) in ``out_dir`` as shards and a manifest (see the module docstring): this process's
    share of the shards (``rank`` of ``world_size``), skipping those already there."""
    if batch_size < 1:
        raise ConfigError(f"batch_size must be >= 1, got {batch_size}.")
    if not 0 <= rank < world_size:
        raise ConfigError(f"rank must lie in [0, world_size={world_size}), got {rank}.")
    if not splits:
        raise ConfigError("dump_hidden: no rows to dump.")
    seq_lens = {int(ids.shape[1]) for ids, _ in splits.values()}
    if len(seq_lens) != 1 or any(ids.shape != doc.shape or ids.dim() != 2 for ids, doc in splits.values()):
        raise ConfigError("dump_hidden: every split must be rows (input_ids, doc_ids) of one shape [N, T].")
    out = Path(out_dir).expanduser()
    out.mkdir(parents=True, exist_ok=True)
    rows_per_split = {split: int(ids.shape[0]) for split, (ids, _) in splits.items()}
    shards = plan_shards(rows_per_split, shard_size)
    spec = DumpSpec(
        config_hash=config_hash(model.cfg),
        tokenizer_hash=file_sha256(tokenizer_file) if tokenizer_file is not None else "",
        dtype=str(dtype).removeprefix("torch."),
        seq_len=seq_lens.pop(),
        hidden_size=model.cfg.hidden_size,
        shard_size=shard_size,
    )

    def rows_of(s: Shard) -> tuple[torch.Tensor, torch.Tensor]:
        ids, doc = splits[s.split]
        return ids[s.start : s.start + s.rows], doc[s.start : s.start + s.rows]  # [n, T], [n, T]

    def state(s: Shard) -> tuple[dict[str, str], dict[str, str] | None]:
        """(the metadata this run writes for s, what the file there holds or None)."""
        return shard_metadata(spec, s, rows_of(s)[0]), read_shard_metadata(out / s.file)

    result = DumpResult(rows=rows_per_split)
    todo: list[tuple[Shard, dict[str, str]]] = []
    for s in shards_of_rank(shards, rank, world_size):
        expected, there = state(s)
        if there == expected:
            result.skipped.append(s.file)
            continue
        if there is not None and there.get("format") == FORMAT:
            raise ConfigError(
                f"output_dir={out}: {s.file} was written by another dump ({_differs(there, expected)}); "
                f"use a new output_dir or delete that folder."
            )
        todo.append((s, expected))  # missing, or unreadable: (re)written

    was_training = model.training
    model.eval()
    try:
        bar = _progress(progress, sum(s.rows for s, _ in todo), f"rank {rank}/{world_size}")
        for s, expected in todo:
            ids, doc = rows_of(s)
            write_shard(out, s, expected, ids, doc, backbone_hidden(model, ids, batch_size, dtype))
            result.written.append(s.file)
            bar(s.rows)
        bar(None)
    finally:
        model.train(was_training)

    if torch.distributed.is_available() and torch.distributed.is_initialized():
        torch.distributed.barrier()
    complete = [expected == there for expected, there in map(state, shards)]  # every rank's shards
    result.missing = [s.file for s, done in zip(shards, complete, strict=True) if not done]
    if not result.missing:
        result.manifest = out / MANIFEST
        write_json_atomic(result.manifest, manifest_dict(spec, model.cfg, rows_per_split, shards, source))
    return result


def _progress(enabled: bool, total: int, label: str):
    """``advance(n)`` for a transient rich progress bar over ``total`` rows; ``advance(None)`` closes it."""
    if not enabled or total == 0:
        return lambda n: None
    from rich.progress import Progress

    bar = Progress(transient=True)
    task = bar.add_task(f"dumping hidden states ({label})", total=total)
    bar.start()

    def advance(n: int | None) -> None:
        if n is None:
            bar.stop()
        else:
            bar.advance(task, n)

    return advance


def dataset_rows(dataset: Dataset) -> tuple[torch.Tensor, torch.Tensor]:
    """(input_ids [N, T], doc_ids [N, T]) of a data node's split (a ``TensorDataset`` of packed rows)."""
    if isinstance(dataset, TensorDataset):
        return dataset.tensors[0], dataset.tensors[1]
    items = [dataset[i] for i in range(len(dataset))]  # type: ignore[arg-type]
    return torch.stack([it[0] for it in items]), torch.stack([it[1] for it in items])


def run_dump_hidden(cfg: Any) -> DumpResult:
    """``scripts/dump_hidden.py``: from ``inkfw/conf/dump_hidden.yaml`` (model, data, output_dir,
    batch and shard sizes, stored dtype), this process's shards and, once all exist, the manifest."""
    missing = OmegaConf.is_missing(cfg, "output_dir") if OmegaConf.is_config(cfg) else False
    if missing or not cfg.get("output_dir"):
        raise ConfigError("set output_dir=DIR: the folder for the shards and manifest.json.")
    if str(cfg.data.get("_target_", "")).endswith(".HiddenDataModule"):
        raise ConfigError(
            "data=hidden is what scripts/dump_hidden.py writes; read a text source (data=stdlib|files|hf)."
        )
    batch_size, shard_size = int_option(cfg.batch_size, "batch_size"), int_option(cfg.shard_size, "shard_size")
    dtype, compute_dtype = parse_dtype(cfg.dtype), parse_dtype(cfg.compute_dtype)
    device = resolve_device(cfg.device)
    node = plain(cfg.model)
    ckpt_tokenizer = None
    if node.get("path"):  # the backbone only: no MTP depth is read
        model, ckpt = load_model(resolve_path(node["path"]), mtp_depths=0, dtype=compute_dtype, device=device)
        ckpt_tokenizer = ckpt.tokenizer_path
    else:
        model = build_model(cfg.model, mtp_depths=0, dtype=compute_dtype, device=device)
    tokenizer = cfg.data.get("tokenizer") or ckpt_tokenizer
    if tokenizer is None:
        raise ConfigError(
            "data.tokenizer is not set and the checkpoint has no tokenizer.json; "
            "train one with scripts/train_tokenizer.py."
        )
    tokenizer = resolve_path(tokenizer)
    data = build_node(
        "data", cfg.data, tokenizer=tokenizer, eos_id=model.cfg.eos_token_ids[0], vocab_size=model.cfg.vocab_size
    )
    data.setup("fit")  # the rows scripts/train.py would train on with this data node
    splits = {"train": dataset_rows(data.train_set), "val": dataset_rows(data.val_set)}
    rank, world = dump_rank()
    result = dump_hidden_states(
        model,
        splits,
        cfg.output_dir,
        tokenizer_file=tokenizer,
        batch_size=batch_size,
        shard_size=shard_size,
        dtype=dtype,
        rank=rank,
        world_size=world,
        source={"model": node, "data": plain(cfg.data)},
        progress=True,
    )
    out = Path(cfg.output_dir).expanduser()
    rows = ", ".join(f"{split} {n} rows" for split, n in result.rows.items())
    print(
        f"rank {rank}/{world}: wrote {len(result.written)} shard(s), skipped {len(result.skipped)} already "
        f"complete ({rows} of {splits['train'][0].shape[1]} tokens, hidden {model.cfg.hidden_size} in {cfg.dtype})"
    )
    if result.manifest is not None:
        print(f"wrote {result.manifest}: train with data=hidden data.path={out}")
    else:
        print(f"{len(result.missing)} shard(s) of other ranks are not there yet; the last rank writes {MANIFEST}")
    return result


# ----------------------------------------------------------------------------- reading
class ShardFiles:
    """A split's shards, opened on demand: rows of one tensor by row index across the shards."""

    def __init__(self, files: Sequence[Path], counts: Sequence[int]):
        self.files = list(files)
        self.starts = list(accumulate(counts, initial=0))  # [S + 1]: first row of every shard, then the total
        self._handles: dict[int, Any] = {}

    def __len__(self) -> int:
        return self.starts[-1]

    def __getstate__(self) -> dict[str, Any]:  # data-loader workers open their own handles
        return {**self.__dict__, "_handles": {}}

    def _handle(self, s: int) -> Any:
        if s not in self._handles:
            self._handles[s] = safe_open(str(self.files[s]), framework="pt")
        return self._handles[s]

    def read(self, name: str, rows: Sequence[int]) -> torch.Tensor:
        """Tensor ``name`` of ``rows`` (valid row indices, in that order), stacked: [len(rows), ...]."""
        parts = []
        for r in rows:
            s = bisect_right(self.starts, r) - 1
            local = r - self.starts[s]
            parts.append(self._handle(s).get_slice(name)[local : local + 1])  # [1, ...]
        return torch.cat(parts)


class ShardColumn:
    """One tensor (``input_ids``, ``doc_ids`` or ``hidden``) of a split, indexed like a tensor's
    first dimension (an int, or a 1-d tensor of row indices)."""

    def __init__(self, shards: ShardFiles, name: str):
        self.shards, self.name = shards, name

    def __len__(self) -> int:
        return len(self.shards)

    def _row(self, i: int) -> int:
        n = len(self)
        j = i + n if i < 0 else i
        if not 0 <= j < n:
            raise IndexError(f"row {i} out of range for {n} rows")
        return j

    def __getitem__(self, index: int | torch.Tensor) -> torch.Tensor:
        if isinstance(index, torch.Tensor) and index.dim() == 1:
            return self.shards.read(self.name, [self._row(int(i)) for i in index.tolist()])
        return self.shards.read(self.name, [self._row(int(index))])[0]


class HiddenRows(TensorDataset):
    """A split of a dump: rows ``(input_ids [T], doc_ids [T], hidden [T, H])``, read on demand.

    ``tensors`` are :class:`ShardColumn` views indexed like tensors, so
    :class:`inkfw.train.data.ResumableLoader` serves these rows exactly as it serves
    ``TextDataModule``'s (same seeded order, rank split and resume state)."""

    def __init__(self, files: Sequence[Path], counts: Sequence[int]):  # no super().__init__: nothing is loaded
        self.shards = ShardFiles(files, counts)
        self.columns = tuple(ShardColumn(self.shards, name) for name in FIELDS)
        self.tensors = cast(tuple[torch.Tensor, ...], self.columns)

    def __len__(self) -> int:
        return len(self.shards)

    def __getitem__(self, index):
        return tuple(column[index] for column in self.columns)


def read_manifest(path: str | Path) -> dict[str, Any]:
    """``DIR/manifest.json`` of a finished dump, checked against its shards' headers."""
    root = Path(path).expanduser()
    if not root.is_dir():
        raise ConfigError(f"data.path={path} does not exist; write it with scripts/dump_hidden.py output_dir={path}.")
    file = root / MANIFEST
    if not file.is_file():
        raise ConfigError(
            f"data.path={path} has no {MANIFEST}: not a finished dump of scripts/dump_hidden.py "
            f"(rerun it with output_dir={path} to finish it)."
        )
    try:
        manifest = json.loads(file.read_text())
        ok = manifest.get("format") == FORMAT and isinstance(manifest.get("splits"), dict)
    except (json.JSONDecodeError, AttributeError, UnicodeDecodeError) as exc:
        raise ConfigError(f"data.path={path}: {MANIFEST} is not valid JSON ({type(exc).__name__}).") from exc
    if not ok:
        raise ConfigError(f"data.path={path}: {MANIFEST} is not a manifest of scripts/dump_hidden.py.")
    if manifest.get("version") != FORMAT_VERSION:
        raise ConfigError(
            f"data.path={path} is a version {manifest.get('version')} dump; this inkfw reads version "
            f"{FORMAT_VERSION}: dump it again."
        )
    for split, part in manifest["splits"].items():
        for entry in part["shards"]:
            meta = read_shard_metadata(root / entry["file"])
            if meta is None:
                raise ConfigError(
                    f"data.path={path}: {entry['file']} listed in {MANIFEST} is missing or unreadable; "
                    f"rerun scripts/dump_hidden.py with output_dir={path}."
                )
            if meta.get("split") != split or int(meta.get("rows", -1)) != int(entry["rows"]):
                raise ConfigError(f"data.path={path}: {entry['file']} does not hold the rows {MANIFEST} lists.")
    return manifest


def _config_of(model: Any) -> InklingConfig:
    if isinstance(model, InklingConfig):
        return model
    if isinstance(model, InklingLM):
        return model.cfg
    return model_config(model)  # an inkfw/conf/model node


def check_manifest(
    manifest: Mapping[str, Any], path: str | Path, model: Any = None, tokenizer: str | Path | None = None
) -> None:
    """Refuse a dump of another backbone (config hash) or tokenizer (sha256 of tokenizer.json), in one sentence.

    ``model``: a ``inkfw/conf/model`` node, an :class:`InklingConfig` or a model (None: not checked)."""
    if model is not None:
        cfg = _config_of(model)
        if manifest.get("model_config_hash") != config_hash(cfg):
            there, here = dict(manifest.get("model_config") or {}), backbone_config(cfg)
            keys = [k for k in sorted(set(there) | set(here)) if there.get(k) != here.get(k)]
            what = ", ".join(f"{k} ({there.get(k)} there, {here.get(k)} here)" for k in keys[:3]) or "its hash"
            raise ConfigError(
                f"data.path={path} holds hidden states of another model: the backbone config differs in "
                f"{what}; dump them with this model (scripts/dump_hidden.py)."
            )
    if tokenizer is not None and manifest.get("tokenizer_hash"):
        mine = file_sha256(tokenizer)
        if mine != manifest["tokenizer_hash"]:
            raise ConfigError(
                f"data.path={path} was dumped with another tokenizer (tokenizer.json sha256 "
                f"{_short(manifest['tokenizer_hash'])} there, {_short(mine)} for {tokenizer}); "
                f"train with the dump's tokenizer or dump again."
            )


def _check_task(task: Any) -> None:
    """Only tasks that take the backbone's states from the batch (``task=mtp``) train from a dump."""
    cls = task if isinstance(task, type) else type(task)
    if isinstance(task, str):
        from hydra.utils import get_class

        cls = get_class(task)
    if not getattr(cls, "reads_stored_hidden", False):
        name = getattr(cls, "name", cls.__name__)
        raise ConfigError(
            f"task={name} trains the backbone, so it cannot train from stored hidden states (data=hidden); "
            f"use task=mtp."
        )


class HiddenDataModule(SplitDataModule):
    """``data=hidden``: the rows and stored hidden states of a dump (``path``), as batches
    ``(input_ids [B, T], doc_ids [B, T], hidden [B, T, H])``.

    ``model`` (the model node being trained, or its config) and ``tokenizer`` (tokenizer.json)
    must be the dump's; ``task`` (the task's ``_target_`` or class) must read stored states.
    ``eos_id`` and ``vocab_size``, which ``scripts/train.py`` passes to every data node, are the
    dump's already (its backbone config holds them). Nothing is read before :meth:`setup`.
    """

    def __init__(
        self,
        path: str | Path,
        model: Any = None,
        task: Any = None,
        tokenizer: str | Path | None = None,
        batch_size: int = 8,
        seed: int = 0,
        eos_id: int | None = None,
        vocab_size: int | None = None,
        num_workers: int = 0,
    ):
        super().__init__()
        if task is not None:
            _check_task(task)
        self.path, self.model, self.tokenizer_path = path, model, tokenizer
        self.set_loading(batch_size, seed, num_workers)
        self.eos_id, self.vocab_size = eos_id, vocab_size
        self.manifest: dict[str, Any] = {}
        self.train_set: HiddenRows | None = None
        self.val_set: HiddenRows | None = None

    def setup(self, stage: str | None = None) -> None:
        if self.train_set is not None:
            return
        root = resolve_path(self.path)
        manifest = read_manifest(root)
        check_manifest(manifest, self.path, self.model, self.tokenizer_path)

        def rows(split: str) -> HiddenRows:
            shards = (manifest["splits"].get(split) or {}).get("shards", [])
            return HiddenRows([root / s["file"] for s in shards], [int(s["rows"]) for s in shards])

        self.manifest, self.train_set, self.val_set = manifest, rows("train"), rows("val")
        if len(self.train_set) < 1:
            raise ConfigError(f"data.path={self.path}: the dump's training split holds no rows.")
