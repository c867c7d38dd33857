//! READ over the bounce path in one process: two BOUNCE agents (ZMQ control
//! on 127.0.0.1), 4096 scattered 4 KiB READs, byte-exact, each asserting
//! from the plugin's counters that the bounce path carried it (the reader
//! submitted and scattered, the owner served and wrote):
//! - both directions of one pair;
//! - a one-way pairing (only the reader loaded the owner's metadata, as
//!   vLLM's decode worker does): the owner learns how to write into the
//!   reader's arena from the READ itself;
//! - with a notification: the owner gets it only after the reader's
//!   destination holds every byte (NIXL's READ notification semantics);
//! - the same over the NIXL-notification control channel;
//! - a timeline (`NIXL_BOUNCE_TRACE`) whose steps line up across reader and
//!   owner;
//! - mixed READ and WRITE traffic in both directions at once, in the same
//!   arenas;
//! - a peer whose handshake lacks the READ capability is read through UCX
//!   (`fallback_peer_lacks_read`), as is a READ of few descriptors.
mod support;

use bounce::*;
use nixl_sys::{ThreadSync, XferOp};
use std::time::{Duration, Instant};
use support::*;

const MANY: usize = 4096;

fn len() -> usize {
    blocks_for(MANY) * BLOCK
}

/// The reader took the bounce path for `n` READs, the owner served them.
#[track_caller]
fn assert_read_bounced(
    (sr, er): (&Counters, &Counters),
    (so, eo): (&Counters, &Counters),
    n: u64,
    bytes: u64,
) {
    assert_reader_bounced(sr, er, n);
    let (dr, dow) = (er.diff(sr), eo.diff(so));
    assert_eq!(eo.since(so, "reads_served"), n, "owner reads_served; {dow}");
    assert_eq!(
        eo.since(so, "bytes_written"),
        bytes,
        "owner bytes_written; {dow}"
    );
    let chunks = eo.since(so, "chunks_written");
    assert!(chunks >= n, "owner chunks_written; {dow}");
    assert_eq!(
        er.since(sr, "chunks_scattered"),
        chunks,
        "reader scattered what the owner wrote; {dr}"
    );
    assert_eq!(er.since(sr, "scatter_refused"), 0, "{dr}");
    assert!(er.poisoned.is_none() && eo.poisoned.is_none());
}

/// One bounce READ by `reader` from `owner`, byte-exact and counted.
fn read_once(
    reader: &mut Endpoint,
    owner: &mut Endpoint,
    plan_seed: u64,
    seeds: (u64, u64),
) -> Duration {
    let plan = Plan::standard(MANY, BLOCK, plan_seed);
    reader.buf.fill_pattern(seeds.0);
    owner.buf.fill_pattern(seeds.1);
    let (src, dst_before) = (
        owner.buf.as_slice().to_vec(),
        reader.buf.as_slice().to_vec(),
    );
    let (sr, so) = (stats(reader.name()), stats(owner.name()));
    let req = read_request(reader, owner, &plan, None);
    let dt = reader
        .node
        .post_and_wait(&req, wait_timeout())
        .or_fail(&format!("READ {} <- {}", reader.name(), owner.name()));
    drop(req);
    plan.verify(reader.buf.as_slice(), &dst_before, &src)
        .or_fail("destination");
    verify_bytes(owner.buf.as_slice(), &src, |_| "source".into()).or_fail("source changed");
    reader.buf.check_guards().or_fail("destination guards");
    owner.buf.check_guards().or_fail("source guards");
    let er = stats(reader.name());
    let eo = stats_once(owner.name(), &so, "reads_served", 1, wait_timeout());
    eprintln!(
        "{} <- {}: {dt:?}; {} ; {}",
        reader.name(),
        owner.name(),
        er.diff(&sr),
        eo.diff(&so)
    );
    assert_read_bounced((&sr, &er), (&so, &eo), 1, (MANY * BLOCK) as u64);
    dt
}

fn both_directions(ex: &[(&str, &str)], seed: u64) {
    let mut a = endpoint("rd-a", ex, len(), seed, ThreadSync::Default);
    let mut b = endpoint("rd-b", ex, len(), seed + 1, ThreadSync::Default);
    pair_up(&a.node, &b.node);
    let s = 100 * seed;
    read_once(&mut a, &mut b, s + 11, (s + 101, s + 102));
    read_once(&mut b, &mut a, s + 12, (s + 103, s + 104));
    read_once(&mut a, &mut b, s + 13, (s + 105, s + 106));
    read_once(&mut b, &mut a, s + 14, (s + 107, s + 108));
}

#[test]
#[serial_test::serial]
fn read_4096_both_directions() {
    if !ready("BOUNCE") {
        return;
    }
    both_directions(&[LOOPBACK], 1);
}

#[test]
#[serial_test::serial]
fn read_4096_both_directions_over_nixl_notifications() {
    if !ready("BOUNCE") {
        return;
    }
    both_directions(&[NOTIF_CONTROL], 11);
}

#[test]
#[serial_test::serial]
fn read_4096_one_way_pairing() {
    if !ready("BOUNCE") {
        return;
    }
    for (ex, seed) in [(LOOPBACK, 5), (NOTIF_CONTROL, 15)] {
        let mut r = endpoint("rd-r", &[ex], len(), seed, ThreadSync::Default);
        let mut o = endpoint("rd-o", &[ex], len(), seed + 1, ThreadSync::Default);
        // Only the reader knows the owner (all a UCX READ needs).
        load(&r.node, &o.node);
        read_once(&mut r, &mut o, 31 + seed, (121, 122));
        read_once(&mut r, &mut o, 32 + seed, (123, 124));
    }
}

/// The owner polls for the READ's notification; the moment it shows up the
/// reader's destination must already hold every byte.
#[test]
#[serial_test::serial]
fn read_notification_reaches_the_owner_after_the_data_is_in_place() {
    if !ready("BOUNCE") {
        return;
    }
    let mut r = endpoint("rn-r", &[LOOPBACK], len(), 41, ThreadSync::Default);
    let mut o = endpoint("rn-o", &[LOOPBACK], len(), 42, ThreadSync::Default);
    pair_up(&r.node, &o.node);
    let plan = Plan::standard(MANY, BLOCK, 43);
    r.buf.fill_pattern(44);
    o.buf.fill_pattern(45);
    let (src, dst_before) = (o.buf.as_slice().to_vec(), r.buf.as_slice().to_vec());
    let expected = plan.expected(&dst_before, &src);
    let (sr, so) = (stats(r.name()), stats(o.name()));
    let msg = b"read-done-7";
    let req = read_request(&r, &o, &plan, Some(msg));
    post(&r.node, &req).or_fail("post READ");
    let t0 = Instant::now();
    let mut spins = 0;
    let mut reader_done = false;
    loop {
        if !reader_done {
            reader_done = poll(&r.node, &req).or_fail("READ status");
        }
        let notifs = take_notifs(&o.node).or_fail("owner notifications");
        if notifs.iter().any(|(from, m)| from == r.name() && m == msg) {
            verify_bytes(r.buf.as_slice(), &expected, |_| "reader destination".into())
                .or_fail("destination incomplete when the owner got the notification");
            break;
        }
        check_deadline(t0, wait_timeout(), &|| "READ notification".into());
        pause(&mut spins);
    }
    while !poll(&r.node, &req).or_fail("READ status") {
        check_deadline(t0, wait_timeout(), &|| "READ completion".into());
        pause(&mut spins);
    }
    drop(req);
    let er = stats(r.name());
    let eo = stats_once(o.name(), &so, "reads_served", 1, wait_timeout());
    assert_read_bounced((&sr, &er), (&so, &eo), 1, (MANY * BLOCK) as u64);
}

/// READs and WRITEs in both directions at once, all in flight together,
/// through the same two arenas: every destination byte-exact, every
/// transfer on the bounce path.
#[test]
#[serial_test::serial]
fn mixed_read_and_write_traffic_in_both_directions() {
    if !ready("BOUNCE") {
        return;
    }
    const N: usize = 1024;
    const SLICES: usize = 4;
    let slice = blocks_for(N);
    let ex = [
        LOOPBACK,
        ("arena_size_bytes", "8MiB"),
        ("max_chunk_size_bytes", "1MiB"),
    ];
    let a = endpoint("mx-a", &ex, SLICES * slice * BLOCK, 51, ThreadSync::Default);
    let b = endpoint("mx-b", &ex, SLICES * slice * BLOCK, 52, ThreadSync::Default);
    pair_up(&a.node, &b.node);
    let (a_before, b_before) = (a.buf.as_slice().to_vec(), b.buf.as_slice().to_vec());
    let (sa, sb) = (stats(a.name()), stats(b.name()));
    // Slice k of each buffer is the source (k even) or destination (k odd)
    // of one transfer, so that none overlaps another.
    // 0: a WRITEs a[0] -> b[1]; 1: a READs b[0] -> a[1];
    // 2: b WRITEs b[2] -> a[3]; 3: b READs a[2] -> b[3].
    let plans: Vec<Plan> = (0..4)
        .map(|k| plan_in(N, BLOCK, 0, slice, 0, slice, 60 + k as u64))
        .collect();
    let off = |s: usize| s * slice * BLOCK;
    let reqs = [
        (
            &a,
            a.node.create_xfer(
                XferOp::Write,
                &plans[0],
                a.buf.addr() + off(0),
                b.buf.addr() + off(1),
                b.name(),
                None,
            ),
        ),
        (
            &a,
            a.node.create_xfer(
                XferOp::Read,
                &plans[1],
                a.buf.addr() + off(1),
                b.buf.addr() + off(0),
                b.name(),
                None,
            ),
        ),
        (
            &b,
            b.node.create_xfer(
                XferOp::Write,
                &plans[2],
                b.buf.addr() + off(2),
                a.buf.addr() + off(3),
                a.name(),
                None,
            ),
        ),
        (
            &b,
            b.node.create_xfer(
                XferOp::Read,
                &plans[3],
                b.buf.addr() + off(3),
                a.buf.addr() + off(2),
                a.name(),
                None,
            ),
        ),
    ];
    let reqs: Vec<_> = reqs
        .into_iter()
        .map(|(e, r)| (e, r.or_fail("create_xfer_req")))
        .collect();
    for (e, r) in &reqs {
        post(&e.node, r).or_fail("post");
    }
    let t0 = Instant::now();
    let mut spins = 0;
    let mut done = [false; 4];
    while done.iter().any(|d| !d) {
        for (i, (e, r)) in reqs.iter().enumerate() {
            if !done[i] {
                done[i] = poll(&e.node, r).or_fail(&format!("transfer {i}"));
            }
        }
        check_deadline(t0, wait_timeout(), &|| format!("mixed transfers {done:?}"));
        pause(&mut spins);
    }
    drop(reqs);
    let slice_of = |buf: &[u8], s: usize| buf[off(s)..off(s + 1)].to_vec();
    let checks = [
        (
            "a WRITE -> b[1]",
            &plans[0],
            slice_of(b.buf.as_slice(), 1),
            slice_of(&b_before, 1),
            slice_of(&a_before, 0),
        ),
        (
            "a READ b[0] -> a[1]",
            &plans[1],
            slice_of(a.buf.as_slice(), 1),
            slice_of(&a_before, 1),
            slice_of(&b_before, 0),
        ),
        (
            "b WRITE -> a[3]",
            &plans[2],
            slice_of(a.buf.as_slice(), 3),
            slice_of(&a_before, 3),
            slice_of(&b_before, 2),
        ),
        (
            "b READ a[2] -> b[3]",
            &plans[3],
            slice_of(b.buf.as_slice(), 3),
            slice_of(&b_before, 3),
            slice_of(&a_before, 2),
        ),
    ];
    for (what, plan, after, before, src) in checks {
        plan.verify(&after, &before, &src).or_fail(what);
    }
    for s in [0, 2] {
        verify_bytes(
            &slice_of(a.buf.as_slice(), s),
            &slice_of(&a_before, s),
            |_| "a source".into(),
        )
        .or_fail("a's sources changed");
        verify_bytes(
            &slice_of(b.buf.as_slice(), s),
            &slice_of(&b_before, s),
            |_| "b source".into(),
        )
        .or_fail("b's sources changed");
    }
    let (ea, eb) = (stats(a.name()), stats(b.name()));
    eprintln!("a: {}\nb: {}", ea.diff(&sa), eb.diff(&sb));
    for (e, s, name) in [(&ea, &sa, "a"), (&eb, &sb, "b")] {
        assert_eq!(
            e.since(s, "bounce_submitted"),
            2,
            "{name}: one WRITE and one READ: {}",
            e.diff(s)
        );
        assert_eq!(e.since(s, "bounce_succeeded"), 2, "{name}: {}", e.diff(s));
        assert_eq!(
            e.since(s, "reads_served"),
            1,
            "{name} served the peer's READ: {}",
            e.diff(s)
        );
        assert_eq!(
            e.since(s, "bytes_written"),
            2 * (N * BLOCK) as u64,
            "{name}: its WRITE and the READ it served"
        );
        assert!(e.poisoned.is_none());
    }
}

/// A READ of few descriptors, and a READ from a peer that does not serve
/// READs (its handshake lacks the capability), go through UCX, byte-exact.
#[test]
#[serial_test::serial]
fn reads_the_bounce_path_cannot_serve_use_ucx() {
    if !ready("BOUNCE") {
        return;
    }
    let r = endpoint("rf-r", &[LOOPBACK], len(), 71, ThreadSync::Default);
    let o = endpoint("rf-o", &[LOOPBACK], len(), 72, ThreadSync::Default);
    pair_up(&r.node, &o.node);
    let plan = Plan::standard(16, BLOCK, 73);
    let (src, dst_before) = (o.buf.as_slice().to_vec(), r.buf.as_slice().to_vec());
    let sr = stats(r.name());
    let req = read_request(&r, &o, &plan, None);
    r.node
        .post_and_wait(&req, wait_timeout())
        .or_fail("READ 16 x 4 KiB");
    drop(req);
    plan.verify(r.buf.as_slice(), &dst_before, &src)
        .or_fail("destination");
    assert_fell_back(&sr, &stats(r.name()), 1, "fallback_too_few_descriptors");
    drop((r, o));

    // An owner advertising no READ (its handshake without the capability,
    // as a BOUNCE built before READ publishes it).
    let mut r = endpoint("rf-r2", &[LOOPBACK], len(), 74, ThreadSync::Default);
    std::env::set_var("NIXL_BOUNCE_FAILPOINTS", "advertise_no_read");
    let o = endpoint("rf-o2", &[LOOPBACK], len(), 75, ThreadSync::Default);
    std::env::remove_var("NIXL_BOUNCE_FAILPOINTS");
    pair_up(&r.node, &o.node);
    let plan = Plan::standard(MANY, BLOCK, 76);
    r.buf.fill_pattern(77);
    let (src, dst_before) = (o.buf.as_slice().to_vec(), r.buf.as_slice().to_vec());
    let (sr, so) = (stats(r.name()), stats(o.name()));
    let req = read_request(&r, &o, &plan, None);
    r.node
        .post_and_wait(&req, wait_timeout())
        .or_fail("READ from an owner without READ");
    drop(req);
    plan.verify(r.buf.as_slice(), &dst_before, &src)
        .or_fail("destination");
    assert_fell_back(&sr, &stats(r.name()), 1, "fallback_peer_lacks_read");
    assert_eq!(stats(o.name()).since(&so, "reads_served"), 0);
    // WRITEs to that peer still take the bounce path.
    let sr = stats(r.name());
    let req = write_request(&r, &o, &Plan::standard(MANY, BLOCK, 78));
    r.node
        .post_and_wait(&req, wait_timeout())
        .or_fail("WRITE to an owner without READ");
    drop(req);
    assert_sender_bounced(&sr, &stats(r.name()), 1);
}

/// With `NIXL_BOUNCE_TRACE` set, a 16 MiB READ's steps line up across the
/// reader and the data owner, who serves it under an id of its own but
/// records its steps under the reader's: each chunk's gather, write and
/// READ_DATA on the owner, then its scatter and READ_ACK on the reader.
#[test]
#[serial_test::serial]
fn a_trace_lines_up_a_reads_steps_across_both_sides() {
    if !ready("BOUNCE") {
        return;
    }
    let trace = TraceDir::new();
    let mut reader = endpoint("trr-a", &[LOOPBACK], len(), 81, ThreadSync::Default);
    let mut owner = endpoint("trr-b", &[LOOPBACK], len(), 82, ThreadSync::Default);
    pair_up(&reader.node, &owner.node);
    read_once(&mut reader, &mut owner, 8111, (8101, 8102));
    drop((reader, owner));
    let (r, o) = trace.sides(MANY * BLOCK);
    let request = r.keys().find(|k| k.0 == "submit").expect("a submission").1;
    let at = |side: &TraceSteps, step: &str, chunk: Option<u32>| {
        *side
            .get(&(step.to_string(), request, chunk))
            .unwrap_or_else(|| panic!("no {step} {chunk:?} for request {request}"))
    };
    let (submit, read_in) = (at(&r, "submit", None), at(&o, "recv_READ", None));
    assert!(submit <= at(&r, "send_READ", None) && at(&r, "send_READ", None) <= read_in);
    let mut last = 0;
    for c in 0..4 {
        let links = [
            ("recv_READ", read_in),
            ("gather_start", at(&o, "gather_start", Some(c))),
            ("gather_done", at(&o, "gather_done", Some(c))),
            ("write_post", at(&o, "write_post", Some(c))),
            ("write_done", at(&o, "write_done", Some(c))),
            ("send_READ_DATA", at(&o, "send_READ_DATA", Some(c))),
            ("recv_READ_DATA", at(&r, "recv_READ_DATA", Some(c))),
            ("scatter_start", at(&r, "scatter_start", Some(c))),
            ("scatter_done", at(&r, "scatter_done", Some(c))),
        ];
        for w in links.windows(2) {
            assert!(w[0].1 <= w[1].1, "chunk {c}: {} after {}", w[0].0, w[1].0);
        }
        last = last.max(links[8].1);
    }
    assert!(
        last <= at(&r, "complete", None),
        "complete before the last scatter"
    );
}
