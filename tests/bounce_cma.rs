//! The CMA path: DRAM peers on one host copy straight between their
//! buffers (cross-memory attach between two processes, a memory copy
//! between two agents of one process), with no arena. Every transfer is
//! byte-exact, and the initiator's counters show that the CMA path carried
//! it and the bounce arena did not:
//! - two agents of one process: 4096 scattered 4 KiB WRITEs and READs, the
//!   target checking its buffer the moment the WRITE's notification shows up;
//! - two processes (this test binary re-executed, tests/support/peer.rs):
//!   WRITE and READ both ways, with notifications;
//! - the gate: fewer than 64 descriptors go to UCX (64, copied in the post
//!   itself, do not); between two processes 32 KiB blocks take the CMA
//!   path, and go to UCX under `cma_max_average_descriptor_size_bytes=8KiB`;
//! - a released copy stops and its memory can be deregistered; the next
//!   transfer works.
//!
//! The rest of the suite runs with the CMA path off (tests/support's
//! `backend_params`): its two agents share one host too, and it is about
//! the bounce arena.
mod support;

use bounce::*;
use nixl_sys::{ThreadSync, XferOp};
use peer::*;
use std::time::Duration;
use support::*;

const MANY: usize = 4096;
const CMA_ON: (&str, &str) = ("enable_cma", "true");

fn len() -> usize {
    blocks_for(MANY) * BLOCK
}

/// The peer process. A no-op unless started by a test below.
#[test]
fn peer_helper() {
    peer_main();
}

/// The initiator's counters show `n` more transfers carried by the CMA
/// path, all succeeded, none on the bounce arena and none sent to UCX.
#[track_caller]
fn assert_cma(before: &Counters, after: &Counters, n: u64) {
    let d = after.diff(before);
    assert_eq!(
        after.since(before, "cma_submitted"),
        n,
        "cma_submitted; {d}"
    );
    assert_eq!(
        after.since(before, "cma_succeeded"),
        n,
        "cma_succeeded; {d}"
    );
    assert_eq!(after.since(before, "cma_failed"), 0, "cma_failed; {d}");
    assert_eq!(
        after.since(before, "bounce_submitted"),
        0,
        "bounce_submitted; {d}"
    );
    for f in after.map.keys().filter(|k| k.starts_with("fallback_")) {
        assert_eq!(after.since(before, f), 0, "{f} rose: {d}");
    }
}

#[test]
#[serial_test::serial]
fn one_process_writes_and_reads_by_memory_copy() {
    if !ready("BOUNCE") {
        return;
    }
    let ex = [LOOPBACK, CMA_ON];
    let mut a = endpoint("cma-a", &ex, len(), 1, ThreadSync::Default);
    let mut b = endpoint("cma-b", &ex, len(), 2, ThreadSync::Default);
    pair_up(&a.node, &b.node);
    for (i, op) in [XferOp::Write, XferOp::Read, XferOp::Write, XferOp::Read]
        .into_iter()
        .enumerate()
    {
        let s = 10 * i as u64;
        a.buf.fill_pattern(s + 1);
        b.buf.fill_pattern(s + 2);
        let (a_before, b_before) = (a.buf.as_slice().to_vec(), b.buf.as_slice().to_vec());
        let plan = Plan::standard(MANY, BLOCK, s + 3);
        let notif = format!("cma-{i}");
        let before = stats(a.name());
        let req = a
            .node
            .create_xfer(
                op,
                &plan,
                a.buf.addr(),
                b.buf.addr(),
                &b.node.name.clone(),
                Some(notif.as_bytes()),
            )
            .or_fail("create_xfer_req");
        a.node
            .post_and_wait(&req, wait_timeout())
            .or_fail("transfer");
        drop(req);
        match op {
            XferOp::Write => {
                // The notification means the bytes are there.
                b.node
                    .wait_notif(a.name(), notif.as_bytes(), wait_timeout())
                    .or_fail("notification");
                plan.verify(b.buf.as_slice(), &b_before, &a_before)
                    .or_fail("WRITE's destination");
                verify_bytes(a.buf.as_slice(), &a_before, |_| "source".into())
                    .or_fail("source changed");
            }
            XferOp::Read => {
                b.node
                    .wait_notif(a.name(), notif.as_bytes(), wait_timeout())
                    .or_fail("notification");
                plan.verify(a.buf.as_slice(), &a_before, &b_before)
                    .or_fail("READ's destination");
                verify_bytes(b.buf.as_slice(), &b_before, |_| "source".into())
                    .or_fail("source changed");
            }
        }
        a.buf.check_guards().or_fail("guards");
        b.buf.check_guards().or_fail("guards");
        let after = stats(a.name());
        eprintln!("{op:?}: {}", after.diff(&before));
        assert_cma(&before, &after, 1);
    }
}

#[test]
#[serial_test::serial]
fn two_processes_write_and_read_both_ways() {
    if !ready("BOUNCE") {
        return;
    }
    let ex = [LOOPBACK, CMA_ON];
    let len = len();
    let mut p = Peer::spawn("cma-target", peer_command(&[], len, &ex, "cma-peer"))
        .unwrap_or_else(|e| panic!("{e}"));
    let mut me = endpoint("cma-me", &ex, len, 5, ThreadSync::Default);
    assert_eq!(
        me.node.load_md(&p.md).or_fail("load the peer's metadata"),
        p.name
    );
    let r = p.cmd(&format!("PEER {}", hex(&me.node.local_md().or_fail("md"))));
    assert_eq!(r, me.name());

    // This process initiates: a WRITE (the peer checks its buffer at the
    // notification) and a READ (the peer waits for its notification).
    for (i, op) in [XferOp::Write, XferOp::Read].into_iter().enumerate() {
        let s = 100 + 10 * i as u64;
        let (my_seed, peer_seed, plan_seed) = (s + 1, s + 2, s + 3);
        me.buf.fill_pattern(my_seed);
        p.cmd(&format!("FILL {peer_seed}"));
        let before = stats(me.name());
        let plan = plan(len, MANY, plan_seed);
        let notif = format!("cma-2p-{i}");
        let req = me
            .node
            .create_xfer(
                op,
                &plan,
                me.buf.addr(),
                p.addr,
                &p.name,
                Some(notif.as_bytes()),
            )
            .or_fail("create_xfer_req");
        me.node
            .post_and_wait(&req, wait_timeout())
            .or_fail("transfer with the peer process");
        drop(req);
        let notif_hex = hex(notif.as_bytes());
        match op {
            XferOp::Write => {
                p.cmd(&format!(
                    "CHECK_WRITE {} {MANY} {plan_seed} {my_seed} {peer_seed} {notif_hex}",
                    me.name()
                ));
                verify_bytes(me.buf.as_slice(), &pattern(len, my_seed), |_| {
                    "source".into()
                })
                .or_fail("source changed");
            }
            XferOp::Read => {
                p.cmd(&format!("WAIT_NOTIF {} {notif_hex}", me.name()));
                plan.verify(
                    me.buf.as_slice(),
                    &pattern(len, my_seed),
                    &pattern(len, peer_seed),
                )
                .or_fail("READ's destination");
                p.cmd(&format!("CHECK_UNCHANGED {peer_seed}"));
            }
        }
        me.buf.check_guards().or_fail("guards");
        let after = stats(me.name());
        eprintln!("{op:?} -> peer: {}", after.diff(&before));
        assert_cma(&before, &after, 1);
    }

    // Large blocks between two processes are the CMA path's too (by
    // default there is no average-size limit); with
    // `cma_max_average_descriptor_size_bytes` set, a READ of blocks above
    // it goes to UCX. Both byte-exact.
    let big_block = 32 * KIB;
    let blocks = len / big_block;
    let limited = [
        LOOPBACK,
        CMA_ON,
        ("cma_max_average_descriptor_size_bytes", "8KiB"),
    ];
    let mut lim = endpoint("cma-me-8k", &limited, len, 6, ThreadSync::Default);
    assert_eq!(
        lim.node.load_md(&p.md).or_fail("load the peer's metadata"),
        p.name
    );
    for (i, who) in [&mut me, &mut lim].into_iter().enumerate() {
        let s = 300 + 10 * i as u64;
        let (my_seed, peer_seed) = (s + 1, s + 2);
        who.buf.fill_pattern(my_seed);
        p.cmd(&format!("FILL {peer_seed}"));
        let wide = Plan::scattered(blocks / 2, big_block, blocks, blocks, s + 3);
        let before = stats(who.name());
        let req = who
            .node
            .create_xfer(XferOp::Read, &wide, who.buf.addr(), p.addr, &p.name, None)
            .or_fail("create_xfer_req");
        who.node
            .post_and_wait(&req, wait_timeout())
            .or_fail("READ of 32 KiB blocks");
        drop(req);
        wide.verify(
            who.buf.as_slice(),
            &pattern(len, my_seed),
            &pattern(len, peer_seed),
        )
        .or_fail("READ of 32 KiB blocks");
        let after = stats(who.name());
        if i == 0 {
            assert_cma(&before, &after, 1);
            continue;
        }
        assert_eq!(
            after.since(&before, "cma_submitted"),
            0,
            "{}",
            after.diff(&before)
        );
        // (The arena's gate then says why it is UCX's: 256 descriptors are
        // too few for it.)
        assert_fell_back_any(
            &before,
            &after,
            1,
            &[
                "fallback_too_few_descriptors",
                "fallback_descriptors_too_large",
            ],
        );
    }
    drop(lim);

    // The peer initiates: a WRITE into this process, then a READ from it.
    for (i, verb) in ["WRITE", "READ"].into_iter().enumerate() {
        let s = 200 + 10 * i as u64;
        let (my_seed, peer_seed, plan_seed) = (s + 1, s + 2, s + 3);
        me.buf.fill_pattern(my_seed);
        p.cmd(&format!("FILL {peer_seed}"));
        let before = p.stats();
        p.cmd(&format!(
            "{verb} {} {} {MANY} {plan_seed} -",
            me.name(),
            me.buf.addr()
        ));
        if verb == "WRITE" {
            plan(len, MANY, plan_seed)
                .verify(
                    me.buf.as_slice(),
                    &pattern(len, my_seed),
                    &pattern(len, peer_seed),
                )
                .or_fail("WRITE from the peer process");
            p.cmd(&format!("CHECK_UNCHANGED {peer_seed}"));
        } else {
            p.cmd(&format!(
                "CHECK_WRITE {} {MANY} {plan_seed} {my_seed} {peer_seed} -",
                me.name()
            ));
            verify_bytes(me.buf.as_slice(), &pattern(len, my_seed), |_| {
                "source".into()
            })
            .or_fail("the READ's source changed");
        }
        me.buf.check_guards().or_fail("guards");
        let after = p.stats();
        eprintln!("peer {verb}: {}", after.diff(&before));
        assert_cma(&before, &after, 1);
    }
    p.finish();
}

#[test]
#[serial_test::serial]
fn the_gate_holds_and_a_released_copy_lets_go() {
    if !ready("BOUNCE") {
        return;
    }
    let ex = [LOOPBACK, CMA_ON];
    let n = 16_384;
    let len = blocks_for(n) * BLOCK;
    let mut a = endpoint("cma-gate-a", &ex, len, 7, ThreadSync::Default);
    let b = endpoint("cma-gate-b", &ex, len, 8, ThreadSync::Default);
    pair_up(&a.node, &b.node);

    // 32 descriptors: under cma_min_descriptor_count (64), UCX's.
    let small = Plan::standard(32, BLOCK, 9);
    let before = stats(a.name());
    let req = write_request(&a, &b, &small);
    a.node
        .post_and_wait(&req, wait_timeout())
        .or_fail("small WRITE");
    drop(req);
    let after = stats(a.name());
    assert_eq!(
        after.since(&before, "cma_submitted"),
        0,
        "{}",
        after.diff(&before)
    );
    assert_eq!(
        after.since(&before, "fallback_too_few_descriptors"),
        1,
        "{}",
        after.diff(&before)
    );

    // 64 descriptors (256 KiB): copied in the post itself, which NIXL
    // sees complete at once; the notification is there when it returns.
    let inline = Plan::standard(64, BLOCK, 12);
    let (a_before, b_before) = (a.buf.as_slice().to_vec(), b.buf.as_slice().to_vec());
    let before = stats(a.name());
    let req = a
        .node
        .create_xfer(
            XferOp::Write,
            &inline,
            a.buf.addr(),
            b.buf.addr(),
            &b.node.name.clone(),
            Some(b"cma-inline"),
        )
        .or_fail("create_xfer_req");
    a.node
        .post_and_wait(&req, wait_timeout())
        .or_fail("WRITE of 64 descriptors");
    drop(req);
    b.node
        .wait_notif(a.name(), b"cma-inline", wait_timeout())
        .or_fail("notification");
    inline
        .verify(b.buf.as_slice(), &b_before, &a_before)
        .or_fail("WRITE of 64 descriptors");
    assert_cma(&before, &stats(a.name()), 1);

    // Within one process no size limit: 32 KiB blocks take the path too.
    let wide = Plan::scattered(256, 32 * KIB, len / (32 * KIB), len / (32 * KIB), 11);
    let (a_before, b_before) = (a.buf.as_slice().to_vec(), b.buf.as_slice().to_vec());
    let before = stats(a.name());
    let req = write_request(&a, &b, &wide);
    a.node
        .post_and_wait(&req, wait_timeout())
        .or_fail("WRITE of 32 KiB blocks");
    drop(req);
    wide.verify(b.buf.as_slice(), &b_before, &a_before)
        .or_fail("WRITE of 32 KiB blocks");
    assert_cma(&before, &stats(a.name()), 1);

    // A 64 MiB READ released at once: it stops (or ends) on its own, and
    // the memory it copies into can be deregistered after it.
    let big = Plan::standard(n, BLOCK, 10);
    let req = read_request(&a, &b, &big, None);
    post(&a.node, &req).or_fail("post the large READ");
    drop(req);
    drop(a.reg.take());
    // Once deregistered, nothing writes into the memory any more: it could
    // be freed here.
    let settled = a.buf.as_slice().to_vec();
    std::thread::sleep(Duration::from_millis(100));
    assert!(
        a.buf.as_slice() == settled.as_slice(),
        "a released READ wrote into memory after its deregistration returned"
    );
    a.reg = Some(a.node.register(&a.buf).or_fail("register again"));
    pair_up(&a.node, &b.node);

    // And the path still works.
    let (a_before, b_before) = (a.buf.as_slice().to_vec(), b.buf.as_slice().to_vec());
    let before = stats(a.name());
    let req = read_request(&a, &b, &big, None);
    a.node
        .post_and_wait(&req, wait_timeout())
        .or_fail("READ after the release");
    drop(req);
    big.verify(a.buf.as_slice(), &a_before, &b_before)
        .or_fail("READ's destination");
    assert_cma(&before, &stats(a.name()), 1);
}
