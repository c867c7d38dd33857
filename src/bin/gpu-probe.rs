//! GPU sanity check in one command: device, compute capability, NVRTC
//! compile time of the copy kernel, and gather/scatter throughput of
//! 16384 x 4 KiB scattered blocks (as 16384 single runs and as one merged
//! strided run, both argument modes), verified byte-exact.
//!
//! Exits 0 with a `SKIP:` line on machines without CUDA; non-zero on any
//! CUDA error or mismatch. Usage:
//! `gpu-probe [--iters N] [--blocks N] [--size BYTES] [--tile BYTES] [--max-blocks N]`
//! (`--tile` (a power of two, 16..=2^30) and `--max-blocks` tune the
//! kernel: see `CopyOptions`). Each line also gives the host part of a copy
//! (table fill, upload and launch enqueued, i.e. `start`); the rest is the
//! GPU plus the completion wait.

use std::process::ExitCode;
use std::time::{Duration, Instant};

use nixl_bounce::copy::cuda::{CopyOptions, CudaCopy, CudaRuntime, ExecPool, DEFAULT_TILE_BYTES};
use nixl_bounce::copy::Direction;
use nixl_bounce::dataplane::vram::DeviceArena;
use nixl_bounce::proto::Run;

/// The probe's options (`gpu-probe --help`).
#[derive(clap::Parser)]
#[command(
    name = "gpu-probe",
    about = "GPU sanity check: the copy kernel's compile and throughput, verified"
)]
struct Opts {
    /// Timed copies per case.
    #[arg(long, default_value_t = 20, value_parser = clap::value_parser!(u64).range(1..))]
    iters: u64,
    /// Scattered blocks per copy.
    #[arg(long, default_value_t = 16384, value_parser = clap::value_parser!(u64).range(1..))]
    blocks: u64,
    /// Bytes per block.
    #[arg(long, default_value_t = 4096, value_parser = clap::value_parser!(u64).range(1..))]
    size: u64,
    /// Bytes per warp's tile (a power of two, 16..=2^30).
    #[arg(long, default_value_t = DEFAULT_TILE_BYTES)]
    tile: u64,
    /// Cap on the grid's blocks (default: the kernel's own choice).
    #[arg(long, value_parser = clap::value_parser!(u32).range(1..))]
    max_blocks: Option<u32>,
}

fn median(mut v: Vec<Duration>) -> Duration {
    v.sort();
    v[v.len() / 2]
}

fn main() -> ExitCode {
    match run() {
        Ok(()) => ExitCode::SUCCESS,
        Err(e) => {
            eprintln!("gpu-probe: FAILED: {e}");
            ExitCode::FAILURE
        }
    }
}

fn run() -> Result<(), String> {
    let o = <Opts as clap::Parser>::parse();
    let as_usize =
        |v: u64, what: &str| usize::try_from(v).map_err(|_| format!("{what} {v} is too large"));
    let iters = as_usize(o.iters, "--iters")?;
    let n = as_usize(o.blocks, "--blocks")?;
    let b = as_usize(o.size, "--size")?;
    let (tile, max_blocks) = (o.tile, o.max_blocks);
    let rt = match CudaRuntime::probe() {
        Ok(rt) => rt,
        Err(e) => {
            println!("SKIP: no CUDA driver or device ({e})");
            return Ok(());
        }
    };
    println!(
        "driver CUDA {}.{}, {} device(s)",
        rt.driver_version() / 1000,
        rt.driver_version() % 1000 / 10,
        rt.device_count()
    );
    let dev = rt.device(0)?;
    let (ma, mi) = dev.compute_capability();
    println!(
        "device 0: {} (sm_{ma}{mi}, {} SMs)",
        dev.name(),
        dev.sm_count()
    );
    let k = dev.copy_kernel()?;
    println!(
        "copy kernel: {:?}, compile+load {:.1} ms, {} blocks/SM, max grid {}",
        k.target,
        k.compile_time.as_secs_f64() * 1e3,
        k.blocks_per_sm,
        k.max_grid
    );
    println!(
        "nvtx: {}",
        if nixl_bounce::nvtx::enabled() {
            "library found"
        } else {
            "no library (ranges are no-ops)"
        }
    );

    let total = n.checked_mul(b).ok_or("size overflows")?;
    let region = DeviceArena::new(&dev, total)?;
    let src = DeviceArena::new(&dev, 2 * total)?;
    let dst = DeviceArena::new(&dev, 2 * total)?;
    let pattern: Vec<u8> = (0..2 * total)
        .map(|i| (i as u64).wrapping_mul(0x9E37_79B9) as u8 ^ (i >> 12) as u8)
        .collect();
    src.write(0, &pattern)?;
    let span = region.span(0, total).ok_or("region span")?;
    let (bu, nu) = (b as u64, n as u64);
    let merged_g = vec![Run {
        region_offset: 0,
        addr: src.base(),
        len: bu,
        count: n as u32,
        region_stride: bu,
        addr_stride: 2 * bu,
    }];
    let merged_s = vec![Run {
        addr: dst.base() + bu,
        ..merged_g[0]
    }];
    let single_g: Vec<Run> = (0..nu)
        .map(|i| Run::single(i * bu, src.base() + 2 * i * bu, bu))
        .collect();
    let single_s: Vec<Run> = (0..nu)
        .map(|i| Run::single(i * bu, dst.base() + (2 * i + 1) * bu, bu))
        .collect();

    // (label, zero-copy arguments, batched memcpy instead of the kernel)
    for (label, zero_copy, batch) in [
        ("kernel, zero-copy table", true, false),
        ("kernel, uploaded table", false, false),
        ("cuMemcpyBatchAsync", true, true),
    ] {
        let opts = CopyOptions {
            tile_bytes: tile,
            max_blocks,
            batch_memcpy: batch,
            ..Default::default()
        };
        let engine = CudaCopy::with_options(ExecPool::new(dev.clone(), 2, zero_copy)?, opts)?;
        for (name, g, s) in [
            ("single runs", &single_g, &single_s),
            ("merged run", &merged_g, &merged_s),
        ] {
            dst.fill(0xAB)?;
            // Per copy: the whole call (plan + upload + launch + wait) and
            // its host part (`start`: table fill, upload and launch enqueued).
            let (mut tg, mut ts, mut hg, mut hs) = (Vec::new(), Vec::new(), Vec::new(), Vec::new());
            let mut failed = None;
            let timed = |d: Direction, runs: &[Run]| {
                let t = Instant::now();
                let p = engine.start(d, span, runs)?;
                let host = t.elapsed();
                p.wait()?;
                Ok::<_, nixl_bounce::copy::CopyError>((t.elapsed(), host))
            };
            for _ in 0..iters + 2 {
                match timed(Direction::Gather, g) {
                    Ok((all, host)) => {
                        tg.push(all);
                        hg.push(host);
                    }
                    Err(e) => {
                        failed = Some(e);
                        break;
                    }
                }
                match timed(Direction::Scatter, s) {
                    Ok((all, host)) => {
                        ts.push(all);
                        hs.push(host);
                    }
                    Err(e) => {
                        failed = Some(e);
                        break;
                    }
                }
            }
            match failed {
                // The experimental batched memcpy may be missing; the kernel may not fail.
                Some(e) if batch && e.quiesced => {
                    println!("{label}: unavailable ({e})");
                    break;
                }
                Some(e) => return Err(format!("{label}, {name}: {e}")),
                None => {}
            }
            // The first two are warm-up.
            let (g50, s50) = (median(tg.split_off(2)), median(ts.split_off(2)));
            let (hg50, hs50) = (median(hg.split_off(2)), median(hs.split_off(2)));
            let mut got = vec![0u8; 2 * total];
            dst.read(0, &mut got)?;
            for i in 0..n {
                let kept = &got[2 * i * b..(2 * i + 1) * b];
                let moved = &got[(2 * i + 1) * b..(2 * i + 2) * b];
                if kept.iter().any(|&x| x != 0xAB) || moved != &pattern[2 * i * b..(2 * i + 1) * b]
                {
                    return Err(format!(
                        "{label}, {name}: block {i} is wrong after gather+scatter"
                    ));
                }
            }
            let gbs = |d: Duration| total as f64 / d.as_secs_f64() / 1e9;
            println!(
                "{n} x {b} B, {name:11}, {label:23}: gather p50 {:7.1} us ({:6.0} GB/s), scatter p50 {:7.1} us ({:6.0} GB/s), byte-exact; host part (fill+upload+launch) gather {:6.1} us, scatter {:6.1} us",
                g50.as_secs_f64() * 1e6,
                gbs(g50),
                s50.as_secs_f64() * 1e6,
                gbs(s50),
                hg50.as_secs_f64() * 1e6,
                hs50.as_secs_f64() * 1e6,
            );
        }
    }
    println!("gpu-probe: OK");
    Ok(())
}
