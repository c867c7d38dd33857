//! Command line of the `bench` binary: options, presets and `--help`.

use std::path::PathBuf;
use std::time::Duration;

use nixl_bounce::config::parse_bytes;

pub const USAGE: &str = "\
bench: move the same scattered buffers through BOUNCE and through UCX in one
process (two agents, loopback) and report latency percentiles and throughput.

For every configuration (descriptor count x descriptor size x requests in
flight) and every variant (BOUNCE, UCX, extra labelled variants) the bench
runs warm-up batches, then timed batches. A batch posts <in-flight> requests
back-to-back, each on its own disjoint buffer slice, then polls them all to
completion. Latency is per request (post -> completion seen); throughput is
bytes / wall time of the batch (first post -> last completion). The first and
the last timed batch are verified byte-exact (fresh seed-distinct patterns;
every byte of the destination slices, the sources and the guard zones). For
BOUNCE rows the plugin's counters prove whether the bounce path was used.

USAGE:
  bench [PRESET] [OPTIONS]

PRESETS (lists and iteration counts; later flags override them):
      --quick            counts 256,1024,4096,16384, size 4KiB, in-flight 1,8;
                         2 rounds of 1 warm-up + 2..10 timed batches, 1 s per run
                         (about 1.5 min on the 2-core machine)
      --full             counts 256,1024,4096,16384, sizes 1KiB,4KiB,16KiB,64KiB,
                         in-flight 1,8,32,128; 2 rounds of up to 20 batches,
                         2 s per run (about 9 min on a quiet 2-core machine)
  (no preset)            the --quick lists, 2 rounds of up to 20 batches, 2 s per run

WHAT TO MOVE:
      --op OP            write (default) | read (the initiator reads the target's
                         buffer into its own: the target is the data owner)
      --mem MEM          dram (default) | vram (reserved for the CUDA issue)
  -c, --counts LIST      descriptors per request, e.g. 256,1024,4096,16384
  -s, --sizes LIST       bytes per descriptor, suffixes allowed: 1k,4KiB,64K
  -f, --inflight LIST    requests in flight per batch, e.g. 1,8,128
      --seed N           layout/pattern seed (default 1)
      --max-buffer BYTES largest buffer per side (in-flight x slice); larger
                         configurations are skipped and reported (default 1536MiB)

VARIANTS (rows):
      --backends LIST    default rows to run: BOUNCE,UCX (default both)
      --bounce-param K=V parameter of the BOUNCE row(s) (repeatable); UCX keys
                         such as num_threads pass through to BOUNCE's inner UCX
      --ucx-param K=V    parameter of the UCX row(s) (repeatable)
      --ucx-variant NAME:K=V[,K=V...]
                         an extra UCX row labelled UCX[NAME] (repeatable), e.g.
                         --ucx-variant nt2:num_threads=2
      --bounce-variant NAME:K=V[,K=V...]
                         an extra BOUNCE row labelled BOUNCE[NAME] (repeatable),
                         e.g. --bounce-variant c4m:max_chunk_size_bytes=4MiB
                         (variant parameters go on top of --bounce-param)
                         A key agent.prog_thread|agent.pthr_delay_us|agent.num_workers
                         configures the bench's own agents (nixl-sys AgentConfig)
                         instead of the backend, e.g. --ucx-variant noprog:agent.prog_thread=false
      --model            also measure the pieces of the bounce path: a UCX row
                         moving the same bytes as ONE contiguous descriptor
                         (UCX[1-desc]) and single-threaded memcpy gather and
                         scatter of the same blocks (memcpy[gather|scatter])
  BOUNCE always gets control_bind_loopback=true (and control_interface empty):
  the control socket stays on 127.0.0.1.

TIMING:
  -r, --rounds N         repeat the whole sweep N times and merge the runs of
                         each row (fresh agents every run; the speedup is also
                         given as the median of per-round ratios, which is
                         robust to a machine whose load drifts); default 2
  -w, --warmup N         untimed batches first in every run (default 2; --quick 1)
  -i, --iters N          timed batches at most (default 20; --quick 10)
      --min-iters N      timed batches at least (default 3; --quick 2)
      --config-budget S  seconds of timed batches per run of a configuration
                         and variant; fewer batches when they are slow
                         (default 2; --quick 1)
      --budget S         whole-run budget in seconds; remaining configurations
                         are skipped and reported once it is spent (default 1800)
      --timeout S        bound on one batch; a batch still running is an error
                         and the variant is abandoned (default 60)
      --wait-quiet S     before each run, wait up to S seconds until other
                         processes use fewer than --quiet-below CPU cores (for
                         shared machines; what was waited and seen is in the JSON)
      --quiet-below C    a round counts as quiet when other processes kept
                         fewer than C CPU cores busy during it (default 0.25);
                         the table's quiet column uses only such rounds
      --poll MODE        how completions are polled: yield (default: yield
                         between polls, sleep 50us every 1024 polls), spin,
                         or sleep=US

OUTPUT:
      --json PATH        every row plus metadata (command line, git commit,
                         machine, date); rewritten after each row
      --raw              also put every per-request latency in the JSON
  -q, --quiet            no progress lines on stderr
  -h, --help             this text

Exit status: 0 when every row that ran verified and every BOUNCE row that
BOUNCE's routing gate admits (min_descriptor_count, max_average_descriptor_
size_bytes) took the bounce path; 1 otherwise; 2 for a usage error. Rows the
gate sends to UCX are flagged in the table but are not errors.";

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Op {
    Write,
    Read,
}

impl Op {
    pub fn name(self) -> &'static str {
        match self {
            Op::Write => "write",
            Op::Read => "read",
        }
    }
}

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum MemKind {
    Dram,
}

impl MemKind {
    pub fn name(self) -> &'static str {
        match self {
            MemKind::Dram => "dram",
        }
    }
}

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum BackendKind {
    Bounce,
    Ucx,
}

impl BackendKind {
    /// The NIXL backend (plugin) name.
    pub fn plugin(self) -> &'static str {
        match self {
            BackendKind::Bounce => "BOUNCE",
            BackendKind::Ucx => "UCX",
        }
    }
}

/// One row family: a backend with its parameters.
#[derive(Clone, Debug)]
pub struct VariantSpec {
    pub backend: BackendKind,
    /// Empty for the default row of a backend.
    pub name: String,
    pub params: Vec<(String, String)>,
    /// Move each request's bytes as ONE contiguous descriptor (model row).
    pub contiguous: bool,
}

impl VariantSpec {
    /// `BOUNCE`, `UCX`, `UCX[nt2]`, ...
    pub fn label(&self) -> String {
        if self.name.is_empty() {
            self.backend.plugin().to_string()
        } else {
            format!("{}[{}]", self.backend.plugin(), self.name)
        }
    }
}

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Poll {
    Yield,
    Spin,
    Sleep(Duration),
}

impl Poll {
    pub fn describe(self) -> String {
        match self {
            Poll::Yield => "yield".into(),
            Poll::Spin => "spin".into(),
            Poll::Sleep(d) => format!("sleep={}", d.as_micros()),
        }
    }

    /// Called between two rounds of status polls.
    pub fn pause(self, rounds: u64) {
        match self {
            Poll::Spin => std::hint::spin_loop(),
            Poll::Yield if rounds % 1024 == 1023 => std::thread::sleep(Duration::from_micros(50)),
            Poll::Yield => std::thread::yield_now(),
            Poll::Sleep(d) => std::thread::sleep(d),
        }
    }
}

#[derive(Clone, Debug)]
pub struct Options {
    pub preset: &'static str,
    pub op: Op,
    pub mem: MemKind,
    pub counts: Vec<usize>,
    pub sizes: Vec<usize>,
    pub inflight: Vec<usize>,
    pub seed: u64,
    pub max_buffer: usize,
    pub variants: Vec<VariantSpec>,
    pub model: bool,
    pub rounds: usize,
    pub warmup: usize,
    pub iters: usize,
    pub min_iters: usize,
    pub config_budget: Duration,
    pub budget: Duration,
    pub timeout: Duration,
    pub poll: Poll,
    pub wait_quiet: Option<Duration>,
    pub quiet_below: f64,
    pub json: Option<PathBuf>,
    pub raw: bool,
    pub quiet: bool,
}

/// The result of parsing: options to run, or a text to print and exit 0.
pub enum Parsed {
    Run(Box<Options>),
    Help,
}

fn list<T>(
    text: &str,
    flag: &str,
    item: impl Fn(&str) -> Result<T, String>,
) -> Result<Vec<T>, String> {
    let v = text
        .split(',')
        .map(str::trim)
        .filter(|s| !s.is_empty())
        .map(|s| item(s).map_err(|e| format!("{flag}: {s:?}: {e}")))
        .collect::<Result<Vec<T>, String>>()?;
    if v.is_empty() {
        return Err(format!("{flag}: empty list"));
    }
    Ok(v)
}

fn positive(s: &str) -> Result<usize, String> {
    match s.replace('_', "").parse::<usize>() {
        Ok(0) => Err("must be at least 1".into()),
        Ok(n) => Ok(n),
        Err(_) => Err("not a whole number".into()),
    }
}

fn bytes(s: &str) -> Result<usize, String> {
    match parse_bytes(s)? {
        0 => Err("must be at least 1 byte".into()),
        n => usize::try_from(n).map_err(|_| "too large".to_string()),
    }
}

fn seconds(s: &str) -> Result<Duration, String> {
    match s.parse::<f64>() {
        Ok(x) if x > 0.0 && x.is_finite() => Ok(Duration::from_secs_f64(x)),
        _ => Err("expected a positive number of seconds".into()),
    }
}

fn key_value(s: &str) -> Result<(String, String), String> {
    let (k, v) = s.split_once('=').ok_or("expected KEY=VALUE")?;
    let k = k.trim();
    if k.is_empty() {
        return Err("empty key".into());
    }
    Ok((k.to_string(), v.trim().to_string()))
}

/// `NAME:K=V,K=V` (the parameter list may be empty: `NAME:`).
fn named_variant(s: &str, backend: BackendKind) -> Result<VariantSpec, String> {
    let (name, rest) = s.split_once(':').ok_or("expected NAME:K=V[,K=V...]")?;
    let name = name.trim();
    if name.is_empty()
        || !name
            .chars()
            .all(|c| c.is_ascii_alphanumeric() || "-_.".contains(c))
    {
        return Err(format!(
            "variant name {name:?}: use letters, digits, '-', '_' or '.'"
        ));
    }
    let params = rest
        .split(',')
        .map(str::trim)
        .filter(|p| !p.is_empty())
        .map(key_value)
        .collect::<Result<Vec<_>, _>>()?;
    Ok(VariantSpec {
        backend,
        name: name.to_string(),
        params,
        contiguous: false,
    })
}

pub fn parse(args: impl IntoIterator<Item = String>) -> Result<Parsed, String> {
    let mut o = Options {
        preset: "default",
        op: Op::Write,
        mem: MemKind::Dram,
        counts: vec![256, 1024, 4096, 16384],
        sizes: vec![4096],
        inflight: vec![1, 8],
        seed: 1,
        max_buffer: 1536 << 20,
        variants: Vec::new(),
        model: false,
        rounds: 2,
        warmup: 2,
        iters: 20,
        min_iters: 3,
        config_budget: Duration::from_secs(2),
        budget: Duration::from_secs(1800),
        timeout: Duration::from_secs(60),
        poll: Poll::Yield,
        wait_quiet: None,
        quiet_below: 0.25,
        json: None,
        raw: false,
        quiet: false,
    };
    let mut backends = vec![BackendKind::Bounce, BackendKind::Ucx];
    let mut bounce_params: Vec<(String, String)> = Vec::new();
    let mut ucx_params: Vec<(String, String)> = Vec::new();
    let mut extra: Vec<VariantSpec> = Vec::new();

    let mut args = args.into_iter();
    while let Some(arg) = args.next() {
        let (flag, inline) = match arg.split_once('=') {
            Some((f, v)) if f.starts_with("--") => (f.to_string(), Some(v.to_string())),
            _ => (arg.clone(), None),
        };
        let mut value = || -> Result<String, String> {
            inline
                .clone()
                .or_else(|| args.next())
                .ok_or_else(|| format!("{flag} needs a value"))
        };
        match flag.as_str() {
            "-h" | "--help" => return Ok(Parsed::Help),
            "--quick" => {
                o.preset = "quick";
                o.counts = vec![256, 1024, 4096, 16384];
                o.sizes = vec![4096];
                o.inflight = vec![1, 8];
                o.rounds = 2;
                o.warmup = 1;
                o.iters = 10;
                o.min_iters = 2;
                o.config_budget = Duration::from_secs(1);
            }
            "--full" => {
                o.preset = "full";
                o.counts = vec![256, 1024, 4096, 16384];
                o.sizes = vec![1024, 4096, 16384, 65536];
                o.inflight = vec![1, 8, 32, 128];
                o.rounds = 2;
                o.iters = 20;
                o.config_budget = Duration::from_secs(2);
            }
            "--op" => {
                o.op = match value()?.to_ascii_lowercase().as_str() {
                    "write" => Op::Write,
                    "read" => Op::Read,
                    other => return Err(format!("--op: expected write or read, got {other:?}")),
                }
            }
            "--mem" => {
                o.mem =
                    match value()?.to_ascii_lowercase().as_str() {
                        "dram" => MemKind::Dram,
                        "vram" => return Err(
                            "--mem vram: this benchmark measures host memory; `bounce-vram bench` \
                             measures GPU memory (docs/gpu.md)"
                                .into(),
                        ),
                        other => return Err(format!("--mem: expected dram, got {other:?}")),
                    }
            }
            "-c" | "--counts" => o.counts = list(&value()?, &flag, positive)?,
            "-s" | "--sizes" => o.sizes = list(&value()?, &flag, bytes)?,
            "-f" | "--inflight" => o.inflight = list(&value()?, &flag, positive)?,
            "--seed" => {
                o.seed = value()?
                    .parse()
                    .map_err(|_| "--seed: not a whole number".to_string())?
            }
            "--max-buffer" => {
                o.max_buffer = bytes(&value()?).map_err(|e| format!("{flag}: {e}"))?
            }
            "--backends" => {
                backends = list(&value()?, &flag, |s| {
                    match s.to_ascii_uppercase().as_str() {
                        "BOUNCE" => Ok(BackendKind::Bounce),
                        "UCX" => Ok(BackendKind::Ucx),
                        _ => Err("expected BOUNCE or UCX".to_string()),
                    }
                })?;
                backends.dedup();
            }
            "--bounce-param" => {
                bounce_params.push(key_value(&value()?).map_err(|e| format!("{flag}: {e}"))?)
            }
            "--ucx-param" => {
                ucx_params.push(key_value(&value()?).map_err(|e| format!("{flag}: {e}"))?)
            }
            "--ucx-variant" => extra.push(
                named_variant(&value()?, BackendKind::Ucx).map_err(|e| format!("{flag}: {e}"))?,
            ),
            "--bounce-variant" => extra.push(
                named_variant(&value()?, BackendKind::Bounce)
                    .map_err(|e| format!("{flag}: {e}"))?,
            ),
            "--model" => o.model = true,
            "-w" | "--warmup" => {
                o.warmup = value()?
                    .parse()
                    .map_err(|_| format!("{flag}: not a whole number"))?
            }
            "-r" | "--rounds" => {
                o.rounds = positive(&value()?).map_err(|e| format!("{flag}: {e}"))?
            }
            "-i" | "--iters" => {
                o.iters = positive(&value()?).map_err(|e| format!("{flag}: {e}"))?
            }
            "--min-iters" => {
                o.min_iters = positive(&value()?).map_err(|e| format!("{flag}: {e}"))?
            }
            "--config-budget" => {
                o.config_budget = seconds(&value()?).map_err(|e| format!("{flag}: {e}"))?
            }
            "--budget" => o.budget = seconds(&value()?).map_err(|e| format!("{flag}: {e}"))?,
            "--wait-quiet" => {
                o.wait_quiet = Some(seconds(&value()?).map_err(|e| format!("{flag}: {e}"))?)
            }
            "--quiet-below" => {
                o.quiet_below = match value()?.parse::<f64>() {
                    Ok(c) if c > 0.0 && c.is_finite() => c,
                    _ => return Err(format!("{flag}: expected a positive number of CPU cores")),
                }
            }
            "--timeout" => o.timeout = seconds(&value()?).map_err(|e| format!("{flag}: {e}"))?,
            "--poll" => {
                let v = value()?;
                o.poll = match v.as_str() {
                    "yield" => Poll::Yield,
                    "spin" => Poll::Spin,
                    s => match s.strip_prefix("sleep=").map(str::parse::<u64>) {
                        Some(Ok(us)) => Poll::Sleep(Duration::from_micros(us)),
                        _ => {
                            return Err(format!(
                                "--poll: expected yield, spin or sleep=US, got {v:?}"
                            ))
                        }
                    },
                }
            }
            "--json" => o.json = Some(PathBuf::from(value()?)),
            "--raw" => o.raw = true,
            "-q" | "--quiet" => o.quiet = true,
            other => return Err(format!("unknown argument {other:?} (see --help)")),
        }
    }

    for (k, v) in &bounce_params {
        check_loopback(k, v)?;
    }
    for spec in &extra {
        if spec.backend == BackendKind::Bounce {
            for (k, v) in &spec.params {
                check_loopback(k, v)?;
            }
        }
    }
    o.min_iters = o.min_iters.min(o.iters);

    // Default rows first (BOUNCE, UCX), then the labelled variants in the
    // order given, then the model row.
    for b in &backends {
        let params = match b {
            BackendKind::Bounce => bounce_params.clone(),
            BackendKind::Ucx => ucx_params.clone(),
        };
        o.variants.push(VariantSpec {
            backend: *b,
            name: String::new(),
            params,
            contiguous: false,
        });
    }
    for mut spec in extra {
        if spec.backend == BackendKind::Bounce {
            let mut p = bounce_params.clone();
            p.extend(spec.params);
            spec.params = p;
        }
        if o.variants.iter().any(|v| v.label() == spec.label()) {
            return Err(format!("variant {} given twice", spec.label()));
        }
        o.variants.push(spec);
    }
    if o.model {
        o.variants.push(VariantSpec {
            backend: BackendKind::Ucx,
            name: "1-desc".into(),
            params: ucx_params,
            contiguous: true,
        });
    }
    if o.variants.is_empty() {
        return Err("nothing to run: --backends is empty and no variant was given".into());
    }
    Ok(Parsed::Run(Box::new(o)))
}

/// The bench is single-host: BOUNCE's control socket must stay on loopback.
fn check_loopback(key: &str, value: &str) -> Result<(), String> {
    let off = matches!(
        value.to_ascii_lowercase().as_str(),
        "0" | "false" | "off" | "no"
    );
    match key {
        "control_bind_loopback" if off => {
            Err("control_bind_loopback=false: the bench runs on one host and keeps BOUNCE's control socket on 127.0.0.1".into())
        }
        "control_interface" if !value.is_empty() => {
            Err("control_interface: the bench binds BOUNCE's control socket to 127.0.0.1 only".into())
        }
        _ => Ok(()),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn run(args: &[&str]) -> Result<Options, String> {
        match parse(args.iter().map(|s| s.to_string()))? {
            Parsed::Run(o) => Ok(*o),
            Parsed::Help => Err("help".into()),
        }
    }

    #[test]
    fn lists_presets_and_variants() {
        let o = run(&[
            "--quick",
            "--counts",
            "4096",
            "--sizes=1k,64KiB",
            "-f",
            "1,8,128",
        ])
        .unwrap();
        assert_eq!(o.counts, vec![4096]);
        assert_eq!(o.sizes, vec![1024, 65536]);
        assert_eq!(o.inflight, vec![1, 8, 128]);
        assert_eq!(o.iters, 10);
        let o = run(&[
            "--bounce-param",
            "max_chunk_size_bytes=4MiB",
            "--ucx-variant",
            "nt2:num_threads=2",
            "--bounce-variant",
            "w16:max_inflight_chunks_per_request=16",
            "--model",
        ])
        .unwrap();
        let labels: Vec<String> = o.variants.iter().map(VariantSpec::label).collect();
        assert_eq!(
            labels,
            ["BOUNCE", "UCX", "UCX[nt2]", "BOUNCE[w16]", "UCX[1-desc]"]
        );
        assert_eq!(
            o.variants[3].params.len(),
            2,
            "bounce variants inherit --bounce-param"
        );
        assert!(o.variants[4].contiguous);
    }

    #[test]
    fn reserved_and_bad_options_are_clear_errors() {
        assert!(run(&["--mem", "vram"])
            .unwrap_err()
            .contains("bounce-vram bench"));
        assert_eq!(run(&["--op", "read"]).unwrap().op, Op::Read);
        assert!(run(&["--op", "pull"]).is_err());
        assert!(run(&["--counts", "0"]).is_err());
        assert!(run(&["--bounce-param", "control_bind_loopback=false"]).is_err());
        assert!(run(&["--ucx-variant", "a:b=c", "--ucx-variant", "a:"])
            .unwrap_err()
            .contains("twice"));
        assert!(run(&["--frobnicate"]).is_err());
    }
}
