//! The `extern "C"` entry points of `include/bounce_ffi.h`, called by the C++
//! shim in `plugin/`.
//!
//! Every entry point runs its body inside [`boundary`] (an engine's calls
//! through [`on_engine`]): a panic never unwinds into C++ (which would abort
//! the host process); it is logged, turned into `BOUNCE_ERR_BACKEND` (or the
//! entry's neutral value), and the engine is marked broken, after which it
//! refuses all work but teardown with an error. Handle ownership is
//! documented in the header and at each function below.

#![allow(non_camel_case_types)]

use std::collections::BTreeMap;
use std::ffi::{c_char, c_void};
use std::sync::atomic::Ordering;

use crate::engine::{
    Descs, Engine, Error, Md, MemKind, Op, Range, Request, Shape, Status, TotalBytes, XferArgs,
};

/// Types generated from `include/bounce_ffi.h`.
pub mod sys {
    #![allow(
        non_upper_case_globals,
        non_camel_case_types,
        non_snake_case,
        dead_code
    )]
    include!(concat!(env!("OUT_DIR"), "/bounce_ffi.rs"));
}

use sys::{
    bounce_bytes_t, bounce_desc_list_t, bounce_notif_sink_t, bounce_param_t, bounce_sink_t,
    bounce_xfer_args_t,
};

/// Opaque handle types of the header: each is a Rust object behind a Box.
pub type bounce_engine_t = Engine;
pub type bounce_md_t = Md;
pub type bounce_req_t = Request;

const VERSION: &[u8] = concat!(env!("CARGO_PKG_VERSION"), "\0").as_bytes();

extern "C" {
    /// The shim's static `nixlBackendPlugin` (plugin/bounce_plugin.cpp).
    fn bounce_shim_plugin() -> *mut c_void;
}

/// NIXL's plugin entry point: returns the static plugin descriptor.
#[no_mangle]
pub extern "C" fn nixl_plugin_init() -> *mut c_void {
    boundary(
        "loading the BOUNCE plugin",
        || {
            crate::logging::init();
            // SAFETY: bounce_shim_plugin has no preconditions and returns a
            // pointer to a static object that lives as long as the library.
            unsafe { bounce_shim_plugin() }
        },
        |_| std::ptr::null_mut(),
    )
}

/// NIXL's plugin exit point. Engines are destroyed by NIXL before this.
#[no_mangle]
pub extern "C" fn nixl_plugin_fini() {}

fn status(s: Status) -> i32 {
    s as i32
}

fn fail(e: Error) -> i32 {
    tracing::error!("{}", e.message);
    status(e.status)
}

/// The panic boundary of every entry point: runs `body`; if it panics, logs
/// the panic under `what` and returns `on_panic(its message)`.
fn boundary<T>(what: &str, body: impl FnOnce() -> T, on_panic: impl FnOnce(&str) -> T) -> T {
    crate::boundary::catch(body).unwrap_or_else(|msg| {
        tracing::error!("{what}: internal error (panic: {msg})");
        on_panic(&msg)
    })
}

/// The status an entry returns for its body's outcome (an error is logged,
/// prefixed with what was being done).
fn outcome(what: &str, r: Result<Status, Error>) -> i32 {
    match r {
        Ok(s) => status(s),
        Err(e) => fail(Error::new(e.status, format!("{what}: {}", e.message))),
    }
}

/// Which engine calls run after the engine stopped on an internal error.
#[derive(Clone, Copy, PartialEq, Eq)]
enum Call {
    /// New work: refused by a broken engine.
    Work,
    /// Releasing resources: still runs, so that NIXL's teardown frees
    /// everything.
    Teardown,
}

/// Runs `f` with the engine inside [`boundary`]; a panic marks the engine
/// broken, and a broken engine refuses every [`Call::Work`].
fn on_engine(
    engine: *const Engine,
    call: Call,
    what: &str,
    f: impl FnOnce(&Engine) -> Result<Status, Error>,
) -> i32 {
    if engine.is_null() {
        return fail(Error::new(
            Status::InvalidParam,
            format!("{what}: no engine (its creation failed)"),
        ));
    }
    // SAFETY: a non-null engine pointer is one bounce_engine_new handed out
    // and the C++ side has not yet passed to bounce_engine_free (ownership
    // contract of bounce_ffi.h); Engine is Sync, so a shared reference from
    // any thread is fine.
    let engine = unsafe { &*engine };
    if engine.is_broken() && call == Call::Work {
        return fail(Error::new(
            Status::Backend,
            format!(
                "{what}: the BOUNCE engine of {:?} stopped after an internal error",
                engine.local_name()
            ),
        ));
    }
    match crate::boundary::catch(|| f(engine)) {
        Ok(r) => {
            if r.is_err() {
                crate::stats::EngineStats::bump(&engine.stats.counters.rejected_calls);
            }
            outcome(what, r)
        }
        Err(msg) => {
            engine.mark_broken();
            tracing::error!(
                agent = engine.local_name(),
                "{what}: internal error (panic: {msg}); engine disabled"
            );
            status(Status::Backend)
        }
    }
}

/// Borrows the bytes of a bounce_bytes_t.
///
/// # Safety
/// `b.ptr` must point to `b.len` readable bytes for the returned lifetime, or
/// `b.len` must be 0.
unsafe fn borrow<'a>(b: bounce_bytes_t) -> &'a [u8] {
    if b.len == 0 || b.ptr.is_null() {
        &[]
    } else {
        // SAFETY: guaranteed by the caller (header contract: borrowed for the call).
        unsafe { std::slice::from_raw_parts(b.ptr, b.len) }
    }
}

/// Borrows a UTF-8 string (agent names are UTF-8 in NIXL's APIs).
///
/// # Safety
/// As for [`borrow`].
unsafe fn borrow_str<'a>(b: bounce_bytes_t, what: &str) -> Result<&'a str, Error> {
    // SAFETY: forwarded contract.
    std::str::from_utf8(unsafe { borrow(b) })
        .map_err(|_| Error::new(Status::InvalidParam, format!("{what} is not valid UTF-8")))
}

fn sink_bytes(sink: bounce_sink_t, ctx: *mut c_void, bytes: &[u8]) -> Result<(), Error> {
    let sink = sink.ok_or_else(|| Error::new(Status::InvalidParam, "no output callback"))?;
    // SAFETY: the callback and ctx come from the C++ caller, which guarantees
    // they are valid for this call; the bytes are valid for the call.
    unsafe { sink(ctx, bytes.as_ptr(), bytes.len()) };
    Ok(())
}

/// Where an entry hands an object to the shim: its out-pointer, checked
/// non-null before the entry does any work (so a bad call changes nothing).
struct OutSlot<T>(std::ptr::NonNull<*mut T>);

/// # Safety
/// `out` is null or valid for writing one pointer (every entry that hands
/// out an object is called by the shim with the address of a local).
unsafe fn out_slot<T>(out: *mut *mut T, what: &str) -> Result<OutSlot<T>, Error> {
    std::ptr::NonNull::new(out)
        .map(OutSlot)
        .ok_or_else(|| Error::new(Status::InvalidParam, format!("null out-pointer for {what}")))
}

impl<T> OutSlot<T> {
    /// Hands `value` over: the shim owns it from then on and gives it back
    /// through the matching release entry.
    fn put(self, value: Box<T>) {
        // SAFETY: non-null and writable per `out_slot`'s contract.
        unsafe { *self.0.as_ptr() = Box::into_raw(value) };
    }
}

/// Adds the time since `.1` to the engine's `prepare_ns` when dropped.
struct PrepTimer<'a>(&'a Engine, std::time::Instant);

impl Drop for PrepTimer<'_> {
    fn drop(&mut self) {
        let ns = self.1.elapsed().as_nanos() as u64;
        self.0
            .stats
            .counters
            .prepare_ns
            .fetch_add(ns, Ordering::Relaxed);
    }
}

/// Where `bounce_engine_prep_xfer` tells the shim whether the UCX delegate
/// carries the transfer: checked non-null before any work.
struct RouteSlot(std::ptr::NonNull<i32>);

impl RouteSlot {
    fn new(p: *mut i32) -> Result<Self, Error> {
        std::ptr::NonNull::new(p)
            .map(RouteSlot)
            .ok_or_else(|| Error::new(Status::InvalidParam, "null out-pointer for the route"))
    }
    fn set(&self, delegate: i32) {
        // SAFETY: non-null, and the shim passes the address of a local.
        unsafe { *self.0.as_ptr() = delegate };
    }
}

/// # Safety
/// `md` is null or a live bounce_md_t owned by the caller.
unsafe fn md_ref<'a>(md: *const Md) -> Result<&'a Md, Error> {
    if md.is_null() {
        return Err(Error::new(Status::InvalidParam, "null metadata handle"));
    }
    // SAFETY: non-null handles are live Md boxes per the header's contract.
    let md = unsafe { &*md };
    if !md.is_valid() {
        return Err(Error::new(
            Status::InvalidParam,
            "metadata handle is not a live BOUNCE handle",
        ));
    }
    Ok(md)
}

// The engine reads the shim's descriptor arrays in place as its own
// `RawDesc` (same fields, same order).
const _: () = {
    use std::mem::{align_of, offset_of, size_of};
    assert!(size_of::<crate::engine::RawDesc>() == size_of::<sys::bounce_desc_t>());
    assert!(align_of::<crate::engine::RawDesc>() == align_of::<sys::bounce_desc_t>());
    assert!(offset_of!(crate::engine::RawDesc, addr) == offset_of!(sys::bounce_desc_t, addr));
    assert!(offset_of!(crate::engine::RawDesc, len) == offset_of!(sys::bounce_desc_t, len));
    assert!(offset_of!(crate::engine::RawDesc, dev) == offset_of!(sys::bounce_desc_t, dev_id));
    assert!(offset_of!(crate::engine::RawDesc, md) == offset_of!(sys::bounce_desc_t, md));
};

fn as_raw(raw: &[sys::bounce_desc_t]) -> &[crate::engine::RawDesc] {
    // SAFETY: same size, alignment and field offsets (checked above at
    // compile time), every bit pattern valid for both.
    unsafe { std::slice::from_raw_parts(raw.as_ptr() as *const crate::engine::RawDesc, raw.len()) }
}

/// The descriptors of a list as the shim passed them, and their memory kind.
///
/// # Safety
/// `list` points to a valid bounce_desc_list_t whose arrays live for `'a`.
unsafe fn raw_descs<'a>(
    list: *const bounce_desc_list_t,
    which: &str,
) -> Result<(&'a [sys::bounce_desc_t], MemKind, Resolver), Error> {
    if list.is_null() {
        return Err(Error::new(
            Status::InvalidParam,
            format!("no {which} descriptor list"),
        ));
    }
    // SAFETY: caller contract.
    let list = unsafe { &*list };
    let kind = MemKind::from_nixl(list.mem)?;
    let resolve = list.resolve.ok_or_else(|| {
        Error::new(
            Status::InvalidParam,
            format!("no metadata resolver with the {which} descriptors"),
        )
    })?;
    let raw: &[sys::bounce_desc_t] = if list.count == 0 {
        &[]
    } else {
        // SAFETY: the shim passes a vector's data pointer and its length.
        unsafe { std::slice::from_raw_parts(list.descs, list.count) }
    };
    Ok((
        raw,
        kind,
        Resolver {
            resolve,
            ctx: list.resolve_ctx,
        },
    ))
}

/// The shim's `bounce_md_resolver_t` with its context.
#[derive(Clone, Copy)]
struct Resolver {
    resolve: unsafe extern "C" fn(*const c_void, *const c_void) -> *const sys::bounce_md_t,
    ctx: *const c_void,
}

// SAFETY: the shim's resolver only reads its table, which nothing changes
// during the call it is given to (bounce_ffi.h), so it may be called from
// the threads that fill a table in parts.
unsafe impl Send for Resolver {}
// SAFETY: as above.
unsafe impl Sync for Resolver {}

impl Resolver {
    /// The `Md` of a descriptor's non-null backend metadata, or null.
    ///
    /// # Safety
    /// Called during the call the resolver came with.
    unsafe fn md(&self, p: *const c_void) -> *const Md {
        // SAFETY: the shim's function with its own context (caller contract).
        unsafe { (self.resolve)(self.ctx, p) as *const Md }
    }
}

/// The transfer's arguments, the notification's message copied only when
/// `with_notif`.
///
/// # Safety
/// `args` is null or points to a valid bounce_xfer_args_t for the call.
unsafe fn xfer_args(args: *const bounce_xfer_args_t, with_notif: bool) -> XferArgs {
    if args.is_null() {
        return XferArgs::default();
    }
    // SAFETY: caller contract.
    let a = unsafe { &*args };
    XferArgs {
        // SAFETY: borrowed for the call (header contract).
        notif: (with_notif && a.has_notif != 0).then(|| unsafe { borrow(a.notif_msg) }.to_vec()),
        // SAFETY: as above.
        custom_param: unsafe { borrow(a.custom_param) }.to_vec(),
    }
}

// ---- plugin-level ----------------------------------------------------------------

#[no_mangle]
pub extern "C" fn bounce_plugin_version() -> *const c_char {
    VERSION.as_ptr() as *const c_char
}

/// Backend options and their defaults, as advertised to NIXL.
#[no_mangle]
pub extern "C" fn bounce_plugin_options(sink: bounce_sink_t, ctx: *mut c_void) -> i32 {
    let what = "listing the backend options";
    boundary(
        what,
        || {
            let listed = crate::engine::advertised_options()
                .into_iter()
                .try_for_each(|(key, default)| {
                    sink_bytes(sink, ctx, key.as_bytes())?;
                    sink_bytes(sink, ctx, default.as_bytes())
                });
            outcome(what, listed.map(|()| Status::Success))
        },
        |_| status(Status::Backend),
    )
}

// ---- engine lifecycle -------------------------------------------------------------

/// Creates an engine. On success `*out` owns it until `bounce_engine_free`.
///
/// # Safety
/// `params` points to `param_count` valid entries whose bytes live for the
/// call; `out` is valid for writing.
#[no_mangle]
pub unsafe extern "C" fn bounce_engine_new(
    local_agent: bounce_bytes_t,
    params: *const bounce_param_t,
    param_count: usize,
    error_sink: bounce_sink_t,
    error_ctx: *mut c_void,
    out: *mut *mut Engine,
) -> i32 {
    crate::logging::init();
    let create = || -> Result<Box<Engine>, Error> {
        if out.is_null() {
            return Err(Error::new(Status::InvalidParam, "no output pointer"));
        }
        // SAFETY: caller contract (borrowed for the call).
        let name = unsafe { borrow_str(local_agent, "the agent name") }?;
        let raw: &[bounce_param_t] =
            // SAFETY: caller contract.
            if param_count == 0 { &[] } else { unsafe { std::slice::from_raw_parts(params, param_count) } };
        let mut map = BTreeMap::new();
        for p in raw {
            // SAFETY: caller contract.
            let k = unsafe { borrow_str(p.key, "a parameter name") }?;
            // SAFETY: caller contract.
            let v = unsafe { borrow_str(p.value, "a parameter value") }?;
            map.insert(k.to_string(), v.to_string());
        }
        Engine::new(name, map).map(Box::new)
    };
    // A panic is logged once, below, with the other reasons.
    let created = crate::boundary::catch(create).unwrap_or_else(|msg| {
        Err(Error::new(
            Status::Backend,
            format!("internal error (panic: {msg})"),
        ))
    });
    let err = match created {
        Ok(engine) => {
            // SAFETY: `out` checked non-null above.
            unsafe { *out = Box::into_raw(engine) };
            return status(Status::Success);
        }
        Err(e) => e,
    };
    let message = format!("BOUNCE backend not created: {}", err.message);
    tracing::error!("{message}");
    let _ = sink_bytes(error_sink, error_ctx, message.as_bytes());
    status(err.status)
}

/// Destroys an engine created by `bounce_engine_new` (takes ownership).
///
/// # Safety
/// `engine` is null or an engine pointer not yet freed.
#[no_mangle]
pub unsafe extern "C" fn bounce_engine_free(engine: *mut Engine) {
    if engine.is_null() {
        return;
    }
    boundary(
        "freeing the BOUNCE engine",
        // SAFETY: ownership returns to Rust exactly once (header contract).
        || drop(unsafe { Box::from_raw(engine) }),
        |_| (),
    )
}

/// The backend parameters for the UCX delegate, as key, value, key, ...
///
/// # Safety
/// `sink`/`ctx` are valid for the call.
#[no_mangle]
pub unsafe extern "C" fn bounce_engine_ucx_params(
    engine: *mut Engine,
    sink: bounce_sink_t,
    ctx: *mut c_void,
) -> i32 {
    on_engine(engine, Call::Work, "creating the UCX delegate", |e| {
        for (k, v) in e.ucx_params() {
            sink_bytes(sink, ctx, k.as_bytes())?;
            sink_bytes(sink, ctx, v.as_bytes())?;
        }
        Ok(Status::Success)
    })
}

/// The UCX delegate's progress-thread delay in us, or `u64::MAX` for the
/// application's own.
///
/// # Safety
/// `engine` is null or a live engine.
#[no_mangle]
pub unsafe extern "C" fn bounce_engine_ucx_progress_delay_us(engine: *const Engine) -> u64 {
    if engine.is_null() {
        return u64::MAX;
    }
    // SAFETY: a live engine (header contract).
    let e = unsafe { &*engine };
    boundary(
        "reading the UCX progress delay",
        || e.ucx_progress_delay_us().unwrap_or(u64::MAX),
        |_| u64::MAX,
    )
}

/// The fewest descriptors any of BOUNCE's own paths takes from memory of
/// kind `local` to memory of kind `remote` (`u64::MAX`: none; 0 for a kind
/// BOUNCE does not take, so that the engine words the error). The shim
/// hands a transfer with fewer to the UCX delegate once
/// [`bounce_engine_count_below_floor`] has counted it.
///
/// # Safety
/// `engine` is null or a live engine.
#[no_mangle]
pub unsafe extern "C" fn bounce_engine_route_floor(
    engine: *const Engine,
    local: i32,
    remote: i32,
) -> u64 {
    if engine.is_null() {
        return 0;
    }
    // SAFETY: a live engine (header contract).
    let e = unsafe { &*engine };
    boundary(
        "reading the route floor",
        || match (MemKind::from_nixl(local), MemKind::from_nixl(remote)) {
            (Ok(l), Ok(r)) => e.route_floor(l, r),
            _ => 0,
        },
        |_| 0,
    )
}

/// Counts a transfer to `remote_agent` that has fewer descriptors than its
/// [`bounce_engine_route_floor`] as prepared on the UCX delegate, for the
/// reason the engine would have given. 1: counted, the shim prepares it on
/// the delegate; 0: the engine must decide (`bounce_engine_prep_xfer`),
/// because it stopped after an internal error or the name is not UTF-8, so
/// that such calls are refused with the engine's own words.
///
/// # Safety
/// `engine` is null or a live engine; `remote_agent` is valid for the call.
#[no_mangle]
pub unsafe extern "C" fn bounce_engine_count_below_floor(
    engine: *const Engine,
    remote_agent: bounce_bytes_t,
) -> i32 {
    if engine.is_null() {
        return 0;
    }
    // SAFETY: a live engine (header contract).
    let e = unsafe { &*engine };
    // SAFETY: caller contract.
    let Ok(agent) = (unsafe { borrow_str(remote_agent, "the remote agent name") }) else {
        return 0;
    };
    if e.is_broken() {
        return 0;
    }
    // A comparison and two atomic additions; nothing unwinds, but nothing
    // may cross.
    boundary(
        "counting a transfer below the route floor",
        || {
            e.count_ucx_routed(e.below_floor_reason(agent == e.local_name()));
            1
        },
        |_| 0,
    )
}

/// Logs why the shim could not create the UCX delegate.
///
/// # Safety
/// `message` is borrowed for the call.
#[no_mangle]
pub unsafe extern "C" fn bounce_engine_report(engine: *mut Engine, message: bounce_bytes_t) {
    let report = || {
        // SAFETY: caller contract.
        let text = String::from_utf8_lossy(unsafe { borrow(message) });
        let agent = if engine.is_null() {
            ""
        } else {
            // SAFETY: a live engine (header contract).
            unsafe { &*engine }.local_name()
        };
        tracing::error!(agent, "BOUNCE backend not created: {text}");
    };
    boundary("reporting the UCX delegate's failure", report, |_| ())
}

// ---- memory ---------------------------------------------------------------------

/// Registers memory. On success `*out` is a new handle owned by the caller,
/// released by `bounce_engine_deregister_mem`.
///
/// # Safety
/// `out` is valid for writing.
#[no_mangle]
pub unsafe extern "C" fn bounce_engine_register_mem(
    engine: *mut Engine,
    addr: usize,
    len: usize,
    dev_id: u64,
    mem: i32,
    ucx_public: bounce_bytes_t,
    out: *mut *mut Md,
) -> i32 {
    on_engine(engine, Call::Work, "registerMem", |e| {
        // SAFETY: `out` comes from the shim (see `out_slot`).
        let slot = unsafe { out_slot(out, "the memory descriptor") }?;
        let md = e.register_mem(
            Range {
                addr,
                len,
                dev: dev_id,
            },
            MemKind::from_nixl(mem)?,
            // SAFETY: caller contract (borrowed for the call).
            unsafe { borrow(ucx_public) },
        )?;
        slot.put(md);
        Ok(Status::Success)
    })
}

/// Deregisters memory; takes ownership of `md` and frees it.
///
/// # Safety
/// `md` is a handle from `bounce_engine_register_mem`, not yet released.
#[no_mangle]
pub unsafe extern "C" fn bounce_engine_deregister_mem(engine: *mut Engine, md: *mut Md) -> i32 {
    release(engine, md, "deregisterMem")
}

/// Unloads loaded metadata; takes ownership of `md` and frees it.
///
/// # Safety
/// `md` is a handle from `_load_remote_md` / `_load_local_md`, not yet released.
#[no_mangle]
pub unsafe extern "C" fn bounce_engine_unload_md(engine: *mut Engine, md: *mut Md) -> i32 {
    release(engine, md, "unloadMD")
}

/// Forgets what preparations keep of the regions they met (the arena
/// check's kept regions, the peer-mapped path's windows). The shim calls
/// it under its table's writer lock before a handle leaves the table, so
/// that no preparation, which runs under the reader lock, finds a region
/// the table no longer holds, nor one about to be freed.
///
/// # Safety
/// `engine` is null or a live engine from `bounce_engine_new`.
#[no_mangle]
pub unsafe extern "C" fn bounce_engine_forget_regions(engine: *mut Engine) -> i32 {
    on_engine(engine, Call::Teardown, "forgetting kept regions", |e| {
        e.forget_regions();
        Ok(Status::Success)
    })
}

fn release(engine: *mut Engine, md: *mut Md, what: &str) -> i32 {
    if md.is_null() {
        return fail(Error::new(
            Status::InvalidParam,
            format!("{what}: null metadata handle"),
        ));
    }
    // SAFETY: ownership of a live handle returns to Rust exactly once (header
    // contract). It is dropped even when the engine refuses the call.
    let md = unsafe { Box::from_raw(md) };
    if engine.is_null() {
        drop(md);
        return fail(Error::new(
            Status::InvalidParam,
            format!("{what}: no engine"),
        ));
    }
    on_engine(engine, Call::Teardown, what, move |e| {
        e.release_md(md).map(|()| Status::Success)
    })
}

/// # Safety
/// `md` is a live handle; `sink`/`ctx` are valid for the call.
#[no_mangle]
pub unsafe extern "C" fn bounce_engine_public_data(
    engine: *mut Engine,
    md: *const Md,
    sink: bounce_sink_t,
    ctx: *mut c_void,
) -> i32 {
    on_engine(engine, Call::Work, "getPublicData", |e| {
        // SAFETY: caller contract.
        let data = e.public_data(unsafe { md_ref(md) }?)?;
        sink_bytes(sink, ctx, &data)?;
        Ok(Status::Success)
    })
}

/// # Safety
/// `ucx_conn` is borrowed for the call; `sink`/`ctx` are valid for the call.
#[no_mangle]
pub unsafe extern "C" fn bounce_engine_conn_info(
    engine: *mut Engine,
    ucx_conn: bounce_bytes_t,
    sink: bounce_sink_t,
    ctx: *mut c_void,
) -> i32 {
    on_engine(engine, Call::Work, "getConnInfo", |e| {
        // SAFETY: caller contract.
        sink_bytes(sink, ctx, &e.conn_info(unsafe { borrow(ucx_conn) }))?;
        Ok(Status::Success)
    })
}

/// # Safety
/// The byte arguments are borrowed for the call; `ucx_sink`/`ucx_ctx` are
/// valid for the call.
#[no_mangle]
pub unsafe extern "C" fn bounce_engine_load_remote_conn_info(
    engine: *mut Engine,
    remote_agent: bounce_bytes_t,
    conn_info: bounce_bytes_t,
    ucx_sink: bounce_sink_t,
    ucx_ctx: *mut c_void,
) -> i32 {
    on_engine(engine, Call::Work, "loadRemoteConnInfo", |e| {
        // SAFETY: caller contract.
        let (agent, info) = unsafe {
            (
                borrow_str(remote_agent, "the remote agent name")?,
                borrow(conn_info),
            )
        };
        let ucx_conn = e.load_remote_conn_info(agent, info)?;
        sink_bytes(ucx_sink, ucx_ctx, &ucx_conn)?;
        Ok(Status::Success)
    })
}

/// Loads a remote region. On success `*out` is a new handle owned by the
/// caller, released by `bounce_engine_unload_md`.
///
/// # Safety
/// The byte arguments are borrowed for the call; `out` is valid for writing.
#[no_mangle]
pub unsafe extern "C" fn bounce_engine_load_remote_md(
    engine: *mut Engine,
    addr: usize,
    len: usize,
    dev_id: u64,
    public_data: bounce_bytes_t,
    mem: i32,
    remote_agent: bounce_bytes_t,
    ucx_sink: bounce_sink_t,
    ucx_ctx: *mut c_void,
    out: *mut *mut Md,
) -> i32 {
    on_engine(engine, Call::Work, "loadRemoteMD", |e| {
        // SAFETY: `out` comes from the shim (see `out_slot`).
        let slot = unsafe { out_slot(out, "the memory descriptor") }?;
        // SAFETY: caller contract.
        let (agent, data) = unsafe {
            (
                borrow_str(remote_agent, "the remote agent name")?,
                borrow(public_data),
            )
        };
        let (md, ucx_public) = e.load_remote_md(
            agent,
            Range {
                addr,
                len,
                dev: dev_id,
            },
            MemKind::from_nixl(mem)?,
            data,
        )?;
        sink_bytes(ucx_sink, ucx_ctx, &ucx_public)?;
        slot.put(md);
        Ok(Status::Success)
    })
}

/// # Safety
/// `input` is a live handle; `out` is valid for writing.
#[no_mangle]
pub unsafe extern "C" fn bounce_engine_load_local_md(
    engine: *mut Engine,
    input: *const Md,
    out: *mut *mut Md,
) -> i32 {
    on_engine(engine, Call::Work, "loadLocalMD", |e| {
        // SAFETY: `out` comes from the shim (see `out_slot`).
        let slot = unsafe { out_slot(out, "the memory descriptor") }?;
        // SAFETY: caller contract.
        let md = e.load_local_md(unsafe { md_ref(input) }?)?;
        slot.put(md);
        Ok(Status::Success)
    })
}

// ---- connections ------------------------------------------------------------------

/// # Safety
/// `remote_agent` is borrowed for the call.
#[no_mangle]
pub unsafe extern "C" fn bounce_engine_connect(
    engine: *mut Engine,
    remote_agent: bounce_bytes_t,
) -> i32 {
    on_engine(engine, Call::Work, "connect", |e| {
        // SAFETY: caller contract.
        e.connect(unsafe { borrow_str(remote_agent, "the remote agent name") }?)
            .map(|()| Status::Success)
    })
}

/// # Safety
/// `remote_agent` is borrowed for the call.
#[no_mangle]
pub unsafe extern "C" fn bounce_engine_disconnect(
    engine: *mut Engine,
    remote_agent: bounce_bytes_t,
) -> i32 {
    on_engine(engine, Call::Teardown, "disconnect", |e| {
        // SAFETY: caller contract.
        e.disconnect(unsafe { borrow_str(remote_agent, "the remote agent name") }?)
            .map(|()| Status::Success)
    })
}

// ---- transfers --------------------------------------------------------------------

/// What a preparation can refuse without looking at a descriptor: the
/// operation, the two lists' counts, the remote agent, the custom
/// parameter. On success `*defer` says whether the request's routing and
/// per-descriptor preparation wait for its first post
/// (`Config::prepare_at_post`), where the shim calls
/// `bounce_engine_prep_xfer` with the post's lists.
///
/// # Safety
/// `remote_agent` and `args` are valid for the call; `defer` is valid for
/// writing.
#[no_mangle]
pub unsafe extern "C" fn bounce_engine_admit_xfer(
    engine: *mut Engine,
    op: i32,
    local_count: usize,
    remote_count: usize,
    local_mem: i32,
    remote_mem: i32,
    remote_agent: bounce_bytes_t,
    args: *const bounce_xfer_args_t,
    defer: *mut i32,
) -> i32 {
    on_engine(engine, Call::Work, "prepXfer", |e| {
        let defer = RouteSlot::new(defer)?;
        // SAFETY: caller contract.
        let agent = unsafe { borrow_str(remote_agent, "the remote agent name") }?;
        // SAFETY: caller contract.
        let args = unsafe { xfer_args(args, false) };
        Op::from_nixl(op)?;
        let kinds = [local_mem, remote_mem].map(|m| MemKind::from_nixl(m).ok());
        let later = e.admit_xfer(local_count, remote_count, kinds, agent, &args)?;
        defer.set(i32::from(later));
        Ok(Status::Success)
    })
}

/// Prepares a transfer: on success either `*delegate` is 1 (the UCX
/// delegate carries it; `*req` stays null) or `*req` is a new request owned
/// by the caller, released by `bounce_engine_release_req`.
///
/// # Safety
/// Lists and args are valid for the call; `delegate` and `req` are valid for
/// writing.
#[no_mangle]
pub unsafe extern "C" fn bounce_engine_prep_xfer(
    engine: *mut Engine,
    op: i32,
    local: *const bounce_desc_list_t,
    remote: *const bounce_desc_list_t,
    remote_agent: bounce_bytes_t,
    args: *const bounce_xfer_args_t,
    delegate: *mut i32,
    req: *mut *mut Request,
) -> i32 {
    let started = std::time::Instant::now();
    // SAFETY: as in `on_engine`: null, or an engine bounce_engine_new
    // handed out and not yet freed.
    let what = unsafe { engine.as_ref() }.map_or("prepXfer", Engine::preparing_call);
    on_engine(engine, Call::Work, what, |e| {
        // The plugin's own share of a preparation, whichever path it takes.
        let _timed = PrepTimer(e, started);
        // SAFETY: `req` comes from the shim (see `out_slot`).
        let slot = unsafe { out_slot(req, "the transfer request") }?;
        let to_ucx = RouteSlot::new(delegate)?;
        // SAFETY: caller contract.
        let agent = unsafe { borrow_str(remote_agent, "the remote agent name") }?;
        // The shape first, without building anything per descriptor: most
        // transfers that go to UCX are decided here.
        // SAFETY: caller contract.
        let (lraw, lkind, lres) = unsafe { raw_descs(local, "local") }?;
        // SAFETY: caller contract.
        let (rraw, rkind, rres) = unsafe { raw_descs(remote, "remote") }?;
        let total = std::cell::OnceCell::new();
        let shape = Shape {
            local: lkind,
            remote: rkind,
            descriptors: lraw.len() as u64,
            bytes: TotalBytes::Of(as_raw(lraw), &total),
            local_transfer: agent == e.local_name(),
        };
        // The notification is not copied: NIXL passes it again to every
        // postXfer (the request's own, or a re-post's new one), which
        // takes it from there.
        // SAFETY: caller contract.
        let args = unsafe { xfer_args(args, false) };
        if e.early_fallback(&shape, agent, &args)?.is_some() {
            to_ucx.set(1);
            return Ok(Status::Success);
        }
        let (lres, rres) = (
            // SAFETY: the shim's resolver, valid for the call, given the
            // non-null backend metadata of a descriptor.
            move |p| unsafe { lres.md(p) },
            // SAFETY: as above.
            move |p| unsafe { rres.md(p) },
        );
        // SAFETY: the metadata are the handles NIXL hands back, which the
        // shim's table resolves to this engine's `Md`s (or null); every
        // look-up reads the magic first (`Descs::md`).
        let (l, r) = unsafe {
            (
                Descs::new(lkind, as_raw(lraw), &lres),
                Descs::new(rkind, as_raw(rraw), &rres),
            )
        };
        match e.prep_xfer(Op::from_nixl(op)?, l, r, agent, args, &shape, started)? {
            Some(request) => {
                to_ucx.set(0);
                slot.put(Box::new(request));
            }
            None => to_ucx.set(1),
        }
        Ok(Status::Success)
    })
}

/// Posts (or posts again) a request from `bounce_engine_prep_xfer`.
///
/// # Safety
/// `args` is null or valid for the call; `req` is a live request.
#[no_mangle]
pub unsafe extern "C" fn bounce_engine_post_xfer(
    engine: *mut Engine,
    args: *const bounce_xfer_args_t,
    req: *mut Request,
) -> i32 {
    on_engine(engine, Call::Work, "postXfer", |e| {
        if req.is_null() {
            return Err(Error::new(Status::InvalidParam, "null request handle"));
        }
        // SAFETY: caller contract.
        let args = unsafe { xfer_args(args, true) };
        // SAFETY: a live request owned by the caller, not aliased during the call.
        e.post_xfer(unsafe { &mut *req }, args)
    })
}

/// # Safety
/// `req` is a live request.
#[no_mangle]
pub unsafe extern "C" fn bounce_engine_check_xfer(engine: *mut Engine, req: *mut Request) -> i32 {
    on_engine(engine, Call::Work, "checkXfer", |e| {
        if req.is_null() {
            return Err(Error::new(Status::InvalidParam, "null request handle"));
        }
        // SAFETY: caller contract.
        e.check_xfer(unsafe { &mut *req })
    })
}

/// Releases a request (takes ownership; aborts it if still running).
///
/// # Safety
/// `req` is a live request, not used again after this call.
#[no_mangle]
pub unsafe extern "C" fn bounce_engine_release_req(engine: *mut Engine, req: *mut Request) -> i32 {
    if req.is_null() {
        return fail(Error::new(
            Status::InvalidParam,
            "releaseReqH: null request handle",
        ));
    }
    // SAFETY: ownership returns to Rust exactly once (header contract); freed
    // even when the engine refuses the call.
    let request = unsafe { Box::from_raw(req) };
    if engine.is_null() {
        return status(Status::Success);
    }
    on_engine(engine, Call::Teardown, "releaseReqH", move |e| {
        e.release_req(*request).map(|()| Status::Success)
    })
}

// ---- notifications ------------------------------------------------------------------

/// # Safety
/// `sink`/`ctx` are valid for the call.
#[no_mangle]
pub unsafe extern "C" fn bounce_engine_get_notifs(
    engine: *mut Engine,
    sink: bounce_notif_sink_t,
    ctx: *mut c_void,
) -> i32 {
    on_engine(engine, Call::Work, "getNotifs", |e| {
        let sink =
            sink.ok_or_else(|| Error::new(Status::InvalidParam, "no notification callback"))?;
        for (agent, msg) in e.get_notifs()? {
            let a = bounce_bytes_t {
                ptr: agent.as_ptr(),
                len: agent.len(),
            };
            let m = bounce_bytes_t {
                ptr: msg.as_ptr(),
                len: msg.len(),
            };
            // SAFETY: the callback and ctx are valid for the call; the bytes
            // live until after it returns.
            unsafe { sink(ctx, a, m) };
        }
        Ok(Status::Success)
    })
}

// ---- observability ------------------------------------------------------------------

/// Writes a JSON snapshot of the counters of `agent`'s BOUNCE engine into
/// `buf` (up to `cap` bytes) and returns the snapshot's full length (call
/// again with a larger buffer if it exceeds `cap`), or -1 when this library
/// holds no engine for that agent. Callable from Python with ctypes.
///
/// # Safety
/// `agent` points to `agent_len` readable bytes; `buf` to `cap` writable bytes
/// (or `cap` is 0).
#[no_mangle]
pub unsafe extern "C" fn nixl_bounce_stats(
    agent: *const u8,
    agent_len: usize,
    buf: *mut u8,
    cap: usize,
) -> isize {
    let snapshot = || {
        // SAFETY: caller contract.
        let name = unsafe {
            borrow(bounce_bytes_t {
                ptr: agent,
                len: agent_len,
            })
        };
        let Ok(name) = std::str::from_utf8(name) else {
            return -1;
        };
        let Some(snapshot) = crate::stats::local_snapshot(name) else {
            return -1;
        };
        let json = serde_json::to_vec(&snapshot).unwrap_or_default();
        if !buf.is_null() && json.len() <= cap {
            // SAFETY: buf has cap >= json.len() writable bytes (caller contract).
            unsafe { std::ptr::copy_nonoverlapping(json.as_ptr(), buf, json.len()) };
        }
        json.len() as isize
    };
    boundary("nixl_bounce_stats", snapshot, |_| -1)
}

/// Writes a JSON array of every bounce arena poisoned in this process
/// (`[{"arena": "<agent> <location>", "reason": "..."}]`, oldest first,
/// `[]` when none) into `buf` (up to `cap` bytes) and returns its full
/// length (call again with a larger buffer if it exceeds `cap`), or -1 on an
/// internal error. A poisoned arena is never used again; its engine's
/// transfers take the UCX path.
///
/// # Safety
/// `buf` points to `cap` writable bytes (or `cap` is 0).
#[no_mangle]
pub unsafe extern "C" fn nixl_bounce_poisoned(buf: *mut u8, cap: usize) -> isize {
    let poisoned = || {
        let json = serde_json::to_vec(&crate::stats::local_poisoned()).unwrap_or_default();
        if !buf.is_null() && json.len() <= cap {
            // SAFETY: buf has cap >= json.len() writable bytes (caller contract).
            unsafe { std::ptr::copy_nonoverlapping(json.as_ptr(), buf, json.len()) };
        }
        json.len() as isize
    };
    boundary("nixl_bounce_poisoned", poisoned, |_| -1)
}
