//! READ over the bounce path across processes (this test binary re-executed
//! as peers, see tests/support/peer.rs), control (direct TCP by default) on 127.0.0.1 and over
//! NIXL notifications, 4096 scattered 4 KiB READs, byte-exact, counted on
//! both sides:
//! - this process reads from a peer that never loaded our metadata (the
//!   vLLM decode -> prefill pattern), with a notification the owner waits
//!   for, and the peer reads from this process;
//! - many readers (three peer processes) read from one owner at once,
//!   while the owner WRITEs to one of them;
//! - an owner killed (SIGKILL) mid-READ: the reader's request fails within
//!   its timeout, and after the application forgets the dead owner the
//!   reader reads from another one;
//! - a reader killed mid-READ: the owner ends its serve within the liveness
//!   bound, drains its arena, forgets the reader (it never loaded it) and
//!   serves the next reader.
mod support;

use bounce::*;
use faults::*;
use nixl_sys::{ThreadSync, XferOp};
use peer::*;
use std::time::{Duration, Instant};
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

/// This process READs `plan(len, MANY, plan_seed)` from peer `p`,
/// byte-exact, and checks both sides' counters.
/// Returns the owner's chunk writes by cross-memory attach.
fn read_from_peer(
    me: &mut Endpoint,
    p: &mut Peer,
    seeds: (u64, u64, u64),
    notif: Option<&[u8]>,
) -> u64 {
    let (my_seed, peer_seed, plan_seed) = seeds;
    let len = me.buf.len();
    me.buf.fill_pattern(my_seed);
    p.cmd(&format!("FILL {peer_seed}"));
    let (sm, sp) = (stats(me.name()), p.stats());
    let plan = plan(len, MANY, plan_seed);
    let req = me
        .node
        .create_xfer(XferOp::Read, &plan, me.buf.addr(), p.addr, &p.name, notif)
        .or_fail("create_xfer_req(READ)");
    let dt = me
        .node
        .post_and_wait(&req, wait_timeout())
        .or_fail("READ from the peer process");
    drop(req);
    if let Some(m) = notif {
        p.cmd(&format!("WAIT_NOTIF {} {}", me.name(), hex(m)));
    }
    plan.verify(
        me.buf.as_slice(),
        &pattern(len, my_seed),
        &pattern(len, peer_seed),
    )
    .or_fail("destination");
    me.buf.check_guards().or_fail("guards");
    p.cmd(&format!("CHECK_UNCHANGED {peer_seed}"));
    let (em, ep) = (stats(me.name()), p.stats());
    eprintln!(
        "{} <- {}: {dt:?}; {} ; {}",
        me.name(),
        p.name,
        em.diff(&sm),
        ep.diff(&sp)
    );
    assert_reader_bounced(&sm, &em, 1);
    assert_eq!(ep.since(&sp, "reads_served"), 1, "{}", ep.diff(&sp));
    assert_eq!(
        em.since(&sm, "chunks_scattered"),
        ep.since(&sp, "chunks_written")
    );
    ep.since(&sp, "chunk_writes_cma")
}

/// Returns the chunk writes both sides made by cross-memory attach.
fn both_ways(extra: &[(&str, &str)], seed: u64) -> u64 {
    let len = len();
    let mut cma_writes = 0;
    let mut p = Peer::spawn("owner", peer_command(&[], len, extra, "rp-peer"))
        .unwrap_or_else(|e| panic!("{e}"));
    let mut me = endpoint("rp-me", extra, len, seed, ThreadSync::Default);
    // Only this process loads the peer's metadata: a READ needs no more.
    assert_eq!(
        me.node.load_md(&p.md).or_fail("load the peer's metadata"),
        p.name
    );
    let s = 100 * seed;
    read_from_peer(
        &mut me,
        &mut p,
        (s + 1, s + 2, s + 3),
        Some(b"rp-read-done"),
    );
    read_from_peer(&mut me, &mut p, (s + 4, s + 5, s + 6), None);

    // The peer reads from this process.
    assert_eq!(
        p.cmd(&format!("PEER {}", hex(&me.node.local_md().or_fail("md")))),
        me.name()
    );
    for i in 0..2u64 {
        let (my_seed, peer_seed, plan_seed) = (s + 11 + 3 * i, s + 12 + 3 * i, s + 13 + 3 * i);
        me.buf.fill_pattern(my_seed);
        p.cmd(&format!("FILL {peer_seed}"));
        let (sm, sp) = (stats(me.name()), p.stats());
        let us = p.cmd(&format!(
            "READ {} {} {MANY} {plan_seed} -",
            me.name(),
            me.buf.addr()
        ));
        p.cmd(&format!(
            "CHECK_WRITE - {MANY} {plan_seed} {my_seed} {peer_seed} -"
        ));
        verify_bytes(me.buf.as_slice(), &pattern(len, my_seed), |_| {
            "source".into()
        })
        .or_fail("source changed");
        let (em, ep) = (stats(me.name()), p.stats());
        eprintln!(
            "{} <- {}: {us} us; {} ; {}",
            p.name,
            me.name(),
            ep.diff(&sp),
            em.diff(&sm)
        );
        assert_reader_bounced(&sp, &ep, 1);
        assert_eq!(em.since(&sm, "reads_served"), 1, "{}", em.diff(&sm));
        cma_writes += em.since(&sm, "chunk_writes_cma");
    }
    p.finish();
    cma_writes
}

#[test]
#[serial_test::serial]
fn two_processes_read_both_ways() {
    if !ready("BOUNCE") {
        return;
    }
    assert_no_cma_writes(both_ways(&[LOOPBACK], 1));
}

/// The owner writes each chunk into the reader's host arena by
/// cross-memory attach (the reader's data path carries its process), with
/// the CMA path on and its own route gated off.
#[test]
#[serial_test::serial]
fn two_processes_read_both_ways_with_chunk_writes_by_cma() {
    if !ready("BOUNCE") {
        return;
    }
    let writes = both_ways(&CMA_CHUNK_WRITES, 4);
    assert!(writes >= 2, "{writes} chunk writes by CMA");
}

/// An owner built before READs carried version 2 of the data path (played
/// by `advertise_no_data_path_v2`: its handshake lacks DATA_PATH_V2 and it
/// refuses version 2 by name, failing the READ, as such builds do) is sent
/// version 1: its READs are served, through NIXL's chunk writes.
#[test]
#[serial_test::serial]
fn an_owner_without_data_path_v2_is_sent_version_1() {
    if !ready("BOUNCE") {
        return;
    }
    // The owner never loads this reader's metadata: all it knows of this
    // arena is what the READ's data path says.
    let owner_writes = |failpoints: &str, seed: u64| {
        let len = len();
        let mut p = with_failpoints(failpoints, || {
            Peer::spawn(
                "owner",
                peer_command(&[], len, &CMA_CHUNK_WRITES, "rp-owner"),
            )
        })
        .unwrap_or_else(|e| panic!("{e}"));
        let mut me = endpoint("rp-me", &CMA_CHUNK_WRITES, len, seed, ThreadSync::Default);
        me.node.load_md(&p.md).or_fail("load the owner's metadata");
        let s = 100 * seed;
        let writes = read_from_peer(&mut me, &mut p, (s + 1, s + 2, s + 3), None);
        p.finish();
        writes
    };
    let current = owner_writes("", 6);
    assert!(
        current >= 1,
        "{current} chunk writes by CMA into a version-2 reader"
    );
    let older = owner_writes("advertise_no_data_path_v2", 7);
    assert_eq!(
        older, 0,
        "{older} chunk writes by CMA into a version-1 reader"
    );
}

#[test]
#[serial_test::serial]
fn two_processes_read_both_ways_over_nixl_notifications() {
    if !ready("BOUNCE") {
        return;
    }
    both_ways(&[NOTIF_CONTROL, ("max_chunk_size_bytes", "1MiB")], 2);
}

#[test]
#[serial_test::serial]
fn two_processes_read_both_ways_over_zmq() {
    if !ready("BOUNCE") {
        return;
    }
    both_ways(
        &[LOOPBACK, ZMQ_CONTROL, ("max_chunk_size_bytes", "1MiB")],
        3,
    );
}

/// Three reader processes READ from this process at once while it WRITEs
/// to a fourth process: the three served READs and the WRITE share this
/// process's (small) arena.
#[test]
#[serial_test::serial]
fn many_readers_from_one_owner_with_a_write_beside() {
    if !ready("BOUNCE") {
        return;
    }
    let len = len();
    let ex = [
        LOOPBACK,
        ("arena_size_bytes", "8MiB"),
        ("max_chunk_size_bytes", "1MiB"),
    ];
    let mut me = endpoint("rm-owner", &ex, len, 7, ThreadSync::Default);
    let md = hex(&me.node.local_md().or_fail("md"));
    let spawn = |label: &str| {
        Peer::spawn(label, peer_command(&[], len, &ex, &format!("rm-{label}")))
            .unwrap_or_else(|e| panic!("{e}"))
    };
    let mut readers: Vec<Peer> = (0..3).map(|i| spawn(&format!("reader{i}"))).collect();
    let mut target = spawn("target");
    for p in readers.iter_mut() {
        assert_eq!(p.cmd(&format!("PEER {md}")), me.name());
    }
    assert_eq!(
        me.node.load_md(&target.md).or_fail("load the target"),
        target.name
    );
    let owner_seed = 70;
    me.buf.fill_pattern(owner_seed);
    for (i, p) in readers.iter_mut().enumerate() {
        p.cmd(&format!("FILL {}", 80 + i));
    }
    target.cmd("FILL 85");
    let sm = stats(me.name());
    let before: Vec<Counters> = readers.iter_mut().map(|p| p.stats()).collect();
    for (i, p) in readers.iter_mut().enumerate() {
        p.send(&format!(
            "READ {} {} {MANY} {} -",
            me.name(),
            me.buf.addr(),
            90 + i
        ));
    }
    let write = plan(len, MANY, 95);
    let req = me
        .node
        .create_xfer(
            XferOp::Write,
            &write,
            me.buf.addr(),
            target.addr,
            &target.name,
            None,
        )
        .or_fail("create_xfer_req(WRITE)");
    let dt = me
        .node
        .post_and_wait(&req, wait_timeout())
        .or_fail("WRITE beside the READs");
    drop(req);
    for (i, p) in readers.iter_mut().enumerate() {
        let us = p.reply("READ");
        eprintln!(
            "{} <- {}: {us} us (the WRITE beside took {dt:?})",
            p.name,
            me.name()
        );
        p.cmd(&format!(
            "CHECK_WRITE - {MANY} {} {owner_seed} {} -",
            90 + i,
            80 + i
        ));
    }
    target.cmd(&format!("CHECK_WRITE - {MANY} 95 {owner_seed} 85 -"));
    verify_bytes(me.buf.as_slice(), &pattern(len, owner_seed), |_| {
        "source".into()
    })
    .or_fail("source changed");
    let em = stats(me.name());
    eprintln!("owner: {}", em.diff(&sm));
    assert_eq!(em.since(&sm, "reads_served"), 3, "{}", em.diff(&sm));
    assert_eq!(
        em.since(&sm, "bounce_succeeded"),
        1,
        "the WRITE: {}",
        em.diff(&sm)
    );
    assert_eq!(
        em.since(&sm, "bytes_written"),
        4 * (MANY * BLOCK) as u64,
        "{}",
        em.diff(&sm)
    );
    assert!(em.poisoned.is_none());
    for (p, b) in readers.iter_mut().zip(&before) {
        let e = p.stats();
        assert_reader_bounced(b, &e, 1);
    }
    for p in readers {
        p.finish();
    }
    target.finish();
}

/// The fault tests' engines: a 1 MiB arena of 64 KiB chunks, one chunk in
/// flight per request (so a READ is still running when the fault comes),
/// and the given request timeout.
fn fault_config(request_timeout_ms: &'static str) -> [(&'static str, &'static str); 6] {
    [
        LOOPBACK,
        ("max_chunk_size_bytes", "64KiB"),
        ("arena_size_bytes", "1MiB"),
        ("arena_allocation_granularity_bytes", "64KiB"),
        ("max_inflight_chunks_per_request", "1"),
        ("request_timeout_ms", request_timeout_ms),
    ]
}

/// [`fault_config`], with the control messages over NIXL notifications
/// when `notifications`.
fn fault_config_over(
    request_timeout_ms: &'static str,
    notifications: bool,
) -> Vec<(&'static str, &'static str)> {
    let mut ex = fault_config(request_timeout_ms).to_vec();
    if notifications {
        ex.push(("use_nixl_notifications", "true"));
    }
    ex
}

/// The arena size of [`fault_config`].
const FAULT_ARENA: u64 = 1 << 20;

/// `p` (a reader process paired with `me`) posts a READ of `me`'s buffer
/// with plan seed `seed`; returns `me`'s counters from before, once `me`
/// (the owner) wrote two chunks of it.
fn reader_mid_read(me: &Endpoint, p: &mut Peer, seed: u64) -> Counters {
    let sm = stats(me.name());
    p.cmd(&format!(
        "POST_READ {} {} {MANY} {seed} -",
        me.name(),
        me.buf.addr()
    ));
    wait_for(
        Duration::from_secs(20),
        || "the owner wrote nothing".into(),
        || stats(me.name()).since(&sm, "chunks_written") >= 2,
    );
    sm
}

/// The owner holds nothing of a reader any more: no control connection,
/// no data path, no reader's agent in its inner agent.
fn assert_no_reader_left(owner: &Counters) {
    for gauge in ["control_peers", "reader_data_paths", "reader_agents_loaded"] {
        assert_eq!(owner.get(gauge), 0, "{gauge}: {:?}", owner.map);
    }
}

/// The owner's buffer is only a source: not one byte of it changed.
fn assert_owner_untouched(me: &Endpoint, owner_seed: u64) {
    verify_bytes(me.buf.as_slice(), &pattern(len(), owner_seed), |_| {
        "the owner's buffer".into()
    })
    .or_fail("the owner's memory");
}

/// SIGKILL the owner while this process READs from it: the READ fails
/// within its timeout; once the application forgets the dead owner, a READ
/// from another owner succeeds.
#[test]
#[serial_test::serial]
fn reader_survives_an_owner_killed_mid_read() {
    if !ready("BOUNCE") {
        return;
    }
    let len = len();
    let ex = fault_config("2000");
    let mut me = endpoint("rk-me", &ex, len, 21, ThreadSync::Default);
    let p = Peer::spawn("owner", peer_command(&[], len, &ex, "rk-owner"))
        .unwrap_or_else(|e| panic!("{e}"));
    assert_eq!(me.node.load_md(&p.md).or_fail("load"), p.name);
    let (pname, paddr) = (p.name.clone(), p.addr);
    let plan = plan(len, MANY, 22);
    let sm = stats(me.name());
    let req = me
        .node
        .create_xfer(XferOp::Read, &plan, me.buf.addr(), paddr, &pname, None)
        .or_fail("create_xfer_req(READ)");
    post(&me.node, &req).or_fail("post");
    // Kill it once data flows (the reader scattered something).
    let t0 = Instant::now();
    while stats(me.name()).since(&sm, "chunks_scattered") == 0 {
        check_deadline(t0, Duration::from_secs(20), &|| "no chunk arrived".into());
        std::thread::sleep(Duration::from_micros(200));
    }
    p.kill();
    let t1 = Instant::now();
    let mut spins = 0;
    let outcome = loop {
        match poll(&me.node, &req) {
            Ok(true) => break Ok(()),
            Ok(false) => {}
            Err(e) => break Err(e),
        }
        check_deadline(t1, Duration::from_secs(20), &|| {
            "READ from a killed owner".into()
        });
        pause(&mut spins);
    };
    let dt = t1.elapsed();
    drop(req);
    let em = stats(me.name());
    eprintln!(
        "READ from a killed owner: {outcome:?} after {dt:?}; {}",
        em.diff(&sm)
    );
    assert!(
        outcome.is_err(),
        "a READ from an owner killed mid-way succeeded"
    );
    assert!(
        dt < Duration::from_secs(5),
        "failed only after {dt:?} (request timeout 2 s)"
    );
    assert_eq!(em.since(&sm, "bounce_failed"), 1, "{}", em.diff(&sm));
    assert!(em.poisoned.is_none(), "poisoned: {:?}", em.poisoned);
    // The application forgets the dead owner; another owner serves.
    me.node.agent.invalidate_remote_md(&pname).ok();
    let mut q = Peer::spawn("owner-2", peer_command(&[], len, &ex, "rk-owner2"))
        .unwrap_or_else(|e| panic!("{e}"));
    assert_eq!(me.node.load_md(&q.md).or_fail("load"), q.name);
    read_from_peer(&mut me, &mut q, (23, 24, 25), None);
    q.finish();
}

/// SIGKILL a reader process while it READs from this process (which never
/// loaded the reader: it knows it only through its READ): the owner finds
/// it unreachable and ends the serve within the liveness bound, not the
/// request timeout (30 s here); its arena drains and is conserved; it
/// forgets the reader (control connection, data path, the reader's agent
/// in its inner agent); nothing of its memory changed; nothing is
/// poisoned; the next reader is served byte-exact.
#[test]
#[serial_test::serial]
fn owner_survives_a_reader_killed_mid_read() {
    reader_killed(&fault_config("30000"));
}

/// The same over NIXL notifications: the owner learns from the reader's
/// heartbeats that it answers them, and its silence ends the serve.
#[test]
#[serial_test::serial]
fn owner_survives_a_reader_killed_mid_read_over_notifications() {
    reader_killed(&fault_config_over("30000", true));
}

fn reader_killed(ex: &[(&str, &str)]) {
    if !ready("BOUNCE") {
        return;
    }
    let len = len();
    let owner_seed = 31;
    let me = endpoint("rk-owner", ex, len, owner_seed, ThreadSync::Default);
    let md = hex(&me.node.local_md().or_fail("md"));
    let mut p = Peer::spawn("reader", peer_command(&[], len, ex, "rk-reader"))
        .unwrap_or_else(|e| panic!("{e}"));
    assert_eq!(p.cmd(&format!("PEER {md}")), me.name());
    let sm = reader_mid_read(&me, &mut p, 32);
    let serving = stats(me.name());
    assert_eq!(serving.get("reader_data_paths"), 1, "{:?}", serving.map);
    assert_eq!(serving.get("reader_agents_loaded"), 1, "{:?}", serving.map);
    p.kill();
    let killed = Instant::now();
    let unreachable_in = wait_for(
        Duration::from_secs(3),
        || "the killed reader is not found unreachable".into(),
        || stats(me.name()).since(&sm, "peers_unreachable") >= 1,
    );
    // Forgotten only once its serve ended and no write to it runs.
    wait_for(
        Duration::from_secs(3),
        || {
            format!(
                "the killed reader is not forgotten: {}",
                stats(me.name()).diff(&sm)
            )
        },
        || stats(me.name()).since(&sm, "peers_forgotten") >= 1,
    );
    let forgotten_in = killed.elapsed();
    let idle_after = wait_arena_idle(me.name(), FAULT_ARENA, Duration::from_secs(1));
    let em = stats(me.name());
    eprintln!(
        "owner after its reader was killed: unreachable after {unreachable_in:?}, serve ended and \
         reader forgotten after {forgotten_in:?}, arena idle {idle_after:?} later; {}",
        em.diff(&sm)
    );
    assert!(
        forgotten_in < Duration::from_secs(3),
        "the serve ended only after {forgotten_in:?} (liveness 1 s; request timeout 30 s)"
    );
    assert!(em.poisoned.is_none(), "poisoned: {:?}", em.poisoned);
    assert_eq!(em.since(&sm, "reads_served"), 0, "{}", em.diff(&sm));
    assert_eq!(em.since(&sm, "peers_forgotten"), 1, "{}", em.diff(&sm));
    assert_no_reader_left(&em);
    assert_owner_untouched(&me, owner_seed);
    me.buf.check_guards().or_fail("guards");
    // The next reader is served.
    let mut q = Peer::spawn("reader-2", peer_command(&[], len, ex, "rk-reader2"))
        .unwrap_or_else(|e| panic!("{e}"));
    assert_eq!(q.cmd(&format!("PEER {md}")), me.name());
    q.cmd("FILL 33");
    let sm = stats(me.name());
    q.cmd(&format!("READ {} {} {MANY} 34 -", me.name(), me.buf.addr()));
    q.cmd(&format!("CHECK_WRITE - {MANY} 34 {owner_seed} 33 -"));
    assert_eq!(stats(me.name()).since(&sm, "reads_served"), 1);
    wait_arena_idle(me.name(), FAULT_ARENA, Duration::from_secs(1));
    q.finish();
}

/// SIGSTOP a reader process mid-READ: the owner (which never loaded it)
/// finds it unreachable, ends the serve and forgets it. On SIGCONT the
/// reader's READ fails (its own timeout ran out while it was stopped), and
/// the same reader, same agent and control endpoint, READs again:
/// connected, its data path and agent loaded anew, byte-exact.
#[test]
#[serial_test::serial]
fn a_forgotten_reader_that_comes_back_is_served_again() {
    forgotten_reader_comes_back(false);
}

/// The same over NIXL notifications: the owner forgets the reader whose
/// heartbeats stopped, and on SIGCONT answers its PINGs again (loading
/// the metadata they carry, which the forget gave up) and serves it.
#[test]
#[serial_test::serial]
fn a_forgotten_reader_that_comes_back_is_served_again_over_notifications() {
    forgotten_reader_comes_back(true);
}

fn forgotten_reader_comes_back(notifications: bool) {
    if !ready("BOUNCE") {
        return;
    }
    let config = |timeout| fault_config_over(timeout, notifications);
    let len = len();
    let owner_seed = 41;
    let me = endpoint(
        "rc-owner",
        &config("30000"),
        len,
        owner_seed,
        ThreadSync::Default,
    );
    let md = hex(&me.node.local_md().or_fail("md"));
    let mut p = Peer::spawn(
        "reader",
        peer_command(&[], len, &config("3000"), "rc-reader"),
    )
    .unwrap_or_else(|e| panic!("{e}"));
    assert_eq!(p.cmd(&format!("PEER {md}")), me.name());
    let sp = p.stats();
    let sm = reader_mid_read(&me, &mut p, 42);
    p.signal(libc::SIGSTOP);
    // Over notifications a chunk write to the stopped reader can stay
    // unfinished while it is stopped (its put waits behind control
    // messages the stopped reader does not take in, on the same UCX
    // endpoint): the owner then keeps the chunk's region and the reader
    // (fail closed) until the write ends, after SIGCONT.
    let t0 = std::time::Instant::now();
    let forgotten = loop {
        let now = stats(me.name());
        if now.since(&sm, "peers_forgotten") >= 1 {
            break true;
        }
        if t0.elapsed() > Duration::from_secs(6) {
            let held =
                now.since(&sm, "peers_unreachable") >= 1 && now.since(&sm, "arena_local_bytes") > 0;
            assert!(
                notifications && held,
                "not within 6 s: the stopped reader is not forgotten: {}",
                now.diff(&sm)
            );
            assert!(now.poisoned.is_none(), "poisoned: {:?}", now.poisoned);
            break false;
        }
        std::thread::sleep(Duration::from_millis(2));
    };
    let forgotten_in = t0.elapsed();
    if forgotten {
        wait_arena_idle(me.name(), FAULT_ARENA, Duration::from_secs(1));
        assert_no_reader_left(&stats(me.name()));
    }
    p.signal(libc::SIGCONT);
    let failed_in = wait_for(
        Duration::from_secs(10),
        || "the stopped reader's READ never failed".into(),
        || p.stats().since(&sp, "bounce_failed") >= 1,
    );
    // It READs again.
    p.cmd("FILL 43");
    let sm2 = stats(me.name());
    let us = p.cmd(&format!("READ {} {} {MANY} 44 -", me.name(), me.buf.addr()));
    p.cmd(&format!("CHECK_WRITE - {MANY} 44 {owner_seed} 43 -"));
    let em2 = stats(me.name());
    eprintln!(
        "stopped reader {} after {forgotten_in:?}; its READ failed {failed_in:?} after \
         SIGCONT; READ again in {us} us; owner: {}",
        if forgotten {
            "forgotten"
        } else {
            "kept (a write to it unfinished)"
        },
        em2.diff(&sm)
    );
    assert_eq!(em2.since(&sm2, "reads_served"), 1, "{}", em2.diff(&sm2));
    assert_eq!(
        em2.since(&sm, "peers_forgotten"),
        u64::from(forgotten),
        "{}",
        em2.diff(&sm)
    );
    assert_eq!(em2.get("control_peers"), 1, "{:?}", em2.map);
    assert_eq!(em2.get("reader_data_paths"), 1, "{:?}", em2.map);
    assert!(em2.poisoned.is_none(), "poisoned: {:?}", em2.poisoned);
    assert_owner_untouched(&me, owner_seed);
    wait_arena_idle(me.name(), FAULT_ARENA, Duration::from_secs(5));
    wait_idle_of("the reader", FAULT_ARENA, Duration::from_secs(10), || {
        p.stats()
    });
    p.finish();
}
