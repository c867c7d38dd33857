//! Owner safety for READ: the source ranges of a READ arrive over the
//! network, so the data owner must read only memory registered with its own
//! BOUNCE engine (the check a remote key gives the UCX path's READ). A fake
//! reader (the library's control channel speaking `nixl_bounce::proto::wire`, see
//! tests/support/fake_sender.rs) reads the owner's control endpoint and
//! access key from its published metadata and sends READs whose sources
//! point:
//! - at a buffer nobody registered;
//! - across the end of the registered buffer;
//! - at memory registered with ANOTHER agent's engine in this process;
//! - at a buffer that was registered and then deregistered;
//! - at the owner's own arena;
//! - with an address range that wraps around, runs beyond the chunk they
//!   fill, or a chunk above the cap (malformed: ProtocolViolation,
//!   ChunkTooLarge);
//! - with a wrong access key.
//!
//! Each must be answered with READ_END naming the reason, before anything
//! is read: `reads_refused` rises, no gather runs (`gather_ns` unchanged),
//! nothing is written, and the owner stays healthy (a real bounce READ from
//! it succeeds afterwards). A READ of registered memory by the same client,
//! for contrast, is accepted (gathered) and ends only because the client
//! has no arena to write into.
mod support;

use bounce::*;
use fake_sender::*;
use nixl_bounce::proto::wire::{Credit, Message, ReadChunk, RefuseReason};
use nixl_bounce::proto::{RegionHandle, RequestId, Run};
use nixl_sys::ThreadSync;
use std::time::Duration;
use support::*;

const MANY: usize = 4096;

fn read(fake: &FakeSender, request: u64, key: u64, chunks: Vec<ReadChunk>) -> RequestId {
    let request = RequestId(request);
    fake.send(&Message::Read {
        request,
        key,
        endpoint: fake.endpoint.as_bytes().to_vec(),
        data_path: Vec::new(),
        chunks,
    });
    request
}

fn one_chunk(addr: u64, len: u64) -> Vec<ReadChunk> {
    vec![ReadChunk {
        size: len,
        runs: vec![Run::single(0, addr, len)].into(),
    }]
}

/// A real bounce READ by `r` from `o` (the owner is still healthy).
fn healthy(r: &mut Endpoint, o: &mut Endpoint, seed: u64) {
    let plan = Plan::standard(MANY, BLOCK, seed);
    o.buf.fill_pattern(seed + 1);
    let (src, dst_before) = (o.buf.as_slice().to_vec(), r.buf.as_slice().to_vec());
    let so = stats(o.name());
    let req = read_request(r, o, &plan, None);
    r.node
        .post_and_wait(&req, wait_timeout())
        .or_fail("healthy READ");
    drop(req);
    plan.verify(r.buf.as_slice(), &dst_before, &src)
        .or_fail("healthy READ destination");
    let eo = stats_once(o.name(), &so, "reads_served", 1, wait_timeout());
    assert_eq!(eo.since(&so, "reads_served"), 1);
}

#[test]
#[serial_test::serial]
fn forged_reads_of_unregistered_memory_are_refused_before_anything_is_read() {
    if !ready("BOUNCE") {
        return;
    }
    let len = blocks_for(MANY) * BLOCK;
    let mut o = endpoint("fr-owner", &[LOOPBACK], len, 1, ThreadSync::Default);
    let mut r = endpoint("fr-reader", &[LOOPBACK], len, 2, ThreadSync::Default);
    pair_up(&r.node, &o.node);
    healthy(&mut r, &mut o, 10);

    let hs = handshake_of(&o.node.local_md().or_fail("owner md"));
    let endpoint = String::from_utf8(hs.endpoint.clone()).expect("a TCP endpoint is text");
    let fake = FakeSender::new(&endpoint, hs.access_key, hs.control);
    let stranger = DramBuffer::with_pattern(64 * KIB, 77);
    let gone = DramBuffer::with_pattern(64 * KIB, 78);
    drop(o.node.register(&gone).or_fail("register"));
    let o_end = (o.buf.addr() + o.buf.len()) as u64;
    let cap = 32 * MIB as u64;
    let cases: Vec<(&str, u64, Vec<ReadChunk>, RefuseReason)> = vec![
        (
            "an unregistered buffer",
            hs.access_key,
            one_chunk(stranger.addr() as u64, 4096),
            RefuseReason::SourceRefused,
        ),
        (
            "across the end of the registered buffer",
            hs.access_key,
            one_chunk(o_end - 2048, 4096),
            RefuseReason::SourceRefused,
        ),
        (
            "another agent's registered buffer",
            hs.access_key,
            one_chunk(r.buf.addr() as u64, 4096),
            RefuseReason::SourceRefused,
        ),
        (
            "a deregistered buffer",
            hs.access_key,
            one_chunk(gone.addr() as u64, 4096),
            RefuseReason::SourceRefused,
        ),
        (
            "the owner's own arena",
            hs.access_key,
            one_chunk(hs.arena_base, 4096),
            RefuseReason::SourceRefused,
        ),
        (
            "an address range that wraps around",
            hs.access_key,
            one_chunk(u64::MAX - 100, 4096),
            RefuseReason::ProtocolViolation,
        ),
        (
            "registered memory, then a strided run leaving it",
            hs.access_key,
            vec![ReadChunk {
                size: 64 * 4096,
                runs: vec![Run {
                    region_offset: 0,
                    addr: o.buf.addr() as u64,
                    len: 4096,
                    count: 64,
                    region_stride: 4096,
                    addr_stride: len as u64 / 32,
                }]
                .into(),
            }],
            RefuseReason::SourceRefused,
        ),
        (
            "a run beyond its chunk",
            hs.access_key,
            vec![ReadChunk {
                size: 1024,
                runs: vec![Run::single(512, o.buf.addr() as u64, 1024)].into(),
            }],
            RefuseReason::ProtocolViolation,
        ),
        (
            "a chunk above the chunk cap",
            hs.access_key,
            one_chunk(o.buf.addr() as u64, cap + 32),
            RefuseReason::ChunkTooLarge,
        ),
        (
            "a wrong access key",
            hs.access_key ^ 1,
            one_chunk(o.buf.addr() as u64, 4096),
            RefuseReason::ProtocolViolation,
        ),
    ];
    let owner_bytes = o.buf.as_slice().to_vec();
    for (i, (case, key, chunks, want)) in cases.into_iter().enumerate() {
        let so = stats(o.name());
        let id = read(&fake, 0x5eed_0000 + i as u64, key, chunks);
        // A READ_GRANT right behind it, as a real reader sends: nothing may
        // be gathered for it either.
        fake.send(&Message::ReadGrant {
            request: id,
            credits: vec![Credit {
                chunk: 0,
                region: RegionHandle(0),
                len: 4096,
            }],
        });
        match fake.recv(&format!("READ_END for {case}")) {
            Message::ReadEnd { request, reason } => {
                assert_eq!(request, id, "{case}");
                assert_eq!(reason, want, "{case}");
            }
            other => panic!("{case}: expected READ_END, got {other:?}"),
        }
        assert_eq!(
            fake.quiet_for(Duration::from_millis(100)),
            None,
            "{case}: one answer"
        );
        let eo = stats(o.name());
        eprintln!("{case}: refused ({want:?}); {}", eo.diff(&so));
        assert_eq!(
            eo.since(&so, "reads_refused"),
            1,
            "{case}: {}",
            eo.diff(&so)
        );
        assert_eq!(
            eo.since(&so, "gather_ns"),
            0,
            "{case}: something was gathered"
        );
        assert_eq!(eo.since(&so, "chunks_written"), 0, "{case}");
        assert!(eo.poisoned.is_none(), "{case}: {:?}", eo.poisoned);
    }
    verify_bytes(o.buf.as_slice(), &owner_bytes, |_| "owner".into())
        .or_fail("owner buffer changed");
    o.buf.check_guards().or_fail("owner guards");

    // For contrast: registered memory is accepted and gathered; the READ
    // then ends because this client described no arena to write into.
    let so = stats(o.name());
    let id = read(
        &fake,
        0x5eed_1000,
        hs.access_key,
        one_chunk(o.buf.addr() as u64, 4096),
    );
    fake.send(&Message::ReadGrant {
        request: id,
        credits: vec![Credit {
            chunk: 0,
            region: RegionHandle(0),
            len: 4096,
        }],
    });
    match fake.recv("READ_END for a READ the client cannot receive") {
        Message::ReadEnd { request, reason } => {
            assert_eq!((request, reason), (id, RefuseReason::SenderFailed));
        }
        other => panic!("expected READ_END, got {other:?}"),
    }
    let eo = stats(o.name());
    eprintln!("registered source, no data path: {}", eo.diff(&so));
    assert_eq!(eo.since(&so, "reads_refused"), 0);
    assert_eq!(eo.since(&so, "write_failures"), 1);

    healthy(&mut r, &mut o, 20);
    drop(stranger);
}
