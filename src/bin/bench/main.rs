//! `bench`: BOUNCE versus UCX, side by side in one process.
//!
//! Two NIXL agents per variant (initiator and target, one backend each) move
//! the same scattered DRAM blocks of the same two buffers, for every
//! configuration of a sweep (descriptor count x descriptor size x requests in
//! flight). Output: a table on stdout and, with `--json`, every row plus the
//! run's metadata; `scripts/plot_bench.py` draws the JSON. See `--help`,
//! `scripts/bench.sh` (set-up + run + plot) and `docs/benchmarks.md`.
//!
//! Layout: [`cli`] (options), [`mem`] (the buffers; DRAM now, a VRAM kind
//! slots in behind the same trait), [`variant`] (live agent pairs), [`run`]
//! (one configuration through one variant), [`report`] (rows, table, JSON),
//! [`sysinfo`] (machine metadata, per-thread CPU time).

mod cli;
mod mem;
mod report;
mod run;
mod sysinfo;
mod variant;

use std::collections::BTreeMap;
use std::path::Path;
use std::process::ExitCode;
use std::time::{Duration, Instant};

use cli::{Options, Parsed, VariantSpec};
use mem::BenchMemory;
use report::{Meta, Row, VariantInfo};
use run::{Failure, Shape};
use variant::Variant;

const ROOT: &str = env!("CARGO_MANIFEST_DIR");

fn main() -> ExitCode {
    let args: Vec<String> = std::env::args().collect();
    let o = match cli::parse(args.iter().skip(1).cloned()) {
        Ok(Parsed::Run(o)) => o,
        Ok(Parsed::Help) => {
            println!("{}", cli::USAGE);
            return ExitCode::SUCCESS;
        }
        Err(e) => {
            eprintln!("bench: {e}");
            return ExitCode::from(2);
        }
    };
    match run_all(&o, &args) {
        Ok(true) => ExitCode::SUCCESS,
        Ok(false) => ExitCode::from(1),
        Err(e) => {
            eprintln!("bench: {e}");
            ExitCode::from(1)
        }
    }
}

/// The sweep, in the order it runs: sizes, then counts, then in-flight.
fn shapes(o: &Options) -> Vec<Shape> {
    let mut v = Vec::new();
    for &size in &o.sizes {
        for &count in &o.counts {
            for &inflight in &o.inflight {
                v.push(Shape {
                    count,
                    size,
                    inflight,
                });
            }
        }
    }
    v
}

fn progress(o: &Options, msg: &str) {
    if !o.quiet {
        eprintln!("[bench] {msg}");
    }
}

fn shell_quote(a: &str) -> String {
    if !a.is_empty()
        && a.chars()
            .all(|c| c.is_ascii_alphanumeric() || "-_=.,:/[]@%+".contains(c))
    {
        a.to_string()
    } else {
        format!("'{}'", a.replace('\'', r"'\''"))
    }
}

fn meta(o: &Options, args: &[String]) -> Meta {
    let (mut git_commit, mut git_dirty) = sysinfo::git_commit(ROOT);
    if git_commit.is_none() {
        // A binary run away from its source tree (e.g. carried to another
        // machine) can be told its commit.
        git_commit = std::env::var("NIXL_BOUNCE_BENCH_COMMIT").ok();
        git_dirty = git_commit.as_ref().map(|_| false);
    }
    let machine = sysinfo::machine();
    Meta {
        tool: "nixl-bounce bench",
        schema: 1,
        command: args.iter().map(|a| shell_quote(a)).collect::<Vec<_>>().join(" "),
        args: args.to_vec(),
        git_commit,
        git_dirty,
        started_utc: sysinfo::utc_now(),
        finished_utc: None,
        setup: format!(
            "{} {}, two agents per variant in ONE process, {} CPU cores, control and data over loopback",
            o.mem.name().to_uppercase(),
            o.op.name().to_uppercase(),
            machine.nproc
        ),
        machine,
        preset: o.preset.into(),
        op: o.op.name().into(),
        mem: o.mem.name().into(),
        counts: o.counts.clone(),
        sizes: o.sizes.clone(),
        inflight: o.inflight.clone(),
        rounds: o.rounds,
        warmup_batches: o.warmup,
        max_timed_batches: o.iters,
        quiet_below_cores: o.quiet_below,
        min_timed_batches: o.min_iters,
        config_budget_s: o.config_budget.as_secs_f64(),
        timeout_s: o.timeout.as_secs_f64(),
        poll: o.poll.describe(),
        seed: o.seed,
        variants: Vec::new(),
        bounce_defaults: nixl_bounce::config::Config::describe()
            .into_iter()
            .map(|s| (s.key.to_string(), s.default))
            .collect(),
        env: sysinfo::relevant_env(),
        foreign_cpu_cores_at_start: None,
        load_average_at_start: None,
        plugin_dir: std::env::var("NIXL_PLUGIN_DIR").ok(),
    }
}

/// Which buffer each agent registers: the initiator holds the source of a
/// WRITE and the destination of a READ.
fn by_agent<'a>(
    o: &Options,
    src: &'a dyn BenchMemory,
    dst: &'a dyn BenchMemory,
) -> (&'a dyn BenchMemory, &'a dyn BenchMemory) {
    match o.op {
        cli::Op::Write => (src, dst),
        cli::Op::Read => (dst, src),
    }
}

/// Opens `spec` once: checks its parameters, records what its backend was
/// created with and what its agents cost while idle, then closes it.
fn probe(
    o: &Options,
    spec: &VariantSpec,
    src: &dyn BenchMemory,
    dst: &dyn BenchMemory,
) -> (VariantInfo, Result<(), String>) {
    let t = Instant::now();
    let mut info = VariantInfo {
        label: spec.label(),
        backend: spec.backend.plugin().into(),
        contiguous: spec.contiguous,
        params_given: spec.params.iter().cloned().collect(),
        params_effective: BTreeMap::new(),
        setup_s: None,
        idle_cpu_cores: None,
        idle_cpu_by_thread: BTreeMap::new(),
        error: None,
    };
    let (init_mem, target_mem) = by_agent(o, src, dst);
    let state = match Variant::open(spec, init_mem, target_mem) {
        Ok(v) => {
            info.setup_s = Some(t.elapsed().as_secs_f64());
            info.params_effective = v.params.clone();
            let (idle, groups, _) = idle_cpu(Duration::from_millis(500));
            info.idle_cpu_cores = Some(idle);
            info.idle_cpu_by_thread = groups;
            progress(
                o,
                &format!(
                    "{}: agents ready in {:.2} s; idle, they keep {idle:.3} CPU cores busy",
                    info.label,
                    info.setup_s.unwrap_or(0.0)
                ),
            );
            close(v, o.timeout).map(|_| ())
        }
        Err(e) => Err(format!("set-up failed: {e}")),
    };
    if let Err(e) = &state {
        progress(o, &format!("{}: unusable: {e}", info.label));
        info.error = Some(e.clone());
    }
    (info, state)
}

/// How one run of a (configuration, variant) ended, for the variant.
enum RunEnd {
    /// The variant can be used again.
    Reusable,
    /// Its agents were torn down badly or leaked: do not use it again.
    Unusable(String),
    /// Requests were left in flight and the agents leaked: the buffers must
    /// outlive the process.
    Abandoned(String),
}

#[allow(clippy::too_many_arguments)]
/// Runs `shape` once through fresh agents of `spec`, adding what it measured
/// (or why it failed) to `cell`.
fn run_once(
    o: &Options,
    spec: &VariantSpec,
    shape: Shape,
    ids: (u64, u64),
    what: &str,
    cell: &mut Cell,
    src: &mut dyn BenchMemory,
    dst: &mut dyn BenchMemory,
) -> RunEnd {
    let t = Instant::now();
    let (init_mem, target_mem) = by_agent(o, &*src, &*dst);
    let v = match Variant::open(spec, init_mem, target_mem) {
        Ok(v) => v,
        Err(e) => {
            progress(o, &format!("{what}: set-up failed: {e}"));
            cell.failure = Some(("failed", format!("set-up failed: {e}")));
            return RunEnd::Reusable;
        }
    };
    cell.setup_s.push(t.elapsed().as_secs_f64());
    match run::run_shape(o, &v, shape, ids, src, dst) {
        Ok(m) => {
            let r = report::Round::of(&m, shape);
            progress(
                o,
                &format!(
                    "{what}: p50 {:.3} ms, {:.2} GB/s, {} batches, other processes {} cores{}{}",
                    r.p50_ms,
                    r.throughput_gbps,
                    m.batch_ms.len(),
                    r.foreign_cpu_cores
                        .map_or("?".into(), |c| format!("{c:.2}")),
                    if m.verified.is_err() {
                        ", VERIFICATION FAILED"
                    } else {
                        ""
                    },
                    m.bounce
                        .as_ref()
                        .map(|b| format!(", bounce path {}", b.used))
                        .unwrap_or_default()
                ),
            );
            cell.rounds.push(r);
            match &mut cell.measured {
                Some(acc) => acc.merge(m),
                None => cell.measured = Some(m),
            }
        }
        Err(Failure::Setup(e)) => {
            progress(o, &format!("{what}: failed: {e}"));
            cell.failure = Some(("failed", e));
        }
        Err(Failure::Batch(e)) => {
            progress(o, &format!("{what}: failed: {e}; variant abandoned"));
            // Requests may still be in flight: never reuse or tear down these
            // agents (teardown could hang, or free memory a transfer still
            // writes to).
            std::mem::forget(v);
            cell.failure = Some(("failed", e.clone()));
            return RunEnd::Abandoned(format!("abandoned after an earlier failure: {e}"));
        }
    }
    match close(v, o.timeout) {
        Ok(d) => {
            cell.teardown_s.push(d.as_secs_f64());
            RunEnd::Reusable
        }
        Err(e) => {
            progress(o, &format!("{what}: {e}"));
            cell.failure = Some(("failed", e.clone()));
            RunEnd::Unusable(e)
        }
    }
}

/// Tears a variant down on a helper thread, waiting at most `timeout`. A
/// teardown that does not finish is left running (the thread is detached)
/// and reported.
fn close(v: Variant, timeout: Duration) -> Result<Duration, String> {
    let label = v.label.clone();
    let t = Instant::now();
    let (tx, rx) = std::sync::mpsc::channel();
    std::thread::Builder::new()
        .name("bench-teardown".into())
        .spawn(move || {
            drop(v);
            let _ = tx.send(());
        })
        .map_err(|e| format!("cannot start the teardown thread: {e}"))?;
    match rx.recv_timeout(timeout) {
        Ok(()) => Ok(t.elapsed()),
        Err(_) => Err(format!(
            "teardown of {label}'s agents did not finish within {timeout:?}; variant abandoned"
        )),
    }
}

fn run_all(o: &Options, args: &[String]) -> Result<bool, String> {
    let started = Instant::now();
    nixl_bounce::harness::preload_capi(Some(Path::new(ROOT))).map_err(|e| {
        format!("NIXL runtime not found: {e}\n(run scripts/bench.sh, which sets it up)")
    })?;
    sysinfo::claim_new_threads("main");
    let mut meta = meta(o, args);
    let all = shapes(o);
    let fits = |s: &Shape| s.buffer_len() <= o.max_buffer;
    let buffer_len = all
        .iter()
        .filter(|s| fits(s))
        .map(Shape::buffer_len)
        .max()
        .unwrap_or(4096);
    progress(
        o,
        &format!(
            "{} {} x {} configurations x {} variants; two buffers of {:.1} MiB",
            meta.op.to_uppercase(),
            meta.mem.to_uppercase(),
            all.len(),
            o.variants.len(),
            buffer_len as f64 / (1 << 20) as f64
        ),
    );
    let mut src = mem::allocate(o.mem, buffer_len)?;
    let mut dst = mem::allocate(o.mem, buffer_len)?;

    // Probe: open every variant once to check its parameters, record what
    // its backend was created with and what its agents cost while idle, and
    // close it again. Each row then gets fresh agents, so that no other
    // variant's idle threads run beside it.
    let mut usable: Vec<Result<(), String>> = Vec::new();
    for spec in &o.variants {
        let (info, state) = probe(o, spec, src.as_ref(), dst.as_ref());
        meta.variants.push(info);
        usable.push(state);
    }
    let (_, _, foreign) = idle_cpu(Duration::from_millis(1000));
    meta.foreign_cpu_cores_at_start = foreign;
    meta.load_average_at_start = sysinfo::load_average();
    if let Some(f) = foreign.filter(|f| *f > 0.2) {
        progress(
            o,
            &format!(
                "warning: other processes keep {f:.2} CPU cores busy (load average {}); results will be noisy",
                meta.load_average_at_start.map_or("?".into(), |l| l.to_string())
            ),
        );
    }

    // Rounds repeat the whole sweep, so that each variant's runs of a
    // configuration are spread over time, interleaved with the others'
    // (fair under drifting load); each run gets fresh agents.
    let nv = o.variants.len();
    let mut cells: Vec<Cell> = (0..all.len() * nv).map(|_| Cell::default()).collect();
    let mut model_rows: Vec<Vec<Row>> = vec![Vec::new(); all.len()];
    let mut abandoned = false;
    let save = |meta: &Meta, cells: &[Cell], model_rows: &[Vec<Row>]| -> Result<Vec<Row>, String> {
        let rows = build_rows(o, &all, cells, model_rows);
        if let Some(p) = &o.json {
            report::write_json(p, meta, &rows)?;
        }
        Ok(rows)
    };
    for round in 0..o.rounds {
        for (shape_id, shape) in all.iter().copied().enumerate() {
            for (variant_id, spec) in o.variants.iter().enumerate() {
                let cell = &mut cells[shape_id * nv + variant_id];
                if cell.failure.is_some() {
                    continue;
                }
                if !fits(&shape) {
                    cell.failure = Some((
                        "skipped",
                        format!(
                            "needs {} MiB per side, above --max-buffer {} MiB",
                            shape.buffer_len() >> 20,
                            o.max_buffer >> 20
                        ),
                    ));
                    continue;
                }
                if started.elapsed() > o.budget {
                    if cell.measured.is_none() {
                        cell.failure = Some((
                            "skipped",
                            format!("--budget of {:.0} s spent", o.budget.as_secs_f64()),
                        ));
                    }
                    continue;
                }
                if let Err(why) = &usable[variant_id] {
                    cell.failure = Some(("failed", why.clone()));
                    continue;
                }
                if let Some(max) = o.wait_quiet {
                    cell.quiet = Some(wait_quiet(max, o.quiet_below));
                }
                let what = format!(
                    "round {}/{}: {:<14} {:>5} x {:>6} B x {:>3}",
                    round + 1,
                    o.rounds,
                    spec.label(),
                    shape.count,
                    shape.size,
                    shape.inflight
                );
                let ids = (shape_id as u64, variant_id as u64);
                match run_once(o, spec, shape, ids, &what, cell, src.as_mut(), dst.as_mut()) {
                    RunEnd::Reusable => {}
                    RunEnd::Unusable(why) => usable[variant_id] = Err(why),
                    RunEnd::Abandoned(why) => {
                        abandoned = true;
                        usable[variant_id] = Err(why);
                    }
                }
                save(&meta, &cells, &model_rows)?;
            }
            if o.model
                && round == 0
                && shape.inflight == 1
                && fits(&shape)
                && started.elapsed() <= o.budget
            {
                let (gather, scatter) =
                    run::memcpy_model(o, shape, shape_id as u64, src.as_ref(), dst.as_mut());
                for (name, samples) in [("gather", gather), ("scatter", scatter)] {
                    let row = Row::new(o, &format!("memcpy[{name}]"), "memcpy", name, shape)
                        .timed(o.warmup, &samples, &samples);
                    progress(o, &describe(&row));
                    model_rows[shape_id].push(row);
                }
                save(&meta, &cells, &model_rows)?;
            }
        }
    }

    meta.finished_utc = Some(sysinfo::utc_now());
    let rows = save(&meta, &cells, &model_rows)?;
    println!();
    report::print_table(&rows, o.quiet_below, &mut std::io::stdout()).map_err(|e| e.to_string())?;
    if let Some(p) = &o.json {
        println!("\njson: {}", p.display());
    }
    if abandoned {
        // The abandoned variants were leaked; so must the buffers they may
        // still write to.
        std::mem::forget(src);
        std::mem::forget(dst);
    }
    progress(
        o,
        &format!("done in {:.1} s", started.elapsed().as_secs_f64()),
    );
    Ok(rows.iter().all(Row::ok))
}

/// What one (configuration, variant) gathered over the rounds.
#[derive(Default)]
struct Cell {
    measured: Option<run::Measured>,
    rounds: Vec<report::Round>,
    setup_s: Vec<f64>,
    teardown_s: Vec<f64>,
    /// Last `--wait-quiet`: seconds waited, other processes' CPU cores then.
    quiet: Option<(f64, Option<f64>)>,
    /// ("failed" | "skipped", why); a failed cell is not run again.
    failure: Option<(&'static str, String)>,
}

/// The rows in sweep order (variants, then the memcpy model rows).
fn build_rows(o: &Options, all: &[Shape], cells: &[Cell], model_rows: &[Vec<Row>]) -> Vec<Row> {
    let nv = o.variants.len();
    let mut rows = Vec::new();
    for (shape_id, shape) in all.iter().enumerate() {
        for (variant_id, spec) in o.variants.iter().enumerate() {
            let cell = &cells[shape_id * nv + variant_id];
            let mut row = Row::new(o, &spec.label(), spec.backend.plugin(), &spec.name, *shape);
            if let Some(m) = &cell.measured {
                if o.raw {
                    row.latencies_raw_ms = Some(
                        m.latencies_ms
                            .iter()
                            .map(|x| (x * 1e4).round() / 1e4)
                            .collect(),
                    );
                }
                row = row.measured(m.clone(), &spec.label());
            }
            row.rounds = cell.rounds.clone();
            let mean = |v: &[f64]| (!v.is_empty()).then(|| v.iter().sum::<f64>() / v.len() as f64);
            row.setup_s = mean(&cell.setup_s);
            row.teardown_s = mean(&cell.teardown_s);
            if let Some((waited, foreign)) = cell.quiet {
                row.quiet_wait_s = Some(waited);
                row.foreign_cpu_cores_before = foreign;
            }
            match &cell.failure {
                Some(("skipped", why)) => row = row.skipped(why.clone()),
                Some((_, why)) => row = row.failed(why.clone()),
                None if cell.measured.is_none() => row = row.skipped("not run"),
                None => {}
            }
            rows.push(row);
        }
        rows.extend(model_rows[shape_id].iter().cloned());
    }
    report::add_speedups(&mut rows, o.quiet_below);
    rows
}

fn describe(r: &Row) -> String {
    let what = format!(
        "{:<14} {:>5} x {:>6} B x {:>3}",
        r.label, r.descriptors, r.descriptor_bytes, r.inflight
    );
    match (&r.status[..], &r.latency_ms, r.throughput_gbps) {
        ("ok", Some(l), Some(g)) => format!(
            "{what}: p50 {:.3} ms, p99 {:.3} ms, {g:.2} GB/s, {} batches, other processes {} cores{}{}",
            l.p50,
            l.p99,
            r.timed_batches,
            r.foreign_cpu_cores.map_or("?".into(), |c| format!("{c:.2}")),
            match r.verified {
                Some(false) => ", VERIFICATION FAILED",
                _ => "",
            },
            r.bounce_path.as_ref().map(|b| format!(", bounce path {b}")).unwrap_or_default()
        ),
        (status, _, _) => format!("{what}: {status}: {}", r.error.as_deref().unwrap_or("")),
    }
}

/// Waits until other processes keep fewer than `quiet_below` CPU cores busy (seen
/// over 0.5 s), at most `max`. Returns the seconds waited and the last
/// reading.
fn wait_quiet(max: Duration, quiet_below: f64) -> (f64, Option<f64>) {
    let t = Instant::now();
    loop {
        let (_, _, foreign) = idle_cpu(Duration::from_millis(500));
        if foreign.is_none_or(|f| f < quiet_below) || t.elapsed() >= max {
            return ((t.elapsed().as_secs_f64() * 10.0).round() / 10.0, foreign);
        }
    }
}

/// CPU cores kept busy by this process while nothing is transferred, in
/// total and by thread group; and by other processes.
fn idle_cpu(window: Duration) -> (f64, BTreeMap<String, f64>, Option<f64>) {
    let before = sysinfo::CpuSample::take();
    let t = Instant::now();
    std::thread::sleep(window);
    let after = sysinfo::CpuSample::take();
    let wall = t.elapsed().as_nanos() as f64;
    let mut u = sysinfo::CpuUse::default();
    u.add(&before, &after);
    let r3 = |x: f64| (x * 1000.0).round() / 1000.0;
    let groups = u
        .groups
        .iter()
        .map(|(k, ns)| (k.clone(), r3(*ns as f64 / wall)))
        .filter(|(_, c)| *c > 0.0)
        .collect();
    (
        r3(u.process_ns as f64 / wall),
        groups,
        u.foreign_cores(wall).map(r3),
    )
}
