//! Resources stay flat across connect / forget cycles:
//! - 1000 cycles of two agents loading each other's metadata, one bounce
//!   WRITE (control connections made both ways), and both invalidating;
//! - 100 cycles of a whole agent created, paired, written from, forgotten
//!   and destroyed;
//! - 40 reader agents, each loading one owner, READing from it once and
//!   destroyed, without the owner ever loading them: the owner forgets
//!   each (control connection, data path, the reader's agent in its inner
//!   agent) once it finds it unreachable.
//!
//! Measured after a warm-up and at the end: open file descriptors
//! (/proc/self/fd), threads (/proc/self/task), resident memory, and the
//! arena bytes held (stats). Sockets, monitors, threads and arena regions
//! that outlived their peer would show here.
//!
//! One growth is not ours: NIXL's own UCX backend keeps one loopback TCP
//! connection (two descriptors, both ends in this process) per load /
//! transfer / invalidate cycle, and BOUNCE's inner agent is a UCX agent.
//! (UCX cannot run without TCP here: NIXL asks for peer-failure handling,
//! which the shared-memory transports lack.) So the cycle test first
//! measures that growth with two plain UCX agents; then every descriptor
//! other than a socket must stay flat, sockets may grow only by UCX's share,
//! and the control connections (TCP to or from a control port) are counted
//! directly: flat.
mod support;

use bounce::*;
use faults::*;
use nixl_sys::ThreadSync;
use std::time::{Duration, Instant};
use support::*;

const ARENA: u64 = 1 << 20;
/// Small transfers take the bounce path (64 descriptors).
const EX: [(&str, &str); 5] = [
    LOOPBACK,
    ("max_chunk_size_bytes", "256KiB"),
    ("arena_size_bytes", "1MiB"),
    ("arena_allocation_granularity_bytes", "64KiB"),
    ("min_descriptor_count", "16"),
];
const N: usize = 64;

fn len() -> usize {
    blocks_for(N) * BLOCK
}

fn count_dir(path: &str) -> usize {
    std::fs::read_dir(path).map(|d| d.count()).unwrap_or(0)
}

#[derive(Debug, Clone, Copy)]
struct Resources {
    fds: usize,
    /// Of which sockets.
    sockets: usize,
    threads: usize,
    rss: usize,
}

impl Resources {
    fn now() -> Self {
        let sockets = std::fs::read_dir("/proc/self/fd")
            .into_iter()
            .flatten()
            .flatten()
            .filter(|e| {
                std::fs::read_link(e.path())
                    .is_ok_and(|t| t.to_string_lossy().starts_with("socket:"))
            })
            .count();
        Resources {
            fds: count_dir("/proc/self/fd"),
            sockets,
            threads: count_dir("/proc/self/task"),
            rss: rss_bytes(),
        }
    }
}

/// Asserts the resources at the end are flat against the warm-up.
fn assert_flat(what: &str, warm: Resources, end: Resources) {
    eprintln!("{what}: after warm-up {warm:?}, at the end {end:?}");
    if end.fds > warm.fds + 8 {
        let mut kinds = std::collections::BTreeMap::<String, usize>::new();
        for e in std::fs::read_dir("/proc/self/fd")
            .into_iter()
            .flatten()
            .flatten()
        {
            let t = std::fs::read_link(e.path())
                .map(|p| p.display().to_string())
                .unwrap_or_default();
            let k = t.split(':').next().unwrap_or("").to_string();
            *kinds.entry(k).or_default() += 1;
        }
        eprintln!("{what}: open descriptors by kind: {kinds:?}");
    }
    // Slack for ZMQ closing sockets asynchronously (its reaper thread) and
    // a transfer's threads still winding down.
    assert!(
        end.fds <= warm.fds + 8,
        "{what}: file descriptors grew {} -> {}",
        warm.fds,
        end.fds
    );
    assert!(
        end.threads <= warm.threads + 2,
        "{what}: threads grew {} -> {}",
        warm.threads,
        end.threads
    );
    let grown = end.rss.saturating_sub(warm.rss);
    assert!(
        grown < 48 << 20,
        "{what}: resident memory grew by {} MiB",
        grown >> 20
    );
}

/// One counted bounce WRITE from -> to; byte-exact when `check`.
fn write(from: &mut Endpoint, to: &Endpoint, seed: u64, check: bool) {
    let plan = Plan::standard(N, BLOCK, seed);
    from.buf.fill_pattern(seed);
    let (src, before) = (from.buf.as_slice().to_vec(), to.buf.as_slice().to_vec());
    let s0 = stats(from.name());
    let req = write_request(from, to, &plan);
    from.node
        .post_and_wait(&req, wait_timeout())
        .or_fail(&format!("WRITE #{seed}"));
    drop(req);
    if check {
        plan.verify(to.buf.as_slice(), &before, &src)
            .or_fail(&format!("WRITE #{seed}"));
        assert_sender_bounced(&s0, &stats(from.name()), 1);
    }
}

/// Established TCP connections from or to one of `ports` (this network
/// namespace; the ports are this process's control endpoints).
fn connections_on(ports: &[u16]) -> usize {
    let mut n = 0;
    for table in ["/proc/self/net/tcp", "/proc/self/net/tcp6"] {
        let text = std::fs::read_to_string(table).unwrap_or_default();
        for line in text.lines().skip(1) {
            let f: Vec<&str> = line.split_whitespace().collect();
            let port = |a: &str| {
                a.rsplit(':')
                    .next()
                    .and_then(|p| u16::from_str_radix(p, 16).ok())
            };
            let established = f.get(3) == Some(&"01");
            let ours = [f.get(1), f.get(2)]
                .into_iter()
                .flatten()
                .any(|a| port(a).is_some_and(|p| ports.contains(&p)));
            n += usize::from(established && ours);
        }
    }
    n
}

/// The port of a node's control endpoint (`tcp://127.0.0.1:<port>`).
fn control_port(n: &Node) -> u16 {
    let hs = handshake_of(&n.local_md().or_fail("md"));
    let ep = String::from_utf8_lossy(&hs.endpoint).to_string();
    ep.rsplit(':')
        .next()
        .and_then(|p| p.parse().ok())
        .unwrap_or_else(|| panic!("endpoint {ep}"))
}

/// Descriptors one load / WRITE / invalidate cycle leaves behind with
/// NIXL's plain UCX backend (see the module docs), over `cycles` cycles.
fn ucx_growth_per_cycle(cycles: u64) -> f64 {
    let a = Endpoint::new("cy-ux-a", "UCX", &[], len(), 1).or_fail("UCX agent");
    let b = Endpoint::new("cy-ux-b", "UCX", &[], len(), 2).or_fail("UCX agent");
    let one = || {
        a.node
            .load_md(&b.node.local_md().or_fail("md"))
            .or_fail("load");
        b.node
            .load_md(&a.node.local_md().or_fail("md"))
            .or_fail("load");
        let plan = Plan::standard(N, BLOCK, 1);
        let req = a
            .node
            .create_xfer(
                nixl_sys::XferOp::Write,
                &plan,
                a.buf.addr(),
                b.buf.addr(),
                &b.node.name.clone(),
                None,
            )
            .or_fail("create");
        a.node
            .post_and_wait(&req, wait_timeout())
            .or_fail("UCX WRITE");
        drop(req);
        forget(&a.node, &b.node);
        forget(&b.node, &a.node);
    };
    for _ in 0..10 {
        one();
    }
    std::thread::sleep(Duration::from_millis(100));
    let before = Resources::now().fds;
    for _ in 0..cycles {
        one();
    }
    std::thread::sleep(Duration::from_millis(100));
    (Resources::now().fds.saturating_sub(before)) as f64 / cycles as f64
}

fn forget(a: &Node, b: &Node) {
    a.agent
        .invalidate_remote_md(&b.name)
        .unwrap_or_else(|e| panic!("{} forgets {}: {e:?}", a.name, b.name));
}

#[test]
#[serial_test::serial]
fn a_thousand_connect_forget_cycles() {
    if !ready("BOUNCE") {
        return;
    }
    let ucx = ucx_growth_per_cycle(200);
    let mut a = endpoint("cy-a", &EX, len(), 1, ThreadSync::Default);
    let b = endpoint("cy-b", &EX, len(), 2, ThreadSync::Default);
    let ports = [control_port(&a.node), control_port(&b.node)];
    let t0 = Instant::now();
    let mut warm = None;
    for i in 0..1000u64 {
        if i == 100 {
            std::thread::sleep(Duration::from_millis(200));
            warm = Some((Resources::now(), connections_on(&ports)));
        }
        pair_up(&a.node, &b.node);
        write(&mut a, &b, i, i % 50 == 0);
        forget(&a.node, &b.node);
        forget(&b.node, &a.node);
    }
    let cycles = t0.elapsed();
    wait_arena_idle(a.name(), ARENA, Duration::from_secs(5));
    wait_arena_idle(b.name(), ARENA, Duration::from_secs(5));
    std::thread::sleep(Duration::from_millis(200));
    let (warm, warm_control) = warm.expect("warm-up");
    let (end, end_control) = (Resources::now(), connections_on(&ports));
    eprintln!(
        "1000 cycles in {cycles:?}; control connections {warm_control} -> {end_control}; \
         the UCX backend alone leaves {ucx:.2} descriptors a cycle"
    );
    assert!(
        end_control <= warm_control,
        "control connections grew {warm_control} -> {end_control}"
    );
    // UCX's own growth is sockets only (its TCP connections); everything
    // else (ZMQ's eventfds, pipes, ...) must be flat, and sockets may not
    // grow beyond UCX's own share (900 cycles since the warm-up, 5% slack)
    // for each of BOUNCE's two UCX engines that connect to every peer: the
    // UCX delegate (UCX-routed transfers) and the inner agent (the arena).
    let ucx_sockets = (2.0 * ucx * 900.0 * 1.05).ceil() as usize + 8;
    let grown = end.sockets.saturating_sub(warm.sockets);
    assert!(
        grown <= ucx_sockets,
        "sockets grew by {grown}, more than twice UCX's own ~{:.0}",
        ucx * 900.0
    );
    assert_flat(
        "1000 connect/forget cycles (sockets aside)",
        Resources {
            fds: warm.fds - warm.sockets,
            ..warm
        },
        Resources {
            fds: end.fds - end.sockets,
            ..end
        },
    );
    // Still working.
    pair_up(&a.node, &b.node);
    write(&mut a, &b, 5000, true);
}

#[test]
#[serial_test::serial]
fn a_hundred_agents_created_and_destroyed() {
    if !ready("BOUNCE") {
        return;
    }
    let a = endpoint("cy-srv", &EX, len(), 1, ThreadSync::Default);
    let t0 = Instant::now();
    let mut warm = None;
    for i in 0..100u64 {
        if i == 10 {
            std::thread::sleep(Duration::from_millis(200));
            warm = Some(Resources::now());
        }
        let mut c = endpoint("cy-cli", &EX, len(), 3, ThreadSync::Default);
        pair_up(&a.node, &c.node);
        write(&mut c, &a, i, i % 10 == 0);
        forget(&a.node, &c.node);
        drop(c);
    }
    let cycles = t0.elapsed();
    wait_arena_idle(a.name(), ARENA, Duration::from_secs(5));
    std::thread::sleep(Duration::from_millis(300));
    eprintln!("100 agents in {cycles:?}");
    assert_flat(
        "100 agents created and destroyed",
        warm.expect("warm-up"),
        Resources::now(),
    );
}

/// One counted bounce READ by `reader` from `owner`; byte-exact when
/// `check`.
fn read(reader: &mut Endpoint, owner: &Endpoint, seed: u64, check: bool) {
    let plan = Plan::standard(N, BLOCK, seed);
    let before = reader.buf.as_slice().to_vec();
    let s0 = stats(reader.name());
    let req = read_request(reader, owner, &plan, None);
    reader
        .node
        .post_and_wait(&req, wait_timeout())
        .or_fail(&format!("READ #{seed}"));
    drop(req);
    if check {
        plan.verify(reader.buf.as_slice(), &before, owner.buf.as_slice())
            .or_fail(&format!("READ #{seed}"));
        assert_reader_bounced(&s0, &stats(reader.name()), 1);
    }
}

/// The owner's peers: control connections, readers' data paths, readers'
/// agents loaded in its inner agent, and how many it forgot.
fn owner_peers(owner: &str) -> [u64; 4] {
    let s = stats(owner);
    [
        s.get("control_peers"),
        s.get("reader_data_paths"),
        s.get("reader_agents_loaded"),
        s.get("peers_forgotten"),
    ]
}

/// Waits until the owner forgot `n` readers in all and holds none.
fn wait_readers_forgotten(owner: &str, n: u64) -> Duration {
    wait_for(
        Duration::from_secs(10),
        || format!("{owner} still holds readers: {:?}", owner_peers(owner)),
        || owner_peers(owner) == [0, 0, 0, n],
    )
}

#[test]
#[serial_test::serial]
fn forty_readers_read_once_and_are_destroyed() {
    if !ready("BOUNCE") {
        return;
    }
    const READERS: u64 = 40;
    let owner = endpoint("cy-own", &EX, len(), 1, ThreadSync::Default);
    let t0 = Instant::now();
    let mut warm = None;
    for i in 0..READERS {
        if i == 10 {
            // The first ten forgotten: from here on nothing may grow.
            wait_readers_forgotten(owner.name(), i);
            std::thread::sleep(Duration::from_millis(200));
            warm = Some(Resources::now());
        }
        let mut c = endpoint("cy-rd", &EX, len(), 3 + i, ThreadSync::Default);
        load(&c.node, &owner.node);
        read(&mut c, &owner, i, i % 5 == 0);
        let [control, paths, agents, _] = owner_peers(owner.name());
        assert!(
            control >= 1 && paths >= 1 && agents >= 1,
            "the owner serves a reader it never loaded: {:?}",
            owner_peers(owner.name())
        );
        drop(c);
    }
    let cycles = t0.elapsed();
    // Each reader is found unreachable about one liveness timeout (1 s)
    // after it went, then forgotten.
    let last = wait_readers_forgotten(owner.name(), READERS);
    wait_arena_idle(owner.name(), ARENA, Duration::from_secs(5));
    std::thread::sleep(Duration::from_millis(300));
    let s = stats(owner.name());
    eprintln!(
        "{READERS} readers in {cycles:?}, the last forgotten {last:?} later; owner: \
         peers_unreachable {} peers_forgotten {} reads_served {}",
        s.get("peers_unreachable"),
        s.get("peers_forgotten"),
        s.get("reads_served")
    );
    assert_eq!(s.get("reads_served"), READERS);
    assert!(s.poisoned.is_none(), "{:?}", s.poisoned);
    assert_flat(
        "40 readers created, read once and destroyed",
        warm.expect("warm-up"),
        Resources::now(),
    );
    // A reader again: served as before.
    let mut c = endpoint("cy-rd", &EX, len(), 99, ThreadSync::Default);
    load(&c.node, &owner.node);
    read(&mut c, &owner, 99, true);
}

/// NIXL's UCX backend alone (no BOUNCE), UCX with TCP: 200 load /
/// transfer / invalidate cycles leave ~400 more descriptors (one loopback
/// TCP connection per cycle, both ends in this process).
#[test]
#[ignore = "UPSTREAM: NIXL's UCX backend keeps a TCP connection per load/invalidate cycle; run to see it"]
fn upstream_ucx_backend_keeps_a_tcp_connection_per_cycle() {
    if !ready("UCX") {
        return;
    }
    let a = Endpoint::new("ux-a", "UCX", &[], len(), 1).unwrap();
    let b = Endpoint::new("ux-b", "UCX", &[], len(), 2).unwrap();
    let r0 = Resources::now();
    for i in 0..200u64 {
        a.node.load_md(&b.node.local_md().unwrap()).unwrap();
        b.node.load_md(&a.node.local_md().unwrap()).unwrap();
        let plan = Plan::standard(N, BLOCK, i);
        let req = a
            .node
            .create_xfer(
                nixl_sys::XferOp::Write,
                &plan,
                a.buf.addr(),
                b.buf.addr(),
                &b.node.name.clone(),
                None,
            )
            .unwrap();
        a.node.post_and_wait(&req, wait_timeout()).unwrap();
        drop(req);
        forget(&a.node, &b.node);
        forget(&b.node, &a.node);
    }
    std::thread::sleep(Duration::from_millis(300));
    eprintln!(
        "UCX backend (UCX_TLS={:?}), 200 cycles: {r0:?} -> {:?}",
        std::env::var("UCX_TLS").ok(),
        Resources::now()
    );
}
