//! What the run happened on (for the JSON metadata) and where CPU time goes
//! (per-thread run time from `/proc/self/task/*/schedstat`).

use std::collections::{BTreeMap, HashMap};
use std::process::Command;
use std::sync::Mutex;
use std::time::{SystemTime, UNIX_EPOCH};

use nixl_bounce::sync::Locked;
use serde::Serialize;

#[derive(Debug, Clone, Serialize)]
pub struct Machine {
    pub nproc: usize,
    pub cpu_model: String,
    pub mem_total_gib: f64,
    pub kernel: String,
    pub hostname: String,
}

pub fn machine() -> Machine {
    let cpuinfo = std::fs::read_to_string("/proc/cpuinfo").unwrap_or_default();
    let cpu_model = cpuinfo
        .lines()
        .find_map(|l| {
            l.strip_prefix("model name")
                .and_then(|r| r.split_once(':'))
                .map(|(_, m)| m.trim().to_string())
        })
        .unwrap_or_else(|| "unknown".into());
    let mem_total_gib = std::fs::read_to_string("/proc/meminfo")
        .unwrap_or_default()
        .lines()
        .find_map(|l| l.strip_prefix("MemTotal:"))
        .and_then(|r| r.split_whitespace().next()?.parse::<f64>().ok())
        .map_or(0.0, |kib| (kib / (1024.0 * 1024.0) * 10.0).round() / 10.0);
    let read = |p: &str| {
        std::fs::read_to_string(p)
            .map(|s| s.trim().to_string())
            .unwrap_or_default()
    };
    Machine {
        nproc: std::thread::available_parallelism().map_or(1, |n| n.get()),
        cpu_model,
        mem_total_gib,
        kernel: read("/proc/sys/kernel/osrelease"),
        hostname: read("/proc/sys/kernel/hostname"),
    }
}

/// `git rev-parse HEAD` of the source tree, and whether it had changes.
pub fn git_commit(root: &str) -> (Option<String>, Option<bool>) {
    let run = |args: &[&str]| {
        Command::new("git")
            .arg("-C")
            .arg(root)
            .args(args)
            .output()
            .ok()
            .filter(|o| o.status.success())
            .map(|o| String::from_utf8_lossy(&o.stdout).trim().to_string())
    };
    let commit = run(&["rev-parse", "HEAD"]);
    // The bench's own outputs (docs/bench/, written while it runs) do not
    // make the tree dirty.
    let dirty = commit
        .as_ref()
        .and_then(|_| {
            run(&[
                "status",
                "--porcelain",
                "--untracked-files=no",
                "--",
                ".",
                ":(exclude)docs/bench",
            ])
        })
        .map(|s| !s.is_empty());
    (commit, dirty)
}

/// Current UTC time as `YYYY-MM-DDTHH:MM:SSZ`.
pub fn utc_now() -> String {
    let secs = SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map_or(0, |d| d.as_secs()) as i64;
    let (days, rem) = (secs.div_euclid(86_400), secs.rem_euclid(86_400));
    // Howard Hinnant's days -> civil date.
    let z = days + 719_468;
    let era = z.div_euclid(146_097);
    let doe = z - era * 146_097;
    let yoe = (doe - doe / 1460 + doe / 36_524 - doe / 146_096) / 365;
    let doy = doe - (365 * yoe + yoe / 4 - yoe / 100);
    let mp = (5 * doy + 2) / 153;
    let day = doy - (153 * mp + 2) / 5 + 1;
    let month = if mp < 10 { mp + 3 } else { mp - 9 };
    let year = yoe + era * 400 + i64::from(month <= 2);
    format!(
        "{year:04}-{month:02}-{day:02}T{:02}:{:02}:{:02}Z",
        rem / 3600,
        rem / 60 % 60,
        rem % 60
    )
}

/// Environment variables that change what NIXL, UCX or BOUNCE do.
pub fn relevant_env() -> BTreeMap<String, String> {
    std::env::vars()
        .filter(|(k, _)| k.starts_with("NIXL_") || k.starts_with("UCX_"))
        .collect()
}

// ---------------------------------------------------------------------------
// Per-thread CPU time
// ---------------------------------------------------------------------------

/// Thread ids of this process.
pub fn tids() -> Vec<i32> {
    std::fs::read_dir("/proc/self/task")
        .map(|d| {
            d.filter_map(|e| e.ok()?.file_name().to_str()?.parse().ok())
                .collect()
        })
        .unwrap_or_default()
}

/// Who created each long-lived thread: `<variant>/init`, `<variant>/target`,
/// `<variant>/connect` or `main`; threads not listed are `other`.
static OWNERS: Mutex<Option<HashMap<i32, String>>> = Mutex::new(None);

/// Attributes every thread that exists now and has no owner yet to `owner`.
pub fn claim_new_threads(owner: &str) {
    let mut g = OWNERS.locked();
    let map = g.get_or_insert_with(HashMap::new);
    let live = tids();
    // Forget threads that have exited (their ids may be reused).
    map.retain(|t, _| live.contains(t));
    for t in live {
        map.entry(t).or_insert_with(|| owner.to_string());
    }
}

fn owner_of(tid: i32) -> String {
    OWNERS
        .locked()
        .as_ref()
        .and_then(|m| m.get(&tid).cloned())
        .unwrap_or_else(|| "other".into())
}

/// A thread's name without its instance numbers (`bounce-copy-3` ->
/// `bounce-copy`; `bounce-io-init-` -> `bounce-io`).
fn kind_of(comm: &str) -> String {
    // The reactor is named after its agent, which the bench names by side.
    if let Some(rest) = comm.strip_prefix("bounce-io") {
        return match rest.trim_start_matches('-').chars().next() {
            Some('i') => "bounce-io(initiator)".into(),
            Some('t') => "bounce-io(target)".into(),
            _ => "bounce-io".into(),
        };
    }
    // Threads that NIXL or UCX start without a name inherit the main
    // thread's name (the program's).
    let main = std::fs::read_to_string("/proc/self/comm").unwrap_or_default();
    if comm == main.trim() {
        return "unnamed(nixl/ucx)".into();
    }
    comm.trim_end_matches(|c: char| c.is_ascii_digit() || c == '-' || c == '_')
        .to_string()
}

/// CPU time of every live thread (ns) plus the whole process' (ns, which
/// also counts threads that have exited).
#[derive(Debug, Clone, Default)]
pub struct CpuSample {
    threads: HashMap<i32, (String, u64)>,
    process_ns: u64,
    /// Whole machine: busy and total time from `/proc/stat` (clock ticks).
    host_busy_ticks: u64,
    host_total_ticks: u64,
}

/// (busy, total) clock ticks of all CPUs since boot.
fn host_ticks() -> (u64, u64) {
    let stat = std::fs::read_to_string("/proc/stat").unwrap_or_default();
    let Some(line) = stat.lines().find(|l| l.starts_with("cpu ")) else {
        return (0, 0);
    };
    let v: Vec<u64> = line
        .split_whitespace()
        .skip(1)
        .filter_map(|x| x.parse().ok())
        .collect();
    // user nice system idle iowait irq softirq steal guest guest_nice
    let total: u64 = v.iter().take(8).sum();
    let idle = v.get(3).copied().unwrap_or(0) + v.get(4).copied().unwrap_or(0);
    (total.saturating_sub(idle), total)
}

/// The 1-minute load average.
pub fn load_average() -> Option<f64> {
    std::fs::read_to_string("/proc/loadavg")
        .ok()?
        .split_whitespace()
        .next()?
        .parse()
        .ok()
}

fn process_cpu_ns() -> u64 {
    // SAFETY: rusage is a plain C struct of integers; all-zero is a valid value.
    let mut ru: libc::rusage = unsafe { std::mem::zeroed() };
    // SAFETY: ru is a valid out-pointer.
    if unsafe { libc::getrusage(libc::RUSAGE_SELF, &mut ru) } != 0 {
        return 0;
    }
    let tv = |t: libc::timeval| t.tv_sec as u64 * 1_000_000_000 + t.tv_usec as u64 * 1000;
    tv(ru.ru_utime) + tv(ru.ru_stime)
}

impl CpuSample {
    pub fn take() -> Self {
        let mut threads = HashMap::new();
        for t in tids() {
            let base = format!("/proc/self/task/{t}");
            let Ok(s) = std::fs::read_to_string(format!("{base}/schedstat")) else {
                continue;
            };
            let Some(ns) = s
                .split_whitespace()
                .next()
                .and_then(|v| v.parse::<u64>().ok())
            else {
                continue;
            };
            let comm = std::fs::read_to_string(format!("{base}/comm"))
                .unwrap_or_default()
                .trim()
                .to_string();
            threads.insert(t, (comm, ns));
        }
        let (host_busy_ticks, host_total_ticks) = host_ticks();
        CpuSample {
            threads,
            process_ns: process_cpu_ns(),
            host_busy_ticks,
            host_total_ticks,
        }
    }
}

/// CPU time accumulated between samples, by `owner:thread-kind`.
#[derive(Debug, Clone, Default)]
pub struct CpuUse {
    pub process_ns: u64,
    pub groups: BTreeMap<String, u64>,
    /// Machine-wide busy and total clock ticks (all CPUs).
    pub host_busy_ticks: u64,
    pub host_total_ticks: u64,
}

impl CpuUse {
    /// CPU cores kept busy by OTHER processes (machine busy minus ours),
    /// given the wall time the samples covered.
    pub fn foreign_cores(&self, wall_ns: f64) -> Option<f64> {
        let tick_ns = 1e9 / clock_ticks_per_second();
        if self.host_total_ticks == 0 || wall_ns <= 0.0 {
            return None;
        }
        let busy_ns = self.host_busy_ticks as f64 * tick_ns;
        Some(((busy_ns - self.process_ns as f64) / wall_ns).max(0.0))
    }
}

fn clock_ticks_per_second() -> f64 {
    // SAFETY: sysconf has no memory effects.
    match unsafe { libc::sysconf(libc::_SC_CLK_TCK) } {
        n if n > 0 => n as f64,
        _ => 100.0,
    }
}

impl CpuUse {
    pub fn merge(&mut self, other: &CpuUse) {
        self.process_ns += other.process_ns;
        self.host_busy_ticks += other.host_busy_ticks;
        self.host_total_ticks += other.host_total_ticks;
        for (k, v) in &other.groups {
            *self.groups.entry(k.clone()).or_default() += v;
        }
    }

    /// Adds what happened between `before` and `after`.
    pub fn add(&mut self, before: &CpuSample, after: &CpuSample) {
        let process = after.process_ns.saturating_sub(before.process_ns);
        self.process_ns += process;
        self.host_busy_ticks += after.host_busy_ticks.saturating_sub(before.host_busy_ticks);
        self.host_total_ticks += after
            .host_total_ticks
            .saturating_sub(before.host_total_ticks);
        let mut live = 0u64;
        for (tid, (comm, ns)) in &after.threads {
            let d = ns.saturating_sub(before.threads.get(tid).map_or(0, |(_, b)| *b));
            if d == 0 {
                continue;
            }
            live += d;
            let owner = owner_of(*tid);
            let key = if owner == "main" {
                "main:post+poll".to_string()
            } else {
                format!("{owner}:{}", kind_of(comm))
            };
            *self.groups.entry(key).or_default() += d;
        }
        // Short-lived threads (e.g. the host copy engine's helpers for large
        // chunks) have vanished from /proc by the second sample.
        let exited = process.saturating_sub(live);
        if exited > 0 {
            *self.groups.entry("exited-threads".into()).or_default() += exited;
        }
    }
}
