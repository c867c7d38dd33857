//! Compiling the copy kernel with NVRTC: the target for a device's
//! architecture, the options, and the compile itself.

use super::*;

/// What NVRTC should produce for a device of compute capability `cc`
/// (`major * 10 + minor`).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum NvrtcTarget {
    /// Machine code for `sm_XY` (the normal case: no JIT at load time).
    Cubin(u32),
    /// PTX for `compute_XY`, JIT-compiled by the driver (NVRTC older than the GPU).
    Ptx(u32),
}

impl NvrtcTarget {
    /// The `--gpu-architecture` option for this target.
    pub fn arch_option(&self) -> String {
        match self {
            NvrtcTarget::Cubin(a) => format!("--gpu-architecture=sm_{a}"),
            NvrtcTarget::Ptx(a) => format!("--gpu-architecture=compute_{a}"),
        }
    }
}

/// `major * 10 + minor`, as NVRTC numbers architectures (9.0 -> 90, 10.0 -> 100).
pub fn arch_number(major: i32, minor: i32) -> Option<u32> {
    if major <= 0 || !(0..10).contains(&minor) {
        return None;
    }
    u32::try_from(major)
        .ok()?
        .checked_mul(10)?
        .checked_add(minor as u32)
}

/// Picks the NVRTC target: machine code for the device's own architecture
/// when NVRTC supports it (or when the supported list is unknown), otherwise
/// PTX for the newest older architecture NVRTC knows.
pub fn choose_target(major: i32, minor: i32, supported: &[i32]) -> Result<NvrtcTarget, CudaError> {
    let want = arch_number(major, minor).ok_or_else(|| {
        CudaError::Unavailable(format!("unusable compute capability {major}.{minor}"))
    })?;
    if supported.is_empty() || supported.contains(&(want as i32)) {
        return Ok(NvrtcTarget::Cubin(want));
    }
    supported
        .iter()
        .copied()
        .filter(|&s| s > 0 && (s as u32) < want)
        .max()
        .map(|s| NvrtcTarget::Ptx(s as u32))
        .ok_or_else(|| {
            CudaError::Unavailable(format!(
                "NVRTC supports none of the architectures up to sm_{want} (it knows {supported:?})"
            ))
        })
}

/// The NVRTC options for `target`.
pub fn nvrtc_options(target: NvrtcTarget) -> Vec<String> {
    vec![
        target.arch_option(),
        "--std=c++17".into(),
        "--device-as-default-execution-space".into(),
        "--generate-line-info".into(),
    ]
}

/// An NVRTC program, destroyed on drop.
pub(super) struct Program(nvrtc::sys::nvrtcProgram);

impl Drop for Program {
    fn drop(&mut self) {
        // SAFETY: the program was created by create_program and is destroyed once.
        let _ = unsafe { nvrtc::result::destroy_program(self.0) };
    }
}

pub(super) fn c_chars_to_string(v: &[std::ffi::c_char]) -> String {
    let bytes: Vec<u8> = v.iter().map(|&c| c as u8).take_while(|&b| b != 0).collect();
    String::from_utf8_lossy(&bytes).into_owned()
}

/// Compiles `src` and returns the cubin (or the PTX text, NUL-free).
pub(super) fn nvrtc_compile(src: &str, target: NvrtcTarget) -> Result<Vec<u8>, CudaError> {
    let csrc = CString::new(src)
        .map_err(|_| CudaError::Invalid("kernel source contains a NUL byte".into()))?;
    let name = CString::new("gather_scatter.cu").expect("no NUL in a literal");
    let prog = Program(
        nvrtc::result::create_program(&csrc, Some(&name))
            .map_err(|e| CudaError::call("nvrtcCreateProgram", e))?,
    );
    let options = nvrtc_options(target);
    // SAFETY: prog is a live program; options are plain strings.
    if let Err(e) = unsafe { nvrtc::result::compile_program(prog.0, &options) } {
        // SAFETY: prog is still live.
        let log = unsafe { nvrtc::result::get_program_log(prog.0) }
            .map(|l| c_chars_to_string(&l))
            .unwrap_or_else(|le| format!("(no log: {le})"));
        return Err(CudaError::call(
            format!("NVRTC failed to compile the copy kernel with {options:?}"),
            format!("{e}\n{log}"),
        ));
    }
    match target {
        NvrtcTarget::Cubin(_) => {
            let mut size = 0usize;
            // SAFETY: prog was compiled for a real architecture, so it has a
            // cubin; the size is written through a valid pointer.
            unsafe { nvrtc::sys::nvrtcGetCUBINSize(prog.0, &mut size) }
                .result()
                .map_err(|e| CudaError::call("nvrtcGetCUBINSize", e))?;
            let mut cubin = vec![0u8; size];
            // SAFETY: cubin has exactly the size NVRTC reported.
            unsafe { nvrtc::sys::nvrtcGetCUBIN(prog.0, cubin.as_mut_ptr() as *mut _) }
                .result()
                .map_err(|e| CudaError::call("nvrtcGetCUBIN", e))?;
            Ok(cubin)
        }
        NvrtcTarget::Ptx(_) => {
            // SAFETY: prog is compiled and live.
            let ptx = unsafe { nvrtc::result::get_ptx(prog.0) }
                .map_err(|e| CudaError::call("nvrtcGetPTX", e))?;
            Ok(c_chars_to_string(&ptx).into_bytes())
        }
    }
}

/// Compiles the copy kernel for `target` without any device (NVRTC only):
/// the image (cubin, or PTX text) and the compile time. Err when NVRTC is
/// absent or rejects the source (with its log).
pub fn compile_copy_kernel(target: NvrtcTarget) -> Result<(Vec<u8>, Duration), CudaError> {
    // SAFETY: only tries to dlopen the candidate library names.
    if !unsafe { nvrtc::sys::is_culib_present() } {
        return Err(CudaError::Unavailable(
            "NVRTC is not available: libnvrtc.so could not be loaded".into(),
        ));
    }
    guarded("compiling the copy kernel", || {
        let t = Instant::now();
        let image = nvrtc_compile(KERNEL_SOURCE, target)?;
        Ok((image, t.elapsed()))
    })
}

pub(super) fn nvrtc_supported_archs() -> Vec<i32> {
    let mut n: std::ffi::c_int = 0;
    // SAFETY: writes one int.
    if unsafe { nvrtc::sys::nvrtcGetNumSupportedArchs(&mut n) }
        .result()
        .is_err()
        || n <= 0
    {
        return Vec::new();
    }
    let mut v = vec![0i32; n as usize];
    // SAFETY: v has room for the n entries NVRTC reported.
    if unsafe { nvrtc::sys::nvrtcGetSupportedArchs(v.as_mut_ptr()) }
        .result()
        .is_err()
    {
        return Vec::new();
    }
    v
}
