#!/usr/bin/env python3
"""vLLM's NIXL KV-transfer pattern, driven through the official NIXL Python API.

Reproduces what vLLM's NIXL connector (vllm/distributed/kv_transfer/
kv_connector/v1/nixl/worker.py) does between a prefill worker and a decode
worker, for one TP rank pair on one host, with any backend (BOUNCE, UCX):

  * two processes: the prefill "owner" (a spawned child) holds the KV cache the
    decode "reader" (this process) pulls with READs;
  * each side creates its agent as vLLM does:
        nixl_agent(str(uuid4()), nixl_agent_config(backends=[B], capture_telemetry=True))
    and for UCX, as vLLM creates it, with num_threads=4;
  * the KV cache is one tensor per layer shaped
        (2, num_blocks, block_size, kv_heads_per_rank, head_dim), bf16,
    registered as two regions per layer (K and V) with
        register_memory(get_reg_descs([(base, num_blocks*block_len, dev, ""), ...], mem));
  * metadata goes one way only, as in vLLM's handshake: the reader calls
    add_remote_agent(owner metadata); the owner never loads the reader's;
    the metadata travels over a multiprocessing pipe (no etcd, no side channel);
  * both sides describe the whole cache as ONE descriptor list, region-major
    (every block of region 0, then region 1, ...), which the reader prepares
    twice: prep_xfer_dlist("NIXL_INIT_AGENT", local) and
    prep_xfer_dlist(owner_name, remote);
  * per request: descriptor ids region*num_blocks + block for the request's
    scattered blocks, region-major, then
        make_prepped_xfer("READ", local, local_ids, remote, remote_ids, notif_msg=b"<req>:<tp>")
        transfer -> poll check_xfer_state to DONE -> get_xfer_telemetry -> release_xfer_handle;
    the owner polls get_new_notifs() and records when each request's
    notification arrived.

Times are taken with time.perf_counter(), which is CLOCK_MONOTONIC on Linux and
therefore one clock for both processes of the host: the notification's
arrival at the owner is reported relative to the reader's post (transfer()).
get_xfer_telemetry (kept per sample in the JSON) uses the same clock: in the
1.5.1 wheel startTime is the post in steady-clock microseconds, postDuration
the transfer() call itself and xferDuration post to DONE (as seen by the poll
that saw DONE). The JSON also keeps post_call_s (how long transfer() blocked):
equal to transfer_s means transfer() returned DONE, i.e. the post was
synchronous.

Every transfer is checked byte-exact: before each request the owner writes a
fresh pattern into the request's source blocks (a function of a per-request
seed, the region and the SOURCE block id) and the reader zeroes its
destination blocks; after DONE the reader recomputes the pattern and compares
every destination block (on the GPU with torch, on the device).

Cases (--cases, comma separated, grammar tp<T>-<tokens>[k][x<in flight>]):
  tp1-8k     one 8192-token prompt at TP=1 (32 KiB blocks, 32,768 descriptors)
  tp4-8k     the same at TP=4 (2 KV heads per rank: 8 KiB blocks)
  tp4-2kx8   eight 2048-token requests in flight (prepared and posted one after
             another, then all waited for; aggregate GB/s reported)
  tp4-128    a 128-token prompt (8 blocks x 64 regions = 512 descriptors)
Model: Llama-3.1-8B (32 layers, 8 KV heads, head_dim 128), block_size 16 (--block-size).
--scale F shrinks layers and tokens for CPU runs (--layers overrides layers).

Backends alternate iteration by iteration (--order alternate, the default),
each with its own agent pair, all alive through the case. --order blocked runs
one backend at a time with only its agents alive: an idle UCX agent made by
the Python API spins its progress thread (about 0.8 core each), which slows
whatever shares a small machine with it.

Memory: --device cuda puts the caches in VRAM as torch tensors (both
processes on --gpu / --owner-gpu); --device cpu in DRAM as numpy arrays (a
uint16 array stands in for bf16); --device torch-cpu in DRAM as torch tensors.
--reader-device puts the reader's cache alone elsewhere: --device cuda
--reader-device torch-cpu READs from the owner's VRAM into the reader's DRAM
(mixed memory). --op write turns the pattern around (not vLLM's): the
decode side WRITEs its blocks into the owner's cache, which checks them.

Examples:
  source scripts/setup.sh release
  python3 bench/vllm_pattern.py --device cuda --iters 20 --json out/vllm.json
  python3 bench/vllm_pattern.py --device cpu --scale 0.125 --iters 5      # DRAM, small
  python3 bench/vllm_pattern.py --device cpu --layers 4 --token-scale 1   # DRAM, real block counts
  python3 bench/vllm_pattern.py --bounce-param enable_peer_map=false      # BOUNCE settings

stdout: a table; --json PATH: every sample. Exit status 0 = all transfers
byte-exact and every notification arrived; otherwise the last line is "FAIL: ...".
"""

from __future__ import annotations

import argparse
import ctypes
import gc
import inspect
import json
import logging
import math
import multiprocessing as mp
import os
import platform
import re
import sys
import time
import traceback
import uuid

import numpy as np

# ---------------------------------------------------------------------------
# Model and cases
# ---------------------------------------------------------------------------

# Llama-3.1-8B's attention geometry; bf16 KV cache; vLLM's default block size.
MODEL = dict(name="Llama-3.1-8B", layers=32, kv_heads=8, head_dim=128, block_size=16, dtype_bytes=2)
DEFAULT_CASES = "tp1-8k,tp4-8k,tp4-2kx8,tp4-128"

# One clock for both processes (CLOCK_MONOTONIC on Linux). NIXL's telemetry
# startTime is std::chrono::steady_clock in microseconds: the same clock.
clock = time.perf_counter


class BenchError(Exception):
    """A failed transfer, a wrong byte, a missing notification, a dead owner."""


def log(msg: str) -> None:
    print(f"[vllm_pattern {os.getpid()}] {msg}", file=sys.stderr, flush=True)


def parse_case(spec: str, layers: int, token_scale: float, spare: float, block_size: int) -> dict:
    """Geometry of one case from its name (see the module docstring)."""
    m = re.fullmatch(r"tp(\d+)-(\d+)(k?)(?:x(\d+))?", spec.strip().lower())
    if not m:
        raise SystemExit(f"bad case {spec!r}: expected tp<T>-<tokens>[k][x<in flight>], e.g. tp4-2kx8")
    tp = int(m[1])
    tokens = int(m[2]) * (1024 if m[3] else 1)
    inflight = int(m[4] or 1)
    if tp < 1 or MODEL["kv_heads"] % tp:
        raise SystemExit(f"case {spec}: TP={tp} does not divide {MODEL['kv_heads']} KV heads")
    bs = block_size
    kvh = MODEL["kv_heads"] // tp
    scaled = max(bs, int(round(tokens * token_scale / bs)) * bs)
    blocks_per_req = math.ceil(scaled / bs)
    block_len = bs * kvh * MODEL["head_dim"] * MODEL["dtype_bytes"]
    # Enough blocks for every request in flight plus spare, so that the
    # request's blocks are scattered over the cache as in a busy server.
    num_blocks = max(blocks_per_req * inflight + 1, int(math.ceil(spare * blocks_per_req * inflight)))
    regions = 2 * layers
    return dict(
        name=spec.strip(), tp=tp, nominal_tokens=tokens, tokens=scaled, inflight=inflight,
        layers=layers, regions=regions, kv_heads_per_rank=kvh, head_dim=MODEL["head_dim"],
        block_size=bs, block_len=block_len, blocks_per_req=blocks_per_req, num_blocks=num_blocks,
        descs_per_req=blocks_per_req * regions, bytes_per_req=blocks_per_req * regions * block_len,
        cache_bytes_per_side=regions * num_blocks * block_len,
    )


# ---------------------------------------------------------------------------
# NIXL
# ---------------------------------------------------------------------------

def nixl_api():
    try:
        from nixl_cu13._api import nixl_agent, nixl_agent_config
    except Exception as e:  # noqa: BLE001
        raise BenchError(f"cannot import the NIXL Python API (nixl_cu13._api): {e!r}; "
                         f"PYTHONPATH={os.environ.get('PYTHONPATH')} (source scripts/setup.sh)")
    if not os.environ.get("NIXL_LOG_LEVEL"):
        # The wheel's Python logger prints an INFO line per agent and backend
        # on stdout; keep warnings and errors only (NIXL_LOG_LEVEL overrides).
        logging.getLogger("nixl").setLevel(logging.WARNING)
    return nixl_agent, nixl_agent_config


def make_agent(backend: str, ucx_threads: int, bounce_params=None):
    """An agent created the way vLLM creates it: uuid4 name, one backend,
    telemetry captured; UCX with num_threads (vLLM's default 4). BOUNCE gets
    its default settings unless `bounce_params` (then it is created with
    create_backend("BOUNCE", bounce_params))."""
    nixl_agent, nixl_agent_config = nixl_api()
    params = inspect.signature(nixl_agent_config).parameters
    kw = dict(backends=[backend])
    if "capture_telemetry" in params:
        kw["capture_telemetry"] = True
    late_params = None
    if backend != "UCX" and bounce_params:
        kw["backends"] = []
        late_params = dict(bounce_params)
    if backend == "UCX" and ucx_threads > 0:
        if "num_threads" in params:
            kw["num_threads"] = ucx_threads
        else:  # an older wheel: the same setting as a backend parameter
            kw["backends"] = []
            late_params = {"num_threads": str(ucx_threads)}
    agent = nixl_agent(str(uuid.uuid4()), nixl_agent_config(**kw))
    if late_params is not None:
        agent.create_backend(backend, late_params)
    if backend not in agent.backends:
        raise BenchError(f"backend {backend} was not created (plugins offered: {agent.plugin_list}; "
                         f"NIXL_PLUGIN_DIR={os.environ.get('NIXL_PLUGIN_DIR')})")
    return agent


def as_str(x) -> str:
    return x.decode() if isinstance(x, bytes) else x


def telemetry_dict(agent, handle):
    """get_xfer_telemetry as a dict (None when the agent captured none)."""
    try:
        t = agent.get_xfer_telemetry(handle)
    except Exception as e:  # noqa: BLE001
        return {"error": str(e)}
    return {k: int(getattr(t, k)) for k in ("startTime", "postDuration", "xferDuration", "totalBytes", "descCount")
            if hasattr(t, k)}


class BounceStats:
    """The BOUNCE plugin's counters (nixl_bounce_stats, exported by the
    libplugin_BOUNCE.so NIXL loaded into this process), to tell which route
    a request took. Optional: everything works without it."""

    def __init__(self):
        self.fn = None
        paths = set()
        try:
            with open("/proc/self/maps") as f:
                for line in f:
                    parts = line.split()
                    if len(parts) >= 6 and parts[5].endswith("/libplugin_BOUNCE.so"):
                        paths.add(parts[5])
            if len(paths) == 1:
                lib = ctypes.CDLL(paths.pop(), mode=os.RTLD_NOLOAD | os.RTLD_NOW)
                fn = lib.nixl_bounce_stats
                fn.argtypes = [ctypes.c_char_p, ctypes.c_size_t, ctypes.c_void_p, ctypes.c_size_t]
                fn.restype = ctypes.c_ssize_t
                self.fn = fn
        except (OSError, AttributeError):
            self.fn = None

    def counters(self, agent_name: str):
        if self.fn is None:
            return None
        name = agent_name.encode()
        n = self.fn(name, len(name), None, 0)
        if n < 0:
            return None
        buf = ctypes.create_string_buffer(n + 4096)
        n = self.fn(name, len(name), buf, len(buf))
        if n < 0 or n > len(buf):
            return None
        return json.loads(buf.raw[:n]).get("counters", {})


# The copies' counters (ns summed over a side's copies, and chunk counts)
# read from both sides around each iteration: where the arena's time goes.
# The GPU's own time (`gpu_*_kernel_ns`, `gpu_*_upload_ns`) is counted with
# NIXL_BOUNCE_TIME_KERNELS=1 only.
COPY_COUNTERS = ("gather_ns", "scatter_ns", "write_ns", "write_post_ns", "chunks_written", "chunks_scattered",
                 "gpu_gather_launch_ns", "gpu_gather_wait_ns", "gpu_gather_kernel_ns", "gpu_gather_upload_ns",
                 "gpu_scatter_launch_ns", "gpu_scatter_wait_ns", "gpu_scatter_kernel_ns", "gpu_scatter_upload_ns")


def route_of(before, after) -> str:
    """The route a BOUNCE engine took between two counter snapshots."""
    if before is None or after is None:
        return "?"
    d = {k: after.get(k, 0) - before.get(k, 0) for k in after}
    parts = []
    if d.get("peer_map_submitted", 0) > 0:
        parts.append("peer-map")
    if d.get("cma_submitted", 0) > 0:
        parts.append("cma")
    if d.get("bounce_submitted", 0) > 0:
        # The arena's lists checked (Engine::check) and its plan packed
        # (Engine::plan) in parts on several threads.
        in_parts = [what for what, key in (("check", "arena_check_parts"), ("plan", "arena_plans_in_parts"))
                    if d.get(key, 0) > 0]
        # Mixed transfers through host-staged arenas (no VRAM arena): all,
        # or some, of those posted.
        staged = d.get("arena_mixed_staged", 0)
        arena = ("bounce" if staged == 0 else "bounce(staged)" if staged >= d["bounce_submitted"]
                 else "bounce(some staged)")
        parts.append(arena + "/" + "+".join(in_parts) + "-in-parts" if in_parts else arena)
    fb = sorted(k[len("fallback_"):] for k, v in d.items() if k.startswith("fallback_") and v > 0)
    if fb:
        parts.append("UCX(" + ",".join(fb) + ")")
    if not parts:
        parts.append("UCX")
    failed = d.get("bounce_failed", 0) + d.get("peer_map_failed", 0) + d.get("cma_failed", 0)
    if failed:
        parts.append(f"FAILED={failed}")
    return "+".join(parts)


# ---------------------------------------------------------------------------
# The KV cache of one side, and its test pattern
# ---------------------------------------------------------------------------

# Multipliers of the pattern (odd 64-bit constants below 2^63 so that torch's
# int64 takes them as they are).
_K_BLOCK = 0x5851F42D4C957F2D
_K_MIX1 = 0x14057B7EF767814F
_K_MIX2 = 0x2545F4914F6CDD1D
_M64 = (1 << 64) - 1


def _s64(v: int) -> int:
    v &= _M64
    return v - (1 << 64) if v >> 63 else v


class KVCache:
    """One side's KV cache: `layers` tensors of shape
    (2, num_blocks, block_size, kv_heads_per_rank, head_dim) in bf16 (numpy
    has no bf16: on DRAM a uint16 array of that shape stands in). Region r is
    layer r // 2, K (r even) or V (r odd). The pattern is written and checked
    through an int64 view of each layer: words[layer][kv, block, word]."""

    def __init__(self, geom: dict, device: str, gpu: int):
        self.nb = geom["num_blocks"]
        self.block_len = geom["block_len"]
        self.regions = geom["regions"]
        self.W = self.block_len // 8
        shape = (2, self.nb, geom["block_size"], geom["kv_heads_per_rank"], geom["head_dim"])
        self.device = device
        self._arange = None
        if device in ("cuda", "torch-cpu"):
            import torch
            self.torch = torch
            self.dev = torch.device("cuda", gpu) if device == "cuda" else torch.device("cpu")
            self.dev_id = gpu if device == "cuda" else 0
            self.mem = "VRAM" if device == "cuda" else "DRAM"
            self.layers = [torch.empty(shape, dtype=torch.bfloat16, device=self.dev)
                           for _ in range(geom["layers"])]
            self.words = [t.view(torch.uint8).view(2, self.nb, self.block_len).view(torch.int64)
                          for t in self.layers]
            self.ptrs = [t.data_ptr() for t in self.layers]
        else:
            self.torch = None
            self.dev_id = 0
            self.mem = "DRAM"
            self.layers = [np.zeros(shape, dtype=np.uint16) for _ in range(geom["layers"])]
            self.words = [a.reshape(-1).view(np.uint64).reshape(2, self.nb, self.W) for a in self.layers]
            self.ptrs = [a.ctypes.data for a in self.layers]

    # -- NIXL descriptors ---------------------------------------------------
    def region_bases(self) -> list[int]:
        """Start address of every region, region-major (K then V per layer)."""
        return [p + kv * self.nb * self.block_len for p in self.ptrs for kv in (0, 1)]

    def reg_list(self) -> list[tuple]:
        return [(b, self.nb * self.block_len, self.dev_id, "") for b in self.region_bases()]

    @staticmethod
    def block_descs(bases, num_blocks, block_len, dev_id) -> list[tuple]:
        """The whole cache as one descriptor list, region-major: every block
        of region 0, then every block of region 1, ..."""
        return [(base + b * block_len, block_len, dev_id) for base in bases for b in range(num_blocks)]

    # -- pattern ------------------------------------------------------------
    def _idx(self, blocks):
        blocks = np.asarray(blocks, dtype=np.int64)
        if self.torch is not None:
            return self.torch.from_numpy(blocks).to(self.dev)
        return blocks

    def _pattern(self, seed: int, region: int, idx):
        """[len(idx), W] int64 words: a mix of (seed, region, block id, word)."""
        base = seed * 0x9E3779B97F4A7C15 + region * 0xC2B2AE3D27D4EB4F
        if self.torch is not None:
            t = self.torch
            if self._arange is None:
                self._arange = t.arange(self.W, dtype=t.int64, device=self.dev)
            x = idx[:, None] * _K_BLOCK + self._arange[None, :] + _s64(base)
            x = x * _K_MIX1
            x = x ^ (x >> 29)
            x = x * _K_MIX2
            return x ^ (x >> 32)
        if self._arange is None:
            self._arange = np.arange(self.W, dtype=np.uint64)
        x = idx.astype(np.uint64)[:, None] * np.uint64(_K_BLOCK) + self._arange[None, :] + np.uint64(base & _M64)
        x *= np.uint64(_K_MIX1)
        x ^= x >> np.uint64(29)
        x *= np.uint64(_K_MIX2)
        return x ^ (x >> np.uint64(32))

    def fill(self, seed: int, blocks) -> None:
        """Owner: write the request's pattern into its source blocks."""
        idx = self._idx(blocks)
        for r in range(self.regions):
            self.words[r // 2][r % 2][idx] = self._pattern(seed, r, idx)

    def zero(self, blocks) -> None:
        """Reader: clear the destination blocks before the transfer."""
        idx = self._idx(blocks)
        for w in self.words:
            w[:, idx] = 0

    def check(self, seed: int, local_blocks, remote_blocks):
        """Reader: None if every destination block holds its source block's
        pattern, else a description of the first wrong block."""
        lidx, ridx = self._idx(local_blocks), self._idx(remote_blocks)
        for r in range(self.regions):
            w = self.words[r // 2][r % 2]
            exp = self._pattern(seed, r, ridx)
            if self.torch is not None:
                got = w.index_select(0, lidx)
                if self.torch.equal(got, exp):
                    continue
                bad = (got != exp).any(dim=1).nonzero().flatten().tolist()
                zero = int((got[bad[0]] == 0).all().item())
            else:
                got = w[lidx]
                if np.array_equal(got, exp):
                    continue
                bad = np.flatnonzero((got != exp).any(axis=1)).tolist()
                zero = int((got[bad[0]] == 0).all())
            j = bad[0]
            return (f"region {r} (layer {r // 2} {'KV'[r % 2]}): {len(bad)} of {len(local_blocks)} blocks wrong; "
                    f"first: destination block {int(local_blocks[j])} <- source block {int(remote_blocks[j])}"
                    f"{' (still zero: never written)' if zero else ''}")
        return None

    def sync(self) -> None:
        if self.device == "cuda":
            self.torch.cuda.synchronize(self.dev)


# ---------------------------------------------------------------------------
# The owner (prefill worker): a spawned process serving pipe commands and
# polling its agents' notifications in between
# ---------------------------------------------------------------------------

def enter_netns(name: str) -> None:
    """Moves this process (still one thread: nothing NIXL or UCX made yet)
    into the network namespace `ip netns add NAME` made: a second "host"."""
    import ctypes
    libc = ctypes.CDLL(None, use_errno=True)
    clone_newnet = 0x40000000
    fd = os.open(f"/var/run/netns/{name}", os.O_RDONLY)
    try:
        if libc.setns(fd, clone_newnet) != 0:
            err = ctypes.get_errno()
            raise OSError(err, f"setns into network namespace {name!r}: {os.strerror(err)}")
    finally:
        os.close(fd)


def owner_main(conn, opts: dict) -> None:
    try:
        if opts.get("netns"):
            enter_netns(opts["netns"])
        _Owner(conn, opts).serve()
    except BaseException:  # noqa: BLE001 (report everything to the reader)
        try:
            conn.send(("error", traceback.format_exc()))
        except Exception:  # noqa: BLE001
            pass


class _Owner:
    def __init__(self, conn, opts):
        self.conn = conn
        self.opts = opts
        self.agents, self.caches, self.regs = {}, {}, {}
        self.arrivals = {}  # backend -> {msg: (time, sender)}
        self.sleep = opts["owner_poll_sleep_us"] * 1e-6
        if opts["device"] == "cuda":
            import torch
            torch.cuda.set_device(opts["owner_gpu"])

    def serve(self):
        while True:
            if self.conn.poll():
                cmd, *args = self.conn.recv()
                if cmd == "exit":
                    self.teardown()
                    self.conn.send(("bye",))
                    return
                self.conn.send(getattr(self, "cmd_" + cmd)(*args))
            self.poll_notifs()
            if self.sleep:
                time.sleep(self.sleep)

    def poll_notifs(self):
        for b, agent in self.agents.items():
            notifs = agent.get_new_notifs()
            if notifs:
                t = clock()
                for sender, msgs in notifs.items():
                    for m in msgs:
                        self.arrivals[b][bytes(m)] = (t, as_str(sender))

    def cmd_setup(self, geom, backends):
        info = {}
        for b in backends:
            t0 = clock()
            agent = make_agent(b, self.opts["ucx_threads"], self.opts["bounce_params"])
            t1 = clock()
            cache = KVCache(geom, self.opts["device"], self.opts["owner_gpu"])
            reg = agent.get_reg_descs(cache.reg_list(), cache.mem)
            agent.register_memory(reg)
            t2 = clock()
            self.agents[b], self.caches[b], self.regs[b], self.arrivals[b] = agent, cache, reg, {}
            info[b] = dict(metadata=agent.get_agent_metadata(), name=agent.name, bases=cache.region_bases(),
                           num_blocks=cache.nb, block_len=cache.block_len, dev_id=cache.dev_id, mem=cache.mem,
                           create_s=t1 - t0, register_s=t2 - t1)
        return ("ready", info)

    def cmd_fill(self, backend, reqs):
        cache = self.caches[backend]
        for seed, blocks in reqs:
            cache.fill(seed, blocks)
        cache.sync()
        return ("filled",)

    def cmd_collect(self, backend, msgs, timeout_s):
        """Wait (polling) until every message in `msgs` has arrived."""
        deadline = clock() + timeout_s
        got = self.arrivals[backend]
        while not all(m in got for m in msgs) and clock() < deadline:
            self.poll_notifs()
            if self.sleep:
                time.sleep(self.sleep)
        out = {m: (got.pop(m) if m in got else None) for m in msgs}
        return ("notifs", out)

    def cmd_counters(self, backend):
        """The BOUNCE plugin's counters of this side's agent (None without
        them), for the copies' breakdown."""
        if backend == "UCX":
            return ("counters", None)
        if getattr(self, "stats", None) is None:
            self.stats = BounceStats()
        return ("counters", self.stats.counters(self.agents[backend].name))

    def cmd_zero(self, backend, blocks):
        cache = self.caches[backend]
        cache.zero(blocks)
        cache.sync()
        return ("zeroed",)

    def cmd_check(self, backend, items):
        """--op write: each (seed, destination blocks, source blocks) checked
        in this cache; the first error or None for each."""
        cache = self.caches[backend]
        cache.sync()
        return ("checked", [cache.check(seed, dst, src) for seed, dst, src in items])

    def cmd_teardown(self):
        stray = {b: len(a) for b, a in self.arrivals.items() if a}
        self.teardown()
        return ("down", stray)

    def teardown(self):
        for b, agent in self.agents.items():
            agent.deregister_memory(self.regs[b])
        self.agents.clear()
        self.regs.clear()
        self.caches.clear()
        self.arrivals.clear()
        gc.collect()


# ---------------------------------------------------------------------------
# The reader (decode worker)
# ---------------------------------------------------------------------------

class Reader:
    def __init__(self, opts):
        self.o = opts
        self.rng = np.random.default_rng(opts.seed)
        self.seed_counter = opts.seed * 1_000_003
        self.stats = None
        self.sides = {}
        self.samples, self.iterations, self.setups = [], [], []
        ctx = mp.get_context("spawn")
        self.conn, child = ctx.Pipe()
        owner_opts = dict(device=opts.device, owner_gpu=opts.owner_gpu, ucx_threads=opts.ucx_threads,
                          owner_poll_sleep_us=opts.owner_poll_sleep_us, bounce_params=opts.bounce_params,
                          netns=opts.owner_netns)
        self.proc = ctx.Process(target=owner_main, args=(child, owner_opts), name="nixl-owner", daemon=True)
        self.proc.start()
        child.close()
        if opts.device == "cuda":
            import torch
            torch.cuda.set_device(opts.gpu)

    # -- pipe ----------------------------------------------------------------
    def ask(self, msg, expect, timeout_s=None):
        """Send a command to the owner and wait for its reply."""
        self.conn.send(msg)
        return self.ask_reply(expect, timeout_s)

    def ask_reply(self, expect, timeout_s=None):
        """Wait for the owner's next reply, which must be `expect`."""
        deadline = clock() + (timeout_s or self.o.timeout) + 60
        try:
            while not self.conn.poll(0.05):
                if not self.proc.is_alive():
                    raise BenchError(f"owner process died (exit code {self.proc.exitcode}) before '{expect}'")
                if clock() > deadline:
                    raise BenchError(f"owner did not answer ('{expect}') in time")
            reply = self.conn.recv()
        except (EOFError, OSError) as e:
            raise BenchError(f"owner process gone before '{expect}' ({e!r}, exit code {self.proc.exitcode})")
        if reply[0] == "error":
            raise BenchError("owner failed:\n" + reply[1])
        if reply[0] != expect:
            raise BenchError(f"owner answered {reply[0]!r}, expected {expect!r}")
        return reply[1:]

    def close(self):
        try:
            if self.proc.is_alive():
                self.ask(("exit",), "bye", timeout_s=10)
        except Exception as e:  # noqa: BLE001
            log(f"owner exit: {e}")
        self.proc.join(10)
        if self.proc.is_alive():
            self.proc.kill()
            self.proc.join()

    # -- a case ----------------------------------------------------------------
    def setup_case(self, geom, backends):
        self.sides = {}
        self.conn.send(("setup", geom, backends))  # the owner sets up while we do
        for b in backends:
            t0 = clock()
            agent = make_agent(b, self.o.ucx_threads, self.o.bounce_params)
            t1 = clock()
            cache = KVCache(geom, self.o.reader_device, self.o.gpu)
            reg = agent.get_reg_descs(cache.reg_list(), cache.mem)
            agent.register_memory(reg)
            t2 = clock()
            self.sides[b] = dict(agent=agent, cache=cache, reg=reg, t_create=t1 - t0, t_register=t2 - t1)
        if self.stats is None and "BOUNCE" in backends:
            self.stats = BounceStats()
        (info,) = self.ask_reply("ready")
        for b in backends:
            s, remote = self.sides[b], info[b]
            agent, cache = s["agent"], s["cache"]
            t0 = clock()
            name = as_str(agent.add_remote_agent(remote["metadata"]))
            if name != remote["name"]:
                raise BenchError(f"{b}: add_remote_agent returned {name!r}, expected {remote['name']!r}")
            t1 = clock()
            local = agent.prep_xfer_dlist(
                "NIXL_INIT_AGENT", KVCache.block_descs(cache.region_bases(), cache.nb, cache.block_len, cache.dev_id),
                cache.mem)
            t2 = clock()
            rem = agent.prep_xfer_dlist(
                name, KVCache.block_descs(remote["bases"], remote["num_blocks"], remote["block_len"],
                                          remote["dev_id"]), remote["mem"])
            t3 = clock()
            s.update(remote_name=name, local_dlist=local, remote_dlist=rem)
            rec = dict(case=geom["name"], backend=b, dlist_descs=cache.regions * cache.nb,
                       reader_create_s=s["t_create"], reader_register_s=s["t_register"],
                       owner_create_s=remote["create_s"], owner_register_s=remote["register_s"],
                       add_remote_agent_s=t1 - t0, prep_local_dlist_s=t2 - t1, prep_remote_dlist_s=t3 - t2)
            self.setups.append(rec)
            log(f"{geom['name']} {b}: agents ready; prep_xfer_dlist of {rec['dlist_descs']} descriptors "
                f"{rec['prep_local_dlist_s'] * 1e3:.1f} ms local, {rec['prep_remote_dlist_s'] * 1e3:.1f} ms remote")

    def teardown_case(self):
        for s in self.sides.values():
            agent = s["agent"]
            for key in ("local_dlist", "remote_dlist"):
                if key in s:
                    agent.release_dlist_handle(s[key])
            if "remote_name" in s:
                agent.remove_remote_agent(s["remote_name"])
            agent.deregister_memory(s["reg"])
        (stray,) = self.ask(("teardown",), "down")
        if stray:
            log(f"owner had unclaimed notifications: {stray}")
        self.sides.clear()
        gc.collect()

    def next_seed(self):
        self.seed_counter += 1
        return self.seed_counter

    # -- one iteration of one backend: `inflight` requests --------------------
    def iteration(self, geom, b, it, warm):
        o, s = self.o, self.sides[b]
        agent, cache = s["agent"], s["cache"]
        n, bpr, nb, R = geom["inflight"], geom["blocks_per_req"], geom["num_blocks"], geom["regions"]
        # Scattered, distinct blocks: the owner's (source) and ours (destination)
        # are drawn independently, as a prefill and a decode allocator would.
        remote = self.rng.choice(nb, n * bpr, replace=False).reshape(n, bpr)
        local = self.rng.choice(nb, n * bpr, replace=False).reshape(n, bpr)
        seeds = [self.next_seed() for _ in range(n)]
        # The plugin's counters before the iteration, read before anything
        # else happens in it: the read (a JSON snapshot, parsed) allocates,
        # and right before a preparation it would leave that preparation,
        # and only BOUNCE's, the garbage and the cold caches.
        before = self.stats.counters(agent.name) if (self.stats and b == "BOUNCE") else None
        (owner_before,) = self.ask(("counters", b), "counters") if before is not None else (None,)
        if o.op == "write":
            # The reader's blocks are the sources, the owner's the destinations.
            for k in range(n):
                cache.fill(seeds[k], local[k])
            self.ask(("zero", b, remote.reshape(-1)), "zeroed")
        else:
            self.ask(("fill", b, [(seeds[k], remote[k]) for k in range(n)]), "filled")
            cache.zero(local.reshape(-1))
        cache.sync()
        # Descriptor ids into the prepared lists, region-major.
        region_off = (np.arange(R, dtype=np.int64) * nb)[:, None]
        lids = [(region_off + local[k][None, :]).reshape(-1) for k in range(n)]
        rids = [(region_off + remote[k][None, :]).reshape(-1) for k in range(n)]
        msgs = [f"req-{geom['name']}-{b}-{it}-{k}:{geom['tp']}".encode() for k in range(n)]

        t_prep0, t_prep1, t_post, t_posted = [0.0] * n, [0.0] * n, [0.0] * n, [0.0] * n
        t_done, handles = [None] * n, []
        for k in range(n):
            t_prep0[k] = clock()
            h = agent.make_prepped_xfer(o.op.upper(), s["local_dlist"], lids[k], s["remote_dlist"], rids[k],
                                        notif_msg=msgs[k])
            t_prep1[k] = t_post[k] = clock()
            state = agent.transfer(h)
            t_posted[k] = clock()
            if state == "DONE":
                t_done[k] = t_posted[k]
            elif state != "PROC":
                raise BenchError(f"{geom['name']} {b} iter {it} request {k}: transfer() returned {state}")
            handles.append(h)
        deadline = clock() + o.timeout
        sleep = o.poll_sleep_us * 1e-6
        pending = [k for k in range(n) if t_done[k] is None]
        while pending:
            for k in list(pending):
                state = agent.check_xfer_state(handles[k])
                if state == "DONE":
                    t_done[k] = clock()
                    pending.remove(k)
                elif state != "PROC":
                    raise BenchError(f"{geom['name']} {b} iter {it} request {k}: state {state}")
            if pending and clock() > deadline:
                raise BenchError(f"{geom['name']} {b} iter {it}: {len(pending)} request(s) not DONE after "
                                 f"{o.timeout} s")
            if pending and sleep:
                time.sleep(sleep)
        tele = [telemetry_dict(agent, h) for h in handles]
        for h in handles:
            agent.release_xfer_handle(h)

        (arrived,) = self.ask(("collect", b, msgs, o.timeout), "notifs", timeout_s=o.timeout)
        missing = [m.decode() for m in msgs if arrived[m] is None]
        if missing:
            raise BenchError(f"{geom['name']} {b} iter {it}: notification(s) {missing} never reached the owner "
                             f"in {o.timeout} s")
        if o.op == "write":
            (errs,) = self.ask(("check", b, [(seeds[k], remote[k], local[k]) for k in range(n)]), "checked")
        else:
            errs = [cache.check(seeds[k], local[k], remote[k]) for k in range(n)]
        for k, err in enumerate(errs):
            if err:
                raise BenchError(f"{geom['name']} {b} iter {it} request {k}: NOT byte-exact: {err}")
        after = self.stats.counters(agent.name) if before is not None else None
        route = route_of(before, after) if before is not None else "-"
        (owner_after,) = self.ask(("counters", b), "counters") if before is not None else (None,)
        copies = {}
        for side, c0, c1 in (("reader", before, after), ("owner", owner_before, owner_after)):
            if c0 is not None and c1 is not None:
                copies.update({f"{side}_{k}": (c1.get(k, 0) - c0.get(k, 0)) / n for k in COPY_COUNTERS})
        # The plugin's own share of the preparations (ns, summed over the n
        # requests): all of it, and of the peer-mapped path's table fill and
        # upload.
        plugin = {k: after.get(k, 0) - before.get(k, 0)
                  for k in ("prepare_ns", "peer_map_prepare_ns", "peer_map_fill_ns", "peer_map_setup_ns",
                            "peer_map_upload_ns", "peer_map_upload_alloc_ns", "peer_map_upload_copy_ns",
                            "peer_map_upload_order_ns", "prepare_before_table_ns", "peer_map_fill_parts",
                            "peer_map_fill_parts_helped", "peer_map_fill_first_help_ns", "arena_prepared",
                            "arena_check_ns", "arena_plan_ns", "arena_plan_parts", "arena_plan_parts_helped",
                            "arena_plan_first_help_ns", "arena_check_parts", "arena_check_parts_helped",
                            "arena_check_first_help_ns", "arena_plans_with_check")
                  } if after is not None else {}

        # Diagnostic (--hot-prepares K): the first request prepared again K
        # times back to back and released untransferred, so every cache is
        # warm; against the timed prepare it shows what cold caches cost.
        hot, hot_share = [], None
        if o.hot_prepares > 0:
            h0 = self.stats.counters(agent.name) if before is not None else None
            for _ in range(o.hot_prepares):
                t0 = clock()
                h = agent.make_prepped_xfer(o.op.upper(), s["local_dlist"], lids[0], s["remote_dlist"], rids[0],
                                            notif_msg=msgs[0])
                hot.append(clock() - t0)
                agent.release_xfer_handle(h)
            if h0 is not None:
                h1 = self.stats.counters(agent.name)
                hot_share = (h1.get("prepare_ns", 0) - h0.get("prepare_ns", 0)) / o.hot_prepares

        bytes_total = n * geom["bytes_per_req"]
        span = max(t_done) - t_prep0[0]
        self.iterations.append(dict(
            case=geom["name"], backend=b, iter=it, warmup=warm, requests=n, bytes=bytes_total,
            span_s=span, post_span_s=max(t_done) - t_post[0], agg_gbps=bytes_total / span / 1e9, route=route,
            plugin_prepare_ns_per_req={k: v / n for k, v in plugin.items()}, copies_per_req=copies,
            hot_prepare_s=float(np.median(hot)) if hot else None, hot_plugin_prepare_ns=hot_share))
        for k in range(n):
            t_arr, sender = arrived[msgs[k]]
            self.samples.append(dict(
                case=geom["name"], backend=b, iter=it, warmup=warm, req=k, descs=geom["descs_per_req"],
                bytes=geom["bytes_per_req"], prepare_s=t_prep1[k] - t_prep0[k], transfer_s=t_done[k] - t_post[k],
                notif_s=t_arr - t_post[k], e2e_s=t_done[k] - t_prep0[k], post_call_s=t_posted[k] - t_post[k],
                prepare_at_s=t_prep0[k], post_at_s=t_post[k],
                done_at_s=t_done[k], notif_at_s=t_arr, notif_sender_ok=(sender == agent.name),
                verified=True, route=route, telemetry=tele[k]))
            if sender != agent.name:
                raise BenchError(f"{geom['name']} {b}: notification from {sender!r}, expected {agent.name!r}")
        if b != "UCX" and o.expect_route and not (
                route.startswith(o.expect_route) and re.search(r"\+(UCX|FAILED|peer-map|cma|bounce)", route) is None):
            raise BenchError(f"{geom['name']} {b} iter {it}: route {route!r}, expected only {o.expect_route!r}...")


# ---------------------------------------------------------------------------
# Statistics and output
# ---------------------------------------------------------------------------

def spread(values):
    v = np.asarray(values, dtype=float)
    if v.size == 0:
        return None
    return dict(n=int(v.size), p50=float(np.median(v)), p10=float(np.percentile(v, 10)),
                p90=float(np.percentile(v, 90)), min=float(v.min()), max=float(v.max()))


def summarize(reader, cases, backends):
    out = []
    for g in cases:
        for b in backends:
            ss = [s for s in reader.samples if s["case"] == g["name"] and s["backend"] == b and not s["warmup"]]
            its = [i for i in reader.iterations if i["case"] == g["name"] and i["backend"] == b and not i["warmup"]]
            if not ss:
                continue
            routes = sorted({s["route"] for s in ss})
            row = dict(case=g["name"], backend=b, descs=g["descs_per_req"], bytes=g["bytes_per_req"],
                       inflight=g["inflight"], routes=routes)
            for key in ("prepare_s", "transfer_s", "notif_s", "e2e_s", "post_call_s"):
                row[key] = spread([s[key] for s in ss])
            row["agg_gbps"] = spread([i["agg_gbps"] for i in its])
            row["span_s"] = spread([i["span_s"] for i in its])
            row["gbps"] = g["bytes_per_req"] / row["transfer_s"]["p50"] / 1e9
            hots = [i["hot_prepare_s"] for i in its if i.get("hot_prepare_s") is not None]
            if hots:
                row["hot_prepare_s"] = spread(hots)
                hs = [i["hot_plugin_prepare_ns"] for i in its if i.get("hot_plugin_prepare_ns") is not None]
                row["hot_plugin_prepare_ns"] = spread(hs) if hs else None
            cps = [i["copies_per_req"] for i in its if i.get("copies_per_req")]
            if cps:
                row["copies"] = {k: spread([x.get(k, 0) for x in cps]) for k in cps[0]}
            shares = [i["plugin_prepare_ns_per_req"] for i in its if i.get("plugin_prepare_ns_per_req")]
            if shares:
                row["plugin_prepare_ns"] = {k: spread([x.get(k, 0) for x in shares]) for k in shares[0]}
            tele = [s["telemetry"] for s in ss if "xferDuration" in s["telemetry"]]
            if tele:
                row["telemetry_post_us"] = spread([t["postDuration"] for t in tele])
                row["telemetry_xfer_us"] = spread([t["xferDuration"] for t in tele])
                row["telemetry_desc_count"] = sorted({t["descCount"] for t in tele})
            out.append(row)
    return out


def fmt_ms(sp):
    if sp is None:
        return "-"
    return f"{sp['p50'] * 1e3:9.3f} [{sp['p10'] * 1e3:.3f}-{sp['p90'] * 1e3:.3f}]"


def print_table(summary, cases, opts):
    print(f"\nvLLM NIXL pattern: {MODEL['name']}-shaped KV cache, {opts.op.upper()} by the decode side, device={opts.device}"
          f"{'' if opts.reader_device == opts.device else f' (reader: {opts.reader_device})'}, "
          f"{opts.iters} timed iterations (+{opts.warmup} warm-up) per backend, "
          + (f"alternating {','.join(opts.backends)}" if opts.order == "alternate"
             else f"one backend at a time ({','.join(opts.backends)})")
          + f"; polls: reader every {opts.poll_sleep_us:g} us, owner every {opts.owner_poll_sleep_us:g} us"
          + (f"; OMP_WAIT_POLICY={os.environ['OMP_WAIT_POLICY']}" if "OMP_WAIT_POLICY" in os.environ else ""))
    print("times in ms: median [p10-p90]; post call = transfer()'s own call; transfer = transfer() -> DONE; "
          "notif = notification seen by the owner - reader's post; e2e = make_prepped_xfer start -> DONE")
    for g in cases:
        rows = [r for r in summary if r["case"] == g["name"]]
        if not rows:
            continue
        print(f"\n== {g['name']}: TP={g['tp']}, {g['tokens']} tokens, {g['layers']} layers ({g['regions']} regions), "
              f"{g['blocks_per_req']} blocks x {g['block_len'] // 1024} KiB per region -> {g['descs_per_req']} "
              f"descriptors, {g['bytes_per_req'] / 2**20:.1f} MiB per request, {g['inflight']} in flight; "
              f"cache {g['num_blocks']} blocks/region")
        hdr = (f"{'backend':<7} {'prepare':>26} {'post call':>26} {'transfer':>28} {'GB/s':>7} {'notif':>28}"
               f" {'e2e':>28}"
               + (f" {'agg GB/s':>9}" if g["inflight"] > 1 else "") + "  route")
        print(hdr)
        for r in rows:
            line = (f"{r['backend']:<7} {fmt_ms(r['prepare_s']):>26} {fmt_ms(r['post_call_s']):>26}"
                    f" {fmt_ms(r['transfer_s']):>28} "
                    f"{r['gbps']:7.2f} {fmt_ms(r['notif_s']):>28} {fmt_ms(r['e2e_s']):>28}")
            if g["inflight"] > 1:
                line += f" {r['agg_gbps']['p50']:9.2f}"
            print(line + "  " + ",".join(r["routes"]))
            if r.get("hot_prepare_s"):
                hp = r.get("hot_plugin_prepare_ns")
                print(f"        warm caches (the request prepared again back to back): prepare"
                      f" {fmt_ms(r['hot_prepare_s'])}"
                      + (f", plugin's share {hp['p50'] / 1e3:.1f} us" if hp else ""))
            cp = r.get("copies")
            if cp and any(v["p50"] > 0 for k, v in cp.items() if k.endswith("_ns")):
                us = {k: v["p50"] / 1e3 for k, v in cp.items()}

                def side(who):
                    gpu = lambda d: (f" (launch {us[f'{who}_gpu_{d}_launch_ns']:.0f}, GPU wait"
                                     f" {us[f'{who}_gpu_{d}_wait_ns']:.0f}, kernels {us[f'{who}_gpu_{d}_kernel_ns']:.0f},"
                                     f" uploads to start {us[f'{who}_gpu_{d}_upload_ns']:.0f})"
                                     if us[f"{who}_gpu_{d}_launch_ns"] > 0 else "")
                    return (f"{who}: gather {us[f'{who}_gather_ns']:.0f}{gpu('gather')}, chunk writes"
                            f" {us[f'{who}_write_ns']:.0f} (posts {us[f'{who}_write_post_ns']:.0f};"
                            f" {cp[f'{who}_chunks_written']['p50']:.0f} chunks), scatter"
                            f" {us[f'{who}_scatter_ns']:.0f}{gpu('scatter')}")
                whos = [w for w in ("reader", "owner") if f"{w}_gather_ns" in us]
                print("        the copies, summed over each side's chunks (median us per request): "
                      + "; ".join(side(w) for w in whos))
            pp = r.get("plugin_prepare_ns")
            if pp and pp.get("prepare_ns") and pp["prepare_ns"]["p50"] > 0:
                us = {k: v["p50"] / 1e3 for k, v in pp.items()}
                print(f"        plugin's preparation of the request (median us per request; in transfer()'s call"
                      f" with prepare_at_post, else in make_prepped_xfer): {us['prepare_ns']:.0f} in all"
                      f" ({us['prepare_ns'] * 1e3 / r['descs']:.1f} ns per descriptor), of it peer-mapped"
                      f" {us['peer_map_prepare_ns']:.0f} (fill {us['peer_map_fill_ns']:.0f}, of it set-up"
                      f" {us.get('peer_map_setup_ns', 0):.0f}; upload {us['peer_map_upload_ns']:.0f}: device"
                      f" allocation {us.get('peer_map_upload_alloc_ns', 0):.0f}, copy call"
                      f" {us.get('peer_map_upload_copy_ns', 0):.0f}, ordering"
                      f" {us.get('peer_map_upload_order_ns', 0):.0f}); before the table"
                      f" {us.get('prepare_before_table_ns', 0):.0f}, after it"
                      f" {us['prepare_ns'] - us.get('prepare_before_table_ns', 0) - us['peer_map_prepare_ns']:.0f}")
                parts = pp.get("peer_map_fill_parts", {}).get("p50", 0)
                if parts:
                    print(f"        table in parts: {parts:.0f} parts, the workers walked"
                          f" {pp['peer_map_fill_parts_helped']['p50']:.0f}, the first of them"
                          f" {us['peer_map_fill_first_help_ns']:.0f} us after the walk began (medians)")
                if pp.get("arena_prepared", {}).get("p50", 0):
                    fused = pp.get("arena_plans_with_check", {}).get("p50", 0) > 0
                    line = (f"        of it on the arena path: the check of both lists"
                            f"{' with the plan packed in its pass' if fused else ''} {us['arena_check_ns']:.0f}")
                    if pp.get("arena_check_parts", {}).get("p50", 0):
                        line += (f" (in {pp['arena_check_parts']['p50']:.0f} parts, the workers did"
                                 f" {pp['arena_check_parts_helped']['p50']:.0f}, the first of them"
                                 f" {us['arena_check_first_help_ns']:.0f} us after the check began)")
                    line += f", {'assembling ' if fused else ''}the plan {us['arena_plan_ns']:.0f}"
                    if pp.get("arena_plan_parts", {}).get("p50", 0) and not fused:
                        line += (f" (in {pp['arena_plan_parts']['p50']:.0f} parts, the workers packed"
                                 f" {pp['arena_plan_parts_helped']['p50']:.0f}, the first of them"
                                 f" {us['arena_plan_first_help_ns']:.0f} us after the packing began)")
                    print(line + " (medians)")
        by = {r["backend"]: r for r in rows}
        if "BOUNCE" in by and "UCX" in by:
            u, bo = by["UCX"], by["BOUNCE"]
            ratios = [f"{k[:-2].replace('_', ' ')} {u[k]['p50'] / bo[k]['p50']:.2f}x"
                      for k in ("prepare_s", "post_call_s", "transfer_s", "notif_s", "e2e_s") if bo[k]["p50"] > 0]
            if g["inflight"] > 1:
                ratios.append(f"aggregate GB/s {bo['agg_gbps']['p50'] / u['agg_gbps']['p50']:.2f}x")
            print("BOUNCE speed-up over UCX (UCX median / BOUNCE median; >1 = BOUNCE faster): " + ", ".join(ratios))


def run(opts) -> dict:
    """Run every case; returns everything measured. Raises BenchError on a
    failed transfer, a wrong byte or a missing notification."""
    layers = opts.layers or max(1, int(round(MODEL["layers"] * opts.scale)))
    cases = [parse_case(c, layers, opts.scale if opts.token_scale is None else opts.token_scale, opts.spare,
                        opts.block_size)
             for c in opts.cases.split(",") if c.strip()]
    reader = Reader(opts)
    try:
        for g in cases:
            log(f"case {g['name']}: {g['descs_per_req']} descriptors x {g['block_len']} B per request, "
                f"{g['inflight']} in flight, cache {g['cache_bytes_per_side'] / 2**20:.0f} MiB per side per backend")
            # alternate: every backend's agents live through the case and the
            # backends take turns iteration by iteration; blocked: one backend
            # at a time, its agents the only ones alive (an idle UCX agent's
            # progress thread spins: see --order).
            groups = [opts.backends] if opts.order == "alternate" else [[b] for b in opts.backends]
            for group in groups:
                ok = False
                try:
                    reader.setup_case(g, group)
                    for it in range(opts.warmup + opts.iters):
                        for b in group:
                            reader.iteration(g, b, it, it < opts.warmup)
                    ok = True
                finally:
                    try:
                        reader.teardown_case()
                    except Exception as e:  # noqa: BLE001
                        if ok:
                            raise
                        log(f"teardown after the failure: {e!r}")  # the failure itself is what matters
    finally:
        reader.close()
    summary = summarize(reader, cases, opts.backends)
    return dict(config={k: v for k, v in vars(opts).items()}, model=MODEL, cases=cases,
                host=dict(hostname=platform.node(), python=platform.python_version(),
                          env={k: v for k, v in os.environ.items() if k.startswith(("NIXL_", "UCX_", "OMP_"))}),
                setup=reader.setups, iterations=reader.iterations, samples=reader.samples, summary=summary)


def default_device():
    try:
        import torch
        return "cuda" if torch.cuda.is_available() else "cpu"
    except ImportError:
        return "cpu"


def parse_args(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--device", choices=["cuda", "cpu", "torch-cpu"], default=None,
                    help="cuda: torch tensors, VRAM; cpu: numpy arrays, DRAM; torch-cpu: torch tensors, DRAM "
                         "(default: cuda if torch sees a GPU, else cpu)")
    ap.add_argument("--reader-device", choices=["cuda", "cpu", "torch-cpu"], default=None,
                    help="the reader's (decode side's) cache alone, e.g. torch-cpu with --device cuda: a READ from "
                         "the owner's VRAM into the reader's DRAM (default: --device)")
    ap.add_argument("--backends", default="BOUNCE,UCX", help="alternated iteration by iteration (default BOUNCE,UCX)")
    ap.add_argument("--order", choices=["alternate", "blocked"], default="alternate",
                    help="alternate (default): all backends' agents alive, backends take turns iteration by "
                         "iteration; blocked: one backend at a time, its agents the only ones alive (NIXL's Python "
                         "config starts a UCX progress thread that spins while idle and takes CPU from the others)")
    ap.add_argument("--cases", default=DEFAULT_CASES, help=f"default {DEFAULT_CASES}")
    ap.add_argument("--iters", type=int, default=10, help="timed iterations per case and backend (default 10)")
    ap.add_argument("--warmup", type=int, default=2, help="untimed iterations first (default 2)")
    ap.add_argument("--scale", type=float, default=1.0, help="shrink layers and tokens by this factor (default 1)")
    ap.add_argument("--layers", type=int, default=None, help="layers (default 32 x scale)")
    ap.add_argument("--token-scale", type=float, default=None, help="tokens factor (default: --scale)")
    ap.add_argument("--block-size", type=int, default=MODEL["block_size"],
                    help=f"tokens per KV block, vLLM's --block-size (default {MODEL['block_size']}); "
                         "a block is block_size x 2 KiB / TP, e.g. 512 at TP=1 for 1 MiB blocks")
    ap.add_argument("--spare", type=float, default=2.0,
                    help="cache blocks per region = spare x blocks of all requests in flight (default 2)")
    ap.add_argument("--ucx-threads", type=int, default=4, help="UCX num_threads as vLLM sets it (default 4; 0 = none)")
    ap.add_argument("--bounce-param", action="append", default=[], metavar="KEY=VALUE",
                    help="BOUNCE backend parameter (repeatable; default: none, BOUNCE's defaults)")
    ap.add_argument("--gpu", type=int, default=0, help="reader's GPU (default 0)")
    ap.add_argument("--owner-gpu", type=int, default=None, help="owner's GPU (default: --gpu)")
    ap.add_argument("--owner-netns", default=None, metavar="NAME",
                    help="run the owner in this network namespace (ip netns add NAME): with the reader in "
                         "another one, two hosts joined by whatever link joins the namespaces "
                         "(scripts/two-hosts.sh makes them)")
    ap.add_argument("--poll-sleep-us", type=float, default=None,
                    help="reader's sleep between check_xfer_state polls (default 0, busy, on cuda; 50 on cpu, "
                         "where a busy reader takes one of the transfer's cores)")
    ap.add_argument("--owner-poll-sleep-us", type=float, default=None,
                    help="owner's sleep between get_new_notifs polls (default 0 on cuda, 50 on cpu)")
    ap.add_argument("--timeout", type=float, default=float(os.environ.get("NIXL_BOUNCE_TEST_TIMEOUT_S", "60")),
                    help="bound on every wait, seconds (default NIXL_BOUNCE_TEST_TIMEOUT_S or 60)")
    ap.add_argument("--seed", type=int, default=1)
    ap.add_argument("--hot-prepares", type=int, default=0, metavar="K",
                    help="diagnostic: also prepare each iteration's first request K more times back to back "
                         "(warm caches; released untransferred) and report their median")
    ap.add_argument("--json", default=None, help="write every sample to this file")
    ap.add_argument("--op", choices=["read", "write"], default="read",
                    help="read (vLLM's: the decode side pulls) or write (it pushes its blocks into the owner's cache)")
    ap.add_argument("--expect-route", default="", metavar="PREFIX",
                    help="fail unless every BOUNCE request's route starts with PREFIX (e.g. bounce, or "
                         "'bounce(staged)' for host-staged arenas), none through UCX or failed")
    o = ap.parse_args(argv)
    if "torch-cpu" in (o.device, o.reader_device):
        # torch's CPU ops here (the pattern written, the destination zeroed
        # and checked around every request) leave its OpenMP threads, one a
        # core, spinning for a while after each; a request then ran beside
        # them, on the cores both processes' copy and IO threads need (a 2
        # MiB mixed READ: 6.4 ms, of it 3.5 ms a 68 us gather waiting to be
        # seen, against 1.4 ms with them asleep). vLLM's decode side does no
        # such work during a transfer, so the bench's threads sleep when
        # idle (set before torch is imported; the caller's value wins).
        os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")
    o.device = o.device or default_device()
    o.reader_device = o.reader_device or o.device
    o.backends = [b.strip() for b in o.backends.split(",") if b.strip()]
    o.bounce_params = {}
    for kv in o.bounce_param:
        if "=" not in kv:
            ap.error(f"--bounce-param {kv!r}: expected KEY=VALUE")
        k, v = kv.split("=", 1)
        o.bounce_params[k.strip()] = v.strip()
    if o.owner_gpu is None:
        o.owner_gpu = o.gpu
    # vLLM checks its transfers once per engine step, not in a loop; on a
    # small CPU machine a busy poll in either process takes a core from the
    # transfer (4096 x 4 KiB between two processes on 2 cores: 7.1 ms with
    # the reader spinning, 4.4 ms with it sleeping 50 us between polls).
    if o.owner_poll_sleep_us is None:
        o.owner_poll_sleep_us = 0.0 if o.device == "cuda" else 50.0
    if o.poll_sleep_us is None:
        o.poll_sleep_us = 0.0 if o.device == "cuda" else 50.0
    return o


def main(argv=None):
    opts = parse_args(argv)
    try:
        res = run(opts)
    except BenchError as e:
        print(f"FAIL: {e}", flush=True)
        return 1
    print_table(res["summary"], res["cases"], opts)
    if opts.json:
        os.makedirs(os.path.dirname(os.path.abspath(opts.json)), exist_ok=True)
        with open(opts.json, "w") as f:
            json.dump(res, f, indent=1)
        print(f"\nsamples written to {opts.json}")
    n = len([s for s in res["samples"] if not s["warmup"]])
    print(f"\nok: {len(res['samples'])} requests ({n} timed), every one byte-exact, every notification at the owner",
          flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
