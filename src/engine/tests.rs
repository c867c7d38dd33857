//! The engine's unit tests: configuration, routing, and the paths' preparations
//! over regions made by hand (`testing`).

use super::*;

#[test]
fn transfer_params_parse() {
    assert_eq!(
        TransferParams::parse(b"").unwrap(),
        TransferParams::default()
    );
    assert_eq!(
        TransferParams::parse(b"deadline_ms=250")
            .unwrap()
            .deadline_ms,
        Some(250)
    );
    assert_eq!(
        TransferParams::parse(b" deadline_ms = 7 ;")
            .unwrap()
            .deadline_ms,
        Some(7)
    );
    assert!(TransferParams::parse(b"deadline_ms=soon")
        .unwrap_err()
        .message
        .contains("deadline_ms"));
    assert!(TransferParams::parse(b"bogus=1")
        .unwrap_err()
        .message
        .contains("\"bogus\""));
    assert!(TransferParams::parse(b"novalue").is_err());
    assert!(TransferParams::parse(&[0xff]).is_err());
}

proptest::proptest! {
    /// The shim's short cut agrees with the engine: below a pair of
    /// kinds' floor, every shape goes to UCX for the reason
    /// `below_floor_reason` gives; at the floor, some shape does not.
    #[test]
    fn the_route_floor_agrees_with_the_early_decision(
        enabled in proptest::prelude::any::<bool>(),
        peer_map in proptest::prelude::any::<bool>(),
        mins in proptest::collection::vec(0u64..3000, 5),
        reach in 0u8..3,
        local_vram in proptest::prelude::any::<bool>(),
        remote_vram in proptest::prelude::any::<bool>(),
        local_transfer in proptest::prelude::any::<bool>(),
        descriptors in 0u64..3000,
        average in 1u64..(1 << 20),
        sum_first in proptest::prelude::any::<bool>(),
    ) {
        let cfg = Config {
            enabled,
            enable_peer_map: peer_map,
            min_descriptor_count: mins[0],
            vram_min_descriptor_count: mins[1],
            peer_map_min_descriptor_count: mins[2],
            mixed_min_descriptor_count: mins[3],
            tcp_min_descriptor_count: mins[4],
            ..Config::default()
        };
        // The peer's reach as the engine may know it (or not yet).
        let reach = [None, Some(bounce::Reach::Near), Some(bounce::Reach::Tcp)][usize::from(reach)];
        let kind = |vram| if vram { MemKind::Vram } else { MemKind::Dram };
        let (local, remote) = (kind(local_vram), kind(remote_vram));
        let shape = |descriptors: u64, local_transfer| Shape {
            local,
            remote,
            descriptors,
            bytes: TotalBytes::Known(descriptors * average),
            local_transfer,
        };
        let floor = route_floor(&cfg, local, remote);
        if descriptors < floor {
            proptest::prop_assert_eq!(
                early_reason(&cfg, &shape(descriptors, local_transfer), reach, || sum_first),
                Some(below_floor_reason(&cfg, local_transfer))
            );
        }
        if floor != u64::MAX {
            // The smallest shape at the floor is let through while the
            // peer's reach is not known.
            let small = Shape { bytes: TotalBytes::Known(floor), ..shape(floor, false) };
            proptest::prop_assert_eq!(early_reason(&cfg, &small, None, || sum_first), None);
        }
    }
}

/// Before the routing, the arena's gate is the peer's own where its reach
/// is known; unknown, the loosest of the two on a host that reaches others
/// over TCP only, the same-host one elsewhere.
#[test]
fn the_early_gate_is_the_peer_s_own_once_its_reach_is_known() {
    use bounce::{Reach, ShapeGate};
    let cfg = Config::default();
    let d = MemKind::Dram;
    let near = ShapeGate {
        min_descriptors: 1024,
        max_average_bytes: 8 << 10,
    };
    let tcp = ShapeGate {
        min_descriptors: 256,
        max_average_bytes: 1 << 20,
    };
    let gate = |reach, tcp_only| early_arena_gate(&cfg, d, d, reach, tcp_only);
    assert_eq!(gate(Some(Reach::Near), true), near);
    assert_eq!(gate(Some(Reach::Tcp), true), tcp);
    assert_eq!(gate(None, true), tcp);
    assert_eq!(gate(None, false), near);
    // VRAM's gate whatever the reach.
    let v = MemKind::Vram;
    assert_eq!(
        early_arena_gate(&cfg, v, v, None, true),
        early_arena_gate(&cfg, v, v, Some(Reach::Near), false)
    );
}

#[test]
fn range_cover_checks_device_and_overflow() {
    let outer = Range {
        addr: 100,
        len: 100,
        dev: 0,
    };
    assert!(outer.covers(&Range {
        addr: 100,
        len: 100,
        dev: 0
    }));
    assert!(outer.covers(&Range {
        addr: 150,
        len: 10,
        dev: 0
    }));
    assert!(!outer.covers(&Range {
        addr: 150,
        len: 51,
        dev: 0
    }));
    assert!(!outer.covers(&Range {
        addr: 150,
        len: 10,
        dev: 1
    }));
    assert!(!outer.covers(&Range {
        addr: usize::MAX,
        len: 2,
        dev: 0
    }));
}

mod checked {
    use super::*;
    use crate::dataplane::PeerArena;
    use crate::engine::testing::{at, md, registered, REGION};
    use nixl_sys::MemType;

    fn remote(peer: &str) -> MdOwner {
        MdOwner::Remote {
            agent: peer.into(),
            bounce: Some(peer_bounce(peer, MemType::Dram)),
            staged: None,
            peer: None,
            mapped: std::sync::OnceLock::new(),
            cma: None,
        }
    }

    fn peer_bounce(id: &str, mem: MemType) -> Arc<PeerBounce> {
        Arc::new(PeerBounce {
            id: PeerId::new(id),
            arena: PeerArena {
                inner_agent: format!("{id}/bounce"),
                base: 0,
                device: 0,
                mem,
                cma: None,
            },
            key: 7,
            read: true,
            heartbeats: true,
            standing: true,
            data_path_v2: true,
            reach: bounce::Reach::Near,
        })
    }

    #[test]
    fn dram_meets_a_peers_gpu_through_its_host_staged_arena() {
        // A peer's VRAM region with its GPU's two instances.
        let vram = Box::leak(Box::new(md(
            1 << 40,
            MdOwner::Remote {
                agent: "peer".into(),
                bounce: Some(peer_bounce("peer-vram", MemType::Vram)),
                staged: Some(peer_bounce("peer-staged", MemType::Dram)),
                peer: None,
                mapped: std::sync::OnceLock::new(),
                cma: None,
            },
        )));
        let local = Box::leak(Box::new(md(1 << 32, registered())));
        let (l, r) = ([at(local, 0, 4096)], [at(vram, 0, 4096)]);
        let resolve = |p: *const std::ffi::c_void| p as *const Md;
        for (kind, want) in [(MemKind::Dram, "peer-staged"), (MemKind::Vram, "peer-vram")] {
            // SAFETY: both handles are the leaked `Md`s above.
            let (ld, rd) = unsafe {
                (
                    Descs::new(kind, &l, &resolve),
                    Descs::new(MemKind::Vram, &r, &resolve),
                )
            };
            let c = Checked::new(Op::Write, ld, rd).expect("checked");
            assert_eq!(c.peer.map(|p| p.id.as_str()), Some(want), "local {kind:?}");
            let packing = Packing::of(Op::Write, &ld, &rd);
            assert!(packing.is_none(), "no local instance here");
        }
        // Without a host-staged instance, the peer's only one.
        let plain = Box::leak(Box::new(md(
            1 << 40,
            MdOwner::Remote {
                agent: "peer".into(),
                bounce: Some(peer_bounce("peer-vram", MemType::Vram)),
                staged: None,
                peer: None,
                mapped: std::sync::OnceLock::new(),
                cma: None,
            },
        )));
        assert_eq!(
            plain.arena_for(true).map(|p| p.id.as_str()),
            Some("peer-vram")
        );
        assert_eq!(
            vram.arena_for(false).map(|p| p.id.as_str()),
            Some("peer-vram")
        );
    }

    /// `f` of the check of a WRITE from `l` to `r`, after checking
    /// that the check in parts of every length finds the same.
    fn check<T>(l: &[RawDesc], r: &[RawDesc], f: impl FnOnce(Result<Checked<'_>>) -> T) -> T {
        // NIXL's handles are not the `Md`s' addresses (the shim's table
        // maps one to the other): here a tag tells them apart, so that a
        // check using a handle as an `Md` would fail.
        const TAG: usize = 0x5a5a_0000;
        let tagged = |d: &[RawDesc]| -> Vec<RawDesc> {
            d.iter()
                .map(|x| RawDesc {
                    md: match x.md.is_null() {
                        true => x.md,
                        false => (x.md as usize ^ TAG) as *const std::ffi::c_void,
                    },
                    ..*x
                })
                .collect()
        };
        let (l, r) = (&tagged(l)[..], &tagged(r)[..]);
        let resolve = |p: *const std::ffi::c_void| (p as usize ^ TAG) as *const Md;
        // SAFETY: every handle is one of the test's leaked `Md`s or
        // null.
        let (ld, rd) = unsafe {
            (
                Descs::new(MemKind::Dram, l, &resolve),
                Descs::new(MemKind::Dram, r, &resolve),
            )
        };
        let one_pass = Checked::new(Op::Write, ld, rd);
        // With the regions kept: cold (every one resolved and kept), then
        // warm (every one found), then kept from other lists of the same
        // regions (the first half of these, and these reversed).
        let mut kept = KeptRegions::default();
        for round in ["cold", "warm"] {
            let c = Checked::with_kept(Op::Write, ld, rd, Some(&mut kept));
            assert_eq!(facts(&c), facts(&one_pass), "regions kept, {round}");
        }
        let (rl, rr): (Vec<_>, Vec<_>) = l.iter().rev().zip(r.iter().rev()).unzip();
        let half = l.len() / 2;
        let (hl, hr) = (l[..half].to_vec(), r[..half].to_vec());
        for (what, kl, kr) in [("the first half", &hl, &hr), ("reversed", &rl, &rr)] {
            // SAFETY: as above.
            let (kd, kr) = unsafe {
                (
                    Descs::new(MemKind::Dram, kl, &resolve),
                    Descs::new(MemKind::Dram, kr, &resolve),
                )
            };
            let mut kept = KeptRegions::default();
            let _ = Checked::with_kept(Op::Write, kd, kr, Some(&mut kept));
            let c = Checked::with_kept(Op::Write, ld, rd, Some(&mut kept));
            assert_eq!(facts(&c), facts(&one_pass), "regions kept from {what}");
        }
        let mut fill = fill_pool();
        for part_len in 1..=l.len() {
            fill.part_len = part_len;
            let (parts, _, _) =
                Checked::in_parts(Op::Write, ld, rd, &fill, None, None).expect("the pool is free");
            assert_eq!(facts(&parts), facts(&one_pass), "in parts of {part_len}");
        }
        f(one_pass)
    }

    /// A pool of two workers beside the calling thread.
    fn fill_pool() -> ipc::FillPool {
        let pool = rayon::ThreadPoolBuilder::new()
            .num_threads(2)
            .build()
            .unwrap();
        ipc::FillPool::new(pool, 1)
    }

    /// What a check found, to compare.
    fn facts(c: &Result<Checked<'_>>) -> std::result::Result<String, String> {
        match c {
            Ok(c) => Ok(format!(
                "peer {:?}, instance {:?}, survey {:?}",
                c.peer,
                c.local_instance.map(Arc::as_ptr),
                c.survey
            )),
            Err(e) => Err(e.to_string()),
        }
    }

    /// Not a benchmark: how long the check of vLLM's 128-token READ
    /// (64 regions a side, 8 blocks each: 512 descriptors) takes here,
    /// warm and cold, its handles resolved through a hash table as the
    /// shim's. `cargo test --release --lib check_cost -- --ignored
    /// --nocapture`
    #[test]
    #[ignore]
    fn check_cost() {
        let (regions, blocks, len) = (64usize, 8usize, 8192usize);
        // Each region's metadata on pages of its own, as registrations
        // made over time leave them.
        let leak = |m: Md| -> &'static Md {
            Box::leak(vec![0u8; 3 * 4096].into_boxed_slice());
            Box::leak(Box::new(m))
        };
        let local: Vec<&Md> = (0..regions)
            .map(|i| leak(md((1 << 32) + i * REGION, registered())))
            .collect();
        let remote: Vec<&Md> = (0..regions)
            .map(|i| leak(md((1 << 40) + i * REGION, remote("peer"))))
            .collect();
        let (mut l, mut r) = (Vec::new(), Vec::new());
        for (lm, rm) in local.iter().zip(&remote) {
            for b in 0..blocks {
                l.push(at(lm, (b * 7919) % 64 * len, len));
                r.push(at(rm, (b * 104_729) % 64 * len, len));
            }
        }
        // The shim's table: NIXL's handle -> BOUNCE's metadata.
        let table: HashMap<usize, usize> = local
            .iter()
            .chain(&remote)
            .map(|m| (*m as *const Md as usize, *m as *const Md as usize))
            .collect();
        let resolve = |p: *const std::ffi::c_void| {
            table
                .get(&(p as usize))
                .map_or(std::ptr::null(), |m| *m as *const Md)
        };
        // SAFETY: every handle resolves to a leaked `Md`.
        let (ld, rd) = unsafe {
            (
                Descs::new(MemKind::Dram, &l, &resolve),
                Descs::new(MemKind::Dram, &r, &resolve),
            )
        };
        let mut sweep = vec![0u8; 64 << 20];
        for keep in [false, true] {
            let mut kept = KeptRegions::default();
            let mut once = || {
                let t = std::time::Instant::now();
                let k = keep.then_some(&mut kept);
                let c = Checked::with_kept(Op::Read, ld, rd, k).expect("checked");
                let ns = t.elapsed().as_nanos();
                assert!(c.peer.is_some() && c.survey.is_ok());
                ns
            };
            let warm = (0..2000).map(|_| once()).min().unwrap();
            let mut cold: Vec<u128> = (0..50u8)
                .map(|i| {
                    sweep
                        .iter_mut()
                        .step_by(64)
                        .for_each(|b| *b = b.wrapping_add(i));
                    once()
                })
                .collect();
            cold.sort_unstable();
            println!(
                "Checked of {} descriptors in {regions} runs, regions kept {keep}: warm {:.1} us (best of 2000), cold {:.1} us (median of 50)",
                l.len(),
                warm as f64 / 1e3,
                cold[25] as f64 / 1e3
            );
        }
        std::hint::black_box(&sweep);
    }

    /// Not a benchmark: the arena preparation's check and packing of
    /// `PREP_N` (16,384) scattered 4 KiB blocks (random slots of one
    /// 1 GiB region a side, as `bounce-vram bench` makes them), new lists
    /// written by this thread before each round as a client makes them:
    /// in one pass here, in parts of whole chunks on a pool of
    /// `PREP_THREADS` (8) threads with this one (as `Checked::in_parts`
    /// shared them before chunks were packed in slices), each part timed
    /// where it runs, and by `Checked::in_parts` itself (slices of
    /// `PREP_PART` / 2, default 512, stitched), the three in turn
    /// (`PREP_IN_ORDER=1`: blocks in order, packed whole). Medians
    /// of `PREP_ROUNDS` (300) rounds, a third each. It tells whether the
    /// parts themselves or their sharing out bound the preparation on a
    /// host with cores to spare. `cargo test --release --lib prep_cost --
    /// --ignored --nocapture`
    #[test]
    #[ignore]
    fn prep_cost() {
        let env = |k: &str, d: usize| {
            std::env::var(k)
                .ok()
                .and_then(|v| v.parse().ok())
                .unwrap_or(d)
        };
        let (n, threads, rounds) = (
            env("PREP_N", 16_384),
            env("PREP_THREADS", 8),
            env("PREP_ROUNDS", 300).max(3),
        );
        let (len, slots) = (4096usize, (1usize << 30) / 4096);
        let region = |base: usize, owner: MdOwner| -> &'static Md {
            let mut m = md(base, owner);
            m.range.len = 1 << 30;
            Box::leak(Box::new(m))
        };
        let (lm, rm) = (
            region(1 << 40, registered()),
            region(1 << 41, remote("peer")),
        );
        let resolve = |p: *const std::ffi::c_void| p as *const Md;
        let options = plan::PlanOptions::capped(8 << 20, true);
        let run_pool = crate::proto::RunPool::default();
        let rayon_pool = rayon::ThreadPoolBuilder::new()
            .num_threads(threads.max(2) - 1)
            .build()
            .unwrap();
        let fill = ipc::FillPool::new(rayon_pool, env("PREP_PART", 1024));
        let mut rng = crate::splitmix::SplitMix64::new(7);
        let mut slots_l: Vec<usize> = (0..slots).collect();
        let mut slots_r = slots_l.clone();
        let median = |v: &mut Vec<f64>| {
            v.sort_by(|a, b| a.total_cmp(b));
            v[v.len() / 2]
        };
        let (mut one, mut wall, mut part_mean, mut part_max, mut caller_parts, mut sliced) = (
            Vec::new(),
            Vec::new(),
            Vec::new(),
            Vec::new(),
            Vec::new(),
            Vec::new(),
        );
        // `PREP_IN_ORDER=1`: blocks in order (no chunk is packed copies
        // first), the same slots every round.
        let in_order = env("PREP_IN_ORDER", 0) == 1;
        for round in 0..rounds {
            if !in_order {
                rng.shuffle(&mut slots_l[..]);
                rng.shuffle(&mut slots_r[..]);
            }
            let l: Vec<RawDesc> = slots_l[..n].iter().map(|&s| at(lm, s * len, len)).collect();
            let r: Vec<RawDesc> = slots_r[..n].iter().map(|&s| at(rm, s * len, len)).collect();
            // SAFETY: every handle is a leaked `Md`.
            let (ld, rd) = unsafe {
                (
                    Descs::new(MemKind::Dram, &l, &resolve),
                    Descs::new(MemKind::Dram, &r, &resolve),
                )
            };
            let first = pair_descriptor(Op::Write, l[0].range(), r[0].range());
            let spec = PackSpec::new(Survey::uniform(&first, n), options, run_pool.clone())
                .expect("cut by whole chunks");
            if round % 3 == 2 {
                // The engine's own: in slices, stitched.
                let t = std::time::Instant::now();
                let (checked, _, chunks) =
                    Checked::in_parts(Op::Write, ld, rd, &fill, Some(&spec), None)
                        .expect("the pool is free");
                sliced.push(t.elapsed().as_secs_f64() * 1e6);
                assert!(
                    checked.is_ok()
                        && chunks.is_some_and(|c| c.len() == n.div_ceil(spec.per_chunk))
                );
                continue;
            }
            if round % 3 == 0 {
                // One pass on this thread: the check, then the plan.
                let t = std::time::Instant::now();
                let c = Checked::new(Op::Write, ld, rd).expect("checked");
                let survey = c.survey.clone().expect("plannable");
                let chunks = plan::pack(
                    c.descriptors(Op::Write),
                    0,
                    &survey,
                    spec.cap,
                    true,
                    &run_pool,
                )
                .expect("packed");
                one.push(t.elapsed().as_secs_f64() * 1e6);
                drop(chunks);
                continue;
            }
            // In parts, as `Checked::in_parts` shares them, each timed.
            let parts = fill.parts(n, spec.per_chunk);
            let caller = std::thread::current().id();
            let t = std::time::Instant::now();
            let (done, _help) = fill
                .share(parts, |range| {
                    let t = std::time::Instant::now();
                    let survey = Survey::part(&first, range.start);
                    let facts = Facts::of(Op::Write, ld, rd, range.clone(), survey, None).ok()?;
                    let descriptors = pair_descriptors(Op::Write, ld, rd, range.clone());
                    let chunks = plan::pack(
                        descriptors,
                        range.start,
                        &spec.survey,
                        spec.cap,
                        true,
                        &spec.pool,
                    )
                    .ok()?;
                    let us = t.elapsed().as_secs_f64() * 1e6;
                    Some((
                        facts.survey.is_ok(),
                        chunks,
                        us,
                        std::thread::current().id() == caller,
                    ))
                })
                .expect("the pool is free");
            wall.push(t.elapsed().as_secs_f64() * 1e6);
            let us: Vec<f64> = done.iter().map(|d| d.2).collect();
            part_mean.push(us.iter().sum::<f64>() / us.len() as f64);
            part_max.push(us.iter().cloned().fold(0.0, f64::max));
            caller_parts.push(done.iter().filter(|d| d.3).count() as f64);
            assert!(done.iter().all(|d| d.0));
        }
        println!(
            "prep_cost {n} x 4 KiB, {threads} threads: one pass {:.1} us | in parts of whole chunks: wall {:.1} us, a part {:.1} us (longest {:.1}), parts on the caller {:.1} | in slices (Checked::in_parts): wall {:.1} us (medians of {} rounds each)",
            median(&mut one),
            median(&mut wall),
            median(&mut part_mean),
            median(&mut part_max),
            median(&mut caller_parts),
            median(&mut sliced),
            rounds / 3
        );
    }

    /// Two local and two remote regions, alive for the test.
    fn regions() -> &'static [Md; 4] {
        Box::leak(Box::new([
            md(1 << 32, registered()),
            md((1 << 32) + REGION, registered()),
            md(1 << 40, remote("peer")),
            md((1 << 40) + REGION, remote("peer")),
        ]))
    }

    #[test]
    fn a_plain_transfer_passes_with_its_peer_and_survey() {
        let [l0, l1, r0, r1] = regions();
        let l = [at(l0, 0, 4096), at(l0, 8192, 4096), at(l1, 0, 4096)];
        let r = [at(r0, 4096, 4096), at(r0, 0, 4096), at(r1, 64, 4096)];
        let plan = check(&l, &r, |c| {
            let c = c.expect("checked");
            assert_eq!(c.peer.map(|p| p.id.as_str()), Some("peer"));
            assert!(c.local_instance.is_none(), "no local arena here");
            crate::proto::plan::build_surveyed(
                c.descriptors(Op::Write),
                c.survey.clone().expect("plannable"),
                crate::proto::plan::PlanOptions::capped(1 << 20, true),
                &crate::proto::RunPool::default(),
            )
            .expect("planned")
        });
        assert_eq!(plan.payload_bytes, 3 * 4096);
        let src: Vec<u64> = plan.chunks[0]
            .gather_runs
            .iter()
            .flat_map(|r| r.copies())
            .map(|c| c.1)
            .collect();
        assert_eq!(src, l.iter().map(|d| d.addr as u64).collect::<Vec<_>>());
    }

    #[test]
    fn two_peers_share_no_arena() {
        let [l0, _, r0, _] = regions();
        let other: &'static Md = Box::leak(Box::new(md(1 << 44, remote("other"))));
        let (l, r) = (
            [at(l0, 0, 64), at(l0, 64, 64)],
            [at(r0, 0, 64), at(other, 0, 64)],
        );
        check(&l, &r, |c| assert!(c.expect("checked").peer.is_none()));
    }

    #[test]
    fn each_fault_is_named_wherever_it_lies_in_a_run() {
        let [l0, _, r0, _] = regions();
        let good = || (vec![at(l0, 0, 64); 4], vec![at(r0, 0, 64); 4]);
        assert!(check(&good().0, &good().1, |c| c.is_ok()));
        // At the run's first pair (checked in full) and inside the run
        // (checked inline, then in full to name it).
        for i in [0, 2] {
            let msg = |l: &[RawDesc], r: &[RawDesc]| {
                check(l, r, |c| match c {
                    Err(e) => e.to_string(),
                    Ok(_) => panic!("descriptor {i}: passed"),
                })
            };
            let (mut l, r) = good();
            l[i] = at(l0, 64, REGION);
            let m = msg(&l, &r);
            assert!(
                m.contains(&format!("local descriptor {i} ("))
                    && m.contains("outside its registered region"),
                "{m}"
            );
            let (l, mut r) = good();
            r[i].addr = usize::MAX - 8;
            let m = msg(&l, &r);
            assert!(
                m.contains(&format!("remote descriptor {i} wraps around")),
                "{m}"
            );
            let (mut l, r) = good();
            l[i].dev = 1;
            let m = msg(&l, &r);
            assert!(m.contains(&format!("local descriptor {i} (")), "{m}");
            let (l, mut r) = good();
            r[i].len = 32;
            let m = msg(&l, &r);
            assert!(
                m.contains(&format!(
                    "descriptor {i}: local length 64 differs from remote length 32"
                )),
                "{m}"
            );
            let stray = Md {
                magic: 0,
                ..md(0, registered())
            };
            let stray: &'static Md = Box::leak(Box::new(stray));
            let (mut l, r) = good();
            l[i].md = stray as *const Md as *const std::ffi::c_void;
            let m = msg(&l, &r);
            assert!(
                m.contains(&format!("local descriptor {i} carries metadata")),
                "{m}"
            );
        }
    }

    #[test]
    fn what_planning_refuses_is_not_an_error_but_no_survey() {
        let [l0, _, r0, _] = regions();
        let mut l = vec![at(l0, 0, 64); 3];
        let r = vec![at(r0, 0, 64); 3];
        // A null handle is not checked against a region (NIXL's own
        // lists always carry one): planning still sees its device.
        l[1] = RawDesc {
            addr: 4096,
            len: 64,
            dev: 3,
            md: std::ptr::null(),
        };
        check(&l, &r, |c| {
            let c = c.expect("checked");
            assert_eq!(
                c.survey.clone().unwrap_err(),
                PlanError::MixedSourceDevices {
                    index: 1,
                    expected: 0,
                    found: 3
                }
            );
            assert!(c.local_instance.is_none());
        });
    }

    proptest::proptest! {
        /// The plan packed in the check's pass is the plan made after
        /// it, for every part length, in parts of whole chunks or (blocks
        /// that pack back to back) in slices stitched; a list that is not
        /// what the packing assumed (one descriptor of another length)
        /// gives no chunks.
        #[test]
        fn the_plan_packed_in_the_check_is_the_plan(
            n in 1usize..160,
            // Half of them lengths that pack back to back (sliced).
            len in proptest::prop_oneof![1usize..100, proptest::strategy::Strategy::prop_map(1usize..4, |k| 32 * k)],
            cap in 64u64..6000,
            min_chunks in 1u64..4,
            part_len in 1usize..80,
            odd in proptest::option::of(0usize..40),
            read in proptest::bool::ANY,
            scattered in proptest::option::of(proptest::num::u64::ANY),
        ) {
            let op = if read { Op::Read } else { Op::Write };
            let [l0, _, r0, _] = regions();
            // In order, or each side's blocks shuffled.
            let mut order = [(0..n).collect::<Vec<_>>(), (0..n).collect()];
            if let Some(seed) = scattered {
                let mut rng = crate::splitmix::SplitMix64::new(seed);
                order.iter_mut().for_each(|o| rng.shuffle(&mut o[..]));
            }
            let mut l: Vec<_> = (0..n).map(|i| at(l0, 128 * order[0][i], len)).collect();
            let mut r: Vec<_> = (0..n).map(|i| at(r0, 256 * order[1][i] + 64, len)).collect();
            if let Some(i) = odd {
                (l[i % n].len, r[i % n].len) = (len + 1, len + 1);
            }
            let resolve = |p: *const std::ffi::c_void| p as *const Md;
            // SAFETY: every handle is one of the test's leaked `Md`s.
            let (ld, rd) = unsafe {
                (Descs::new(MemKind::Dram, &l, &resolve), Descs::new(MemKind::Dram, &r, &resolve))
            };
            let options = plan::PlanOptions { max_chunk_bytes: cap, merge_runs: true, min_chunks, min_chunk_bytes: 64 };
            let pool = crate::proto::RunPool::default();
            let first = pair_descriptor(op, l[0].range(), r[0].range());
            let Some(spec) = PackSpec::new(Survey::uniform(&first, n), options, pool.clone()) else {
                return Ok(());
            };
            let fill = ipc::FillPool { part_len, ..fill_pool() };
            // Each chunk as the slices finish it, for an announced WRITE.
            let handed = Mutex::new(Vec::new());
            let hook = |c: usize, chunk: &plan::Chunk| handed.lock().unwrap().push((c, chunk.clone()));
            let (checked, _, chunks) = Checked::in_parts(op, ld, rd, &fill, Some(&spec), Some(&hook))
                .expect("the pool is free");
            let checked = checked.expect("checked");
            let survey = checked.survey.clone().expect("plannable");
            let made = plan::build_surveyed(checked.descriptors(op), survey, options, &pool).unwrap();
            // Each chunk handed once; where the list is what the packing
            // assumed, a chunk handed ahead is the plan's, and where the
            // slices packed the whole plan, every chunk was handed (a list
            // that is not as assumed is withdrawn: Engine::prep_xfer).
            let mut handed = handed.into_inner().unwrap();
            handed.sort_by_key(|(c, _)| *c);
            proptest::prop_assert!(handed.windows(2).all(|w| w[0].0 < w[1].0), "each chunk once");
            for (c, chunk) in handed.iter().filter(|_| survey == spec.survey) {
                proptest::prop_assert_eq!(Some(chunk), made.chunks.get(*c), "chunk {}", c);
            }
            let sliced = plan::sliceable(&spec.survey, true) && spec.per_chunk > plan::slice_len(part_len / 2);
            if sliced && chunks.is_some() {
                proptest::prop_assert_eq!(handed.len(), made.chunks.len());
            }
            if !sliced {
                proptest::prop_assert!(handed.is_empty(), "whole-chunk parts hand nothing ahead");
            }
            match chunks {
                Some(chunks) => {
                    proptest::prop_assert_eq!(&survey, &spec.survey);
                    let assembled = plan::assemble(&survey, chunks).unwrap();
                    // The chunks packed in parts are packed copies where
                    // the one pass's are (the gathers' and scatters'
                    // tables, and the wire, read them).
                    for (a, b) in assembled.chunks.iter().zip(&made.chunks) {
                        proptest::prop_assert_eq!(a.gather_runs.copies(), b.gather_runs.copies());
                        proptest::prop_assert_eq!(a.scatter_runs.copies(), b.scatter_runs.copies());
                    }
                    proptest::prop_assert_eq!(assembled, made);
                }
                // Not packed: not the list assumed, or (not in slices)
                // fewer parts of whole chunks than the pool's three
                // threads.
                None => {
                    let step = spec.per_chunk * part_len.div_ceil(spec.per_chunk);
                    let sliced = plan::sliceable(&spec.survey, true)
                        && spec.per_chunk > plan::slice_len(part_len / 2);
                    proptest::prop_assert!(
                        (!sliced && n.div_ceil(step) < 3) || (odd.is_some() && survey != spec.survey)
                    )
                }
            }
        }

        /// Whatever is wrong, and wherever: the check in parts names
        /// what the one pass names and finds the same facts (`check`
        /// compares them at every part length).
        #[test]
        fn in_parts_the_check_finds_what_one_pass_finds(
            faults in proptest::collection::vec((0usize..24, 0u8..9), 0..4),
            n in 1usize..24,
        ) {
            let [l0, l1, r0, r1] = regions();
            let other: &'static Md = Box::leak(Box::new(md(1 << 44, remote("other"))));
            let mut l: Vec<_> = (0..n).map(|i| at(l0, 64 * i, 64)).collect();
            let mut r: Vec<_> = (0..n).map(|i| at(r0, 128 * i, 64)).collect();
            for (i, fault) in faults {
                let i = i % n;
                match fault {
                    0 => l[i] = at(l0, 64, REGION),
                    1 => r[i].addr = usize::MAX - 8,
                    2 => r[i].len = 32,
                    3 => {
                        l[i] = RawDesc { addr: 4096, len: 64, dev: 3, md: std::ptr::null() }
                    }
                    4 => r[i] = at(other, 0, 64),
                    5 => l[i] = at(l1, 0, 64),
                    6 => r[i] = at(r1, 0, 64),
                    7 => (l[i].len, r[i].len) = (32, 32),
                    _ => (l[i].len, r[i].len) = (0, 0),
                }
            }
            check(&l, &r, |_| ());
        }
    }
}
