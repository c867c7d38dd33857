//! Rows, the human table and the JSON document.

use std::collections::BTreeMap;
use std::io::Write;
use std::path::Path;

use serde::Serialize;

use crate::cli::Options;
use crate::run::{Measured, Shape};
use crate::sysinfo::{CpuUse, Machine};

#[derive(Debug, Clone, Serialize)]
pub struct Percentiles {
    pub p50: f64,
    pub p90: f64,
    pub p99: f64,
    pub min: f64,
    pub max: f64,
    pub mean: f64,
}

/// Nearest-rank percentiles; `None` for no samples.
pub fn percentiles(samples: &[f64]) -> Option<Percentiles> {
    if samples.is_empty() {
        return None;
    }
    let mut v = samples.to_vec();
    v.sort_by(f64::total_cmp);
    let rank = |p: f64| v[((p * v.len() as f64).ceil() as usize).clamp(1, v.len()) - 1];
    Some(Percentiles {
        p50: rank(0.50),
        p90: rank(0.90),
        p99: rank(0.99),
        min: v[0],
        max: v[v.len() - 1],
        mean: v.iter().sum::<f64>() / v.len() as f64,
    })
}

/// One round's run of a (configuration, variant).
#[derive(Debug, Clone, Serialize)]
pub struct Round {
    pub throughput_gbps: f64,
    pub p50_ms: f64,
    pub batches: usize,
    pub foreign_cpu_cores: Option<f64>,
}

impl Round {
    pub fn of(m: &Measured, shape: Shape) -> Round {
        let wall_ms: f64 = m.batch_ms.iter().sum();
        let bytes = (m.batch_ms.len() * shape.inflight * shape.request_bytes()) as f64;
        Round {
            throughput_gbps: if wall_ms > 0.0 {
                bytes / (wall_ms / 1e3) / 1e9
            } else {
                0.0
            },
            p50_ms: percentiles(&m.latencies_ms).map_or(0.0, |p| p.p50),
            batches: m.batch_ms.len(),
            foreign_cpu_cores: m.cpu.foreign_cores(wall_ms * 1e6).map(round3),
        }
    }
}

fn median(v: &mut [f64]) -> Option<f64> {
    if v.is_empty() {
        return None;
    }
    v.sort_by(f64::total_cmp);
    let n = v.len();
    Some(if n % 2 == 1 {
        v[n / 2]
    } else {
        (v[n / 2 - 1] + v[n / 2]) / 2.0
    })
}

#[derive(Debug, Clone, Serialize)]
pub struct Row {
    /// `BOUNCE`, `UCX`, `UCX[nt2]`, `memcpy[gather]`, ...
    pub label: String,
    pub backend: String,
    pub variant: String,
    pub op: String,
    pub mem: String,
    pub descriptors: usize,
    pub descriptor_bytes: usize,
    pub inflight: usize,
    pub request_bytes: usize,
    /// `ok`, `failed` or `skipped`.
    pub status: String,
    pub error: Option<String>,
    /// `--wait-quiet`: seconds waited before the row, and the CPU cores
    /// other processes used when the wait ended.
    pub quiet_wait_s: Option<f64>,
    pub foreign_cpu_cores_before: Option<f64>,
    /// Seconds to set the row's fresh agents up and to tear them down.
    pub setup_s: Option<f64>,
    pub teardown_s: Option<f64>,
    pub warmup_batches: usize,
    pub timed_batches: usize,
    /// Per-request latency from post to completion seen (ms).
    pub latency_ms: Option<Percentiles>,
    /// `--raw`: every per-request latency (ms), in completion order.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub latencies_raw_ms: Option<Vec<f64>>,
    /// Median wall time of a batch (ms).
    pub batch_ms_median: Option<f64>,
    /// Bytes of all timed batches / their summed wall time (GB/s, 1e9).
    pub throughput_gbps: Option<f64>,
    /// Median over timed batches of (batch bytes / batch wall time): less
    /// sensitive to a few slow batches on a busy machine.
    pub throughput_gbps_batch_median: Option<f64>,
    /// Throughput / the UCX default row's for the same configuration.
    pub speedup_vs_ucx: Option<f64>,
    /// Median over rounds of (this row's round throughput / the UCX
    /// default row's throughput in the same round): robust to load drift.
    pub speedup_vs_ucx_by_round: Option<f64>,
    /// Each round's run (the whole sweep is repeated `--rounds` times).
    pub rounds: Vec<Round>,
    /// Rounds during which other processes kept fewer than `--quiet-below`
    /// CPU cores busy, their median throughput, and the median ratio over
    /// rounds where this row AND the UCX row were quiet.
    pub quiet_rounds: usize,
    pub quiet_throughput_gbps: Option<f64>,
    pub speedup_vs_ucx_quiet: Option<f64>,
    pub speedup_vs_ucx_quiet_pairs: usize,
    /// First and last timed batch verified byte-exact.
    pub verified: Option<bool>,
    pub verify_error: Option<String>,
    /// BOUNCE rows: whether the plugin's counters show the bounce path.
    pub bounce_path: Option<String>,
    pub bounce_path_ok: Option<bool>,
    /// Whether BOUNCE's routing gate admits this configuration (a fallback
    /// it predicts is flagged, not an error).
    pub bounce_path_expected: Option<bool>,
    pub chunks_per_request: Option<f64>,
    /// BOUNCE rows: the plugin's phase timers per request (ms), from the
    /// counter increments: gather (initiator), write (post -> completion,
    /// initiator), scatter (target), copy_queue (both sides), request
    /// (submit -> complete, initiator) and `unaccounted` = request minus the
    /// phases (negative when phases of several chunks overlap).
    pub bounce_phases_ms_per_request: Option<BTreeMap<String, f64>>,
    /// BOUNCE rows: counter increments over the whole configuration.
    pub bounce_counters_initiator: Option<BTreeMap<String, u64>>,
    pub bounce_counters_target: Option<BTreeMap<String, u64>>,
    /// Process CPU time / wall time during the timed batches (cores busy).
    pub cpu_cores_busy: Option<f64>,
    /// CPU cores kept busy by other processes during the timed batches
    /// (machine busy time minus this process'); a shared machine shows here.
    pub foreign_cpu_cores: Option<f64>,
    /// 1-minute load average when the row finished.
    pub load_average: Option<f64>,
    /// CPU ms per request by `owner:thread` (owner = variant/init|target|connect, main, other).
    pub cpu_ms_per_request: Option<BTreeMap<String, f64>>,
}

impl Row {
    pub fn new(o: &Options, label: &str, backend: &str, variant: &str, shape: Shape) -> Row {
        Row {
            label: label.into(),
            backend: backend.into(),
            variant: variant.into(),
            op: o.op.name().into(),
            mem: o.mem.name().into(),
            descriptors: shape.count,
            descriptor_bytes: shape.size,
            inflight: shape.inflight,
            request_bytes: shape.request_bytes(),
            status: "skipped".into(),
            error: None,
            quiet_wait_s: None,
            foreign_cpu_cores_before: None,
            setup_s: None,
            teardown_s: None,
            warmup_batches: 0,
            timed_batches: 0,
            latency_ms: None,
            latencies_raw_ms: None,
            batch_ms_median: None,
            throughput_gbps: None,
            throughput_gbps_batch_median: None,
            speedup_vs_ucx: None,
            speedup_vs_ucx_by_round: None,
            rounds: Vec::new(),
            quiet_rounds: 0,
            quiet_throughput_gbps: None,
            speedup_vs_ucx_quiet: None,
            speedup_vs_ucx_quiet_pairs: 0,
            verified: None,
            verify_error: None,
            bounce_path: None,
            bounce_path_ok: None,
            bounce_path_expected: None,
            chunks_per_request: None,
            bounce_phases_ms_per_request: None,
            bounce_counters_initiator: None,
            bounce_counters_target: None,
            cpu_cores_busy: None,
            foreign_cpu_cores: None,
            load_average: crate::sysinfo::load_average(),
            cpu_ms_per_request: None,
        }
    }

    pub fn skipped(mut self, why: impl Into<String>) -> Row {
        self.status = "skipped".into();
        self.error = Some(why.into());
        self
    }

    pub fn failed(mut self, why: impl Into<String>) -> Row {
        self.status = "failed".into();
        self.error = Some(why.into());
        self
    }

    /// Fills the timing fields from per-request times and batch walls.
    pub fn timed(mut self, warmup: usize, latencies_ms: &[f64], batch_ms: &[f64]) -> Row {
        self.status = "ok".into();
        self.warmup_batches = warmup;
        self.timed_batches = batch_ms.len();
        self.latency_ms = percentiles(latencies_ms);
        self.batch_ms_median = percentiles(batch_ms).map(|p| p.p50);
        let wall_s: f64 = batch_ms.iter().sum::<f64>() / 1e3;
        let bytes = (batch_ms.len() * self.inflight * self.request_bytes) as f64;
        self.throughput_gbps = (wall_s > 0.0).then(|| bytes / wall_s / 1e9);
        let batch_bytes = (self.inflight * self.request_bytes) as f64;
        let mut per_batch: Vec<f64> = batch_ms
            .iter()
            .filter(|ms| **ms > 0.0)
            .map(|ms| batch_bytes / (ms / 1e3) / 1e9)
            .collect();
        self.throughput_gbps_batch_median = median(&mut per_batch).map(round3);
        self
    }

    pub fn measured(self, m: Measured, label: &str) -> Row {
        let mut r = self.timed(m.warmup, &m.latencies_ms, &m.batch_ms);
        r.verified = Some(m.verified.is_ok());
        r.verify_error = m.verified.err();
        if let Some(b) = m.bounce {
            r.bounce_path = Some(b.used);
            r.bounce_path_ok = Some(b.ok);
            r.bounce_path_expected = Some(b.expected);
            r.chunks_per_request = b.chunks_per_request;
            r.bounce_phases_ms_per_request = phases(&b.init_delta, &b.target_delta, b.posted);
            r.bounce_counters_initiator = Some(b.init_delta);
            r.bounce_counters_target = Some(b.target_delta);
        }
        let wall_ns: f64 = m.batch_ms.iter().sum::<f64>() * 1e6;
        if wall_ns > 0.0 {
            r.cpu_cores_busy = Some(round3(m.cpu.process_ns as f64 / wall_ns));
            r.foreign_cpu_cores = m.cpu.foreign_cores(wall_ns).map(round3);
        }
        let requests = (m.batch_ms.len() * r.inflight) as f64;
        if requests > 0.0 {
            r.cpu_ms_per_request = Some(cpu_groups(&m.cpu, label, requests));
        }
        r
    }

    pub fn ok(&self) -> bool {
        let unexpected_fallback =
            self.bounce_path_ok == Some(false) && self.bounce_path_expected != Some(false);
        self.status != "failed" && self.verified != Some(false) && !unexpected_fallback
    }
}

/// Per-request phase times from the plugin's `*_ns` counters, if it has them.
fn phases(
    init: &BTreeMap<String, u64>,
    target: &BTreeMap<String, u64>,
    posted: u64,
) -> Option<BTreeMap<String, f64>> {
    let request = *init.get("request_ns")?;
    if posted == 0 {
        return None;
    }
    let per = |ns: u64| (ns as f64 / 1e6 / posted as f64 * 1e3).round() / 1e3;
    let get = |m: &BTreeMap<String, u64>, k: &str| m.get(k).copied().unwrap_or(0);
    // Each phase summed over both agents: one of them runs it (the
    // initiator gathers and writes a WRITE, the target a READ).
    let both = |k: &str| get(init, k) + get(target, k);
    let (gather, write, scatter) = (both("gather_ns"), both("write_ns"), both("scatter_ns"));
    let queue = get(init, "copy_queue_ns") + get(target, "copy_queue_ns");
    let unaccounted = request as f64 - (gather + write + scatter + queue) as f64;
    Some(BTreeMap::from([
        ("gather".to_string(), per(gather)),
        ("write".to_string(), per(write)),
        ("scatter".to_string(), per(scatter)),
        ("copy_queue".to_string(), per(queue)),
        ("request".to_string(), per(request)),
        (
            "unaccounted".to_string(),
            (unaccounted / 1e6 / posted as f64 * 1e3).round() / 1e3,
        ),
    ]))
}

fn round3(x: f64) -> f64 {
    (x * 1e3).round() / 1e3
}

/// This variant's threads, main, other, exited; the idle threads of the
/// other variants summed into one entry.
fn cpu_groups(cpu: &CpuUse, label: &str, requests: f64) -> BTreeMap<String, f64> {
    let mine = format!("{label}/");
    let mut out = BTreeMap::new();
    for (k, ns) in &cpu.groups {
        let key = if k.starts_with(&mine) || k.starts_with("main:") || k == "exited-threads" {
            k.clone()
        } else {
            format!(
                "other:{}",
                k.split_once(':').map_or(k.as_str(), |(_, kind)| kind)
            )
        };
        *out.entry(key).or_insert(0.0) += *ns as f64 / 1e6 / requests;
    }
    for v in out.values_mut() {
        *v = (*v * 1e4).round() / 1e4;
    }
    out
}

/// Fills the quiet-round figures and the speedups from the UCX default row
/// of each configuration. A round is quiet when other processes kept fewer
/// than `quiet_below` CPU cores busy during it.
pub fn add_speedups(rows: &mut [Row], quiet_below: f64) {
    type Key = (usize, usize, usize);
    let quiet = |x: &Round| x.foreign_cpu_cores.is_some_and(|f| f < quiet_below);
    for r in rows.iter_mut() {
        let mut q: Vec<f64> = r
            .rounds
            .iter()
            .filter(|x| quiet(x))
            .map(|x| x.throughput_gbps)
            .collect();
        r.quiet_rounds = q.len();
        r.quiet_throughput_gbps = median(&mut q).map(round3);
    }
    let base: Vec<(Key, f64, Vec<Round>)> = rows
        .iter()
        .filter(|r| r.label == "UCX" && r.status == "ok")
        .filter_map(|r| {
            Some((
                (r.descriptors, r.descriptor_bytes, r.inflight),
                r.throughput_gbps?,
                r.rounds.clone(),
            ))
        })
        .collect();
    for r in rows.iter_mut().filter(|r| r.backend != "memcpy") {
        let key = (r.descriptors, r.descriptor_bytes, r.inflight);
        let Some((_, b, b_rounds)) = base.iter().find(|(k, _, _)| *k == key) else {
            continue;
        };
        r.speedup_vs_ucx = r
            .throughput_gbps
            .filter(|_| *b > 0.0)
            .map(|g| round3(g / b));
        let pairs = r
            .rounds
            .iter()
            .zip(b_rounds)
            .filter(|(_, u)| u.throughput_gbps > 0.0);
        let mut ratios: Vec<f64> = pairs
            .clone()
            .map(|(x, u)| x.throughput_gbps / u.throughput_gbps)
            .collect();
        r.speedup_vs_ucx_by_round = median(&mut ratios).map(round3);
        let mut quiet_ratios: Vec<f64> = pairs
            .filter(|(x, u)| quiet(x) && quiet(u))
            .map(|(x, u)| x.throughput_gbps / u.throughput_gbps)
            .collect();
        r.speedup_vs_ucx_quiet_pairs = quiet_ratios.len();
        r.speedup_vs_ucx_quiet = median(&mut quiet_ratios).map(round3);
    }
}

fn size_text(n: usize) -> String {
    match n {
        n if n >= 1 << 20 && n % (1 << 20) == 0 => format!("{}MiB", n >> 20),
        n if n >= 1 << 10 && n % (1 << 10) == 0 => format!("{}KiB", n >> 10),
        n => format!("{n}B"),
    }
}

pub fn print_table(rows: &[Row], quiet_below: f64, out: &mut impl Write) -> std::io::Result<()> {
    let f = |x: Option<f64>, prec: usize| x.map_or("-".to_string(), |v| format!("{v:.prec$}"));
    // One layout for the header and the rows.
    let line = |c: [&str; 15]| {
        format!(
            "{:<16} {:>6} {:>6} {:>5} {:>9} {:>9} {:>9} {:>7} {:>7} {:>7} {:>9} {:>7} {:>7}  {:<8} {}",
            c[0], c[1], c[2], c[3], c[4], c[5], c[6], c[7], c[8], c[9], c[10], c[11], c[12], c[13], c[14]
        )
    };
    writeln!(
        out,
        "{}",
        line([
            "variant",
            "descs",
            "size",
            "infl",
            "p50 ms",
            "p90 ms",
            "p99 ms",
            "GB/s",
            "vs UCX",
            "per-rnd",
            "quiet",
            "batches",
            "ext.cpu",
            "verified",
            "bounce path",
        ])
    )?;
    for r in rows {
        let lat = r.latency_ms.as_ref();
        let verified = match (r.status.as_str(), r.verified) {
            ("skipped", _) => "skipped",
            ("failed", _) => "FAILED",
            (_, Some(true)) => "yes",
            (_, Some(false)) => "NO",
            (_, None) => "-",
        };
        let bounce = match (&r.bounce_path, r.bounce_path_ok) {
            (Some(p), Some(false)) if r.bounce_path_expected == Some(false) => {
                format!("{p}  <-- FLAGGED (expected: the routing gate sends it to UCX)")
            }
            (Some(p), Some(false)) => format!("{p}  <-- FLAGGED"),
            (Some(p), _) => p.clone(),
            (None, _) => "-".into(),
        };
        let cells = [
            r.label.clone(),
            r.descriptors.to_string(),
            size_text(r.descriptor_bytes),
            r.inflight.to_string(),
            f(lat.map(|l| l.p50), 3),
            f(lat.map(|l| l.p90), 3),
            f(lat.map(|l| l.p99), 3),
            f(r.throughput_gbps, 2),
            r.speedup_vs_ucx.map_or("-".into(), |s| format!("{s:.2}x")),
            r.speedup_vs_ucx_by_round
                .map_or("-".into(), |s| format!("{s:.2}x")),
            r.speedup_vs_ucx_quiet.map_or("-".into(), |s| {
                format!("{s:.2}x({})", r.speedup_vs_ucx_quiet_pairs)
            }),
            if r.status == "ok" {
                r.timed_batches.to_string()
            } else {
                "-".into()
            },
            f(r.foreign_cpu_cores, 2),
            verified.to_string(),
            bounce,
        ];
        writeln!(out, "{}", line(cells.each_ref().map(String::as_str)))?;
    }
    let notes: Vec<String> = rows
        .iter()
        .filter_map(|r| r.error.as_ref().map(|e| (r, e)))
        .map(|(r, e)| {
            format!(
                "  {} {}x{} B x{}: {} ({e})",
                r.label, r.descriptors, r.descriptor_bytes, r.inflight, r.status
            )
        })
        .chain(rows.iter().filter_map(|r| {
            r.verify_error.as_ref().map(|e| {
                format!(
                    "  {} {}x{} B x{}: verification failed: {e}",
                    r.label, r.descriptors, r.descriptor_bytes, r.inflight
                )
            })
        }))
        .collect();
    writeln!(
        out,
        "\nvs UCX: throughput / the UCX row's; per-rnd: median over rounds of the same ratio within a round;\n\
         quiet: the same median over rounds where both rows ran while other processes used < {quiet_below} cores (pairs).\n\
         batches: timed batches over all rounds. ext.cpu: CPU cores other processes kept busy meanwhile (0 = quiet)."
    )?;
    if !notes.is_empty() {
        writeln!(out, "\nnotes:")?;
        for n in notes {
            writeln!(out, "{n}")?;
        }
    }
    Ok(())
}

#[derive(Debug, Clone, Serialize)]
pub struct VariantInfo {
    pub label: String,
    pub backend: String,
    pub contiguous: bool,
    /// Parameters given on the command line (plus the loopback ones).
    pub params_given: BTreeMap<String, String>,
    /// Every parameter the backend was created with (plugin defaults included).
    pub params_effective: BTreeMap<String, String>,
    /// Seconds to create both agents, register and exchange metadata.
    pub setup_s: Option<f64>,
    /// CPU cores the variant's agents keep busy while idle, by thread.
    pub idle_cpu_cores: Option<f64>,
    pub idle_cpu_by_thread: BTreeMap<String, f64>,
    pub error: Option<String>,
}

#[derive(Debug, Clone, Serialize)]
pub struct Meta {
    pub tool: &'static str,
    pub schema: u32,
    pub command: String,
    pub args: Vec<String>,
    pub git_commit: Option<String>,
    pub git_dirty: Option<bool>,
    pub started_utc: String,
    pub finished_utc: Option<String>,
    pub machine: Machine,
    pub setup: String,
    pub preset: String,
    pub op: String,
    pub mem: String,
    pub counts: Vec<usize>,
    pub sizes: Vec<usize>,
    pub inflight: Vec<usize>,
    pub rounds: usize,
    pub warmup_batches: usize,
    pub max_timed_batches: usize,
    pub quiet_below_cores: f64,
    pub min_timed_batches: usize,
    pub config_budget_s: f64,
    pub timeout_s: f64,
    pub poll: String,
    pub seed: u64,
    pub variants: Vec<VariantInfo>,
    /// BOUNCE's defaults (`Config::describe()` of this source tree).
    pub bounce_defaults: BTreeMap<String, String>,
    pub env: BTreeMap<String, String>,
    /// CPU cores other processes kept busy before the sweep (a shared
    /// machine shows here), and the load average then.
    pub foreign_cpu_cores_at_start: Option<f64>,
    pub load_average_at_start: Option<f64>,
    pub plugin_dir: Option<String>,
}

#[derive(Debug, Clone, Serialize)]
pub struct Document<'a> {
    pub meta: &'a Meta,
    pub rows: &'a [Row],
}

/// Writes the JSON atomically (temporary file, then rename).
pub fn write_json(path: &Path, meta: &Meta, rows: &[Row]) -> Result<(), String> {
    if let Some(dir) = path.parent().filter(|d| !d.as_os_str().is_empty()) {
        std::fs::create_dir_all(dir).map_err(|e| format!("creating {}: {e}", dir.display()))?;
    }
    let text = serde_json::to_string_pretty(&Document { meta, rows }).map_err(|e| e.to_string())?;
    let tmp = path.with_extension("json.tmp");
    std::fs::write(&tmp, text + "\n").map_err(|e| format!("writing {}: {e}", tmp.display()))?;
    std::fs::rename(&tmp, path)
        .map_err(|e| format!("renaming {} to {}: {e}", tmp.display(), path.display()))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn nearest_rank_percentiles() {
        let v: Vec<f64> = (1..=100).map(f64::from).collect();
        let p = percentiles(&v).unwrap();
        assert_eq!(
            (p.p50, p.p90, p.p99, p.min, p.max),
            (50.0, 90.0, 99.0, 1.0, 100.0)
        );
        let p = percentiles(&[3.0]).unwrap();
        assert_eq!((p.p50, p.p99), (3.0, 3.0));
        assert!(percentiles(&[]).is_none());
    }
}
