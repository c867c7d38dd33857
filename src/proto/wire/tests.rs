//! The wire format's unit tests: every message round-trips, and malformed input
//! is refused by name (proptest among them).

use super::*;
use proptest::prelude::*;

fn arb_run() -> impl Strategy<Value = Run> {
    (
        any::<u64>(),
        any::<u64>(),
        any::<u64>(),
        any::<u32>(),
        any::<u64>(),
        any::<u64>(),
    )
        .prop_map(
            |(region_offset, addr, len, count, region_stride, addr_stride)| Run {
                region_offset,
                addr,
                len,
                count,
                region_stride,
                addr_stride,
            },
        )
}

/// Run lists of any shape, and lists of blocks as plans make them
/// (one length, single copies and runs of two, usually back to back in
/// the region), now and then at the edges of overflow: every form.
fn arb_runs(max: usize) -> impl Strategy<Value = Vec<Run>> {
    let edge = || prop_oneof![8 => 0..1u64 << 40, 1 => (u64::MAX - 1024)..=u64::MAX];
    let blocks = (
        prop_oneof![4 => 1..8192u64, 1 => any::<u64>()],
        edge(),
        proptest::collection::vec((any::<bool>(), edge(), edge(), any::<bool>()), 0..max),
    )
        .prop_map(|(len, first, copies)| {
            let mut runs: Vec<Run> = Vec::new();
            let mut next = first;
            for (pair, addr, off, packed) in copies {
                let off = if packed { next } else { off };
                next = off.wrapping_add(len);
                let mut run = Run::single(off, addr, len);
                if pair {
                    run.count = 2;
                    run.region_stride = len.wrapping_mul(1 + u64::from(!packed));
                    run.addr_stride = addr.rotate_left(7) & 0xffff_ffff;
                    next = next.wrapping_add(run.region_stride);
                }
                runs.push(run);
            }
            runs
        });
    prop_oneof![proptest::collection::vec(arb_run(), 0..max), blocks]
}

fn arb_standing_use() -> impl Strategy<Value = StandingUse> {
    prop_oneof![
        Just(StandingUse::None),
        Just(StandingUse::Wanted),
        Just(StandingUse::Held),
        (any::<u64>(), any::<u64>()).prop_map(|(token, region)| StandingUse::Claimed {
            token,
            region: RegionHandle(region),
        }),
    ]
}

fn arb_message() -> impl Strategy<Value = Message> {
    let rid = any::<u64>().prop_map(RequestId);
    prop_oneof![
        (
            rid.clone(),
            proptest::collection::vec(any::<u64>(), 1..20),
            proptest::collection::vec(any::<u8>(), 0..40),
            arb_standing_use()
        )
            .prop_map(|(request, chunk_sizes, endpoint, standing)| Message::Want {
                request,
                chunk_sizes,
                endpoint,
                key: request.0.rotate_left(17),
                standing,
                // Carried by a WANT_STANDING only.
                incarnation: match standing {
                    StandingUse::None => 0,
                    _ => request.0 ^ 0x1ca7,
                },
            }),
        (any::<u64>(), any::<u64>(), any::<u64>(), any::<u64>()).prop_map(
            |(token, region, len, incarnation)| Message::Standing {
                token,
                region: RegionHandle(region),
                len,
                incarnation,
            }
        ),
        (
            rid.clone(),
            proptest::collection::vec(any::<u8>(), 0..40),
            arb_standing_use()
        )
            .prop_map(|(request, endpoint, standing)| Message::Cancel {
                request,
                endpoint,
                key: !request.0,
                claim: standing.claim(),
                // Carried with a claim only.
                incarnation: standing.claim().map_or(0, |_| request.0 >> 3),
            }),
        (any::<u64>(), any::<u64>(), any::<u64>()).prop_map(|(token, region, incarnation)| {
            Message::Return {
                key: token.rotate_left(5),
                offer: Claim {
                    token,
                    region: RegionHandle(region),
                },
                incarnation,
            }
        }),
        (
            rid.clone(),
            proptest::collection::vec((any::<u32>(), any::<u64>(), any::<u64>()), 1..10)
        )
            .prop_map(|(request, cs)| Message::Grant {
                request,
                credits: cs
                    .into_iter()
                    .map(|(chunk, r, len)| Credit {
                        chunk,
                        region: RegionHandle(r),
                        len
                    })
                    .collect()
            }),
        (rid.clone(), any::<u32>(), any::<u64>(), arb_runs(10)).prop_map(
            |(request, chunk, region, runs)| Message::Data {
                request,
                chunk,
                region: RegionHandle(region),
                runs: runs.into(),
            }
        ),
        (rid.clone(), any::<u32>(), any::<u64>()).prop_map(|(request, chunk, region)| {
            Message::Ack {
                request,
                chunk,
                region: RegionHandle(region),
            }
        }),
        (rid.clone(), 1u8..=9).prop_map(|(request, code)| Message::Refuse {
            request,
            reason: RefuseReason::try_from(code).unwrap()
        }),
        (
            rid.clone(),
            any::<u64>(),
            proptest::collection::vec(any::<u8>(), 0..40),
            proptest::collection::vec(any::<u8>(), 0..40),
            proptest::collection::vec((any::<u64>(), arb_runs(4)), 1..5)
        )
            .prop_map(|(request, key, endpoint, data_path, cs)| Message::Read {
                request,
                key,
                endpoint,
                data_path,
                chunks: cs
                    .into_iter()
                    .map(|(size, runs)| ReadChunk {
                        size,
                        runs: runs.into()
                    })
                    .collect()
            }),
        (rid.clone(), 1u8..=9, any::<bool>()).prop_map(|(request, code, end)| {
            let reason = RefuseReason::try_from(code).unwrap();
            if end {
                Message::ReadEnd { request, reason }
            } else {
                Message::ReadRefuse { request, reason }
            }
        }),
        (rid.clone(), any::<u32>(), any::<u64>()).prop_map(|(request, chunk, region)| {
            Message::ReadGrant {
                request,
                credits: vec![Credit {
                    chunk,
                    region: RegionHandle(region),
                    len: region.rotate_left(3),
                }],
            }
        }),
        (rid, any::<u32>(), any::<u64>(), any::<bool>()).prop_map(
            |(request, chunk, region, ack)| {
                let region = RegionHandle(region);
                if ack {
                    Message::ReadAck {
                        request,
                        chunk,
                        region,
                    }
                } else {
                    Message::ReadData {
                        request,
                        chunk,
                        region,
                    }
                }
            }
        ),
    ]
}

fn handshake() -> Handshake {
    Handshake {
        wire_version: WIRE_VERSION,
        control: ControlKind::Zmq,
        capabilities: Capabilities::CANCEL,
        arena_usable_capacity: 1 << 28,
        max_chunk_size: 1 << 25,
        arena_base: 0x7f00_0000_0000,
        arena_device: 3,
        access_key: 0x5eed,
        endpoint: b"tcp://10.0.0.1:5555".to_vec(),
    }
}

#[test]
fn every_message_type_code_reads_back() {
    use MessageType::*;
    for t in [
        Want,
        Grant,
        Data,
        Ack,
        Refuse,
        WantStanding,
        Standing,
        Read,
        ReadEnd,
        ReadGrant,
        ReadData,
        ReadAck,
        ReadRefuse,
    ] {
        assert_eq!(MessageType::try_from(t as u8), Ok(t));
    }
    for code in [0u8, 8, 15, 22, 255] {
        assert_eq!(MessageType::try_from(code), Err(code));
    }
}

#[test]
fn peek_reads_type_request_and_chunk() {
    let data = Message::Data {
        request: RequestId(7),
        chunk: 3,
        region: RegionHandle(64),
        runs: vec![Run::single(0, 0x1000, 8)].into(),
    };
    assert_eq!(peek(&data.encode()), Some((3, RequestId(7), Some(3))));
    let grant = Message::Grant {
        request: RequestId(9),
        credits: vec![],
    };
    assert_eq!(peek(&grant.encode()), Some((2, RequestId(9), None)));
    assert_eq!(peek(b"NXBM"), None);
    assert_eq!(peek(&[0u8; 32]), None);
}

#[test]
fn header_checks() {
    let good = Message::Ack {
        request: RequestId(7),
        chunk: 2,
        region: RegionHandle(64),
    }
    .encode();
    assert_eq!(good.len(), HEADER_LEN + 20);
    let mut bad = good.clone();
    bad[0] = b'X';
    assert!(matches!(
        Message::decode(&bad),
        Err(WireError::BadMagic { .. })
    ));
    let mut bad = good.clone();
    bad[4] = 9;
    assert!(matches!(
        Message::decode(&bad),
        Err(WireError::Version { found: 9, .. })
    ));
    let mut bad = good.clone();
    bad[6] = 22;
    assert_eq!(Message::decode(&bad), Err(WireError::ReservedType(22)));
    let mut bad = good.clone();
    bad[6] = 99;
    assert_eq!(Message::decode(&bad), Err(WireError::UnknownType(99)));
    let mut bad = good.clone();
    bad[7] = 1;
    assert_eq!(Message::decode(&bad), Err(WireError::BadFlags(1)));
    let mut bad = good.clone();
    bad.push(0);
    assert!(matches!(
        Message::decode(&bad),
        Err(WireError::LengthMismatch { .. })
    ));
    // Trailing bytes inside a consistent length.
    let mut bad = good.clone();
    bad.push(0);
    bad[8] += 1;
    assert_eq!(
        Message::decode(&bad),
        Err(WireError::Trailing(1, "message"))
    );
    assert!(matches!(
        Message::decode(&good[..5]),
        Err(WireError::Truncated { .. })
    ));
}

#[test]
fn empty_want_is_cancel() {
    let c = Message::cancel(RequestId(5), b"ep".to_vec(), 42);
    let bytes = c.encode();
    assert_eq!(bytes[6], MessageType::Want as u8);
    assert_eq!(Message::decode(&bytes).unwrap(), c);
}

/// The CANCEL of a request that claimed a standing offer names the claim:
/// an empty WANT_STANDING. One without a claim is no message.
#[test]
fn a_cancel_names_its_claim_as_an_empty_want_standing() {
    let claim = Claim {
        token: 9,
        region: RegionHandle(4096),
    };
    let c = Message::Cancel {
        request: RequestId(5),
        endpoint: b"ep".to_vec(),
        key: 42,
        claim: Some(claim),
        incarnation: 77,
    };
    let bytes = c.encode();
    assert_eq!(bytes[6], MessageType::WantStanding as u8);
    assert_eq!(Message::decode(&bytes).unwrap(), c);
    // The same with "wanted" (1) for the claim (3, token, region).
    let mut wanted = bytes[..bytes.len() - 17].to_vec();
    wanted.push(1);
    let len = (wanted.len() - HEADER_LEN) as u32;
    wanted[8..12].copy_from_slice(&len.to_le_bytes());
    assert!(matches!(
        Message::decode(&wanted),
        Err(WireError::Invalid {
            what: "WANT_STANDING",
            ..
        })
    ));
}

/// An offer given back is an empty WANT_STANDING (use 4); a WANT with
/// chunks that says so is no message.
#[test]
fn an_offer_given_back_is_an_empty_want_standing() {
    let offer = Claim {
        token: 9,
        region: RegionHandle(4096),
    };
    let back = Message::Return {
        key: 42,
        offer,
        incarnation: 77,
    };
    let bytes = back.encode();
    assert_eq!(bytes[6], MessageType::WantStanding as u8);
    assert_eq!(Message::decode(&bytes).unwrap(), back);
    let want = Message::Want {
        request: RequestId(5),
        chunk_sizes: vec![64],
        endpoint: b"ep".to_vec(),
        key: 42,
        standing: StandingUse::Returned {
            token: 9,
            region: RegionHandle(4096),
        },
        incarnation: 77,
    };
    assert!(matches!(
        Message::decode(&want.encode()),
        Err(WireError::Invalid {
            what: "WANT_STANDING",
            ..
        })
    ));
}

#[test]
fn absurd_counts_rejected_before_allocation() {
    let mut w = Writer::new();
    w.u64(1); // request
    w.u64(0); // access key
    w.u32(u32::MAX);
    let payload = w.into_bytes();
    let mut m = Writer::new();
    m.bytes(&MESSAGE_MAGIC);
    m.u16(WIRE_VERSION);
    m.u8(1);
    m.u8(0);
    m.u32(payload.len() as u32);
    m.bytes(&payload);
    assert!(matches!(
        Message::decode(&m.into_bytes()),
        Err(WireError::CountTooLarge { .. })
    ));
    // A plausible count with too few bytes behind it.
    let mut w = Writer::new();
    w.u64(1); // request
    w.u64(0); // access key
    w.u32(1000);
    let payload = w.into_bytes();
    let mut m = Writer::new();
    m.bytes(&MESSAGE_MAGIC);
    m.u16(WIRE_VERSION);
    m.u8(1);
    m.u8(0);
    m.u32(payload.len() as u32);
    m.bytes(&payload);
    assert!(matches!(
        Message::decode(&m.into_bytes()),
        Err(WireError::Truncated { need: 8000, .. })
    ));
}

#[test]
fn handshake_round_trip_and_compatibility() {
    let h = handshake();
    assert_eq!(Handshake::decode(&h.encode()).unwrap(), h);
    assert!(h.check_compatible(&h).is_ok());
    let mut p = h.clone();
    p.control = ControlKind::NixlNotif;
    assert!(matches!(
        h.check_compatible(&p),
        Err(Incompatible::ControlKind { .. })
    ));
    let mut p = h.clone();
    p.max_chunk_size /= 2;
    assert!(h
        .check_compatible(&p)
        .unwrap_err()
        .to_string()
        .contains("MAX_CHUNK_SIZE_BYTES"));
    let mut p = h.clone();
    p.capabilities = Capabilities(0);
    assert_eq!(h.check_compatible(&p), Err(Incompatible::NoCancel));
    let mut bytes = h.encode();
    bytes.push(1);
    assert!(matches!(
        Handshake::decode(&bytes),
        Err(WireError::Trailing(1, _))
    ));
    let mut p = h.clone();
    p.max_chunk_size = p.arena_usable_capacity + 1;
    assert!(Handshake::decode(&p.encode()).is_err());
    for cut in 0..h.encode().len() {
        assert!(Handshake::decode(&h.encode()[..cut]).is_err());
    }
}

/// A plan's block list (single copies and runs of two, back to back in
/// the region) travels as addresses: 8 bytes a copy, not 44 a run.
#[test]
fn block_lists_travel_as_addresses() {
    let data = |runs: Vec<Run>| Message::Data {
        request: RequestId(1),
        chunk: 0,
        region: RegionHandle(0),
        runs: runs.into(),
    };
    // 4096 blocks of 4 KiB, every third one paired with the next.
    let mut runs = Vec::new();
    let mut j = 0u64;
    while j < 4096 {
        let mut run = Run::single(j * 4096, (1 << 40) + (j * 7919 % 4096) * 8192, 4096);
        if j.is_multiple_of(3) && j + 1 < 4096 {
            run.count = 2;
            run.region_stride = 4096;
            run.addr_stride = 3 * 8192;
        }
        j += u64::from(run.count);
        runs.push(run);
    }
    let m = data(runs.clone());
    let bytes = m.encode();
    assert_eq!(bytes.len(), HEADER_LEN + 20 + 5 + 16 + 4096 / 8 + 8 * 4096);
    assert_eq!(Message::decode(&bytes), Ok(m));
    // Not back to back: (offset, address) a copy.
    runs[5].region_offset += 1 << 30;
    let m = data(runs.clone());
    let bytes = m.encode();
    assert_eq!(bytes.len(), HEADER_LEN + 20 + 5 + 8 + 4096 / 8 + 16 * 4096);
    assert_eq!(Message::decode(&bytes), Ok(m));
    // A run of three: every field of every run.
    runs[7].count = 3;
    runs[7].region_stride = 4096;
    runs[7].addr_stride = 4096;
    let m = data(runs.clone());
    assert_eq!(
        m.encode().len(),
        HEADER_LEN + 20 + 5 + RUN_BYTES * runs.len()
    );
    assert_eq!(Message::decode(&m.encode()), Ok(m));
}

#[test]
fn bad_block_lists_are_errors() {
    let packed = |n: u32, len: u64, first: u64, marks: &[u8]| {
        let mut p = Writer::new();
        p.u64(1);
        p.u32(0);
        p.u64(0);
        p.u8(RunForm::Packed as u8);
        p.u32(n);
        p.u64(len);
        p.u64(first);
        p.bytes(marks);
        for i in 0..u64::from(n) {
            p.u64(i << 12);
        }
        let payload = p.into_bytes();
        let mut m = Writer::new();
        m.bytes(&MESSAGE_MAGIC);
        m.u16(WIRE_VERSION);
        m.u8(MessageType::Data as u8);
        m.u8(0);
        m.u32(payload.len() as u32);
        m.bytes(&payload);
        Message::decode(&m.into_bytes())
    };
    assert!(packed(3, 4096, 0, &[0b010]).is_ok());
    // A second copy with no single copy before it.
    assert!(packed(3, 4096, 0, &[0b001]).is_err());
    assert!(packed(3, 4096, 0, &[0b110]).is_err());
    // Marks past the copies.
    assert!(packed(3, 4096, 0, &[0b1000]).is_err());
    // Offsets that overflow.
    assert!(packed(3, 1 << 63, 1, &[0]).is_err());
    // More entries than the message may still carry.
    let mut p = Writer::new();
    p.u8(RunForm::Packed as u8);
    p.u32(3);
    p.u64(4096);
    p.u64(0);
    p.u8(0);
    for i in 0..3u64 {
        p.u64(i << 12);
    }
    let list = p.into_bytes();
    assert!(decode_runs(&mut Reader::new(&list), &mut 3).is_ok());
    assert!(matches!(
        decode_runs(&mut Reader::new(&list), &mut 2),
        Err(WireError::CountTooLarge { .. })
    ));
    // An unknown form.
    let mut p = Writer::new();
    p.u8(7);
    p.u32(0);
    assert!(decode_runs(
        &mut Reader::new(&p.into_bytes()),
        &mut MAX_MESSAGE_RUNS.clone()
    )
    .is_err());
}

proptest! {
    /// A DATA whose runs are packed copies decodes to those copies, kept
    /// as copies (the receiver reads them so, docs/design.md §4), when
    /// their runs exist (no address range wraps).
    #[test]
    fn packed_data_decodes_to_its_copies(c in crate::proto::testing::arb_copies()) {
        prop_assume!(c.addresses_fit());
        let m = Message::Data {
            request: RequestId(1),
            chunk: 2,
            region: RegionHandle(3),
            runs: Runs::from_copies(c.clone()),
        };
        let Ok(Message::Data { runs, .. }) = Message::decode(&m.encode()) else {
            panic!("a DATA decodes");
        };
        prop_assert_eq!(runs.copies(), Some(&c));
    }

    /// A list kept as packed copies encodes to the bytes its runs alone
    /// encode to (the encoder writes copies straight out only where that
    /// holds), with an exact size hint; READ chunks too.
    #[test]
    fn copies_encode_as_their_runs(c in crate::proto::testing::arb_copies()) {
        let data = |runs: Runs| Message::Data {
            request: RequestId(1),
            chunk: 2,
            region: RegionHandle(3),
            runs,
        };
        let read = |runs: Runs| Message::Read {
            request: RequestId(4),
            key: 5,
            endpoint: b"ep".to_vec(),
            data_path: b"dp".to_vec(),
            chunks: vec![ReadChunk { size: c.region_end(), runs }],
        };
        let as_runs = || Runs::from(Runs::from_copies(c.clone()).to_vec());
        for (kept, plain) in [
            (data(Runs::from_copies(c.clone())), data(as_runs())),
            (read(Runs::from_copies(c.clone())), read(as_runs())),
        ] {
            let bytes = kept.encode();
            prop_assert_eq!(&bytes, &plain.encode());
            prop_assert_eq!(bytes.len(), HEADER_LEN + kept.payload_len_hint());
            prop_assert_eq!(kept.run_entries(), plain.run_entries());
        }
    }

    #[test]
    fn messages_round_trip(m in arb_message()) {
        let bytes = m.encode();
        // The size hint is exact (one allocation per encode).
        prop_assert_eq!(bytes.len(), HEADER_LEN + m.payload_len_hint());
        prop_assert_eq!(Message::decode(&bytes), Ok(m));
    }

    #[test]
    fn truncations_are_errors(m in arb_message(), cut in any::<prop::sample::Index>()) {
        let bytes = m.encode();
        let cut = cut.index(bytes.len());
        prop_assert!(Message::decode(&bytes[..cut]).is_err());
    }

    /// Valid messages with one byte changed (reaching the compact run
    /// lists' decoders, which random bytes rarely do) decode without
    /// panicking, and whatever decodes re-encodes to itself.
    #[test]
    fn changed_bytes_never_panic(m in arb_message(), at in any::<prop::sample::Index>(), xor in 1u8..) {
        let mut bytes = m.encode();
        // Every message has a payload (9 bytes or more).
        let i = HEADER_LEN + at.index(bytes.len() - HEADER_LEN);
        bytes[i] ^= xor;
        if let Ok(msg) = Message::decode(&bytes) {
            prop_assert_eq!(Message::decode(&msg.encode()), Ok(msg));
        }
    }

    #[test]
    fn arbitrary_bytes_never_panic(bytes in proptest::collection::vec(any::<u8>(), 0..300)) {
        let _ = Message::decode(&bytes);
        let _ = Handshake::decode(&bytes);
    }

    #[test]
    fn arbitrary_payloads_behind_a_valid_header_never_panic(
        ty in 0u8..32, payload in proptest::collection::vec(any::<u8>(), 0..200)
    ) {
        let mut m = Writer::new();
        m.bytes(&MESSAGE_MAGIC);
        m.u16(WIRE_VERSION);
        m.u8(ty);
        m.u8(0);
        m.u32(payload.len() as u32);
        m.bytes(&payload);
        if let Ok(msg) = Message::decode(&m.into_bytes()) {
            // Whatever decodes re-encodes to a message that decodes the
            // same (a run list in the full form may come back compact).
            prop_assert_eq!(Message::decode(&msg.encode()), Ok(msg));
        }
    }

    #[test]
    fn handshakes_round_trip(cap in 0u32..40, chunk_shift in 0u32..40, ep in proptest::collection::vec(any::<u8>(), 0..64), flags in any::<u64>()) {
        let usable = 1u64 << cap;
        let h = Handshake {
            wire_version: WIRE_VERSION,
            control: [ControlKind::Zmq, ControlKind::NixlNotif, ControlKind::Tcp][(flags % 3) as usize],
            capabilities: Capabilities(flags),
            arena_usable_capacity: usable,
            max_chunk_size: (1u64 << chunk_shift).min(usable),
            arena_base: flags.rotate_left(7),
            arena_device: cap,
            access_key: flags.rotate_left(13),
            endpoint: ep,
        };
        prop_assert_eq!(Handshake::decode(&h.encode()), Ok(h));
    }
}

/// What a receiver's IO thread pays to decode one DATA of 2048 scattered
/// 4 KiB copies (a 64 MiB request's chunk at 8 chunks), the encoding
/// beside it: `cargo test --release --lib data_decode_cost -- --ignored
/// --nocapture` (or under valgrind for instructions). 5.9 us before the
/// thirty-second session, 2.3-2.5 us after (the CPU VM).
#[test]
#[ignore]
fn data_decode_cost() {
    let n = 2048u64;
    let addrs: Vec<u64> = (0..n)
        .map(|i| 0x7f00_0000_0000 + ((i * 7919) % n) * 4096)
        .collect();
    let k = 2000;
    // No copy marked (scattered blocks), then every other one (pairs of
    // blocks, each pair a run of two: the marked-copy loop's worst case).
    for (what, mark) in [("no marks", 0u8), ("every other copy marked", 0b1010_1010)] {
        let mut addrs = addrs.clone();
        if mark != 0 {
            for (j, a) in addrs.iter_mut().enumerate() {
                *a += j as u64 % 2 * 0x10_0000_0000;
            }
        }
        let marks = vec![mark; (n as usize).div_ceil(8)];
        let c = Copies::new(4096, 0, addrs, marks).unwrap();
        assert!(c.addresses_fit());
        let m = Message::Data {
            request: RequestId(1),
            chunk: 2,
            region: RegionHandle(3),
            runs: Runs::from_copies(c),
        };
        let bytes = m.encode();
        let t = std::time::Instant::now();
        for _ in 0..k {
            std::hint::black_box(Message::decode(std::hint::black_box(&bytes)).unwrap());
        }
        let each = t.elapsed() / k;
        eprintln!("{what}: decode of {} bytes: {each:?} each", bytes.len());
        let t = std::time::Instant::now();
        for _ in 0..k {
            std::hint::black_box(m.encode());
        }
        eprintln!("{what}: encode: {:?} each", t.elapsed() / k);
    }
}
