"""Safetensors checkpoint directories, whatever model they hold: reading and atomic writing.

Nothing here knows a tensor name. A model family's state-dict adapter (for Inkling,
``inkfw/models/inkling/state_dict.py``) says which names it reads and writes.

A directory holds ``config.json`` and either ``model.safetensors`` or an index
(``model.safetensors.index.json``) over several files. MTP weights may sit in a file of their
own beside them (``mtp.safetensors`` or ``model_mtp.safetensors``); those files are read
whether or not the index lists them. Files are memory-mapped and read tensor by tensor.
"""

from __future__ import annotations

import json
import os
import shutil
import tempfile
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from safetensors import SafetensorError, safe_open
from safetensors.torch import save_file

from inkfw.errors import CheckpointError, InkfwError

INDEX_FILE = "model.safetensors.index.json"
SINGLE_FILE = "model.safetensors"
MTP_FILES = ("mtp.safetensors", "model_mtp.safetensors")  # side files other stacks pick up by name
MTP_FILE = MTP_FILES[0]  # what an export writes


@dataclass
class Checkpoint:
    """An opened checkpoint directory: raw ``config.json``, tensor -> file map, tokenizer.

    ``config`` and ``layout`` are filled in by the model family that opened it (its typed
    config and a word for the naming scheme its tensors use).
    """

    path: Path
    raw_config: dict[str, Any]
    weight_map: dict[str, Path]  # tensor name -> file
    main_file: Path  # the index, or the single file: where a missing tensor should have been
    side_files: list[Path] = field(default_factory=list)  # MTP files found beside the main file
    config: Any = None
    layout: str = ""
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


def read_json_object(path: str | Path, error: type[InkfwError] = CheckpointError) -> dict[str, Any]:
    """The JSON object in ``path`` (e.g. a ``config.json``); anything else raises ``error`` in one sentence."""
    path = Path(path)
    if not path.is_file():
        raise error(f"{path}: {path.name} not found.")
    try:
        raw = json.loads(path.read_text())
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise error(f"{path}: not a readable JSON file ({exc}).") from exc
    if not isinstance(raw, dict):
        raise error(f"{path}: expected a JSON object, got {type(raw).__name__}.")
    return raw


def _read_index(ckpt: Checkpoint, index: Path) -> None:
    try:
        entries = json.loads(index.read_text())["weight_map"]
        if not isinstance(entries, dict) or not all(isinstance(v, str) for v in entries.values()):
            raise TypeError("weight_map must map tensor names to file names")
    except (OSError, UnicodeDecodeError, json.JSONDecodeError, KeyError, TypeError) as exc:
        raise CheckpointError(f"{index}: not a valid safetensors index ({exc}).") from exc
    listed: dict[Path, set[str]] = {}
    for name, fname in entries.items():
        listed.setdefault(ckpt.path / fname, set()).add(name)
    for file, names in listed.items():
        missing = sorted(names - set(ckpt.tensor_names(file)))
        if missing:
            raise CheckpointError(f"{file}: tensor {missing[0]} is listed in {INDEX_FILE} but not in the file.")
        ckpt.weight_map.update({n: file for n in names})


def open_checkpoint_files(path: str | Path) -> Checkpoint:
    """Read ``config.json`` and every tensor name of a checkpoint directory (no tensor data).

    A tensor name found in two files is an error naming both.
    """
    path = Path(path)
    if not path.exists():
        raise CheckpointError(f"{path}: checkpoint directory not found.")
    if not path.is_dir():
        raise CheckpointError(f"{path}: a checkpoint must be a directory holding config.json and safetensors.")
    raw = read_json_object(path / "config.json")
    index, single = path / INDEX_FILE, path / SINGLE_FILE
    if index.is_file():
        ckpt = Checkpoint(path, raw, {}, main_file=index)
        _read_index(ckpt, index)
    elif single.is_file():
        ckpt = Checkpoint(path, raw, {}, main_file=single)
        ckpt.weight_map.update({n: single for n in ckpt.tensor_names(single)})
    else:
        raise CheckpointError(f"{path}: no {SINGLE_FILE} or {INDEX_FILE} found.")
    for side in (path / f for f in MTP_FILES):
        if not side.is_file():
            continue
        ckpt.side_files.append(side)
        for name in ckpt.tensor_names(side):
            other = ckpt.weight_map.setdefault(name, side)
            if other != side:
                raise CheckpointError(f"{side}: tensor {name} is also in {other}; keep one copy.")
    return ckpt


def read_tokenizer(file: str | Path):
    """A ``tokenizers.Tokenizer`` from ``tokenizer.json``; one clear error if it cannot be read."""
    from tokenizers import Tokenizer

    try:
        return Tokenizer.from_file(str(file))
    except Exception as exc:  # the tokenizers library raises plain Exceptions on bad files
        raise CheckpointError(f"{file}: not a readable tokenizer.json ({str(exc).splitlines()[0]}).") from exc


# --------------------------------------------------------------------------- writing
def write_checkpoint(
    out_dir: str | Path,
    tensors: Iterable[tuple[str, torch.Tensor]],
    config: dict[str, Any],
    tokenizer_json: str | Path | None = None,
    max_shard_bytes: int | None = None,
    side_file: Callable[[str], str | None] | None = None,
) -> Path:
    """Write ``tensors`` and ``config.json`` (and a copy of ``tokenizer.json``) as ``out_dir``.

    Written into a temporary directory next to ``out_dir``, then renamed into place, so a
    reader never sees a half-written checkpoint. ``max_shard_bytes`` splits the tensors over
    several files. ``side_file(name)`` may send a tensor to a file of its own (e.g.
    ``mtp.safetensors``). One file is ``model.safetensors``; more files get an index that lists
    every tensor.
    """
    out_dir = Path(out_dir)
    out_dir.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{out_dir.name}.", suffix=".tmp", dir=out_dir.parent))
    try:
        shards: list[dict[str, torch.Tensor]] = [{}]
        sides: dict[str, dict[str, torch.Tensor]] = {}
        size = 0
        for name, t in tensors:
            target = side_file(name) if side_file is not None else None
            if target is not None:
                sides.setdefault(target, {})[name] = t
                continue
            nbytes = t.numel() * t.element_size()
            if max_shard_bytes is not None and shards[-1] and size + nbytes > max_shard_bytes:
                shards.append({})
                size = 0
            shards[-1][name] = t
            size += nbytes
        files = (
            {SINGLE_FILE: shards[0]}
            if len(shards) == 1 and not sides
            else {f"model-{i + 1:05d}-of-{len(shards):05d}.safetensors": s for i, s in enumerate(shards)}
        )
        files.update(sides)
        for fname, part in files.items():
            save_file(part, str(tmp / fname), metadata={"format": "pt"})
        if len(files) > 1:
            weight_map = {n: fname for fname, part in files.items() for n in part}
            total = sum(t.numel() * t.element_size() for part in files.values() for t in part.values())
            (tmp / INDEX_FILE).write_text(
                json.dumps({"metadata": {"total_size": total}, "weight_map": weight_map}, indent=2)
            )
        (tmp / "config.json").write_text(json.dumps(config, indent=2) + "\n")
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
