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
/// leaves none behind), and so is one that did not answer in time: a late
/// reply would otherwise be taken for the next command's, so every call
/// after that fails.
pub struct ChildPeer {
    label: String,
    child: Child,
    /// Why the child was stopped (no reply in time, or its output ended);
    /// every later call fails with it.
    broken: Option<String>,
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
            // Bytes, not text: a line that is not UTF-8 (a library's
            // output) must not end the reading.
            let mut out = BufReader::new(stdout);
            let mut line = Vec::new();
            while matches!(out.read_until(b'\n', &mut line), Ok(n) if n > 0) {
                let text = String::from_utf8_lossy(&line);
                if let Some(at) = text.find(TAG) {
                    let reply = text[at + TAG.len()..].trim_end_matches(['\r', '\n']);
                    if tx.send(reply.to_string()).is_err() {
                        break;
                    }
                }
                line.clear();
            }
        });
        let mut peer = ChildPeer {
            label: label.to_string(),
            child,
            broken: None,
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
        if let Some(why) = &self.broken {
            return Err(why.clone());
        }
        writeln!(self.stdin, "{line}")
            .and_then(|()| self.stdin.flush())
            .map_err(|e| format!("writing to the {}: {e}", self.label))
    }

    /// The next reply line as sent; an `ERR` reply is an error naming
    /// the child, `what` (the command) and the child's message.
    pub fn recv(&mut self, what: &str) -> Result<String, String> {
        if let Some(why) = &self.broken {
            return Err(why.clone());
        }
        let lines = self.lines.get_mut().unwrap_or_else(PoisonError::into_inner);
        let why = match lines.recv_timeout(self.timeout) {
            Ok(l) if l.starts_with("ERR") => {
                return Err(format!("{} failed at {what}: {l}", self.label))
            }
            Ok(l) => return Ok(l),
            Err(RecvTimeoutError::Timeout) => format!(
                "{}: no reply to {what} within {:?}; stopped",
                self.label, self.timeout
            ),
            Err(RecvTimeoutError::Disconnected) => {
                // Its output ended: give it a moment to exit, then stop it.
                let st = self.exit_within(Duration::from_secs(5));
                format!("{} ended its output during {what} (exit: {st})", self.label)
            }
        };
        self.stop();
        self.broken = Some(why.clone());
        Err(why)
    }

    /// Waits up to `within` for the child to exit; its status, or why none.
    fn exit_within(&mut self, within: Duration) -> String {
        let deadline = Instant::now() + within;
        loop {
            match self.child.try_wait() {
                Ok(Some(st)) => return st.to_string(),
                Ok(None) if Instant::now() < deadline => {
                    std::thread::sleep(Duration::from_millis(20))
                }
                Ok(None) => return format!("still running after {within:?}"),
                Err(e) => return format!("waiting for it: {e}"),
            }
        }
    }

    /// SIGKILL unless it exited, then reaps it.
    fn stop(&mut self) {
        if let Ok(None) = self.child.try_wait() {
            let _ = self.child.kill();
        }
        let _ = self.child.wait();
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

    /// Sends `signal` to the child, which must still be running.
    pub fn signal(&mut self, signal: i32) -> Result<(), String> {
        if !matches!(self.child.try_wait(), Ok(None)) {
            return Err(format!("{} is not running", self.label));
        }
        let pid = libc::pid_t::try_from(self.child.id()).map_err(|e| e.to_string())?;
        // SAFETY: kill(2) on our own child's pid, checked just above not to
        // have exited; it is reaped only through this handle (`&mut self`),
        // so the pid cannot have been reused by another process.
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
        self.stop();
    }

    /// `QUIT`; its `BYE` and the child's exit within `within` in all (it is
    /// killed after that); its exit status.
    pub fn quit(mut self, within: Duration) -> Result<ExitStatus, String> {
        self.timeout = self.timeout.min(within);
        let t0 = Instant::now();
        let bye = self.send("QUIT").and_then(|()| self.recv("QUIT"));
        let left = within.saturating_sub(t0.elapsed());
        let exit = self.exit_within(left);
        match self.child.try_wait() {
            Ok(Some(st)) => match bye {
                Ok(b) if b == "BYE" => Ok(st),
                Ok(b) => Err(format!("{}: unexpected reply to QUIT: {b}", self.label)),
                Err(e) => Err(e),
            },
            _ => Err(format!(
                "{} did not exit within {within:?} after QUIT ({exit}); killed",
                self.label
            )),
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

#[cfg(test)]
mod tests {
    use super::*;

    /// A child played by `sh -c script`.
    fn sh(script: &str, timeout: Duration) -> Result<(ChildPeer, String), String> {
        let mut cmd = Command::new("sh");
        cmd.args(["-c", script]);
        ChildPeer::spawn("test child", cmd, timeout)
    }

    #[test]
    fn replies_are_read_past_noise_and_bytes_that_are_not_text() {
        let script = r#"printf 'noise\n\377\376 not utf-8\ntest x ... @@NB HELLO 1\n'
            read cmd; printf '\n@@NB OK got %s\n' "$cmd"
            read cmd; printf '@@NB ERR no such thing\n'
            read cmd; printf '@@NB BYE\n'"#;
        let (mut c, hello) = sh(script, Duration::from_secs(10)).unwrap();
        assert_eq!(hello, "HELLO 1");
        assert_eq!(c.call("PING").unwrap(), "got PING");
        let err = c.call("FROB").unwrap_err();
        assert!(
            err.contains("test child failed at FROB: ERR no such thing"),
            "{err}"
        );
        assert!(c.quit(Duration::from_secs(10)).unwrap().success());
    }

    #[test]
    fn a_child_that_does_not_answer_in_time_is_stopped_for_good() {
        let script = "printf '@@NB HELLO\\n'; read cmd; sleep 30; printf '@@NB OK late\\n'";
        let (mut c, _) = sh(script, Duration::from_millis(300)).unwrap();
        let t0 = Instant::now();
        let err = c.call("SLOW").unwrap_err();
        assert!(err.contains("no reply to SLOW"), "{err}");
        assert!(t0.elapsed() < Duration::from_secs(10));
        // Its late reply can never be taken for another command's.
        let again = c.call("NEXT").unwrap_err();
        assert_eq!(again, err);
        assert!(c.signal(libc::SIGTERM).is_err(), "stopped and reaped");
    }

    #[test]
    fn quit_is_bounded_in_all() {
        let script = "printf '@@NB HELLO\\n'; read cmd; sleep 30";
        let (c, _) = sh(script, Duration::from_secs(60)).unwrap();
        let t0 = Instant::now();
        let err = c.quit(Duration::from_millis(500)).unwrap_err();
        assert!(t0.elapsed() < Duration::from_secs(5), "{:?}", t0.elapsed());
        assert!(err.contains("QUIT"), "{err}");
    }

    #[test]
    fn a_child_whose_output_ends_is_an_error_not_a_hang() {
        let script = "printf '@@NB HELLO\\n'; exec 1>&-; sleep 30";
        let (mut c, _) = sh(script, Duration::from_secs(60)).unwrap();
        let t0 = Instant::now();
        let err = c.call("ANY").unwrap_err();
        assert!(err.contains("ended its output"), "{err}");
        assert!(t0.elapsed() < Duration::from_secs(15));
    }
}
