//! Real process faults between this test and a peer process (this binary
//! re-executed, tests/support/peer.rs), control (direct TCP by default) on 127.0.0.1:
//! - the receiver killed (`kill -9`) mid-transfer: the sender's request
//!   fails within its bound, its arena drains, a new peer is then served;
//! - the sender killed mid-transfer: the receiver aborts the dead sender's
//!   flows, keeps serving another sender, and gets every region back once
//!   it forgets the dead one;
//! - the receiver stopped (SIGSTOP) mid-transfer: the sender's request fails
//!   within its bound; resumed (SIGCONT), nothing outside the destinations
//!   changed, both arenas drain and both directions work again;
//! - control send queue saturated (`control_send_hwm=64`): a burst of
//!   requests to a live peer, then requests to a stopped peer: every request
//!   terminal within its bound, no hang, both sides fine afterwards.
//!
//! Each asserts: every request terminal within its bound, no byte outside
//! the destinations changed, arena bytes conserved, processes alive.
mod support;

use bounce::*;
use faults::*;
use nixl_sys::{ThreadSync, XferOp};
use peer::*;
use std::time::Duration;
use support::*;

const MANY: usize = 4096;
/// 256 KiB chunks in a 4 MiB arena: a 16 MiB transfer is 64 chunks, still
/// running when the fault hits; a flow holds at most 8 regions (2 MiB), so
/// the receiver has room for another sender beside a dead one's quarantine.
const ARENA: u64 = 4 << 20;
const EX: [(&str, &str); 5] = [
    LOOPBACK,
    ("max_chunk_size_bytes", "256KiB"),
    ("arena_size_bytes", "4MiB"),
    ("arena_allocation_granularity_bytes", "64KiB"),
    ("request_timeout_ms", "10000"),
];
/// Liveness: a dead peer is unreachable after peer_liveness_timeout_ms (1 s
/// by default), a stopped one after its heartbeats time out as well (~2.3 s).
/// The request timeout (10 s) must not be what ends these requests.
const FAILURE_BOUND: Duration = Duration::from_secs(6);
const DRAIN_BOUND: Duration = Duration::from_secs(10);

fn len() -> usize {
    blocks_for(MANY) * BLOCK
}

/// The peer process. A no-op unless started by a test below.
#[test]
fn peer_helper() {
    peer_main();
}

/// [`EX`] with the control messages over NIXL notifications: liveness is
/// then the channel's own heartbeats.
const EX_NOTIF: [(&str, &str); 6] = [
    EX[0],
    EX[1],
    EX[2],
    EX[3],
    EX[4],
    ("use_nixl_notifications", "true"),
];

/// [`EX`] with the control messages over ZMQ (the default is the direct
/// TCP channel): liveness is then ZMTP's heartbeats.
const EX_ZMQ: [(&str, &str); 6] = [EX[0], EX[1], EX[2], EX[3], EX[4], ZMQ_CONTROL];

fn spawn(label: &str) -> Peer {
    spawn_with(label, &EX)
}

fn spawn_with(label: &str, ex: &[(&str, &str)]) -> Peer {
    Peer::spawn(label, peer_command(&[], len(), ex, "pf-peer")).unwrap_or_else(|e| panic!("{e}"))
}

/// Loads each other's metadata.
fn pair(me: &Endpoint, p: &mut Peer) {
    assert_eq!(
        me.node.load_md(&p.md).or_fail("load the peer's metadata"),
        p.name
    );
    assert_eq!(
        p.cmd(&format!("PEER {}", hex(&me.node.local_md().or_fail("md")))),
        me.name()
    );
}

/// A counted, byte-exact bounce WRITE from this process into the peer.
fn write_to(me: &mut Endpoint, p: &mut Peer, seed: u64) {
    let (my_seed, peer_seed, plan_seed) = (seed, seed + 1, seed + 2);
    me.buf.fill_pattern(my_seed);
    p.cmd(&format!("FILL {peer_seed}"));
    let s0 = stats(me.name());
    let plan = plan(len(), MANY, plan_seed);
    let req = me
        .node
        .create_xfer(XferOp::Write, &plan, me.buf.addr(), p.addr, &p.name, None)
        .or_fail("create_xfer_req");
    me.node
        .post_and_wait(&req, wait_timeout())
        .or_fail("WRITE to the peer process");
    drop(req);
    p.cmd(&format!(
        "CHECK_WRITE {} {MANY} {plan_seed} {my_seed} {peer_seed} -",
        me.name()
    ));
    assert_sender_bounced(&s0, &stats(me.name()), 1);
}

/// A counted, byte-exact bounce WRITE from the peer into this process.
fn write_from(p: &mut Peer, me: &mut Endpoint, seed: u64) {
    let (peer_seed, plan_seed) = (seed, seed + 2);
    p.cmd(&format!("FILL {peer_seed}"));
    let before = me.buf.as_slice().to_vec();
    let s0 = stats(me.name());
    p.cmd(&format!(
        "WRITE {} {} {MANY} {plan_seed} -",
        me.name(),
        me.buf.addr()
    ));
    plan(len(), MANY, plan_seed)
        .verify(me.buf.as_slice(), &before, &pattern(len(), peer_seed))
        .or_fail("WRITE from the peer process");
    assert!(
        stats(me.name()).since(&s0, "chunks_scattered") > 0,
        "not bounced"
    );
}

/// Waits until the peer's arena holds nothing; returns how long it took.
fn wait_peer_idle(p: &mut Peer) -> Duration {
    let what = format!("the {} peer", p.label);
    wait_idle_of(&what, ARENA, DRAIN_BOUND, || p.stats())
}

#[test]
#[serial_test::serial]
fn receiver_killed_mid_transfer() {
    if !ready("BOUNCE") {
        return;
    }
    let mut me = endpoint("pf-me", &EX, len(), 1, ThreadSync::Default);
    let mut p = spawn("receiver");
    pair(&me, &mut p);
    let s0 = stats(me.name());
    let plan = plan(len(), MANY, 3);
    let req = me
        .node
        .create_xfer(XferOp::Write, &plan, me.buf.addr(), p.addr, &p.name, None)
        .or_fail("create_xfer_req");
    post(&me.node, &req).or_fail("post");
    wait_for(
        Duration::from_secs(10),
        || "no chunk written".into(),
        || stats(me.name()).since(&s0, "chunks_written") > 0,
    );
    let dead = p.name.clone();
    p.kill9();
    let (outcome, failed_in) =
        terminal_within(&me.node, &req, FAILURE_BOUND, "WRITE to a killed receiver");
    drop(req);
    let idle = wait_arena_idle(me.name(), ARENA, DRAIN_BOUND);
    let s1 = stats(me.name());
    eprintln!(
        "receiver killed: {outcome:?} after {failed_in:?}, arena idle after {idle:?}; {}",
        s1.diff(&s0)
    );
    assert!(outcome.is_err(), "a WRITE to a killed receiver succeeded");
    assert!(s1.poisoned.is_none(), "{:?}", s1.poisoned);
    me.node.agent.invalidate_remote_md(&dead).ok();

    // A new peer is served.
    let mut p2 = spawn("second receiver");
    pair(&me, &mut p2);
    write_to(&mut me, &mut p2, 10);
    wait_arena_idle(me.name(), ARENA, DRAIN_BOUND);
    p2.finish();
}

#[test]
#[serial_test::serial]
fn sender_killed_mid_transfer() {
    if !ready("BOUNCE") {
        return;
    }
    let mut me = endpoint("pf-me", &EX, len(), 1, ThreadSync::Default);
    let mut p = spawn("sender");
    pair(&me, &mut p);
    let before = me.buf.as_slice().to_vec();
    let s0 = stats(me.name());
    p.cmd("FILL 5");
    p.cmd(&format!(
        "WRITE_BG {} {} {MANY} 6",
        me.name(),
        me.buf.addr()
    ));
    wait_for(
        Duration::from_secs(10),
        || "nothing scattered".into(),
        || stats(me.name()).since(&s0, "chunks_scattered") > 0,
    );
    let dead = p.name.clone();
    p.kill9();
    // The dead sender's flows are aborted (their regions quarantined: a
    // sender we cannot hear from might still write).
    let aborted = wait_for(
        FAILURE_BOUND,
        || {
            format!(
                "the dead sender's flows are still live: {:?}",
                stats(me.name()).map
            )
        },
        || stats(me.name()).get("arena_flow_bytes") == 0,
    );
    let s1 = stats(me.name());
    eprintln!(
        "sender killed: its flows aborted after {aborted:?}; quarantined {} bytes; {}",
        s1.get("arena_quarantine_bytes"),
        s1.diff(&s0)
    );
    assert!(s1.since(&s0, "peers_unreachable") >= 1);
    assert_arena_conserved(&s1, ARENA);
    outside_destinations_unchanged(me.buf.as_slice(), &before, &plan(len(), MANY, 6))
        .or_fail("after the sender was killed");

    // Another sender is served meanwhile.
    let mut p2 = spawn("second sender");
    pair(&me, &mut p2);
    write_from(&mut p2, &mut me, 20);

    // Forgetting the dead sender gives every region back.
    me.node
        .agent
        .invalidate_remote_md(&dead)
        .unwrap_or_else(|e| panic!("invalidate: {e:?}"));
    let idle = wait_arena_idle(me.name(), ARENA, DRAIN_BOUND);
    eprintln!("arena idle {idle:?} after forgetting the dead sender");
    assert!(stats(me.name()).poisoned.is_none());
    p2.finish();
}

#[test]
#[serial_test::serial]
fn receiver_stopped_then_resumed() {
    receiver_stopped(&EX);
}

/// The same over NIXL notifications: the receiver stops answering the
/// channel's heartbeats, and that (not the request timeout) ends the WRITE.
#[test]
#[serial_test::serial]
fn receiver_stopped_then_resumed_over_notifications() {
    receiver_stopped(&EX_NOTIF);
}

/// The same over ZMQ: the stopped receiver's ZMQ I/O thread answers no
/// ZMTP heartbeat, and that ends the WRITE.
#[test]
#[serial_test::serial]
fn receiver_stopped_then_resumed_over_zmq() {
    receiver_stopped(&EX_ZMQ);
}

fn receiver_stopped(ex: &[(&str, &str)]) {
    if !ready("BOUNCE") {
        return;
    }
    let mut me = endpoint("pf-me", ex, len(), 1, ThreadSync::Default);
    let mut p = spawn_with("receiver", ex);
    pair(&me, &mut p);
    me.buf.fill_pattern(30);
    p.cmd("FILL 31");
    let s0 = stats(me.name());
    let plan = plan(len(), MANY, 32);
    let req = me
        .node
        .create_xfer(XferOp::Write, &plan, me.buf.addr(), p.addr, &p.name, None)
        .or_fail("create_xfer_req");
    post(&me.node, &req).or_fail("post");
    wait_for(
        Duration::from_secs(10),
        || "no chunk written".into(),
        || stats(me.name()).since(&s0, "chunks_written") > 0,
    );
    p.signal(libc::SIGSTOP);
    let (outcome, failed_in) =
        terminal_within(&me.node, &req, FAILURE_BOUND, "WRITE to a stopped receiver");
    drop(req);
    // Still stopped a while: the sender must not depend on it.
    std::thread::sleep(Duration::from_millis(500));
    p.signal(libc::SIGCONT);
    let idle_me = wait_arena_idle(me.name(), ARENA, DRAIN_BOUND);
    let idle_p = wait_peer_idle(&mut p);
    let (s1, ps) = (stats(me.name()), p.stats());
    eprintln!(
        "receiver stopped: {outcome:?} after {failed_in:?}; after SIGCONT arenas idle in {idle_me:?} (sender) / {idle_p:?} (receiver); late DATA dropped at the receiver: {}; {}",
        ps.get("late_data"),
        s1.diff(&s0)
    );
    assert!(outcome.is_err(), "a WRITE to a stopped receiver succeeded");
    assert!(
        s1.since(&s0, "peers_unreachable") >= 1,
        "the request ended, but not because the receiver was found unreachable"
    );
    assert!(s1.poisoned.is_none());
    // Whatever the resumed receiver did with what was in flight, nothing
    // outside the destinations changed.
    p.cmd(&format!("CHECK_OUTSIDE {MANY} 32 31"));
    // Both directions work again.
    write_to(&mut me, &mut p, 40);
    write_from(&mut p, &mut me, 50);
    wait_arena_idle(me.name(), ARENA, DRAIN_BOUND);
    wait_peer_idle(&mut p);
    p.finish();
}

#[test]
#[serial_test::serial]
fn control_high_water_mark_saturated() {
    if !ready("BOUNCE") {
        return;
    }
    // At most HWM control messages queued towards a peer. ZMQ counts a
    // queued message as gone only when its I/O thread reports progress,
    // every HWM / 2 messages and late on a loaded machine, so the limit
    // must leave room for that: at 16 a single transfer (8 chunks in
    // flight) lost DATA on the 2-core CI machine. 3 s request timeout (a
    // dropped WANT is recovered by the request timeout).
    const HWM: usize = 64;
    const BURST: usize = 4 * HWM;
    let ex = [
        LOOPBACK,
        ("max_chunk_size_bytes", "256KiB"),
        ("arena_size_bytes", "4MiB"),
        ("arena_allocation_granularity_bytes", "64KiB"),
        ("request_timeout_ms", "3000"),
    ];
    let mut me = with_failpoints(&format!("control_send_hwm={HWM}"), || {
        endpoint("pf-me", &ex, len(), 1, ThreadSync::Default)
    });
    let mut p = spawn("receiver");
    pair(&me, &mut p);
    write_to(&mut me, &mut p, 60);

    // A burst of requests (the same 1024 blocks each) to a live peer.
    let n = 1024;
    me.buf.fill_pattern(61);
    p.cmd("FILL 62");
    let plan = plan(len(), n, 63);
    let s0 = stats(me.name());
    let (peer_addr, peer_name) = (p.addr, p.name.clone());
    let burst = |me: &Endpoint| -> Vec<nixl_sys::XferRequest> {
        (0..BURST)
            .map(|_| {
                let r = me
                    .node
                    .create_xfer(
                        XferOp::Write,
                        &plan,
                        me.buf.addr(),
                        peer_addr,
                        &peer_name,
                        None,
                    )
                    .or_fail("create_xfer_req");
                post(&me.node, &r).or_fail("post");
                r
            })
            .collect()
    };
    let reqs = burst(&me);
    let bound = Duration::from_secs(3) + FAILURE_BOUND;
    let mut slowest = Duration::ZERO;
    let mut ok = 0;
    for r in &reqs {
        let (o, dt) = terminal_within(&me.node, r, bound, "a request of the burst");
        slowest = slowest.max(dt);
        ok += usize::from(o.is_ok());
    }
    drop(reqs);
    let s1 = stats(me.name());
    eprintln!(
        "burst of {BURST} to a live peer: {ok} succeeded, all terminal within {slowest:?}; {}",
        s1.diff(&s0)
    );
    if ok > 0 {
        // Every request carries the same bytes to the same places.
        p.cmd(&format!("CHECK_WRITE {} {n} 63 61 62 -", me.name()));
    } else {
        p.cmd(&format!("CHECK_OUTSIDE {n} 63 62"));
    }
    wait_arena_idle(me.name(), ARENA, DRAIN_BOUND);
    wait_peer_idle(&mut p);

    // The peer stops reading: once it is found unreachable, BURST more
    // requests fill the queue and fail.
    p.cmd("FILL 64");
    let s2 = stats(me.name());
    p.signal(libc::SIGSTOP);
    let found = wait_for(
        FAILURE_BOUND,
        || "the stopped peer was not found unreachable".into(),
        || stats(me.name()).since(&s2, "peers_unreachable") >= 1,
    );
    let reqs = burst(&me);
    let mut slowest = Duration::ZERO;
    for r in &reqs {
        let (o, dt) = terminal_within(&me.node, r, FAILURE_BOUND, "a request to a stopped peer");
        assert!(o.is_err(), "a WRITE to a stopped peer succeeded");
        slowest = slowest.max(dt);
    }
    drop(reqs);
    let s3 = stats(me.name());
    eprintln!(
        "peer stopped, found unreachable after {found:?}; {BURST} requests failed within {slowest:?}; {}",
        s3.diff(&s2)
    );
    assert!(
        s3.since(&s2, "control_send_drops") > 0,
        "the queue never filled: {}",
        s3.diff(&s2)
    );
    p.signal(libc::SIGCONT);
    wait_arena_idle(me.name(), ARENA, DRAIN_BOUND);
    wait_peer_idle(&mut p);
    p.cmd(&format!("CHECK_OUTSIDE {n} 63 64"));
    write_to(&mut me, &mut p, 70);
    p.finish();
}
