//! The official NIXL Python API from the pinned wheel, selecting
//! `nixl_agent_config(backends=[<backend>])`: runs tests/python/test_api.py
//! (WRITE and READ, 1 and 4096 scattered 4 KiB descriptors, byte-exact,
//! notifications) with python3 and asserts it passed.
//!
//! The script runs with PYTHONPATH and NIXL_PLUGIN_DIR only, and WITHOUT
//! LD_LIBRARY_PATH: that is how the README tells Python users to run, so the
//! plugin must find libnixl_capi.so by itself.
mod common;

use common::*;
use std::io::Read;
use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

fn python() -> String {
    std::env::var("NIXL_BOUNCE_PYTHON").unwrap_or_else(|_| "python3".into())
}

fn site() -> std::path::PathBuf {
    std::env::var("NIXL_BOUNCE_SITE")
        .map(Into::into)
        .unwrap_or_else(|_| repo_root().join(".nixl/site"))
}

fn python_cmd() -> Command {
    let mut c = Command::new(python());
    let site = site();
    let pp = match std::env::var("PYTHONPATH") {
        Ok(p) if !p.is_empty() => format!("{}:{p}", site.display()),
        _ => site.display().to_string(),
    };
    c.env("PYTHONPATH", pp).env_remove("LD_LIBRARY_PATH");
    if let Some(d) = plugin_dir() {
        c.env("NIXL_PLUGIN_DIR", d);
    }
    c
}

/// Is the NIXL Python API importable? Err(reason) if not.
fn python_ready() -> Result<(), String> {
    let out = python_cmd()
        .args(["-c", "import nixl_cu13._api"])
        .output()
        .map_err(|e| format!("cannot run {}: {e}", python()))?;
    if out.status.success() {
        Ok(())
    } else {
        Err(format!(
            "{} cannot import nixl_cu13._api: {}",
            python(),
            String::from_utf8_lossy(&out.stderr)
                .lines()
                .last()
                .unwrap_or("")
        ))
    }
}

/// Run the script with a hard time limit; returns (success, combined output).
fn run_script(backend: &str) -> (bool, String) {
    let script = repo_root().join("tests/python/test_api.py");
    let mut child = python_cmd()
        .arg(&script)
        .args(["--backend", backend])
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .expect("spawn python3");
    let mut so = child.stdout.take().unwrap();
    let mut se = child.stderr.take().unwrap();
    let t_out = std::thread::spawn(move || {
        let mut s = String::new();
        let _ = so.read_to_string(&mut s);
        s
    });
    let t_err = std::thread::spawn(move || {
        let mut s = String::new();
        let _ = se.read_to_string(&mut s);
        s
    });
    let limit = wait_timeout() * 3;
    let t0 = Instant::now();
    let status = loop {
        if let Some(st) = child.try_wait().expect("try_wait") {
            break Some(st);
        }
        if t0.elapsed() > limit {
            let _ = child.kill();
            let _ = child.wait();
            break None;
        }
        std::thread::sleep(Duration::from_millis(20));
    };
    let out = format!(
        "--- stdout ---\n{}--- stderr ---\n{}",
        t_out.join().unwrap_or_default(),
        t_err.join().unwrap_or_default()
    );
    match status {
        Some(st) => (st.success(), out),
        None => (false, format!("killed after {limit:?}\n{out}")),
    }
}

backend_tests! {
    fn python_api_write_read(backend) {
        if let Err(e) = python_ready() {
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
