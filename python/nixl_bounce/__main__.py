"""``python -m nixl_bounce`` (or ``nixl-bounce``): install the plugin where
NIXL finds it, or say where things are."""

import argparse
import filecmp
import os
import sys

from . import __version__, install, nixl_plugins_dir, plugin_path


def _where() -> int:
    plugins = nixl_plugins_dir()
    print(f"nixl-bounce {__version__}")
    print(f"plugin in this package: {plugin_path()}")
    print(f"nixl-cu13 plugins folder: {plugins or 'not found (is nixl-cu13 installed?)'}")
    if plugins is not None:
        installed = plugins / plugin_path().name
        state = (
            "installed, same as this package's"
            if installed.is_file() and filecmp.cmp(installed, plugin_path(), shallow=False)
            else "installed, DIFFERENT from this package's (run: python -m nixl_bounce install)"
            if installed.is_file()
            else "not installed (run: python -m nixl_bounce install)"
        )
        print(f"BOUNCE there: {state}")
    env = os.environ.get("NIXL_PLUGIN_DIR")
    if env:
        print(f"NIXL_PLUGIN_DIR={env}: NIXL scans only this folder")
    return 0


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="nixl-bounce", description=__doc__)
    sub = ap.add_subparsers(dest="command", required=True)
    ins = sub.add_parser("install", help="copy the plugin beside the nixl-cu13 wheel's UCX plugin")
    ins.add_argument("--dest", help="the folder to copy it into instead (the one NIXL scans)")
    sub.add_parser("where", help="where the plugin and NIXL's plugin folder are")
    args = ap.parse_args(argv)
    if args.command == "where":
        return _where()
    try:
        target = install(args.dest)
    except (OSError, FileNotFoundError) as e:
        print(f"nixl-bounce: install failed: {e}", file=sys.stderr)
        return 1
    print(f"installed {target}")
    env = os.environ.get("NIXL_PLUGIN_DIR")
    if env and os.path.realpath(env) != os.path.realpath(target.parent):
        print(
            f"note: NIXL_PLUGIN_DIR={env} makes NIXL scan only that folder; unset it, "
            f"or set it to {target.parent}",
            file=sys.stderr,
        )
    else:
        print('NIXL finds it there: nixl_agent_config(backends=["BOUNCE"])')
    return 0


if __name__ == "__main__":
    sys.exit(main())
