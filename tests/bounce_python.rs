//! The official NIXL Python API selecting BOUNCE for a bounce-eligible
//! transfer: runs tests/python/test_bounce_path.py (4096 x 4 KiB WRITEs and
//! READs both ways, byte-exact, the plugin's counters read from Python with
//! ctypes through `nixl_bounce_stats` to prove which path carried them) and
//! asserts it passed: with the CMA path off (the bounce arena), and with
//! the defaults (two agents of one process: the CMA path).
//!
//! Like tests/python_api.rs, the script runs with PYTHONPATH and
//! NIXL_PLUGIN_DIR only, WITHOUT LD_LIBRARY_PATH (how Python users run).
//! The control socket binds loopback through the environment
//! (NIXL_BOUNCE_CONTROL_BIND_LOOPBACK=1): the Python API has no per-backend
//! parameter for it.
mod support;

use python::*;
use support::*;

/// Runs the script expecting `path` ("arena" or "cma") to carry every
/// transfer; `cma` says whether the CMA path is left at its default (on)
/// or turned off.
fn expect_path(path: &str, cma: bool) {
    if !ready("BOUNCE") {
        return;
    }
    if !python_usable("nixl_cu13._api, numpy") {
        return;
    }
    let mut cmd = python_cmd();
    cmd.arg(repo_root().join("tests/python/test_bounce_path.py"))
        .env("NIXL_BOUNCE_CONTROL_BIND_LOOPBACK", "1")
        .env("BOUNCE_TEST_PATH", path);
    if cma {
        cmd.env_remove("NIXL_BOUNCE_ENABLE_CMA");
    } else {
        cmd.env("NIXL_BOUNCE_ENABLE_CMA", "0");
    }
    run_passing(
        cmd,
        "tests/python/test_bounce_path.py",
        &format!("PASS backend=BOUNCE {path} path used"),
    );
}

#[test]
#[serial_test::serial]
fn python_api_takes_the_bounce_path() {
    expect_path("arena", false);
}

#[test]
#[serial_test::serial]
fn python_api_takes_the_cma_path_by_default() {
    expect_path("cma", true);
}
