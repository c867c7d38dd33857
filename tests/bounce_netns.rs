//! Two hosts, simulated: two network namespaces created by this test and
//! joined by a veth pair (10.203.X.1/24 <-> 10.203.X.2/24, X from the pid),
//! one BOUNCE peer process in each (`ip netns exec`, this test binary
//! re-executed, see tests/support/peer.rs). UCX is restricted to TCP over
//! the veth (`UCX_TLS=tcp`, `UCX_NET_DEVICES=<veth>`: no shared memory
//! between the "hosts"), the control channel (direct TCP, the default)
//! binds the veth address
//! (`control_interface=<veth>`). 4096 scattered 4 KiB WRITEs both ways,
//! byte-exact, counted on both sides as bounce transfers; the handshakes
//! must advertise the veth addresses, and the veth's byte counters must
//! show the data crossed it. Everything created is removed by a Drop guard,
//! also on failure.
//!
//! A second test takes the link down mid-transfer (`ip link set <veth>
//! down`): the sender's request must end within its bound (peer liveness:
//! the control channel's beats stop), nothing outside the destinations may
//! change; with the link up again, both arenas drain and fresh transfers
//! both ways are byte-exact.
//!
//! Where namespaces cannot be created for lack of privilege, the test prints
//! `SKIP:` and passes (even with NIXL_BOUNCE_REQUIRE_RUNTIME=1: that is a
//! property of the machine); any other failure to set them up fails under
//! NIXL_BOUNCE_REQUIRE_RUNTIME=1 and skips otherwise.
mod support;

use bounce::*;
use peer::*;
use std::process::Command;
use std::time::Duration;
use support::*;

const MANY: usize = 4096;

/// The peer processes. A no-op unless started by the test below.
#[test]
fn peer_helper() {
    peer_main();
}

/// Why `ip` failed, and whether it is a permission problem.
struct IpError {
    message: String,
    permission: bool,
}

fn ip(args: &[&str]) -> Result<(), IpError> {
    let out = Command::new("ip")
        .args(args)
        .output()
        .map_err(|e| IpError {
            message: format!("cannot run `ip {}`: {e}", args.join(" ")),
            permission: e.kind() == std::io::ErrorKind::PermissionDenied,
        })?;
    if out.status.success() {
        return Ok(());
    }
    let err = String::from_utf8_lossy(&out.stderr).trim().to_string();
    let permission = err.contains("Operation not permitted")
        || err.contains("Permission denied")
        || err.contains("must be root");
    Err(IpError {
        message: format!("`ip {}` failed ({}): {err}", args.join(" "), out.status),
        permission,
    })
}

/// Two namespaces and a veth pair; what was created is removed on drop.
struct Netns {
    ns: [String; 2],
    veth: [String; 2],
    addr: [String; 2],
    /// Namespaces created so far.
    made_ns: Vec<String>,
    /// Whether the veth pair was created.
    made_veth: bool,
}

/// Removes namespaces an earlier run left behind when it was killed
/// (`nbb-<pid>-*` of a process that no longer exists).
fn remove_stale() {
    let Ok(out) = Command::new("ip").args(["netns", "list"]).output() else {
        return;
    };
    for line in String::from_utf8_lossy(&out.stdout).lines() {
        let name = line.split_whitespace().next().unwrap_or("");
        let Some(rest) = name.strip_prefix("nbb-") else {
            continue;
        };
        let Some(pid) = rest.split('-').next().and_then(|p| p.parse::<u32>().ok()) else {
            continue;
        };
        if pid != std::process::id() && !std::path::Path::new(&format!("/proc/{pid}")).exists() {
            eprintln!("removing stale namespace {name} of a dead test run");
            let _ = ip(&["netns", "del", name]);
        }
    }
}

impl Netns {
    fn create() -> Result<Netns, IpError> {
        remove_stale();
        let pid = std::process::id();
        let x = pid % 250 + 1;
        let mut n = Netns {
            ns: [format!("nbb-{pid}-a"), format!("nbb-{pid}-b")],
            // Interface names: at most 15 bytes.
            veth: [format!("nbb{pid}a"), format!("nbb{pid}b")],
            addr: [format!("10.203.{x}.1"), format!("10.203.{x}.2")],
            made_ns: Vec::new(),
            made_veth: false,
        };
        // From here on, Drop cleans up whatever was created.
        let (a, b) = (n.ns[0].clone(), n.ns[1].clone());
        let (va, vb) = (n.veth[0].clone(), n.veth[1].clone());
        for ns in [&a, &b] {
            ip(&["netns", "add", ns])?;
            n.made_ns.push(ns.clone());
        }
        ip(&["link", "add", &va, "type", "veth", "peer", "name", &vb])?;
        n.made_veth = true;
        ip(&["link", "set", &va, "netns", &a])?;
        ip(&["link", "set", &vb, "netns", &b])?;
        for i in 0..2 {
            let (ns, v, addr) = (&n.ns[i], &n.veth[i], &n.addr[i]);
            ip(&["-n", ns, "addr", "add", &format!("{addr}/24"), "dev", v])?;
            ip(&["-n", ns, "link", "set", v, "up"])?;
            ip(&["-n", ns, "link", "set", "lo", "up"])?;
        }
        Ok(n)
    }
}

impl Drop for Netns {
    fn drop(&mut self) {
        for ns in &self.made_ns {
            // Deleting a namespace destroys the veth end inside it (and so
            // the pair).
            match ip(&["netns", "del", ns]) {
                Ok(()) => eprintln!("cleanup: namespace {ns} removed"),
                Err(e) => eprintln!("cleanup: {}", e.message),
            }
        }
        if self.made_veth {
            // In case the pair never left the root namespace (gone already
            // otherwise).
            let _ = ip(&["link", "del", &self.veth[0]]);
        }
    }
}

fn netdev(p: &mut Peer, dev: &str) -> (u64, u64) {
    let r = p.cmd(&format!("NETDEV {dev}"));
    let w: Vec<u64> = r
        .split_whitespace()
        .map(|v| v.parse().expect("bytes"))
        .collect();
    (w[0], w[1])
}

/// The namespaces, or `None` (after printing why) where the machine does
/// not allow them.
fn namespaces() -> Option<Netns> {
    match Netns::create() {
        Ok(n) => Some(n),
        Err(e) if e.permission => {
            eprintln!("SKIP: network namespaces are not permitted on this machine (a permission problem, not a failure): {}", e.message);
            None
        }
        Err(e) if require_runtime() => panic!(
            "NIXL_BOUNCE_REQUIRE_RUNTIME is set and the namespaces could not be set up: {}",
            e.message
        ),
        Err(e) => {
            eprintln!("SKIP: cannot set up the network namespaces: {}", e.message);
            None
        }
    }
}

/// A peer process in namespace `i`, UCX over TCP on its veth only.
fn spawn(net: &Netns, i: usize, label: &str, len: usize) -> Peer {
    let extra = [("control_interface", net.veth[i].as_str())];
    let mut c = peer_command(
        &["ip", "netns", "exec", &net.ns[i]],
        len,
        &extra,
        &format!("nn-{label}"),
    );
    c.env("UCX_TLS", "tcp").env("UCX_NET_DEVICES", &net.veth[i]);
    Peer::spawn(label, c).unwrap_or_else(|e| panic!("{e}"))
}

#[test]
#[serial_test::serial]
fn two_hosts_over_a_veth_pair() {
    if !ready("BOUNCE") {
        return;
    }
    let Some(net) = namespaces() else { return };
    eprintln!(
        "namespaces {:?}, veth {:?}, addresses {:?}",
        net.ns, net.veth, net.addr
    );
    let len = blocks_for(MANY) * BLOCK;
    let mut a = spawn(&net, 0, "host-a", len);
    let mut b = spawn(&net, 1, "host-b", len);

    // The control endpoints are on the veth addresses.
    for (p, addr) in [(&a, &net.addr[0]), (&b, &net.addr[1])] {
        let hs = handshake_of(&p.md);
        let ep = String::from_utf8_lossy(&hs.endpoint).to_string();
        eprintln!("{} advertises control endpoint {ep}", p.name);
        assert!(
            ep.starts_with(&format!("tcp://{addr}:")),
            "{}: control endpoint {ep} is not on {addr}",
            p.name
        );
    }
    let (amd, bmd) = (hex(&a.md), hex(&b.md));
    assert_eq!(a.cmd(&format!("PEER {bmd}")), b.name);
    assert_eq!(b.cmd(&format!("PEER {amd}")), a.name);

    let (a_rx0, a_tx0) = netdev(&mut a, &net.veth[0]);
    let (b_rx0, b_tx0) = netdev(&mut b, &net.veth[1]);
    let steps: [(usize, Option<&[u8]>); 4] = [
        (0, Some(b"netns-a-to-b")),
        (1, None),
        (0, None),
        (1, Some(b"netns-b-to-a")),
    ];
    for (i, (from, notif)) in steps.into_iter().enumerate() {
        let s = 100 * (i as u64 + 1);
        let (src_seed, dst_seed, plan_seed) = (s + 1, s + 2, s + 3);
        let (src, dst) = if from == 0 {
            (&mut a, &mut b)
        } else {
            (&mut b, &mut a)
        };
        src.cmd(&format!("FILL {src_seed}"));
        dst.cmd(&format!("FILL {dst_seed}"));
        let (s0, d0) = (src.stats(), dst.stats());
        let notif_hex = notif.map(hex).unwrap_or_else(|| "-".into());
        let us = src.cmd(&format!(
            "WRITE {} {} {MANY} {plan_seed} {notif_hex}",
            dst.name, dst.addr
        ));
        dst.cmd(&format!(
            "CHECK_WRITE {} {MANY} {plan_seed} {src_seed} {dst_seed} {notif_hex}",
            src.name
        ));
        src.cmd(&format!("CHECK_UNCHANGED {src_seed}"));
        let (s1, d1) = (src.stats(), dst.stats());
        eprintln!(
            "{} -> {}: {us} us; {} ; {}",
            src.name,
            dst.name,
            s1.diff(&s0),
            d1.diff(&d0)
        );
        assert_sender_bounced(&s0, &s1, 1);
        assert_receiver_scattered(&d0, &d1, s1.since(&s0, "chunks_written"));
    }
    let (a_rx1, a_tx1) = netdev(&mut a, &net.veth[0]);
    let (b_rx1, b_tx1) = netdev(&mut b, &net.veth[1]);
    eprintln!(
        "veth bytes: {} tx +{} rx +{}; {} tx +{} rx +{}",
        net.veth[0],
        a_tx1 - a_tx0,
        a_rx1 - a_rx0,
        net.veth[1],
        b_tx1 - b_tx0,
        b_rx1 - b_rx0
    );
    // Two 16 MiB WRITEs each way crossed the veth (UCX used it, not
    // loopback or shared memory).
    let moved = 2 * (MANY * BLOCK) as u64;
    assert!(
        a_tx1 - a_tx0 >= moved,
        "only {} bytes left {} (expected >= {moved})",
        a_tx1 - a_tx0,
        net.veth[0]
    );
    assert!(
        b_tx1 - b_tx0 >= moved,
        "only {} bytes left {} (expected >= {moved})",
        b_tx1 - b_tx0,
        net.veth[1]
    );
    a.finish();
    b.finish();
    drop(net);
}

/// READs between the two hosts: host A reads from host B having loaded only
/// B's metadata (B never loads A's: it learns how to write into A's arena
/// from the READ), then B reads from A; byte-exact, counted on both sides,
/// and the data crossed the veth from the owner to the reader.
#[test]
#[serial_test::serial]
fn two_hosts_read_over_a_veth_pair() {
    if !ready("BOUNCE") {
        return;
    }
    let Some(net) = namespaces() else { return };
    let len = blocks_for(MANY) * BLOCK;
    let mut a = spawn(&net, 0, "host-a", len);
    let mut b = spawn(&net, 1, "host-b", len);
    let (amd, bmd) = (hex(&a.md), hex(&b.md));
    assert_eq!(a.cmd(&format!("PEER {bmd}")), b.name);
    for (i, (reader, notif)) in [(0, Some(b"netns-read")), (1, None), (0, None)]
        .into_iter()
        .enumerate()
    {
        if i == 1 {
            assert_eq!(b.cmd(&format!("PEER {amd}")), a.name);
        }
        let s = 100 * (i as u64 + 1);
        let (src_seed, dst_seed, plan_seed) = (s + 1, s + 2, s + 3);
        let (rd, ow, ow_veth) = if reader == 0 {
            (&mut a, &mut b, &net.veth[1])
        } else {
            (&mut b, &mut a, &net.veth[0])
        };
        ow.cmd(&format!("FILL {src_seed}"));
        rd.cmd(&format!("FILL {dst_seed}"));
        let (r0, o0) = (rd.stats(), ow.stats());
        let (_, tx0) = netdev(ow, ow_veth);
        let notif_hex = notif.map(|m| hex(m)).unwrap_or_else(|| "-".into());
        let us = rd.cmd(&format!(
            "READ {} {} {MANY} {plan_seed} {notif_hex}",
            ow.name, ow.addr
        ));
        if let Some(m) = notif {
            ow.cmd(&format!("WAIT_NOTIF {} {}", rd.name, hex(m)));
        }
        rd.cmd(&format!(
            "CHECK_WRITE - {MANY} {plan_seed} {src_seed} {dst_seed} -"
        ));
        ow.cmd(&format!("CHECK_UNCHANGED {src_seed}"));
        let (r1, o1) = (rd.stats(), ow.stats());
        let (_, tx1) = netdev(ow, ow_veth);
        eprintln!(
            "{} <- {}: {us} us; {} ; {}; owner veth tx +{}",
            rd.name,
            ow.name,
            r1.diff(&r0),
            o1.diff(&o0),
            tx1 - tx0
        );
        assert_eq!(r1.since(&r0, "bounce_submitted"), 1, "{}", r1.diff(&r0));
        assert_eq!(r1.since(&r0, "bounce_succeeded"), 1, "{}", r1.diff(&r0));
        assert_eq!(o1.since(&o0, "reads_served"), 1, "{}", o1.diff(&o0));
        assert_eq!(
            r1.since(&r0, "chunks_scattered"),
            o1.since(&o0, "chunks_written")
        );
        assert!(
            tx1 - tx0 >= (MANY * BLOCK) as u64,
            "only {} bytes left the owner's veth",
            tx1 - tx0
        );
    }
    a.finish();
    b.finish();
    drop(net);
}

#[test]
#[serial_test::serial]
fn link_down_mid_transfer() {
    if !ready("BOUNCE") {
        return;
    }
    let Some(net) = namespaces() else {
        return;
    };
    const ARENA: u64 = 4 << 20;
    let len = blocks_for(MANY) * BLOCK;
    // 64 chunks of 256 KiB; the receiver's scatters take 50 ms each, so the
    // transfer runs for about a second: the link goes down in the middle.
    let spawn = |i: usize, label: &str, failpoints: &str| -> Peer {
        let extra = [
            ("control_interface", net.veth[i].as_str()),
            ("max_chunk_size_bytes", "256KiB"),
            ("arena_size_bytes", "4MiB"),
            ("arena_allocation_granularity_bytes", "64KiB"),
        ];
        let mut c = peer_command(
            &["ip", "netns", "exec", &net.ns[i]],
            len,
            &extra,
            &format!("nd-{label}"),
        );
        c.env("UCX_TLS", "tcp")
            .env("UCX_NET_DEVICES", &net.veth[i])
            .env("NIXL_BOUNCE_FAILPOINTS", failpoints);
        Peer::spawn(label, c).unwrap_or_else(|e| panic!("{e}"))
    };
    let mut a = spawn(0, "host-a", "");
    let mut b = spawn(1, "host-b", "delay_scatter_ms=50");
    let (amd, bmd) = (hex(&a.md), hex(&b.md));
    assert_eq!(a.cmd(&format!("PEER {bmd}")), b.name);
    assert_eq!(b.cmd(&format!("PEER {amd}")), a.name);
    a.cmd("FILL 1");
    b.cmd("FILL 2");
    let a0 = a.stats();
    a.cmd(&format!("WRITE_BG {} {} {MANY} 3", b.name, b.addr));
    faults::wait_for(
        Duration::from_secs(10),
        || "no chunk written".into(),
        || a.stats().since(&a0, "chunks_written") > 0,
    );
    let link = |state: &str| {
        ip(&["-n", &net.ns[0], "link", "set", &net.veth[0], state])
            .unwrap_or_else(|e| panic!("{}", e.message))
    };
    link("down");
    // Terminal within the bound (liveness: heartbeats every 250 ms, a
    // connection silent for 1 s is dropped, a peer without one for 1 s is
    // unreachable); the request timeout (30 s) must not be what ends it.
    let r = a.cmd("WAIT_BG 8000");
    let w: Vec<u64> = r
        .split_whitespace()
        .map(|v| v.parse().expect("number"))
        .collect();
    let failed_in = Duration::from_micros(w[2]);
    eprintln!(
        "link down: {} succeeded, {} failed, terminal after {failed_in:?}",
        w[0], w[1]
    );
    assert_eq!(w[1], 1, "the transfer across a dead link did not fail");
    std::thread::sleep(Duration::from_millis(500));
    link("up");
    // With the link back, writes still in flight end, the CANCEL reaches the
    // receiver, and both arenas drain.
    for p in [&mut a, &mut b] {
        let what = format!("{} (the link came back)", p.name);
        let dt = faults::wait_idle_of(&what, ARENA, Duration::from_secs(20), || p.stats());
        eprintln!("{}: arena idle {dt:?} after the link came back", p.name);
    }
    b.cmd(&format!("CHECK_OUTSIDE {MANY} 3 2"));
    // Fresh transfers both ways, byte-exact.
    for from in 0..2u64 {
        let (src, dst) = if from == 0 {
            (&mut a, &mut b)
        } else {
            (&mut b, &mut a)
        };
        let s = 10 * (from + 1);
        src.cmd(&format!("FILL {}", s + 1));
        dst.cmd(&format!("FILL {}", s + 2));
        let s0 = src.stats();
        src.cmd(&format!(
            "WRITE {} {} {MANY} {} -",
            dst.name,
            dst.addr,
            s + 3
        ));
        dst.cmd(&format!(
            "CHECK_WRITE {} {MANY} {} {} {} -",
            src.name,
            s + 3,
            s + 1,
            s + 2
        ));
        assert_sender_bounced(&s0, &src.stats(), 1);
    }
    a.finish();
    b.finish();
    drop(net);
}
