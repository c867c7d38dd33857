//! The line protocol between a test or benchmark and the peer process it
//! starts (the tests' BOUNCE peer, `tests/support/peer.rs`; bounce-vram's
//! VRAM target).
//!
//! Commands go down the child's stdin, one per line, words separated by
//! spaces. Replies come up its stdout as lines starting with [`TAG`]; any
//! other output there (libtest's own lines, for a test binary re-executed
//! as the peer) is ignored. The child greets first (its own greeting
//! line, e.g. `HELLO ...`), answers each command with `OK [text]` or
//! `ERR <message>`, and `QUIT` with `BYE`.

use std::io::{BufRead, BufReader, Write};
use std::process::{Child, ChildStdin, Command, ExitStatus, Stdio};
use std::sync::mpsc::{channel, Receiver, RecvTimeoutError};
use std::sync::{Mutex, PoisonError};
use std::time::{Duration, Instant};

/// What marks a reply line on the child's stdout.
pub const TAG: &str = "@@NB ";

/// Writes one reply line (child side). It starts with a newline: the line
/// may follow output that did not end one (libtest's `test x ... `).
pub fn reply(line: &str) {
    let mut out = std::io::stdout().lock();
    // A parent that went away cannot be answered: nothing to do.
    let _ = write!(out, "\n{TAG}{line}\n");
    let _ = out.flush();
}

/// Serves commands from stdin until `QUIT` (answered `BYE`) or its end
/// (child side): `handle` gets each line's words, and its `Ok(text)` is
/// answered `OK text`, its `Err(message)` `ERR message`.
pub fn serve(mut handle: impl FnMut(&[&str]) -> Result<String, String>) {
    for line in std::io::stdin().lock().lines() {
        let Ok(line) = line else { break };
        let words: Vec<&str> = line.split_whitespace().collect();
        if words.first() == Some(&"QUIT") {
            reply("BYE");
            break;
        }
        match handle(&words) {
            Ok(text) if text.is_empty() => reply("OK"),
            Ok(text) => reply(&format!("OK {text}")),
            Err(e) => reply(&format!("ERR {e}")),
        }
    }
}

/// The parent's handle on a child process that speaks the protocol. A
/// child still running when this is dropped is killed (a failed test
/// leaves none behind).
pub struct ChildPeer {
    label: String,
    child: Child,
    stdin: ChildStdin,
    /// Behind a mutex only so that the handle is `Sync` (the tools share
    /// it between threads by reference); taken through `&mut self`.
    lines: Mutex<Receiver<String>>,
    timeout: Duration,
}

impl ChildPeer {
    /// Starts `cmd` (its stderr inherited) and waits for its greeting;
    /// returns the handle and the greeting. `label` names the child in
    /// errors; `timeout` bounds each wait for a reply.
    pub fn spawn(
        label: &str,
        mut cmd: Command,
        timeout: Duration,
    ) -> Result<(ChildPeer, String), String> {
        let mut child = cmd
            .stdin(Stdio::piped())
            .stdout(Stdio::piped())
            .stderr(Stdio::inherit())
            .spawn()
            .map_err(|e| format!("spawning the {label}: {e}"))?;
        let (Some(stdin), Some(stdout)) = (child.stdin.take(), child.stdout.take()) else {
            return Err(format!("the {label}'s stdin and stdout were not piped"));
        };
        let (tx, lines) = channel();
        std::thread::spawn(move || {
            for line in BufReader::new(stdout).lines() {
                let Ok(line) = line else { break };
                if let Some(at) = line.find(TAG) {
                    if tx.send(line[at + TAG.len()..].to_string()).is_err() {
                        break;
                    }
                }
            }
        });
        let mut peer = ChildPeer {
            label: label.to_string(),
            child,
            stdin,
            lines: Mutex::new(lines),
            timeout,
        };
        let greeting = peer.recv("its greeting")?;
        Ok((peer, greeting))
    }

    /// The child's name in errors.
    pub fn label(&self) -> &str {
        &self.label
    }

    /// Its process id.
    pub fn pid(&self) -> u32 {
        self.child.id()
    }

    /// Sends a command without waiting for its reply ([`ChildPeer::recv`]
    /// takes it): several children can then work at once.
    pub fn send(&mut self, line: &str) -> Result<(), String> {
        writeln!(self.stdin, "{line}")
            .and_then(|()| self.stdin.flush())
            .map_err(|e| format!("writing to the {}: {e}", self.label))
    }

    /// The next reply line as sent; an `ERR` reply is an error naming
    /// the child, `what` (the command) and the child's message.
    pub fn recv(&mut self, what: &str) -> Result<String, String> {
        let lines = self.lines.get_mut().unwrap_or_else(PoisonError::into_inner);
        match lines.recv_timeout(self.timeout) {
            Ok(l) if l.starts_with("ERR") => Err(format!("{} failed at {what}: {l}", self.label)),
            Ok(l) => Ok(l),
            Err(RecvTimeoutError::Timeout) => Err(format!(
                "{}: no reply to {what} within {:?}",
                self.label, self.timeout
            )),
            Err(RecvTimeoutError::Disconnected) => {
                let st = self.child.wait().ok();
                Err(format!(
                    "{} exited during {what} (status {st:?})",
                    self.label
                ))
            }
        }
    }

    /// The reply to a command sent: the text after `OK`.
    pub fn ok(&mut self, what: &str) -> Result<String, String> {
        let r = self.recv(what)?;
        match r.strip_prefix("OK") {
            Some(rest) => Ok(rest.trim().to_string()),
            None => Err(format!("{}: unexpected reply to {what}: {r}", self.label)),
        }
    }

    /// Sends a command and returns the text of its `OK` reply.
    pub fn call(&mut self, line: &str) -> Result<String, String> {
        self.send(line)?;
        let what = line.split_whitespace().next().unwrap_or("").to_string();
        self.ok(&what)
    }

    /// Sends `signal` to the child.
    pub fn signal(&self, signal: i32) -> Result<(), String> {
        let pid = libc::pid_t::try_from(self.child.id()).map_err(|e| e.to_string())?;
        // SAFETY: kill(2) on our own child's pid, not yet reaped: this
        // handle holds the Child and waits for it only in quit, kill and
        // drop, which consume or end it.
        let rc = unsafe { libc::kill(pid, signal) };
        if rc != 0 {
            return Err(format!(
                "kill({pid}, {signal}): {}",
                std::io::Error::last_os_error()
            ));
        }
        Ok(())
    }

    /// SIGKILL, then reaps the child: no goodbye of any kind.
    pub fn kill(mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }

    /// `QUIT`, then waits up to `within` for the child to exit (killing it
    /// after that); its exit status.
    pub fn quit(mut self, within: Duration) -> Result<ExitStatus, String> {
        let bye = self.send("QUIT").and_then(|()| self.recv("QUIT"));
        let t0 = Instant::now();
        loop {
            match self.child.try_wait() {
                Ok(Some(st)) => {
                    return match bye {
                        Ok(b) if b == "BYE" => Ok(st),
                        Ok(b) => Err(format!("{}: unexpected reply to QUIT: {b}", self.label)),
                        Err(e) => Err(e),
                    }
                }
                Ok(None) if t0.elapsed() < within => std::thread::sleep(Duration::from_millis(20)),
                Ok(None) => {
                    return Err(format!(
                        "{} did not exit within {within:?} after QUIT",
                        self.label
                    ))
                }
                Err(e) => return Err(format!("waiting for the {}: {e}", self.label)),
            }
        }
    }
}

impl Drop for ChildPeer {
    fn drop(&mut self) {
        if let Ok(None) = self.child.try_wait() {
            let _ = self.child.kill();
            let _ = self.child.wait();
        }
    }
}
