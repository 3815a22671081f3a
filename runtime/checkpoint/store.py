"""Step folders of torch.distributed.checkpoint files, each rank's sealed by a verified manifest.

Every rank (pipeline position ``s``, replica ``r``) writes its state with
``torch.distributed.checkpoint`` into its own folder, then a manifest beside it::

    <directory>/step-000040/stage-02-replica-0/          .metadata, __0_0.distcp (DCP)
    <directory>/step-000040/stage-02-replica-0.json      manifest (schema pipeplan.checkpoint/2)

The manifest holds the step, the minibatches trained, the run identity and fingerprint,
the plan layout that wrote the step (positions, replicas, layers, schedule) and the size
and sha256 of every file of the rank's folder. It is written last and atomically
(``write_atomic``) after DCP fsync'ed its files, so a step is *complete* when the
manifest of every (stage, replica) of its layout exists and every file it lists
verifies; a crash mid-save, a truncated or garbled file leaves the step incomplete and
``latest_complete_step`` says which newer step it skipped and why.

Saving needs no collective: each rank's folder is a whole DCP checkpoint of its own keys
(``no_dist``), and keys are the model's qualified names, so a run under another plan reads
any key from whichever folder of the step holds it (``pipeplan.runtime.checkpoint.state``).
Pruning needs no barrier either: every rank writes its steps in increasing order, so
once a step is complete every rank finished all older steps.
"""

from __future__ import annotations

import hashlib
import json
import os
import re
import shutil
import warnings
from pathlib import Path
from typing import Any

from pipeplan.errors import InputError, first_line
from pipeplan.jsonio import write_atomic

__all__ = [
    "CHECKPOINT_SCHEMA",
    "rank_folder",
    "open_rank_folder",
    "seal_rank",
    "save_rank",
    "read_manifests",
    "step_problem",
    "latest_complete_step",
    "complete_steps",
    "prune_checkpoints",
    "discard_steps_after",
    "read_run",
    "step_folders",
    "step_folder",
]

CHECKPOINT_SCHEMA = "pipeplan.checkpoint/2"
_OLD_SCHEMA_FILE = re.compile(r"^stage-\d+-replica-\d+\.pt$")  # pipeplan.checkpoint/1
_STEP_DIR = re.compile(r"^step-(\d+)$")
_HASH_CHUNK_BYTES = 1 << 20


def step_folder(directory: str | os.PathLike[str], step: int) -> Path:
    return Path(directory) / f"step-{step:06d}"


def rank_folder(directory: str | os.PathLike[str], step: int, stage: int, replica: int) -> Path:
    """``<directory>/step-<step:06d>/stage-<stage:02d>-replica-<replica>`` (a DCP folder)."""
    return step_folder(directory, step) / f"stage-{stage:02d}-replica-{replica}"


def open_rank_folder(directory: str | os.PathLike[str], step: int, stage: int, replica: int) -> Path:
    """Create one rank's folder of ``step`` and remove its manifest: a stale seal must never
    cover the files about to be written. Returns the folder."""
    folder = rank_folder(directory, step, stage, replica)
    try:
        folder.with_suffix(".json").unlink(missing_ok=True)
        folder.mkdir(parents=True, exist_ok=True)
    except OSError as exc:
        raise InputError(f"cannot write checkpoint {folder}: {exc.strerror or exc}") from exc
    return folder


def seal_rank(folder: Path, step: int, stage: int, replica: int, manifest: dict[str, Any]) -> int:
    """Write the manifest of a rank folder DCP finished writing (sizes and sha256 of its
    files, atomically); returns the bytes of the files it seals.

    ``manifest`` must hold ``run_fingerprint`` and ``layout`` (``{"replicas": [...]}`` and
    whatever else describes the plan); step, stage, replica and the files are added here.
    """
    files = {path.name: _file_digest(path) for path in sorted(folder.iterdir()) if path.is_file()}
    sealed = {
        **manifest,
        "schema": CHECKPOINT_SCHEMA,
        "step": step,
        "stage": stage,
        "replica": replica,
        "files": files,
    }
    write_atomic(folder.with_suffix(".json"), json.dumps(sealed, indent=1).encode())
    _fsync_dir(folder.parent)
    return sum(int(entry["bytes"]) for entry in files.values())


def save_rank(
    directory: str | os.PathLike[str],
    step: int,
    stage: int,
    replica: int,
    state: dict[str, Any],
    manifest: dict[str, Any],
) -> Path:
    """Write one rank's ``state`` (flat, str keys) with DCP, then its manifest (``seal_rank``);
    returns the folder. ``pipeplan.runtime.checkpoint.persist`` does the same in the background."""
    import torch.distributed.checkpoint as dcp

    folder = open_rank_folder(directory, step, stage, replica)
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", UserWarning)  # "assuming ... a single process": intended
            dcp.save(state, storage_writer=dcp.FileSystemWriter(str(folder)), no_dist=True)
    except OSError as exc:
        raise InputError(f"cannot write checkpoint {folder}: {exc.strerror or exc}") from exc
    seal_rank(folder, step, stage, replica, manifest)
    return folder


def read_manifests(directory: str | os.PathLike[str], step: int) -> dict[tuple[int, int], dict[str, Any]]:
    """(stage, replica) -> manifest of every readable manifest of ``step``."""
    found: dict[tuple[int, int], dict[str, Any]] = {}
    folder = step_folder(directory, step)
    for path in sorted(folder.glob("stage-*-replica-*.json")) if folder.is_dir() else ():
        manifest = _read_manifest(path)
        if manifest is not None:
            found[(manifest["stage"], manifest["replica"])] = manifest
    return found


def step_problem(
    directory: str | os.PathLike[str], step: int, run_fingerprint: str | None, hashes: bool = True
) -> str | None:
    """``None`` when ``step`` is complete and verifies; else why not, in a few words.

    Reads and hashes every file of the step (O(checkpoint bytes of one step)); with
    ``hashes=False`` only the files' sizes are compared (pruning: see ``prune_checkpoints``). A step
    written by another run than ``run_fingerprint`` raises ``InputError`` rather than
    being silently skipped (``None``: any run's step, as ``run --weights`` reads them).
    """
    folder = step_folder(directory, step)
    try:
        names = [p.name for p in folder.iterdir()]
    except OSError as exc:
        return f"it cannot be listed ({first_line(exc)[:80]})"
    if any(_OLD_SCHEMA_FILE.match(name) for name in names):
        return "it was written by an older pipeplan (pipeplan.checkpoint/1), which this one does not read"
    manifests = read_manifests(directory, step)
    if not manifests:
        return "it has no readable manifest"
    for manifest in manifests.values():
        if run_fingerprint is not None and manifest["run_fingerprint"] != run_fingerprint:
            raise InputError(
                f"checkpoint {folder} was written by run {manifest['run_fingerprint']}, "
                f"this run is {run_fingerprint}"
            )
    layouts = {json.dumps(m["layout"], sort_keys=True) for m in manifests.values()}
    if len(layouts) > 1:
        return "its ranks' manifests describe different plans"
    replicas = next(iter(manifests.values()))["layout"]["replicas"]
    for stage, count in enumerate(replicas):
        for replica in range(count):
            if (stage, replica) not in manifests:
                return f"stage {stage} replica {replica} has no manifest (its save did not finish)"
    for (stage, replica), manifest in sorted(manifests.items()):
        root = rank_folder(directory, step, stage, replica)
        for name, expected in manifest["files"].items():
            problem = _file_problem(root / name, expected, hashes)
            if problem is not None:
                return f"{root.name}/{name} {problem}"
    return None


def latest_complete_step(
    directory: str | os.PathLike[str], run_fingerprint: str | None
) -> tuple[int | None, list[tuple[int, str]]]:
    """(newest complete step or None, [(newer step skipped, why), ...] newest first)."""
    skipped: list[tuple[int, str]] = []
    for step in reversed(step_folders(directory)):
        problem = step_problem(directory, step, run_fingerprint)
        if problem is None:
            return step, skipped
        skipped.append((step, problem))
    return None, skipped


def complete_steps(
    directory: str | os.PathLike[str], run_fingerprint: str, limit: int | None = None, hashes: bool = True
) -> list[int]:
    """Complete steps, newest first (at most ``limit`` of them); ``hashes``: as ``step_problem``."""
    found: list[int] = []
    for step in reversed(step_folders(directory)):
        if limit is not None and len(found) >= limit:
            break
        if step_problem(directory, step, run_fingerprint, hashes) is None:
            found.append(step)
    return found


def prune_checkpoints(directory: str | os.PathLike[str], run_fingerprint: str, keep: int = 2) -> list[int]:
    """Delete this run's step folders older than the ``keep`` newest complete steps; returns them.

    Nothing is deleted until ``keep`` complete steps exist, so the last complete step is
    never deleted; folders newer than the newest complete step (a save in progress) are
    never touched, nor folders holding another run's manifests. The steps kept are checked
    by their manifests and file sizes, not re-hashed: each rank hashed its files as it sealed
    them, and re-reading two whole steps after every save doubled a checkpoint's CPU cost.
    """
    if keep < 1:
        raise InputError(f"checkpoint retention must keep at least 1 step, got keep={keep}")
    kept = complete_steps(directory, run_fingerprint, limit=keep, hashes=False)
    if len(kept) < keep:
        return []
    deleted: list[int] = []
    for step in step_folders(directory):
        if step < kept[0] and step not in kept and _owned(directory, step, run_fingerprint):
            shutil.rmtree(step_folder(directory, step), ignore_errors=True)
            deleted.append(step)
    return deleted


def discard_steps_after(directory: str | os.PathLike[str], step: int, run_fingerprint: str) -> list[int]:
    """Delete this run's step folders newer than ``step`` (a resume from ``step`` rewrites them)."""
    deleted = [s for s in step_folders(directory) if s > step and _owned(directory, s, run_fingerprint)]
    for later in deleted:
        shutil.rmtree(step_folder(directory, later), ignore_errors=True)
    return deleted


def step_folders(directory: str | os.PathLike[str]) -> list[int]:
    """Step numbers of the ``step-N`` folders in ``directory``, ascending ([] when absent)."""
    root = Path(directory)
    if not root.is_dir():
        return []
    steps = [int(m.group(1)) for e in root.iterdir() if (m := _STEP_DIR.match(e.name)) and e.is_dir()]
    return sorted(steps)


def read_run(directory: str | os.PathLike[str]) -> tuple[str, dict[str, Any]] | None:
    """(run fingerprint, run identity) from the newest readable manifest, or None."""
    for step in reversed(step_folders(directory)):
        for manifest in read_manifests(directory, step).values():
            run = manifest.get("run")
            return manifest["run_fingerprint"], run if isinstance(run, dict) else {}
    return None


def _owned(directory: str | os.PathLike[str], step: int, run_fingerprint: str) -> bool:
    """True when no manifest of ``step`` names another run (torn ones name nobody)."""
    return all(m["run_fingerprint"] == run_fingerprint for m in read_manifests(directory, step).values())


def _read_manifest(path: Path) -> dict[str, Any] | None:
    """The manifest at ``path``, or None when it is unreadable or not one of ours."""
    try:
        manifest = json.loads(path.read_bytes())
    except (OSError, ValueError):
        return None
    if not isinstance(manifest, dict) or manifest.get("schema") != CHECKPOINT_SCHEMA:
        return None
    kinds = (
        ("step", int),
        ("stage", int),
        ("replica", int),
        ("run_fingerprint", str),
        ("files", dict),
        ("layout", dict),
    )
    if any(not isinstance(manifest.get(key), kind) for key, kind in kinds):
        return None
    if not isinstance(manifest["layout"].get("replicas"), list):
        return None
    return manifest


def _file_digest(path: Path) -> dict[str, Any]:
    digest = hashlib.sha256()
    size = 0
    with path.open("rb") as handle:
        while chunk := handle.read(_HASH_CHUNK_BYTES):
            digest.update(chunk)
            size += len(chunk)
    return {"bytes": size, "sha256": digest.hexdigest()}


def _file_problem(path: Path, expected: object, hashes: bool = True) -> str | None:  # a manifest entry
    if not isinstance(expected, dict):
        return "has no size and hash in its manifest"
    try:
        observed = (
            _file_digest(path) if hashes else {"bytes": path.stat().st_size, "sha256": expected.get("sha256")}
        )
    except OSError as exc:
        return f"cannot be read ({first_line(exc)[:80]})"
    if observed["bytes"] != expected.get("bytes"):
        return f"is {observed['bytes']} bytes, its manifest says {expected.get('bytes')} bytes"
    if observed["sha256"] != expected.get("sha256"):
        return "fails its sha256 (the file changed after it was written)"
    return None


def _fsync_dir(folder: Path) -> None:
    """Persist a rename in ``folder`` (no-op where directories cannot be opened)."""
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
