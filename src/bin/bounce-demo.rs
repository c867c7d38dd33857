//! Loopback DRAM demo: two NIXL agents in this process move N scattered
//! descriptors (default 4096 x 4 KiB) through each requested backend
//! (default BOUNCE, then UCX) and print one table row per backend.
//!
//! Run with `scripts/demo.sh [flags]` (sets up the runtime) or
//! `cargo run --release --bin bounce-demo -- [flags]` once set up.

use clap::{Parser, ValueEnum};
use nixl_bounce::harness::*;
use nixl_sys::XferOp;
use std::path::Path;
use std::process::ExitCode;
use std::time::Duration;

/// Move N scattered DRAM descriptors between two agents in one process
/// through each backend and print backend, descriptors, bytes, p50 ms, GB/s,
/// verified, and for BOUNCE the path its engine took (from the plugin's
/// nixl_bounce_stats counters: bounce, or the UCX fallback reasons).
#[derive(Parser)]
#[command(name = "bounce-demo")]
struct Opts {
    /// Descriptors per transfer.
    #[arg(short = 'n', long = "count", default_value = "4096", value_parser = positive)]
    count: usize,
    /// Bytes per descriptor (4096, 4KiB, ...).
    #[arg(short, long, default_value = "4096", value_parser = bytes)]
    size: usize,
    /// Timed transfers per backend.
    #[arg(short, long, default_value = "20", value_parser = positive)]
    iters: usize,
    /// Untimed transfers first.
    #[arg(short, long, default_value = "3", value_parser = whole::<usize>)]
    warmup: usize,
    /// Comma-separated backends.
    #[arg(
        short,
        long,
        value_delimiter = ',',
        default_value = "BOUNCE,UCX",
        value_parser = backend
    )]
    backends: Vec<String>,
    /// The operation.
    #[arg(short, long, value_enum, default_value = "write", ignore_case = true)]
    op: Op,
    /// Backend parameter K=V for backend B (default BOUNCE), repeatable,
    /// e.g. -p num_threads=4 -p UCX:num_threads=4.
    #[arg(short = 'p', long = "param", value_name = "[B:]K=V", value_parser = param)]
    params: Vec<(String, String, String)>,
    /// Layout and pattern seed.
    #[arg(long, default_value = "1", value_parser = whole::<u64>)]
    seed: u64,
}

#[derive(Clone, Copy, PartialEq, Eq, ValueEnum)]
enum Op {
    Write,
    Read,
}

impl Op {
    fn xfer(self) -> XferOp {
        match self {
            Op::Write => XferOp::Write,
            Op::Read => XferOp::Read,
        }
    }
}

/// A backend's name (not empty).
fn backend(s: &str) -> Result<String, String> {
    match s.trim() {
        "" => Err("a backend's name is empty".into()),
        name => Ok(name.to_string()),
    }
}

/// A whole number (`_` separators allowed).
fn whole<T: std::str::FromStr>(s: &str) -> Result<T, String> {
    s.replace('_', "")
        .parse::<T>()
        .map_err(|_| format!("{s:?} is not a whole number"))
}

/// A count above zero.
fn positive(s: &str) -> Result<usize, String> {
    match s.replace('_', "").parse::<usize>() {
        Ok(0) => Err("must be above 0".into()),
        Ok(n) => Ok(n),
        Err(_) => Err(format!("{s:?} is not a number")),
    }
}

/// A byte count above zero: `4096`, `4KiB` (as the backend's parameters).
fn bytes(s: &str) -> Result<usize, String> {
    let n = nixl_bounce::config::parse_bytes(s).map_err(|e| e.to_string())?;
    match usize::try_from(n) {
        Ok(0) => Err("must be above 0".into()),
        Ok(n) => Ok(n),
        Err(_) => Err(format!("{s} does not fit in memory")),
    }
}

/// `[BACKEND:]KEY=VALUE`, the backend BOUNCE when none is named.
fn param(s: &str) -> Result<(String, String, String), String> {
    let (k, v) = s
        .split_once('=')
        .ok_or_else(|| format!("expected [BACKEND:]KEY=VALUE, got {s}"))?;
    let (b, k) = k.split_once(':').unwrap_or(("BOUNCE", k));
    Ok((b.to_string(), k.to_string(), v.to_string()))
}

struct Row {
    backend: String,
    descriptors: usize,
    bytes: usize,
    p50: Option<Duration>,
    verified: Result<(), String>,
    path: String,
}

fn run_backend(o: &Opts, backend: &str) -> Row {
    let bytes = o.count * o.size;
    let mut row = Row {
        backend: backend.to_string(),
        descriptors: o.count,
        bytes,
        p50: None,
        verified: Err("not run".into()),
        path: "-".into(),
    };
    let params: Vec<(&str, &str)> = o
        .params
        .iter()
        .filter(|(b, _, _)| b == backend)
        .map(|(_, k, v)| (k.as_str(), v.as_str()))
        .collect();
    let res = (|| -> Result<Duration, String> {
        let len = blocks_for(o.count) * o.size;
        let mut pair = LocalPair::new(backend, &params, len)?;
        let plan = Plan::standard(o.count, o.size, o.seed);
        pair.init.buf.fill_pattern(o.seed.wrapping_mul(2) + 1);
        pair.target.buf.fill_pattern(o.seed.wrapping_mul(2) + 2);
        let init_before = pair.init.buf.as_slice().to_vec();
        let target_before = pair.target.buf.as_slice().to_vec();
        let target = pair.target.node.name.clone();
        let req = pair.init.node.create_xfer(
            o.op.xfer(),
            &plan,
            pair.init.buf.addr(),
            pair.target.buf.addr(),
            &target,
            None,
        )?;
        let timeout = wait_timeout();
        for _ in 0..o.warmup {
            pair.init.node.post_and_wait(&req, timeout)?;
        }
        let mut times = Vec::with_capacity(o.iters);
        for _ in 0..o.iters {
            times.push(pair.init.node.post_and_wait(&req, timeout)?);
        }
        drop(req);
        times.sort();
        let p50 = times[times.len() / 2];
        // Every repetition moves the same bytes, so the final state must be
        // exactly one transfer's result.
        let (dst_after, dst_before, src_before) = match o.op {
            Op::Write => (pair.target.buf.as_slice(), &target_before, &init_before),
            Op::Read => (pair.init.buf.as_slice(), &init_before, &target_before),
        };
        row.verified = plan
            .verify(dst_after, dst_before, src_before)
            .and_then(|_| pair.init.buf.check_guards())
            .and_then(|_| pair.target.buf.check_guards());
        if backend == "BOUNCE" {
            row.path = bounce_path(&pair.init.node.name);
        }
        Ok(p50)
    })();
    match res {
        Ok(p50) => row.p50 = Some(p50),
        Err(e) => row.verified = Err(e),
    }
    row
}

/// Which path the initiator's BOUNCE engine took, from its counters.
fn bounce_path(agent: &str) -> String {
    match nixl_bounce::stats::plugin_stats(agent) {
        Err(e) => format!("? ({e})"),
        Ok(s) => {
            let get = |k: &str| s.counters.get(k).copied().unwrap_or(0);
            let (arena, cma) = (get("bounce_submitted"), get("cma_submitted"));
            let fallbacks: Vec<String> = s
                .counters
                .iter()
                .filter(|(k, v)| k.starts_with("fallback_") && **v > 0)
                .map(|(k, v)| format!("{}={v}", k.trim_start_matches("fallback_")))
                .collect();
            let mut paths = Vec::new();
            if cma > 0 {
                paths.push(format!("CMA ({cma} requests)"));
            }
            if arena > 0 {
                paths.push(format!("bounce arena ({arena} requests)"));
            }
            if !fallbacks.is_empty() {
                paths.push(format!("UCX fallback: {}", fallbacks.join(",")));
            }
            if paths.is_empty() {
                "UCX (no transfer routed)".into()
            } else {
                paths.join(" + ")
            }
        }
    }
}

fn main() -> ExitCode {
    let o = Opts::parse();
    let root = Path::new(env!("CARGO_MANIFEST_DIR"));
    if let Err(e) = preload_capi(Some(root)) {
        eprintln!(
            "bounce-demo: NIXL runtime not found: {e}\n(run scripts/demo.sh, which sets it up)"
        );
        return ExitCode::from(1);
    }
    let op = match o.op {
        Op::Write => "WRITE",
        Op::Read => "READ",
    };
    eprintln!(
        "bounce-demo: {op} of {} x {} B scattered descriptors, DRAM -> DRAM, two agents in one process; \
         {} warm-up + {} timed transfers per backend{}",
        o.count,
        o.size,
        o.warmup,
        o.iters,
        if o.params.is_empty() {
            String::new()
        } else {
            let ps: Vec<String> = o.params.iter().map(|(b, k, v)| format!("{b}:{k}={v}")).collect();
            format!("; params {}", ps.join(" "))
        }
    );
    let rows: Vec<Row> = o.backends.iter().map(|b| run_backend(&o, b)).collect();

    println!(
        "{:<8} {:>11} {:>12} {:>9} {:>8}  {:<8}  path",
        "backend", "descriptors", "bytes", "p50 ms", "GB/s", "verified"
    );
    let mut ok = true;
    for r in &rows {
        let (ms, gbs) = match r.p50 {
            Some(t) => (
                format!("{:.3}", t.as_secs_f64() * 1e3),
                format!("{:.2}", r.bytes as f64 / t.as_secs_f64() / 1e9),
            ),
            None => ("-".into(), "-".into()),
        };
        let (v, why) = match &r.verified {
            Ok(()) => ("yes".to_string(), String::new()),
            Err(e) => {
                ok = false;
                ("NO".to_string(), e.clone())
            }
        };
        println!(
            "{:<8} {:>11} {:>12} {:>9} {:>8}  {:<8}  {}",
            r.backend, r.descriptors, r.bytes, ms, gbs, v, r.path
        );
        if !why.is_empty() {
            println!("         {}: {why}", r.backend);
        }
    }
    if ok {
        ExitCode::SUCCESS
    } else {
        ExitCode::from(1)
    }
}
