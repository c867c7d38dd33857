#!/usr/bin/env bash
# Prepare everything nixl-bounce needs, idempotently (fast when all is present):
#   system packages (apt, only what is missing) -> Rust toolchain -> the pinned
#   NIXL wheel in the project-local .nixl/site -> cargo build -> the plugin
#   installed as libplugin_BOUNCE.so next to NIXL's own UCX plugin -> env vars.
#
# Use:   source scripts/setup.sh [dev|release]   (exports the variables below)
#   or:  scripts/setup.sh [dev|release]          (prints them as `export` lines)
# Profile also from NIXL_BOUNCE_PROFILE; default dev.
#
# Exports: NIXL_PLUGIN_DIR  the wheel's plugins/ folder (BOUNCE + UCX live there)
#          LD_LIBRARY_PATH  + the wheel's library folder (libnixl_capi.so)
#          PYTHONPATH       + .nixl/site (the official nixl_cu13 Python API)
#          NIXL_BOUNCE_ROOT, NIXL_BOUNCE_SITE, NIXL_BOUNCE_PYTHON
#
# Knobs: NIXL_BOUNCE_SKIP_APT=1 (never call apt-get), NIXL_BOUNCE_SKIP_BUILD=1.

_nb_setup_main() (
    set -euo pipefail
    local profile="$1" root="$2"
    local site="$root/.nixl/site"
    local libs="$site/.nixl_cu13.mesonpy.libs"
    local wheel_spec="nixl-cu13==1.5.1" numpy_spec="numpy==2.2.6"
    step() { printf '[setup] %s\n' "$*" >&2; }
    die() { printf '[setup] ERROR: %s\n' "$*" >&2; exit 1; }

    # 1. System packages ---------------------------------------------------
    local missing=()
    have_pkg() { dpkg-query -W -f='${Status}' "$1" 2>/dev/null | grep -q 'ok installed'; }
    if command -v dpkg-query >/dev/null 2>&1; then
        # build-essential: cc/c++ for the C++ shim and libzmq (built from source
        # by zmq-sys, with the cc crate; no cmake needed). libclang-dev: bindgen.
        # python3-pip: installs the wheel into .nixl/site (--target, no system site).
        # iproute2: `ip netns` for the network-namespace tests.
        for p in build-essential pkg-config libclang-dev python3 python3-pip ca-certificates curl iproute2; do
            have_pkg "$p" || missing+=("$p")
        done
    fi
    if ((${#missing[@]})); then
        if [[ "${NIXL_BOUNCE_SKIP_APT:-0}" == 1 ]]; then
            step "apt: missing ${missing[*]} (NIXL_BOUNCE_SKIP_APT=1, not installing)"
        elif [[ $(id -u) -ne 0 ]]; then
            die "missing system packages: ${missing[*]} (run as root or: sudo apt-get install -y ${missing[*]})"
        else
            step "apt: installing ${missing[*]}"
            export DEBIAN_FRONTEND=noninteractive
            apt-get update -qq >&2
            apt-get install -y -qq --no-install-recommends "${missing[@]}" >&2
        fi
    else
        step "apt: system packages present"
    fi

    # 2. Rust ----------------------------------------------------------------
    if ! command -v cargo >/dev/null 2>&1 && [[ -x "$HOME/.cargo/bin/cargo" ]]; then
        export PATH="$HOME/.cargo/bin:$PATH"
    fi
    if ! command -v cargo >/dev/null 2>&1; then
        step "rust: cargo not found, installing the stable toolchain with rustup (~/.cargo)"
        curl --proto '=https' --tlsv1.2 -sSf https://sh.rustup.rs \
            | sh -s -- -y --profile minimal --default-toolchain stable >&2
        export PATH="$HOME/.cargo/bin:$PATH"
    else
        step "rust: $(cargo --version)"
    fi

    # 3. NIXL wheel (project-local) -------------------------------------------
    local py="${NIXL_BOUNCE_PYTHON:-python3}"
    command -v "$py" >/dev/null 2>&1 || die "$py not found"
    if [[ -f "$libs/libnixl_capi.so" && -f "$libs/plugins/libplugin_UCX.so" \
          && -d "$site/nixl_cu13-1.5.1.dist-info" && -d "$site/numpy" ]] \
       && PYTHONPATH="$site" "$py" -c 'import nixl_cu13._api' >/dev/null 2>&1; then
        step "nixl: $wheel_spec present in .nixl/site"
    else
        "$py" -m pip --version >/dev/null 2>&1 || die "$py -m pip is not available (apt-get install python3-pip)"
        step "nixl: installing $wheel_spec + $numpy_spec into .nixl/site (pip --target, no system site-packages)"
        # --target bypasses Debian's externally-managed guard (PEP 668) by design:
        # nothing is written to the system's site-packages. --no-deps skips torch,
        # which only an optional module needs; numpy is required by nixl_cu13._api.
        local tmp="$root/.nixl/site.tmp.$$"
        rm -rf "$tmp"
        "$py" -m pip install --quiet --disable-pip-version-check --no-input --no-deps \
            --target "$tmp" "$wheel_spec" "$numpy_spec" >&2 \
            || { rm -rf "$tmp"; die "pip install of $wheel_spec failed"; }
        rm -rf "$site"
        mv "$tmp" "$site"
        [[ -f "$libs/libnixl_capi.so" ]] || die "wheel installed but $libs/libnixl_capi.so is missing"
    fi

    # 4. Build -----------------------------------------------------------------
    local target_dir="${CARGO_TARGET_DIR:-$root/target}"
    local outdir flags=()
    case "$profile" in
        dev|debug) outdir="$target_dir/debug" ;;
        release) outdir="$target_dir/release"; flags+=(--release) ;;
        *) die "unknown profile '$profile' (dev|release)" ;;
    esac
    if [[ "${NIXL_BOUNCE_SKIP_BUILD:-0}" == 1 ]]; then
        step "build: skipped (NIXL_BOUNCE_SKIP_BUILD=1)"
    else
        step "build: cargo build ${flags[*]:-} (profile $profile)"
        (cd "$root" && cargo build ${flags[@]+"${flags[@]}"} --lib --bins >&2) || die "cargo build failed"
    fi

    # 5. Install the plugin next to UCX -----------------------------------------
    # NIXL_PLUGIN_DIR makes NIXL scan one folder only, and libplugin_UCX.so finds
    # UCX through its $ORIGIN run path, so BOUNCE goes INTO the wheel's plugins/.
    local so="$outdir/libnixl_bounce.so" dest="$libs/plugins/libplugin_BOUNCE.so"
    if [[ ! -f "$so" ]]; then
        die "build produced no $so"
    elif cmp -s "$so" "$dest"; then
        step "plugin: $dest up to date"
    else
        step "plugin: installing $so as $dest"
        cp "$so" "$dest.tmp.$$" && mv -f "$dest.tmp.$$" "$dest"   # atomic: never rewrite a mapped file
    fi
)

_nb_setup() {
    local profile="${1:-${NIXL_BOUNCE_PROFILE:-dev}}"
    local root
    root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)" || return 1
    _nb_setup_main "$profile" "$root" || return 1
    [[ -x "$HOME/.cargo/bin/cargo" ]] && case ":$PATH:" in *":$HOME/.cargo/bin:"*) ;; *) PATH="$HOME/.cargo/bin:$PATH" ;; esac
    local libs="$root/.nixl/site/.nixl_cu13.mesonpy.libs"
    export PATH
    export NIXL_BOUNCE_ROOT="$root"
    export NIXL_BOUNCE_SITE="$root/.nixl/site"
    export NIXL_BOUNCE_PYTHON="${NIXL_BOUNCE_PYTHON:-$(command -v python3)}"
    export NIXL_PLUGIN_DIR="$libs/plugins"
    case ":${LD_LIBRARY_PATH:-}:" in *":$libs:"*) ;; *) export LD_LIBRARY_PATH="$libs${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}" ;; esac
    case ":${PYTHONPATH:-}:" in *":$root/.nixl/site:"*) ;; *) export PYTHONPATH="$root/.nixl/site${PYTHONPATH:+:$PYTHONPATH}" ;; esac
    printf '[setup] env: NIXL_PLUGIN_DIR=%s LD_LIBRARY_PATH=%s... PYTHONPATH=%s...\n' \
        "$NIXL_PLUGIN_DIR" "${LD_LIBRARY_PATH%%:*}" "${PYTHONPATH%%:*}" >&2
}

if [[ "${BASH_SOURCE[0]}" == "$0" ]]; then
    # Executed, not sourced: do the work and print the exports for `eval`.
    _nb_setup "$@" || exit 1
    printf 'export NIXL_PLUGIN_DIR=%q\nexport LD_LIBRARY_PATH=%q\nexport PYTHONPATH=%q\n' \
        "$NIXL_PLUGIN_DIR" "$LD_LIBRARY_PATH" "$PYTHONPATH"
else
    _nb_setup "$@"
fi
