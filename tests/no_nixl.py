"""A directory that, first on PYTHONPATH, makes a process look like a host without NIXL: each
module name NIXL installs under raises ImportError on import."""

from __future__ import annotations

from pathlib import Path

NIXL_MODULES = ("nixl", "nixl_cu12", "nixl_cu13")


def write_no_nixl_dir(root: Path) -> Path:
    for name in NIXL_MODULES:
        package = root / name
        package.mkdir(parents=True, exist_ok=True)
        (package / "__init__.py").write_text(
            'raise ImportError("NIXL is hidden: this process plays a host without it")\n'
        )
    return root
