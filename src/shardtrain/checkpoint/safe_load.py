"""Read DCP checkpoints without running code from them.

`torch.distributed.checkpoint` reads `.metadata` with `pickle.load` and non-tensor entries (the optimizer's
`param_groups`) with `torch.load(weights_only=False)`: a crafted file runs arbitrary code. Everything in
shardtrain that reads a DCP directory goes through `read_dcp_metadata` / `dcp_load` here instead:

- `.metadata` through `MetadataUnpickler`, which resolves only the globals in `ALLOWED_GLOBALS` (what the
  metadata of a checkpoint written by shardtrain contains; found by disassembling real ones) and builds only
  instances of DCP's own metadata classes;
- non-tensor entries through `torch.load(weights_only=True)` (`SafeLoadPlanner`); tensors already are.

Anything else raises `CheckpointError` naming the file (or entry) and what it referenced.
(torch's weights-only unpickler cannot read `.metadata` itself: it refuses DCP's classes and protocol-4 frames.)
"""

from __future__ import annotations

import io
import pathlib
import pickle
import re
from pathlib import Path, PurePath
from typing import Any

import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint import metadata as _md
from torch.distributed.checkpoint._traverse import set_element
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.checkpoint.default_planner import DefaultLoadPlanner
from torch.distributed.checkpoint.filesystem import FileSystemReader, _StorageInfo
from torch.distributed.checkpoint.planner import ReadItem
from torch.serialization import _get_layout

from shardtrain.errors import CheckpointError

__all__ = ["ALLOWED_GLOBALS", "MetadataUnpickler", "SafeFileSystemReader", "SafeLoadPlanner", "dcp_load",
           "read_dcp_metadata"]

_TAMPERED = "the file was not written by shardtrain or was tampered with"

# DCP's metadata classes: the only objects the unpickler may instantiate and fill in (NEWOBJ/REDUCE + BUILD).
_DCP_CLASSES: tuple[type, ...] = (
    _md.Metadata, _md.TensorStorageMetadata, _md.BytesStorageMetadata, _md.ChunkStorageMetadata,
    _md.TensorProperties, _md.MetadataIndex, _md.StorageMeta, _StorageInfo,
)


def _allowed_globals() -> dict[tuple[str, str], Any]:
    """(module, name) -> object, as the pickle names them (`pickletools.dis` of real `.metadata` files)."""
    allowed: dict[tuple[str, str], Any] = {(cls.__module__, cls.__qualname__): cls for cls in _DCP_CLASSES}
    # TensorProperties pickles its memory format as this enum, its layout as _get_layout("torch.strided")
    allowed[("torch.distributed.checkpoint.metadata", "_MEM_FORMAT_ENCODING")] = _md._MEM_FORMAT_ENCODING
    allowed[("torch.serialization", "_get_layout")] = _get_layout  # a lookup in a dict of torch.layout values
    allowed[("torch", "Size")] = torch.Size
    for name in dir(torch):  # dtypes pickle as globals: torch.float32, torch.bfloat16, ...
        value = getattr(torch, name, None)
        if isinstance(value, torch.dtype):
            allowed[("torch", name)] = value
    # StorageMeta.checkpoint_id is the pathlib path DCP wrote to (pathlib._local on Python 3.13+)
    for module_name, module in (("pathlib", pathlib), ("pathlib._local", getattr(pathlib, "_local", None))):
        for name in ("PosixPath", "PurePosixPath", "WindowsPath", "PureWindowsPath"):
            cls = getattr(module, name, None)
            if isinstance(cls, type) and issubclass(cls, PurePath):
                allowed[(module_name, name)] = cls
    return allowed


ALLOWED_GLOBALS: dict[tuple[str, str], Any] = _allowed_globals()


class MetadataUnpickler(pickle._Unpickler):
    """An unpickler for DCP `.metadata` that resolves only `ALLOWED_GLOBALS`.

    It is the pure-Python `pickle.Unpickler` (the C one cannot intercept BUILD), so that BUILD (which sets
    attributes) may target only instances of DCP's metadata classes, never a class or a function.
    """

    dispatch = dict(pickle._Unpickler.dispatch)

    def __init__(self, file: Any, source: str | Path) -> None:
        super().__init__(file)
        self.source = str(source)

    def find_class(self, module: str, name: str) -> Any:
        try:
            return ALLOWED_GLOBALS[(module, name)]
        except KeyError:
            raise CheckpointError(f"refusing to load {self.source}: it references {module}.{name}, which a "
                                  f"shardtrain checkpoint never contains; {_TAMPERED}") from None

    def persistent_load(self, pid: Any) -> Any:
        raise CheckpointError(f"refusing to load {self.source}: it holds a persistent id, which a shardtrain "
                              f"checkpoint never contains; {_TAMPERED}")

    def _load_build_checked(self) -> None:
        target = self.stack[-2] if len(self.stack) >= 2 else None
        if type(target) not in _DCP_CLASSES:
            raise CheckpointError(f"refusing to load {self.source}: it sets the state of a "
                                  f"{type(target).__name__} object, which a shardtrain checkpoint never does; "
                                  f"{_TAMPERED}")
        pickle._Unpickler.load_build(self)

    dispatch[pickle.BUILD[0]] = _load_build_checked


def _check_metadata(metadata: Any, source: str) -> _md.Metadata:
    if not isinstance(metadata, _md.Metadata):
        raise CheckpointError(f"refusing to load {source}: it holds a {type(metadata).__name__}, not DCP "
                              f"metadata; {_TAMPERED}")
    for info in (metadata.storage_data or {}).values():
        relative = getattr(info, "relative_path", None)
        if not isinstance(relative, str) or PurePath(relative).is_absolute() or ".." in PurePath(relative).parts:
            raise CheckpointError(f"refusing to load {source}: it points at the data file {relative!r}, outside "
                                  f"the checkpoint directory; {_TAMPERED}")
    return metadata


class SafeFileSystemReader(FileSystemReader):
    """`FileSystemReader` whose `read_metadata` unpickles with `MetadataUnpickler` (otherwise identical).

    `refusal` keeps the first CheckpointError it raised: DCP's `load` swallows a failed `.metadata` read (it
    falls back to per-rank metadata and then raises its own error), so `dcp_load` re-raises this one.
    """

    refusal: CheckpointError | None = None

    def read_metadata(self, *args: Any, **kwargs: Any) -> _md.Metadata:
        if self.refusal is not None:  # no per-rank fallback after a refused global .metadata
            raise self.refusal
        rank = kwargs.get("rank")
        path = self._get_metadata_path(rank)
        with self.fs.create_stream(path, "rb") as metadata_file:
            try:
                metadata = _check_metadata(MetadataUnpickler(metadata_file, path).load(), str(path))
            except CheckpointError as err:
                self.refusal = err
                raise

        if getattr(metadata, "storage_meta", None) is None:
            metadata.storage_meta = _md.StorageMeta()
        metadata.storage_meta.load_id = self.load_id

        return metadata


def _weights_only_reason(err: Exception) -> str:
    """What torch's weights-only unpickler refused, without its advice to retry with weights_only=False."""
    found = re.search(r"GLOBAL ([\w.]+)", str(err))
    if found:
        name = found.group(1) if "." in found.group(1) else f"builtins.{found.group(1)}"
        return f"it references {name}"
    found = re.search(r"WeightsUnpickler error: ([^\n]*)", str(err))
    detail = f" ({found.group(1).strip()})" if found else ""
    return f"it holds an object the weights-only unpickler refused{detail}"


class SafeLoadPlanner(DefaultLoadPlanner):
    """`DefaultLoadPlanner` that reads non-tensor entries with `torch.load(weights_only=True)`.

    That covers what the optimizer's `param_groups` hold (floats, bools, None, tuples, lists of names).
    """

    def __init__(self, *args: Any, checkpoint_dir: str | Path | None = None, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.checkpoint_dir = checkpoint_dir
        self.refusal: CheckpointError | None = None  # the first refusal on this rank (see dcp_load)

    def load_bytes(self, read_item: ReadItem, value: io.BytesIO) -> None:
        fqn = read_item.dest_index.fqn
        try:
            obj = torch.load(value, weights_only=True)
        except pickle.UnpicklingError as err:
            where = f" of {self.checkpoint_dir}" if self.checkpoint_dir is not None else ""
            self.refusal = CheckpointError(f"refusing to load the non-tensor entry {fqn!r}{where}: "
                                           f"{_weights_only_reason(err)}, which a shardtrain checkpoint never "
                                           f"contains (only plain values and tensors); {_TAMPERED}")
            raise self.refusal from None
        if self.flatten_state_dict:
            set_element(self.original_state_dict, self.mappings[fqn], obj)
        else:
            self.state_dict[fqn] = obj


def read_dcp_metadata(path: str | Path) -> _md.Metadata:
    """The metadata of the DCP directory `path`, read with the restricted unpickler."""
    return SafeFileSystemReader(str(path)).read_metadata()


def dcp_load(state: dict[str, Any], path: str | Path, no_dist: bool = False) -> None:
    """`torch.distributed.checkpoint.load(state, checkpoint_id=path)` through the safe reader and planner.

    Raises:
        CheckpointError: a file or entry was refused (on this rank, else the first rank that refused;
            unwrapped from DCP's own errors); other failures propagate as DCP raises them.
    """
    reader, planner = SafeFileSystemReader(str(path)), SafeLoadPlanner(checkpoint_dir=path)
    try:
        dcp.load(state, storage_reader=reader, planner=planner, no_dist=no_dist)
    except (Exception, CheckpointException) as err:  # CheckpointException is a BaseException
        refusal = reader.refusal or planner.refusal
        if refusal is None and isinstance(err, CheckpointException):  # another rank refused
            failures = [err.failures[rank] for rank in sorted(err.failures)]
            refusal = next((f[0] for f in failures if isinstance(f, tuple) and isinstance(f[0], CheckpointError)),
                           None)
        if refusal is not None:
            raise CheckpointError(str(refusal)) from err
        raise
