//! The CUDA driver and its devices: [`CudaRuntime`] (found without
//! panicking), [`CudaDevice`] (opened once a process) and its compiled
//! [`CopyKernel`].

use super::*;

/// Runs `f`, turning a panic inside cudarc (missing library or symbol) into an error.
pub(super) fn guarded<T>(
    what: &str,
    f: impl FnOnce() -> Result<T, CudaError>,
) -> Result<T, CudaError> {
    crate::boundary::catch(f).unwrap_or_else(|panic| {
        Err(CudaError::Panicked {
            what: what.to_string(),
            panic: panic.to_string(),
        })
    })
}

/// The process's CUDA driver: present, initialised, with at least one device.
/// Cheap to clone; one per process (devices are opened and kernels compiled
/// once, whoever asks).
#[derive(Clone)]
pub struct CudaRuntime {
    pub(super) inner: Arc<RuntimeInner>,
}

pub(super) struct RuntimeInner {
    pub(super) device_count: usize,
    pub(super) driver_version: i32,
    pub(super) devices: Mutex<HashMap<usize, Arc<CudaDevice>>>,
}

impl std::fmt::Debug for CudaRuntime {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("CudaRuntime")
            .field("device_count", &self.inner.device_count)
            .field("driver_version", &self.inner.driver_version)
            .finish()
    }
}

impl CudaRuntime {
    /// Finds and initialises the CUDA driver. Never panics: without
    /// `libcuda.so`, without a device, or when `cuInit` fails, the error says
    /// which. The result is cached for the process.
    pub fn probe() -> Result<CudaRuntime, CudaError> {
        static RUNTIME: OnceLock<Result<CudaRuntime, CudaError>> = OnceLock::new();
        RUNTIME.get_or_init(probe_uncached).clone()
    }

    pub fn device_count(&self) -> usize {
        self.inner.device_count
    }

    /// The driver's CUDA version (e.g. 13000 for 13.0).
    pub fn driver_version(&self) -> i32 {
        self.inner.driver_version
    }

    /// Device `ordinal` (its primary context, retained once per process).
    pub fn device(&self, ordinal: usize) -> Result<Arc<CudaDevice>, CudaError> {
        if ordinal >= self.inner.device_count {
            return Err(CudaError::Invalid(format!(
                "CUDA device {ordinal} does not exist ({} present)",
                self.inner.device_count
            )));
        }
        let mut devices = self.inner.devices.locked();
        if let Some(d) = devices.get(&ordinal) {
            return Ok(d.clone());
        }
        let d = Arc::new(guarded("opening a CUDA device", || {
            CudaDevice::open(ordinal)
        })?);
        devices.insert(ordinal, d.clone());
        Ok(d)
    }
}

pub(super) fn probe_uncached() -> Result<CudaRuntime, CudaError> {
    // SAFETY: only tries to dlopen the candidate library names; no symbol
    // is called.
    if !unsafe { sys::is_culib_present() } {
        return Err(CudaError::Unavailable(
            "no CUDA driver: libcuda.so could not be loaded".into(),
        ));
    }
    guarded("probing the CUDA driver", || {
        result::init().map_err(|e| CudaError::Unavailable(format!("cuInit failed: {e}")))?;
        let count =
            result::device::get_count().map_err(|e| CudaError::call("cuDeviceGetCount", e))?;
        if count <= 0 {
            return Err(CudaError::Unavailable(
                "the CUDA driver reports no device".into(),
            ));
        }
        let mut version: i32 = 0;
        // SAFETY: cuDriverGetVersion writes one int through a valid pointer.
        unsafe { sys::cuDriverGetVersion(&mut version) }
            .result()
            .map_err(|e| CudaError::call("cuDriverGetVersion", e))?;
        Ok(CudaRuntime {
            inner: Arc::new(RuntimeInner {
                device_count: count as usize,
                driver_version: version,
                devices: Mutex::new(HashMap::new()),
            }),
        })
    })
}

/// One GPU: its primary context and, once compiled, its copy kernel.
pub struct CudaDevice {
    pub(super) ordinal: usize,
    pub(super) ctx: Arc<CudaContext>,
    pub(super) name: String,
    pub(super) cc: (i32, i32),
    pub(super) sm_count: u32,
    pub(super) kernel: OnceLock<Result<Arc<CopyKernel>, CudaError>>,
}

impl std::fmt::Debug for CudaDevice {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("CudaDevice")
            .field("ordinal", &self.ordinal)
            .field("name", &self.name)
            .field("cc", &self.cc)
            .field("sm_count", &self.sm_count)
            .finish()
    }
}

impl CudaDevice {
    pub(super) fn open(ordinal: usize) -> Result<CudaDevice, CudaError> {
        let ctx = CudaContext::new(ordinal).map_err(|e| {
            CudaError::call(
                format!("retaining the primary context of CUDA device {ordinal}"),
                e,
            )
        })?;
        let name = ctx
            .name()
            .map_err(|e| CudaError::call(format!("cuDeviceGetName({ordinal})"), e))?;
        let cc = ctx
            .compute_capability()
            .map_err(|e| CudaError::call(format!("compute capability of device {ordinal}"), e))?;
        let sm_count = ctx
            .attribute(sys::CUdevice_attribute::CU_DEVICE_ATTRIBUTE_MULTIPROCESSOR_COUNT)
            .map_err(|e| CudaError::call(format!("multiprocessor count of device {ordinal}"), e))?;
        Ok(CudaDevice {
            ordinal,
            ctx,
            name,
            cc,
            sm_count: sm_count.max(1) as u32,
            kernel: OnceLock::new(),
        })
    }

    pub fn ordinal(&self) -> usize {
        self.ordinal
    }
    pub fn name(&self) -> &str {
        &self.name
    }
    /// (major, minor).
    pub fn compute_capability(&self) -> (i32, i32) {
        self.cc
    }
    pub fn sm_count(&self) -> u32 {
        self.sm_count
    }
    /// The primary context (cudarc), e.g. to create more streams.
    pub fn context(&self) -> &Arc<CudaContext> {
        &self.ctx
    }

    /// Makes this device's context current on the calling thread.
    pub fn bind(&self) -> Result<(), CudaError> {
        self.ctx
            .bind_to_thread()
            .map_err(|e| CudaError::call(format!("making CUDA device {} current", self.ordinal), e))
    }

    /// The copy kernel, compiled with NVRTC at the first call (once per
    /// process and device; a failure is cached too and returned again).
    pub fn copy_kernel(&self) -> Result<Arc<CopyKernel>, CudaError> {
        self.kernel
            .get_or_init(|| {
                guarded("compiling the copy kernel", || CopyKernel::build(self)).map(Arc::new)
            })
            .clone()
    }
}

/// The loaded copy kernel of one device.
pub struct CopyKernel {
    /// `bounce_copy`: reads an uploaded table.
    pub(super) func: CudaFunction,
    /// `bounce_copy_zero_copy`: reads the table from mapped pinned memory.
    pub(super) func_zero_copy: CudaFunction,
    /// `bounce_copy_pairs`: reads an uploaded pair table.
    pub(super) func_pairs: CudaFunction,
    /// `bounce_copy_pairs_inline<N>` for each N of [`INLINE_PAIRS`] (none
    /// when NVRTC compiled them out, older than CUDA 12.1 or for a GPU
    /// before Volta, or when the driver is older than 12.1).
    pub(super) func_pairs_inline: Vec<(usize, CudaFunction)>,
    /// `bounce_copy_packed_inline<N>` for each N of [`INLINE_PACKED`]
    /// (none where the pair kernels above are none).
    pub(super) func_packed_inline: Vec<(usize, CudaFunction)>,
    pub(super) _module: Arc<CudaModule>,
    /// What NVRTC compiled for (e.g. `sm_90`).
    pub target: NvrtcTarget,
    /// NVRTC compile time (plus module load).
    pub compile_time: Duration,
    /// Resident blocks per SM at `BLOCK_THREADS` threads (occupancy query).
    pub blocks_per_sm: u32,
    /// Most blocks one launch uses (`sm_count * blocks_per_sm * GRID_WAVES`);
    /// a chunk with more tiles than these blocks have warps gives each warp
    /// several consecutive tiles.
    pub max_grid: u32,
}

impl std::fmt::Debug for CopyKernel {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("CopyKernel")
            .field("target", &self.target)
            .field("compile_time", &self.compile_time)
            .field("blocks_per_sm", &self.blocks_per_sm)
            .field("max_grid", &self.max_grid)
            .finish()
    }
}

impl CopyKernel {
    /// The kernel that reads an uploaded table (the peer-mapped copy's).
    pub(crate) fn function(&self) -> &CudaFunction {
        &self.func
    }

    /// The kernel over an uploaded pair table ([`launch_pairs`]).
    pub(crate) fn pairs_function(&self) -> &CudaFunction {
        &self.func_pairs
    }

    /// The smallest pair kernel taking its table as a parameter that holds
    /// `n` copies, with its capacity ([`launch_pairs_inline`]).
    pub(crate) fn inline_pairs_function(&self, n: usize) -> Option<(usize, &CudaFunction)> {
        self.func_pairs_inline
            .iter()
            .find(|(cap, _)| n <= *cap)
            .map(|(cap, f)| (*cap, f))
    }

    /// The smallest packed-copies kernel taking the application addresses
    /// as a parameter that holds `n` copies, with its capacity
    /// ([`launch_packed_inline`]).
    pub(crate) fn inline_packed_function(&self, n: usize) -> Option<(usize, &CudaFunction)> {
        self.func_packed_inline
            .iter()
            .find(|(cap, _)| n <= *cap)
            .map(|(cap, f)| (*cap, f))
    }

    pub(super) fn build(dev: &CudaDevice) -> Result<CopyKernel, CudaError> {
        // SAFETY: only tries to dlopen the candidate library names.
        if !unsafe { nvrtc::sys::is_culib_present() } {
            return Err(CudaError::Unavailable(
                "NVRTC is not available: libnvrtc.so could not be loaded".into(),
            ));
        }
        let started = Instant::now();
        let target = choose_target(dev.cc.0, dev.cc.1, &nvrtc_supported_archs())?;
        let image = nvrtc_compile(KERNEL_SOURCE, target)?;
        dev.bind()?;
        let ptx = match target {
            NvrtcTarget::Cubin(_) => nvrtc::Ptx::from_binary(image),
            NvrtcTarget::Ptx(_) => nvrtc::Ptx::from_src(String::from_utf8_lossy(&image)),
        };
        let module = dev.ctx.load_module(ptx).map_err(|e| {
            CudaError::call(
                format!(
                    "loading the copy kernel ({target:?}) on device {}",
                    dev.ordinal
                ),
                e,
            )
        })?;
        let func = module
            .load_function(KERNEL_NAME)
            .map_err(|e| CudaError::call(format!("cuModuleGetFunction({KERNEL_NAME})"), e))?;
        let func_zero_copy = module.load_function(ZERO_COPY_KERNEL_NAME).map_err(|e| {
            CudaError::call(format!("cuModuleGetFunction({ZERO_COPY_KERNEL_NAME})"), e)
        })?;
        let func_pairs = module
            .load_function(PAIRS_KERNEL_NAME)
            .map_err(|e| CudaError::call(format!("cuModuleGetFunction({PAIRS_KERNEL_NAME})"), e))?;
        // Absent from the module when NVRTC compiled them out (see the
        // source); unused when the driver predates large kernel parameters.
        let mut driver: std::ffi::c_int = 0;
        // SAFETY: one out pointer.
        let driver_ok = unsafe { sys::cuDriverGetVersion(&mut driver) }
            .result()
            .is_ok()
            && driver >= 12010;
        // The inline kernels of `sizes`, named by `name`.
        let inline = |sizes: &[usize], name: fn(usize) -> String| -> Vec<(usize, CudaFunction)> {
            sizes
                .iter()
                .filter(|_| driver_ok)
                .filter_map(|&n| Some((n, module.load_function(&name(n)).ok()?)))
                .collect()
        };
        let func_pairs_inline = inline(&INLINE_PAIRS, inline_pairs_kernel_name);
        let func_packed_inline = inline(&INLINE_PACKED, inline_packed_kernel_name);
        if func_pairs_inline.is_empty() {
            tracing::info!(
                driver,
                "no inline pair kernels (NVRTC or driver older than CUDA 12.1, or a GPU before Volta): every peer-mapped table is uploaded"
            );
        }
        let compile_time = started.elapsed();
        // SAFETY: func is a live kernel of a loaded module.
        let occ = unsafe {
            result::occupancy::max_active_block_per_multiprocessor(
                func.cu_function(),
                BLOCK_THREADS as i32,
                0,
            )
        }
        .map_err(|e| CudaError::call("cuOccupancyMaxActiveBlocksPerMultiprocessor", e))?;
        let blocks_per_sm = occ.clamp(1, 32) as u32;
        Ok(CopyKernel {
            func,
            func_zero_copy,
            func_pairs,
            func_pairs_inline,
            func_packed_inline,
            _module: module,
            target,
            compile_time,
            blocks_per_sm,
            max_grid: dev
                .sm_count
                .saturating_mul(blocks_per_sm)
                .saturating_mul(GRID_WAVES)
                .max(1),
        })
    }
}
