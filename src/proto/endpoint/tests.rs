//! The endpoint's unit tests: both roles of two endpoints, driven by
//! `proto::driver`'s `Pair` or, for forged and single-endpoint cases, by
//! hand.

use super::*;
use crate::proto::credit::Owner;
use crate::proto::driver::{
    Gather, Pair,
    Side::{A, B},
};
use crate::proto::wire::{Claim, Credit, RefuseReason, StandingUse};

/// Copy launches wait behind every other action (each line in its
/// order); with `launches_last` off, one line in the order of arrival.
#[test]
fn copy_launches_go_after_the_other_actions() {
    let chunk = |c: u32| ChunkRef {
        request: RequestId(7),
        chunk: c,
    };
    let gather = |c: u32| Action::StartGather {
        chunk: chunk(c),
        region: RegionHandle(u64::from(c)),
        runs: Vec::new().into(),
    };
    let scatter = |c: u32| Action::StartScatter {
        flow: FlowId::write(PeerId::new("p"), RequestId(9)),
        chunk: c,
        region: RegionHandle(100 + u64::from(c)),
        runs: Vec::new().into(),
    };
    let write = |c: u32| Action::PostWrite {
        chunk: chunk(c),
        peer: PeerId::new("p"),
        local: RegionHandle(u64::from(c)),
        remote: RegionHandle(50),
        len: 1,
    };
    let cause = |c: &str| Action::Poisoned { cause: c.into() };
    let name = |a: &Action| match a {
        Action::StartGather { chunk, .. } => format!("G{}", chunk.chunk),
        Action::StartScatter { chunk, .. } => format!("S{chunk}"),
        Action::PostWrite { chunk, .. } => format!("W{}", chunk.chunk),
        Action::Poisoned { cause } => cause.clone(),
        other => format!("{other:?}"),
    };
    for (last, want) in [
        (true, "W0 x W1 y G0 S0 G1 S1"),
        (false, "G0 W0 S0 x G1 W1 S1 y"),
    ] {
        let mut q = ActionQueue::new(last);
        for a in [gather(0), write(0), scatter(0), cause("x")] {
            q.push_back(a);
        }
        let mut got = vec![name(&q.pop_front().unwrap())];
        for a in [gather(1), write(1), scatter(1), cause("y")] {
            q.push_back(a);
        }
        while let Some(a) = q.pop_front() {
            got.push(name(&a));
        }
        assert!(q.is_empty());
        let want: Vec<&str> = want.split(' ').collect();
        assert_eq!(got, want, "launches_last = {last}");
    }
    // What the reactor takes after reading a message: no launch, when
    // launches are held back.
    for (last, want) in [(true, "W0 -"), (false, "G0 W0")] {
        let mut q = ActionQueue::new(last);
        q.push_back(gather(0));
        q.push_back(write(0));
        let got: Vec<String> = (0..2)
            .map(|_| q.pop_other().map_or("-".into(), |a| name(&a)))
            .collect();
        assert_eq!(got.join(" "), want, "launches_last = {last}");
    }
}

fn cfg(eager: bool) -> EndpointConfig {
    EndpointConfig {
        arena_capacity: 4096,
        granularity: 64,
        max_chunk: 1024,
        // These tests count chunks: cut by the cap alone.
        min_chunks: 1,
        min_chunk: 0,
        window: 2,
        request_timeout: Duration::from_millis(10),
        request_deadline: None,
        flow_idle_timeout: Duration::from_millis(20),
        tombstone_ttl: Duration::from_millis(40),
        access_key: 0,
        eager_gather: eager,
        launches_last: false,
        merge_runs: true,
        local_reserve: true,
        standing_slots: 0,
        local_endpoint: b"ep".to_vec(),
        request_id_base: 100,
        incarnation: 100,
    }
}

fn drain(ep: &mut Endpoint) -> Vec<Action> {
    std::iter::from_fn(|| ep.poll_action()).collect()
}

fn descs(n: u64, len: u64) -> Vec<Descriptor> {
    (0..n)
        .map(|i| Descriptor {
            src_addr: 0x1000 + i * len,
            src_dev: 0,
            dst_addr: 0x9000 + i * 2 * len,
            dst_dev: 0,
            len,
        })
        .collect()
}

fn sent(actions: &[Action]) -> Vec<&Message> {
    actions
        .iter()
        .filter_map(|a| match a {
            Action::Send { message, .. } => Some(message),
            _ => None,
        })
        .collect()
}

fn completes(actions: &[Action]) -> Vec<(RequestId, Outcome)> {
    actions
        .iter()
        .filter_map(|a| match a {
            Action::Complete { request, outcome } => Some((*request, *outcome)),
            _ => None,
        })
        .collect()
}

fn t(ms: u64) -> Time {
    Time::from_millis(ms)
}

/// A pair of endpoints with the tests' configuration: `a` and `b` by name.
fn pair(a: &str, b: &str, eager: bool) -> Pair {
    Pair::new(
        (a, Endpoint::new(cfg(eager)).unwrap()),
        (b, Endpoint::new(cfg(eager)).unwrap()),
    )
}

/// A reader `R` (side A, its data path `dp`) and an owner `O` (side B)
/// that exports `[0x1000, 0x2000)`.
fn read_pair() -> Pair {
    let mut reader = Endpoint::new(cfg(false)).unwrap();
    reader.set_read_data_path(b"dp".to_vec());
    let mut owner = Endpoint::new(cfg(false)).unwrap();
    owner.set_source_check(Box::new(Allow(0x1000, 0x2000)));
    Pair::new(("R", reader), ("O", owner))
}

/// Both endpoints' invariants hold.
fn check(p: &Pair) {
    p.a.ep.check_invariants().unwrap();
    p.b.ep.check_invariants().unwrap();
}

/// One chunk end to end, one step at a time.
#[test]
fn one_chunk_end_to_end() {
    let mut p = pair("A", "B", false);
    let d = descs(4, 100);
    let id = p.a.ep.submit(p.now, &p.b.name, &d).unwrap();
    assert_eq!(id, RequestId(100));
    p.deliver(B);
    assert!(
        matches!(&p.b.take_events()[..], [Action::Connect { peer, endpoint }] if *peer == p.a.name && endpoint == b"ep")
    );
    assert!(matches!(&p.b.sent[..], [Message::Grant { .. }]));
    p.deliver(A);
    let [g] = p.a.gathers.make_contiguous() else {
        panic!("{:?}", p.a.gathers)
    };
    assert_eq!(
        g.runs.len(),
        1,
        "4 dense descriptors gather as one strided run"
    );
    assert!(matches!(
        p.a.ep.region_owner(g.region),
        Some(Owner::Local { eager: false })
    ));
    p.gather(A);
    let w = p.a.writes[0].clone();
    assert_eq!(w.len, 3 * 128 + 100);
    assert!(matches!(p.b.ep.region_owner(w.remote), Some(Owner::Flow(f)) if f.peer == p.a.name));
    p.write(A);
    assert_eq!(
        p.a.ep.arena_usage().local,
        0,
        "staging released at write completion"
    );
    p.deliver(B);
    assert_eq!(p.b.scatters.len(), 1);
    p.scatter(B);
    assert!(matches!(p.b.sent.last(), Some(Message::Ack { .. })));
    assert_eq!(p.b.ep.flow_count(), 0);
    p.deliver(A);
    assert_eq!(p.a.completed, vec![(id, Outcome::Success)]);
    assert_eq!(p.a.ep.request_count(), 0);
    assert!(p.b.holds_copy_of(&p.a, &d));
    check(&p);
}

/// WRITEs and READs of several chunks each, both ways at once, driven to
/// the end: byte-exact, nothing left behind.
#[test]
fn writes_and_reads_both_ways_drive_to_the_end() {
    let mut p = pair("A", "B", true);
    for side in [A, B] {
        p.node(side)
            .ep
            .set_source_check(Box::new(Allow(0x1000, 0x9000)));
        p.node(side).ep.set_read_data_path(b"dp".to_vec());
    }
    // 20 x 150 bytes: 3 chunks of at most 1024 each way; the READ's
    // destinations lie apart from the WRITE's.
    let d = descs(20, 150);
    let rd: Vec<Descriptor> = d
        .iter()
        .map(|x| Descriptor {
            dst_addr: x.dst_addr + 0x3000,
            ..*x
        })
        .collect();
    assert!(!p.b.holds_copy_of(&p.a, &rd), "the READ has bytes to move");
    let w = p.a.ep.submit(p.now, &p.b.name, &d).unwrap();
    let r = p.b.ep.submit_read(p.now, &p.a.name, &rd, None).unwrap();
    p.drive();
    assert_eq!(p.a.completed, vec![(w, Outcome::Success)]);
    assert_eq!(p.b.completed, vec![(r, Outcome::Success)]);
    // B's destinations of both hold A's sources.
    assert!(p.b.holds_copy_of(&p.a, &d) && p.b.holds_copy_of(&p.a, &rd));
    assert_eq!(p.a.ep.stats().reads_served, 1);
    for node in [&p.a, &p.b] {
        assert_eq!((node.ep.request_count(), node.ep.flow_count()), (0, 0));
        assert_eq!(node.ep.arena_usage().local, 0);
    }
    check(&p);
}

/// Admits sources inside [lo, hi).
struct Allow(u64, u64);

impl SourceCheck for Allow {
    fn check(&self, _reader: &PeerId, runs: &[crate::proto::Run]) -> Result<(), String> {
        for r in runs {
            for (_, addr, len) in r.copies() {
                if addr < self.0 || addr + len > self.1 {
                    return Err(format!("{addr:#x}+{len} not registered"));
                }
            }
        }
        Ok(())
    }
}

/// An owner given its own data path is sent that one, the others the
/// instance's, until it is forgotten.
#[test]
fn a_peer_s_own_data_path_goes_only_to_it() {
    let (o, other) = (PeerId::new("O"), PeerId::new("P"));
    let mut reader = Endpoint::new(cfg(false)).unwrap();
    reader.set_read_data_path(b"v2".to_vec());
    reader.set_peer_data_path(&o, Some(b"v1".to_vec()));
    let path_to = |reader: &mut Endpoint, peer: &PeerId, at: u64| {
        reader
            .submit_read(t(at), peer, &descs(1, 64), None)
            .unwrap();
        let acts = drain(reader);
        match sent(&acts)[0] {
            Message::Read { data_path, .. } => data_path.clone(),
            _ => panic!("{acts:?}"),
        }
    };
    assert_eq!(path_to(&mut reader, &o, 0), b"v1");
    assert_eq!(path_to(&mut reader, &other, 1), b"v2");
    reader.forget_peer(t(2), &o);
    assert_eq!(path_to(&mut reader, &o, 3), b"v2");
    // Set again, then cleared (the peer loaded anew with the capability).
    reader.set_peer_data_path(&o, Some(b"v1".to_vec()));
    assert_eq!(path_to(&mut reader, &o, 4), b"v1");
    reader.set_peer_data_path(&o, None);
    assert_eq!(path_to(&mut reader, &o, 5), b"v2");
}

/// One READ end to end, one step at a time (`descs`: the owner's memory,
/// the source, at 0x1000.., the reader's destinations at 0x9000..).
#[test]
fn one_read_end_to_end() {
    let mut p = read_pair();
    let d = descs(4, 100);
    let id = p.a.ep.submit_read(p.now, &p.b.name, &d, None).unwrap();
    p.poll();
    let [Message::Read {
        chunks, data_path, ..
    }, Message::ReadGrant { credits, .. }] = &p.a.sent[..]
    else {
        panic!("a READ, then its READ_GRANT: {:?}", p.a.sent)
    };
    assert_eq!(data_path, b"dp");
    assert_eq!(chunks.len(), 1);
    assert_eq!(chunks[0].size, 3 * 128 + 100);
    let region = credits[0].region;
    assert!(
        matches!(p.a.ep.region_owner(region), Some(Owner::Flow(f)) if f.kind == crate::proto::FlowKind::Read && f.peer == p.b.name)
    );
    p.deliver(B);
    assert!(p.b.events.iter().any(
        |a| matches!(a, Action::LoadDataPath { peer, data_path } if *peer == p.a.name && data_path == b"dp")
    ));
    let g = p.b.gathers[0].clone();
    assert_eq!(g.runs[0].addr, 0x1000, "the owner gathers its own memory");
    assert_eq!(p.b.ep.serves_read(g.chunk.request), Some(id));
    p.gather(B);
    let w = p.b.writes[0].clone();
    assert_eq!((w.remote, &w.peer), (region, &p.a.name));
    p.write(B);
    assert_eq!(
        p.b.sent,
        vec![Message::ReadData {
            request: id,
            chunk: 0,
            region
        }]
    );
    p.deliver(A);
    assert_eq!(
        p.a.scatters[0].runs[0].addr, 0x9000,
        "the reader scatters by its own plan"
    );
    p.scatter(A);
    assert_eq!(p.a.completed, vec![(id, Outcome::Success)]);
    assert!(matches!(p.a.sent.last(), Some(Message::ReadAck { .. })));
    p.deliver(B);
    assert!(
        p.b.completed.is_empty(),
        "nothing local waits on a served READ"
    );
    assert_eq!(p.b.ep.stats().reads_served, 1);
    assert_eq!((p.b.ep.request_count(), p.a.ep.request_count()), (0, 0));
    assert_eq!(p.a.ep.flow_count(), 0);
    assert!(p.a.holds_copy_of(&p.b, &d));
    check(&p);
}

#[test]
fn a_grant_for_a_serve_that_ended_is_ignored_not_held() {
    let mut p = read_pair();
    p.a.ep
        .submit_read(p.now, &p.b.name, &descs(4, 100), None)
        .unwrap();
    p.deliver(B);
    let grant = p.a.sent[1].clone();
    // The gather fails: the serve ends (READ_END) and is removed.
    let g = p.b.gathers.pop_front().expect("a gather");
    p.b.ep.handle_gather_failed(p.now, g.chunk, true);
    p.poll();
    let sent = p.b.take_sent();
    assert!(
        sent.iter().any(|m| matches!(m, Message::ReadEnd { .. })),
        "{sent:?}"
    );
    assert_eq!(p.b.ep.request_count(), 0);
    // A READ_GRANT the reader sent meanwhile arrives late: nothing is
    // held for it (it would wait a request timeout for a READ that never
    // comes) and no second READ_END is sent.
    p.b.ep.handle_message(p.now, &p.a.name, grant);
    p.poll();
    assert!(p.b.sent.is_empty(), "{:?}", p.b.sent);
    assert_eq!(p.b.ep.request_count(), 0, "credits held for an ended serve");
    check(&p);
}

#[test]
fn a_read_whose_message_would_not_fit_the_channel_is_refused() {
    use crate::proto::plan::Chunk;
    let mut reader = Endpoint::new(cfg(false)).unwrap();
    reader.set_read_data_path(b"dp".to_vec());
    // One chunk of more source copies than a message may carry (16
    // bytes each on the wire, 24 MB: the entry limit, not the byte
    // limit, refuses it).
    let n = super::super::wire::MAX_MESSAGE_RUNS + 1;
    let runs: Runs = (0..n as u64)
        .map(|i| crate::proto::Run::single(0, 0x1000 + 64 * i, 32))
        .collect();
    let plan = Arc::new(Plan {
        chunks: vec![Chunk {
            bytes: 32,
            gather_runs: runs.clone(),
            scatter_runs: runs,
            pieces: n as u32,
        }],
        src_dev: 0,
        dst_dev: 0,
        payload_bytes: 32 * n as u64,
    });
    let err = reader
        .submit_read_plan(t(0), &PeerId::new("O"), plan, None)
        .unwrap_err();
    assert!(
        matches!(err, SubmitError::ReadTooLarge { entries, .. } if entries == n),
        "{err}"
    );
    assert!(err.to_string().contains("split the transfer"), "{err}");
    assert!(drain(&mut reader).is_empty(), "nothing sent, nothing held");
    assert_eq!((reader.request_count(), reader.flow_count()), (0, 0));
}

#[test]
fn write_messages_naming_a_serve_are_ignored() {
    let mut p = read_pair();
    p.a.ep
        .submit_read(p.now, &p.b.name, &descs(4, 100), None)
        .unwrap();
    p.deliver(B);
    // The serve's gather, set aside while the forged messages arrive.
    let gather = p.b.gathers.pop_front().expect("a gather");
    assert!(p.b.gathers.is_empty());
    let Gather { chunk, region, .. } = gather.clone();
    let ignored = p.b.ep.stats().ignored;
    p.b.take_sent();
    p.b.take_events();
    // A faulty reader names the owner's local serve id in WRITE messages.
    for m in [
        Message::Ack {
            request: chunk.request,
            chunk: 0,
            region,
        },
        Message::Refuse {
            request: chunk.request,
            reason: super::super::wire::RefuseReason::Expired,
        },
    ] {
        p.b.ep.handle_message(p.now, &p.a.name, m);
    }
    p.poll();
    assert!(p.b.is_quiet(), "nothing answers them, nothing else starts");
    assert_eq!(p.b.ep.stats().ignored, ignored + 2);
    // The serve goes on.
    p.b.gathers.push_back(gather);
    p.gather(B);
    assert_eq!(p.b.writes.len(), 1);
    check(&p);
}

#[test]
fn read_of_unregistered_memory_is_refused_before_anything_is_read() {
    let mut p = read_pair();
    // Registered: only the first 200 bytes of the 4 x 100 sources.
    p.b.ep
        .set_source_check(Box::new(Allow(0x1000, 0x1000 + 200)));
    let id =
        p.a.ep
            .submit_read(p.now, &p.b.name, &descs(4, 100), None)
            .unwrap();
    p.deliver(B);
    assert!(
        p.b.gathers.is_empty()
            && !p
                .b
                .events
                .iter()
                .any(|a| matches!(a, Action::LoadDataPath { .. })),
        "nothing is read"
    );
    assert_eq!(
        p.b.sent[0],
        Message::ReadEnd {
            request: id,
            reason: RefuseReason::SourceRefused
        }
    );
    assert_eq!(p.b.ep.stats().reads_refused, 1);
    p.deliver(A);
    assert_eq!(
        p.a.completed,
        vec![(id, Outcome::Failure(FailureReason::SourceRefused))]
    );
    let usage = p.a.ep.arena_usage();
    assert_eq!(usage.flows + usage.quarantine, 0);
    check(&p);
}

#[test]
fn cancelled_read_quarantines_until_the_owner_ends() {
    let mut p = read_pair();
    let id =
        p.a.ep
            .submit_read(p.now, &p.b.name, &descs(2, 64), None)
            .unwrap();
    p.deliver(B);
    p.gather(B);
    assert_eq!(p.b.writes.len(), 1);
    // The reader gives up while the owner's write is in flight.
    assert!(p.a.ep.cancel(p.now, id));
    p.a.take_sent();
    p.poll();
    assert_eq!(
        p.a.completed,
        vec![(id, Outcome::Failure(FailureReason::Cancelled))]
    );
    assert!(
        p.a.ep.arena_usage().quarantine > 0,
        "the owner may still write"
    );
    assert!(matches!(p.a.sent[..], [Message::ReadRefuse { .. }]));
    p.b.take_sent();
    p.deliver(B);
    assert!(p.b.sent.is_empty(), "no READ_END while the write may land");
    p.write(B);
    assert!(
        matches!(p.b.sent[..], [Message::ReadEnd { .. }]),
        "{:?}",
        p.b.sent
    );
    assert_eq!(p.b.ep.request_count(), 0);
    p.deliver(A);
    assert_eq!(p.a.ep.arena_usage().quarantine, 0);
    assert_eq!(p.a.ep.request_count(), 0);
    check(&p);
}

#[test]
fn read_with_a_wrong_key_is_refused() {
    let mut c = cfg(false);
    c.access_key = 77;
    let mut owner = Endpoint::new(c).unwrap();
    owner.set_source_check(Box::new(Allow(0, u64::MAX / 2)));
    let mut p = Pair::new(("R", Endpoint::new(cfg(false)).unwrap()), ("O", owner));
    let id =
        p.a.ep
            .submit_read(p.now, &p.b.name, &descs(2, 64), None)
            .unwrap();
    p.deliver(B);
    assert_eq!(
        p.b.sent,
        vec![Message::ReadEnd {
            request: id,
            reason: RefuseReason::ProtocolViolation
        }]
    );
    assert_eq!(p.b.ep.stats().unauthorized, 1);
}

#[test]
fn empty_transfer_succeeds_at_once() {
    let mut tx = Endpoint::new(cfg(true)).unwrap();
    let id = tx.submit(t(0), &PeerId::new("B"), &descs(3, 0)).unwrap();
    assert_eq!(completes(&drain(&mut tx)), vec![(id, Outcome::Success)]);
}

#[test]
fn cancel_is_deferred_until_the_write_ends() {
    let b = PeerId::new("B");
    let mut tx = Endpoint::new(cfg(true)).unwrap();
    let id = tx.submit(t(0), &b, &descs(2, 64)).unwrap();
    let acts = drain(&mut tx);
    let Action::StartGather { chunk, .. } = acts[1].clone() else {
        panic!("{acts:?}")
    };
    tx.handle_message(
        t(1),
        &b,
        Message::Grant {
            request: id,
            credits: vec![Credit {
                chunk: 0,
                region: RegionHandle(0),
                len: 4096,
            }],
        },
    );
    // Eager gather in flight: the credit only promotes it.
    assert!(drain(&mut tx).is_empty());
    tx.handle_gather_done(t(2), chunk);
    assert!(matches!(drain(&mut tx)[0], Action::PostWrite { .. }));
    assert!(tx.cancel(t(3), id));
    let acts = drain(&mut tx);
    assert_eq!(
        completes(&acts),
        vec![(id, Outcome::Failure(FailureReason::Cancelled))]
    );
    assert!(
        sent(&acts).is_empty(),
        "no CANCEL while the write may still land"
    );
    assert!(!tx.cancel(t(3), id), "terminal exactly once");
    tx.handle_write_done(t(4), chunk);
    let acts = drain(&mut tx);
    assert_eq!(sent(&acts), vec![&Message::cancel(id, b"ep".to_vec(), 0)]);
    assert!(completes(&acts).is_empty());
    assert_eq!(tx.request_count(), 0);
    tx.check_invariants().unwrap();
}

#[test]
fn unreachable_peer_fails_its_requests_and_cancels_once_writes_end() {
    let mut p = pair("A", "B", false);
    let id = p.a.ep.submit(p.now, &p.b.name, &descs(2, 64)).unwrap();
    p.deliver(B);
    p.deliver(A);
    p.gather(A);
    assert_eq!(p.a.writes.len(), 1);
    p.a.take_sent();
    p.b.take_sent();
    // Both sides lose the control channel while the write runs.
    let (a, b) = (p.a.name.clone(), p.b.name.clone());
    p.a.ep.peer_unreachable(p.now, &b);
    p.poll();
    assert_eq!(
        p.a.completed,
        vec![(id, Outcome::Failure(FailureReason::PeerUnreachable))]
    );
    assert!(p.a.sent.is_empty(), "no CANCEL while the write runs");
    p.b.ep.peer_unreachable(p.now, &a);
    p.poll();
    assert!(matches!(
        p.b.sent[..],
        [Message::Refuse {
            reason: RefuseReason::Expired,
            ..
        }]
    ));
    assert!(
        p.b.ep.arena_usage().quarantine > 0,
        "a stopped sender may still write"
    );
    // The REFUSE is lost with the channel.
    p.a.inbound.clear();
    p.write(A);
    assert_eq!(p.a.sent, vec![Message::cancel(id, b"ep".to_vec(), 0)]);
    // The peer comes back: its CANCEL frees the quarantine.
    p.deliver(B);
    assert_eq!(p.b.ep.arena_usage().quarantine, 0);
    assert_eq!(p.a.ep.request_count(), 0);
    check(&p);
}

/// A reader and an owner that never loaded it, after the READ of two
/// chunks (`descs(2, 1000)`) reached the owner; its READ_GRANT is on the
/// way. Returns the reader's request.
fn read_in_progress(p: &mut Pair) -> RequestId {
    let id =
        p.a.ep
            .submit_read(p.now, &p.b.name, &descs(2, 1000), None)
            .unwrap();
    p.poll();
    assert!(matches!(
        p.a.sent[..],
        [Message::Read { .. }, Message::ReadGrant { .. }]
    ));
    let grant = p.b.inbound.pop_back().expect("the READ_GRANT");
    p.deliver(B);
    p.b.inbound.push_back(grant);
    let r = p.a.name.clone();
    let events = p.b.take_events();
    assert!(events
        .iter()
        .any(|a| matches!(a, Action::Connect { peer, .. } if *peer == r)));
    assert!(events
        .iter()
        .any(|a| matches!(a, Action::LoadDataPath { peer, .. } if *peer == r)));
    id
}

fn forgets(events: &[Action]) -> Vec<&PeerId> {
    events
        .iter()
        .filter_map(|a| match a {
            Action::ForgetPeer { peer } => Some(peer),
            _ => None,
        })
        .collect()
}

/// The reader of a served READ becomes unreachable (killed): the serve
/// fails at once, but what it still runs holds it (the gather reading
/// the source, the write into the reader's arena, their staging); its
/// READ_END goes once no write can land; the reader, known only through
/// its READ, is forgotten only after that; and when it comes back, a
/// new READ is served normally.
#[test]
fn an_unreachable_reader_is_forgotten_once_its_serve_ended() {
    let mut p = read_pair();
    let id = read_in_progress(&mut p);
    let r = p.a.name.clone();
    p.deliver(B);
    assert_eq!(p.b.gathers.len(), 2, "both chunks credited and gathering");
    let second = p.b.gathers.pop_back().unwrap();
    p.b.take_sent();
    p.b.take_events();
    p.gather(B);
    let write = p.b.writes.pop_front().expect("chunk 0's write");
    assert!(p.b.is_quiet(), "only the write starts");
    p.b.writes.push_back(write);
    let staged = p.b.ep.arena_usage().local;
    assert!(staged > 0);

    // Chunk 0 is being written, chunk 1 gathered, when the reader dies.
    p.b.ep.peer_unreachable(p.now, &r);
    p.poll();
    assert!(p.b.sent.is_empty(), "no READ_END while a write runs");
    assert!(
        forgets(&p.b.events).is_empty(),
        "a write and a gather still run"
    );
    assert!(p.b.completed.is_empty(), "nothing local waits on a serve");
    assert_eq!(
        p.b.ep.arena_usage().local,
        staged,
        "staging held, not reused"
    );
    assert!(p.b.ep.holds_peer(&r));
    // Asked again (the runtime does while the peer stays unreachable):
    // still held.
    p.b.ep.peer_unreachable(p.now, &r);
    p.poll();
    assert!(forgets(&p.b.events).is_empty());

    // The gather ends: its staging is freed, no write starts.
    p.b.ep.handle_gather_done(p.now, second.chunk);
    p.poll();
    assert_eq!(p.b.writes.len(), 1, "no second write");
    assert!(p.b.ep.arena_usage().local < staged);
    // The write fails (the reader is dead): READ_END, staging freed.
    let w = p.b.writes.pop_front().unwrap();
    p.b.ep.handle_write_failed(p.now, w.chunk);
    p.poll();
    match &p.b.take_sent()[..] {
        [Message::ReadEnd { request, .. }] if *request == id => {}
        other => panic!("READ_END once no write can land: {other:?}"),
    }
    assert!(forgets(&p.b.events).is_empty(), "decided at the next check");
    assert_eq!(p.b.ep.request_count(), 0);
    assert_eq!(p.b.ep.arena_usage().local, 0, "the arena drained");
    p.b.ep.check_invariants().unwrap();

    // The next check: nothing of the reader is left, forget it.
    p.b.ep.peer_unreachable(p.now, &r);
    p.poll();
    assert_eq!(forgets(&p.b.take_events()), vec![&r]);
    assert!(p.b.sent.is_empty(), "{:?}", p.b.sent);
    p.b.ep.forget_peer(p.now, &r);
    p.poll();
    assert!(p.b.is_quiet());
    assert!(!p.b.ep.knows_peer(&r), "no state about the reader is left");

    // The reader was only cut off: it hears the READ_END, then READs
    // again and is served like a new reader.
    assert_eq!(p.a.inbound.len(), 1);
    p.deliver(A);
    assert_eq!(
        p.a.take_completed(),
        vec![(id, Outcome::Failure(FailureReason::Rejected))]
    );
    let d = descs(1, 100);
    let id2 = p.a.ep.submit_read(p.now, &p.b.name, &d, None).unwrap();
    p.deliver(B);
    let events = p.b.take_events();
    assert!(
        events
            .iter()
            .any(|a| matches!(a, Action::Connect { peer, .. } if *peer == r))
            && events
                .iter()
                .any(|a| matches!(a, Action::LoadDataPath { peer, .. } if *peer == r)),
        "the reader's endpoint and data path are loaded anew: {events:?}"
    );
    assert_eq!(p.b.gathers.len(), 1, "the new READ is served");
    p.drive();
    assert_eq!(p.a.completed, vec![(id2, Outcome::Success)]);
    assert!(p.a.holds_copy_of(&p.b, &d));
    assert_eq!(p.b.ep.stats().reads_served, 1);
    assert_eq!(p.b.ep.request_count(), 0);
    check(&p);
}

/// A serve with nothing running (its READ_GRANT was lost) ends at once
/// when its reader is unreachable: READ_END, then the reader is
/// forgotten in the same step.
#[test]
fn an_idle_serve_ends_at_once_when_its_reader_is_unreachable() {
    let mut p = read_pair();
    let id = read_in_progress(&mut p);
    let r = p.a.name.clone();
    p.b.inbound.clear();
    assert!(p.b.ep.holds_peer(&r));
    p.b.take_sent();
    p.b.ep.peer_unreachable(p.now, &r);
    let acts = drain(&mut p.b.ep);
    assert!(
        matches!(
            &acts[..],
            [Action::Send { message: Message::ReadEnd { request, .. }, .. }, Action::ForgetPeer { peer }]
                if *request == id && *peer == r
        ),
        "{acts:?}"
    );
    assert_eq!(p.b.ep.request_count(), 0);
    p.b.ep.forget_peer(p.now, &r);
    assert!(!p.b.ep.knows_peer(&r));
    check(&p);
}

/// Found by the simulation: a READ_REFUSE that overtook its READ
/// tombstones the READ; forgetting the unreachable reader keeps the
/// tombstone, or the late READ would be served into regions the reader
/// has given back.
#[test]
fn a_forgotten_reader_s_late_read_is_not_served_after_its_refusal() {
    let mut p = read_pair();
    let r = p.a.name.clone();
    let id =
        p.a.ep
            .submit_read(p.now, &p.b.name, &descs(1, 100), None)
            .unwrap();
    p.poll();
    // The READ (and its READ_GRANT) is held back ...
    let late: Vec<_> = p.b.inbound.drain(..).collect();
    assert!(p.a.ep.cancel(p.now, id));
    p.a.take_sent();
    p.poll();
    assert!(matches!(p.a.sent[..], [Message::ReadRefuse { .. }]));
    // ... and the READ_REFUSE overtakes it.
    p.deliver(B);
    assert!(matches!(p.b.take_sent()[..], [Message::ReadEnd { .. }]));
    p.b.ep.peer_unreachable(p.now, &r);
    p.poll();
    assert_eq!(forgets(&p.b.take_events()), vec![&r]);
    p.b.ep.forget_peer(p.now, &r);
    p.b.inbound.extend(late);
    p.deliver(B);
    assert!(
        p.b.gathers.is_empty()
            && !p
                .b
                .events
                .iter()
                .any(|a| matches!(a, Action::LoadDataPath { .. })),
        "a READ refused before it arrived is served: {:?}",
        p.b.events
    );
    assert_eq!(p.b.ep.request_count(), 0);
}

/// Only peers the application never loaded are forgotten by the
/// endpoint, and only once nothing of them is left: a loaded peer stays
/// (the application forgets it); a sender whose regions are quarantined
/// stays until its CANCEL frees them.
#[test]
fn unreachable_peers_are_forgotten_only_when_unloaded_and_empty() {
    let mut p = read_pair();
    read_in_progress(&mut p);
    let r = p.a.name.clone();
    p.b.ep.set_peer_key(&r, 7);
    p.b.ep.peer_unreachable(p.now, &r);
    p.poll();
    assert!(
        forgets(&p.b.events).is_empty(),
        "a loaded peer: {:?}",
        p.b.events
    );
    assert!(!p.b.ep.holds_peer(&r) && p.b.ep.knows_peer(&r));
    // The application forgets it; it is not loaded any more.
    p.b.ep.forget_peer(p.now, &r);
    assert!(!p.b.ep.knows_peer(&r));

    let (mut rx, a, _region) = receiver_with_grant();
    rx.peer_unreachable(t(1), &a);
    let acts = drain(&mut rx);
    assert!(forgets(&acts).is_empty(), "its regions are quarantined");
    assert!(rx.arena_usage().quarantine > 0 && rx.holds_peer(&a));
    rx.handle_message(t(2), &a, Message::cancel(RequestId(7), vec![], 0));
    drain(&mut rx);
    assert_eq!(rx.arena_usage().quarantine, 0);
    rx.peer_unreachable(t(3), &a);
    assert_eq!(forgets(&drain(&mut rx)), vec![&a]);
    rx.forget_peer(t(4), &a);
    assert!(!rx.knows_peer(&a));
    rx.check_invariants().unwrap();
}

#[test]
fn failure_is_reported_after_running_gathers_end() {
    let b = PeerId::new("B");
    let mut tx = Endpoint::new(cfg(true)).unwrap();
    let id = tx.submit(t(0), &b, &descs(2, 64)).unwrap();
    let acts = drain(&mut tx);
    let Action::StartGather { chunk, .. } = acts[1].clone() else {
        panic!("{acts:?}")
    };
    tx.handle_timeout(t(11));
    let acts = drain(&mut tx);
    assert!(
        completes(&acts).is_empty(),
        "a gather still reads the source"
    );
    // No write can land (none was posted): the CANCEL goes at once.
    assert_eq!(sent(&acts), vec![&Message::cancel(id, b"ep".to_vec(), 0)]);
    tx.handle_gather_done(t(12), chunk);
    let acts = drain(&mut tx);
    assert_eq!(
        completes(&acts),
        vec![(id, Outcome::Failure(FailureReason::Timeout))]
    );
    assert_eq!(tx.arena_usage().local, 0);
    tx.check_invariants().unwrap();
}

fn receiver_with_grant() -> (Endpoint, PeerId, RegionHandle) {
    let a = PeerId::new("A");
    let mut rx = Endpoint::new(cfg(false)).unwrap();
    rx.handle_message(
        t(0),
        &a,
        Message::Want {
            request: RequestId(7),
            chunk_sizes: vec![500, 500],
            endpoint: vec![],
            key: 0,
            standing: StandingUse::None,
            incarnation: 0,
        },
    );
    let acts = drain(&mut rx);
    let Some(Message::Grant { credits, .. }) = sent(&acts).first().cloned().cloned() else {
        panic!("{acts:?}")
    };
    (rx, a, credits[0].region)
}

#[test]
fn late_data_after_cancel_is_dropped() {
    let (mut rx, a, region) = receiver_with_grant();
    rx.handle_message(t(1), &a, Message::cancel(RequestId(7), vec![], 0));
    assert_eq!(rx.flow_count(), 0);
    assert_eq!(rx.arena_usage().flows, 0);
    rx.handle_message(
        t(2),
        &a,
        Message::Data {
            request: RequestId(7),
            chunk: 0,
            region,
            runs: vec![crate::proto::Run::single(0, 0x10, 500)].into(),
        },
    );
    assert!(drain(&mut rx).is_empty());
    assert_eq!(rx.stats().late_data, 1);
    // A WANT arriving after its CANCEL is ignored (tombstone).
    rx.handle_message(
        t(3),
        &a,
        Message::Want {
            request: RequestId(7),
            chunk_sizes: vec![8],
            endpoint: vec![],
            key: 0,
            standing: StandingUse::None,
            incarnation: 0,
        },
    );
    assert_eq!(rx.flow_count(), 0);
    rx.check_invariants().unwrap();
}

#[test]
fn out_of_region_runs_abort_the_flow() {
    let (mut rx, a, region) = receiver_with_grant();
    rx.handle_message(
        t(1),
        &a,
        Message::Data {
            request: RequestId(7),
            chunk: 0,
            region,
            runs: vec![crate::proto::Run::single(400, 0x10, 101)].into(),
        },
    );
    let acts = drain(&mut rx);
    assert_eq!(
        sent(&acts),
        vec![&Message::Refuse {
            request: RequestId(7),
            reason: RefuseReason::ProtocolViolation
        }]
    );
    assert!(
        rx.arena_usage().quarantine > 0,
        "the sender may still write: quarantined"
    );
    // The sender's CANCEL (after its writes ended) releases them.
    rx.handle_message(t(2), &a, Message::cancel(RequestId(7), vec![], 0));
    assert_eq!(rx.arena_usage().quarantine, 0);
    rx.check_invariants().unwrap();
}

#[test]
fn orphaned_scatter_region_is_freed_when_the_scatter_ends() {
    let (mut rx, a, region) = receiver_with_grant();
    rx.handle_message(
        t(1),
        &a,
        Message::Data {
            request: RequestId(7),
            chunk: 0,
            region,
            runs: vec![crate::proto::Run::single(0, 0x10, 500)].into(),
        },
    );
    assert!(matches!(drain(&mut rx)[0], Action::StartScatter { .. }));
    rx.forget_peer(t(2), &a);
    assert_eq!(rx.region_owner(region), Some(&Owner::Orphan));
    rx.handle_scatter_done(t(3), region);
    assert!(
        sent(&drain(&mut rx)).is_empty(),
        "no ACK for a forgotten flow"
    );
    assert_eq!(rx.arena_free() + rx.arena_usage().reserve, 4096);
}

#[test]
fn grant_for_an_unknown_request_is_answered_with_cancel() {
    let b = PeerId::new("B");
    let mut tx = Endpoint::new(cfg(false)).unwrap();
    tx.handle_message(
        t(0),
        &b,
        Message::Grant {
            request: RequestId(5),
            credits: vec![Credit {
                chunk: 0,
                region: RegionHandle(0),
                len: 64,
            }],
        },
    );
    assert_eq!(
        sent(&drain(&mut tx)),
        vec![&Message::cancel(RequestId(5), b"ep".to_vec(), 0)]
    );
}

#[test]
fn impossible_credit_is_a_protocol_error() {
    let b = PeerId::new("B");
    let mut tx = Endpoint::new(cfg(false)).unwrap();
    let id = tx.submit(t(0), &b, &descs(1, 64)).unwrap();
    drain(&mut tx);
    tx.handle_message(
        t(1),
        &b,
        Message::Grant {
            request: id,
            credits: vec![Credit {
                chunk: 3,
                region: RegionHandle(0),
                len: 64,
            }],
        },
    );
    assert_eq!(
        completes(&drain(&mut tx)),
        vec![(id, Outcome::Failure(FailureReason::ProtocolError))]
    );
}

#[test]
fn stuck_write_poisons_the_arena() {
    let b = PeerId::new("B");
    let mut tx = Endpoint::new(cfg(false)).unwrap();
    let id = tx.submit(t(0), &b, &descs(1, 64)).unwrap();
    drain(&mut tx);
    tx.handle_message(
        t(1),
        &b,
        Message::Grant {
            request: id,
            credits: vec![Credit {
                chunk: 0,
                region: RegionHandle(0),
                len: 64,
            }],
        },
    );
    let Action::StartGather { chunk, .. } = drain(&mut tx)[0].clone() else {
        panic!()
    };
    tx.handle_gather_done(t(2), chunk);
    drain(&mut tx);
    tx.handle_write_stuck(t(3), chunk);
    let acts = drain(&mut tx);
    assert!(acts.iter().any(|a| matches!(a, Action::Poisoned { .. })));
    assert_eq!(
        completes(&acts),
        vec![(id, Outcome::Failure(FailureReason::Poisoned))]
    );
    assert!(
        sent(&acts).is_empty(),
        "never cancel while a write may land"
    );
    assert!(
        tx.arena_usage().local > 0,
        "the stuck source region is never reused"
    );
    assert!(matches!(
        tx.submit(t(4), &b, &descs(1, 64)),
        Err(SubmitError::Poisoned(_))
    ));
    tx.handle_message(
        t(5),
        &b,
        Message::Want {
            request: RequestId(1),
            chunk_sizes: vec![64],
            endpoint: vec![],
            key: 0,
            standing: StandingUse::None,
            incarnation: 0,
        },
    );
    assert_eq!(
        sent(&drain(&mut tx)),
        vec![&Message::Refuse {
            request: RequestId(1),
            reason: RefuseReason::Poisoned
        }]
    );
    tx.check_invariants().unwrap();
}

#[test]
fn shutdown_fails_everything_once() {
    let b = PeerId::new("B");
    let mut tx = Endpoint::new(cfg(false)).unwrap();
    let ids: Vec<RequestId> = (0..3)
        .map(|_| tx.submit(t(0), &b, &descs(1, 64)).unwrap())
        .collect();
    drain(&mut tx);
    tx.shutdown(t(1));
    tx.shutdown(t(2));
    let done = completes(&drain(&mut tx));
    assert_eq!(done.len(), 3);
    assert!(done
        .iter()
        .all(|(id, o)| ids.contains(id) && *o == Outcome::Failure(FailureReason::Shutdown)));
    assert_eq!(
        tx.submit(t(3), &b, &descs(1, 64)),
        Err(SubmitError::ShutDown)
    );
}

#[test]
fn deadline_and_malformed_input() {
    let b = PeerId::new("B");
    let mut c = cfg(false);
    c.request_deadline = Some(Duration::from_millis(3));
    let mut tx = Endpoint::new(c).unwrap();
    let id = tx.submit(t(0), &b, &descs(1, 64)).unwrap();
    drain(&mut tx);
    assert_eq!(tx.poll_timeout(), Some(t(3)));
    tx.handle_timeout(t(3));
    assert_eq!(
        completes(&drain(&mut tx)),
        vec![(id, Outcome::Failure(FailureReason::DeadlineExceeded))]
    );
    assert!(tx.handle_control(t(4), &b, b"garbage").is_err());
    assert_eq!(tx.stats().malformed, 1);
}

/// A WRITE of 20 x 128 bytes (3 chunks of at most 1024) from A to B,
/// submitted by its chunks' sizes (`submit_sized`): the pair, the
/// descriptors, their plan and the request, its WANT sent.
fn sized_write() -> (Pair, Vec<Descriptor>, Arc<Plan>, RequestId) {
    let mut p = pair("A", "B", true);
    let d = descs(20, 128);
    let plan = p.a.ep.plan(&d).unwrap();
    assert_eq!(plan.chunks.len(), 3);
    let id =
        p.a.ep
            .submit_sized(p.now, &p.b.name, &plan.chunk_sizes())
            .unwrap();
    p.poll();
    (p, d, plan, id)
}

/// Nothing is left on either side: no request, no flow, no staging, and
/// the receiver's arena whole.
fn nothing_left(p: &Pair, what: &str) {
    for node in [&p.a, &p.b] {
        assert_eq!(
            (node.ep.request_count(), node.ep.flow_count()),
            (0, 0),
            "{what}"
        );
        assert_eq!(node.ep.arena_usage().local, 0, "{what}");
    }
    let all = Endpoint::new(cfg(true)).unwrap().arena_free();
    assert_eq!(
        p.b.ep.arena_free(),
        all,
        "{what}: the receiver's regions are free"
    );
    check(p);
}

/// A request submitted by its chunks' sizes sends its WANT at once and
/// keeps the credits that come before its plan; nothing is gathered until
/// the plan comes, whether it comes after the GRANT or before, and the
/// transfer then ends byte-exact.
#[test]
fn a_request_submitted_by_its_sizes_waits_for_its_plan() {
    for plan_first in [false, true] {
        let (mut p, d, plan, id) = sized_write();
        assert!(
            matches!(&p.a.sent[..], [Message::Want { chunk_sizes, .. }] if *chunk_sizes == plan.chunk_sizes())
        );
        assert!(p.a.gathers.is_empty(), "no eager gather without the copies");
        if plan_first {
            assert!(p.a.ep.plan_ready(p.now, id, plan.clone(), None));
            p.poll();
            assert!(!p.a.gathers.is_empty(), "eager gathers once planned");
        } else {
            p.deliver(B);
            p.deliver(A);
            p.poll();
            assert!(p.a.gathers.is_empty(), "credits kept, nothing gathered");
            assert!(p.a.ep.plan_ready(p.now, id, plan.clone(), None));
            p.poll();
            assert_eq!(p.a.gathers.len(), 2, "the credited chunks staged");
        }
        assert!(
            !p.a.ep.plan_ready(p.now, id, plan.clone(), None),
            "planned once"
        );
        p.drive();
        assert_eq!(p.a.completed, vec![(id, Outcome::Success)], "{plan_first}");
        assert!(p.b.holds_copy_of(&p.a, &d));
        nothing_left(&p, "done");
    }
}

/// A request submitted by its sizes that does not get its plan ends as
/// any other: cancelled by its caller, refused a plan of other sizes, or
/// timed out; its CANCEL frees the receiver's regions and nothing is left.
#[test]
fn a_request_without_its_plan_is_cancelled_refused_or_timed_out() {
    for how in ["cancel", "other sizes", "other chunks", "timeout"] {
        let (mut p, d, plan, id) = sized_write();
        p.deliver(B);
        p.deliver(A);
        let want = match how {
            "cancel" => {
                assert!(p.a.ep.cancel(p.now, id));
                FailureReason::Cancelled
            }
            "other sizes" => {
                let other = p.a.ep.plan(&descs(19, 128)).unwrap();
                assert!(!p.a.ep.plan_ready(p.now, id, other, None));
                FailureReason::Cancelled
            }
            "other chunks" => {
                // A chunk brought ahead, then a plan of the same sizes
                // whose chunk is not that one (other sources).
                assert!(p.a.ep.chunk_ready(p.now, id, 2, plan.chunks[2].clone()));
                let moved: Vec<Descriptor> = d
                    .iter()
                    .map(|x| Descriptor {
                        src_addr: x.src_addr + 0x100,
                        ..*x
                    })
                    .collect();
                let other = p.a.ep.plan(&moved).unwrap();
                assert_eq!(other.chunk_sizes(), plan.chunk_sizes());
                assert!(!p.a.ep.plan_ready(p.now, id, other, None));
                FailureReason::Cancelled
            }
            _ => {
                p.a.ep
                    .handle_timeout(p.now.after(Duration::from_millis(11)));
                FailureReason::Timeout
            }
        };
        p.drive();
        assert_eq!(p.a.completed, vec![(id, Outcome::Failure(want))], "{how}");
        assert!(p.a.writes.is_empty() && p.a.gathers.is_empty(), "{how}");
        nothing_left(&p, how);
    }
}

/// Chunks brought ahead of their request's plan (`chunk_ready`) are
/// gathered and written as soon as they are credited, but their DATA waits
/// for the whole plan; the plan then sends it and the transfer ends
/// byte-exact.
#[test]
fn chunks_brought_ahead_of_the_plan_are_written_but_their_data_waits() {
    let (mut p, d, plan, id) = sized_write();
    p.deliver(B);
    p.deliver(A);
    for c in [1, 0] {
        assert!(p.a.ep.chunk_ready(p.now, id, c, plan.chunks[c].clone()));
    }
    assert!(
        !p.a.ep.chunk_ready(p.now, id, 0, plan.chunks[0].clone()),
        "once"
    );
    p.poll();
    while p.gather(A) + p.write(A) > 0 {}
    assert!(p.a.writes.is_empty() && p.a.gathers.is_empty());
    let data = |n: &crate::proto::driver::Node| {
        n.sent
            .iter()
            .filter(|m| matches!(m, Message::Data { .. }))
            .count()
    };
    assert_eq!(data(&p.a), 0, "no DATA before the plan");
    p.deliver(B);
    assert!(
        p.b.scatters.is_empty(),
        "nothing to scatter before the plan"
    );
    assert!(p.a.ep.plan_ready(p.now, id, plan.clone(), None));
    p.poll();
    assert_eq!(data(&p.a), 2, "the written chunks' DATA at the plan");
    p.drive();
    assert_eq!(p.a.completed, vec![(id, Outcome::Success)]);
    assert!(p.b.holds_copy_of(&p.a, &d));
    nothing_left(&p, "done");
}

/// A request whose chunks were written ahead of its plan, then cancelled
/// (its check failed): nothing lands in its destination, the receiver's
/// regions are freed, nothing is left.
#[test]
fn chunks_written_ahead_of_a_cancelled_plan_never_reach_the_destination() {
    let (mut p, _, plan, id) = sized_write();
    let before = p.b.memory.mem.clone();
    p.deliver(B);
    p.deliver(A);
    for c in 0..plan.chunks.len() {
        assert!(p.a.ep.chunk_ready(p.now, id, c, plan.chunks[c].clone()));
    }
    p.poll();
    // Gathers and writes, one of them still running at the cancel.
    p.gather(A);
    p.write(A);
    p.gather(A);
    assert!(p.a.ep.cancel(p.now, id));
    p.drive();
    assert_eq!(
        p.a.completed,
        vec![(id, Outcome::Failure(FailureReason::Cancelled))]
    );
    assert_eq!(p.b.memory.mem, before, "the destination is untouched");
    nothing_left(&p, "cancelled");
}

/// The tests' configuration with standing credits: `slots` slots of 512
/// bytes (the arena 4096, its reserve 1024), requests cut into chunks of
/// 512 bytes where they can be.
fn standing_cfg(slots: u32) -> EndpointConfig {
    EndpointConfig {
        min_chunks: 4,
        min_chunk: 512,
        standing_slots: slots,
        ..cfg(true)
    }
}

/// A sender `A` and a receiver `B` that offers standing credits (one slot),
/// `A` knowing it does.
fn standing_pair() -> Pair {
    let mut p = Pair::new(
        ("A", Endpoint::new(standing_cfg(1)).unwrap()),
        ("B", Endpoint::new(standing_cfg(1)).unwrap()),
    );
    let b = p.b.name.clone();
    p.a.ep.set_peer_standing(&b);
    p
}

/// The standing offers a node sent: (token, region).
fn offers(node: &crate::proto::driver::Node) -> Vec<(u64, RegionHandle)> {
    node.sent
        .iter()
        .filter_map(|m| match m {
            Message::Standing { token, region, .. } => Some((*token, *region)),
            _ => None,
        })
        .collect()
}

/// The WANTs a node sent, by what they said of the standing credit.
fn wants(node: &crate::proto::driver::Node) -> Vec<StandingUse> {
    node.sent
        .iter()
        .filter_map(|m| match m {
            Message::Want { standing, .. } => Some(*standing),
            _ => None,
        })
        .collect()
}

/// Drives `A`'s first WRITE (which asks for a standing credit) to the
/// end: `A` then holds `B`'s offer.
fn first_write_takes_an_offer(p: &mut Pair) -> (u64, RegionHandle) {
    let d = descs(4, 100);
    let id = p.a.ep.submit(p.now, &p.b.name, &d).unwrap();
    p.drive();
    assert_eq!(p.a.take_completed(), vec![(id, Outcome::Success)]);
    assert_eq!(wants(&p.a), vec![StandingUse::Wanted]);
    let offered = offers(&p.b);
    assert_eq!(offered.len(), 1, "one offer: {offered:?}");
    assert!(matches!(
        p.b.ep.region_owner(offered[0].1),
        Some(Owner::Standing { offer: Some(o) }) if o.token == offered[0].0
    ));
    assert_eq!(p.b.ep.slot_peer(offered[0].1), Some(&p.a.name));
    p.a.take_sent();
    p.b.take_sent();
    offered[0]
}

/// Submits a WRITE of `d` from `A`, which must claim `B`'s offer `token`
/// of `slot` in its WANT.
fn submit_claiming(p: &mut Pair, d: &[Descriptor], token: u64, slot: RegionHandle) -> RequestId {
    p.a.take_sent();
    let id = p.a.ep.submit(p.now, &p.b.name, d).unwrap();
    p.poll();
    assert_eq!(
        wants(&p.a),
        vec![StandingUse::Claimed {
            token,
            region: slot
        }]
    );
    id
}

/// A WRITE whose first chunk fits the receiver's standing credit writes
/// it at once, claiming the region in its WANT: gathered and written
/// before the receiver has seen anything, no GRANT for that chunk, the
/// later chunks granted as usual, byte-exact; the slot is offered again,
/// under a newer token, right behind chunk 0's ACK.
#[test]
fn a_standing_credit_writes_the_first_chunk_without_a_grant() {
    for chunks in [1u64, 3] {
        let mut p = standing_pair();
        let (token, slot) = first_write_takes_an_offer(&mut p);
        // 4 x 128 bytes a chunk: the first fills the slot.
        let d = descs(4 * chunks, 128);
        let plan = p.a.ep.plan(&d).unwrap();
        assert_eq!(plan.chunks.len() as u64, chunks);
        let id = submit_claiming(&mut p, &d, token, slot);
        assert!(!p.a.gathers.is_empty(), "gathering at once");
        p.gather(A);
        assert_eq!(p.a.writes.len(), 1, "written before any GRANT");
        assert_eq!(p.a.writes[0].remote, slot);
        p.write(A);
        assert!(
            matches!(p.a.sent.last(), Some(Message::Data { chunk: 0, region, .. }) if *region == slot)
        );
        p.drive();
        assert_eq!(p.a.take_completed(), vec![(id, Outcome::Success)]);
        assert!(p.b.holds_copy_of(&p.a, &d));
        let granted: Vec<u32> =
            p.b.sent
                .iter()
                .filter_map(|m| match m {
                    Message::Grant { credits, .. } => Some(credits.iter().map(|c| c.chunk)),
                    _ => None,
                })
                .flatten()
                .collect();
        assert!(!granted.contains(&0), "chunk 0 never granted: {granted:?}");
        let again = offers(&p.b);
        assert_eq!(again.len(), 1, "{again:?}");
        assert!(again[0].0 > token && again[0].1 == slot);
        let offer_at =
            p.b.sent
                .iter()
                .position(|m| matches!(m, Message::Standing { .. }));
        let first_ack =
            p.b.sent
                .iter()
                .position(|m| matches!(m, Message::Ack { chunk: 0, .. }));
        assert_eq!(
            offer_at,
            first_ack.map(|a| a + 1),
            "offered right behind chunk 0's ACK: {:?}",
            p.b.sent
        );
        // The next request claims the new offer.
        let id = submit_claiming(&mut p, &descs(4, 100), again[0].0, slot);
        p.drive();
        assert_eq!(p.a.take_completed(), vec![(id, Outcome::Success)]);
        assert_eq!(p.b.ep.stats().standing_offered, 3);
        assert_eq!(p.a.ep.stats().standing_claimed, 2);
        check(&p);
    }
}

/// A request whose first chunk is larger than the standing region keeps
/// the credit for a later one (`Held`), and a sender that does not know
/// the receiver offers them sends plain WANTs and is offered none.
#[test]
fn a_standing_credit_is_kept_for_a_request_it_fits_and_offered_only_when_asked() {
    let mut p = standing_pair();
    let (token, slot) = first_write_takes_an_offer(&mut p);
    // 4 KiB: chunks of 1024 bytes, the first larger than the slot.
    let id = p.a.ep.submit(p.now, &p.b.name, &descs(32, 128)).unwrap();
    p.drive();
    assert_eq!(p.a.take_completed(), vec![(id, Outcome::Success)]);
    assert_eq!(wants(&p.a), vec![StandingUse::Held]);
    assert!(offers(&p.b).is_empty(), "no new offer while one is live");
    let id = submit_claiming(&mut p, &descs(2, 100), token, slot);
    p.drive();
    assert_eq!(p.a.take_completed(), vec![(id, Outcome::Success)]);

    let mut plain = Pair::new(
        ("A", Endpoint::new(standing_cfg(1)).unwrap()),
        ("B", Endpoint::new(standing_cfg(1)).unwrap()),
    );
    for _ in 0..2 {
        let id = plain
            .a
            .ep
            .submit(plain.now, &plain.b.name, &descs(4, 100))
            .unwrap();
        plain.drive();
        assert_eq!(plain.a.take_completed(), vec![(id, Outcome::Success)]);
    }
    assert_eq!(wants(&plain.a), vec![StandingUse::None; 2]);
    assert!(offers(&plain.b).is_empty());
}

/// On a channel that reorders: a DATA written into the standing slot that
/// arrives before its claiming WANT is kept for it and scattered once the
/// claim comes; a claimed request cancelled before its claim arrives
/// (CANCEL first, then the claim) spends the offer, and the slot is
/// offered anew; an offer re-sent before the claim and arriving after it
/// is not taken again.
#[test]
fn standing_claims_survive_reordering() {
    // DATA before its claim.
    let mut p = standing_pair();
    let (token, slot) = first_write_takes_an_offer(&mut p);
    let d = descs(4, 100);
    let id = p.a.ep.submit(p.now, &p.b.name, &d).unwrap();
    p.poll();
    p.gather(A);
    p.write(A);
    let mut inbound: Vec<_> = p.b.inbound.drain(..).collect();
    assert_eq!(inbound.len(), 2, "the claim and the DATA");
    inbound.reverse();
    p.b.inbound.extend(inbound);
    p.deliver(B);
    assert_eq!(p.b.scatters.len(), 1, "the DATA kept for its claim");
    p.drive();
    assert_eq!(p.a.take_completed(), vec![(id, Outcome::Success)]);
    assert!(p.b.holds_copy_of(&p.a, &d));
    check(&p);

    // Cancelled, its CANCEL before its claim; nothing lands.
    let mut p = standing_pair();
    let (token2, slot2) = first_write_takes_an_offer(&mut p);
    let before = p.b.memory.mem.clone();
    let id = p.a.ep.submit(p.now, &p.b.name, &descs(4, 100)).unwrap();
    p.poll();
    assert!(p.a.ep.cancel(p.now, id));
    p.poll();
    p.gather(A);
    assert_eq!(
        p.a.take_completed(),
        vec![(id, Outcome::Failure(FailureReason::Cancelled))]
    );
    let mut inbound: Vec<_> = p.b.inbound.drain(..).collect();
    assert_eq!(inbound.len(), 2, "the claim and the CANCEL");
    inbound.reverse();
    p.b.inbound.extend(inbound);
    p.b.take_sent();
    p.deliver(B);
    renewed_offer(&p, token2, slot2, "the spent offer renewed");
    assert_eq!(p.b.memory.mem, before);
    p.drive();
    assert_eq!(p.b.ep.flow_count(), 0);
    check(&p);

    // An offer re-sent before the claim, arriving after it.
    let mut p = standing_pair();
    let _ = (token, slot);
    let ([first, second], (token, _), late) = offered_twice_one_copy_held(&mut p);
    // A takes the first offer, claims it, then reads the second copy.
    p.deliver(A);
    p.a.take_sent();
    let third = p.a.ep.submit(p.now, &p.b.name, &descs(4, 100)).unwrap();
    p.poll();
    assert!(matches!(wants(&p.a)[..], [StandingUse::Claimed { token: t, .. }] if t == token));
    p.a.inbound.push_back(late);
    p.deliver(A);
    p.a.take_sent();
    let fourth = p.a.ep.submit(p.now, &p.b.name, &descs(4, 100)).unwrap();
    p.poll();
    assert_eq!(
        wants(&p.a),
        vec![StandingUse::Wanted],
        "the crossed copy was not taken"
    );
    p.drive();
    let mut done = p.a.take_completed();
    done.sort_by_key(|(id, _)| *id);
    let want: Vec<_> = [first, second, third, fourth]
        .into_iter()
        .map(|id| (id, Outcome::Success))
        .collect();
    assert_eq!(done, want);
    check(&p);
}

/// `A` restarted: a new endpoint under the same name, another incarnation
/// (200), that knows `B` offers standing credits.
fn restart_a(p: &mut Pair) {
    p.a.ep = Endpoint::new(EndpointConfig {
        request_id_base: 5000,
        incarnation: 200,
        ..standing_cfg(1)
    })
    .unwrap();
    let b = p.b.name.clone();
    p.a.ep.set_peer_standing(&b);
}

/// A WRITE from `A` that claims `B`'s offer `token` of `slot` completes,
/// byte-exact, and both arenas end whole.
fn claim_to_the_end(p: &mut Pair, token: u64, slot: RegionHandle) {
    let d = descs(4, 100);
    let id = submit_claiming(p, &d, token, slot);
    p.drive();
    assert_eq!(p.a.take_completed(), vec![(id, Outcome::Success)]);
    assert!(p.b.holds_copy_of(&p.a, &d));
    check(p);
}

/// `B`'s one offer since its sent messages were last taken: of `slot`,
/// under a token above `token` (`why` says what renewed it). Returns that
/// token.
fn renewed_offer(p: &Pair, token: u64, slot: RegionHandle, why: &str) -> u64 {
    let again = offers(&p.b);
    assert_eq!(again.len(), 1, "{why}: {:?}", p.b.sent);
    assert!(again[0].0 > token && again[0].1 == slot, "{why}: {again:?}");
    again[0].0
}

/// An offer `A` must not take (`what` names it), delivered now: `A`'s
/// next WRITE completes asking for an offer, not claiming that one.
fn not_taken(p: &mut Pair, offer: Inbound, what: &str) {
    p.a.inbound.push_back(offer);
    p.deliver(A);
    p.a.take_sent();
    let b = p.b.name.clone();
    let id = p.a.ep.submit(p.now, &b, &descs(4, 100)).unwrap();
    p.drive();
    assert_eq!(p.a.take_completed(), vec![(id, Outcome::Success)]);
    assert_eq!(wants(&p.a), vec![StandingUse::Wanted], "{what} not taken");
}

/// `A`, forgetting `B` or shutting down, sends `B` one message: the give-back
/// of offer `token` of `slot`; `B` reads it.
fn gives_back(p: &mut Pair, token: u64, slot: RegionHandle) {
    p.poll();
    assert!(
        matches!(&p.a.sent[..], [Message::Return { offer, .. }] if offer.token == token && offer.region == slot),
        "{:?}",
        p.a.sent
    );
    p.deliver(B);
}

/// A message waiting in a node's inbound queue: (from, bytes).
type Inbound = (PeerId, Vec<u8>);

/// Two WRITEs from `A` asking for an offer: `B` offers its slot, then
/// sends the same offer again for the second WANT; the second copy is
/// taken out of `A`'s inbound, to be delivered late. Returns the two
/// requests, the offer (token, region) and that copy.
fn offered_twice_one_copy_held(p: &mut Pair) -> ([RequestId; 2], (u64, RegionHandle), Inbound) {
    let first = p.a.ep.submit(p.now, &p.b.name, &descs(4, 100)).unwrap();
    let second = p.a.ep.submit(p.now, &p.b.name, &descs(4, 100)).unwrap();
    p.poll();
    assert_eq!(wants(&p.a), vec![StandingUse::Wanted; 2]);
    p.deliver(B);
    let sent = offers(&p.b);
    assert_eq!(sent.len(), 2, "offered, then offered again: {:?}", p.b.sent);
    assert_eq!(sent[0], sent[1]);
    let mut to_a: Vec<_> = p.a.inbound.drain(..).collect();
    let copy = to_a
        .iter()
        .rposition(|(_, b)| matches!(Message::decode(b), Ok(Message::Standing { .. })))
        .unwrap();
    let late = to_a.remove(copy);
    p.a.inbound.extend(to_a);
    ([first, second], sent[0], late)
}

/// The incarnation of the senders whose WANTs the tests write by hand.
const SENDER: u64 = 1;

/// A WANT from the sender whose endpoint is `ep` (incarnation [`SENDER`]),
/// by hand: request `request`, chunks `sizes`, `standing` its use of the
/// standing credit.
fn want_of(request: u64, sizes: &[u64], standing: StandingUse) -> Message {
    Message::Want {
        request: RequestId(request),
        chunk_sizes: sizes.to_vec(),
        endpoint: b"ep".to_vec(),
        key: 0,
        standing,
        incarnation: match standing {
            StandingUse::None => 0,
            _ => SENDER,
        },
    }
}

/// A slot serves one sender for the receiver's life: a second sender gets
/// none while the first has it, nor after the first is forgotten (what the
/// first may still write lands only in its own slot).
#[test]
fn a_standing_slot_never_changes_peers() {
    let mut b = Endpoint::new(standing_cfg(1)).unwrap();
    let (a, c) = (PeerId::new("A"), PeerId::new("C"));
    let want = |request: u64| want_of(request, &[100], StandingUse::Wanted);
    b.handle_message(t(1), &a, want(1));
    let to = |actions: &[Action], who: &PeerId| {
        actions
            .iter()
            .filter(|x| matches!(x, Action::Send { peer, message: Message::Standing { .. } } if peer == who))
            .count()
    };
    let first = drain(&mut b);
    assert_eq!(to(&first, &a), 1);
    b.handle_message(t(2), &c, want(2));
    assert_eq!(to(&drain(&mut b), &c), 0, "one slot, taken");
    b.forget_peer(t(3), &a);
    b.handle_message(t(4), &c, want(3));
    assert_eq!(to(&drain(&mut b), &c), 0, "not after A is forgotten either");
    b.handle_message(t(5), &a, want(4));
    assert_eq!(to(&drain(&mut b), &a), 1, "A, back, is offered its own");
    b.check_invariants().unwrap();
}

/// The offer a receiver's actions sent, if any: (token, region).
fn offer_in(actions: &[Action]) -> Option<(u64, RegionHandle)> {
    actions.iter().find_map(|x| match x {
        Action::Send {
            message: Message::Standing { token, region, .. },
            ..
        } => Some((*token, *region)),
        _ => None,
    })
}

/// A sender that forgets its receiver and loads it again keeps the tokens
/// it claimed: a copy of a claimed offer, re-sent before the claim and
/// arriving after the reload, is not claimed twice (its slot holds the
/// first claim's chunk, being scattered). Found by review.
#[test]
fn a_claimed_offer_is_not_taken_again_after_the_receiver_is_reloaded() {
    let mut p = standing_pair();
    let (_, (token, slot), late) = offered_twice_one_copy_held(&mut p);
    p.deliver(A);
    submit_claiming(&mut p, &descs(4, 100), token, slot);
    p.gather(A);
    p.write(A);
    let b = p.b.name.clone();
    p.a.ep.forget_peer(p.now, &b);
    p.a.ep.set_peer_standing(&b);
    p.poll();
    p.a.inbound.push_back(late);
    p.deliver(A);
    p.a.take_sent();
    p.a.ep.submit(p.now, &b, &descs(4, 100)).unwrap();
    p.poll();
    assert_eq!(wants(&p.a), vec![StandingUse::Wanted], "the copy not taken");
}

/// Offers go only to a sender whose last WANT was a WANT_STANDING: one
/// back under the same name as an older build (plain WANTs) is sent none.
/// Found by review.
#[test]
fn a_sender_back_with_plain_wants_is_offered_nothing() {
    let mut b = Endpoint::new(standing_cfg(1)).unwrap();
    let a = PeerId::new("A");
    let want = |request: u64, standing: StandingUse| want_of(request, &[100], standing);
    b.handle_message(t(1), &a, want(1, StandingUse::Wanted));
    let (token, region) = offer_in(&drain(&mut b)).expect("offered");
    b.handle_message(t(2), &a, want(2, StandingUse::Claimed { token, region }));
    drain(&mut b);
    b.forget_peer(t(3), &a);
    drain(&mut b);
    b.handle_message(t(4), &a, want(3, StandingUse::None));
    assert_eq!(offer_in(&drain(&mut b)), None);
    b.check_invariants().unwrap();
}

/// A claim the receiver refuses (here: a later chunk too large) has its
/// offer spent when the request's CANCEL comes, and the slot is offered
/// anew. Found by review.
#[test]
fn a_refused_claim_is_spent_by_its_cancel() {
    let mut b = Endpoint::new(standing_cfg(1)).unwrap();
    let a = PeerId::new("A");
    b.handle_message(t(1), &a, want_of(1, &[100], StandingUse::Wanted));
    let (token, region) = offer_in(&drain(&mut b)).expect("offered");
    let claim = StandingUse::Claimed { token, region };
    b.handle_message(t(2), &a, want_of(2, &[100, 1 << 40], claim));
    assert!(drain(&mut b).iter().any(|x| matches!(
        x,
        Action::Send {
            message: Message::Refuse { .. },
            ..
        }
    )));
    b.handle_message(
        t(3),
        &a,
        Message::Cancel {
            request: RequestId(2),
            endpoint: b"ep".to_vec(),
            key: 0,
            claim: claim.claim(),
            incarnation: SENDER,
        },
    );
    let again = offer_in(&drain(&mut b)).expect("offered anew");
    assert!(again.0 > token && again.1 == region);
    b.check_invariants().unwrap();
}

/// A claim lost with the control connection (its WANT and DATA never
/// arrive): the request fails as unreachable, and its CANCEL, which names
/// the claim, spends the offer once it gets through, so the slot is offered
/// anew and the pair's next WRITE claims again instead of falling back to
/// GRANTs for good.
#[test]
fn a_claim_lost_with_the_connection_is_spent_by_its_cancel() {
    let mut p = standing_pair();
    let (token, slot) = first_write_takes_an_offer(&mut p);
    let before = p.b.memory.mem.clone();
    let id = submit_claiming(&mut p, &descs(4, 100), token, slot);
    p.gather(A);
    p.write(A);
    p.poll();
    assert_eq!(p.b.inbound.len(), 2, "the claim and its DATA");
    p.b.inbound.clear();
    let b = p.b.name.clone();
    p.a.ep.peer_unreachable(p.now, &b);
    p.poll();
    assert_eq!(
        p.a.take_completed(),
        vec![(id, Outcome::Failure(FailureReason::PeerUnreachable))]
    );
    assert!(
        matches!(p.a.sent.last(), Some(Message::Cancel { claim: Some(c), .. }) if c.token == token && c.region == slot),
        "the CANCEL names the claim: {:?}",
        p.a.sent
    );
    p.b.take_sent();
    p.drive();
    let renewed = renewed_offer(&p, token, slot, "the lost claim's offer renewed");
    assert_eq!(p.b.memory.mem, before, "nothing of the lost request landed");
    let id = submit_claiming(&mut p, &descs(4, 100), renewed, slot);
    p.drive();
    assert_eq!(p.a.take_completed(), vec![(id, Outcome::Success)]);
    check(&p);
}

/// A sender restarted under the same name is another incarnation, which
/// cannot know what the first claimed: the receiver does not send it the
/// first's live offer again (had it, the first's late CANCEL would spend a
/// token the second had claimed, and the slot, offered anew, would take a
/// third write while the second's could still land), and it does not take
/// an offer meant for the first. The first's claim, lost with the
/// connection, is spent by its CANCEL, however late; the slot then goes to
/// the second incarnation, which claims it. Found by review.
#[test]
fn a_restarted_sender_is_not_sent_its_last_incarnations_offer() {
    let mut p = standing_pair();
    let (token, slot) = first_write_takes_an_offer(&mut p);
    submit_claiming(&mut p, &descs(4, 100), token, slot);
    p.gather(A);
    p.write(A);
    p.poll();
    p.b.inbound.clear();
    let b = p.b.name.clone();
    p.a.ep.peer_unreachable(p.now, &b);
    p.poll();
    let old_cancel =
        p.b.inbound
            .pop_back()
            .expect("the first incarnation's CANCEL");
    assert!(p.b.inbound.is_empty());
    restart_a(&mut p);
    p.a.take_sent();
    p.a.take_completed();
    p.b.take_sent();
    let id = p.a.ep.submit(p.now, &b, &descs(4, 100)).unwrap();
    p.drive();
    assert_eq!(p.a.take_completed(), vec![(id, Outcome::Success)]);
    assert_eq!(wants(&p.a), vec![StandingUse::Wanted]);
    assert!(
        offers(&p.b).is_empty(),
        "not sent the first's offer: {:?}",
        p.b.sent
    );
    // A copy of an offer to the first incarnation, arriving now.
    let stray = Message::Standing {
        token,
        region: slot,
        len: 512,
        incarnation: 100,
    };
    not_taken(&mut p, (b.clone(), stray.encode()), "the stray");
    // The first incarnation's CANCEL comes at last: the slot is offered
    // to the second, which claims it.
    p.b.take_sent();
    p.b.inbound.push_back(old_cancel);
    p.drive();
    let renewed = renewed_offer(&p, token, slot, "offered to the second incarnation");
    assert!(matches!(
        p.b.sent
            .iter()
            .find(|m| matches!(m, Message::Standing { .. })),
        Some(Message::Standing {
            incarnation: 200,
            ..
        })
    ));
    claim_to_the_end(&mut p, renewed, slot);
}

/// A sender shutting down gives back the offer it holds and never
/// claimed: the receiver spends it and offers the slot to the sender's
/// next incarnation, whose next WRITE claims it. A give-back naming
/// another incarnation spends nothing.
#[test]
fn a_sender_shutting_down_gives_its_offer_back() {
    let mut p = standing_pair();
    let (token, slot) = first_write_takes_an_offer(&mut p);
    let b = p.b.name.clone();
    // A stray give-back from another incarnation: ignored.
    let stray = Message::Return {
        key: 0,
        offer: Claim {
            token,
            region: slot,
        },
        incarnation: 7,
    };
    p.b.inbound.push_back((p.a.name.clone(), stray.encode()));
    p.deliver(B);
    assert!(matches!(
        p.b.ep.region_owner(slot),
        Some(Owner::Standing { offer: Some(o) }) if o.token == token
    ));
    p.a.ep.shutdown(p.now);
    gives_back(&mut p, token, slot);
    assert!(
        offers(&p.b).is_empty(),
        "not offered to the incarnation that left"
    );
    assert!(matches!(
        p.b.ep.region_owner(slot),
        Some(Owner::Standing { offer: None })
    ));
    restart_a(&mut p);
    p.a.take_sent();
    let id = p.a.ep.submit(p.now, &b, &descs(4, 100)).unwrap();
    p.drive();
    assert_eq!(p.a.take_completed(), vec![(id, Outcome::Success)]);
    let renewed = renewed_offer(&p, token, slot, "offered to the next incarnation");
    claim_to_the_end(&mut p, renewed, slot);
}

/// A sender that forgets its receiver gives back the offer it holds (the
/// slot leaves it, free for any sender) and never takes that token again:
/// a copy of the offer re-sent before the give-back and arriving after
/// the receiver is loaded again is ignored (the slot may be another
/// sender's by then); the pair's next WANT asks anew and is offered a
/// newer token.
#[test]
fn a_forgetting_sender_gives_its_offer_back_and_never_takes_it_again() {
    let mut p = standing_pair();
    let (_, (token, slot), late) = offered_twice_one_copy_held(&mut p);
    p.drive();
    p.a.take_completed();
    p.a.take_sent();
    let b = p.b.name.clone();
    p.a.ep.forget_peer(p.now, &b);
    gives_back(&mut p, token, slot);
    assert_eq!(p.b.ep.slot_peer(slot), None, "the slot left A");
    p.a.ep.set_peer_standing(&b);
    p.b.take_sent();
    not_taken(&mut p, late, "the late copy");
    let again = offers(&p.b);
    assert_eq!(again.len(), 1, "{:?}", p.b.sent);
    assert!(again[0].0 > token);
    claim_to_the_end(&mut p, again[0].0, again[0].1);
}
