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
mod support;

use python::*;
use support::*;

backend_tests! {
    fn python_vllm_pattern(backend) {
        if !python_usable("nixl_cu13._api, numpy") {
            return;
        }
        let mut cmd = python_cmd();
        cmd.arg(repo_root().join("tests/python/test_vllm_pattern.py"))
            .args(["--backend", backend])
            .env("NIXL_BOUNCE_CONTROL_BIND_LOOPBACK", "1");
        run_passing(
            cmd,
            &format!("tests/python/test_vllm_pattern.py --backend {backend}"),
            &format!("PASS backend={backend}"),
        );
    }
}

/// The same pattern with BOUNCE over the arena (the CMA path off) at 8192
/// descriptors a request (32 layers, 2048 tokens, TP=4), both lists checked
/// (`Engine::check`) and the plan packed (`Engine::plan`) in parts on two
/// threads: every READ byte-exact and every route the arena with its check
/// and its plan in parts.
#[test]
fn python_vllm_pattern_arena_plan_in_parts() {
    if !ready("BOUNCE") || !python_usable("nixl_cu13._api, numpy") {
        return;
    }
    let mut cmd = python_cmd();
    cmd.arg(repo_root().join("tests/python/test_vllm_pattern.py"))
        .args(["--backend", "BOUNCE", "--cases", "tp4-2k", "--layers", "32"])
        .args([
            "--iters",
            "2",
            "--expect-route",
            "bounce/check+plan-in-parts",
        ])
        .env("NIXL_BOUNCE_CONTROL_BIND_LOOPBACK", "1")
        .env("NIXL_BOUNCE_ENABLE_CMA", "0")
        .env("NIXL_BOUNCE_PEER_MAP_PREPARE_THREADS", "2");
    run_passing(
        cmd,
        "tests/python/test_vllm_pattern.py (arena, check and plan in parts)",
        "PASS backend=BOUNCE",
    );
}
