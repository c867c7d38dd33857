//! The command line.

use super::*;

/// What the binary does (`help` prints the usage at the top of main.rs).
#[derive(Clone, Copy, Debug, PartialEq, Eq, clap::ValueEnum)]
pub(super) enum Cmd {
    Test,
    Bench,
    Faults,
    Mapping,
    /// The target process (started by the initiator).
    Serve,
    Help,
}

/// The operation `bench` measures.
#[derive(Clone, Copy, Debug, PartialEq, Eq, clap::ValueEnum)]
pub(super) enum OpArg {
    Write,
    Read,
}

/// A byte count: `4096`, `4KiB`, `1GiB` (as the backend's parameters).
fn bytes(s: &str) -> Result<usize, String> {
    let n = nixl_bounce::config::parse_bytes(s).map_err(|e| e.to_string())?;
    usize::try_from(n).map_err(|_| format!("{s} does not fit in memory"))
}

/// A `K=V` backend parameter.
fn key_value(s: &str) -> Result<(String, String), String> {
    s.split_once('=')
        .map(|(k, v)| (k.to_string(), v.to_string()))
        .ok_or_else(|| format!("{s:?} is not K=V"))
}

// The command line as clap reads it (every option goes with every
// command, as the initiator forwards some to its target).
#[derive(Clone, Debug, clap::Parser)]
#[command(
    name = "bounce-vram",
    about = "VRAM transfers between two processes, through BOUNCE or UCX (`bounce-vram help`: the full usage)"
)]
struct Cli {
    #[arg(value_enum, default_value = "help")]
    command: Cmd,
    #[arg(long, default_value = "BOUNCE")]
    backend: String,
    /// The row label in bench's output (default: the backend).
    #[arg(long, default_value = "")]
    label: String,
    /// A backend parameter of both processes (repeatable; a later one
    /// replaces an earlier one of the same key).
    #[arg(long = "param", value_parser = key_value)]
    params: Vec<(String, String)>,
    /// A backend parameter of the target process only.
    #[arg(long = "target-param", value_parser = key_value)]
    target_params: Vec<(String, String)>,
    #[arg(long, default_value_t = 0)]
    device: usize,
    #[arg(long, default_value_t = 0)]
    target_device: usize,
    #[arg(long, value_parser = bytes, default_value = "1GiB")]
    buffer: usize,
    #[arg(long, value_delimiter = ',', action = clap::ArgAction::Set, overrides_with = "counts", default_value = "1024,4096,16384")]
    counts: Vec<usize>,
    #[arg(long, value_delimiter = ',', value_parser = bytes, action = clap::ArgAction::Set, overrides_with = "sizes", default_value = "4KiB")]
    sizes: Vec<usize>,
    #[arg(long, default_value_t = 20)]
    iters: usize,
    #[arg(long, default_value_t = 128)]
    concurrent: usize,
    #[arg(long)]
    json: Option<String>,
    #[arg(long)]
    expect_fallback: bool,
    #[arg(long, value_enum, default_value = "write")]
    op: OpArg,
    /// `bench`: idle microseconds before each request (outside the timing).
    #[arg(long, default_value_t = 0)]
    gap_us: u64,
    /// `bench`: prepare each shape's request once and post it again every
    /// iteration (and the concurrent requests once for their three rounds),
    /// as a client with a fixed pattern does; default: a new request each
    /// time, as vLLM makes them.
    #[arg(long)]
    repost: bool,
}

#[derive(Clone)]
pub(super) struct Args {
    pub(super) command: Cmd,
    pub(super) backend: String,
    pub(super) label: String,
    pub(super) params: Vec<(String, String)>,
    pub(super) device: usize,
    pub(super) target_device: usize,
    pub(super) buffer: usize,
    pub(super) counts: Vec<usize>,
    pub(super) sizes: Vec<usize>,
    pub(super) iters: usize,
    pub(super) concurrent: usize,
    pub(super) json: Option<String>,
    pub(super) expect_fallback: bool,
    /// Parameters for the target process only (e.g. `enable=false`).
    pub(super) target_params: Vec<(String, String)>,
    /// What `bench` measures: WRITEs to the target, or READs from it.
    pub(super) op: XferOp,
    /// `bench`: idle microseconds before each request (outside the timing).
    pub(super) gap_us: u64,
    /// `bench`: one request per shape, posted again every iteration.
    pub(super) repost: bool,
}

impl Args {
    pub(super) fn parse() -> Args {
        let cli = <Cli as clap::Parser>::parse();
        let mut params = vec![("control_bind_loopback".to_string(), "true".to_string())];
        for (k, v) in cli.params {
            params.retain(|(key, _)| *key != k);
            params.push((k, v));
        }
        let mut a = Args {
            command: cli.command,
            backend: cli.backend,
            label: cli.label,
            params,
            device: cli.device,
            target_device: cli.target_device,
            buffer: cli.buffer,
            counts: cli.counts,
            sizes: cli.sizes,
            iters: cli.iters,
            concurrent: cli.concurrent,
            json: cli.json,
            expect_fallback: cli.expect_fallback,
            op: match cli.op {
                OpArg::Write => XferOp::Write,
                OpArg::Read => XferOp::Read,
            },
            target_params: cli.target_params,
            gap_us: cli.gap_us,
            repost: cli.repost,
        };
        if a.backend != "BOUNCE" {
            a.params.retain(|(k, _)| k != "control_bind_loopback");
        }
        if a.command == Cmd::Faults {
            // The drills hold the bounce path's stages (so not the
            // peer-mapped path); small chunks and arenas: a drill's WRITE is
            // 32 chunks, running when the fault hits.
            for (k, v) in [
                ("max_chunk_size_bytes", "2MiB"),
                ("arena_size_bytes", "16MiB"),
                ("enable_peer_map", "false"),
            ] {
                if !a.params.iter().any(|(key, _)| key == k) {
                    a.params.push((k.into(), v.into()));
                }
            }
        }
        if a.label.is_empty() {
            a.label = a.backend.clone();
        }
        a
    }

    /// The path an eligible transfer should take with these parameters.
    pub(super) fn expected_path(&self) -> Path {
        let off = |list: &[(String, String)], key: &str| {
            list.iter()
                .any(|(k, v)| k == key && matches!(v.as_str(), "false" | "0" | "off" | "no"))
        };
        if self.backend != "BOUNCE"
            || self.expect_fallback
            || off(&self.params, "enable")
            || off(&self.target_params, "enable")
        {
            Path::Ucx
        } else if off(&self.params, "enable_peer_map")
            || off(&self.target_params, "enable_peer_map")
        {
            Path::Bounce
        } else {
            Path::Peer
        }
    }

    /// The usable arena capacity these parameters give.
    pub(super) fn arena_capacity(&self) -> u64 {
        let size = self
            .params
            .iter()
            .find(|(k, _)| k == "arena_size_bytes")
            .and_then(|(_, v)| nixl_bounce::config::parse_bytes(v).ok())
            .unwrap_or(256 << 20);
        1u64 << (63 - size.leading_zeros())
    }

    /// The options the target process needs.
    pub(super) fn forward(&self) -> Vec<String> {
        let mut v = vec![
            "--backend".into(),
            self.backend.clone(),
            "--buffer".into(),
            self.buffer.to_string(),
            "--target-device".into(),
            self.target_device.to_string(),
        ];
        for (k, val) in &self.params {
            if self.target_params.iter().any(|(tk, _)| tk == k) {
                continue;
            }
            v.push("--param".into());
            v.push(format!("{k}={val}"));
        }
        for (k, val) in &self.target_params {
            v.push("--param".into());
            v.push(format!("{k}={val}"));
        }
        v
    }
}
