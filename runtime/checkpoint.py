"""Per-stage atomic checkpoints of a pipeline-parallel run.

Every rank (stage ``s``, replica ``r``) writes its own file; a step is *complete* when
the file of every (stage, replica) of the plan exists and verifies::

    <directory>/step-000040/stage-02-replica-0.pt

One file is one header line of JSON (schema ``pipeplan.checkpoint/1``: step, stage,
replica, plan fingerprint, payload size in bytes and its sha256) followed by the
``torch.save`` payload of the state the runtime passes (model and optimizer state
dicts, stashed weight versions, RNG states, ...). The file is written to a temp file
in the same folder, fsync'ed, then renamed over the final name, so a crash leaves
either no file or a whole one; a file torn some other way (truncated, garbled) fails
its sha256 and makes its step incomplete, so ``latest_complete_step`` falls back to an
older step where every stage verifies.

Pruning needs no barrier: every rank writes its steps in increasing order, so once a
step is complete (every rank's file verifies) every rank has finished writing all older
steps; ``prune_checkpoints`` deletes only folders older than the kept complete steps and
only those whose files carry this run's fingerprint.

Typical use by the runtime (every rank saves; stage 0 replica 0 then prunes)::

    save_stage_checkpoint(folder, stage, replica, step, state, plan_fingerprint)
    prune_checkpoints(folder, stages, replicas, plan_fingerprint, keep=2)
    ...
    step = latest_complete_step(folder, stages, replicas, plan_fingerprint)
    if step is not None:
        state = load_stage_checkpoint(folder, stage, replica, step, plan_fingerprint).state

The state may hold tensors, numbers, strings, ``None``, ``torch.Size``/``dtype``/
``device`` and dicts, lists and tuples of these (what ``state_dict()`` and
``torch.get_rng_state()`` return): loading uses ``torch.load(weights_only=True)``,
which refuses arbitrary pickled objects, so saving checks the same rule up front.
"""

from __future__ import annotations

import hashlib
import io
import json
import os
import re
import shutil
from collections import OrderedDict
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Sequence

from pipeplan.errors import InputError, first_line
from pipeplan.jsonio import write_atomic

__all__ = [
    "StageCheckpoint",
    "CHECKPOINT_SCHEMA",
    "checkpoint_path",
    "save_stage_checkpoint",
    "latest_complete_step",
    "load_stage_checkpoint",
    "complete_steps",
    "prune_checkpoints",
    "read_run",
    "step_folders",
]

CHECKPOINT_SCHEMA = "pipeplan.checkpoint/1"
_STEP_DIR = re.compile(r"^step-(\d+)$")
_MAX_HEADER_BYTES = 64 * 1024
_HASH_CHUNK_BYTES = 1 << 20


@dataclass(frozen=True)
class StageCheckpoint:
    """The state one rank saved at one step (indexed by stage; replicas are identical)."""

    stage: int
    step: int
    state: dict[str, Any]  # whatever the runtime passed: state dicts, weight stash, rng, ...


class _Torn(Exception):
    """A checkpoint file that is missing, truncated or garbled (the step is incomplete)."""


def checkpoint_path(directory: str | os.PathLike[str], stage: int, replica: int, step: int) -> Path:
    """``<directory>/step-<step:06d>/stage-<stage:02d>-replica-<replica>.pt``."""
    return Path(directory) / f"step-{step:06d}" / f"stage-{stage:02d}-replica-{replica}.pt"


def save_stage_checkpoint(
    directory: str | os.PathLike[str],
    stage: int,
    replica: int,
    step: int,
    state: dict[str, Any],
    plan_fingerprint: str,
    run: dict[str, Any] | None = None,
) -> Path:
    """Write one rank's checkpoint of ``step`` atomically; returns its path.

    ``plan_fingerprint`` identifies the run (the runtime passes its run fingerprint: plan,
    model, optimizer, seed); ``run`` (optional) is the run's identity written into the
    header so that a refusal can say what differs (``read_run``).

    The temp file lives in the step folder and is renamed over the final name after an
    fsync, then the folder is fsync'ed, so the rename itself survives a power loss.
    """
    _check_ids(stage, replica, step)
    if not isinstance(state, dict):
        raise InputError(f"checkpoint state must be a dict, got {type(state).__name__}")
    _check_loadable(state, "state")
    import torch

    buffer = io.BytesIO()
    torch.save(state, buffer)
    payload = buffer.getvalue()
    header = {
        "schema": CHECKPOINT_SCHEMA,
        "step": step,
        "stage": stage,
        "replica": replica,
        "plan_fingerprint": plan_fingerprint,
        "payload_bytes": len(payload),
        "sha256": hashlib.sha256(payload).hexdigest(),
    }
    if run is not None:
        header["run"] = run
    line = json.dumps(header, separators=(",", ":")).encode() + b"\n"
    path = checkpoint_path(directory, stage, replica, step)
    try:
        write_atomic(path, line + payload)
    except InputError as exc:  # write_atomic names the file; say it is a checkpoint
        cause = exc.__cause__
        reason = cause.strerror if isinstance(cause, OSError) and cause.strerror else str(exc)
        raise InputError(f"cannot write checkpoint {path}: {reason}") from exc
    _fsync_dir(path.parent)
    return path


def load_stage_checkpoint(
    directory: str | os.PathLike[str],
    stage: int,
    replica: int,
    step: int,
    plan_fingerprint: str,
) -> StageCheckpoint:
    """Read and verify one rank's checkpoint; ``InputError`` names the file and the problem."""
    _check_ids(stage, replica, step)
    path = checkpoint_path(directory, stage, replica, step)
    try:
        with path.open("rb") as handle:
            header = _read_header(handle, path)
            _check_header(header, path, stage, replica, step, plan_fingerprint)
            payload = handle.read()
    except _Torn as exc:
        raise InputError(f"checkpoint {path} is unusable: {exc}") from exc
    except OSError as exc:
        raise InputError(f"cannot read checkpoint {path}: {exc.strerror or exc}") from exc
    if len(payload) != header["payload_bytes"]:
        raise InputError(
            f"checkpoint {path} is truncated: payload is {len(payload)} bytes, "
            f"header says {header['payload_bytes']} bytes"
        )
    digest = hashlib.sha256(payload).hexdigest()
    if digest != header["sha256"]:
        raise InputError(f"checkpoint {path} is corrupt: sha256 {digest[:12]}… != {header['sha256'][:12]}…")
    import torch

    try:
        state = torch.load(io.BytesIO(payload), map_location="cpu", weights_only=True)
    except Exception as exc:  # a verified payload that torch refuses: report in one line
        first = first_line(exc)
        raise InputError(f"checkpoint {path} cannot be loaded: {first}") from exc
    return StageCheckpoint(stage=stage, step=step, state=state)


def latest_complete_step(
    directory: str | os.PathLike[str],
    stages: int,
    replicas: Sequence[int],
    plan_fingerprint: str,
) -> int | None:
    """Newest step whose files of every (stage, replica) exist and verify; ``None`` if none.

    ``replicas[s]`` is the replica count of stage ``s``. Steps are checked newest first
    and the search stops at the first complete one; each check reads and hashes every
    file of that step (O(checkpoint bytes of one step)). A whole file written for
    another plan raises ``InputError`` rather than being silently skipped.
    """
    for step in complete_steps(directory, stages, replicas, plan_fingerprint, limit=1):
        return step
    return None


def complete_steps(
    directory: str | os.PathLike[str],
    stages: int,
    replicas: Sequence[int],
    plan_fingerprint: str,
    limit: int | None = None,
) -> list[int]:
    """Complete steps, newest first (at most ``limit`` of them)."""
    _check_layout(stages, replicas)
    found: list[int] = []
    for step in reversed(_step_numbers(directory)):
        if limit is not None and len(found) >= limit:
            break
        if _step_is_complete(directory, step, stages, replicas, plan_fingerprint):
            found.append(step)
    return found


def prune_checkpoints(
    directory: str | os.PathLike[str],
    stages: int,
    replicas: Sequence[int],
    plan_fingerprint: str,
    keep: int = 2,
) -> list[int]:
    """Delete step folders older than the ``keep`` newest complete steps; returns them.

    Call it on one rank after every rank saved (a barrier). Nothing is deleted until
    ``keep`` complete steps exist, so the last complete step is never deleted; folders
    newer than the newest complete step (a save in progress) are never touched.
    """
    if keep < 1:
        raise InputError(f"checkpoint retention must keep at least 1 step, got keep={keep}")
    kept = complete_steps(directory, stages, replicas, plan_fingerprint, limit=keep)
    if len(kept) < keep:
        return []
    oldest_kept = kept[-1]
    deleted: list[int] = []
    for step in _step_numbers(directory):
        folder = Path(directory) / f"step-{step:06d}"
        if (step < oldest_kept or (step < kept[0] and step not in kept)) and _owned(folder, plan_fingerprint):
            shutil.rmtree(folder, ignore_errors=True)
            deleted.append(step)
    return deleted


def _owned(folder: Path, plan_fingerprint: str) -> bool:
    """True when no file in ``folder`` carries another run's fingerprint in its header."""
    for path in folder.glob("*.pt"):
        try:
            with path.open("rb") as handle:
                header = _read_header(handle, path)
        except (_Torn, OSError):
            continue  # torn or vanished: nobody's
        if header["plan_fingerprint"] != plan_fingerprint:
            return False
    return True


def step_folders(directory: str | os.PathLike[str]) -> list[int]:
    """Step numbers of the ``step-N`` folders in ``directory``, ascending."""
    return _step_numbers(directory)


def read_run(directory: str | os.PathLike[str]) -> tuple[str, dict[str, Any]] | None:
    """(fingerprint, run identity) from the newest readable checkpoint header, or None.

    The identity is ``{}`` for files written without one. O(step folders) header reads.
    """
    for step in reversed(_step_numbers(directory)):
        for path in sorted((Path(directory) / f"step-{step:06d}").glob("*.pt")):
            try:
                with path.open("rb") as handle:
                    header = _read_header(handle, path)
            except (_Torn, OSError):
                continue
            run = header.get("run")
            return header["plan_fingerprint"], run if isinstance(run, dict) else {}
    return None


def _step_numbers(directory: str | os.PathLike[str]) -> list[int]:
    """Step numbers of the ``step-N`` folders, ascending ([] when the folder is absent)."""
    root = Path(directory)
    if not root.is_dir():
        return []
    steps = []
    for entry in root.iterdir():
        match = _STEP_DIR.match(entry.name)
        if match and entry.is_dir():
            steps.append(int(match.group(1)))
    return sorted(steps)


def _step_is_complete(
    directory: str | os.PathLike[str],
    step: int,
    stages: int,
    replicas: Sequence[int],
    plan_fingerprint: str,
) -> bool:
    for stage in range(stages):
        for replica in range(replicas[stage]):
            path = checkpoint_path(directory, stage, replica, step)
            try:
                _verify_file(path, stage, replica, step, plan_fingerprint)
            except _Torn:
                return False
    return True


def _verify_file(path: Path, stage: int, replica: int, step: int, plan_fingerprint: str) -> None:
    """Raise ``_Torn`` unless ``path`` is whole; ``InputError`` if it belongs to another plan."""
    try:
        with path.open("rb") as handle:
            header = _read_header(handle, path)
            _check_header(header, path, stage, replica, step, plan_fingerprint)
            digest = hashlib.sha256()
            size = 0
            while chunk := handle.read(_HASH_CHUNK_BYTES):
                digest.update(chunk)
                size += len(chunk)
    except OSError as exc:
        raise _Torn(exc.strerror or str(exc)) from exc
    if size != header["payload_bytes"] or digest.hexdigest() != header["sha256"]:
        raise _Torn(f"payload of {size} bytes does not match its header")


def _read_header(handle: Any, path: Path) -> dict[str, Any]:
    line = handle.readline(_MAX_HEADER_BYTES)
    if not line.endswith(b"\n"):
        raise _Torn("no header line")
    try:
        header = json.loads(line)
    except (json.JSONDecodeError, UnicodeDecodeError) as exc:
        raise _Torn("header is not JSON") from exc
    if not isinstance(header, dict) or header.get("schema") != CHECKPOINT_SCHEMA:
        raise _Torn(f"header schema is not {CHECKPOINT_SCHEMA!r}")
    for key, kind in (("step", int), ("stage", int), ("replica", int), ("payload_bytes", int),
                      ("sha256", str), ("plan_fingerprint", str)):
        if not isinstance(header.get(key), kind):
            raise _Torn(f"header field {key!r} is missing or not {kind.__name__}")
    return header


def _check_header(
    header: dict[str, Any], path: Path, stage: int, replica: int, step: int, plan_fingerprint: str
) -> None:
    if header["plan_fingerprint"] != plan_fingerprint:
        raise InputError(
            f"checkpoint {path} was written for plan {header['plan_fingerprint']}, "
            f"this plan is {plan_fingerprint}"
        )
    observed = (header["step"], header["stage"], header["replica"])
    if observed != (step, stage, replica):
        raise _Torn(f"header says step {observed[0]} stage {observed[1]} replica {observed[2]}")


def _check_ids(stage: int, replica: int, step: int) -> None:
    for name, value in (("stage", stage), ("replica", replica), ("step", step)):
        if not isinstance(value, int) or isinstance(value, bool) or value < 0:
            raise InputError(f"checkpoint {name} must be a non-negative int, got {value!r}")


def _check_layout(stages: int, replicas: Sequence[int]) -> None:
    if len(replicas) != stages or any(count < 1 for count in replicas):
        raise InputError(
            f"checkpoint layout: stages={stages} needs one replica count >= 1 per stage, "
            f"got replicas={list(replicas)}"
        )


def _check_loadable(value: Any, where: str) -> None:
    """Refuse values ``torch.load(weights_only=True)`` could not read back, naming their key."""
    import torch

    if value is None or isinstance(value, (bool, int, float, complex, str, bytes)):
        return
    if isinstance(value, (torch.Tensor, torch.Size, torch.dtype, torch.device)):
        return
    if type(value) in (dict, OrderedDict):  # subclasses (defaultdict, ...) are refused on load
        for key, item in value.items():
            if not isinstance(key, (str, int, float, bool, tuple)) and key is not None:
                raise InputError(f"checkpoint {where} has a key of type {type(key).__name__}")
            _check_loadable(item, f"{where}[{key!r}]")
        return
    if type(value) in (list, tuple):  # a namedtuple is refused on load
        for position, item in enumerate(value):
            _check_loadable(item, f"{where}[{position}]")
        return
    raise InputError(
        f"checkpoint {where} is a {type(value).__name__}; only tensors, numbers, strings and "
        "dicts/lists/tuples of them can be saved"
    )


def _fsync_dir(folder: Path) -> None:
    """Persist a rename in ``folder`` (no-op where directories cannot be opened, e.g. Windows)."""
    try:
        fd = os.open(folder, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(fd)
    except OSError:
        pass
    finally:
        os.close(fd)
