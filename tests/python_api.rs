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
mod support;

use python::*;
use support::*;

/// Runs the script for `backend` (with NIXL's file telemetry into
/// `telemetry`, if given) and asserts that it passed.
fn run_script(backend: &str, telemetry: Option<&std::path::Path>) {
    let mut cmd = python_cmd();
    cmd.arg(repo_root().join("tests/python/test_api.py"))
        .args(["--backend", backend]);
    if let Some(dir) = telemetry {
        cmd.env("NIXL_TELEMETRY_ENABLE", "y")
            .env("NIXL_TELEMETRY_DIR", dir);
    }
    let with = if telemetry.is_some() {
        " with file telemetry"
    } else {
        ""
    };
    run_passing(
        cmd,
        &format!("tests/python/test_api.py --backend {backend}{with}"),
        &format!("PASS backend={backend}"),
    );
}

backend_tests! {
    fn python_api_write_read(backend) {
        if python_usable("nixl_cu13._api") {
            run_script(backend, None);
        }
    }

    fn python_api_with_file_telemetry(backend) {
        if !python_usable("nixl_cu13._api") {
            return;
        }
        let dir = std::env::temp_dir().join(format!(
            "nixl-bounce-telemetry-{}-{backend}",
            std::process::id()
        ));
        let _ = std::fs::remove_dir_all(&dir);
        std::fs::create_dir_all(&dir).expect("telemetry dir");
        run_script(backend, Some(&dir));
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
