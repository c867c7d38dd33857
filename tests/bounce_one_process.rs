//! The bounce path in one process: two BOUNCE agents (direct TCP control on
//! 127.0.0.1), 4096 scattered 4 KiB WRITEs, byte-exact, each asserting from
//! the plugin's counters that the bounce path carried it:
//! - both directions of one pair, and both orders of the metadata exchange;
//! - a one-way pairing (only the initiator loaded the target's metadata, as
//!   UCX needs for a WRITE);
//! - with a notification: the target checks its destination the moment the
//!   notification shows up (the notification must mean "the data is there"),
//!   with the default chunks (four of 4 MiB) and with many small chunks;
//! - the default split of a 16 MiB request into four chunks (and one chunk
//!   with the split off);
//! - chunk writes posted by the IO thread or by the writer thread;
//! - a timeline (`NIXL_BOUNCE_TRACE`) whose steps line up across both sides;
//! - a 64 MiB WRITE announced before its plan (`announce_writes`), whose
//!   chunks are all taken ahead of it as the preparation's threads pack
//!   them, and one whose plan differs from its announcement withdrawn and
//!   sent anew;
//! - the receiver's standing credit taken by a sender's next WRITEs
//!   (`standing_credit_peers`), and none with it off;
//! - the same over the NIXL-notification control channel
//!   (`use_nixl_notifications=true` on both sides) instead of ZMQ.
mod support;

use bounce::*;
use nixl_sys::{ThreadSync, XferOp};
use std::time::{Duration, Instant};
use support::*;

const MANY: usize = 4096;

fn len() -> usize {
    blocks_for(MANY) * BLOCK
}

/// One bounce WRITE of [`MANY`] blocks from `a` to `b`, byte-exact and
/// counted ([`write_plan`]).
fn write_once(a: &mut Endpoint, b: &mut Endpoint, plan_seed: u64, seeds: (u64, u64)) -> Duration {
    let plan = Plan::standard(MANY, BLOCK, plan_seed);
    let (dt, sa, ea) = write_plan(a, b, &plan, seeds);
    // Fewer descriptors than the preparation's threads take: not announced
    // (`announce_writes`).
    assert_eq!(ea.since(&sa, "bounce_announced"), 0, "announced");
    dt
}

/// The bounce WRITE of `plan` from `a` to `b` (their buffers filled from
/// `seeds`), byte-exact, sources and guards intact, counted on both sides
/// as one bounce transfer of the plan's bytes; the time it took and the
/// sender's counters before and after.
fn write_plan(
    a: &mut Endpoint,
    b: &mut Endpoint,
    plan: &Plan,
    seeds: (u64, u64),
) -> (Duration, Counters, Counters) {
    a.buf.fill_pattern(seeds.0);
    b.buf.fill_pattern(seeds.1);
    let (src, dst_before) = (a.buf.as_slice().to_vec(), b.buf.as_slice().to_vec());
    let (sa, sb) = (stats(a.name()), stats(b.name()));
    let req = write_request(a, b, plan);
    let dt = a.node.post_and_wait(&req, wait_timeout()).or_fail(&format!(
        "WRITE {} -> {}",
        a.name(),
        b.name()
    ));
    drop(req);
    plan.verify(b.buf.as_slice(), &dst_before, &src)
        .or_fail("destination");
    verify_bytes(a.buf.as_slice(), &src, |_| "source".into()).or_fail("source changed");
    a.buf.check_guards().or_fail("source guards");
    b.buf.check_guards().or_fail("destination guards");
    let (ea, eb) = (stats(a.name()), stats(b.name()));
    eprintln!(
        "{} -> {}: {dt:?}; {} ; {}",
        a.name(),
        b.name(),
        ea.diff(&sa),
        eb.diff(&sb)
    );
    assert_sender_bounced(&sa, &ea, 1);
    assert_receiver_scattered(&sb, &eb, ea.since(&sa, "chunks_written"));
    assert_eq!(
        ea.since(&sa, "bytes_written"),
        (plan.len() * plan.block) as u64,
        "bytes_written"
    );
    (dt, sa, ea)
}

fn both_directions(ex: &[(&str, &str)], seed: u64) {
    let mut a = endpoint("op-a", ex, len(), seed, ThreadSync::Default);
    let mut b = endpoint("op-b", ex, len(), seed + 1, ThreadSync::Default);
    pair_up(&a.node, &b.node);
    let s = 100 * seed;
    write_once(&mut a, &mut b, s + 11, (s + 101, s + 102));
    write_once(&mut b, &mut a, s + 12, (s + 103, s + 104));
    // Again, same agents, other layouts and data.
    write_once(&mut a, &mut b, s + 13, (s + 105, s + 106));
    write_once(&mut b, &mut a, s + 14, (s + 107, s + 108));
}

#[test]
#[serial_test::serial]
fn write_4096_both_directions() {
    if !ready("BOUNCE") {
        return;
    }
    both_directions(&[LOOPBACK], 1);
}

#[test]
#[serial_test::serial]
fn write_4096_both_directions_over_nixl_notifications() {
    if !ready("BOUNCE") {
        return;
    }
    // Control messages as NIXL notifications (no ZMQ socket at all).
    both_directions(&[NOTIF_CONTROL], 11);
}

#[test]
#[serial_test::serial]
fn write_4096_one_way_pairing_over_nixl_notifications() {
    if !ready("BOUNCE") {
        return;
    }
    let ex = [NOTIF_CONTROL];
    let mut a = endpoint("op-a", &ex, len(), 15, ThreadSync::Default);
    let mut b = endpoint("op-b", &ex, len(), 16, ThreadSync::Default);
    // The target never loaded the initiator's metadata: its replies must
    // find their way back through what the WANT carries.
    load(&a.node, &b.node);
    write_once(&mut a, &mut b, 33, (125, 126));
    write_once(&mut a, &mut b, 34, (127, 128));
}

/// A peer built before the notification channel's heartbeats: its
/// handshake lacks HEARTBEATS (`advertise_no_heartbeats`) and it PINGs
/// nobody (liveness off). It is never sent a heartbeat (one would reach it
/// as a malformed control message), and transfers both ways work.
#[test]
#[serial_test::serial]
fn a_peer_without_heartbeats_is_never_sent_one() {
    if !ready("BOUNCE") {
        return;
    }
    let mut a = endpoint("hb-a", &[NOTIF_CONTROL], len(), 51, ThreadSync::Default);
    std::env::set_var("NIXL_BOUNCE_FAILPOINTS", "advertise_no_heartbeats");
    let mut b = endpoint(
        "hb-b",
        &[NOTIF_CONTROL, ("peer_liveness_timeout_ms", "0")],
        len(),
        52,
        ThreadSync::Default,
    );
    std::env::remove_var("NIXL_BOUNCE_FAILPOINTS");
    pair_up(&a.node, &b.node);
    write_once(&mut a, &mut b, 53, (131, 132));
    write_once(&mut b, &mut a, 54, (133, 134));
    // More than two PING intervals (250 ms by default) with both connected.
    std::thread::sleep(Duration::from_millis(700));
    write_once(&mut a, &mut b, 55, (135, 136));
    assert_eq!(
        stats(a.name()).get("control_pings_sent"),
        0,
        "A PINGed a peer without heartbeats"
    );
    assert_eq!(
        stats(b.name()).get("control_pings_sent"),
        0,
        "liveness off, yet B PINGed"
    );

    // The same pair with heartbeats on both sides does PING.
    drop((a, b));
    let mut a = endpoint("hb-a2", &[NOTIF_CONTROL], len(), 56, ThreadSync::Default);
    let mut b = endpoint("hb-b2", &[NOTIF_CONTROL], len(), 57, ThreadSync::Default);
    pair_up(&a.node, &b.node);
    write_once(&mut a, &mut b, 58, (137, 138));
    std::thread::sleep(Duration::from_millis(700));
    assert!(
        stats(a.name()).get("control_pings_sent") >= 2,
        "A did not PING B"
    );
}

#[test]
#[serial_test::serial]
fn write_4096_metadata_loaded_target_first() {
    if !ready("BOUNCE") {
        return;
    }
    let ex = [LOOPBACK];
    let mut a = endpoint("op-a", &ex, len(), 3, ThreadSync::Default);
    let mut b = endpoint("op-b", &ex, len(), 4, ThreadSync::Default);
    // The target learns the initiator first, then the initiator the target.
    load(&b.node, &a.node);
    load(&a.node, &b.node);
    write_once(&mut a, &mut b, 21, (111, 112));
    write_once(&mut b, &mut a, 22, (113, 114));
}

#[test]
#[serial_test::serial]
fn write_4096_one_way_pairing() {
    if !ready("BOUNCE") {
        return;
    }
    let ex = [LOOPBACK];
    let mut a = endpoint("op-a", &ex, len(), 5, ThreadSync::Default);
    let mut b = endpoint("op-b", &ex, len(), 6, ThreadSync::Default);
    // Only the initiator knows the target (enough for a UCX WRITE): the
    // target learns the reverse control path from the WANT itself.
    load(&a.node, &b.node);
    write_once(&mut a, &mut b, 31, (121, 122));
    write_once(&mut a, &mut b, 32, (123, 124));
}

/// Post a WRITE with a notification; poll the initiator's status and the
/// target's notifications in one loop; the moment the notification is seen,
/// check the whole destination. Returns whether the initiator had already
/// seen completion when the notification arrived (informational).
fn notif_check_at_arrival(extra: &[(&str, &str)], plan_seed: u64, seeds: (u64, u64), msg: &[u8]) {
    let mut a = endpoint("nt-a", extra, len(), seeds.0, ThreadSync::Default);
    let mut b = endpoint("nt-b", extra, len(), seeds.1, ThreadSync::Default);
    pair_up(&a.node, &b.node);
    for round in 0..2u64 {
        let plan = Plan::standard(MANY, BLOCK, plan_seed + round);
        a.buf.fill_pattern(seeds.0 * 10 + round);
        b.buf.fill_pattern(seeds.1 * 10 + round);
        let (src, dst_before) = (a.buf.as_slice().to_vec(), b.buf.as_slice().to_vec());
        let (sa, sb) = (stats(a.name()), stats(b.name()));
        let req = a
            .node
            .create_xfer(
                XferOp::Write,
                &plan,
                a.buf.addr(),
                b.buf.addr(),
                &b.node.name.clone(),
                Some(msg),
            )
            .or_fail("create_xfer_req");
        let t0 = Instant::now();
        post(&a.node, &req).or_fail("post");
        let (mut done_at, mut notif_at) = (None, None);
        let mut spins = 0u64;
        while done_at.is_none() || notif_at.is_none() {
            if done_at.is_none() && poll(&a.node, &req).or_fail("status") {
                done_at = Some(t0.elapsed());
            }
            if notif_at.is_none() {
                let got = take_notifs(&b.node).or_fail("notifications");
                for (from, m) in &got {
                    assert_eq!(
                        from,
                        a.name(),
                        "notification from an unexpected agent: {m:?}"
                    );
                    assert_eq!(m.as_slice(), msg, "unexpected notification");
                    assert!(notif_at.is_none(), "notification delivered twice");
                    // The data must be there NOW, before anything else runs.
                    plan.verify(b.buf.as_slice(), &dst_before, &src).unwrap_or_else(|e| {
                        panic!("round {round}: notification arrived but the destination is not complete: {e}")
                    });
                    notif_at = Some(t0.elapsed());
                }
            }
            check_deadline(t0, wait_timeout(), &|| {
                format!("done={done_at:?} notif={notif_at:?}")
            });
            pause(&mut spins);
        }
        eprintln!(
            "round {round} {extra:?}: initiator done at {done_at:?}, notification at {notif_at:?}"
        );
        drop(req);
        b.buf.check_guards().or_fail("guards");
        let (ea, eb) = (stats(a.name()), stats(b.name()));
        eprintln!("{} ; {}", ea.diff(&sa), eb.diff(&sb));
        assert_sender_bounced(&sa, &ea, 1);
        assert_receiver_scattered(&sb, &eb, ea.since(&sa, "chunks_written"));
        // No notification beyond the one.
        std::thread::sleep(Duration::from_millis(20));
        let extra_notifs = take_notifs(&b.node).or_fail("notifications");
        assert!(
            extra_notifs.is_empty(),
            "unexpected extra notifications: {extra_notifs:?}"
        );
    }
}

#[test]
#[serial_test::serial]
fn notification_only_after_data_in_place() {
    if !ready("BOUNCE") {
        return;
    }
    notif_check_at_arrival(&[LOOPBACK], 41, (7, 8), b"op-notif-default-chunks");
}

#[test]
#[serial_test::serial]
fn notification_only_after_data_in_place_over_nixl_notifications() {
    if !ready("BOUNCE") {
        return;
    }
    // The control messages and the user's notification share the inner
    // agent's notification stream: the user must see only its own message,
    // and only once the data is there.
    notif_check_at_arrival(
        &[
            NOTIF_CONTROL,
            ("max_chunk_size_bytes", "256KiB"),
            ("arena_size_bytes", "8MiB"),
        ],
        61,
        (11, 12),
        b"op-notif-over-notif-control",
    );
}

#[test]
#[serial_test::serial]
fn notification_only_after_data_in_place_many_chunks() {
    if !ready("BOUNCE") {
        return;
    }
    // 64 chunks of 256 KiB, scattered by several workers: a notification
    // sent after the first ACK instead of the last one would show.
    notif_check_at_arrival(
        &[
            LOOPBACK,
            ("max_chunk_size_bytes", "256KiB"),
            ("arena_size_bytes", "8MiB"),
        ],
        51,
        (9, 10),
        b"op-notif-many-chunks",
    );
}

/// By default a 16 MiB request (4096 x 4 KiB) goes in four chunks of 4 MiB
/// whose gather, write and scatter overlap (`min_chunks_per_request`,
/// `min_chunk_size_bytes`); with the split off it is one chunk (the 32 MiB
/// cap). Byte-exact either way.
#[test]
#[serial_test::serial]
fn a_16_mib_request_is_pipelined_in_four_chunks() {
    if !ready("BOUNCE") {
        return;
    }
    let split_off = ("min_chunks_per_request", "1");
    for (seed, ex, chunks) in [(51, vec![LOOPBACK], 4), (53, vec![LOOPBACK, split_off], 1)] {
        let mut a = endpoint("pl-a", &ex, len(), seed, ThreadSync::Default);
        let mut b = endpoint("pl-b", &ex, len(), seed + 1, ThreadSync::Default);
        pair_up(&a.node, &b.node);
        let before = stats(a.name());
        let s = 100 * seed;
        write_once(&mut a, &mut b, s + 11, (s + 101, s + 102));
        assert_eq!(
            stats(a.name()).since(&before, "chunks_written"),
            chunks,
            "{ex:?}"
        );
    }
}

/// After a sender's first WRITE, the receiver holds a standing credit for
/// it (`standing_credit_peers`): the sender's next WRITEs write their first
/// chunk into it at once, claiming it in the WANT, without waiting for a
/// GRANT (`bounce_standing_claimed`), byte-exact, whether the request is
/// one chunk (1024 blocks, 4 MiB) or four; the slot is offered again
/// before each claimed chunk's ACK, so every later WRITE finds it. With the
/// receiver's slots off none is offered or claimed.
#[test]
#[serial_test::serial]
fn the_next_writes_take_the_receivers_standing_credit() {
    if !ready("BOUNCE") {
        return;
    }
    for (seed, slots, claims) in [(61, "4", [0, 1, 1, 1]), (63, "0", [0; 4])] {
        let ex = [LOOPBACK, ("standing_credit_peers", slots)];
        let mut a = endpoint("st-a", &ex, len(), seed, ThreadSync::Default);
        let mut b = endpoint("st-b", &ex, len(), seed + 1, ThreadSync::Default);
        pair_up(&a.node, &b.node);
        let sb = stats(b.name());
        let s = 100 * seed;
        for (i, (blocks, claimed)) in [MANY, 1024, MANY, 1024].into_iter().zip(claims).enumerate() {
            let i = i as u64;
            let plan = Plan::standard(blocks, BLOCK, s + i);
            let (_, sa, ea) = write_plan(&mut a, &mut b, &plan, (s + 10 + i, s + 20 + i));
            assert_eq!(
                ea.since(&sa, "bounce_standing_claimed"),
                claimed,
                "WRITE {i} ({blocks} blocks), slots {slots}"
            );
        }
        let offered = stats(b.name()).since(&sb, "bounce_standing_offered");
        assert_eq!(offered, if slots == "0" { 0 } else { 4 }, "offers");
    }
}

/// A sender that goes away and comes back under the same name (a restart:
/// its engine dropped, a new one made) gives back, as it shuts down, the
/// standing credit it held and never claimed; the receiver's one slot
/// leaves it, and the new incarnation (a new control endpoint, so a new
/// peer to the receiver) is offered it: its second WRITE claims. Without
/// the give-back the slot would stay the last incarnation's for the
/// receiver's life (a slot never changes peers while one may write into
/// it), and the new one would be offered nothing.
#[test]
#[serial_test::serial]
fn a_restarted_sender_is_offered_the_slot_its_last_incarnation_gave_back() {
    if !ready("BOUNCE") {
        return;
    }
    let ex = [LOOPBACK, ("standing_credit_peers", "1")];
    let mut b = endpoint("rs-b", &ex, len(), 71, ThreadSync::Default);
    let name = unique_name("rs-a");
    for incarnation in 0..2u64 {
        let node = node_with(&name, &ex, ThreadSync::Default).or_fail("create rs-a");
        let buf = DramBuffer::with_pattern(len(), 72 + incarnation);
        let reg = node.register(&buf).or_fail("register rs-a's buffer");
        let mut a = Endpoint {
            reg: Some(reg),
            buf,
            node,
        };
        pair_up(&a.node, &b.node);
        for (i, claimed) in [0, 1].into_iter().enumerate() {
            let s = 7000 + 10 * incarnation + i as u64;
            let plan = Plan::standard(1024, BLOCK, s);
            let (_, sa, ea) = write_plan(&mut a, &mut b, &plan, (s, s + 1));
            assert_eq!(
                ea.since(&sa, "bounce_standing_claimed"),
                claimed,
                "incarnation {incarnation}, WRITE {i}"
            );
        }
        drop(a);
        // The give-back reaches the receiver before it forgets the sender.
        std::thread::sleep(Duration::from_millis(200));
        b.node
            .agent
            .invalidate_remote_md(&name)
            .unwrap_or_else(|e| panic!("rs-b forgets {name}: {e:?}"));
    }
}

/// Threads of this process whose name starts with `prefix` (Linux keeps
/// 15 bytes of a thread's name).
fn threads_named(prefix: &str) -> usize {
    std::fs::read_dir("/proc/self/task")
        .map(|tasks| {
            tasks
                .filter_map(|t| std::fs::read_to_string(t.ok()?.path().join("comm")).ok())
                .filter(|name| name.starts_with(prefix))
                .count()
        })
        .unwrap_or(0)
}

/// Chunk writes posted and polled by the IO thread itself
/// (`chunk_writes=io_thread`), by the writer thread (a host arena's
/// default), and by the IO thread only while no other write runs (a device
/// arena's default; here a 16 MiB request's four chunks overlap, so both
/// threads post), and by three writer threads (`chunk_writer_threads`):
/// byte-exact both ways every way, and only the last three start writer
/// threads, as many as asked for.
#[test]
#[serial_test::serial]
fn chunk_writes_on_the_io_thread_or_the_writer_thread() {
    if !ready("BOUNCE") {
        return;
    }
    for (seed, value, per_agent, writers) in [
        (61, "io_thread", "1", 0),
        (63, "writer_thread", "1", 2),
        (65, "auto", "1", 2),
        (67, "writer_thread", "3", 6),
    ] {
        let ex = [
            LOOPBACK,
            ("chunk_writes", value),
            ("chunk_writer_threads", per_agent),
        ];
        let mut a = endpoint("wt-a", &ex, len(), seed, ThreadSync::Default);
        let mut b = endpoint("wt-b", &ex, len(), seed + 1, ThreadSync::Default);
        pair_up(&a.node, &b.node);
        let s = 100 * seed;
        write_once(&mut a, &mut b, s + 11, (s + 101, s + 102));
        write_once(&mut b, &mut a, s + 12, (s + 103, s + 104));
        assert_eq!(
            threads_named("bounce-write-wt"),
            writers,
            "chunk_writes={value}, chunk_writer_threads={per_agent}"
        );
    }
}

/// With `NIXL_BOUNCE_TRACE` set, each engine writes its timeline when it
/// ends, and a 16 MiB WRITE's steps (four chunks) line up across the two
/// sides in causal order: the client's queueing, submit, WANT, GRANT,
/// each chunk's gather, write, DATA, scatter and ACK, the completion.
#[test]
#[serial_test::serial]
fn a_trace_lines_up_each_chunks_steps_across_both_sides() {
    if !ready("BOUNCE") {
        return;
    }
    let trace = TraceDir::new();
    let (mut a, mut b) = (
        endpoint("tr-a", &[LOOPBACK], len(), 71, ThreadSync::Default),
        endpoint("tr-b", &[LOOPBACK], len(), 72, ThreadSync::Default),
    );
    pair_up(&a.node, &b.node);
    write_once(&mut a, &mut b, 7311, (7301, 7302));
    drop((a, b)); // the reactors end and write their timelines
    let (s, r) = trace.sides(MANY * BLOCK);
    let (s, r) = (&s, &r);
    let request = s.keys().find(|k| k.0 == "submit").expect("a submission").1;
    let at = |side: &TraceSteps, step: &str, chunk: Option<u32>| {
        *side
            .get(&(step.to_string(), request, chunk))
            .unwrap_or_else(|| panic!("no {step} {chunk:?} for request {request}"))
    };
    let first_grant = at(s, "recv_GRANT", None);
    let mut chain = vec![
        ("queued", at(s, "queued", None)),
        ("submit", at(s, "submit", None)),
        ("send_WANT", at(s, "send_WANT", None)),
        ("recv_WANT", at(r, "recv_WANT", None)),
        ("send_GRANT", at(r, "send_GRANT", None)),
        ("recv_GRANT", first_grant),
    ];
    for c in 0..4 {
        let step = |side, name: &'static str| (name, at(side, name, Some(c)));
        assert!(at(s, "gather_start", Some(c)) <= at(s, "gather_done", Some(c)));
        assert!(
            at(s, "gather_done", Some(c)) <= at(s, "write_post", Some(c)),
            "chunk {c}"
        );
        let mut links = vec![
            ("recv_GRANT", first_grant),
            step(s, "write_post"),
            step(s, "write_done"),
            step(s, "send_DATA"),
            step(r, "recv_DATA"),
            step(r, "scatter_start"),
            step(r, "scatter_done"),
            step(r, "send_ACK"),
            step(s, "recv_ACK"),
        ];
        for w in links.windows(2) {
            assert!(w[0].1 <= w[1].1, "chunk {c}: {} after {}", w[0].0, w[1].0);
        }
        chain.push(links.pop().expect("recv_ACK"));
    }
    chain.push(("complete", at(s, "complete", None)));
    let last_ack = chain[6..10].iter().map(|l| l.1).max().expect("acks");
    for w in chain[..6].windows(2) {
        assert!(w[0].1 <= w[1].1, "{} after {}", w[0].0, w[1].0);
    }
    assert!(last_ack <= chain[10].1, "complete before the last ACK");
}

/// Blocks of a request large enough to be checked and packed on the
/// preparation's threads (8192 or more), so announced (`announce_writes`).
const LARGE: usize = 16_384;

/// Two agents paired, with buffers for [`LARGE`] blocks and three
/// preparation threads (the 2-core CI machine would have one).
fn large_pair(prefix: &str, seed: u64) -> (Endpoint, Endpoint) {
    let ex = [LOOPBACK, ("peer_map_prepare_threads", "3")];
    let size = blocks_for(LARGE) * BLOCK;
    let a = endpoint(&format!("{prefix}-a"), &ex, size, seed, ThreadSync::Default);
    let b = endpoint(
        &format!("{prefix}-b"),
        &ex,
        size,
        seed + 1,
        ThreadSync::Default,
    );
    pair_up(&a.node, &b.node);
    (a, b)
}

/// A WRITE announced before its plan (`announce_writes`) that is not what
/// its first descriptor foretold: its last block is half as long, so its
/// plan's last chunk is not the size announced. The announcement is
/// withdrawn (not counted as a failed transfer), the target's regions
/// granted for it are freed, and the WRITE itself goes through as a
/// request of its own, byte-exact.
#[test]
#[serial_test::serial]
fn a_write_whose_plan_differs_from_its_announcement_is_withdrawn() {
    if !ready("BOUNCE") {
        return;
    }
    let (mut a, mut b) = large_pair("wd", 61);
    let plan = Plan::standard(LARGE, BLOCK, 63);
    a.buf.fill_pattern(64);
    b.buf.fill_pattern(65);
    let lens: Vec<usize> = (0..LARGE)
        .map(|i| if i + 1 == LARGE { BLOCK / 2 } else { BLOCK })
        .collect();
    let list = |base: usize, offsets: &[usize]| {
        let mut l = nixl_sys::XferDescList::new(nixl_sys::MemType::Dram).expect("a list");
        for (o, len) in offsets.iter().zip(&lens) {
            l.add_desc(base + o, *len, 0);
        }
        l
    };
    let (local, remote) = (list(a.buf.addr(), &plan.src), list(b.buf.addr(), &plan.dst));
    let (sa, sb) = (stats(a.name()), stats(b.name()));
    let req = a
        .node
        .agent
        .create_xfer_req(XferOp::Write, &local, &remote, &b.node.name.clone(), None)
        .expect("create_xfer_req");
    a.node
        .post_and_wait(&req, wait_timeout())
        .or_fail("the WRITE with a shorter last block");
    drop(req);
    let (src, dst) = (a.buf.as_slice(), b.buf.as_slice());
    for ((s, d), len) in plan.src.iter().zip(&plan.dst).zip(&lens) {
        assert_eq!(&dst[*d..d + len], &src[*s..s + len], "block at {d:#x}");
    }
    b.buf.check_guards().or_fail("destination guards");
    let ea = stats_once(a.name(), &sa, "bounce_withdrawn", 1, Duration::from_secs(5));
    assert_sender_bounced(&sa, &ea, 1);
    assert_eq!(ea.since(&sa, "bounce_announced"), 1, "announced");
    assert_eq!(ea.since(&sa, "bounce_withdrawn"), 1, "withdrawn");
    assert_eq!(ea.since(&sa, "bounce_failed"), 0, "not a failed transfer");
    // The target granted regions for the WANT, and frees them at the CANCEL.
    let t0 = Instant::now();
    let full = sb.get("arena_free_bytes");
    while stats(b.name()).get("arena_free_bytes") != full {
        assert!(
            t0.elapsed() < Duration::from_secs(5),
            "the target's arena stays held"
        );
        std::thread::sleep(Duration::from_millis(1));
    }
    write_once(&mut a, &mut b, 66, (67, 68));
}

/// A 64 MiB WRITE of 16,384 blocks prepared on the pool's threads, its
/// chunks packed in slices: each chunk is handed to the announced request
/// as soon as it is packed (`bounce_chunks_ahead`), gathered and written
/// ahead of the plan, and the transfer is byte-exact.
#[test]
#[serial_test::serial]
fn a_large_write_takes_its_chunks_ahead_of_its_plan() {
    if !ready("BOUNCE") {
        return;
    }
    let (mut a, mut b) = large_pair("ca", 71);
    for seed in [73, 74] {
        let plan = Plan::standard(LARGE, BLOCK, seed);
        let (_, sa, ea) = write_plan(&mut a, &mut b, &plan, (seed + 10, seed + 20));
        assert_eq!(ea.since(&sa, "bounce_announced"), 1, "announced");
        assert_eq!(ea.since(&sa, "bounce_withdrawn"), 0, "withdrawn");
        let (ahead, chunks) = (
            ea.since(&sa, "bounce_chunks_ahead"),
            ea.since(&sa, "chunks_written"),
        );
        eprintln!("{seed}: {ahead} of {chunks} chunks taken ahead of the plan");
        assert!(
            chunks > 1 && ahead == chunks,
            "{ahead} of {chunks} chunks ahead"
        );
    }
}
