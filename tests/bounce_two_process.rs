//! The bounce path across two processes: this test and a peer process (this
//! test binary re-executed, see tests/support/peer.rs), ZMQ control on
//! 127.0.0.1 (and, in a second test, over NIXL notifications). 4096
//! scattered 4 KiB WRITEs both ways, byte-exact on the receiving side, each
//! checked on both sides' counters (the peer prints its own):
//! - this process -> peer, with and without a notification (the peer
//!   checks its buffer once the notification is there);
//! - peer -> this process (the peer is the initiator: its counters must
//!   show the bounce submission, ours the scatter);
//! - with the CMA path on (its own route gated off): the same, each chunk
//!   written into the peer's arena by cross-memory attach;
//! - a peer that names another host (failpoint `another_host`) on a host
//!   that reaches others over TCP only: the DRAM arena's TCP gate (256
//!   descriptors) takes 512 x 4 KiB, which the same-host gate (1024)
//!   leaves to UCX.
mod support;

use bounce::*;
use nixl_sys::{ThreadSync, XferOp};
use peer::*;
use support::*;

const MANY: usize = 4096;

fn len() -> usize {
    blocks_for(MANY) * BLOCK
}

/// The peer process. A no-op unless started by a test below.
#[test]
fn peer_helper() {
    peer_main();
}

/// Returns the chunk writes both sides made by cross-memory attach.
fn run(extra: &[(&str, &str)], seed: u64) -> u64 {
    let len = len();
    let mut cma_writes = 0;
    let mut p = Peer::spawn("target", peer_command(&[], len, extra, "bp-peer"))
        .unwrap_or_else(|e| panic!("{e}"));
    assert_eq!(p.len, len);
    let mut me = endpoint("bp-me", extra, len, seed, ThreadSync::Default);
    assert_eq!(
        me.node.load_md(&p.md).or_fail("load the peer's metadata"),
        p.name
    );
    let r = p.cmd(&format!("PEER {}", hex(&me.node.local_md().or_fail("md"))));
    assert_eq!(r, me.name());

    // This process -> peer, with and without a notification.
    for (i, notif) in [Some(b"bp-notif".as_slice()), None].into_iter().enumerate() {
        let s = seed * 100 + 10 * i as u64;
        let (my_seed, peer_seed, plan_seed) = (s + 1, s + 2, s + 3);
        me.buf.fill_pattern(my_seed);
        p.cmd(&format!("FILL {peer_seed}"));
        let (before_me, before_peer) = (stats(me.name()), p.stats());
        let plan = plan(len, MANY, plan_seed);
        let req = me
            .node
            .create_xfer(XferOp::Write, &plan, me.buf.addr(), p.addr, &p.name, notif)
            .or_fail("create_xfer_req");
        let dt = me
            .node
            .post_and_wait(&req, wait_timeout())
            .or_fail("WRITE to the peer process");
        drop(req);
        let notif_hex = notif.map(hex).unwrap_or_else(|| "-".into());
        p.cmd(&format!(
            "CHECK_WRITE {} {MANY} {plan_seed} {my_seed} {peer_seed} {notif_hex}",
            me.name()
        ));
        verify_bytes(me.buf.as_slice(), &pattern(len, my_seed), |_| {
            "source".into()
        })
        .or_fail("source changed");
        let (after_me, after_peer) = (stats(me.name()), p.stats());
        eprintln!(
            "{} -> {} ({:?}): {dt:?}; {} ; {}",
            me.name(),
            p.name,
            notif.map(String::from_utf8_lossy),
            after_me.diff(&before_me),
            after_peer.diff(&before_peer)
        );
        assert_sender_bounced(&before_me, &after_me, 1);
        assert_receiver_scattered(
            &before_peer,
            &after_peer,
            after_me.since(&before_me, "chunks_written"),
        );
        cma_writes += after_me.since(&before_me, "chunk_writes_cma");
    }

    // Peer -> this process: the peer initiates.
    for i in 0..2u64 {
        let s = seed * 100 + 50 + 10 * i;
        let (my_seed, peer_seed, plan_seed) = (s + 1, s + 2, s + 3);
        me.buf.fill_pattern(my_seed);
        p.cmd(&format!("FILL {peer_seed}"));
        let (before_me, before_peer) = (stats(me.name()), p.stats());
        let us = p.cmd(&format!(
            "WRITE {} {} {MANY} {plan_seed} -",
            me.name(),
            me.buf.addr()
        ));
        plan(len, MANY, plan_seed)
            .verify(
                me.buf.as_slice(),
                &pattern(len, my_seed),
                &pattern(len, peer_seed),
            )
            .or_fail("WRITE from the peer process");
        me.buf.check_guards().or_fail("guards");
        p.cmd(&format!("CHECK_UNCHANGED {peer_seed}"));
        let (after_me, after_peer) = (stats(me.name()), p.stats());
        eprintln!(
            "{} -> {}: {us} us; {} ; {}",
            p.name,
            me.name(),
            after_peer.diff(&before_peer),
            after_me.diff(&before_me)
        );
        assert_sender_bounced(&before_peer, &after_peer, 1);
        assert_receiver_scattered(
            &before_me,
            &after_me,
            after_peer.since(&before_peer, "chunks_written"),
        );
        cma_writes += after_peer.since(&before_peer, "chunk_writes_cma");
    }
    p.finish();
    cma_writes
}

#[test]
#[serial_test::serial]
fn two_processes_both_ways() {
    if !ready("BOUNCE") {
        return;
    }
    assert_no_cma_writes(run(&[LOOPBACK], 1));
}

/// Host arenas of two processes on one host: every chunk write goes by
/// cross-memory attach when the CMA path is on (here its own route is
/// gated off, so that the transfers take the arena).
#[test]
#[serial_test::serial]
fn two_processes_both_ways_with_chunk_writes_by_cma() {
    if !ready("BOUNCE") {
        return;
    }
    let writes = run(&CMA_CHUNK_WRITES, 3);
    assert!(writes >= 4, "{writes} chunk writes by CMA");
}

#[test]
#[serial_test::serial]
fn two_processes_both_ways_over_nixl_notifications() {
    if !ready("BOUNCE") {
        return;
    }
    run(&[NOTIF_CONTROL, ("max_chunk_size_bytes", "1MiB")], 2);
}

/// 512 x 4 KiB to and from a peer process: over UCX while it is on this
/// host (the same-host gate: 1024 descriptors), over the arena once it
/// names another host and this host reaches others over TCP only (the TCP
/// gate: 256). WRITE and READ.
#[test]
#[serial_test::serial]
fn a_peer_on_another_host_over_tcp_has_the_tcp_gate() {
    if !ready("BOUNCE") {
        return;
    }
    if !nixl_bounce::engine::bounce::tcp_only_host() {
        eprintln!(
            "SKIP: this host has an RDMA device UCX may use (UCX_TLS={:?}): peers on other hosts keep the same-host gate",
            std::env::var("UCX_TLS").ok()
        );
        return;
    }
    const N: usize = 512;
    // A region names its host in its CMA block, which only a CMA path that
    // is on exports; its own route is gated off here.
    let extra = [
        LOOPBACK,
        ("enable_cma", "true"),
        ("cma_min_descriptor_count", "1000000000"),
    ];
    let len = len();
    for (another_host, seed) in [(false, 7u64), (true, 8)] {
        let mut c = peer_command(&[], len, &extra, "tcp-peer");
        if another_host {
            c.env("NIXL_BOUNCE_FAILPOINTS", "another_host");
        }
        let mut p = Peer::spawn("target", c).unwrap_or_else(|e| panic!("{e}"));
        let mut me = endpoint("tcp-me", &extra, len, seed, ThreadSync::Default);
        me.node.load_md(&p.md).or_fail("load the peer's metadata");
        for (i, op) in [XferOp::Write, XferOp::Read].into_iter().enumerate() {
            let s = seed * 100 + 10 * i as u64;
            let (my_seed, peer_seed, plan_seed) = (s + 1, s + 2, s + 3);
            me.buf.fill_pattern(my_seed);
            p.cmd(&format!("FILL {peer_seed}"));
            let before = stats(me.name());
            let plan = plan(len, N, plan_seed);
            let req = me
                .node
                .create_xfer(op, &plan, me.buf.addr(), p.addr, &p.name, None)
                .or_fail("create_xfer_req");
            me.node
                .post_and_wait(&req, wait_timeout())
                .or_fail(&format!("{op:?} with the peer process"));
            drop(req);
            if op == XferOp::Write {
                p.cmd(&format!(
                    "CHECK_WRITE {} {N} {plan_seed} {my_seed} {peer_seed} -",
                    me.name()
                ));
            } else {
                plan.verify(
                    me.buf.as_slice(),
                    &pattern(len, my_seed),
                    &pattern(len, peer_seed),
                )
                .or_fail("READ's destination");
                p.cmd(&format!("CHECK_UNCHANGED {peer_seed}"));
            }
            let after = stats(me.name());
            eprintln!(
                "another host {another_host}, {op:?}: {}",
                after.diff(&before)
            );
            match (another_host, op) {
                (true, XferOp::Write) => assert_sender_bounced(&before, &after, 1),
                (true, _) => assert_reader_bounced(&before, &after, 1),
                (false, _) => {
                    assert_eq!(after.since(&before, "bounce_submitted"), 0);
                    assert_eq!(
                        after.since(&before, "fallback_too_few_descriptors"),
                        1,
                        "{}",
                        after.diff(&before)
                    );
                }
            }
        }
        p.finish();
    }
}
