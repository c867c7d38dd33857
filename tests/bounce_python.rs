//! The official NIXL Python API selecting BOUNCE for a bounce-eligible
//! transfer: runs tests/python/test_bounce_path.py (4096 x 4 KiB WRITEs and
//! READs both ways, byte-exact, the plugin's counters read from Python with
//! ctypes through `nixl_bounce_stats` to prove the bounce path carried
//! them) and asserts it passed.
//!
//! Like tests/python_api.rs, the script runs with PYTHONPATH and
//! NIXL_PLUGIN_DIR only, WITHOUT LD_LIBRARY_PATH (how Python users run).
//! The control socket binds loopback through the environment
//! (NIXL_BOUNCE_CONTROL_BIND_LOOPBACK=1): the Python API has no per-backend
//! parameter for it.
mod common;
#[path = "support/python.rs"]
mod python;

use common::*;
use python::*;

#[test]
#[serial_test::serial]
fn python_api_takes_the_bounce_path() {
    if !ready("BOUNCE") {
        return;
    }
    if let Err(e) = python_ready("nixl_cu13._api, numpy") {
        if require_runtime() {
            panic!("NIXL_BOUNCE_REQUIRE_RUNTIME is set but the Python API is unusable: {e}");
        }
        eprintln!("SKIP: {e}");
        return;
    }
    let script = repo_root().join("tests/python/test_bounce_path.py");
    let mut cmd = python_cmd();
    cmd.arg(&script)
        .env("NIXL_BOUNCE_CONTROL_BIND_LOOPBACK", "1");
    let limit = wait_timeout() * 3;
    let (status, out) = run_with_limit(cmd, limit);
    eprintln!("{out}");
    match status {
        Some(st) => assert!(
            st.success(),
            "tests/python/test_bounce_path.py failed ({st}):\n{out}"
        ),
        None => panic!("tests/python/test_bounce_path.py killed after {limit:?}:\n{out}"),
    }
    assert!(
        out.contains("PASS backend=BOUNCE bounce path used"),
        "no PASS line:\n{out}"
    );
}
