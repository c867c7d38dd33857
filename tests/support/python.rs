//! Running the official NIXL Python API (from the project-local wheel) in a
//! child process, with a hard time limit (`support::python`).
#![allow(dead_code)]

use super::*;
use std::io::Read;
use std::process::{Command, ExitStatus, Stdio};
use std::time::{Duration, Instant};

/// The interpreter: `NIXL_BOUNCE_PYTHON`, else `python3`.
pub fn python() -> String {
    std::env::var("NIXL_BOUNCE_PYTHON").unwrap_or_else(|_| "python3".into())
}

/// A `python3` command that imports `nixl_cu13` from the project's
/// `.nixl/site` (or `NIXL_BOUNCE_SITE`), finds the plugins, and gets no
/// `LD_LIBRARY_PATH` (the wheel must find its own libraries).
pub fn python_cmd() -> Command {
    let mut c = Command::new(python());
    let site = std::env::var("NIXL_BOUNCE_SITE")
        .map(std::path::PathBuf::from)
        .unwrap_or_else(|_| repo_root().join(".nixl/site"));
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

/// Whether `import <modules>` works (Err(reason) if not).
pub fn python_ready(modules: &str) -> Result<(), String> {
    let out = python_cmd()
        .args(["-c", &format!("import {modules}")])
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

/// Runs `cmd` to completion or until `limit` (then kills it). Returns its
/// exit status (None when killed) and its stdout and stderr, labelled.
pub fn run_with_limit(mut cmd: Command, limit: Duration) -> (Option<ExitStatus>, String) {
    let mut child = cmd
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
    (status, out)
}

/// Whether `import <modules>` works. When it does not, the test is skipped
/// with the reason printed, or fails if `NIXL_BOUNCE_REQUIRE_RUNTIME` is set.
pub fn python_usable(modules: &str) -> bool {
    match python_ready(modules) {
        Ok(()) => true,
        Err(e) if require_runtime() => {
            panic!("NIXL_BOUNCE_REQUIRE_RUNTIME is set but the Python API is unusable: {e}")
        }
        Err(e) => {
            eprintln!("SKIP: {e}");
            false
        }
    }
}

/// Runs the script `cmd` (`what` names it) within three wait timeouts and
/// asserts that it exited 0 and printed `pass_line`; returns its output.
pub fn run_passing(cmd: Command, what: &str, pass_line: &str) -> String {
    let limit = wait_timeout() * 3;
    let (status, out) = run_with_limit(cmd, limit);
    eprintln!("{out}");
    match status {
        Some(st) => assert!(st.success(), "{what} failed ({st}):\n{out}"),
        None => panic!("{what} killed after {limit:?}:\n{out}"),
    }
    assert!(
        out.contains(pass_line),
        "{what}: no {pass_line:?} line:\n{out}"
    );
    out
}
