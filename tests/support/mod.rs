//! Test support, one module for every integration test (`mod support;`):
//! runtime discovery with SKIP/FAIL policy, the transfer harness in
//! `harness.rs` (re-exported), and the helpers of the bounce tests
//! (`bounce`, `faults`, `peer` (the child-process peer), `python`,
//! `fake_sender`).
//!
//! Policy: when the NIXL runtime (or the plugin a test needs) is missing, a
//! test prints `SKIP: <reason>` and returns, unless
//! `NIXL_BOUNCE_REQUIRE_RUNTIME=1` is set (scripts/test.sh and CI set it), in
//! which case it fails with that reason.
#![allow(dead_code)]

pub mod bounce;
pub mod fake_sender;
pub mod faults;
pub mod peer;
pub mod python;
pub use nixl_bounce::harness::*;

use std::path::{Path, PathBuf};
use std::sync::OnceLock;

/// Backends every transfer test runs against. BOUNCE is the requirement;
/// UCX validates the harness itself against the stock backend.
pub const BACKENDS: &[&str] = &["BOUNCE", "UCX"];

pub fn repo_root() -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR"))
}

pub fn require_runtime() -> bool {
    matches!(
        std::env::var("NIXL_BOUNCE_REQUIRE_RUNTIME").as_deref(),
        Ok(v) if !v.is_empty() && v != "0"
    )
}

/// Where NIXL looks for plugins: `NIXL_PLUGIN_DIR`, else the wheel's own
/// `plugins/` folder (where scripts/setup.sh installs libplugin_BOUNCE.so).
pub fn plugin_dir() -> Option<PathBuf> {
    if let Ok(d) = std::env::var("NIXL_PLUGIN_DIR") {
        return Some(PathBuf::from(d));
    }
    let d = repo_root().join(".nixl/site/.nixl_cu13.mesonpy.libs/plugins");
    d.is_dir().then_some(d)
}

/// [`nixl_bounce::harness::preload_capi`] with the suites' defaults on
/// (every test and child peer loads NIXL through this).
pub fn preload_capi(repo_root: Option<&Path>) -> Result<PathBuf, String> {
    nixl_bounce::harness::use_suite_defaults();
    nixl_bounce::harness::preload_capi(repo_root)
}

fn capi_status() -> &'static Result<PathBuf, String> {
    static S: OnceLock<Result<PathBuf, String>> = OnceLock::new();
    S.get_or_init(|| preload_capi(Some(&repo_root())))
}

/// Why `backend` cannot run here, or `None` if it can.
pub fn missing(backend: &str) -> Option<String> {
    if let Err(e) = capi_status() {
        return Some(format!("NIXL runtime not available: {e}"));
    }
    let Some(dir) = plugin_dir() else {
        return Some("no plugin directory (NIXL_PLUGIN_DIR unset and .nixl/site missing); run scripts/setup.sh".into());
    };
    let lib = dir.join(format!("libplugin_{backend}.so"));
    if !lib.is_file() {
        return Some(format!(
            "{} not found (build and install the plugin with scripts/setup.sh)",
            lib.display()
        ));
    }
    None
}

/// Gate a test on the runtime. Returns `true` if the test should run;
/// otherwise prints SKIP and returns `false`, or panics when the runtime is
/// required.
pub fn ready(backend: &str) -> bool {
    match missing(backend) {
        None => true,
        Some(reason) if require_runtime() => {
            panic!("NIXL_BOUNCE_REQUIRE_RUNTIME is set but backend {backend} cannot run: {reason}")
        }
        Some(reason) => {
            eprintln!("SKIP: {backend}: {reason}");
            false
        }
    }
}

/// Same as `ready` for tests that only need the NIXL runtime (no particular
/// plugin), e.g. the Python API test's interpreter check.
pub fn runtime_lib_dir() -> Option<&'static Path> {
    capi_status().as_ref().ok().and_then(|p| p.parent())
}

/// `unwrap` with the harness' error message.
pub trait OrFail<T> {
    fn or_fail(self, what: &str) -> T;
}

impl<T, E: std::fmt::Display> OrFail<T> for Result<T, E> {
    #[track_caller]
    fn or_fail(self, what: &str) -> T {
        match self {
            Ok(v) => v,
            Err(e) => panic!("{what}: {e}"),
        }
    }
}

/// Define one `#[test]` per backend in `BACKENDS`, as `bounce::<name>` and
/// `ucx::<name>`, each calling `$body(backend)` after the runtime gate.
/// Usage: `backend_tests! { fn write_one(backend) { ... } }`.
#[macro_export]
macro_rules! backend_tests {
    ($( $(#[$m:meta])* fn $name:ident($b:ident) $body:block )*) => {
        mod cases {
            #[allow(unused_imports)]
            use super::*;
            $(
                $(#[$m])*
                pub fn $name($b: &str) $body
            )*
        }
        mod bounce {
            $(
                #[test]
                #[serial_test::serial]
                fn $name() {
                    if $crate::support::ready("BOUNCE") { super::cases::$name("BOUNCE") }
                }
            )*
        }
        mod ucx {
            $(
                #[test]
                #[serial_test::serial]
                fn $name() {
                    if $crate::support::ready("UCX") { super::cases::$name("UCX") }
                }
            )*
        }
    };
}
