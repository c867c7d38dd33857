# Written by scripts/wheel.sh from Cargo.toml's version.
__version__ = "0.1.0"
