"""Replacing the worker's drafter while it serves: read and check off the engine thread,
swap between two steps (requests already started keep the drafter they started with)."""

from __future__ import annotations

import logging
from pathlib import Path

from dflash.engine.engine import check_compatible
from dflash.errors import DFlashError

log = logging.getLogger("dflash.worker")


class DrafterReloader:
    def __init__(self, engine, drafter_dir: str | Path | None, drafter_roots):
        self.engine = engine
        # reload_drafter without a path reads this folder again; with a path, only folders
        # under the drafter roots load (a socket peer must not make the worker read anything else).
        self.drafter_dir = Path(drafter_dir) if drafter_dir else None
        self.drafter_roots = [Path(r).resolve() for r in drafter_roots]

    def read(self, params: dict) -> dict:
        """Read and check the drafter a reload_drafter names (`path`: a folder under the
        drafter roots; none: the current drafter's folder again; `sha256`: the digest its
        weights must have). Runs on the caller's thread. Raises DFlashError."""
        from dflash.loading import load_versioned

        unknown = sorted(set(params) - {"path", "sha256"})
        if unknown:
            raise DFlashError("bad_params", f"unknown reload_drafter parameters: {', '.join(unknown)}")
        path, sha256 = params.get("path"), params.get("sha256")
        for key, value in (("path", path), ("sha256", sha256)):
            if value is not None and (not isinstance(value, str) or not value):
                raise DFlashError("bad_params", f"parameter '{key}' must be a non-empty string")
        if path is None:
            if self.drafter_dir is None:
                raise DFlashError("bad_params", "this worker's drafter was not loaded from a folder: give a path")
            folder = self.drafter_dir
        else:
            folder = Path(path).resolve()
            if not any(folder.is_relative_to(root) for root in self.drafter_roots):
                raise DFlashError("forbidden_path", f"{path} is not under the worker's drafter roots "
                                  "(dflash serve --drafter-root DIR)")
        target = self.engine.target
        try:
            model, digest = load_versioned(folder, device=target.device, dtype=target.dtype)
        except DFlashError:
            raise
        except Exception as exc:  # a half-written or foreign folder: refuse it, keep serving
            raise DFlashError("bad_drafter", f"cannot load a drafter from {folder}: {type(exc).__name__}: {exc}")
        check_compatible(target, model.config, str(folder))
        if sha256 is not None and digest != sha256:
            raise DFlashError("bad_drafter", f"the drafter in {folder} has digest {digest}, not the expected {sha256}")
        return {"model": model, "sha256": digest, "path": folder, "name": folder.name}

    def swap(self, new: dict) -> dict:
        """Install a drafter `read` returned; on the engine thread, between steps."""
        result = self.engine.swap_drafter(new["model"], new["name"], new["sha256"])
        self.drafter_dir = new["path"]
        if not result["cost_curve_kept"]:
            self.engine.cost_curve  # measure now, not inside a request's step
        log.info("drafter %s (%s) replaced by %s (%s) from %s", result["previous"]["drafter"],
                 result["previous"]["drafter_version"], result["drafter"], result["drafter_version"], new["path"])
        return {**result, "drafter_sha256": new["sha256"], "path": str(new["path"])}
