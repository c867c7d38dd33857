//! `bounce-vram bench`: post to completion, BOUNCE beside UCX.

use super::*;

#[derive(serde::Serialize)]
pub(super) struct Row {
    pub(super) label: String,
    pub(super) backend: String,
    pub(super) descriptors: usize,
    pub(super) size: usize,
    pub(super) inflight: usize,
    pub(super) iterations: usize,
    pub(super) p50_ms: f64,
    pub(super) p90_ms: f64,
    pub(super) p99_ms: f64,
    pub(super) gbps: f64,
    /// Accelerated (peer-mapped or bounce), as older JSON files say.
    pub(super) bounce_path: bool,
    pub(super) path: Path,
    /// Median time to prepare the request (`createXferReq`), not in p50.
    pub(super) prep_p50_ms: f64,
}

pub(super) fn percentile(sorted: &[f64], q: f64) -> f64 {
    if sorted.is_empty() {
        return f64::NAN;
    }
    sorted[((sorted.len() - 1) as f64 * q).round() as usize]
}

pub(super) fn run_bench(args: &Args) -> bool {
    let mut init = match Initiator::new(args) {
        Ok(i) => i,
        Err(e) => die(e),
    };
    let mut rows = Vec::new();
    for &size in &args.sizes {
        for &n in &args.counts {
            if n * size * 2 > args.buffer {
                eprintln!("skip {n} x {size}: buffer too small");
                continue;
            }
            if let Err(e) = init.checked_write(n, size, 1000 + n as u64, false, args) {
                die(format!("{n} x {size}: verification failed: {e}"));
            }
            let slots = args.buffer / size;
            let p = plan(n, size, slots, 0, 5000 + n as u64, false);
            let before = plugin_counters(&init.name);
            let target_before = target_counters(&mut init.target);
            let mut times = Vec::new();
            let mut preps = Vec::new();
            let mut kept: Option<XferRequest> = None;
            for _ in 0..args.iters {
                if args.gap_us > 0 {
                    std::thread::sleep(Duration::from_micros(args.gap_us));
                }
                let t0 = Instant::now();
                let fresh;
                let req = match &kept {
                    Some(r) => r,
                    None => {
                        let r = init
                            .request_op(args.op, &p, None)
                            .unwrap_or_else(|e| die(e));
                        preps.push(t0.elapsed().as_secs_f64() * 1e3);
                        if args.repost {
                            kept.insert(r)
                        } else {
                            fresh = r;
                            &fresh
                        }
                    }
                };
                let dt = post_and_wait(&init.agent, req).unwrap_or_else(|e| die(e));
                times.push(dt.as_secs_f64() * 1e3);
            }
            preps.sort_by(f64::total_cmp);
            let after = plugin_counters(&init.name);
            let target_after = target_counters(&mut init.target);
            times.sort_by(f64::total_cmp);
            let p50 = percentile(&times, 0.5);
            let bytes = (n * size) as f64;
            let path = Path::of(&before, &after);
            let bounced = path == Path::Bounce;
            rows.push(Row {
                label: args.label.clone(),
                backend: args.backend.clone(),
                descriptors: n,
                size,
                inflight: 1,
                iterations: args.iters,
                p50_ms: p50,
                p90_ms: percentile(&times, 0.9),
                p99_ms: percentile(&times, 0.99),
                gbps: bytes / (p50 * 1e-3) / 1e9,
                bounce_path: path != Path::Ucx,
                path,
                prep_p50_ms: percentile(&preps, 0.5),
            });
            print_row(rows.last().expect("row"));
            if path == Path::Peer {
                let per =
                    |k: &str| since(&after, &before, k) as f64 / args.iters.max(1) as f64 / 1e6;
                println!(
                    "    peer-mapped prepare (in the plugin): {:.3} ms, of it table fill {:.3} ms, upload {:.3} ms",
                    per("peer_map_prepare_ns"),
                    per("peer_map_fill_ns"),
                    per("peer_map_upload_ns"),
                );
            }
            if bounced {
                // The initiator prepares (at the first post by default:
                // inside the timed post, unless reposting).
                let count = |k: &str| since(&after, &before, k) as f64 / args.iters.max(1) as f64;
                let per = |k: &str| count(k) / 1e6;
                println!(
                    "    plugin's preparation per request: {:.3} ms (check {:.3}, plan {:.3}; plans in parts {:.2}, parts {:.1} of which helped {:.1}, first helper after {:.3} ms)",
                    per("prepare_ns"),
                    per("arena_check_ns"),
                    per("arena_plan_ns"),
                    count("arena_plans_in_parts"),
                    count("arena_plan_parts"),
                    count("arena_plan_parts_helped"),
                    per("arena_plan_first_help_ns"),
                );
                // The side that gathers and writes: the initiator of a
                // WRITE, the target (data owner) of a READ.
                match args.op {
                    XferOp::Read => {
                        println!(
                            "    (READ: gather and write on the owner, scatter on the reader)"
                        );
                        print_breakdown(
                            args.iters,
                            &target_before,
                            &target_after,
                            &before,
                            &after,
                            true,
                        )
                    }
                    _ => print_breakdown(
                        args.iters,
                        &before,
                        &after,
                        &target_before,
                        &target_after,
                        false,
                    ),
                }
            }
        }
    }
    // `concurrent` requests of 1024 x 4 KiB in flight at once, disjoint.
    let (size, n) = (4096, 1024);
    if let Some(per) = (args.buffer / size).checked_div(args.concurrent) {
        if per >= n {
            let plans: Vec<Plan> = (0..args.concurrent)
                .map(|i| plan(n, size, per, i * per * size, 7000 + i as u64, false))
                .collect();
            let mut kept: Vec<XferRequest> = Vec::new();
            for round in 0..3 {
                let before = plugin_counters(&init.name);
                let fresh: Vec<XferRequest>;
                let reqs: &[XferRequest] = if args.repost && !kept.is_empty() {
                    &kept
                } else {
                    let made = plans
                        .iter()
                        .map(|p| init.request_op(args.op, p, None).unwrap_or_else(|e| die(e)))
                        .collect();
                    if args.repost {
                        kept = made;
                        &kept
                    } else {
                        fresh = made;
                        &fresh
                    }
                };
                let t0 = Instant::now();
                for r in reqs {
                    post(&init.agent, r).unwrap_or_else(|e| die(e));
                }
                // How long the posts alone took: a bound on the aggregate
                // rate when they, not the copies, are the slower part.
                let posted_ms = t0.elapsed().as_secs_f64() * 1e3;
                let mut done = vec![None; reqs.len()];
                while done.iter().any(Option::is_none) {
                    for (i, r) in reqs.iter().enumerate() {
                        if done[i].is_none() {
                            match init.agent.get_xfer_status(r) {
                                Ok(XferStatus::Success) => {
                                    done[i] = Some(t0.elapsed().as_secs_f64() * 1e3)
                                }
                                Ok(XferStatus::InProgress) => {}
                                Err(e) => die(format!("concurrent request {i} failed: {e}")),
                            }
                        }
                    }
                    if t0.elapsed() > TIMEOUT {
                        die("concurrent requests still running after 60 s");
                    }
                }
                let wall = t0.elapsed().as_secs_f64() * 1e3;
                let path = Path::of(&before, &plugin_counters(&init.name));
                let mut times: Vec<f64> = done.into_iter().flatten().collect();
                times.sort_by(f64::total_cmp);
                if round == 2 {
                    rows.push(Row {
                        label: args.label.clone(),
                        backend: args.backend.clone(),
                        descriptors: n,
                        size,
                        inflight: args.concurrent,
                        iterations: 1,
                        p50_ms: percentile(&times, 0.5),
                        p90_ms: percentile(&times, 0.9),
                        p99_ms: percentile(&times, 0.99),
                        gbps: (args.concurrent * n * size) as f64 / (wall * 1e-3) / 1e9,
                        bounce_path: path != Path::Ucx,
                        path,
                        prep_p50_ms: f64::NAN,
                    });
                    print_row(rows.last().expect("row"));
                    println!(
                        "    posting the {} requests took {posted_ms:.3} ms ({:.1} us each)",
                        args.concurrent,
                        posted_ms * 1e3 / args.concurrent as f64
                    );
                }
            }
        }
    }
    if let Some(path) = &args.json {
        let doc = serde_json::json!({
            "command": std::env::args().collect::<Vec<_>>(),
            "gpu": CudaRuntime::probe().ok().and_then(|c| c.device(args.device).ok()).map(|d| d.name().to_string()),
            "rows": rows,
        });
        if let Err(e) = std::fs::write(path, serde_json::to_string_pretty(&doc).unwrap_or_default())
        {
            eprintln!("writing {path}: {e}");
        }
    }
    let stats = init.target.cmd("STATS").unwrap_or_default();
    eprintln!("target counters: {stats}");
    true
}

pub(super) fn target_counters(t: &mut Target) -> BTreeMap<String, u64> {
    t.cmd("STATS")
        .ok()
        .and_then(|j| serde_json::from_str(&j).ok())
        .unwrap_or_default()
}

/// Where a bounce request's time goes, averaged per request from the
/// runtime's counters (sums over operations, so overlapping phases can add up
/// to more than the request time).
pub(super) fn print_breakdown(
    iters: usize,
    before: &BTreeMap<String, u64>,
    after: &BTreeMap<String, u64>,
    tbefore: &BTreeMap<String, u64>,
    tafter: &BTreeMap<String, u64>,
    read: bool,
) {
    let d = |a: &BTreeMap<String, u64>, b: &BTreeMap<String, u64>, k: &str| {
        a.get(k)
            .copied()
            .unwrap_or(0)
            .saturating_sub(b.get(k).copied().unwrap_or(0))
    };
    let per = |ns: u64| ns as f64 / iters.max(1) as f64 / 1e6;
    let chunks = d(after, before, "chunks_written") as f64 / iters.max(1) as f64;
    let i = |k: &str| per(d(after, before, k));
    let t = |k: &str| per(d(tafter, tbefore, k));
    // The request lives on the initiator: the writer of a WRITE, the
    // reader (the "target" side here) of a READ.
    let total = if read {
        t("request_ns")
    } else {
        i("request_ns")
    };
    println!(
        "    per request: total {:.3} ms | chunks {:.1} | gather {:.3} ms (launch {:.3}, device wait {:.3}) | copy queue {:.3} ms | write {:.3} ms (post {:.3}) | scatter (target) {:.3} ms (launch {:.3}, device wait {:.3}) | target queue {:.3} ms",
        total,
        chunks,
        i("gather_ns"),
        i("gpu_gather_launch_ns"),
        i("gpu_gather_wait_ns"),
        i("copy_queue_ns"),
        i("write_ns"),
        i("write_post_ns"),
        t("scatter_ns"),
        t("gpu_scatter_launch_ns"),
        t("gpu_scatter_wait_ns"),
        t("copy_queue_ns"),
    );
    if !read {
        // Both round trips are timed by the writer of a WRITE only.
        println!(
            "    control per request: submit -> first GRANT {:.3} ms | DATA -> ACK {:.3} ms (sum over chunks, includes the target's scatter)",
            i("grant_wait_ns"),
            i("ack_wait_ns"),
        );
    }
    let both = |k: &str| i(k) + t(k);
    println!(
        "    GPU launch steps, both sides: prepare {:.3} ms | table fill {:.3} ms | upload call {:.3} ms | launch + event {:.3} ms",
        both("gpu_launch_prepare_ns"),
        both("gpu_launch_fill_ns"),
        both("gpu_launch_upload_ns"),
        both("gpu_launch_call_ns"),
    );
    // A counter's growth per request on one side.
    let per = |a: &BTreeMap<String, u64>, b: &BTreeMap<String, u64>, k: &str| {
        d(a, b, k) as f64 / iters.max(1) as f64
    };
    // Chunks whose copy went out in one launch with others of its pass
    // (`group_copy_launches`).
    println!(
        "    copies launched together with others per request: initiator {:.2} | target {:.2}",
        per(after, before, "copies_launched_together"),
        per(tafter, tbefore, "copies_launched_together"),
    );
    // A `gpu_<direction>_<what>` counter per request, each direction on
    // each side.
    let launches = |label: &str, what: &str| {
        let (g, s) = (format!("gpu_gather_{what}"), format!("gpu_scatter_{what}"));
        println!(
            "    {label}: initiator {:.2} gathers, {:.2} scatters | target {:.2} gathers, {:.2} scatters",
            per(after, before, &g),
            per(after, before, &s),
            per(tafter, tbefore, &g),
            per(tafter, tbefore, &s),
        );
    };
    // Kernel launches per request (a group counts once): with the chunks
    // and the count above, the groups' sizes; and of those, the launches
    // that passed their table as the parameter.
    launches("kernel launches per request", "launches");
    launches("of which their table the parameter", "inline_launches");
    // Timed only with NIXL_BOUNCE_TIME_KERNELS set.
    let (gk, sk) = (i("gpu_gather_kernel_ns"), t("gpu_scatter_kernel_ns"));
    let (gu, su) = (i("gpu_gather_upload_ns"), t("gpu_scatter_upload_ns"));
    if gk > 0.0 || sk > 0.0 {
        println!(
            "    kernels' own time (CUDA events): gather {gk:.3} ms (upload to start {gu:.3}) | scatter (target) {sk:.3} ms (upload to start {su:.3})"
        );
    }
}

pub(super) fn print_row(r: &Row) {
    // Requests in flight are prepared before the timing: no preparation.
    let prep = if r.prep_p50_ms.is_nan() {
        String::new()
    } else {
        format!("  (prepare p50 {:.3} ms)", r.prep_p50_ms)
    };
    println!(
        "{:<14} {:>6} x {:>6} B  inflight {:>4}  p50 {:>9.3} ms  p90 {:>9.3}  p99 {:>9.3}  {:>8.2} GB/s  {}{prep}",
        r.label,
        r.descriptors,
        r.size,
        r.inflight,
        r.p50_ms,
        r.p90_ms,
        r.p99_ms,
        r.gbps,
        r.path.name(),
    );
}
