"""The BOUNCE NIXL backend plugin, packaged.

NIXL loads backend plugins from one folder: the nixl-cu13 wheel's own
``plugins/`` (beside ``libplugin_UCX.so``), or the folder ``NIXL_PLUGIN_DIR``
names, which replaces it. :func:`install` copies this package's plugin into
the wheel's folder, so that UCX and BOUNCE are both there.
"""

import importlib.util
import os
import shutil
from pathlib import Path
from typing import Optional

from ._version import __version__

PLUGIN_NAME = "libplugin_BOUNCE.so"

__all__ = ["__version__", "plugin_path", "nixl_plugins_dir", "install"]


def plugin_path() -> Path:
    """The plugin this package carries."""
    return Path(__file__).resolve().parent / PLUGIN_NAME


def nixl_plugins_dir() -> Optional[Path]:
    """The ``plugins/`` folder of the installed nixl-cu13 wheel (where its
    UCX plugin is), or None when the wheel is not installed."""
    spec = importlib.util.find_spec("nixl_cu13")
    if spec is None or not spec.submodule_search_locations:
        return None
    site = Path(list(spec.submodule_search_locations)[0]).resolve().parent
    for libs in (".nixl_cu13.mesonpy.libs", "nixl_cu13.libs"):
        plugins = site / libs / "plugins"
        if (plugins / "libplugin_UCX.so").is_file():
            return plugins
    return None


def install(dest: Optional[os.PathLike] = None) -> Path:
    """Copies the plugin into ``dest`` (default: :func:`nixl_plugins_dir`)
    and returns where it is. The copy replaces an older one atomically: a
    process that has the old one mapped keeps it intact."""
    src = plugin_path()
    if not src.is_file():
        raise FileNotFoundError(f"{src}: this nixl-bounce package carries no plugin")
    folder = Path(dest) if dest is not None else nixl_plugins_dir()
    if folder is None:
        raise FileNotFoundError(
            "the nixl-cu13 wheel is not installed in this Python (pip install nixl-cu13), "
            "or its plugins folder has no libplugin_UCX.so; pass the folder NIXL scans"
        )
    target = folder / PLUGIN_NAME
    tmp = folder / f".{PLUGIN_NAME}.{os.getpid()}.tmp"
    shutil.copyfile(src, tmp)
    os.chmod(tmp, 0o755)
    os.replace(tmp, target)
    return target
