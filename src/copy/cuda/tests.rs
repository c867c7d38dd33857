//! The copy engine's tests: the table against a host model of the kernel
//! (everywhere), the kernel's compile and the driver's probe (where CUDA
//! is).

/// A pair table's launch is the launch `fill_table` sizes for the same
/// copies left unmerged; impossible launches are refused.
#[test]
fn pairs_shape_matches_fill_table() {
    for (n, len, tile, warps) in [
        (1, 1, 16, 1),
        (7, 4096, 4096, 3),
        (300, 8192, 8192, 96),
        (1000, 32768, 8192, 3168),
        (64, 100_000, 4096, 10),
    ] {
        let runs: Vec<Run> = (0..n as u64)
            .map(|i| Run::single(i * 2 * len, (2 * i + 1) * len, len))
            .collect();
        let (mut ra, mut ta, mut sa) = (
            vec![DevRun::default(); n],
            vec![0u32; n + 1],
            vec![[0u64; 2]; n],
        );
        let whole = RegionSpan {
            addr: 0,
            len: usize::MAX,
        };
        let want = fill_table(
            Direction::Gather,
            whole,
            &runs,
            tile,
            warps,
            &mut ra,
            &mut ta,
            &mut sa,
        )
        .unwrap();
        assert_eq!(
            pairs_shape(n, len, tile, warps).unwrap(),
            want,
            "{n} x {len}"
        );
    }
    assert!(pairs_shape(0, 64, 16, 1).is_err());
    assert!(pairs_shape(2, 0, 16, 1).is_err());
    assert!(pairs_shape(2, 64, 24, 1).is_err());
    assert!(pairs_shape(1 << 20, 1 << 20, 16, 1).is_err(), "2^36 tiles");
}
use super::*;
use crate::copy::host::HostCopy;

/// A table's three parts, as the tests hold them.
struct Table {
    runs: Vec<DevRun>,
    tile_start: Vec<u32>,
    strides: Vec<DevStrides>,
}

impl Table {
    fn new(nruns: usize) -> Self {
        Table {
            runs: vec![DevRun::default(); nruns],
            tile_start: vec![u32::MAX; nruns + 1],
            strides: vec![[u64::MAX; 2]; nruns],
        }
    }
    fn fill(
        &mut self,
        direction: Direction,
        region: RegionSpan,
        runs: &[Run],
        tile_bytes: u64,
        max_warps: u32,
    ) -> Result<LaunchShape, CopyError> {
        fill_table(
            direction,
            region,
            runs,
            tile_bytes,
            max_warps,
            &mut self.runs,
            &mut self.tile_start,
            &mut self.strides,
        )
    }
}

/// The kernel's `find_run`: the same 32-ary search, the 32 lanes and
/// the ballot simulated.
fn model_find_run(tile_start: &[u32], nruns: u32, t: u32) -> u32 {
    let ballot = |lo: u32, hi: u32, step: u32| -> u32 {
        (0..32u32)
            .map(|lane| {
                let idx = lo + lane * step;
                u32::from(idx < hi && tile_start[idx as usize] <= t) << lane
            })
            .fold(0, |m, b| m | b)
    };
    let (mut lo, mut hi) = (0u32, nruns);
    while hi - lo > 32 {
        let step = (hi - lo + 31) >> 5;
        let m = ballot(lo, hi, step);
        assert!(m & 1 == 1, "the search lost its invariant");
        lo += (31 - m.leading_zeros()) * step;
        if hi - lo > step {
            hi = lo + step;
        }
    }
    let m = ballot(lo, hi, 1);
    assert!(m & 1 == 1, "the search lost its invariant");
    lo + 31 - m.leading_zeros()
}

/// The kernel's `warp_copy`: which lane copies which bytes, with the
/// same head / words / tail split; asserts every byte of the tile is
/// copied exactly once.
fn model_warp_copy(dst: u64, src: u64, n: u32) {
    let mis = dst ^ src;
    let a: u32 = if mis & 15 == 0 {
        16
    } else if mis & 7 == 0 {
        8
    } else if mis & 3 == 0 {
        4
    } else {
        1
    };
    let (head, nwords) = if a == 1 {
        (0, n)
    } else {
        let head = ((a - (src as u32 & (a - 1))) & (a - 1)).min(n);
        (head, (n - head) / a)
    };
    let body = nwords * a;
    let tail = n - head - body;
    let mut seen = vec![0u8; n as usize];
    let mut copy = |off: u32, len: u32| {
        for k in off..off + len {
            seen[k as usize] += 1;
        }
        // SAFETY: test buffers; the runs were built inside them.
        unsafe {
            std::ptr::copy_nonoverlapping(
                (src + u64::from(off)) as usize as *const u8,
                (dst + u64::from(off)) as usize as *mut u8,
                len as usize,
            )
        };
    };
    for lane in 0..32u32 {
        if a != 1 && lane < head {
            copy(lane, 1);
        }
        let mut base = lane;
        while base < nwords {
            for u in 0..8u32 {
                let k = base + u * 32;
                if k < nwords {
                    copy(head + k * a, a);
                }
            }
            base += 32 * 8;
        }
        if a != 1 && lane < tail {
            copy(head + body + lane, 1);
        }
    }
    assert!(
        seen.iter().all(|&c| c == 1),
        "a tile byte not copied exactly once"
    );
}

/// The kernel, on the host: every warp of the grid, same table, same
/// 32-bit arithmetic, same search and walk.
fn run_model(table: &Table, shape: &LaunchShape) {
    let warps = u64::from(shape.grid) * u64::from(WARPS_PER_BLOCK);
    let tpw = u64::from(shape.tiles_per_warp);
    let total = u64::from(shape.total_tiles);
    assert!(
        (warps - u64::from(WARPS_PER_BLOCK)) * tpw < total,
        "a whole block idle"
    );
    assert_eq!(table.tile_start[0], 0);
    assert_eq!(table.tile_start[shape.nruns as usize], shape.total_tiles);
    let shift = shape.tile_shift();
    let tile_bytes = 1u64 << shift;
    assert_eq!(tile_bytes, shape.tile_bytes);
    let load = |r: u32| {
        let e = table.runs[r as usize];
        let [ss, ds] = if e.count > 1 {
            table.strides[e.stride_index as usize]
        } else {
            [0, 0]
        };
        let (start, end) = (
            table.tile_start[r as usize],
            table.tile_start[r as usize + 1],
        );
        assert!(start < end, "run {r} has no tile");
        (e, ss, ds, start, end)
    };
    for w in 0..warps {
        let first = w * tpw;
        if first >= total {
            continue;
        }
        let mut t = first as u32;
        let t_end = (first + tpw).min(total) as u32;
        let mut r = model_find_run(&table.tile_start, shape.nruns, t);
        let (mut e, mut ss, mut ds, mut start, mut end) = load(r);
        loop {
            assert!(t >= start && t < end, "tile {t} is not in run {r}");
            let per_copy = ((e.len + tile_bytes - 1) >> shift) as u32;
            let local = t - start;
            let (mut i, mut j) = (local, 0);
            if per_copy != 1 {
                i = local / per_copy;
                j = local - i * per_copy;
            }
            assert!(i < e.count);
            let off = u64::from(j) << shift;
            let n = (e.len - off).min(tile_bytes) as u32;
            model_warp_copy(
                e.dst + u64::from(i) * ds + off,
                e.src + u64::from(i) * ss + off,
                n,
            );
            t += 1;
            if t >= t_end {
                break;
            }
            if t >= end {
                r += 1;
                (e, ss, ds, start, end) = load(r);
            }
        }
    }
}

#[test]
fn the_run_search_finds_every_tile() {
    for nruns in [1u32, 2, 31, 32, 33, 63, 64, 65, 1000, 1024, 1025, 40000] {
        let mut starts: Vec<u32> = Vec::with_capacity(nruns as usize + 1);
        let mut t = 0u32;
        for r in 0..nruns {
            starts.push(t);
            t += 1 + (r * 7919 % 5) * (r % 3);
        }
        starts.push(t);
        let mut r = 0u32;
        for tile in 0..t {
            while starts[r as usize + 1] <= tile {
                r += 1;
            }
            assert_eq!(
                model_find_run(&starts, nruns, tile),
                r,
                "nruns {nruns} tile {tile}"
            );
        }
    }
}

use crate::splitmix::SplitMix64 as Rng;

/// Random non-overlapping runs: (region_offset, app_offset, len, count, rstride, astride).
fn random_runs(
    rng: &mut Rng,
    region_len: u64,
    app_len: u64,
    max_len: u64,
) -> Vec<(u64, u64, u64, u32, u64, u64)> {
    let mut out = Vec::new();
    let (mut ro, mut ao) = (rng.below(40), rng.below(40));
    loop {
        let len = 1 + rng.below(max_len);
        let count = if rng.below(3) == 0 {
            1 + rng.below(12) as u32
        } else {
            1
        };
        let rs = len + rng.below(24);
        let as_ = len + rng.below(100);
        let rspan = (count as u64 - 1) * rs + len;
        let aspan = (count as u64 - 1) * as_ + len;
        if ro + rspan > region_len || ao + aspan > app_len {
            break;
        }
        out.push((ro, ao, len, count, rs, as_));
        ro += rspan + rng.below(33);
        ao += aspan + rng.below(33);
    }
    out
}

#[test]
fn table_model_matches_host_copy_for_random_runs() {
    let mut rng = Rng::new(0x9E37_79B9_7F4A_7C15);
    for case in 0..80 {
        let region_len = 64 * 1024;
        let app_len = 96 * 1024;
        let max_len = [8, 100, 5000, 40000][case % 4];
        let tile = [16, 64, 4096, DEFAULT_TILE_BYTES][(case / 4) % 4];
        let max_warps = [1, 3, 7, 1000, 1 << 20][(case / 16) % 5];
        let layout = random_runs(&mut rng, region_len, app_len, max_len);
        if layout.is_empty() {
            continue;
        }
        let src: Vec<u8> = (0..app_len).map(|_| rng.next_u64() as u8).collect();
        let mut region_ref = vec![0xABu8; region_len as usize];
        let mut region_model = vec![0xABu8; region_len as usize];
        let mk = |region: &mut Vec<u8>, app_base: usize| -> (RegionSpan, Vec<Run>) {
            let span = RegionSpan {
                addr: region.as_mut_ptr() as usize,
                len: region.len(),
            };
            let runs = layout
                .iter()
                .map(|&(ro, ao, len, count, rs, as_)| Run {
                    region_offset: ro,
                    addr: app_base as u64 + ao,
                    len,
                    count,
                    region_stride: rs,
                    addr_stride: as_,
                })
                .collect();
            (span, runs)
        };
        // Gather: host reference vs model.
        let (span_ref, runs_ref) = mk(&mut region_ref, src.as_ptr() as usize);
        HostCopy {
            threads: 1,
            parallel_threshold: u64::MAX,
        }
        .copy(Direction::Gather, span_ref, &runs_ref)
        .unwrap();
        let (span_m, runs_m) = mk(&mut region_model, src.as_ptr() as usize);
        let mut table = Table::new(runs_m.len());
        let shape = table
            .fill(Direction::Gather, span_m, &runs_m, tile, max_warps)
            .unwrap();
        assert!(shape.grid >= 1);
        assert!(
            u64::from(shape.grid) * u64::from(WARPS_PER_BLOCK)
                < u64::from(max_warps) + u64::from(WARPS_PER_BLOCK)
        );
        assert_eq!(
            shape.nstrided as usize,
            runs_m.iter().filter(|r| r.count > 1).count()
        );
        assert_eq!(
            shape.total_bytes,
            runs_m.iter().map(|r| r.len * r.count as u64).sum::<u64>()
        );
        run_model(&table, &shape);
        assert!(region_model == region_ref, "case {case}: gather differs");
        // Scatter back into poisoned application buffers.
        let mut dst_ref = vec![0xABu8; app_len as usize];
        let mut dst_model = vec![0xABu8; app_len as usize];
        let (_, s_ref) = mk(&mut region_ref, dst_ref.as_mut_ptr() as usize);
        HostCopy {
            threads: 1,
            parallel_threshold: u64::MAX,
        }
        .copy(Direction::Scatter, span_ref, &s_ref)
        .unwrap();
        let (_, s_m) = mk(&mut region_model, dst_model.as_mut_ptr() as usize);
        let shape = table
            .fill(Direction::Scatter, span_m, &s_m, tile, max_warps)
            .unwrap();
        run_model(&table, &shape);
        assert!(dst_model == dst_ref, "case {case}: scatter differs");
    }
}

#[test]
fn a_run_of_many_copies_is_one_table_entry() {
    let region = RegionSpan {
        addr: 1 << 20,
        len: 4096 * 1000,
    };
    let runs = [Run {
        region_offset: 0,
        addr: 1 << 40,
        len: 4096,
        count: 1000,
        region_stride: 4096,
        addr_stride: 8192,
    }];
    let mut table = Table::new(1);
    let s = table
        .fill(
            Direction::Gather,
            region,
            &runs,
            DEFAULT_TILE_BYTES,
            132 * 64,
        )
        .unwrap();
    // One tile (one warp) per copy: 1000 warps in 125 blocks.
    assert_eq!(
        (s.nruns, s.nstrided, s.total_tiles, s.tiles_per_warp, s.grid),
        (1, 1, 1000, 1, 125)
    );
    assert_eq!(table.runs[0].src, 1 << 40);
    assert_eq!(table.runs[0].dst, 1 << 20);
    assert_eq!((table.runs[0].count, table.runs[0].stride_index), (1000, 0));
    assert_eq!(table.strides[0], [8192, 4096]);
    assert_eq!(&table.tile_start[..2], &[0, 1000]);
    // 32 bytes of run, 8 of tile starts, 8 of alignment gap, 16 of strides.
    assert_eq!(s.table_bytes(), 32 + 8 + 8 + 16);
    let s = table
        .fill(
            Direction::Scatter,
            region,
            &runs,
            DEFAULT_TILE_BYTES,
            132 * 64,
        )
        .unwrap();
    assert_eq!(s.total_bytes, 4096 * 1000);
    assert_eq!((table.runs[0].src, table.runs[0].dst), (1 << 20, 1 << 40));
    assert_eq!(table.strides[0], [4096, 8192]);
    // A large single copy is split into tiles; no stride list.
    let big = [Run::single(0, 1 << 40, 4096 * 1000)];
    let s = table
        .fill(Direction::Gather, region, &big, 16 * 1024, 100)
        .unwrap();
    assert_eq!(s.total_tiles as u64, (4096u64 * 1000).div_ceil(16 * 1024));
    // 250 tiles over at most 100 warps: 3 tiles each, so 84 warps in 11 blocks.
    assert_eq!(
        (s.total_tiles, s.tiles_per_warp, s.grid, s.nstrided),
        (250, 3, 11, 0)
    );
    assert_eq!(s.table_bytes(), 32 + 8 + 8);
    // 16384 single 4 KiB runs (the probe's case): 36 bytes a run.
    let n = 16384u64;
    let region = RegionSpan {
        addr: 1 << 30,
        len: (n * 4096) as usize,
    };
    let single: Vec<Run> = (0..n)
        .map(|i| Run::single(i * 4096, (1 << 40) + 2 * i * 4096, 4096))
        .collect();
    let mut table = Table::new(single.len());
    let s = table
        .fill(
            Direction::Gather,
            region,
            &single,
            DEFAULT_TILE_BYTES,
            132 * 64 * 4,
        )
        .unwrap();
    assert_eq!(
        (s.total_tiles, s.tiles_per_warp, s.grid, s.nstrided),
        (16384, 1, 2048, 0)
    );
    assert_eq!(s.table_bytes(), 16384 * 36 + 4 + 12);
    assert!(table
        .tile_start
        .iter()
        .enumerate()
        .all(|(i, &t)| t == i as u32));
}

proptest::proptest! {
    /// Packed copies fill the pair table their runs fill, and are refused
    /// where their runs are, in a region that now holds them and now not
    /// (a region that itself wraps around the address space is none).
    #[test]
    fn packed_copies_fill_the_pair_table_of_their_runs(
        c in crate::proto::testing::arb_copies(),
        slack in proptest::prop_oneof![proptest::strategy::Just(0i64), -8192..8192i64],
        high in proptest::bool::ANY,
        gather in proptest::bool::ANY,
    ) {
        use proptest::prelude::*;
        let direction = if gather { Direction::Gather } else { Direction::Scatter };
        let len = c.region_end().saturating_add_signed(slack);
        let region = RegionSpan { addr: if high { u64::MAX - len } else { 1 << 40 } as usize, len: len as usize };
        prop_assume!(region.addr.checked_add(region.len).is_some());
        let runs = crate::proto::Runs::from_copies(c.clone()).to_vec();
        let mut fast = vec![0u64; 2 * c.addrs().len()];
        let mut slow = fast.clone();
        let a = fill_pairs_from_copies(direction, region, &c, &mut fast);
        let b = fill_pairs(direction, region, &runs, &mut slow);
        prop_assert_eq!(a.is_ok(), b.is_ok(), "{:?} / {:?}", a, b);
        if let (Ok(a), Ok(b)) = (a, b) {
            prop_assert_eq!(a, b);
            prop_assert_eq!(fast, slow);
        }
        // Short of room for every copy: none.
        let mut short = vec![0u64; 2 * c.addrs().len() - 1];
        prop_assert!(matches!(fill_pairs_from_copies(direction, region, &c, &mut short), Ok(None)));
    }

    /// The one pass (with its short form for single copies) refuses
    /// exactly what `check_runs` refuses, near every overflow edge, and
    /// otherwise writes the table entry by entry as the definition
    /// says.
    #[test]
    fn the_fill_refuses_what_the_check_refuses_and_tables_the_rest(
        // Mostly valid runs, each field now and then at an edge, so
        // that a list is often refused for one run's one field.
        runs in proptest::collection::vec(
            (
                proptest::prop_oneof![8 => 0..1u64 << 15, 1 => (u64::MAX - 1024)..=u64::MAX],
                proptest::prop_oneof![8 => 0..1u64 << 40, 1 => (u64::MAX - 1024)..=u64::MAX],
                proptest::prop_oneof![1 => proptest::strategy::Just(0u64), 8 => 1..5000u64, 1 => (u64::MAX - 1024)..=u64::MAX],
                proptest::prop_oneof![6 => proptest::strategy::Just(1u32), 1 => 0..5u32],
                proptest::prop_oneof![8 => 0..4096u64, 1 => (u64::MAX / 2)..=u64::MAX],
                proptest::prop_oneof![8 => 0..4096u64, 1 => (u64::MAX / 2)..=u64::MAX],
            ),
            1..4,
        ),
        gather in proptest::bool::ANY,
        region_addr in proptest::prop_oneof![8 => proptest::strategy::Just(1u64 << 20), 1 => (u64::MAX - (1 << 16))..=u64::MAX],
    ) {
        use proptest::prelude::*;
        let direction = if gather { Direction::Gather } else { Direction::Scatter };
        let region = RegionSpan { addr: region_addr as usize, len: 1 << 16 };
        let runs: Vec<Run> = runs
            .into_iter()
            .map(|(region_offset, addr, len, count, region_stride, addr_stride)| Run {
                region_offset,
                addr,
                len,
                count,
                region_stride,
                addr_stride,
            })
            .collect();
        let mut table = Table::new(runs.len());
        let filled = table.fill(direction, region, &runs, 64, 1000);
        let base_wraps = runs.iter().any(|r| region_addr.checked_add(r.region_offset).is_none());
        let checked = check_runs(direction, region.len, &runs);
        prop_assert_eq!(filled.is_ok(), checked.is_ok() && !base_wraps, "{:?} / {:?}", filled, checked);
        if let Ok(shape) = filled {
            prop_assert_eq!(shape.total_bytes, checked.unwrap());
            let mut tiles = 0u32;
            let mut strided = 0u32;
            for (i, r) in runs.iter().enumerate() {
                let at = region_addr + r.region_offset;
                let (src, dst) = if gather { (r.addr, at) } else { (at, r.addr) };
                let stride_index = if r.count > 1 { strided += 1; strided - 1 } else { 0 };
                prop_assert_eq!(table.runs[i], DevRun { src, dst, len: r.len, count: r.count, stride_index });
                prop_assert_eq!(table.tile_start[i], tiles);
                if r.count > 1 {
                    let want = if gather {
                        [r.addr_stride, r.region_stride]
                    } else {
                        [r.region_stride, r.addr_stride]
                    };
                    prop_assert_eq!(table.strides[stride_index as usize], want);
                }
                tiles += (r.len.div_ceil(64) * u64::from(r.count)) as u32;
            }
            prop_assert_eq!(table.tile_start[runs.len()], tiles);
            prop_assert_eq!(shape.nstrided, strided);
        }
    }

    /// The pair table is taken exactly when every copy has one length
    /// and they fit; it then refuses what the run table refuses and
    /// holds the run table's (source, destination) of every copy.
    #[test]
    fn the_pair_fill_agrees_with_the_run_table(
        runs in proptest::collection::vec(
            (
                proptest::prop_oneof![8 => 0..1u64 << 15, 1 => (u64::MAX - 1024)..=u64::MAX],
                proptest::prop_oneof![8 => 0..1u64 << 40, 1 => (u64::MAX - 1024)..=u64::MAX],
                // Mostly one length (the first run's), now and then another.
                proptest::prop_oneof![12 => proptest::strategy::Just(None), 1 => proptest::strategy::Strategy::prop_map(0..5000u64, Some), 1 => proptest::strategy::Strategy::prop_map((u64::MAX - 1024)..=u64::MAX, Some)],
                proptest::prop_oneof![8 => proptest::strategy::Just(1u32), 4 => proptest::strategy::Just(2u32), 1 => 0..5u32],
                proptest::prop_oneof![8 => 0..8192u64, 1 => (u64::MAX / 2)..=u64::MAX],
                proptest::prop_oneof![8 => 0..8192u64, 1 => (u64::MAX / 2)..=u64::MAX],
            ),
            1..5,
        ),
        first_len in proptest::prop_oneof![1 => proptest::strategy::Just(0u64), 8 => 1..5000u64, 1 => (u64::MAX - 1024)..=u64::MAX],
        gather in proptest::bool::ANY,
        region_addr in proptest::prop_oneof![8 => proptest::strategy::Just(1u64 << 20), 1 => (u64::MAX - (1 << 16))..=u64::MAX],
    ) {
        use proptest::prelude::*;
        let direction = if gather { Direction::Gather } else { Direction::Scatter };
        let region = RegionSpan { addr: region_addr as usize, len: 1 << 16 };
        let runs: Vec<Run> = runs
            .into_iter()
            .map(|(region_offset, addr, len, count, region_stride, addr_stride)| Run {
                region_offset,
                addr,
                len: len.unwrap_or(first_len),
                count,
                region_stride,
                addr_stride,
            })
            .collect();
        let uniform = runs.iter().all(|r| r.len == runs[0].len);
        let copies: u64 = runs.iter().map(|r| u64::from(r.count)).sum();
        let room = 8usize;
        let mut words = vec![u64::MAX; 2 * room];
        let pairs = fill_pairs(direction, region, &runs, &mut words);
        let mut table = Table::new(runs.len());
        let filled = table.fill(direction, region, &runs, 64, 1000);
        match pairs {
            Ok(None) => prop_assert!(!uniform || copies > room as u64),
            Err(_) => prop_assert!(uniform && filled.is_err(), "{:?}", filled),
            Ok(Some((len, n))) => {
                prop_assert!(uniform);
                prop_assert_eq!((len, n as u64), (runs[0].len, copies));
                prop_assert!(filled.is_ok(), "{:?}", filled);
                let mut j = 0;
                for run in &table.runs {
                    let [ss, ds] = if run.count > 1 { table.strides[run.stride_index as usize] } else { [0, 0] };
                    for k in 0..u64::from(run.count) {
                        // Wrapping, as the device would (a table that
                        // wraps is refused, never launched).
                        let at = |base: u64, step: u64| base.wrapping_add(k.wrapping_mul(step));
                        prop_assert_eq!([words[2 * j], words[2 * j + 1]], [at(run.src, ss), at(run.dst, ds)]);
                        j += 1;
                    }
                }
            }
        }
    }
}

#[test]
fn bad_input_is_refused_before_anything_is_launched() {
    let region = RegionSpan {
        addr: 4096,
        len: 4096,
    };
    let mut table = Table::new(4);
    let ok = Run::single(0, 1 << 30, 100);
    let past = Run::single(4000, 1 << 30, 200);
    let e = table
        .fill(Direction::Gather, region, &[ok, past], 4096, 8)
        .unwrap_err();
    assert!(e.reason.contains("run 1") && e.quiesced, "{e}");
    for bad_tile in [0, 8, 24, 100, 4096 + 16, MAX_TILE_BYTES * 2] {
        let e = table
            .fill(Direction::Gather, region, &[ok], bad_tile, 8)
            .unwrap_err();
        assert!(e.reason.contains("power of two"), "{e}");
    }
    let e = table
        .fill(Direction::Gather, region, &[], 4096, 8)
        .unwrap_err();
    assert!(e.reason.contains("no runs"), "{e}");
    let e = table
        .fill(Direction::Gather, region, &[ok; 5], 4096, 8)
        .unwrap_err();
    assert!(e.reason.contains("too small"), "{e}");
    let e = table
        .fill(Direction::Gather, region, &[ok], 4096, 0)
        .unwrap_err();
    assert!(e.reason.contains("0 warps"), "{e}");
    let empty = Run { count: 0, ..ok };
    assert!(table
        .fill(Direction::Scatter, region, &[empty], 4096, 8)
        .is_err());
    let wrap = Run::single(0, u64::MAX - 10, 100);
    assert!(table
        .fill(Direction::Scatter, region, &[wrap], 4096, 8)
        .is_err());
    // More than 2^32 - 1 tiles of 16 bytes: refused, not truncated.
    let huge = RegionSpan {
        addr: 1 << 40,
        len: 1 << 37,
    };
    let e = table
        .fill(
            Direction::Gather,
            huge,
            &[Run::single(0, 1 << 20, 1 << 37)],
            16,
            8,
        )
        .unwrap_err();
    assert!(e.reason.contains("tiles"), "{e}");
}

#[test]
fn architecture_strings() {
    assert_eq!(arch_number(9, 0), Some(90));
    assert_eq!(arch_number(10, 0), Some(100));
    assert_eq!(arch_number(12, 1), Some(121));
    assert_eq!(arch_number(0, 0), None);
    assert_eq!(choose_target(9, 0, &[]).unwrap(), NvrtcTarget::Cubin(90));
    assert_eq!(
        choose_target(9, 0, &[75, 80, 86, 89, 90, 100]).unwrap(),
        NvrtcTarget::Cubin(90)
    );
    assert_eq!(
        choose_target(12, 0, &[75, 80, 90, 100]).unwrap(),
        NvrtcTarget::Ptx(100)
    );
    assert!(choose_target(7, 0, &[75, 80]).is_err());
    assert_eq!(
        NvrtcTarget::Cubin(90).arch_option(),
        "--gpu-architecture=sm_90"
    );
    assert_eq!(
        NvrtcTarget::Ptx(100).arch_option(),
        "--gpu-architecture=compute_100"
    );
    let o = nvrtc_options(NvrtcTarget::Cubin(90));
    assert!(o.contains(&"--std=c++17".to_string()));
}

#[test]
fn the_kernel_source_matches_the_host_constants() {
    assert!(KERNEL_SOURCE.contains(&format!("#define BOUNCE_THREADS {BLOCK_THREADS}")));
    for name in [KERNEL_NAME, ZERO_COPY_KERNEL_NAME] {
        assert!(KERNEL_SOURCE.contains(&format!(
            "void __launch_bounds__(BOUNCE_THREADS, BOUNCE_MIN_BLOCKS)\n{name}("
        )));
    }
    for n in INLINE_PAIRS {
        assert!(KERNEL_SOURCE.contains(&format!("BOUNCE_INLINE_PAIRS_KERNEL({n})\n")));
        // The table and the other five parameters fit in CUDA's 32,764
        // bytes of kernel parameters.
        assert!(n * 16 + 8 + 4 * 4 <= 32_764, "{n}");
    }
    assert!(INLINE_PAIRS.windows(2).all(|w| w[0] < w[1]));
    for n in INLINE_PACKED {
        assert!(KERNEL_SOURCE.contains(&format!("BOUNCE_INLINE_PACKED_KERNEL({n})\n")));
        // The addresses and the other seven parameters (region, len, five
        // u32) fit in CUDA's 32,764 bytes of kernel parameters.
        assert!(n * 8 + 2 * 8 + 5 * 4 <= 32_764, "{n}");
    }
    assert!(INLINE_PACKED.windows(2).all(|w| w[0] < w[1]));
    assert!(
        !KERNEL_SOURCE.contains("#include"),
        "NVRTC has no toolkit headers"
    );
}

#[test]
fn the_kernel_compiles_with_nvrtc_when_present() {
    for target in [NvrtcTarget::Cubin(90), NvrtcTarget::Ptx(80)] {
        match compile_copy_kernel(target) {
            Ok((image, t)) => {
                assert!(!image.is_empty());
                // NVRTC of CUDA 12.1 or later keeps the inline kernels
                // (for Volta and later: both targets here are).
                let (mut major, mut minor) = (0, 0);
                // SAFETY: two out pointers.
                let _ = unsafe { nvrtc::sys::nvrtcVersion(&mut major, &mut minor) };
                let has = |name: &str| image.windows(name.len()).any(|w| w == name.as_bytes());
                for n in INLINE_PAIRS {
                    assert_eq!(
                        has(&inline_pairs_kernel_name(n)),
                        (major, minor) >= (12, 1),
                        "{n}: NVRTC {major}.{minor}"
                    );
                }
                for n in INLINE_PACKED {
                    assert_eq!(
                        has(&inline_packed_kernel_name(n)),
                        (major, minor) >= (12, 1),
                        "{n}: NVRTC {major}.{minor}"
                    );
                }
                println!("{target:?}: {} bytes in {t:?}", image.len());
            }
            Err(e @ CudaError::Unavailable(_)) => {
                println!("SKIP: {e}");
                return;
            }
            Err(e) => panic!("{e}"),
        }
    }
}

#[test]
fn handles_cross_threads_as_the_runtime_needs() {
    fn send<T: Send>() {}
    fn send_sync<T: Send + Sync>() {}
    send::<PendingCopy>();
    send::<ExecGuard>();
    send_sync::<CudaCopy>();
    send_sync::<ExecPool>();
    send_sync::<CudaRuntime>();
    send_sync::<crate::dataplane::vram::DeviceArena>();
}

#[test]
fn probe_never_panics() {
    match CudaRuntime::probe() {
        Ok(rt) => assert!(rt.device_count() > 0),
        Err(e) => assert!(!e.to_string().is_empty()),
    }
}
