//! The official NIXL Python API from the pinned wheel, selecting
//! `nixl_agent_config(backends=[<backend>])`: runs tests/python/test_api.py
//! (WRITE and READ, 1 and 4096 scattered 4 KiB descriptors, byte-exact,
//! notifications) with python3 and asserts it passed.
//!
//! The script runs with PYTHONPATH and NIXL_PLUGIN_DIR only, and WITHOUT
//! LD_LIBRARY_PATH: that is how the README tells Python users to run, so the
//! plugin must find libnixl_capi.so by itself.
mod common;
#[path = "support/python.rs"]
mod python;

use common::*;
use python::*;

/// Run the script with a hard time limit; returns (success, combined output).
fn run_script(backend: &str) -> (bool, String) {
    let script = repo_root().join("tests/python/test_api.py");
    let mut cmd = python_cmd();
    cmd.arg(&script).args(["--backend", backend]);
    let limit = wait_timeout() * 3;
    match run_with_limit(cmd, limit) {
        (Some(st), out) => (st.success(), out),
        (None, out) => (false, format!("killed after {limit:?}\n{out}")),
    }
}

backend_tests! {
    fn python_api_write_read(backend) {
        if let Err(e) = python_ready("nixl_cu13._api") {
            if require_runtime() {
                panic!("NIXL_BOUNCE_REQUIRE_RUNTIME is set but the Python API is unusable: {e}");
            }
            eprintln!("SKIP: {e}");
            return;
        }
        let (ok, out) = run_script(backend);
        eprintln!("{out}");
        assert!(ok, "tests/python/test_api.py --backend {backend} failed:\n{out}");
        assert!(out.contains(&format!("PASS backend={backend}")), "no PASS line:\n{out}");
    }
}
