"""The module paths of gradshare 0.1, kept for one release as aliases of their new homes.

``import gradshare.encoder`` (or a pickle that names ``gradshare.ddp_hook.ThresholdHookState``,
as every pickled hook state of 0.1 does) still works: the old name is the new module itself,
with a ``DeprecationWarning``. Public code imports from ``gradshare`` itself.
"""

from __future__ import annotations

import importlib
import importlib.abc
import importlib.machinery
import sys
import types
import warnings
from collections.abc import Sequence

__all__ = ["MOVED", "install"]

MOVED = {
    "gradshare._format": "gradshare.codec._format",
    "gradshare._workspace": "gradshare.codec._workspace",
    "gradshare._dispatch": "gradshare.codec._dispatch",
    "gradshare._kernels": "gradshare.codec._kernels",
    "gradshare._intrinsics": "gradshare.codec._intrinsics",
    "gradshare._torch_paths": "gradshare.codec._torch_paths",
    "gradshare._flat": "gradshare.codec.flat",
    "gradshare.threads": "gradshare.codec.threads",
    "gradshare.encoder": "gradshare.encoding.encoder",
    "gradshare.threshold": "gradshare.encoding.threshold",
    "gradshare.residual": "gradshare.encoding.residual",
    "gradshare.accumulator": "gradshare.local.accumulator",
    "gradshare.tail": "gradshare.local.tail",
    "gradshare.parallel": "gradshare.local.parallel",
    "gradshare.exchange": "gradshare.distributed.exchange",
    "gradshare._inflight": "gradshare.distributed._inflight",
    "gradshare.nodes": "gradshare.distributed.nodes",
    "gradshare.ddp_hook": "gradshare.distributed.ddp_hook",
    "gradshare._lightning": "gradshare.integrations.lightning",
    "gradshare.cli": "gradshare.app.cli",
    "gradshare.train": "gradshare.app.train",
    "gradshare.report": "gradshare.app.report",
    "gradshare.datasets": "gradshare.app.datasets",
}
"""Old module path -> the module that now holds its contents."""


class _Alias(importlib.abc.MetaPathFinder, importlib.abc.Loader):
    """Finds an old path and loads it as the new module (the same object, not a copy)."""

    def find_spec(
        self,
        fullname: str,
        path: Sequence[str] | None,
        target: types.ModuleType | None = None,
    ) -> importlib.machinery.ModuleSpec | None:
        if fullname not in MOVED:
            return None
        return importlib.machinery.ModuleSpec(fullname, self)

    def create_module(self, spec: importlib.machinery.ModuleSpec) -> None:
        return None  # a placeholder, replaced in exec_module

    def exec_module(self, module: types.ModuleType) -> None:
        new = MOVED[module.__name__]
        warnings.warn(
            f"`{module.__name__}` moved to `{new}`; the old path goes in gradshare 0.3. "
            "Import public names from `gradshare` itself.",
            DeprecationWarning,
            stacklevel=2,
        )
        sys.modules[module.__name__] = importlib.import_module(new)


def install() -> None:
    """Put the alias finder on ``sys.meta_path`` (once)."""
    if not any(isinstance(f, _Alias) for f in sys.meta_path):
        sys.meta_path.append(_Alias())
