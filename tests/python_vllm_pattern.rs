//! vLLM's NIXL KV-transfer pattern through the official NIXL Python API from
//! the pinned wheel, for each backend: runs tests/python/test_vllm_pattern.py
//! (which runs bench/vllm_pattern.py on DRAM with small shapes): a prefill
//! owner process and a decode reader process, uuid4-named agents, 4 layers
//! registered as 8 K/V regions, one region-major prepared descriptor list per
//! side, `make_prepped_xfer` READs by descriptor ids (1024 descriptors, four
//! such in flight, 64, and 256 x 32 KiB), notifications polled by the owner.
//! Every READ byte-exact, every notification received; asserts it passed.
//!
//! Like tests/python_api.rs, the script runs with PYTHONPATH and
//! NIXL_PLUGIN_DIR only, WITHOUT LD_LIBRARY_PATH (how Python users run). Like
//! tests/bounce_python.rs, the control socket binds loopback through the
//! environment (single-host test).
mod common;
#[path = "support/python.rs"]
mod python;

use common::*;
use python::*;

/// Run the script with a hard time limit; returns (success, combined output).
fn run_script(backend: &str) -> (bool, String) {
    let script = repo_root().join("tests/python/test_vllm_pattern.py");
    let mut cmd = python_cmd();
    cmd.arg(&script)
        .args(["--backend", backend])
        .env("NIXL_BOUNCE_CONTROL_BIND_LOOPBACK", "1");
    let limit = wait_timeout() * 3;
    match run_with_limit(cmd, limit) {
        (Some(st), out) => (st.success(), out),
        (None, out) => (false, format!("killed after {limit:?}\n{out}")),
    }
}

backend_tests! {
    fn python_vllm_pattern(backend) {
        if let Err(e) = python_ready("nixl_cu13._api, numpy") {
            if require_runtime() {
                panic!("NIXL_BOUNCE_REQUIRE_RUNTIME is set but the Python API is unusable: {e}");
            }
            eprintln!("SKIP: {e}");
            return;
        }
        let (ok, out) = run_script(backend);
        eprintln!("{out}");
        assert!(ok, "tests/python/test_vllm_pattern.py --backend {backend} failed:\n{out}");
        assert!(out.contains(&format!("PASS backend={backend}")), "no PASS line:\n{out}");
    }
}
