//! The CUDA copy kernel against a host reference (needs a GPU; prints
//! `SKIP: no CUDA driver ...` and passes elsewhere).
//!
//! Every case: device buffers and their host mirrors are poisoned (0xAB),
//! random runs (sizes 1..70000, every alignment, strided runs with count > 1)
//! are gathered and scattered on the GPU and with the memcpy engine on the
//! host, and every byte of the whole buffers (so also the bytes outside the
//! destinations) is compared. Both argument modes (zero-copy pinned table and
//! uploaded table) are covered.
//!
//! Run: `cargo test --release --test gpu_kernels -- --nocapture`.

use std::sync::Arc;
use std::time::{Duration, Instant};

use nixl_bounce::copy::cuda::{
    CopyOptions, CudaCopy, CudaDevice, CudaRuntime, ExecPool, DEFAULT_TILE_BYTES,
};
use nixl_bounce::copy::host::HostCopy;
use nixl_bounce::copy::{CopyEngine, Direction, RegionSpan};
use nixl_bounce::dataplane::vram::DeviceArena;
use nixl_bounce::proto::{Copies, Run, Runs};

fn device() -> Option<Arc<CudaDevice>> {
    match CudaRuntime::probe() {
        Ok(rt) => Some(rt.device(0).expect("device 0 opens")),
        Err(e) => {
            println!("SKIP: no CUDA driver or device ({e})");
            None
        }
    }
}

use nixl_bounce::splitmix::SplitMix64 as Rng;

/// One run, as offsets: (region_offset, app_offset, len, count, region_stride, app_stride).
type Layout = Vec<(u64, u64, u64, u32, u64, u64)>;

/// Random runs whose region sides do not overlap and whose application
/// sides do not overlap (so gather and scatter results are defined).
fn random_layout(
    rng: &mut Rng,
    region_len: u64,
    app_len: u64,
    max_len: u64,
    max_runs: usize,
) -> Layout {
    let mut out = Vec::new();
    let (mut ro, mut ao) = (rng.below(64), rng.below(64));
    while out.len() < max_runs {
        let len = if rng.below(4) == 0 {
            1 + rng.below(max_len)
        } else {
            1 + rng.below(max_len.min(5000))
        };
        let count = if rng.below(3) == 0 {
            2 + rng.below(20) as u32
        } else {
            1
        };
        let rs = len + rng.below(40);
        let as_ = len + rng.below(300);
        let rspan = (count as u64 - 1) * rs + len;
        let aspan = (count as u64 - 1) * as_ + len;
        if ro + rspan > region_len || ao + aspan > app_len {
            break;
        }
        out.push((ro, ao, len, count, rs, as_));
        // Sometimes packed back to back (merged-run shape), sometimes gaps.
        ro += rspan + if rng.below(2) == 0 { 0 } else { rng.below(50) };
        ao += aspan + rng.below(70);
    }
    out
}

/// A chunk as wire version 3 packs it: `n` blocks of `len` bytes back to
/// back in the region from a random offset, scattered in the application
/// buffer, some merged into runs of two (the only runs packed copies have).
fn copies_layout(rng: &mut Rng, region_len: u64, app_len: u64, len: u64, n: usize) -> Layout {
    let mut out = Vec::new();
    let (mut ro, mut ao) = (rng.below(64), rng.below(64));
    let mut left = n;
    while left > 0 {
        let count = if left >= 2 && rng.below(3) == 0 { 2 } else { 1 };
        let as_ = len + rng.below(300);
        let aspan = (count - 1) * as_ + len;
        if ro + count * len > region_len || ao + aspan > app_len {
            break;
        }
        out.push((ro, ao, len, count as u32, len, as_));
        ro += count * len;
        ao += aspan + rng.below(70);
        left -= count as usize;
    }
    out
}

/// `runs` as packed copies (every run one or two copies of one length,
/// back to back in the region), the form the receiver keeps a decoded
/// DATA in.
fn packed(runs: &[Run]) -> Runs {
    let len = runs[0].len;
    let mut addrs = Vec::new();
    let mut second = Vec::new();
    for r in runs {
        assert!(r.len == len && r.count <= 2 && r.region_stride == len);
        assert_eq!(
            r.region_offset,
            runs[0].region_offset + addrs.len() as u64 * len
        );
        for k in 0..r.count as u64 {
            second.push(k == 1);
            addrs.push(r.addr + k * r.addr_stride);
        }
    }
    let mut marks = vec![0u8; addrs.len().div_ceil(8)];
    for (j, _) in second.iter().enumerate().filter(|(_, &m)| m) {
        marks[j / 8] |= 1 << (j % 8);
    }
    let copies = Copies::new(len, runs[0].region_offset, addrs, marks).unwrap();
    let list = Runs::from_copies(copies);
    assert_eq!(each_copy(&list), each_copy(runs), "the copies are the runs");
    list
}

/// Every copy `runs` make: (region offset, address, length).
fn each_copy(runs: &[Run]) -> Vec<(u64, u64, u64)> {
    runs.iter()
        .flat_map(|r| {
            (0..r.count as u64).map(move |k| {
                (
                    r.region_offset + k * r.region_stride,
                    r.addr + k * r.addr_stride,
                    r.len,
                )
            })
        })
        .collect()
}

fn runs_for(layout: &Layout, app_base: u64) -> Vec<Run> {
    layout
        .iter()
        .map(|&(ro, ao, len, count, rs, as_)| Run {
            region_offset: ro,
            addr: app_base + ao,
            len,
            count,
            region_stride: rs,
            addr_stride: as_,
        })
        .collect()
}

fn assert_same(what: &str, got: &[u8], want: &[u8]) {
    assert_eq!(got.len(), want.len());
    if got != want {
        let first = got.iter().zip(want).position(|(a, b)| a != b).unwrap();
        let bad = got.iter().zip(want).filter(|(a, b)| a != b).count();
        panic!(
            "{what}: {bad} bytes differ; first at {first}: got {:#04x}, want {:#04x}",
            got[first], want[first]
        );
    }
}

/// Device buffers + host mirrors for one gather/scatter round trip.
struct Buffers {
    src: DeviceArena,
    region: DeviceArena,
    dst: DeviceArena,
    src_h: Vec<u8>,
    region_h: Vec<u8>,
    dst_h: Vec<u8>,
}

impl Buffers {
    fn new(dev: &CudaDevice, region_len: usize, app_len: usize, rng: &mut Rng) -> Buffers {
        let b = Buffers {
            src: DeviceArena::new(dev, app_len).unwrap(),
            region: DeviceArena::new(dev, region_len).unwrap(),
            dst: DeviceArena::new(dev, app_len).unwrap(),
            src_h: rng.bytes(app_len),
            region_h: vec![0xAB; region_len],
            dst_h: vec![0xAB; app_len],
        };
        b.src.write(0, &b.src_h).unwrap();
        b
    }

    fn poison(&mut self) {
        self.region.fill(0xAB).unwrap();
        self.dst.fill(0xAB).unwrap();
        self.region_h.fill(0xAB);
        self.dst_h.fill(0xAB);
    }

    /// Region span `[off, off+len)` on the device and on the host mirror.
    fn spans(&mut self, off: usize, len: usize) -> (RegionSpan, RegionSpan) {
        (
            self.region.span(off, len).unwrap(),
            RegionSpan {
                addr: self.region_h.as_mut_ptr() as usize + off,
                len,
            },
        )
    }

    /// Gathers `layout` into the region at `off` and scatters it back out,
    /// on the GPU (through `start`, which returns the copy's result) and on
    /// the host, and compares everything after each step.
    fn round_trip(
        &mut self,
        what: &str,
        layout: &Layout,
        off: usize,
        len: usize,
        mut gpu: impl FnMut(Direction, RegionSpan, &[Run]),
    ) {
        self.poison();
        let host = HostCopy {
            threads: 1,
            parallel_threshold: u64::MAX,
        };
        let (dspan, hspan) = self.spans(off, len);
        gpu(Direction::Gather, dspan, &runs_for(layout, self.src.base()));
        host.copy(
            Direction::Gather,
            hspan,
            &runs_for(layout, self.src_h.as_ptr() as u64),
        )
        .unwrap();
        let mut got = vec![0u8; self.region_h.len()];
        self.region.read(0, &mut got).unwrap();
        assert_same(&format!("{what}: gather"), &got, &self.region_h);

        gpu(
            Direction::Scatter,
            dspan,
            &runs_for(layout, self.dst.base()),
        );
        host.copy(
            Direction::Scatter,
            hspan,
            &runs_for(layout, self.dst_h.as_mut_ptr() as u64),
        )
        .unwrap();
        let mut got = vec![0u8; self.dst_h.len()];
        self.dst.read(0, &mut got).unwrap();
        assert_same(&format!("{what}: scatter"), &got, &self.dst_h);
    }
}

/// Polls a launched copy until it reports its result (at most 10 s).
fn poll_until_done<T>(what: &str, mut poll: impl FnMut() -> Option<T>) -> T {
    let deadline = Instant::now() + Duration::from_secs(10);
    loop {
        if let Some(r) = poll() {
            return r;
        }
        assert!(Instant::now() < deadline, "{what}: copy never completed");
        std::hint::spin_loop();
    }
}

#[test]
fn random_runs_match_the_host_reference_in_both_argument_modes() {
    let Some(dev) = device() else { return };
    let k = dev.copy_kernel().expect("the copy kernel compiles");
    println!(
        "device {} ({:?}), kernel {:?}",
        dev.name(),
        dev.compute_capability(),
        k
    );
    let mut rng = Rng::new(0x5EED_1234_ABCD_0001);
    let (region_len, app_len) = (4 << 20, 8 << 20);
    let mut bufs = Buffers::new(&dev, region_len, app_len, &mut rng);
    for zero_copy in [true, false] {
        let pool = ExecPool::new(dev.clone(), 2, zero_copy).unwrap();
        let option_sets = [
            CopyOptions::default(),
            CopyOptions {
                tile_bytes: 16,
                max_blocks: Some(7),
                ..Default::default()
            },
            CopyOptions {
                tile_bytes: 4096,
                max_blocks: Some(1),
                ..Default::default()
            },
            CopyOptions {
                tile_bytes: 1 << 20,
                max_blocks: Some(64),
                ..Default::default()
            },
        ];
        for (oi, opts) in option_sets.iter().enumerate() {
            let engine = CudaCopy::with_options(pool.clone(), *opts).unwrap();
            let cases = if opts.max_blocks == Some(1) || opts.tile_bytes == 16 {
                6
            } else {
                25
            };
            for case in 0..cases {
                let max_len = [1, 16, 300, 4096, 70000][case % 5];
                let max_runs = if opts.tile_bytes == 16 { 300 } else { 3000 };
                let off = rng.below(256) as usize;
                let len = region_len - 256;
                let layout = random_layout(&mut rng, len as u64, app_len as u64, max_len, max_runs);
                if layout.is_empty() {
                    continue;
                }
                let what = format!(
                    "zero_copy={zero_copy} options#{oi} case {case} ({} runs, max len {max_len})",
                    layout.len()
                );
                bufs.round_trip(&what, &layout, off, len, |d, span, runs| {
                    engine
                        .copy(d, span, runs)
                        .unwrap_or_else(|e| panic!("{what}: {e}"))
                });
            }
        }
        assert_eq!(pool.idle(), 2, "every context is back");
    }
}

#[test]
fn non_blocking_start_and_poll() {
    let Some(dev) = device() else { return };
    let mut rng = Rng::new(77);
    let (region_len, app_len) = (2 << 20, 4 << 20);
    let mut bufs = Buffers::new(&dev, region_len, app_len, &mut rng);
    for zero_copy in [true, false] {
        let pool = ExecPool::new(dev.clone(), 1, zero_copy).unwrap();
        let engine = CudaCopy::new(pool.clone());
        for case in 0..10 {
            let layout = random_layout(&mut rng, region_len as u64, app_len as u64, 20000, 500);
            let what = format!("poll zero_copy={zero_copy} case {case}");
            bufs.round_trip(&what, &layout, 0, region_len, |d, span, runs| {
                let mut p = engine
                    .try_start(d, span, runs)
                    .unwrap()
                    .expect("the only context is idle");
                assert!(
                    pool.try_acquire().is_none(),
                    "the copy holds the only context"
                );
                poll_until_done(&what, || p.poll()).unwrap();
                assert_eq!(p.poll(), Some(Ok(())), "a finished copy keeps its result");
                assert_eq!(pool.idle(), 1, "completion returns the context");
            });
        }
        // Dropping a running copy waits for it and returns the context.
        let layout = random_layout(&mut rng, region_len as u64, app_len as u64, 4096, 2000);
        let (span, _) = bufs.spans(0, region_len);
        let p = engine
            .try_start(Direction::Gather, span, &runs_for(&layout, bufs.src.base()))
            .unwrap()
            .unwrap();
        drop(p);
        assert_eq!(pool.idle(), 1);
        // An empty run list is done at once.
        let mut p = engine
            .try_start(Direction::Scatter, span, &[])
            .unwrap()
            .unwrap();
        assert_eq!(p.poll(), Some(Ok(())));
    }
}

/// The engine-level launch the IO thread uses for gathers: byte-exact,
/// `None` while no context is idle (the runtime then hands the copy to a
/// worker), and the launch and device-wait counters move.
#[test]
fn try_launch_polls_to_completion_and_declines_when_busy() {
    let Some(dev) = device() else { return };
    let mut rng = Rng::new(4242);
    let (region_len, app_len) = (2 << 20, 4 << 20);
    let mut bufs = Buffers::new(&dev, region_len, app_len, &mut rng);
    let pool = ExecPool::new(dev.clone(), 1, true).unwrap();
    let engine = CudaCopy::new(pool.clone());
    let counter = |k: &str| {
        engine
            .phase_counters()
            .into_iter()
            .find(|(n, _)| *n == k)
            .map(|(_, v)| v)
            .unwrap()
    };
    for case in 0..6 {
        let layout = random_layout(&mut rng, region_len as u64, app_len as u64, 20000, 800);
        let what = format!("try_launch case {case}");
        bufs.round_trip(&what, &layout, 0, region_len, |d, span, runs| {
            let runs = Runs::from(runs.to_vec());
            let mut copy = engine
                .try_launch(d, span, &runs)
                .expect("the only context is idle")
                .unwrap();
            assert!(
                engine.try_launch(d, span, &runs).is_none(),
                "{what}: no idle context, so the caller should use a worker"
            );
            poll_until_done(&what, || copy.poll()).unwrap();
            assert_eq!(pool.idle(), 1, "completion returns the context");
        });
    }
    // Packed copies as a decoded DATA keeps them (the pair-table launch),
    // from one copy to a full chunk of 4 KiB blocks, and odd lengths.
    for (case, (len, n)) in [(4096, 1), (4096, 2), (4096, 500), (8192, 200), (37, 5000)]
        .into_iter()
        .enumerate()
    {
        let layout = copies_layout(&mut rng, region_len as u64, app_len as u64, len, n);
        let what = format!("try_launch copies case {case} ({n} x {len} B)");
        bufs.round_trip(&what, &layout, 0, region_len, |d, span, runs| {
            let mut copy = engine
                .try_launch(d, span, &packed(runs))
                .expect("the only context is idle")
                .unwrap();
            poll_until_done(&what, || copy.poll()).unwrap();
        });
    }
    assert!(counter("gpu_gather_launch_ns") > 0 && counter("gpu_gather_wait_ns") > 0);
    assert!(counter("gpu_scatter_launch_ns") > 0 && counter("gpu_scatter_wait_ns") > 0);
    // At least one kernel launch a direction for each of the 11 round
    // trips (the declined second launch made none), as many each way.
    let (gathers, scatters) = (
        counter("gpu_gather_launches"),
        counter("gpu_scatter_launches"),
    );
    assert!(
        gathers >= 11 && gathers == scatters,
        "{gathers} gather and {scatters} scatter launches"
    );
    // A run outside the region is refused at launch, nothing touched.
    let (span, _) = bufs.spans(0, 4096);
    let bad = [Run {
        region_offset: 4000,
        addr: bufs.src.base(),
        len: 200,
        count: 1,
        region_stride: 200,
        addr_stride: 200,
    }];
    let e = match engine.try_launch(Direction::Gather, span, &Runs::from(bad.to_vec())) {
        Some(Err(e)) => e,
        Some(Ok(_)) => panic!("a run past the region was launched"),
        None => panic!("the context is idle"),
    };
    assert!(e.quiesced, "{e}");
    assert_eq!(pool.idle(), 1);
    // So are packed copies past the region, with the run named.
    let two = Copies::new(
        4096,
        0,
        vec![bufs.src.base(), bufs.src.base() + 8192],
        vec![0],
    )
    .unwrap();
    let e = match engine.try_launch(Direction::Gather, span, &Runs::from_copies(two)) {
        Some(Err(e)) => e,
        Some(Ok(_)) => panic!("copies past the region were launched"),
        None => panic!("the context is idle"),
    };
    assert!(e.quiesced && e.to_string().contains("region"), "{e}");
    assert_eq!(pool.idle(), 1);
}

/// Chunks of packed copies launched together (one table, one launch, as
/// the IO thread launches a burst) gather and scatter what each would
/// alone, every byte of the buffers compared with the host reference; lists
/// of different lengths, or one leaving its region, are not launched
/// together (the caller launches them one by one, which words the refusal).
#[test]
fn copies_launched_together_match_the_host_reference() {
    let Some(dev) = device() else { return };
    let mut rng = Rng::new(9090);
    let (part_region, part_app) = (1usize << 20, 2usize << 20);
    let parts = 3;
    let mut bufs = Buffers::new(&dev, parts * part_region, parts * part_app, &mut rng);
    let pool = ExecPool::new(dev.clone(), 1, false).unwrap();
    let engine = CudaCopy::new(pool.clone());
    let host = HostCopy {
        threads: 1,
        parallel_threshold: u64::MAX,
    };
    for (case, (len, counts)) in [
        (4096u64, [1usize, 2, 3]),
        (4096, [200, 1, 250]),
        (8192, [100, 120, 90]),
        (37, [3000, 10, 2000]),
    ]
    .into_iter()
    .enumerate()
    {
        let what = format!("together case {case} ({counts:?} x {len} B)");
        bufs.poison();
        let layouts: Vec<Layout> = counts
            .iter()
            .map(|&n| copies_layout(&mut rng, part_region as u64, part_app as u64, len, n))
            .collect();
        let spans: Vec<(RegionSpan, RegionSpan)> = (0..parts)
            .map(|k| bufs.spans(k * part_region, part_region))
            .collect();
        for (direction, dev_app, host_app) in [
            (
                Direction::Gather,
                bufs.src.base(),
                bufs.src_h.as_ptr() as u64,
            ),
            (
                Direction::Scatter,
                bufs.dst.base(),
                bufs.dst_h.as_mut_ptr() as u64,
            ),
        ] {
            let lists: Vec<Runs> = layouts
                .iter()
                .enumerate()
                .map(|(k, l)| packed(&runs_for(l, dev_app + (k * part_app) as u64)))
                .collect();
            let args: Vec<(RegionSpan, &Runs)> =
                spans.iter().map(|s| s.0).zip(lists.iter()).collect();
            let mut copy = engine
                .try_launch_together(direction, &args)
                .expect("one length, inside their regions, the context idle")
                .unwrap();
            poll_until_done(&what, || copy.poll()).unwrap();
            assert_eq!(pool.idle(), 1, "{what}: completion returns the context");
            for (k, l) in layouts.iter().enumerate() {
                let runs = runs_for(l, host_app + (k * part_app) as u64);
                host.copy(direction, spans[k].1, &runs).unwrap();
            }
        }
        let mut got = vec![0u8; bufs.region_h.len()];
        bufs.region.read(0, &mut got).unwrap();
        assert_same(&format!("{what}: gather"), &got, &bufs.region_h);
        let mut got = vec![0u8; bufs.dst_h.len()];
        bufs.dst.read(0, &mut got).unwrap();
        assert_same(&format!("{what}: scatter"), &got, &bufs.dst_h);
    }
    // Not together: one copy of another length, or one list past its
    // region (nothing launched, the context idle; alone it is refused).
    let base = bufs.src.base();
    let list = |len: u64, first: u64, n: u64| {
        let addrs = (0..n).map(|i| base + i * 2 * len).collect();
        Runs::from_copies(
            Copies::new(len, first, addrs, vec![0; (n as usize).div_ceil(8)]).unwrap(),
        )
    };
    let (span, _) = bufs.spans(0, part_region);
    let (a, b) = (list(4096, 0, 4), list(8192, 0, 4));
    assert!(engine
        .try_launch_together(Direction::Gather, &[(span, &a), (span, &b)])
        .is_none());
    let past = list(4096, part_region as u64 - 4096, 2);
    assert!(engine
        .try_launch_together(Direction::Gather, &[(span, &a), (span, &past)])
        .is_none());
    assert_eq!(pool.idle(), 1);
    match engine.try_launch(Direction::Gather, span, &past) {
        Some(Err(e)) => assert!(e.quiesced && e.to_string().contains("region"), "{e}"),
        _ => panic!("copies past the region were not refused"),
    }
    // One list is not a group.
    assert!(engine
        .try_launch_together(Direction::Gather, &[(span, &a)])
        .is_none());
}

/// One list of packed copies (a chunk's gather, a DATA's scatter): with
/// `inline_packed` its addresses are the launch's parameter up to 1024
/// copies (the region side computed on the GPU), else a pair table is
/// uploaded; both match the host reference at every size around the
/// kernels' capacities, and the counters say which launches were inline.
/// Also times a launch call of each (host side, medians).
#[test]
fn single_packed_lists_inline_and_uploaded_match_the_host_reference() {
    let Some(dev) = device() else { return };
    let mut rng = Rng::new(4242);
    let (region_len, app_len) = (24usize << 20, 32usize << 20);
    let mut bufs = Buffers::new(&dev, region_len, app_len, &mut rng);
    let counter = |e: &CudaCopy, name: &str| {
        e.phase_counters()
            .into_iter()
            .find(|(k, _)| *k == name)
            .map(|(_, v)| v)
            .unwrap()
    };
    for inline in [true, false] {
        let pool = ExecPool::new(dev.clone(), 1, false).unwrap();
        let opts = CopyOptions {
            inline_packed: inline,
            ..CopyOptions::default()
        };
        let engine = CudaCopy::with_options(pool.clone(), opts).unwrap();
        let mut launch_us: Vec<f64> = Vec::new();
        // Whether this driver and NVRTC have the inline kernels (CUDA
        // 12.1 and later), seen from the first case's counters.
        let mut inline_kernels = true;
        for (len, n) in [
            (4096u64, 1usize),
            (4096, 255),
            (4096, 256),
            (4096, 257),
            (4096, 511),
            (4096, 512),
            (4096, 513),
            (4096, 1024),
            (4096, 1025),
            (4096, 2048),
            (64, 1024),
            (37, 1000),
            (37, 3000),
            (8192, 700),
            // Copies longer than a tile (8 KiB): several tiles a copy, the
            // last one partial.
            (20000, 300),
        ] {
            let what = format!("{n} x {len} B, inline {inline}");
            let layout = copies_layout(&mut rng, region_len as u64, app_len as u64, len, n);
            let count: u64 = layout.iter().map(|r| r.3 as u64).sum();
            assert_eq!(count, n as u64, "{what}: the layout holds every copy");
            let before = [
                counter(&engine, "gpu_gather_inline_launches"),
                counter(&engine, "gpu_scatter_inline_launches"),
            ];
            bufs.round_trip(&what, &layout, 0, region_len, |direction, span, runs| {
                let list = packed(runs);
                let t = Instant::now();
                let mut copy = engine
                    .try_launch(direction, span, &list)
                    .expect("the context idle")
                    .unwrap();
                launch_us.push(t.elapsed().as_secs_f64() * 1e6);
                poll_until_done(&what, || copy.poll()).unwrap();
            });
            let after = [
                counter(&engine, "gpu_gather_inline_launches"),
                counter(&engine, "gpu_scatter_inline_launches"),
            ];
            if inline && n == 1 && after == before {
                println!(
                    "SKIP the inline launch counts: no inline kernels here (CUDA older than 12.1)"
                );
                inline_kernels = false;
            }
            let want = u64::from(inline && inline_kernels && n <= 1024);
            assert_eq!(
                [after[0] - before[0], after[1] - before[1]],
                [want, want],
                "{what}: inline launches"
            );
        }
        launch_us.sort_by(|a, b| a.total_cmp(b));
        println!(
            "single packed lists, inline {inline}: launch call (table, upload, launch) median {:.1} us over {}",
            launch_us[launch_us.len() / 2],
            launch_us.len()
        );
    }
}

#[test]
fn concurrent_copies_through_one_pool() {
    let Some(dev) = device() else { return };
    for zero_copy in [true, false] {
        let pool = ExecPool::new(dev.clone(), 2, zero_copy).unwrap();
        let engine = CudaCopy::new(pool.clone());
        std::thread::scope(|s| {
            for t in 0..6u64 {
                let dev = dev.clone();
                let engine = &engine;
                s.spawn(move || {
                    let mut rng = Rng::new(1000 + t);
                    let (region_len, app_len) = (1 << 20, 2 << 20);
                    let mut bufs = Buffers::new(&dev, region_len, app_len, &mut rng);
                    for i in 0..12 {
                        let layout =
                            random_layout(&mut rng, region_len as u64, app_len as u64, 9000, 800);
                        let what = format!("thread {t} iteration {i} zero_copy={zero_copy}");
                        bufs.round_trip(&what, &layout, 0, region_len, |d, span, runs| {
                            engine
                                .copy(d, span, runs)
                                .unwrap_or_else(|e| panic!("{what}: {e}"))
                        });
                    }
                });
            }
        });
        assert_eq!(pool.idle(), 2);
        assert_eq!(pool.live(), 2);
    }
}

#[test]
fn a_run_outside_the_region_is_rejected_without_launching() {
    let Some(dev) = device() else { return };
    let pool = ExecPool::new(dev.clone(), 1, true).unwrap();
    let engine = CudaCopy::new(pool.clone());
    let arena = DeviceArena::new(&dev, 8192).unwrap();
    let src = DeviceArena::new(&dev, 8192).unwrap();
    arena.fill(0xAB).unwrap();
    src.fill(0x11).unwrap();
    let span = arena.span(0, 4096).unwrap();
    let runs = [
        Run::single(0, src.base(), 100),
        Run::single(4000, src.base(), 200),
    ];
    for d in [Direction::Gather, Direction::Scatter] {
        let e = engine.copy(d, span, &runs).unwrap_err();
        assert!(e.reason.contains("run 1") && e.quiesced, "{e}");
        let e = engine.try_start(d, span, &runs).unwrap_err();
        assert!(e.reason.contains("run 1") && e.quiesced, "{e}");
    }
    let mut got = vec![0u8; 8192];
    arena.read(0, &mut got).unwrap();
    assert!(got.iter().all(|&b| b == 0xAB), "nothing may be copied");
    src.read(0, &mut got).unwrap();
    assert!(got.iter().all(|&b| b == 0x11), "nothing may be copied");
    assert_eq!(pool.idle(), 1);
    assert!(CudaCopy::with_options(
        pool.clone(),
        CopyOptions {
            tile_bytes: 24,
            ..Default::default()
        }
    )
    .is_err());
}

#[test]
fn pool_acquire_is_bounded_and_guards_return_contexts() {
    let Some(dev) = device() else { return };
    let pool = ExecPool::new(dev, 2, true).unwrap();
    let a = pool.try_acquire().unwrap();
    let b = pool.acquire(Duration::from_millis(10)).unwrap();
    assert!(pool.try_acquire().is_none());
    let t = Instant::now();
    assert!(pool.acquire(Duration::from_millis(50)).is_err());
    assert!(t.elapsed() >= Duration::from_millis(45));
    drop(a);
    assert!(pool.try_acquire().is_some());
    drop(b);
    assert_eq!(pool.idle(), 2);
}

#[test]
fn sixteen_thousand_4k_blocks_merged_and_unmerged() {
    let Some(dev) = device() else { return };
    const N: usize = 16384;
    const B: usize = 4096;
    let mut rng = Rng::new(4242);
    let region = DeviceArena::new(&dev, N * B).unwrap();
    let src = DeviceArena::new(&dev, 2 * N * B).unwrap();
    let dst = DeviceArena::new(&dev, 2 * N * B).unwrap();
    let src_h = rng.bytes(2 * N * B);
    src.write(0, &src_h).unwrap();
    for zero_copy in [true, false] {
        let engine = CudaCopy::new(ExecPool::new(dev.clone(), 2, zero_copy).unwrap());
        let span = region.span(0, N * B).unwrap();
        // Block i of the source (every other 4 KiB) -> region slot i -> dst block 2i+1.
        let merged_g = [Run {
            region_offset: 0,
            addr: src.base(),
            len: B as u64,
            count: N as u32,
            region_stride: B as u64,
            addr_stride: 2 * B as u64,
        }];
        let merged_s = [Run {
            addr: dst.base() + B as u64,
            ..merged_g[0]
        }];
        let single_g: Vec<Run> = (0..N)
            .map(|i| Run::single((i * B) as u64, src.base() + (2 * i * B) as u64, B as u64))
            .collect();
        let single_s: Vec<Run> = (0..N)
            .map(|i| {
                Run::single(
                    (i * B) as u64,
                    dst.base() + ((2 * i + 1) * B) as u64,
                    B as u64,
                )
            })
            .collect();
        for (name, g, s) in [
            ("merged", &merged_g[..], &merged_s[..]),
            ("single", &single_g[..], &single_s[..]),
        ] {
            region.fill(0xAB).unwrap();
            dst.fill(0xAB).unwrap();
            let t = Instant::now();
            engine.copy(Direction::Gather, span, g).unwrap();
            let tg = t.elapsed();
            let t = Instant::now();
            engine.copy(Direction::Scatter, span, s).unwrap();
            let ts = t.elapsed();
            println!("{name} zero_copy={zero_copy}: gather {tg:?}, scatter {ts:?} (first launch, includes table set-up)");
            let mut got = vec![0u8; 2 * N * B];
            dst.read(0, &mut got).unwrap();
            for i in 0..N {
                assert_eq!(
                    &got[2 * i * B..(2 * i + 1) * B],
                    &[0xABu8; B][..],
                    "{name}: dst block {} must stay poisoned",
                    2 * i
                );
                assert_eq!(
                    &got[(2 * i + 1) * B..(2 * i + 2) * B],
                    &src_h[2 * i * B..(2 * i + 1) * B],
                    "{name}: dst block {}",
                    2 * i + 1
                );
            }
        }
    }
    let _ = DEFAULT_TILE_BYTES;
}

/// The experimental `use_cub_copy` path (cuMemcpyBatchAsync) against the
/// same reference. A driver without the entry point is reported, not failed.
#[test]
fn batched_memcpy_path_matches_the_host_reference() {
    let Some(dev) = device() else { return };
    let mut rng = Rng::new(0xBA7C4);
    let (region_len, app_len) = (2 << 20, 4 << 20);
    let mut bufs = Buffers::new(&dev, region_len, app_len, &mut rng);
    let pool = ExecPool::new(dev.clone(), 2, true).unwrap();
    let engine = CudaCopy::with_options(
        pool.clone(),
        CopyOptions {
            batch_memcpy: true,
            ..Default::default()
        },
    )
    .unwrap();
    let probe_span = bufs.region.span(0, 16).unwrap();
    if let Err(e) = engine.copy(
        Direction::Gather,
        probe_span,
        &[Run::single(0, bufs.src.base(), 16)],
    ) {
        assert!(e.quiesced, "{e}");
        println!("SKIP: cuMemcpyBatchAsync unavailable: {e}");
        return;
    }
    for case in 0..10 {
        let layout = random_layout(
            &mut rng,
            region_len as u64,
            app_len as u64,
            [16, 4096, 70000][case % 3],
            1500,
        );
        let what = format!("batched memcpy case {case}");
        bufs.round_trip(&what, &layout, 0, region_len, |d, span, runs| {
            engine
                .copy(d, span, runs)
                .unwrap_or_else(|e| panic!("{what}: {e}"))
        });
    }
    assert_eq!(pool.idle(), 2);
}

/// The pair kernel (the peer-mapped path's table of one-length copies)
/// against the host: every length class (under a word, a tile, several
/// tiles with a partial last one), every relative alignment, copies placed
/// at random non-overlapping spots of the destination, and every byte of
/// both buffers compared (so nothing outside the copies is touched). The
/// uploads are queued back to back on one staging buffer, so a table is
/// built while the previous one may still be uploading.
#[test]
fn pair_tables_match_the_host_reference() {
    use nixl_bounce::copy::ipc::IpcCopier;
    let Some(dev) = device() else { return };
    let copier = IpcCopier::for_device(dev.ordinal(), 2).expect("copier");
    let mut rng = Rng::new(0x005e_ed0f_9a1e);
    let buf = 32 << 20;
    let src = DeviceArena::new(&dev, buf).unwrap();
    let dst = DeviceArena::new(&dev, buf).unwrap();
    let src_h = rng.bytes(buf);
    src.write(0, &src_h).unwrap();
    for (case, &len) in [1usize, 7, 16, 100, 4096, 8192, 8193, 12345, 32768, 100_000]
        .iter()
        .enumerate()
    {
        for (m, misalign) in [0usize, 1, 8, 13].into_iter().enumerate() {
            dst.fill(0xAB).unwrap();
            let mut want = vec![0xABu8; buf];
            // Destination slots of `len` rounded up to 16, shuffled; sources anywhere.
            let slot = len.next_multiple_of(16) + 16;
            // Counts on both sides of each inline table size (256, 512,
            // 1024, 2040), each count in both forms: the 40 cases go
            // through the counts four times, inline on rounds 0 and 2.
            let counts = [1usize, 256, 257, 512, 513, 1024, 1025, 2040, 2041, 6000];
            let k = case * 4 + m;
            let n = counts[k % counts.len()].min(buf / slot);
            let inline_limit = [usize::MAX, 0][(k / counts.len()) % 2];
            let mut slots: Vec<usize> = (0..n).collect();
            for i in (1..n).rev() {
                slots.swap(i, rng.below(i as u64 + 1) as usize);
            }
            let copies: Vec<(usize, usize)> = slots
                .iter()
                .map(|&s| {
                    let from = rng.below((buf - len - 16) as u64) as usize & !15;
                    (from + (misalign * 3) % 16, s * slot + misalign)
                })
                .collect();
            for &(from, to) in &copies {
                want[to..to + len].copy_from_slice(&src_h[from..from + len]);
            }
            copier.set_inline_limit(inline_limit);
            let table = pair_table(&copier, len, &copies, &src, &dst);
            assert_eq!(table.bytes(), (n * len) as u64);
            // This machine's NVRTC (CUDA 13) has the inline pair kernels.
            assert_eq!(table.inline(), n <= 2040 && inline_limit > 0, "{n} copies");
            let mut table = table;
            let launch = table.launch(&[]).expect("launch");
            poll_until_done("pair copy", || launch.poll()).expect("copy succeeds");
            let mut got = vec![0u8; buf];
            dst.read(0, &mut got).unwrap();
            assert_same(
                &format!("case {case}: {n} x {len} bytes, misaligned by {misalign}, inline up to {inline_limit}"),
                &got,
                &want,
            );
        }
    }
    // A declined table uploads nothing and is no error.
    let declined = copier.prepare_pairs(4, 4096, Instant::now(), |_| Ok(false));
    assert!(matches!(declined, Ok(None)));
}

/// The pair table of `copies` (source, destination offsets) of `len`
/// bytes each from `src` into `dst`.
fn pair_table(
    copier: &std::sync::Arc<nixl_bounce::copy::ipc::IpcCopier>,
    len: usize,
    copies: &[(usize, usize)],
    src: &DeviceArena,
    dst: &DeviceArena,
) -> nixl_bounce::copy::ipc::IpcTable {
    copier
        .prepare_pairs(copies.len(), len as u64, Instant::now(), |out| {
            for (pair, &(from, to)) in out.chunks_exact_mut(2).zip(copies) {
                pair[0] = src.base() + from as u64;
                pair[1] = dst.base() + to as u64;
            }
            Ok(true)
        })
        .expect("table")
        .expect("not declined")
}

/// An inline table reuses the words of one dropped before it (the copier
/// keeps them): a smaller table after a larger one of the same capacity
/// finds the larger one's pairs beyond its own, and the kernel must copy
/// only its own.
#[test]
fn a_reused_inline_table_copies_only_its_own_pairs() {
    use nixl_bounce::copy::ipc::IpcCopier;
    let Some(dev) = device() else { return };
    let copier = IpcCopier::for_device(dev.ordinal(), 1).expect("copier");
    let len = 4096usize;
    let buf = 1024 * len;
    let src = DeviceArena::new(&dev, buf).unwrap();
    let dst = DeviceArena::new(&dev, buf).unwrap();
    let src_h = Rng::new(0x1a11e).bytes(buf);
    src.write(0, &src_h).unwrap();
    // 512 copies into the upper half of the slots, then 300 into the lower
    // half: both take the 512-pair inline kernel, and the second's words
    // still hold the first's pairs 300..511, whose slots (512..723) must
    // keep their fill.
    for (n, first_slot) in [(512usize, 512usize), (300, 0)] {
        dst.fill(0xAB).unwrap();
        let mut want = vec![0xABu8; buf];
        let copies: Vec<(usize, usize)> = (0..n)
            .map(|i| (i * len, (first_slot + n - 1 - i) * len))
            .collect();
        for &(from, to) in &copies {
            want[to..to + len].copy_from_slice(&src_h[from..from + len]);
        }
        let mut table = pair_table(&copier, len, &copies, &src, &dst);
        assert!(table.inline(), "{n} copies are inline");
        let launch = table.launch(&[]).expect("launch");
        poll_until_done("pair copy", || launch.poll()).expect("copy succeeds");
        drop(table);
        let mut got = vec![0u8; buf];
        dst.read(0, &mut got).unwrap();
        assert_same(
            &format!("{n} copies after a dropped inline table"),
            &got,
            &want,
        );
    }
}

/// Not a test: what each driver call of a table upload costs on this
/// machine (pinned host -> device, async), idle between uploads or back to
/// back, for the breakdown in docs/benchmarks.md.
/// `gpu_kernels --ignored upload_call_costs --nocapture`.
#[test]
#[ignore]
fn upload_call_costs() {
    use cudarc::driver::{result, sys};
    let Some(dev) = device() else { return };
    let ctx = dev.context().clone();
    ctx.bind_to_thread().unwrap();
    let up = ctx.new_stream().unwrap();
    let other = ctx.new_stream().unwrap();
    let mut ev: sys::CUevent = std::ptr::null_mut();
    // SAFETY: one out pointer.
    unsafe { sys::cuEventCreate(&mut ev, sys::CUevent_flags::CU_EVENT_DISABLE_TIMING as u32) }
        .result()
        .unwrap();
    for bytes in [8usize << 10, 512 << 10] {
        // SAFETY: plain allocations, freed below.
        let host = unsafe { result::malloc_host(bytes, 0) }.unwrap();
        let d = unsafe { result::malloc_sync(bytes) }.unwrap();
        for idle in [false, true] {
            let mut t = [Vec::new(), Vec::new(), Vec::new()];
            for _ in 0..40 {
                if idle {
                    std::thread::sleep(Duration::from_millis(2));
                }
                let t0 = Instant::now();
                // SAFETY: `host` and `d` hold `bytes`; synchronised below.
                unsafe {
                    sys::cuMemcpyHtoDAsync_v2(d, host, bytes, up.cu_stream())
                        .result()
                        .unwrap();
                }
                let t1 = Instant::now();
                unsafe { sys::cuEventRecord(ev, up.cu_stream()).result().unwrap() };
                let t2 = Instant::now();
                unsafe {
                    sys::cuStreamWaitEvent(other.cu_stream(), ev, 0)
                        .result()
                        .unwrap()
                };
                let t3 = Instant::now();
                t[0].push((t1 - t0).as_nanos() as u64);
                t[1].push((t2 - t1).as_nanos() as u64);
                t[2].push((t3 - t2).as_nanos() as u64);
                other.synchronize().unwrap();
            }
            let med = |v: &mut Vec<u64>| {
                v.sort();
                v[v.len() / 2] as f64 / 1e3
            };
            println!(
                "upload {:>6} B {}: cuMemcpyHtoDAsync {:.1} us, cuEventRecord {:.1} us, cuStreamWaitEvent {:.1} us (medians of 40)",
                bytes,
                if idle { "after 2 ms idle" } else { "back to back  " },
                med(&mut t[0]),
                med(&mut t[1]),
                med(&mut t[2])
            );
        }
        // SAFETY: ours, nothing in flight (synchronised above).
        unsafe {
            result::free_sync(d).unwrap();
            result::free_host(host).unwrap();
        }
    }
    // The copier's own table build (fill of trivial pairs, then upload).
    let copier = nixl_bounce::copy::ipc::IpcCopier::for_device(dev.ordinal(), 2).unwrap();
    for n in [512usize, 32768] {
        for idle in [false, true] {
            let mut up = Vec::new();
            for _ in 0..40 {
                if idle {
                    std::thread::sleep(Duration::from_millis(2));
                }
                let t = copier
                    .prepare_pairs(n, 4096, Instant::now(), |out| {
                        out.fill(1 << 20);
                        Ok(true)
                    })
                    .unwrap()
                    .unwrap();
                up.push(t.times.upload);
            }
            up.sort();
            println!(
                "IpcCopier table of {n} pairs {}: upload {:.1} us (median of 40)",
                if idle {
                    "after 2 ms idle"
                } else {
                    "back to back"
                },
                up[20] as f64 / 1e3
            );
        }
    }
}
