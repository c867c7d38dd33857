//! Loopback DRAM demo: two NIXL agents in this process move N scattered
//! descriptors (default 4096 x 4 KiB) through each requested backend
//! (default BOUNCE, then UCX) and print one table row per backend.
//!
//! Run with `scripts/demo.sh [flags]` (sets up the runtime) or
//! `cargo run --release --bin bounce-demo -- [flags]` once set up.

use nixl_bounce::harness::*;
use nixl_sys::XferOp;
use std::path::Path;
use std::process::ExitCode;
use std::time::Duration;

const USAGE: &str = "\
bounce-demo: move N scattered DRAM descriptors between two agents in one
process through each backend and print backend, descriptors, bytes, p50 ms,
GB/s, verified, and for BOUNCE the path its engine took (from the plugin's
nixl_bounce_stats counters: bounce, or the UCX fallback reasons).

Options:
  -n, --count N        descriptors per transfer (default 4096)
  -s, --size BYTES     bytes per descriptor (default 4096)
  -i, --iters K        timed transfers per backend (default 20)
  -w, --warmup K       untimed transfers first (default 3)
  -b, --backends LIST  comma-separated backends (default BOUNCE,UCX)
  -o, --op OP          write or read (default write)
  -p, --param [B:]K=V  backend parameter K=V for backend B (default BOUNCE),
                       repeatable, e.g. -p num_threads=4 -p UCX:num_threads=4
      --seed S         layout/pattern seed (default 1)
  -h, --help           this text";

struct Opts {
    count: usize,
    size: usize,
    iters: usize,
    warmup: usize,
    backends: Vec<String>,
    op: XferOp,
    params: Vec<(String, String, String)>,
    seed: u64,
}

fn parse() -> Result<Opts, String> {
    let mut o = Opts {
        count: 4096,
        size: 4096,
        iters: 20,
        warmup: 3,
        backends: vec!["BOUNCE".into(), "UCX".into()],
        op: XferOp::Write,
        params: vec![],
        seed: 1,
    };
    let mut args = std::env::args().skip(1);
    while let Some(a) = args.next() {
        let (flag, inline) = match a.split_once('=') {
            Some((f, v)) if f.starts_with("--") => (f.to_string(), Some(v.to_string())),
            _ => (a.clone(), None),
        };
        let mut val = |name: &str| -> Result<String, String> {
            inline
                .clone()
                .or_else(|| args.next())
                .ok_or_else(|| format!("{name} needs a value"))
        };
        let num = |s: String, name: &str| -> Result<usize, String> {
            s.replace('_', "")
                .parse::<usize>()
                .map_err(|_| format!("{name}: not a number: {s}"))
        };
        match flag.as_str() {
            "-h" | "--help" => {
                println!("{USAGE}");
                std::process::exit(0);
            }
            "-n" | "--count" => o.count = num(val(&flag)?, &flag)?,
            "-s" | "--size" => o.size = num(val(&flag)?, &flag)?,
            "-i" | "--iters" => o.iters = num(val(&flag)?, &flag)?,
            "-w" | "--warmup" => o.warmup = num(val(&flag)?, &flag)?,
            "--seed" => o.seed = num(val(&flag)?, &flag)? as u64,
            "-b" | "--backends" => {
                o.backends = val(&flag)?
                    .split(',')
                    .map(|s| s.trim().to_string())
                    .filter(|s| !s.is_empty())
                    .collect()
            }
            "-o" | "--op" => {
                o.op = match val(&flag)?.to_ascii_lowercase().as_str() {
                    "write" => XferOp::Write,
                    "read" => XferOp::Read,
                    other => return Err(format!("--op: expected write or read, got {other}")),
                }
            }
            "-p" | "--param" => {
                let arg = val(&flag)?;
                let (k, v) = arg
                    .split_once('=')
                    .ok_or_else(|| format!("--param: expected [BACKEND:]KEY=VALUE, got {arg}"))?;
                let (b, k) = k.split_once(':').unwrap_or(("BOUNCE", k));
                o.params.push((b.to_string(), k.to_string(), v.to_string()));
            }
            other => return Err(format!("unknown argument {other}\n\n{USAGE}")),
        }
    }
    if o.count == 0 || o.size == 0 || o.iters == 0 {
        return Err("--count, --size and --iters must be > 0".into());
    }
    if o.backends.is_empty() {
        return Err("--backends is empty".into());
    }
    Ok(o)
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
            o.op,
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
            XferOp::Write => (pair.target.buf.as_slice(), &target_before, &init_before),
            XferOp::Read => (pair.init.buf.as_slice(), &init_before, &target_before),
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
    let o = match parse() {
        Ok(o) => o,
        Err(e) => {
            eprintln!("bounce-demo: {e}");
            return ExitCode::from(2);
        }
    };
    let root = Path::new(env!("CARGO_MANIFEST_DIR"));
    if let Err(e) = preload_capi(Some(root)) {
        eprintln!(
            "bounce-demo: NIXL runtime not found: {e}\n(run scripts/demo.sh, which sets it up)"
        );
        return ExitCode::from(1);
    }
    let op = match o.op {
        XferOp::Write => "WRITE",
        XferOp::Read => "READ",
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
