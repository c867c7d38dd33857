//! The official NIXL Python API selecting BOUNCE for a bounce-eligible
//! transfer: runs tests/python/test_bounce_path.py (4096 x 4 KiB WRITEs both
//! ways and a READ, byte-exact, the plugin's counters read from Python with
//! ctypes through `nixl_bounce_stats` to prove the bounce path carried the
//! WRITEs) and asserts it passed.
//!
//! Like tests/python_api.rs, the script runs with PYTHONPATH and
//! NIXL_PLUGIN_DIR only, WITHOUT LD_LIBRARY_PATH (how Python users run).
//! The control socket binds loopback through the environment
//! (NIXL_BOUNCE_CONTROL_BIND_LOOPBACK=1): the Python API has no per-backend
//! parameter for it.
mod common;

use common::*;
use std::io::Read;
use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

fn python() -> String {
    std::env::var("NIXL_BOUNCE_PYTHON").unwrap_or_else(|_| "python3".into())
}

fn python_cmd() -> Command {
    let mut c = Command::new(python());
    let site = std::env::var("NIXL_BOUNCE_SITE")
        .map(std::path::PathBuf::from)
        .unwrap_or_else(|_| repo_root().join(".nixl/site"));
    let pp = match std::env::var("PYTHONPATH") {
        Ok(p) if !p.is_empty() => format!("{}:{p}", site.display()),
        _ => site.display().to_string(),
    };
    c.env("PYTHONPATH", pp)
        .env_remove("LD_LIBRARY_PATH")
        .env("NIXL_BOUNCE_CONTROL_BIND_LOOPBACK", "1");
    if let Some(d) = plugin_dir() {
        c.env("NIXL_PLUGIN_DIR", d);
    }
    c
}

fn python_ready() -> Result<(), String> {
    let out = python_cmd()
        .args(["-c", "import nixl_cu13._api, numpy"])
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

#[test]
#[serial_test::serial]
fn python_api_takes_the_bounce_path() {
    if !ready("BOUNCE") {
        return;
    }
    if let Err(e) = python_ready() {
        if require_runtime() {
            panic!("NIXL_BOUNCE_REQUIRE_RUNTIME is set but the Python API is unusable: {e}");
        }
        eprintln!("SKIP: {e}");
        return;
    }
    let script = repo_root().join("tests/python/test_bounce_path.py");
    let mut child = python_cmd()
        .arg(&script)
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .expect("spawn python3");
    let (mut so, mut se) = (child.stdout.take().unwrap(), child.stderr.take().unwrap());
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
