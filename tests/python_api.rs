//! The official NIXL Python API from the pinned wheel, selecting
//! `nixl_agent_config(backends=[<backend>])`: runs tests/python/test_api.py
//! (WRITE and READ, 1 and 4096 scattered 4 KiB descriptors, byte-exact,
//! notifications) with python3 and asserts it passed.
//!
//! The script runs with PYTHONPATH and NIXL_PLUGIN_DIR only, and WITHOUT
//! LD_LIBRARY_PATH: that is how the README tells Python users to run, so the
//! plugin must find libnixl_capi.so by itself.
//!
//! It runs once more with NIXL's file telemetry on (`NIXL_TELEMETRY_ENABLE`,
//! `NIXL_TELEMETRY_DIR`), as NIXL's own tests do: BOUNCE must be created and
//! each agent's telemetry file written, as with UCX (BOUNCE's inner agent
//! once collided with the outer agent's file).
mod common;
#[path = "support/python.rs"]
mod python;

use common::*;
use python::*;

/// Run the script with a hard time limit (and NIXL's file telemetry into
/// `telemetry`, if given); returns (success, combined output).
fn run_script(backend: &str, telemetry: Option<&std::path::Path>) -> (bool, String) {
    let script = repo_root().join("tests/python/test_api.py");
    let mut cmd = python_cmd();
    cmd.arg(&script).args(["--backend", backend]);
    if let Some(dir) = telemetry {
        cmd.env("NIXL_TELEMETRY_ENABLE", "y")
            .env("NIXL_TELEMETRY_DIR", dir);
    }
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
        let (ok, out) = run_script(backend, None);
        eprintln!("{out}");
        assert!(ok, "tests/python/test_api.py --backend {backend} failed:\n{out}");
        assert!(out.contains(&format!("PASS backend={backend}")), "no PASS line:\n{out}");
    }

    fn python_api_with_file_telemetry(backend) {
        if let Err(e) = python_ready("nixl_cu13._api") {
            if require_runtime() {
                panic!("NIXL_BOUNCE_REQUIRE_RUNTIME is set but the Python API is unusable: {e}");
            }
            eprintln!("SKIP: {e}");
            return;
        }
        let dir = std::env::temp_dir().join(format!(
            "nixl-bounce-telemetry-{}-{backend}",
            std::process::id()
        ));
        let _ = std::fs::remove_dir_all(&dir);
        std::fs::create_dir_all(&dir).expect("telemetry dir");
        let (ok, out) = run_script(backend, Some(&dir));
        eprintln!("{out}");
        assert!(ok, "test_api.py --backend {backend} with file telemetry failed:\n{out}");
        assert!(out.contains(&format!("PASS backend={backend}")), "no PASS line:\n{out}");
        // One telemetry file per application agent (py-init-<pid>,
        // py-target-<pid>), as UCX writes them.
        let files: Vec<String> = std::fs::read_dir(&dir)
            .expect("read telemetry dir")
            .filter_map(|e| e.ok())
            .map(|e| e.file_name().to_string_lossy().into_owned())
            .collect();
        for who in ["py-init-", "py-target-"] {
            assert!(
                files.iter().any(|f| f.starts_with(who) && !f.ends_with(".bounce")),
                "no telemetry file for the {who}* agent in {dir:?}: {files:?}"
            );
        }
        let _ = std::fs::remove_dir_all(&dir);
    }
}
