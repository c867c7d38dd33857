//! Command line of the `bench` binary: options, presets and `--help`.

use std::path::PathBuf;
use std::time::Duration;

use clap::{ArgAction, CommandFactory, FromArgMatches, Parser};
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

PRESETS (lists and iteration counts; the flags given override them):
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

fn positive(s: &str) -> Result<usize, String> {
    match s.trim().replace('_', "").parse::<usize>() {
        Ok(0) => Err("must be at least 1".into()),
        Ok(n) => Ok(n),
        Err(_) => Err("not a whole number".into()),
    }
}

fn bytes(s: &str) -> Result<usize, String> {
    match parse_bytes(s.trim())? {
        0 => Err("must be at least 1 byte".into()),
        n => usize::try_from(n).map_err(|_| "too large".to_string()),
    }
}

fn backend(s: &str) -> Result<BackendKind, String> {
    match s.trim().to_ascii_uppercase().as_str() {
        "BOUNCE" => Ok(BackendKind::Bounce),
        "UCX" => Ok(BackendKind::Ucx),
        _ => Err("expected BOUNCE or UCX".into()),
    }
}

fn op(s: &str) -> Result<Op, String> {
    match s.to_ascii_lowercase().as_str() {
        "write" => Ok(Op::Write),
        "read" => Ok(Op::Read),
        _ => Err("expected write or read".into()),
    }
}

fn mem_kind(s: &str) -> Result<MemKind, String> {
    match s.to_ascii_lowercase().as_str() {
        "dram" => Ok(MemKind::Dram),
        "vram" => Err("this benchmark measures host memory; `bounce-vram bench` \
                       measures GPU memory (docs/gpu.md)"
            .into()),
        _ => Err("expected dram".into()),
    }
}

fn cores(s: &str) -> Result<f64, String> {
    match s.parse::<f64>() {
        Ok(c) if c > 0.0 && c.is_finite() => Ok(c),
        _ => Err("expected a positive number of CPU cores".into()),
    }
}

fn poll(s: &str) -> Result<Poll, String> {
    match s {
        "yield" => Ok(Poll::Yield),
        "spin" => Ok(Poll::Spin),
        _ => match s.strip_prefix("sleep=").map(str::parse::<u64>) {
            Some(Ok(us)) => Ok(Poll::Sleep(Duration::from_micros(us))),
            _ => Err("expected yield, spin or sleep=US".into()),
        },
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

/// A parser of `NAME:K=V,K=V` for `backend` (the parameter list may be
/// empty: `NAME:`).
fn named_variant(
    backend: BackendKind,
) -> impl Fn(&str) -> Result<VariantSpec, String> + Clone + Send + Sync + 'static {
    move |s| variant_of(s, backend)
}

fn variant_of(s: &str, backend: BackendKind) -> Result<VariantSpec, String> {
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

/// The command line as clap reads it; [`parse`] turns it into [`Options`]
/// (the preset's values, then the flags given). `--help` prints [`USAGE`].
#[derive(Parser, Debug)]
#[command(
    name = "bench",
    override_help = USAGE,
    disable_version_flag = true,
    args_override_self = true
)]
struct Args {
    #[arg(long, conflicts_with = "full")]
    quick: bool,
    #[arg(long)]
    full: bool,
    #[arg(long, value_parser = op)]
    op: Option<Op>,
    #[arg(long, value_parser = mem_kind)]
    mem: Option<MemKind>,
    #[arg(short = 'c', long, value_delimiter = ',', value_parser = positive, action = ArgAction::Set)]
    counts: Option<Vec<usize>>,
    #[arg(short = 's', long, value_delimiter = ',', value_parser = bytes, action = ArgAction::Set)]
    sizes: Option<Vec<usize>>,
    #[arg(short = 'f', long, value_delimiter = ',', value_parser = positive, action = ArgAction::Set)]
    inflight: Option<Vec<usize>>,
    #[arg(long)]
    seed: Option<u64>,
    #[arg(long, value_parser = bytes)]
    max_buffer: Option<usize>,
    #[arg(long, value_delimiter = ',', value_parser = backend, action = ArgAction::Set)]
    backends: Option<Vec<BackendKind>>,
    #[arg(long = "bounce-param", value_parser = key_value)]
    bounce_params: Vec<(String, String)>,
    #[arg(long = "ucx-param", value_parser = key_value)]
    ucx_params: Vec<(String, String)>,
    #[arg(long = "ucx-variant", value_parser = named_variant(BackendKind::Ucx))]
    ucx_variants: Vec<VariantSpec>,
    #[arg(long = "bounce-variant", value_parser = named_variant(BackendKind::Bounce))]
    bounce_variants: Vec<VariantSpec>,
    #[arg(long)]
    model: bool,
    #[arg(short = 'w', long)]
    warmup: Option<usize>,
    #[arg(short = 'r', long, value_parser = positive)]
    rounds: Option<usize>,
    #[arg(short = 'i', long, value_parser = positive)]
    iters: Option<usize>,
    #[arg(long, value_parser = positive)]
    min_iters: Option<usize>,
    #[arg(long, value_parser = seconds)]
    config_budget: Option<Duration>,
    #[arg(long, value_parser = seconds)]
    budget: Option<Duration>,
    #[arg(long, value_parser = seconds)]
    wait_quiet: Option<Duration>,
    #[arg(long, value_parser = cores)]
    quiet_below: Option<f64>,
    #[arg(long, value_parser = seconds)]
    timeout: Option<Duration>,
    #[arg(long, value_parser = poll)]
    poll: Option<Poll>,
    #[arg(long)]
    json: Option<PathBuf>,
    #[arg(long)]
    raw: bool,
    #[arg(short = 'q', long)]
    quiet: bool,
}

/// Parses the arguments (without the program name). A usage error is
/// clap's text (with the usage line); `--help` is [`Parsed::Help`].
pub fn parse(args: impl IntoIterator<Item = String>) -> Result<Parsed, String> {
    let argv = std::iter::once("bench".to_string()).chain(args);
    let usage = |e: clap::Error| e.to_string().trim_end().to_string();
    let matches = match Args::command().try_get_matches_from(argv) {
        Ok(m) => m,
        Err(e) if e.kind() == clap::error::ErrorKind::DisplayHelp => return Ok(Parsed::Help),
        Err(e) => return Err(usage(e)),
    };
    let a = Args::from_arg_matches(&matches).map_err(usage)?;
    // The labelled variants in the order given, whichever their backend.
    let at = |id: &str| -> Vec<usize> {
        matches
            .indices_of(id)
            .map(Iterator::collect)
            .unwrap_or_default()
    };
    let mut extra: Vec<(usize, VariantSpec)> = at("ucx_variants")
        .into_iter()
        .zip(a.ucx_variants)
        .chain(at("bounce_variants").into_iter().zip(a.bounce_variants))
        .collect();
    extra.sort_by_key(|(at, _)| *at);
    let extra: Vec<VariantSpec> = extra.into_iter().map(|(_, v)| v).collect();
    // The preset's values; a flag given overrides them.
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
        model: a.model,
        rounds: 2,
        warmup: 2,
        iters: 20,
        min_iters: 3,
        config_budget: Duration::from_secs(2),
        budget: Duration::from_secs(1800),
        timeout: Duration::from_secs(60),
        poll: Poll::Yield,
        wait_quiet: a.wait_quiet,
        quiet_below: 0.25,
        json: a.json,
        raw: a.raw,
        quiet: a.quiet,
    };
    if a.quick {
        o.preset = "quick";
        o.warmup = 1;
        o.iters = 10;
        o.min_iters = 2;
        o.config_budget = Duration::from_secs(1);
    }
    if a.full {
        o.preset = "full";
        o.sizes = vec![1024, 4096, 16384, 65536];
        o.inflight = vec![1, 8, 32, 128];
    }
    fn set<T>(field: &mut T, value: Option<T>) {
        if let Some(v) = value {
            *field = v;
        }
    }
    set(&mut o.op, a.op);
    set(&mut o.mem, a.mem);
    set(&mut o.counts, a.counts);
    set(&mut o.sizes, a.sizes);
    set(&mut o.inflight, a.inflight);
    set(&mut o.seed, a.seed);
    set(&mut o.max_buffer, a.max_buffer);
    set(&mut o.warmup, a.warmup);
    set(&mut o.rounds, a.rounds);
    set(&mut o.iters, a.iters);
    set(&mut o.min_iters, a.min_iters);
    set(&mut o.config_budget, a.config_budget);
    set(&mut o.budget, a.budget);
    set(&mut o.quiet_below, a.quiet_below);
    set(&mut o.timeout, a.timeout);
    set(&mut o.poll, a.poll);
    let mut backends = a
        .backends
        .unwrap_or(vec![BackendKind::Bounce, BackendKind::Ucx]);
    backends.dedup();
    let (bounce_params, ucx_params) = (a.bounce_params, a.ucx_params);

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
        // A flag given overrides the preset wherever it stands; labelled
        // variants keep the order given; a repeated flag takes the last;
        // list items are trimmed.
        let o = run(&[
            "--counts=4096",
            "--quick",
            "--bounce-variant",
            "a:",
            "--ucx-variant",
            "b:",
            "-s",
            "1k",
            "-s",
            "2k",
            "--rounds",
            "2",
            "--rounds",
            "3",
            "-f",
            "1, 8",
        ])
        .unwrap();
        assert_eq!((o.counts, o.sizes, o.iters), (vec![4096], vec![2048], 10));
        assert_eq!((o.rounds, o.inflight), (3, vec![1, 8]));
        let labels: Vec<String> = o.variants.iter().map(VariantSpec::label).collect();
        assert_eq!(labels, ["BOUNCE", "UCX", "BOUNCE[a]", "UCX[b]"]);
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
