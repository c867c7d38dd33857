//! The peer-mapped path's unit tests (no GPU needed): the route's gates, the
//! pair walk in one pass and in parts on the fill pool, and the window look-up.

use super::*;

fn input() -> Shape<'static> {
    Shape {
        local: MemKind::Vram,
        remote: MemKind::Vram,
        descriptors: 4096,
        bytes: (4096 * 4096).into(),
        local_transfer: false,
    }
}

#[test]
fn vram_transfers_with_many_small_descriptors_pass() {
    assert_eq!(gate(&Config::default(), &input()), Ok(()));
    // One large descriptor too: the kernel tiles it over every warp.
    let one = Shape {
        descriptors: 1,
        bytes: (1u64 << 30).into(),
        ..input()
    };
    assert_eq!(gate(&Config::default(), &one), Ok(()));
}

#[test]
fn each_gate_says_why() {
    // The default gate admits every count and size; these limits are set
    // to see each reason.
    let cfg = Config {
        peer_map_min_descriptor_count: 1024,
        peer_map_max_average_descriptor_size_bytes: 16 << 10,
        ..Config::default()
    };
    let off = Config {
        enable_peer_map: false,
        ..Config::default()
    };
    assert_eq!(gate(&off, &input()), Err("peer mapping disabled"));
    let master_off = Config {
        enabled: false,
        ..Config::default()
    };
    assert_eq!(gate(&master_off, &input()), Err("peer mapping disabled"));
    for (g, why) in [
        (
            Shape {
                local_transfer: true,
                ..input()
            },
            "a transfer within one agent",
        ),
        (
            Shape {
                local: MemKind::Dram,
                ..input()
            },
            "not VRAM on both sides",
        ),
        (
            Shape {
                remote: MemKind::Dram,
                ..input()
            },
            "not VRAM on both sides",
        ),
        (
            Shape {
                descriptors: 10,
                bytes: 40960.into(),
                ..input()
            },
            "too few descriptors",
        ),
        (
            Shape {
                bytes: (4096u64 << 20).into(),
                ..input()
            },
            "descriptors too large",
        ),
    ] {
        assert_eq!(gate(&cfg, &g), Err(why));
    }
}

#[test]
fn remote_regions_of_other_hosts_or_outside_the_allocation_are_not_mapped() {
    let maps = IpcMaps::new(&Config::default());
    let id = ipc::identity().expect("boot id");
    let export = IpcExport {
        host: id.host,
        process: [9; 16],
        device_uuid: [1; 16],
        alloc_base: 1 << 40,
        alloc_len: 1 << 30,
        ipc_handle: [0; 64],
    };
    let a = maps.remote(&export, 1 << 40, 4096).expect("same host");
    let b = maps
        .remote(&export, (1 << 40) + 8192, 4096)
        .expect("same host");
    assert!(Arc::ptr_eq(&a, &b), "one handle per allocation");
    assert!(!a.same_process);
    assert!(maps.remote(&export, (1 << 40) + (1 << 30), 1).is_none());
    let other_host = IpcExport {
        host: [0xee; 16],
        ..export
    };
    assert!(maps.remote(&other_host, 1 << 40, 4096).is_none());
    let mine = IpcExport {
        process: id.process,
        ..export
    };
    assert!(maps.remote(&mine, 1 << 40, 4096).unwrap().same_process);
    drop((a, b));
    // The last region gone, the allocation is forgotten.
    assert!(maps.remote(&export, 1 << 40, 4096).is_some());
    assert_eq!(maps.allocs.locked().len(), 1);
}

#[test]
fn nothing_is_exported_when_peer_mapping_is_off() {
    let maps = IpcMaps::new(&Config {
        enable_peer_map: false,
        ..Config::default()
    });
    assert!(maps.export(0, 4096, 4096).unwrap_err().contains("off"));
    let id = ipc::identity().expect("boot id");
    let export = IpcExport {
        host: id.host,
        process: id.process,
        device_uuid: [1; 16],
        alloc_base: 4096,
        alloc_len: 4096,
        ipc_handle: [0; 64],
    };
    assert!(maps.remote(&export, 4096, 4096).is_none());
}

// ---- the one-pass pair table -----------------------------------------------

/// Descriptors as NIXL hands them: `md` is the region's index + 1 (a
/// non-null handle per region).
fn raw(addr: usize, len: usize, dev: u64, region: usize) -> RawDesc {
    RawDesc {
        addr,
        len,
        dev,
        md: (region + 1) as *const std::ffi::c_void,
    }
}

fn window_of(regions: &[Window]) -> impl FnMut(*const std::ffi::c_void) -> Option<Window> + '_ {
    |p| regions.get((p as usize).checked_sub(1)?).copied()
}

fn win(addr: usize, len: usize, dev: u64, shift: u64) -> Window {
    Window::of(Range { addr, len, dev }, shift)
}

fn walk(op: Op, l: &[RawDesc], r: &[RawDesc], lw: &[Window], rw: &[Window]) -> Option<Vec<u64>> {
    let mut out = vec![0u64; 2 * l.len()];
    walk_pairs(op, l, r, &mut out, window_of(lw), window_of(rw)).then_some(out)
}

#[test]
fn pairs_are_written_in_order_with_remote_addresses_shifted() {
    let lw = [win(0x10000, 0x4000, 0, 0), win(0x40000, 0x4000, 0, 0)];
    let rw = [win(0x90000, 0x8000, 3, 0x1000_0000)];
    let l = [raw(0x10000, 4096, 0, 0), raw(0x43000, 4096, 0, 1)];
    let r = [raw(0x97000, 4096, 3, 0), raw(0x90000, 4096, 3, 0)];
    let w = walk(Op::Write, &l, &r, &lw, &rw).unwrap();
    assert_eq!(w, [0x10000, 0x1009_7000, 0x43000, 0x1009_0000]);
    let rd = walk(Op::Read, &l, &r, &lw, &rw).unwrap();
    assert_eq!(rd, [0x1009_7000, 0x10000, 0x1009_0000, 0x43000]);
}

#[test]
fn anything_not_plainly_uniform_and_inside_is_declined() {
    let lw = [win(0x10000, 0x4000, 0, 0)];
    let rw = [win(0x90000, 0x4000, 3, 7)];
    let l = |addr, len| raw(addr, len, 0, 0);
    let r = |addr, len| raw(addr, len, 3, 0);
    let ok = (
        vec![l(0x10000, 4096), l(0x11000, 4096)],
        vec![r(0x90000, 4096), r(0x93000, 4096)],
    );
    assert!(walk(Op::Write, &ok.0, &ok.1, &lw, &rw).is_some());
    let cases: Vec<(&str, Vec<RawDesc>, Vec<RawDesc>)> = vec![
        (
            "another local length",
            vec![l(0x10000, 4096), l(0x11000, 2048)],
            ok.1.clone(),
        ),
        (
            "another remote length",
            ok.0.clone(),
            vec![r(0x90000, 4096), r(0x91000, 2048)],
        ),
        (
            "past the window's end",
            vec![l(0x10000, 4096), l(0x13001, 4096)],
            ok.1.clone(),
        ),
        (
            "below the window",
            ok.0.clone(),
            vec![r(0x90000, 4096), r(0x8ffff, 4096)],
        ),
        (
            "far below (wraps)",
            vec![l(0, 4096), l(0x11000, 4096)],
            ok.1.clone(),
        ),
        (
            "another device",
            vec![l(0x10000, 4096), raw(0x11000, 4096, 1, 0)],
            ok.1.clone(),
        ),
        (
            "a null handle",
            vec![
                l(0x10000, 4096),
                RawDesc {
                    md: std::ptr::null(),
                    ..l(0x11000, 4096)
                },
            ],
            ok.1.clone(),
        ),
        (
            "a null first handle",
            vec![
                RawDesc {
                    md: std::ptr::null(),
                    ..l(0x10000, 4096)
                },
                l(0x11000, 4096),
            ],
            ok.1.clone(),
        ),
        (
            "a handle without a window",
            ok.0.clone(),
            vec![r(0x90000, 4096), raw(0x90000, 4096, 3, 5)],
        ),
        ("no bytes", vec![l(0x10000, 0)], vec![r(0x90000, 0)]),
        ("one side shorter", ok.0.clone(), vec![r(0x90000, 4096)]),
        ("none at all", vec![], vec![]),
    ];
    for (what, a, b) in cases {
        assert_eq!(walk(Op::Write, &a, &b, &lw, &rw), None, "{what}");
    }
    // A window smaller than one descriptor.
    let small = [win(0x10000, 2048, 0, 0)];
    assert_eq!(walk(Op::Write, &ok.0, &ok.1, &small, &rw), None);
}

proptest::proptest! {
    /// The one-pass walk accepts exactly the transfers whose every
    /// descriptor has the first one's length and lies inside its
    /// region on its region's device, and then writes the same pairs
    /// as the plain reading of that rule.
    #[test]
    fn walk_agrees_with_the_plain_rule(
        seed in proptest::prelude::any::<u64>(),
        n in 1usize..40,
        lens in proptest::collection::vec(prop_len(), 1..3),
        write in proptest::prelude::any::<bool>(),
    ) {
        let (l, r, lw, rw) = random_transfer(seed, n, &lens);
        let inside = |d: &RawDesc, ws: &[Window]| {
            let region = d.md as usize - 1;
            ws.get(region).is_some_and(|w| {
                d.dev == w.dev && d.addr >= w.addr && d.addr + d.len <= w.addr + w.len
            })
        };
        let len = l[0].len;
        let expect_ok = l.iter().chain(&r).all(|d| d.len == len)
            && l.iter().all(|d| inside(d, &lw))
            && r.iter().all(|d| inside(d, &rw));
        let op = if write { Op::Write } else { Op::Read };
        let got = walk(op, &l, &r, &lw, &rw);
        proptest::prop_assert_eq!(got.is_some(), expect_ok);
        if let Some(out) = got {
            for (i, (a, b)) in l.iter().zip(&r).enumerate() {
                let mapped = (b.addr as u64).wrapping_add(rw[b.md as usize - 1].shift);
                let want = if write { [a.addr as u64, mapped] } else { [mapped, a.addr as u64] };
                proptest::prop_assert_eq!(&out[2 * i..2 * i + 2], &want[..]);
            }
        }
    }

    /// Walked in parts on several threads, a transfer gives what one
    /// walk gives (the same pairs, or a decline), and the parts report
    /// every remote region the table uses.
    #[test]
    fn parts_agree_with_one_walk(
        seed in proptest::prelude::any::<u64>(),
        n in 1usize..40,
        lens in proptest::collection::vec(prop_len(), 1..3),
        write in proptest::prelude::any::<bool>(),
        threads in 1usize..5,
        part_len in 1usize..12,
    ) {
        let (l, r, lw, rw) = random_transfer(seed, n, &lens);
        let op = if write { Op::Write } else { Op::Read };
        let fill = fill_pool(threads, part_len);
        let one = walk(op, &l, &r, &lw, &rw);
        let (parts, used) = walk_in_parts(&fill, op, &l, &r, &lw, &rw);
        proptest::prop_assert_eq!(&parts, &one);
        if parts.is_some() {
            let mut want: Vec<usize> = r.iter().map(|d| d.md as usize).collect();
            want.dedup();
            let mut got = used.unwrap();
            got.dedup();
            // Each part looks its first region up again.
            want.sort_unstable();
            want.dedup();
            got.sort_unstable();
            got.dedup();
            proptest::prop_assert_eq!(got, want);
        }
    }
}

/// A random transfer over three regions a side (a fourth handle has no
/// window), mostly inside them, sometimes just outside or on another
/// device, of lengths drawn from `lens`.
fn random_transfer(
    seed: u64,
    n: usize,
    lens: &[usize],
) -> (Vec<RawDesc>, Vec<RawDesc>, Vec<Window>, Vec<Window>) {
    let mut x = seed | 1;
    let mut next = move |m: u64| {
        x ^= x << 13;
        x ^= x >> 7;
        x ^= x << 17;
        x % m
    };
    let lw: Vec<Window> = (0..3)
        .map(|i| win(0x100000 * (i + 1), 0x10000, 0, 0))
        .collect();
    let rw: Vec<Window> = (0..3)
        .map(|i| win(0x800000 * (i + 1), 0x8000, 9, 0x5000_0000 * i as u64))
        .collect();
    let pick = |ws: &[Window], next: &mut dyn FnMut(u64) -> u64, len: usize| {
        let region = next(4) as usize; // 3: no window
        let w = ws.get(region).copied().unwrap_or(win(0, 0, 0, 0));
        // Mostly inside, sometimes just past either end.
        let addr = (w.addr + next(w.len as u64 + 64) as usize).wrapping_sub(32);
        let dev = if next(16) == 0 { w.dev + 1 } else { w.dev };
        raw(addr, len, dev, region)
    };
    let (mut l, mut r) = (Vec::new(), Vec::new());
    for _ in 0..n {
        let len = lens[next(lens.len() as u64) as usize];
        l.push(pick(&lw, &mut next, len));
        r.push(pick(&rw, &mut next, len));
    }
    (l, r, lw, rw)
}

/// A pool of `threads` workers and parts of `part_len` descriptors.
fn fill_pool(threads: usize, part_len: usize) -> FillPool {
    let pool = rayon::ThreadPoolBuilder::new()
        .num_threads(threads)
        .build()
        .unwrap();
    FillPool::new(pool, part_len)
}

/// [`walk_pairs_in_parts`] over the test windows: the table (or a
/// decline) and the remote handles the parts reported.
fn walk_in_parts(
    fill: &FillPool,
    op: Op,
    l: &[RawDesc],
    r: &[RawDesc],
    lw: &[Window],
    rw: &[Window],
) -> (Option<Vec<u64>>, Option<Vec<usize>>) {
    let mut out = vec![0u64; 2 * l.len()];
    let local = |p: *const std::ffi::c_void| lw.get((p as usize).checked_sub(1)?).copied();
    let remote = |p: *const std::ffi::c_void, used: &mut Vec<usize>| {
        let w = rw.get((p as usize).checked_sub(1)?).copied()?;
        used.push(p as usize);
        Some(w)
    };
    let used = walk_pairs_in_parts(fill, op, l, r, &mut out, local, remote).map(|w| {
        assert_eq!(w.help.parts as usize, l.len().div_ceil(fill.part_len));
        assert!(w.help.helped <= w.help.parts);
        w.used
    });
    (used.is_some().then_some(out), used)
}

#[test]
fn a_busy_or_forked_pool_is_not_waited_for() {
    let fill = fill_pool(2, 2);
    let w = [win(0x10000, 0x10000, 0, 0)];
    let l: Vec<RawDesc> = (0..8)
        .map(|i| raw(0x10000 + i * 0x1000, 4096, 0, 0))
        .collect();
    assert!(walk_in_parts(&fill, Op::Write, &l, &l, &w, &w).0.is_some());
    let other = fill.busy.locked();
    assert_eq!(
        walk_in_parts(&fill, Op::Write, &l, &l, &w, &w),
        (None, None)
    );
    drop(other);
    // Nor is a pool whose workers a fork left behind.
    let forked = FillPool {
        pid: std::process::id().wrapping_add(1),
        ..fill_pool(2, 2)
    };
    assert_eq!(
        walk_in_parts(&forked, Op::Write, &l, &l, &w, &w),
        (None, None)
    );
}

#[test]
fn a_warmed_pool_takes_parts_then_sleeps_again() {
    let fill = fill_pool(2, 1);
    assert!(!fill.awake());
    fill.warm(Duration::from_secs(2));
    // Called again before the jobs started or while they poll: nothing
    // more is broadcast.
    fill.warm(Duration::from_secs(2));
    let polling = |n: usize| {
        let t = std::time::Instant::now();
        let now = || fill.warming.polling.load(Ordering::Relaxed);
        while now() != n && t.elapsed() < Duration::from_secs(1) {
            std::thread::sleep(Duration::from_micros(100));
        }
        now()
    };
    assert_eq!(polling(2), 2, "both workers poll");
    assert!(fill.awake());
    fill.warm(Duration::from_secs(2));
    assert_eq!(fill.warming.wakes.load(Ordering::Relaxed), 1);
    assert_eq!(fill.warming.pending.load(Ordering::Relaxed), 0);
    // The polling workers take the parts, then stop polling (long
    // before their 2 s are up).
    let (done, help) = fill
        .share((0..64).collect(), |i: usize| {
            std::thread::sleep(Duration::from_micros(200));
            Some(2 * i)
        })
        .expect("the pool is free");
    assert_eq!(done, (0..64).map(|i| 2 * i).collect::<Vec<_>>());
    assert!(help.helped > 0, "{help:?}");
    assert_eq!(polling(0), 0, "the workers poll on after taking parts");
    assert!(!fill.awake());
    // A pool a fork left behind wakes nothing.
    let forked = FillPool {
        pid: std::process::id().wrapping_add(1),
        ..fill_pool(2, 1)
    };
    forked.warm(Duration::from_secs(2));
    assert!(!forked.awake());
}

#[test]
fn parts_of_different_lengths_are_declined() {
    // Uniform inside each part, not across them: 4 parts of 2 (the
    // first of another length than the rest).
    let fill = fill_pool(3, 2);
    let lw = [win(0x10000, 0x10000, 0, 0)];
    let rw = [win(0x90000, 0x10000, 3, 0)];
    let side = |base: usize, dev: u64, second_len: usize| -> Vec<RawDesc> {
        (0..8)
            .map(|i| {
                raw(
                    base + i * 0x1000,
                    if i < 2 { 4096 } else { second_len },
                    dev,
                    0,
                )
            })
            .collect()
    };
    let (l, r) = (side(0x10000, 0, 4096), side(0x90000, 3, 4096));
    assert!(walk_in_parts(&fill, Op::Write, &l, &r, &lw, &rw)
        .0
        .is_some());
    let (l, r) = (side(0x10000, 0, 2048), side(0x90000, 3, 2048));
    assert_eq!(
        walk_in_parts(&fill, Op::Write, &l, &r, &lw, &rw),
        (None, None)
    );
}

fn prop_len() -> impl proptest::strategy::Strategy<Value = usize> {
    proptest::prop_oneof![proptest::strategy::Just(4096usize), 1usize..5000]
}

#[test]
fn kept_windows_are_found_in_the_order_they_were_met() {
    let h = |i: usize| i as *const std::ffi::c_void;
    let mut kept = Vec::new();
    // First preparation: everything is looked up and kept.
    let mut c = Cursor::new(&mut kept);
    for i in 1..=3 {
        assert!(c.hit(h(i)).is_none());
        c.keep(h(i), i * 10);
    }
    // The same regions in the same order: all found.
    let mut c = Cursor::new(&mut kept);
    for i in 1..=3 {
        assert_eq!(c.hit(h(i)), Some(&(i * 10)));
    }
    // Another order: the first differing region replaces what followed.
    let mut c = Cursor::new(&mut kept);
    assert_eq!(c.hit(h(1)), Some(&10));
    assert!(c.hit(h(3)).is_none());
    c.keep(h(3), 30);
    assert!(c.hit(h(2)).is_none());
    c.keep(h(2), 20);
    assert_eq!(kept, vec![(1, 10), (3, 30), (2, 20)]);
    // At most CACHED_WINDOWS are kept.
    let mut c = Cursor::new(&mut kept);
    for i in 0..CACHED_WINDOWS + 5 {
        if c.hit(h(i + 100)).is_none() {
            c.keep(h(i + 100), i);
        }
    }
    assert_eq!(kept.len(), CACHED_WINDOWS);
}

/// Not a benchmark (the vLLM-pattern benchmark measures preparation end
/// to end): the walk's cost per descriptor on this machine, for a look
/// at the breakdown. `cargo test --release walk_cost -- --ignored --nocapture`.
#[test]
#[ignore]
fn walk_cost() {
    // vLLM TP=4 at 8192 tokens: 64 regions x 512 blocks of 8 KiB.
    let (regions, blocks, len) = (64usize, 512usize, 8192usize);
    let lw: Vec<Window> = (0..regions)
        .map(|i| win(i << 28, 1024 * len, 0, 0))
        .collect();
    let rw: Vec<Window> = (0..regions)
        .map(|i| win((i + 64) << 28, 1024 * len, 0, 1 << 40))
        .collect();
    let mut l = Vec::new();
    let mut r = Vec::new();
    for g in 0..regions {
        for b in 0..blocks {
            l.push(raw((g << 28) + ((b * 7919) % 1024) * len, len, 0, g));
            r.push(raw(
                ((g + 64) << 28) + ((b * 104_729) % 1024) * len,
                len,
                0,
                g,
            ));
        }
    }
    let mut out = vec![0u64; 2 * l.len()];
    let mut best = u128::MAX;
    for _ in 0..50 {
        let t = std::time::Instant::now();
        assert!(walk_pairs(
            Op::Read,
            &l,
            &r,
            &mut out,
            window_of(&lw),
            window_of(&rw)
        ));
        best = best.min(t.elapsed().as_nanos());
    }
    println!(
        "walk_pairs: {} descriptors in {:.1} us ({:.2} ns each, best of 50)",
        l.len(),
        best as f64 / 1e3,
        best as f64 / l.len() as f64
    );
    for threads in [2, 4] {
        let fill = fill_pool(threads - 1, FILL_PART_DESCRIPTORS);
        let mut best = u128::MAX;
        for _ in 0..50 {
            let t = std::time::Instant::now();
            let local = |p: *const std::ffi::c_void| lw.get(p as usize - 1).copied();
            let remote =
                |p: *const std::ffi::c_void, _: &mut Vec<()>| rw.get(p as usize - 1).copied();
            assert!(
                walk_pairs_in_parts(&fill, Op::Read, &l, &r, &mut out, local, remote).is_some()
            );
            best = best.min(t.elapsed().as_nanos());
        }
        println!(
            "walk_pairs_in_parts, {threads} threads: {:.1} us (best of 50)",
            best as f64 / 1e3
        );
    }
}
