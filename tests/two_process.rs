//! Two processes: this test (the initiator) re-executes its own test binary
//! as a target peer (`peer_helper`, active only with NIXL_BOUNCE_TP_ROLE set).
//! Metadata and commands travel over the child's stdin/stdout (lines
//! prefixed `@@TP `; everything else on stdout is libtest noise). Both sides
//! compute the same seeded plans and patterns, so each side verifies its own
//! buffer byte-exact: the target after a WRITE, the initiator after a READ.
mod support;

use nixl_sys::XferOp;
use std::io::{BufRead, BufReader, Write};
use std::process::{Child, ChildStdin, Command, Stdio};
use std::sync::mpsc::{channel, Receiver, RecvTimeoutError};
use std::time::{Duration, Instant};
use support::*;

const BLOCK: usize = 4096;
const MANY: usize = 4096;
const ROLE_ENV: &str = "NIXL_BOUNCE_TP_ROLE";
const BACKEND_ENV: &str = "NIXL_BOUNCE_TP_BACKEND";
const LEN_ENV: &str = "NIXL_BOUNCE_TP_LEN";
const TAG: &str = "@@TP ";

fn buf_len() -> usize {
    blocks_for(MANY) * BLOCK
}

fn plan(n: usize, seed: u64) -> Plan {
    let blocks = buf_len() / BLOCK;
    Plan::scattered(n, BLOCK, blocks, blocks, seed)
}

// ---------------------------------------------------------------------------
// Target side (child process)
// ---------------------------------------------------------------------------

/// The target peer. A no-op unless this binary was started by
/// `two_process_transfers` with NIXL_BOUNCE_TP_ROLE=target.
#[test]
fn peer_helper() {
    if std::env::var(ROLE_ENV).as_deref() != Ok("target") {
        return;
    }
    let reply = |s: &str| {
        let mut out = std::io::stdout().lock();
        // Leading newline: libtest may have printed "test peer_helper ... "
        // without one.
        write!(out, "\n{TAG}{s}\n").unwrap();
        out.flush().unwrap();
    };
    let backend = std::env::var(BACKEND_ENV).expect("backend");
    let len: usize = std::env::var(LEN_ENV).expect("len").parse().expect("len");
    if let Err(e) = preload_capi(Some(&repo_root())) {
        reply(&format!("ERR runtime: {e}"));
        return;
    }
    let mut ep = match Endpoint::new("tp-target", &backend, &[], len, 0) {
        Ok(ep) => ep,
        Err(e) => {
            reply(&format!("ERR setup: {e}"));
            return;
        }
    };
    let md = ep.node.local_md().expect("local md");
    reply(&format!(
        "HELLO {} {} {} {}",
        ep.name(),
        ep.buf.addr(),
        ep.buf.len(),
        hex(&md)
    ));
    let mut initiator = String::new();
    let stdin = std::io::stdin();
    for line in stdin.lock().lines() {
        let Ok(line) = line else { break };
        let w: Vec<&str> = line.split_whitespace().collect();
        let num = |i: usize| -> u64 { w[i].parse().expect("number") };
        let res: Result<String, String> = match w.first().copied() {
            Some("PEER") => unhex(w[1])
                .and_then(|m| ep.node.load_md(&m))
                .inspect(|n| initiator = n.clone()),
            Some("FILL") => {
                ep.buf.fill_pattern(num(1));
                Ok(String::new())
            }
            // CHECK_WRITE n plan_seed src_seed dst_seed notif_hex|-
            Some("CHECK_WRITE") => (|| {
                if w[5] != "-" {
                    ep.node
                        .wait_notif(&initiator, &unhex(w[5])?, wait_timeout())?;
                }
                let p = plan(num(1) as usize, num(2));
                p.verify(
                    ep.buf.as_slice(),
                    &pattern(len, num(4)),
                    &pattern(len, num(3)),
                )?;
                ep.buf.check_guards()?;
                Ok(String::new())
            })(),
            Some("CHECK_UNCHANGED") => {
                verify_bytes(ep.buf.as_slice(), &pattern(len, num(1)), |_| {
                    "source of a READ".into()
                })
                .and_then(|_| ep.buf.check_guards())
                .map(|_| String::new())
            }
            Some("WAIT_NOTIF") => unhex(w[1])
                .and_then(|m| ep.node.wait_notif(&initiator, &m, wait_timeout()))
                .map(|_| String::new()),
            Some("SEND_NOTIF") => unhex(w[1]).and_then(|m| {
                ep.node
                    .agent
                    .send_notification(&initiator, &m, Some(&ep.node.backend))
                    .map_err(|e| format!("send_notification: {e:?}"))
                    .map(|_| String::new())
            }),
            Some("QUIT") => {
                reply("BYE");
                break;
            }
            _ => Err(format!("unknown command {line:?}")),
        };
        match res {
            Ok(s) => reply(&format!("OK {s}")),
            Err(e) => reply(&format!("ERR {e}")),
        }
    }
}

// ---------------------------------------------------------------------------
// Initiator side
// ---------------------------------------------------------------------------

struct Peer {
    child: Child,
    stdin: ChildStdin,
    lines: Receiver<String>,
}

impl Peer {
    fn spawn(backend: &str) -> Peer {
        let exe = std::env::current_exe().expect("current_exe");
        let mut child = Command::new(exe)
            .args(["--exact", "peer_helper", "--nocapture", "--test-threads=1"])
            .env(ROLE_ENV, "target")
            .env(BACKEND_ENV, backend)
            .env(LEN_ENV, buf_len().to_string())
            .stdin(Stdio::piped())
            .stdout(Stdio::piped())
            .stderr(Stdio::inherit())
            .spawn()
            .expect("spawn the target peer");
        let stdin = child.stdin.take().unwrap();
        let stdout = child.stdout.take().unwrap();
        let (tx, rx) = channel();
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
        Peer {
            child,
            stdin,
            lines: rx,
        }
    }

    /// Next reply; `ERR ...` becomes a panic with the peer's message.
    fn recv(&mut self, what: &str) -> String {
        let timeout = wait_timeout() + Duration::from_secs(30);
        match self.lines.recv_timeout(timeout) {
            Ok(l) if l.starts_with("ERR") => panic!("target peer failed at {what}: {l}"),
            Ok(l) => l,
            Err(RecvTimeoutError::Timeout) => {
                panic!("target peer: no reply to {what} within {timeout:?}")
            }
            Err(RecvTimeoutError::Disconnected) => {
                let st = self.child.wait().ok();
                panic!("target peer exited during {what} (status {st:?})")
            }
        }
    }

    fn cmd(&mut self, line: &str) -> String {
        writeln!(self.stdin, "{line}").expect("write to the target peer");
        self.stdin.flush().unwrap();
        let what = line.split_whitespace().next().unwrap_or("").to_string();
        let t0 = Instant::now();
        let r = self.recv(&what);
        eprintln!("[two_process] {what}: {:?}", t0.elapsed());
        assert!(
            r.starts_with("OK") || r == "BYE",
            "unexpected reply to {what}: {r}"
        );
        r
    }

    fn finish(mut self) {
        self.cmd("QUIT");
        let t0 = Instant::now();
        loop {
            match self.child.try_wait().expect("try_wait") {
                Some(st) => {
                    assert!(st.success(), "target peer exited with {st}");
                    return;
                }
                None if t0.elapsed() > Duration::from_secs(30) => {
                    panic!("target peer did not exit within 30 s after QUIT")
                }
                None => std::thread::sleep(Duration::from_millis(20)),
            }
        }
    }
}

impl Drop for Peer {
    fn drop(&mut self) {
        // Never leave a child behind (e.g. when an assertion failed).
        if let Ok(None) = self.child.try_wait() {
            let _ = self.child.kill();
            let _ = self.child.wait();
        }
    }
}

backend_tests! {
    fn two_process_transfers(backend) {
        let mut peer = Peer::spawn(backend);
        let hello = peer.recv("HELLO");
        let w: Vec<&str> = hello.split_whitespace().collect();
        assert_eq!(w[0], "HELLO", "{hello}");
        let (tname, taddr, tlen, tmd) = (w[1].to_string(), w[2].parse::<usize>().unwrap(), w[3].parse::<usize>().unwrap(), unhex(w[4]).unwrap());
        assert_eq!(tlen, buf_len());

        let mut me = Endpoint::new("tp-init", backend, &[], buf_len(), 0).or_fail("initiator setup");
        assert_eq!(me.node.load_md(&tmd).or_fail("load target metadata"), tname);
        let r = peer.cmd(&format!("PEER {}", hex(&me.node.local_md().or_fail("local md"))));
        assert_eq!(r, format!("OK {}", me.name()));

        let len = buf_len();
        let steps = [(XferOp::Write, 1usize, false), (XferOp::Write, MANY, true), (XferOp::Read, 1, false), (XferOp::Read, MANY, true)];
        for (i, (op, n, with_notif)) in steps.into_iter().enumerate() {
            let i = i as u64;
            let (my_seed, peer_seed, plan_seed) = (1000 + 2 * i, 1001 + 2 * i, 50 + i);
            let p = plan(n, plan_seed);
            me.buf.fill_pattern(my_seed);
            peer.cmd(&format!("FILL {peer_seed}"));
            let notif = with_notif.then(|| format!("tp-{op:?}-{n}").into_bytes());
            let what = format!("{op:?} {n} x 4 KiB across processes");
            let req = me.node
                .create_xfer(op, &p, me.buf.addr(), taddr, &tname, notif.as_deref())
                .or_fail(&what);
            let dt = me.node.post_and_wait(&req, wait_timeout()).or_fail(&what);
            eprintln!("[two_process] {what}: transfer {dt:?}");
            drop(req);
            let notif_hex = notif.as_deref().map(hex).unwrap_or_else(|| "-".into());
            match op {
                XferOp::Write => {
                    peer.cmd(&format!("CHECK_WRITE {n} {plan_seed} {my_seed} {peer_seed} {notif_hex}"));
                    verify_bytes(me.buf.as_slice(), &pattern(len, my_seed), |_| "WRITE source".into())
                        .or_fail(&format!("{what}: source changed"));
                }
                XferOp::Read => {
                    p.verify(me.buf.as_slice(), &pattern(len, my_seed), &pattern(len, peer_seed)).or_fail(&what);
                    peer.cmd(&format!("CHECK_UNCHANGED {peer_seed}"));
                    if let Some(m) = &notif {
                        peer.cmd(&format!("WAIT_NOTIF {}", hex(m)));
                    }
                }
            }
            me.buf.check_guards().or_fail(&what);
        }

        // Standalone notifications, both directions.
        let msg = b"standalone \x00\xfe notification";
        me.node.agent.send_notification(&tname, msg, Some(&me.node.backend))
            .unwrap_or_else(|e| panic!("send_notification: {e:?}"));
        peer.cmd(&format!("WAIT_NOTIF {}", hex(msg)));
        peer.cmd(&format!("SEND_NOTIF {}", hex(b"from-target")));
        me.node.wait_notif(&tname, b"from-target", wait_timeout()).or_fail("notification from the target");

        peer.finish();
    }
}
