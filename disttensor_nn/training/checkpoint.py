"""Checkpoints: replicated model and optimizer state plus distributed arrays, with a manifest.

A checkpoint is a directory::

    manifest.json      format, version, step, names/shapes/dtypes, sha256 and size of every file
    state.npz          parameters, BN running statistics, optimizer, scheduler, RNG and
                       extra arrays
    array_000.npy ...  one standard .npy file per distributed array

Saving is collective. Rank 0 writes the replicated state (every rank holds the
same copy) and preallocates each distributed array's ``.npy`` file with
:func:`numpy.lib.format.open_memmap`; after a barrier every rank writes its
own block into it (of several replicas of a block, only the lowest rank
writes). Everything goes into a temporary directory ``.NAME.tmp-TOKEN``
beside the target, which rank 0 commits once the manifest is written: the
previous checkpoint is renamed to ``.NAME.old-TOKEN``, the new one to the
target, and the old one removed. A checkpoint is loadable at every instant:
if the writer dies between the two renames, loading finds the target
missing, completes the commit from the finished temporary directory (or,
failing that, restores the previous checkpoint) and loads it; leftovers of
an interrupted commit are removed by the next successful save. Any failure
on any rank is agreed on: every rank raises the same
:class:`CheckpointError` and the temporary directory is removed.

Loading is collective too. Every rank first checks its own arguments and
that they agree with every other rank's (model, optimizer, scheduler and
requested arrays: names, shapes, dtypes, distributions). Rank 0 checks the
manifest, the size and sha256 of every file, and that the model, optimizer,
scheduler and arrays match what was saved (an optimizer or a learning-rate
scheduler of another class is refused, naming both); it broadcasts its
verdict, so a corrupt, truncated, incomplete or mismatched checkpoint raises
the same :class:`CheckpointError` on every rank before anything is changed.
Rank 0 then broadcasts the replicated state, every rank reads its block of
each distributed array (memory-mapped), and only when all of that succeeded
on every rank are the model, the optimizer, the scheduler and the arrays
changed.

Distributed writes into one file need a file system on which writes of
different processes to disjoint regions of a file are coherent (local file
systems, Lustre, GPFS; not NFS with client caching).
"""

from __future__ import annotations

import glob
import hashlib
import json
import operator
import os
import shutil
import uuid
from collections.abc import Callable, Mapping
from typing import Any

import numpy as np
from mpi4py import MPI

from disttensor import DistArray, Distribution
from disttensor.backend import numpy_dtype, to_numpy

from ..module import Layer
from ..parameter import Parameter

__all__ = ["CheckpointError", "save_checkpoint", "load_checkpoint", "checkpoint_manifest",
           "FORMAT", "VERSION"]

FORMAT = "disttensor_nn.checkpoint"
VERSION = 1
MANIFEST = "manifest.json"
STATE = "state.npz"
_CHUNK = 1 << 22


class CheckpointError(RuntimeError):
    """A checkpoint could not be saved, or is refused on loading (raised on every rank)."""


# --------------------------------------------------------------------------- model state
def named_parameters(model: Layer | None) -> list[tuple[str, Parameter]]:
    """``model.named_parameters()`` as a list (empty for None): names such as ``"0.weight"``."""
    return [] if model is None else list(model.named_parameters())


def named_buffers(model: Layer | None) -> list[tuple[str, Layer, str]]:
    """(name, layer, attribute) of every buffer of ``model``, in ``model.named_buffers()`` order."""
    if model is None:
        return []
    return [(key, layer, key.rpartition(".")[2]) for path, layer in model.named_modules()
            for key, _ in layer.named_buffers(prefix=path, recurse=False)]


def _host(a: Any) -> np.ndarray:
    """``a`` (an array of any module) as a C-contiguous NumPy array."""
    return _contiguous(to_numpy(a))


# --------------------------------------------------------------------------- trees
def _contiguous(a: Any, dtype: np.dtype | None = None) -> np.ndarray:
    """``a`` as a C-contiguous array of its own shape (0-d stays 0-d, unlike
    ``numpy.ascontiguousarray``)."""
    return np.asarray(a, dtype=dtype, order="C")


def _encode(obj: Any, arrays: dict[str, np.ndarray], prefix: str) -> Any:
    """A JSON-able description of ``obj``; its arrays go to ``arrays`` under ``prefix`` keys."""
    if obj is None or isinstance(obj, (bool, str)):
        return obj
    if isinstance(obj, (int, float)):
        return obj
    if isinstance(obj, np.random.Generator):
        obj = obj.bit_generator.state
    if isinstance(obj, (np.ndarray, np.generic)):
        a = np.asarray(obj)
        if a.dtype.hasobject:
            raise TypeError("arrays of Python objects cannot be stored in a checkpoint")
        key = f"{prefix}{len(arrays)}"
        arrays[key] = _contiguous(a)
        return {"t": "scalar" if isinstance(obj, np.generic) else "array", "key": key}
    if isinstance(obj, Mapping):
        items = []
        for k, v in obj.items():
            if not (k is None or isinstance(k, (str, int, float, bool))):
                raise TypeError(f"dictionary keys must be str, int, float or bool, got {k!r}")
            items.append([k, _encode(v, arrays, prefix)])
        return {"t": "dict", "items": items}
    if isinstance(obj, (list, tuple)):
        return {"t": type(obj).__name__, "items": [_encode(v, arrays, prefix) for v in obj]}
    raise TypeError(f"a {type(obj).__name__} cannot be stored in a checkpoint "
                    "(use None, bool, int, float, str, NumPy arrays, lists, tuples and dicts)")


def _decode(spec: Any, arrays: Mapping[str, np.ndarray]) -> Any:
    if spec is None or isinstance(spec, (bool, str, int, float)):
        return spec
    t = spec["t"]
    if t in ("array", "scalar"):
        a = np.array(arrays[spec["key"]])
        return a[()] if t == "scalar" else a
    if t == "dict":
        return {k: _decode(v, arrays) for k, v in spec["items"]}
    if t in ("list", "tuple"):
        items = [_decode(v, arrays) for v in spec["items"]]
        return items if t == "list" else tuple(items)
    raise ValueError(f"unknown entry type {t!r}")


def _tree_keys(spec: Any) -> list[str]:
    if not isinstance(spec, dict):
        return []
    if spec.get("t") in ("array", "scalar"):
        return [spec["key"]]
    if spec.get("t") == "dict":
        return [k for _, v in spec["items"] for k in _tree_keys(v)]
    return [k for v in spec.get("items", []) for k in _tree_keys(v)]


# --------------------------------------------------------------------------- files
def _sha256(path: str) -> tuple[str, int]:
    h = hashlib.sha256()
    size = 0
    with open(path, "rb") as f:
        while chunk := f.read(_CHUNK):
            h.update(chunk)
            size += len(chunk)
    return h.hexdigest(), size


def _fsync(path: str) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _canonical(manifest: Mapping[str, Any]) -> bytes:
    return json.dumps(manifest, sort_keys=True, separators=(",", ":")).encode()


def _write_manifest(directory: str, manifest: dict[str, Any]) -> None:
    body = dict(manifest)
    body["manifest_sha256"] = hashlib.sha256(_canonical(manifest)).hexdigest()
    path = os.path.join(directory, MANIFEST)
    with open(path, "w") as f:
        json.dump(body, f, indent=1)
        f.flush()
        os.fsync(f.fileno())


def _write_state(path: str, arrays: dict[str, np.ndarray]) -> None:
    with open(path, "wb") as f:
        np.savez(f, **arrays)
        f.flush()
        os.fsync(f.fileno())


def _create_array_file(path: str, shape: tuple[int, ...], dtype: np.dtype) -> None:
    mm = np.lib.format.open_memmap(path, mode="w+", dtype=dtype, shape=shape)
    mm.flush()
    del mm


def _write_block(path: str, where: tuple[slice, ...], block: np.ndarray) -> None:
    """Write this rank's ``block`` at ``where`` into the preallocated .npy at ``path``."""
    mm = np.lib.format.open_memmap(path, mode="r+")
    mm[where] = block
    mm.flush()
    del mm


def _agree(comm: MPI.Comm, error: BaseException | None, what: str,
           cleanup: Callable[[], None] | None = None) -> None:
    """Raise the same CheckpointError on every rank if ``error`` is set on any."""
    msg = None if error is None else f"{type(error).__name__}: {error}"
    failed = [(r, m) for r, m in enumerate(comm.allgather(msg)) if m is not None]
    if failed:
        if cleanup is not None and comm.Get_rank() == 0:
            cleanup()
        detail = "; ".join(f"rank {r}: {m}" for r, m in failed)
        raise CheckpointError(f"{what} failed on rank(s) {[r for r, _ in failed]}: {detail}")


def _commit(tmp: str, final: str, token: str) -> None:
    """Rename the finished ``tmp`` to ``final``, replacing a previous checkpoint there."""
    parent = os.path.dirname(final)
    old = None
    if os.path.lexists(final):
        if not os.path.isdir(final) or os.path.islink(final):
            raise FileExistsError(f"{final} exists and is not a directory")
        if os.listdir(final) and not os.path.exists(os.path.join(final, MANIFEST)):
            raise FileExistsError(f"{final} is a non-empty directory that is not a checkpoint; "
                                  "refusing to replace it")
        old = os.path.join(parent, f".{os.path.basename(final)}.old-{token}")
        os.replace(final, old)
    try:
        os.replace(tmp, final)
    except BaseException:
        if old is not None:
            os.replace(old, final)
        raise
    _fsync(parent)
    if old is not None:
        shutil.rmtree(old, ignore_errors=True)
    for leftover in _siblings(final, "tmp") + _siblings(final, "old"):  # of interrupted commits
        shutil.rmtree(leftover, ignore_errors=True)


def _siblings(final: str, kind: str) -> list[str]:
    """The ``.NAME.tmp-*`` or ``.NAME.old-*`` directories beside ``final``, newest first."""
    parent, base = os.path.split(final)
    found = [p for p in glob.glob(os.path.join(glob.escape(parent), f".{glob.escape(base)}."
                                               f"{kind}-*")) if os.path.isdir(p)]
    return sorted(found, key=lambda p: os.stat(p).st_mtime_ns, reverse=True)


def _complete(directory: str) -> bool:
    """Whether ``directory`` holds a finished checkpoint (a manifest whose checksum holds)."""
    try:
        _read_manifest(directory)
    except CheckpointError:
        return False
    return True


def _recover(final: str) -> str:
    """The directory to load for ``final``, completing a commit that was interrupted.

    When ``final`` is missing but a finished temporary directory (the new
    checkpoint) or a previous checkpoint (``.old-``) lies beside it, that one
    is renamed to ``final``; where renaming is not possible it is read in
    place.
    """
    if os.path.lexists(final):
        return final
    for candidate in [p for p in _siblings(final, "tmp") if _complete(p)] + \
            [p for p in _siblings(final, "old") if _complete(p)]:
        try:
            os.replace(candidate, final)
            _fsync(os.path.dirname(final))
        except OSError:
            return candidate
        return final
    return final


# --------------------------------------------------------------------------- save
def save_checkpoint(directory: str | os.PathLike, model: Layer | None, optimizer: Any, step: int,
                    rng_state: Any = None, extra: Any = None,
                    arrays: Mapping[str, DistArray] | None = None, *,
                    comm: MPI.Comm | None = None, scheduler: Any = None) -> str:
    """Write a checkpoint to ``directory`` (collective over ``comm``).

    Parameters
    ----------
    directory : path
        The checkpoint directory. It is replaced as a whole once the new
        checkpoint is complete (a previous checkpoint there is removed then);
        a non-empty directory that is not a checkpoint is never replaced. Rank
        0's path is used.
    model : Layer or None
        Its parameters (``model.named_parameters()``; sharded ones are
        gathered and stored whole, so they load under any split) and buffers
        (``model.named_buffers()``, such as batch-norm running statistics),
        arrays of any array module; they are stored as NumPy arrays.
    optimizer : object or None
        Anything with ``state_dict()`` returning a tree of None, bool, int,
        float, str, NumPy arrays, lists, tuples and dicts, such as
        :class:`~disttensor_nn.optim.SGD` or :class:`~disttensor_nn.optim.Adam`
        (its class name is recorded too).
    step : int
        Training step.
    rng_state : tree or numpy.random.Generator, optional
        RNG state, e.g. ``rng.bit_generator.state`` (a Generator is stored as
        its bit generator's state).
    extra : tree, optional
        Anything else of the same kinds, e.g. a :class:`~disttensor_nn.data.Loader`'s
        ``state_dict()``.
    arrays : mapping of str to DistArray, optional
        Distributed arrays, each stored as one ``.npy`` file written block by
        block. Their grids must span ``comm``'s processes.
    comm : mpi4py.MPI.Comm, optional
        ``MPI.COMM_WORLD`` by default.
    scheduler : object, optional
        A learning-rate scheduler (:mod:`disttensor_nn.optim.lr_scheduler`):
        its class name and ``state_dict()`` are recorded, so that a resumed
        run continues the schedule exactly.

    Returns
    -------
    str
        The absolute path of the checkpoint.

    Raises
    ------
    CheckpointError
        On every rank, when anything fails on any rank, or when the ranks
        pass different steps, models, optimizers, schedulers or arrays; the target is
        then left as it was and the temporary directory removed.
    """
    comm = MPI.COMM_WORLD if comm is None else comm
    rank = comm.Get_rank()
    final = os.path.abspath(os.fspath(directory))
    final, token = comm.bcast((final, uuid.uuid4().hex[:12]) if rank == 0 else None, root=0)
    parent, base = os.path.split(final)
    tmp = os.path.join(parent, f".{base}.tmp-{token}")

    def cleanup() -> None:
        shutil.rmtree(tmp, ignore_errors=True)

    # -- describe everything (all ranks; no file touched yet)
    error: BaseException | None = None
    try:
        step = operator.index(step)
        params = named_parameters(model)
        buffers = named_buffers(model)
        arrays = dict(arrays or {})
        dist_arrays = []
        for k, name in enumerate(sorted(arrays)):
            a = arrays[name]
            if not isinstance(name, str) or not isinstance(a, DistArray):
                raise TypeError(f"arrays must map str to DistArray, got {name!r}: "
                                f"{type(a).__name__}")
            if not a.grid.same_processes(comm):
                raise ValueError(f"array {name!r} lives on another communicator than the "
                                 "checkpoint's")
            dist_arrays.append((name, f"array_{k:03d}.npy", a))
    except Exception as exc:
        error = exc
    _agree(comm, error, "save_checkpoint (arguments)")
    everyone = comm.allgather((step, _describe_arguments(model, optimizer, arrays, comm,
                                                         scheduler)))
    differ = [r for r, v in enumerate(everyone) if v != everyone[0]]
    if differ:
        raise CheckpointError(f"save_checkpoint refused (nothing written): the step, model, "
                              f"optimizer, scheduler or arrays of rank(s) {differ} differ from "
                              "rank 0's; "
                              "every rank must pass the same")

    # -- whole values of sharded parameters and optimizer buffers (collective gathers)
    values: list[Any] = []
    opt_state = sched_state = None
    try:
        values = [p.full() for _, p in params]
        opt_state = None if optimizer is None else optimizer.state_dict()
        sched_state = None if scheduler is None else scheduler.state_dict()
    except Exception as exc:
        error = exc
    _agree(comm, error, "save_checkpoint (gathering sharded state)")

    # -- rank 0: replicated state, preallocated array files
    if rank == 0:
        try:
            state: dict[str, np.ndarray] = {}
            manifest: dict[str, Any] = {"format": FORMAT, "version": VERSION, "step": step,
                                        "world_size": comm.Get_size()}
            manifest["parameters"] = []
            for i, ((name, _), full) in enumerate(zip(params, values)):
                key = f"param_{i:04d}"
                state[key] = value = _host(full)
                manifest["parameters"].append({"name": name, "key": key,
                                               "shape": list(value.shape),
                                               "dtype": value.dtype.str})
            manifest["buffers"] = []
            for i, (name, layer, attr) in enumerate(buffers):
                key = f"buffer_{i:04d}"
                state[key] = value = _host(getattr(layer, attr))
                manifest["buffers"].append({"name": name, "key": key,
                                            "shape": list(value.shape),
                                            "dtype": value.dtype.str})
            manifest["optimizer"] = None if optimizer is None else {
                "class": type(optimizer).__name__,
                "state": _encode(opt_state, state, "optimizer_")}
            manifest["scheduler"] = None if scheduler is None else {
                "class": type(scheduler).__name__,
                "state": _encode(sched_state, state, "scheduler_")}
            manifest["rng_state"] = _encode(rng_state, state, "rng_")
            manifest["extra"] = _encode(extra, state, "extra_")
            manifest["arrays"] = [{"name": name, "file": fname, "shape": list(a.shape),
                                   "dtype": a.dtype.str} for name, fname, a in dist_arrays]
            os.makedirs(parent, exist_ok=True)
            os.mkdir(tmp)
            _write_state(os.path.join(tmp, STATE), state)
            for _, fname, a in dist_arrays:
                _create_array_file(os.path.join(tmp, fname), a.shape, a.dtype)
        except Exception as exc:
            error = exc
    _agree(comm, error, "save_checkpoint (replicated state)", cleanup)

    # -- every rank: its blocks (one replica of each)
    try:
        for _, fname, a in dist_arrays:
            dist = a.dist
            writer = dist.ranks_of_block(dist.block_index())[0] == dist.grid.rank
            if writer and all(n > 0 for n in dist.local_shape()):
                _write_block(os.path.join(tmp, fname), dist.local_slices(),
                             _contiguous(to_numpy(a.local)))
    except Exception as exc:
        error = exc
    _agree(comm, error, "save_checkpoint (distributed arrays)", cleanup)

    # -- rank 0: checksums, manifest, atomic rename
    if rank == 0:
        try:
            files = [STATE] + [fname for _, fname, _ in dist_arrays]
            manifest["files"] = {}
            for fname in files:
                path = os.path.join(tmp, fname)
                if fname != STATE:
                    _fsync(path)
                digest, size = _sha256(path)
                manifest["files"][fname] = {"sha256": digest, "size": size}
            _write_manifest(tmp, manifest)
            _fsync(tmp)
            _commit(tmp, final, token)
        except Exception as exc:
            error = exc
    _agree(comm, error, "save_checkpoint (commit)", cleanup)
    return final


# --------------------------------------------------------------------------- load
def _refuse(msg: str) -> None:
    raise CheckpointError(msg)


def _read_manifest(directory: str) -> dict[str, Any]:
    path = os.path.join(directory, MANIFEST)
    if not os.path.isdir(directory):
        _refuse(f"no checkpoint at {directory}")
    if not os.path.exists(path):
        _refuse(f"{directory} is not a complete checkpoint: {MANIFEST} is missing")
    try:
        with open(path, "rb") as f:
            body = json.loads(f.read().decode())
        if not isinstance(body, dict):
            raise ValueError("not a JSON object")
        digest = body.pop("manifest_sha256")
    except (ValueError, KeyError, UnicodeDecodeError) as exc:
        raise CheckpointError(f"{path} is corrupt: {exc}") from None
    if hashlib.sha256(_canonical(body)).hexdigest() != digest:
        _refuse(f"{path} is corrupt: its checksum does not match its content")
    if body.get("format") != FORMAT:
        _refuse(f"{path} is not a {FORMAT} manifest")
    if not isinstance(body.get("version"), int) or body["version"] > VERSION:
        _refuse(f"{path} has format version {body.get('version')}; this library reads "
                f"versions up to {VERSION}")
    return body


def _check_files(directory: str, manifest: Mapping[str, Any]) -> None:
    for fname, info in manifest["files"].items():
        path = os.path.join(directory, fname)
        if os.path.basename(fname) != fname:
            _refuse(f"manifest names a file outside the checkpoint: {fname!r}")
        if not os.path.isfile(path):
            _refuse(f"checkpoint file {path} is missing")
        size = os.path.getsize(path)
        if size != info["size"]:
            _refuse(f"checkpoint file {path} is truncated or damaged: {size} bytes, "
                    f"expected {info['size']}")
        if _sha256(path)[0] != info["sha256"]:
            _refuse(f"checkpoint file {path} is corrupt: sha256 mismatch")


def _compare(kind: str, saved: list[Mapping[str, Any]],
             current: list[tuple[str, tuple[int, ...], np.dtype]]) -> None:
    have = [(e["name"], tuple(e["shape"]), np.dtype(e["dtype"])) for e in saved]
    if len(have) != len(current):
        _refuse(f"the checkpoint holds {len(have)} {kind}, the model has {len(current)}: "
                "it was saved from a different model")
    for (n0, s0, d0), (n1, s1, d1) in zip(have, current):
        if (n0, s0, d0) != (n1, s1, d1):
            _refuse(f"checkpoint {kind[:-1]} {n0!r} is {d0} {s0} but the model's {n1!r} is "
                    f"{d1} {s1}: it was saved from a different model")


def _verify(directory: str, model: Layer | None, optimizer: Any,
            arrays: Mapping[str, DistArray | Distribution],
            scheduler: Any = None) -> tuple[dict, dict]:
    """Rank 0's checks; returns (manifest, replicated arrays) or raises CheckpointError."""
    manifest = _read_manifest(directory)
    for key in ("step", "files", "parameters", "buffers", "arrays", "optimizer", "rng_state",
                "extra"):
        if key not in manifest:
            _refuse(f"{directory}: the manifest lacks {key!r}")
    _check_files(directory, manifest)
    _compare("parameters", manifest["parameters"],
             [(n, tuple(p.shape), numpy_dtype(p.dtype))
              for n, p in named_parameters(model)])
    _compare("buffers", manifest["buffers"],
             [(n, tuple(getattr(lay, a).shape), numpy_dtype(getattr(lay, a).dtype))
              for n, lay, a in named_buffers(model)])
    saved_arrays = {e["name"]: e for e in manifest["arrays"]}
    for name, target in arrays.items():
        if name not in saved_arrays:
            _refuse(f"the checkpoint holds no array {name!r} (it has {sorted(saved_arrays)})")
        e = saved_arrays[name]
        shape = tuple(target.global_shape if isinstance(target, Distribution) else target.shape)
        if tuple(e["shape"]) != shape:
            _refuse(f"checkpoint array {name!r} has shape {tuple(e['shape'])}, expected {shape}")
        if isinstance(target, DistArray) and np.dtype(e["dtype"]) != target.dtype:
            _refuse(f"checkpoint array {name!r} is {np.dtype(e['dtype'])}, expected "
                    f"{target.dtype}")
        if e["file"] not in manifest["files"]:
            _refuse(f"the manifest has no checksum for {e['file']}")
    opt = manifest.get("optimizer")
    if optimizer is not None:
        if opt is None:
            _refuse("the checkpoint holds no optimizer state")
        if opt["class"] != type(optimizer).__name__:
            _refuse(f"the checkpoint holds {opt['class']} state, not {type(optimizer).__name__}: "
                    "it was saved with another optimizer")
    sched = manifest.get("scheduler")
    if scheduler is not None:
        if sched is None:
            _refuse(f"the checkpoint holds no learning-rate scheduler state, and "
                    f"{type(scheduler).__name__} was asked for: it was saved without a schedule")
        if sched["class"] != type(scheduler).__name__:
            _refuse(f"the checkpoint holds {sched['class']} scheduler state, not "
                    f"{type(scheduler).__name__}: it was saved with another schedule")
    with np.load(os.path.join(directory, STATE), allow_pickle=False) as npz:
        state = {k: npz[k] for k in npz.files}
    needed = [e["key"] for e in manifest["parameters"] + manifest["buffers"]]
    for spec in (opt["state"] if opt else None, sched["state"] if sched else None,
                 manifest.get("rng_state"), manifest.get("extra")):
        needed += _tree_keys(spec)
    missing = [k for k in needed if k not in state]
    if missing:
        _refuse(f"{STATE} lacks the entries {missing}")
    for e in manifest["parameters"] + manifest["buffers"]:
        a = state[e["key"]]
        if a.shape != tuple(e["shape"]) or a.dtype != np.dtype(e["dtype"]):
            _refuse(f"{STATE} entry of {e['name']!r} is {a.dtype} {a.shape}, the manifest "
                    f"says {np.dtype(e['dtype'])} {tuple(e['shape'])}")
    _decode(manifest["rng_state"], state), _decode(manifest["extra"], state)  # they decode
    if optimizer is not None:
        _check_optimizer_state(_decode(opt["state"], state), model, optimizer)
    if scheduler is not None:
        _check_by(scheduler, _decode(sched["state"], state), "learning-rate scheduler")
    return manifest, state


def _check_by(obj: Any, state: Any, what: str) -> None:
    """``obj.check_state_dict(state)``, where ``obj`` has one, as a refusal."""
    check = getattr(obj, "check_state_dict", None)
    if check is None:
        return
    try:
        check(state)
    except (ValueError, TypeError, KeyError) as exc:
        _refuse(f"the {what} state does not fit: {exc}")


def _check_optimizer_state(state: Any, model: Layer | None, optimizer: Any) -> None:
    """The optimizer's own check (``check_state_dict``), or for optimizers with
    per-parameter buffers (``state`` list, ``params``): shapes match."""
    if hasattr(optimizer, "check_state_dict"):
        _check_by(optimizer, state, "optimizer")
        return
    params = getattr(optimizer, "params", None)
    bufs = state.get("state") if isinstance(state, dict) else None
    if not isinstance(params, list) or not isinstance(bufs, list):
        return
    if len(bufs) != len(params):
        _refuse(f"the optimizer state is for {len(bufs)} parameters, the optimizer has "
                f"{len(params)}")
    for i, (b, p) in enumerate(zip(bufs, params)):
        if b is not None and np.shape(b) != tuple(p.shape):
            _refuse(f"optimizer state {i} has shape {np.shape(b)}, its parameter "
                    f"{tuple(p.shape)}")


def _bcast_arrays(comm: MPI.Comm, state: dict[str, np.ndarray] | None) -> dict[str, np.ndarray]:
    """Rank 0's arrays on every rank (metadata by pickle, data by buffer broadcasts)."""
    rank = comm.Get_rank()
    meta = [(k, a.shape, a.dtype.newbyteorder("=").str) for k, a in state.items()] \
        if rank == 0 else None
    meta = comm.bcast(meta, root=0)
    out = {}
    for key, shape, dtype in meta:
        if rank == 0:
            buf = _contiguous(state[key], np.dtype(dtype))
        else:
            buf = np.empty(shape, dtype=np.dtype(dtype))
        if buf.size:
            comm.Bcast(buf.reshape(-1).view(np.uint8), root=0)
        out[key] = buf
    return out


def _describe_arguments(model: Layer | None, optimizer: Any,
                        arrays: Mapping[Any, Any], comm: MPI.Comm, scheduler: Any = None) -> Any:
    """This rank's arguments as comparable data; raises for malformed ones (local, no messages)."""
    described = []
    for name in arrays:
        if not isinstance(name, str):
            raise TypeError(f"arrays must map str to DistArray or Distribution, got the key "
                            f"{name!r}")
    for name in sorted(arrays):
        target = arrays[name]
        if isinstance(target, DistArray):
            dist, dtype = target.dist, numpy_dtype(target.dtype).str
        elif isinstance(target, Distribution):
            dist, dtype = target, None
            if target.grid is None:
                raise ValueError(f"array {name!r}: the Distribution has no process grid (it was "
                                 "built on a grid shape); build it on a ProcessGrid")
        else:
            raise TypeError(f"arrays must map str to DistArray or Distribution, got {name!r}: "
                            f"{type(target).__name__}")
        if not dist.grid.same_processes(comm):
            raise ValueError(f"array {name!r} lives on another communicator than the "
                             "checkpoint's")
        described.append((name, repr(dist), dtype))
    params = [(n, tuple(p.shape), numpy_dtype(p.dtype).str)
              for n, p in named_parameters(model)]
    buffers = [(n, tuple(getattr(lay, a).shape), numpy_dtype(getattr(lay, a).dtype).str)
               for n, lay, a in named_buffers(model)]
    return {"arrays": described, "model parameters": params, "model buffers": buffers,
            "optimizer": None if optimizer is None else type(optimizer).__name__,
            "scheduler": None if scheduler is None else type(scheduler).__name__}


def _agree_on_arguments(model: Layer | None, optimizer: Any, arrays: Mapping[Any, Any],
                        comm: MPI.Comm, scheduler: Any = None) -> None:
    """The same CheckpointError on every rank for a malformed or rank-dependent argument."""
    try:
        mine: Any = ("ok", _describe_arguments(model, optimizer, arrays, comm, scheduler))
    except Exception as exc:
        mine = ("error", f"{type(exc).__name__}: {exc}")
    everyone = comm.allgather(mine)
    for r, (kind, value) in enumerate(everyone):
        if kind == "error":
            raise CheckpointError(f"load_checkpoint refused (nothing changed): rank {r}: {value}")
    first = everyone[0][1]
    for r, (_, value) in enumerate(everyone):
        for what in first:
            if value[what] != first[what]:
                raise CheckpointError(
                    f"load_checkpoint refused (nothing changed): the {what} differ between "
                    f"ranks (rank {r}: {value[what]}; rank 0: {first[what]}); every rank "
                    "must pass the same")


def checkpoint_manifest(directory: str | os.PathLike, *,
                        comm: MPI.Comm | None = None) -> dict[str, Any]:
    """The manifest of the checkpoint at ``directory``, on every rank (collective).

    Rank 0 reads it (completing an interrupted commit, as
    :func:`load_checkpoint` does) and checks its format, version and
    self-checksum; the files it lists are not read. A program can thus learn
    before any work what a checkpoint holds: its ``step``, and the classes of
    its ``optimizer`` and ``scheduler`` (``manifest["optimizer"]["class"]``,
    None when saved without one). The scheduler's state, which holds no
    arrays, is given decoded (``manifest["scheduler"]["state"]``, as its
    ``state_dict()`` returned it).

    Raises
    ------
    CheckpointError
        On every rank, with rank 0's message, when there is no checkpoint
        there or its manifest is corrupt.
    """
    comm = MPI.COMM_WORLD if comm is None else comm
    reply: tuple[bool, Any] = (True, None)
    if comm.Get_rank() == 0:
        path = os.path.abspath(os.fspath(directory))
        try:
            manifest = _read_manifest(_recover(path))
            sched = manifest.get("scheduler")
            if isinstance(sched, dict) and not _tree_keys(sched.get("state")):
                sched["state"] = _decode(sched["state"], {})
            reply = (True, manifest)
        except CheckpointError as exc:
            reply = (False, str(exc))
        except Exception as exc:
            reply = (False, f"{path} cannot be read: {type(exc).__name__}: {exc}")
    ok, value = comm.bcast(reply, root=0)
    if not ok:
        raise CheckpointError(value)
    return value


def load_checkpoint(directory: str | os.PathLike, model: Layer | None, optimizer: Any = None,
                    arrays: Mapping[str, DistArray | Distribution] | None = None, *,
                    comm: MPI.Comm | None = None, scheduler: Any = None) -> dict[str, Any]:
    """Load a checkpoint written by :func:`save_checkpoint` (collective over ``comm``).

    Nothing is changed unless the arguments are well-formed and the same on
    every rank (the model's parameter and buffer names, shapes and dtypes,
    the optimizer's and scheduler's classes, the requested arrays' names,
    distributions and dtypes), the whole checkpoint passes rank 0's checks
    (manifest format, version and self-checksum; presence, size and sha256 of
    every file; parameter and buffer names, shapes and dtypes equal to the
    model's; the optimizer's class and state (its ``check_state_dict``, or
    its buffer shapes); the scheduler's class and state; requested arrays
    present with the expected shape and dtype) and every rank has read its
    blocks. A target
    missing because a save was interrupted in its commit is recovered (see
    the module's description).

    Parameters
    ----------
    directory : path
        The checkpoint (rank 0's path is used).
    model : Layer or None
        Its parameters and buffers are overwritten in place
        (:meth:`~disttensor_nn.Layer.load_state_dict`), in the array module
        and on the device where they live.
    optimizer : object, optional
        Gets ``load_state_dict`` with the saved state; None skips it.
    arrays : mapping of str to DistArray or Distribution, optional
        Distributed arrays to read: a DistArray is filled in place, a
        Distribution gets a new DistArray of the saved dtype. Each rank reads
        only its own block. Saved arrays not named here are not read.
    comm : mpi4py.MPI.Comm, optional
        ``MPI.COMM_WORLD`` by default.
    scheduler : object, optional
        A learning-rate scheduler of the class saved: it gets
        ``load_state_dict`` with the saved state (after the optimizer), so
        the schedule goes on from the saved step. Create it before loading.

    Returns
    -------
    dict
        ``step``, ``rng_state``, ``extra``, ``arrays`` (name -> DistArray, for
        the requested arrays), ``array_names`` (all saved arrays) and
        ``manifest``.

    Raises
    ------
    CheckpointError
        On every rank, with rank 0's message, for a missing, corrupt,
        truncated, incomplete or mismatched checkpoint, or when reading a
        distributed array fails on any rank.
    """
    comm = MPI.COMM_WORLD if comm is None else comm
    rank = comm.Get_rank()
    path = os.path.abspath(os.fspath(directory))
    path = comm.bcast(path if rank == 0 else None, root=0)
    arrays = dict(arrays or {})
    _agree_on_arguments(model, optimizer, arrays, comm, scheduler)

    verdict: tuple[bool, str] = (True, "")
    manifest: dict | None = None
    state: dict | None = None
    if rank == 0:
        try:
            path = _recover(path)
            manifest, state = _verify(path, model, optimizer, arrays, scheduler)
        except CheckpointError as exc:
            verdict = (False, str(exc))
        except Exception as exc:  # anything unexpected is a refusal too, never a partial load
            verdict = (False, f"{path} cannot be loaded: {type(exc).__name__}: {exc}")
    ok, msg = comm.bcast(verdict, root=0)
    if not ok:
        raise CheckpointError(msg)
    path, manifest = comm.bcast((path, manifest), root=0)
    state = _bcast_arrays(comm, state)

    # every rank reads its blocks before anything is changed
    saved = {e["name"]: e for e in manifest["arrays"]}
    blocks: dict[str, np.ndarray | None] = {}
    error: BaseException | None = None
    try:
        for name in sorted(arrays):
            dist = arrays[name] if isinstance(arrays[name], Distribution) else arrays[name].dist
            blocks[name] = None
            if all(n > 0 for n in dist.local_shape()):
                mm = np.load(os.path.join(path, saved[name]["file"]), mmap_mode="r")
                blocks[name] = np.array(mm[dist.local_slices()])
                del mm
    except Exception as exc:
        error = exc
    _agree(comm, error, f"load_checkpoint of {path} (distributed arrays)")

    opt = manifest["optimizer"]
    if optimizer is not None:
        optimizer.load_state_dict(_decode(opt["state"], state))
    if scheduler is not None:
        scheduler.load_state_dict(_decode(manifest["scheduler"]["state"], state))
    if model is not None:  # names, shapes and dtypes were checked: every entry is accepted
        model.load_state_dict({e["name"]: state[e["key"]]
                               for e in manifest["parameters"] + manifest["buffers"]},
                              strict=False)
    out: dict[str, DistArray] = {}
    for name in sorted(arrays):
        target = arrays[name]
        if isinstance(target, Distribution):
            target = DistArray.empty(target, np.dtype(saved[name]["dtype"]))
        if blocks[name] is not None:
            target.local[...] = target.xp.asarray(blocks[name])
        out[name] = target
    return {"step": manifest["step"], "rng_state": _decode(manifest["rng_state"], state),
            "extra": _decode(manifest["extra"], state), "arrays": out,
            "array_names": list(saved), "manifest": manifest}
