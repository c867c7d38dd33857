//! A BOUNCE peer in another process, driven over its stdin/stdout (the
//! re-exec pattern of tests/two_process.rs): a test binary re-executes
//! itself (`<exe> --exact peer_helper --nocapture`) with
//! `NIXL_BOUNCE_BP_ROLE=peer`; its `peer_helper` test calls [`peer_main`].
//! It speaks `nixl_bounce::harness::child`'s line protocol. Both sides
//! compute the same seeded plans and patterns, so each side checks its own
//! buffer byte-exact. Its agent's backend is BOUNCE, or the one named by
//! `NIXL_BOUNCE_BP_BACKEND` (then without parameters).
//!
//! Commands (one line each; every reply is `OK ...` or `ERR ...`):
//! - `PEER <md hex>`: load a peer's metadata, reply with its name;
//! - `FILL <seed>`: fill the buffer with the seed's pattern;
//! - `WRITE <peer> <peer addr> <n> <plan seed> <notif hex|->`: a WRITE of
//!   `plan(n, plan seed)` from this buffer into the peer's, waited for;
//!   replies with the elapsed microseconds;
//! - `READ <peer> <peer addr> <n> <plan seed> <notif hex|->`: a READ of
//!   `plan(n, plan seed)` from the peer's buffer into this one, waited for;
//!   replies with the elapsed microseconds (`POST_READ`: posted, not
//!   waited for; replies at once);
//! - `CHECK_WRITE <from> <n> <plan seed> <src seed> <dst seed> <notif hex|->`:
//!   wait for the notification (if any) from `from`, then verify the buffer
//!   (also the check after a READ into this buffer);
//! - `WAIT_NOTIF <from> <notif hex>`;
//! - `SEND_NOTIF <to> <notif hex>`: a notification through the backend;
//! - `CHECK_UNCHANGED <seed>`;
//! - `WRITE_BG <peer> <peer addr> <n> <plan seed>`: post that WRITE and
//!   reply at once, leaving it running (fault tests kill the process then);
//! - `WAIT_BG <ms>`: wait (bounded) until every WRITE_BG request is
//!   terminal; replies `<succeeded> <failed> <elapsed us>`;
//! - `CHECK_OUTSIDE <n> <plan seed> <seed>`: every byte outside the plan's
//!   destinations still holds the seed's pattern;
//! - `FORGET <peer>`: invalidate the peer's metadata;
//! - `STATS`: this agent's BOUNCE counters as one JSON line;
//! - `NETDEV <dev>`: `<rx bytes> <tx bytes>` of a network device as this
//!   process sees it;
//! - `QUIT`.
#![allow(dead_code)]

use super::bounce::*;
use super::*;
use nixl_bounce::harness::child::{self, reply, ChildPeer};
use nixl_sys::{ThreadSync, XferOp, XferStatus};
use std::process::Command;
use std::time::{Duration, Instant};

pub const ROLE_ENV: &str = "NIXL_BOUNCE_BP_ROLE";
/// Backend parameters of the peer, `key=value` separated by `;`.
pub const EXTRA_ENV: &str = "NIXL_BOUNCE_BP_EXTRA";
pub const LEN_ENV: &str = "NIXL_BOUNCE_BP_LEN";
pub const PREFIX_ENV: &str = "NIXL_BOUNCE_BP_PREFIX";
/// Another backend than BOUNCE for the peer's agent.
pub const BACKEND_ENV: &str = "NIXL_BOUNCE_BP_BACKEND";

/// The plan every process computes for (`n`, `seed`) over buffers of `len`.
pub fn plan(len: usize, n: usize, seed: u64) -> Plan {
    let blocks = len / BLOCK;
    Plan::scattered(n, BLOCK, blocks, blocks, seed)
}

pub fn extra_to_env(extra: &[(&str, &str)]) -> String {
    extra
        .iter()
        .map(|(k, v)| format!("{k}={v}"))
        .collect::<Vec<_>>()
        .join(";")
}

fn extra_from_env() -> Vec<(String, String)> {
    std::env::var(EXTRA_ENV)
        .unwrap_or_default()
        .split(';')
        .filter(|s| !s.is_empty())
        .map(|kv| {
            let (k, v) = kv.split_once('=').expect("key=value");
            (k.to_string(), v.to_string())
        })
        .collect()
}

fn netdev(dev: &str) -> Result<String, String> {
    let read = |what: &str| -> Result<u64, String> {
        let p = format!("/sys/class/net/{dev}/statistics/{what}");
        std::fs::read_to_string(&p)
            .map_err(|e| format!("{p}: {e}"))?
            .trim()
            .parse()
            .map_err(|e| format!("{p}: {e}"))
    };
    Ok(format!("{} {}", read("rx_bytes")?, read("tx_bytes")?))
}

/// The child side. A no-op unless started with `NIXL_BOUNCE_BP_ROLE=peer`.
pub fn peer_main() {
    if std::env::var(ROLE_ENV).as_deref() != Ok("peer") {
        return;
    }
    let len: usize = std::env::var(LEN_ENV).expect("len").parse().expect("len");
    let prefix = std::env::var(PREFIX_ENV).unwrap_or_else(|_| "bp".into());
    if let Err(e) = preload_capi(Some(&repo_root())) {
        reply(&format!("ERR runtime: {e}"));
        return;
    }
    let extra_owned = extra_from_env();
    let extra: Vec<(&str, &str)> = extra_owned
        .iter()
        .map(|(k, v)| (k.as_str(), v.as_str()))
        .collect();
    let node = match std::env::var(BACKEND_ENV) {
        Ok(backend) => Node::new(&unique_name(&prefix), &backend, &[]),
        Err(_) => node_with(&unique_name(&prefix), &extra, ThreadSync::Default),
    };
    let node = match node {
        Ok(n) => n,
        Err(e) => {
            reply(&format!("ERR setup: {e}"));
            return;
        }
    };
    let mut buf = DramBuffer::with_pattern(len, 0);
    let reg = match node.register(&buf) {
        Ok(r) => r,
        Err(e) => {
            reply(&format!("ERR register: {e}"));
            return;
        }
    };
    let md = node.local_md().expect("local md");
    // Requests left running by WRITE_BG.
    let mut background = Vec::new();
    reply(&format!(
        "HELLO {} {} {} {}",
        node.name,
        buf.addr(),
        buf.len(),
        hex(&md)
    ));
    child::serve(|w| {
        let num = |i: usize| -> u64 { w[i].parse().expect("number") };
        let notif_arg = |i: usize| -> Result<Option<Vec<u8>>, String> {
            if w[i] == "-" {
                Ok(None)
            } else {
                unhex(w[i]).map(Some)
            }
        };
        match w.first().copied() {
            Some("PEER") => unhex(w[1]).and_then(|m| node.load_md(&m)),
            Some("FILL") => {
                buf.fill_pattern(num(1));
                Ok(String::new())
            }
            Some(cmd @ ("WRITE" | "READ" | "POST_READ")) => (|| {
                let op = if cmd == "WRITE" {
                    XferOp::Write
                } else {
                    XferOp::Read
                };
                let p = plan(len, num(3) as usize, num(4));
                let notif = notif_arg(5)?;
                let req =
                    node.create_xfer(op, &p, buf.addr(), num(2) as usize, w[1], notif.as_deref())?;
                if cmd == "POST_READ" {
                    node.agent
                        .post_xfer_req(&req, None)
                        .map_err(|e| format!("post READ: {e:?}"))?;
                    // Keep it alive: this process is killed while it runs.
                    std::mem::forget(req);
                    return Ok(String::new());
                }
                let dt = node.post_and_wait(&req, wait_timeout())?;
                Ok(dt.as_micros().to_string())
            })(),
            Some("WAIT_NOTIF") => unhex(w[2]).and_then(|m| {
                node.wait_notif(w[1], &m, wait_timeout())
                    .map(|_| String::new())
            }),
            Some("SEND_NOTIF") => unhex(w[2]).and_then(|m| {
                node.agent
                    .send_notification(w[1], &m, Some(&node.backend))
                    .map(|_| String::new())
                    .map_err(|e| format!("send_notification: {e:?}"))
            }),
            Some("CHECK_WRITE") => (|| {
                if let Some(m) = notif_arg(6)? {
                    node.wait_notif(w[1], &m, wait_timeout())?;
                }
                let p = plan(len, num(2) as usize, num(3));
                p.verify(buf.as_slice(), &pattern(len, num(5)), &pattern(len, num(4)))?;
                buf.check_guards()?;
                Ok(String::new())
            })(),
            Some("WRITE_BG") => (|| {
                let p = plan(len, num(3) as usize, num(4));
                let req =
                    node.create_xfer(XferOp::Write, &p, buf.addr(), num(2) as usize, w[1], None)?;
                node.agent
                    .post_xfer_req(&req, None)
                    .map_err(|e| format!("post_xfer_req: {e:?}"))?;
                background.push(req);
                Ok(String::new())
            })(),
            Some("WAIT_BG") => (|| {
                let bound = Duration::from_millis(num(1));
                let t0 = Instant::now();
                let (mut ok, mut failed) = (0, 0);
                for req in background.drain(..) {
                    loop {
                        match node.agent.get_xfer_status(&req) {
                            Ok(XferStatus::Success) => ok += 1,
                            Ok(XferStatus::InProgress) if t0.elapsed() < bound => {
                                std::thread::sleep(Duration::from_millis(1));
                                continue;
                            }
                            Ok(XferStatus::InProgress) => {
                                return Err(format!("a request still runs after {bound:?}"))
                            }
                            Err(_) => failed += 1,
                        }
                        break;
                    }
                }
                Ok(format!("{ok} {failed} {}", t0.elapsed().as_micros()))
            })(),
            Some("CHECK_OUTSIDE") => {
                let p = plan(len, num(1) as usize, num(2));
                let before = pattern(len, num(3));
                let mut inside = vec![false; len];
                for d in &p.dst {
                    inside[*d..*d + p.block].iter_mut().for_each(|b| *b = true);
                }
                match (0..len).find(|&i| !inside[i] && buf.as_slice()[i] != before[i]) {
                    Some(i) => Err(format!("byte {i} outside every destination changed")),
                    None => buf.check_guards().map(|_| String::new()),
                }
            }
            Some("FORGET") => node
                .agent
                .invalidate_remote_md(w[1])
                .map(|_| String::new())
                .map_err(|e| format!("invalidate_remote_md: {e:?}")),
            Some("CHECK_UNCHANGED") => {
                verify_bytes(buf.as_slice(), &pattern(len, num(1)), |_| "source".into())
                    .and_then(|_| buf.check_guards())
                    .map(|_| String::new())
            }
            Some("STATS") => nixl_bounce::stats::plugin_stats(&node.name)
                .map(|s| serde_json::to_string(&s.counters).expect("json")),
            Some("NETDEV") => netdev(w[1]),
            _ => Err(format!("unknown command {:?}", w.join(" "))),
        }
    });
    drop(reg);
}

/// The parent's handle on a peer process.
pub struct Peer {
    pub label: String,
    child: ChildPeer,
    pub name: String,
    pub addr: usize,
    pub len: usize,
    pub md: Vec<u8>,
}

/// The command that re-executes this test binary as a peer.
pub fn peer_command(
    program_prefix: &[&str],
    len: usize,
    extra: &[(&str, &str)],
    prefix: &str,
) -> Command {
    let exe = std::env::current_exe().expect("current_exe");
    let mut c = match program_prefix.split_first() {
        Some((first, rest)) => {
            let mut c = Command::new(first);
            c.args(rest).arg(&exe);
            c
        }
        None => Command::new(&exe),
    };
    c.args(["--exact", "peer_helper", "--nocapture", "--test-threads=1"])
        .env(ROLE_ENV, "peer")
        .env(LEN_ENV, len.to_string())
        .env(EXTRA_ENV, extra_to_env(extra))
        .env(PREFIX_ENV, prefix);
    c
}

impl Peer {
    /// Starts `cmd` (from [`peer_command`]) and waits for its HELLO.
    pub fn spawn(label: &str, cmd: Command) -> Result<Peer, String> {
        let timeout = wait_timeout() + Duration::from_secs(30);
        let (child, hello) = ChildPeer::spawn(&format!("{label} peer"), cmd, timeout)?;
        let w: Vec<&str> = hello.split_whitespace().collect();
        let ["HELLO", name, addr, len, md] = w[..] else {
            return Err(format!("{label} peer: unexpected greeting {hello:?}"));
        };
        Ok(Peer {
            label: label.to_string(),
            child,
            name: name.to_string(),
            addr: addr
                .parse()
                .map_err(|e| format!("{label} peer's address: {e}"))?,
            len: len
                .parse()
                .map_err(|e| format!("{label} peer's length: {e}"))?,
            md: unhex(md)?,
        })
    }

    /// Sends a command; returns the text after `OK `, or panics with the
    /// peer's error.
    #[track_caller]
    pub fn cmd(&mut self, line: &str) -> String {
        self.send(line);
        let what = line.split_whitespace().next().unwrap_or("").to_string();
        self.reply(&what)
    }

    /// Sends a command without waiting for its reply (see [`Peer::reply`]):
    /// several peers can then work at once.
    #[track_caller]
    pub fn send(&mut self, line: &str) {
        self.child.send(line).unwrap_or_else(|e| panic!("{e}"));
    }

    /// The reply to the command sent last (`what` names it in errors).
    #[track_caller]
    pub fn reply(&mut self, what: &str) -> String {
        self.child.ok(what).unwrap_or_else(|e| panic!("{e}"))
    }

    /// Sends `signal` to the peer process.
    #[track_caller]
    pub fn signal(&mut self, signal: i32) {
        self.child.signal(signal).unwrap_or_else(|e| panic!("{e}"));
    }

    /// `kill -9`, then reaps the process.
    pub fn kill9(self) {
        self.child.kill();
    }

    pub fn stats(&mut self) -> Counters {
        let json = self.cmd("STATS");
        counters_from_json(&self.name.clone(), &json)
    }

    /// Kills the peer process (SIGKILL: no goodbye of any kind).
    pub fn kill(self) {
        self.child.kill();
    }

    /// Quits and waits (bounded) for a clean exit.
    #[track_caller]
    pub fn finish(self) {
        let label = self.label;
        match self.child.quit(Duration::from_secs(30)) {
            Ok(st) => assert!(st.success(), "{label} peer exited with {st}"),
            Err(e) => panic!("{e}"),
        }
    }
}
