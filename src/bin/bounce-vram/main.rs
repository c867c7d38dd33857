//! VRAM transfers between two processes, through BOUNCE or UCX: the GPU
//! tests and the GPU benchmark of nixl-bounce in one binary (the GPU machine
//! has no cargo, so it runs this prebuilt; see docs/gpu.md).
//!
//! The initiator process re-executes itself as the target (`serve`, driven
//! over stdin/stdout). Both sides compute the same seeded plans and
//! patterns; the target checks its own VRAM byte-exact after each WRITE;
//! after each READ (the initiator reads the target's VRAM into its own) the
//! initiator checks its VRAM and the target that its source is unchanged.
//!
//!   bounce-vram test  [--device N] [--target-device N] [--param K=V]...
//!   bounce-vram bench [--backend BOUNCE|UCX] [--label L] [--param K=V]...
//!                     [--counts 1024,4096,16384] [--sizes 4096] [--iters N]
//!                     [--concurrent 128] [--json PATH] [--op write|read]
//!                     [--gap-us N] [--repost]
//!                     (--gap-us: an idle pause before each request, outside
//!                     the timing, as between a real client's requests)
//!                     (--repost: one request per shape, prepared once and
//!                     posted every iteration; default: a new one each time)
//!                     (--op read: the initiator READs the target's buffer; the
//!                     target is the data owner)
//!   bounce-vram faults [--device N] [--target-device N] [--param K=V]...
//!   bounce-vram mapping [--device N] [--target-device N] [--buffer BYTES]
//!                     [--iters N] [--json PATH]
//!                     (no NIXL transfer: what a CUDA IPC mapping of the
//!                     target's buffer allows; cuMemcpyDtoDAsync and the copy
//!                     kernel, contiguous and scattered, local->local against
//!                     local->peer and peer->local through the mapping)
//!
//! Same-host peers take the peer-mapped path by default (one kernel through
//! a CUDA IPC mapping of the target's buffer); `--param
//! enable_peer_map=false` tests and measures the bounce path instead. Each
//! case checks from the counters which path carried it (`peer`, `bounce`
//! or `ucx`).
//!
//! `faults` runs the fault drills with VRAM arenas on both sides (2 MiB
//! chunks, 16 MiB arenas unless given): a WRITE released during gather,
//! write and scatter (stages held by failpoints), and the target killed
//! mid-transfer; each checks the request ends within its bound, both arenas
//! drain with every byte accounted for, nothing outside the destinations
//! changed, and the next WRITE is byte-exact.
//!
//! Without a CUDA driver every command prints `SKIP: ...` and exits 0.

mod bench;
mod cases;
mod cli;
mod faults;
mod initiator;
mod mapping;
mod nixl;
mod plans;
mod target;

use bench::*;
use cases::*;
use cli::*;
use faults::*;
use initiator::*;
use mapping::*;
use nixl::*;
use plans::*;
use target::*;

use std::collections::BTreeMap;
use std::process::Command;
use std::sync::Arc;
use std::time::{Duration, Instant};

use cudarc::driver::{result, sys, CudaEvent, CudaStream};
use nixl_bounce::copy::cuda::{CudaDevice, CudaRuntime};
use nixl_bounce::copy::ipc::{IpcCopier, IpcMapping, IpcTable, IPC_HANDLE_LEN};
use nixl_bounce::dataplane::vram::DeviceArena;
use nixl_bounce::harness::child::{self, ChildPeer};
use nixl_sys::{
    Agent, MemType, OptArgs, Params, RegistrationHandle, XferDescList, XferOp, XferRequest,
    XferStatus,
};

const TIMEOUT: Duration = Duration::from_secs(60);

fn main() {
    let args = Args::parse();
    TARGET_DEVICE.store(
        args.target_device as u64,
        std::sync::atomic::Ordering::Relaxed,
    );
    if args.command == Cmd::Help {
        println!(
            "{}",
            include_str!("main.rs")
                .lines()
                .take_while(|l| l.starts_with("//!"))
                .map(|l| l.trim_start_matches("//!").trim_start())
                .collect::<Vec<_>>()
                .join("\n")
        );
        return;
    }
    if let Err(e) = CudaRuntime::probe().and_then(|c| c.device(args.device).map(|_| ())) {
        println!("SKIP: no usable CUDA device ({e})");
        return;
    }
    let ok = match args.command {
        Cmd::Serve => {
            serve(&args);
            true
        }
        Cmd::Test => run_tests(&args),
        Cmd::Bench => run_bench(&args),
        Cmd::Faults => run_faults(&args),
        Cmd::Mapping => run_mapping(&args),
        Cmd::Help => true, // answered above
    };
    std::process::exit(if ok { 0 } else { 1 });
}
