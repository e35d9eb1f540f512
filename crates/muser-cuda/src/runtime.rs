//! Device start-up, kernel compilation (NVRTC, cached on disk), device buffers, launches and
//! cuBLAS calls. Everything runs on one stream, so a decode step can be captured as a graph.

use std::collections::HashMap;
use std::ffi::c_void;
use std::path::{Path, PathBuf};
use std::sync::Arc;

use cudarc::cublas::{result as blas, sys as blas_sys, CudaBlas};
use cudarc::driver::{
    result as drv, sys as drv_sys, CudaContext, CudaFunction, CudaGraph, CudaModule, CudaStream,
    DriverError,
};
use cudarc::nvrtc::{CompileOptions, Ptx};

use crate::plan::Overrides;
use crate::CudaError;

/// The kernel source, compiled at start-up for the device's architecture.
pub const KERNELS_CU: &str = include_str!("kernels.cu");

/// The kernels of [`crate::backend::CudaBackend`]'s per-op path, a second module loaded by
/// [`Gpu::load_module`] only when that backend starts.
pub const OPS_CU: &str = include_str!("ops.cu");

type Result<T> = std::result::Result<T, CudaError>;

pub(crate) fn drv_err(e: DriverError) -> CudaError {
    CudaError::Driver(format!("{e:?}"))
}

fn blas_err(e: blas::CublasError) -> CudaError {
    CudaError::Blas(format!("{e:?}"))
}

/// What the device is.
#[derive(Clone, Debug)]
pub struct DeviceInfo {
    /// Marketing name, e.g. "NVIDIA H200".
    pub name: String,
    /// Compute capability (major, minor).
    pub compute_capability: (i32, i32),
    /// Device memory in bytes.
    pub total_mem: usize,
    /// Number of multiprocessors.
    pub sm_count: i32,
    /// Peak clock of the multiprocessors, kHz.
    pub clock_khz: i32,
}

/// Checks that the driver, NVRTC and cuBLAS libraries can be loaded, without panicking
/// (cudarc panics on first use of a missing library).
pub fn check_libraries() -> Result<()> {
    // SAFETY: these only try to open the shared libraries.
    unsafe {
        if !drv_sys::is_culib_present() {
            return Err(CudaError::LibraryMissing {
                lib: "libcuda.so",
                hint: "the NVIDIA driver",
            });
        }
        if !cudarc::nvrtc::sys::is_culib_present() {
            return Err(CudaError::LibraryMissing {
                lib: "libnvrtc.so",
                hint: "the CUDA toolkit (NVRTC)",
            });
        }
        if !blas_sys::is_culib_present() {
            return Err(CudaError::LibraryMissing {
                lib: "libcublas.so",
                hint: "the CUDA toolkit (cuBLAS)",
            });
        }
    }
    Ok(())
}

/// The CUDA include folder: `$CUDA_HOME/include`, `$CUDA_PATH/include`, or `/usr/local/cuda/include`.
pub fn cuda_include_dir() -> Result<PathBuf> {
    let mut tried = Vec::new();
    let roots = ["CUDA_HOME", "CUDA_PATH"]
        .iter()
        .filter_map(|k| std::env::var_os(k).map(PathBuf::from))
        .chain(std::iter::once(PathBuf::from("/usr/local/cuda")));
    for root in roots {
        let inc = root.join("include");
        if inc.join("cuda_fp16.h").is_file() {
            return Ok(inc);
        }
        tried.push(inc.display().to_string());
    }
    Err(CudaError::HeadersMissing(tried.join(", ")))
}

fn cache_dir() -> Option<PathBuf> {
    if let Some(d) = std::env::var_os("MUSER_CACHE") {
        return Some(PathBuf::from(d).join("kernels"));
    }
    if let Some(d) = std::env::var_os("XDG_CACHE_HOME") {
        return Some(PathBuf::from(d).join("muser").join("kernels"));
    }
    std::env::var_os("HOME").map(|h| {
        PathBuf::from(h)
            .join(".cache")
            .join("muser")
            .join("kernels")
    })
}

fn fnv1a(parts: &[&[u8]]) -> u64 {
    let mut h: u64 = 0xcbf2_9ce4_8422_2325;
    for p in parts {
        for &b in *p {
            h ^= b as u64;
            h = h.wrapping_mul(0x0100_0000_01b3);
        }
        h ^= 0xff;
        h = h.wrapping_mul(0x0100_0000_01b3);
    }
    h
}

/// Compiles the kernels to PTX for `arch` (e.g. "sm_90"), or reads them from the disk cache
/// (keyed by source, architecture and NVRTC version). Needs no device, only NVRTC and headers.
pub fn compile_kernels(arch: &str) -> Result<String> {
    compile_source(KERNELS_CU, arch)
}

/// The prelude every module starts with (types, warp and block sums, programmatic-launch waits).
pub const COMMON_CUH: &str = include_str!("common.cuh");

/// [`compile_kernels`] for any kernel source (compiled after [`COMMON_CUH`]).
pub fn compile_source(src: &str, arch: &str) -> Result<String> {
    let full = format!("{COMMON_CUH}\n{src}");
    let src = full.as_str();
    // SAFETY: probing the library only.
    if !unsafe { cudarc::nvrtc::sys::is_culib_present() } {
        return Err(CudaError::LibraryMissing {
            lib: "libnvrtc.so",
            hint: "the CUDA toolkit (NVRTC)",
        });
    }
    let include = cuda_include_dir()?;
    let (mut major, mut minor) = (0i32, 0i32);
    // SAFETY: writes two ints.
    unsafe { cudarc::nvrtc::sys::nvrtcVersion(&mut major, &mut minor) };
    let version = (major, minor);
    let key = fnv1a(&[
        src.as_bytes(),
        arch.as_bytes(),
        format!("{version:?}").as_bytes(),
    ]);
    let cached = cache_dir().map(|d| d.join(format!("muser-{key:016x}.ptx")));
    if let Some(path) = &cached {
        if let Ok(ptx) = std::fs::read_to_string(path) {
            return Ok(ptx);
        }
    }
    let opts = CompileOptions {
        include_paths: vec![include.display().to_string()],
        options: vec![
            format!("--gpu-architecture={arch}"),
            "--std=c++17".into(),
            "-lineinfo".into(),
        ],
        fmad: Some(true),
        ..Default::default()
    };
    let ptx = cudarc::nvrtc::compile_ptx_with_opts(src, opts).map_err(|e| match e {
        cudarc::nvrtc::CompileError::CompileError { log, .. } => {
            CudaError::Compile(log.to_string_lossy().into_owned())
        }
        other => CudaError::Compile(format!("{other:?}")),
    })?;
    let bytes = ptx.as_bytes().unwrap_or_default();
    let text = String::from_utf8_lossy(bytes)
        .trim_end_matches('\0')
        .to_string();
    if let Some(path) = cached {
        write_cache(&path, &text);
    }
    Ok(text)
}

fn write_cache(path: &Path, text: &str) {
    // The cache is an optimisation: failing to write it is not an error.
    if let Some(dir) = path.parent() {
        let _ = std::fs::create_dir_all(dir);
    }
    let tmp = path.with_extension(format!("tmp{}", std::process::id()));
    if std::fs::write(&tmp, text).is_ok() {
        let _ = std::fs::rename(&tmp, path);
    }
}

pub use crate::layout::MAX_GEMV_BATCH;

/// Element type of a GEMM's inputs ([`Gpu::gemm`]).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum GemmIn {
    Bf16,
    /// f16 inputs: their products are exact in f32, so an f16 GEMM with f32 accumulation
    /// differs from an f32 one on the same (f16-representable) values only in summation order.
    F16,
    F32,
}

impl GemmIn {
    fn cuda(self) -> blas_sys::cudaDataType {
        match self {
            GemmIn::Bf16 => blas_sys::cudaDataType::CUDA_R_16BF,
            GemmIn::F16 => blas_sys::cudaDataType::CUDA_R_16F,
            GemmIn::F32 => blas_sys::cudaDataType::CUDA_R_32F,
        }
    }
}

/// One operand of [`Gpu::gemm_strided`]: a row-major matrix at `ptr` with `ld` elements a row,
/// the batch's next one `stride` elements further.
#[derive(Clone, Copy, Debug)]
pub struct Strided {
    pub ptr: u64,
    pub ld: usize,
    pub stride: usize,
}

/// One kernel argument.
#[derive(Clone, Copy, Debug)]
pub enum Arg {
    /// Device pointer (0 for a null pointer).
    P(u64),
    /// C `int`.
    I(i32),
    /// C `long` (64-bit on the platforms we build for).
    L(i64),
    /// C `float`.
    F(f32),
}

/// A device allocation, stream-ordered on the [`Gpu`]'s stream: it may be used by work
/// enqueued on that stream, and dropping it frees it after all work enqueued before the drop
/// (so a temporary can be dropped right after the kernels that read it are launched).
pub struct DevBuf {
    ptr: u64,
    bytes: usize,
    ctx: Arc<CudaContext>,
    stream: Arc<CudaStream>,
}

impl DevBuf {
    /// Device address.
    pub fn ptr(&self) -> u64 {
        self.ptr
    }
    /// Size in bytes.
    pub fn bytes(&self) -> usize {
        self.bytes
    }
    /// Address `off` bytes in (checked against the size).
    pub fn at(&self, off: usize) -> u64 {
        assert!(
            off <= self.bytes,
            "offset {off} past a {} byte buffer",
            self.bytes
        );
        self.ptr + off as u64
    }
}

impl Drop for DevBuf {
    fn drop(&mut self) {
        if self.ctx.bind_to_thread().is_ok() {
            // SAFETY: ptr came from malloc_async on this stream and is freed once, in stream
            // order: after every launch that was enqueued while the buffer was alive.
            let _ = unsafe { drv::free_async(self.ptr, self.stream.cu_stream()) };
        }
    }
}

/// The device, its stream, the compiled kernels and a cuBLAS handle.
pub struct Gpu {
    ctx: Arc<CudaContext>,
    pub(crate) stream: Arc<CudaStream>,
    _module: Arc<CudaModule>,
    funcs: HashMap<String, CudaFunction>,
    blas: CudaBlas,
    info: DeviceInfo,
    pdl: bool,
    overrides: std::sync::Mutex<Overrides>,
    /// Kernels already allowed clusters past the portable 8 blocks.
    wide_clusters: std::sync::Mutex<std::collections::HashSet<String>>,
    /// The dynamic shared memory each kernel is already allowed past the default 48 KiB.
    big_smem: std::sync::Mutex<HashMap<String, u32>>,
    /// Page-locked host memory for bulk copies ([`Gpu::download_many`],
    /// [`Gpu::upload_many`]), made on first use and grown to what a copy needs.
    pub(crate) staging: std::sync::Mutex<Option<crate::staging::Staging>>,
}

impl Gpu {
    /// Opens device `ordinal`, compiles (or loads cached) kernels, creates a cuBLAS handle.
    pub fn new(ordinal: usize) -> Result<Gpu> {
        check_libraries()?;
        let count =
            CudaContext::device_count().map_err(|e| CudaError::NoDevice(format!("{e:?}")))?;
        if count <= 0 {
            return Err(CudaError::NoDevice("the driver reports 0 devices".into()));
        }
        if ordinal >= count as usize {
            return Err(CudaError::NoDevice(format!(
                "device {ordinal} asked for, {count} present"
            )));
        }
        let ctx = CudaContext::new(ordinal).map_err(|e| CudaError::NoDevice(format!("{e:?}")))?;
        // One stream and raw pointers: the library's per-buffer events would only get in the way
        // of graph capture.
        // SAFETY: no CudaSlice of this context is shared across streams.
        unsafe { ctx.disable_event_tracking() };
        let cc = ctx.compute_capability().map_err(drv_err)?;
        let info = DeviceInfo {
            name: ctx.name().map_err(drv_err)?,
            compute_capability: cc,
            total_mem: ctx.total_mem().map_err(drv_err)?,
            sm_count: ctx
                .attribute(drv_sys::CUdevice_attribute::CU_DEVICE_ATTRIBUTE_MULTIPROCESSOR_COUNT)
                .map_err(drv_err)?,
            clock_khz: ctx
                .attribute(drv_sys::CUdevice_attribute::CU_DEVICE_ATTRIBUTE_CLOCK_RATE)
                .map_err(drv_err)?,
        };
        if cc.0 < 7 || (cc.0 == 7 && cc.1 < 5) {
            return Err(CudaError::Unsupported(format!(
                "compute capability {}.{} (need 7.5 or newer)",
                cc.0, cc.1
            )));
        }
        let arch = format!("sm_{}{}", cc.0, cc.1);
        let ptx = compile_kernels(&arch)?;
        let module = ctx.load_module(Ptx::from_src(ptx)).map_err(drv_err)?;
        let mut funcs = HashMap::new();
        let names = crate::layout::kernel_names();
        for n in names {
            let f = module.load_function(&n).map_err(drv_err)?;
            funcs.insert(n, f);
        }
        let stream = ctx.new_stream().map_err(drv_err)?;
        // Buffers come from the device's stream-ordered pool (DevBuf); keep freed memory in
        // the pool instead of returning it to the driver at every synchronization, so the
        // per-op backend's temporaries are recycled without a driver allocation each time.
        // SAFETY: the device handle is the context's own; the attribute takes a u64.
        unsafe {
            let pool = drv::device::get_default_mem_pool(ctx.cu_device()).map_err(drv_err)?;
            let mut keep = u64::MAX;
            drv::mem_pool::set_attribute(
                pool,
                drv_sys::CUmemPool_attribute::CU_MEMPOOL_ATTR_RELEASE_THRESHOLD,
                &mut keep as *mut u64 as *mut std::ffi::c_void,
            )
            .map_err(drv_err)?;
        }
        let blas = CudaBlas::new(stream.clone()).map_err(blas_err)?;
        let pdl = cc.0 >= 9 && std::env::var("MUSER_CUDA_PDL").map_or(true, |v| v != "0");
        let overrides = match std::env::var("MUSER_CUDA_TUNE") {
            Ok(spec) => Overrides::default().parse(&spec)?,
            Err(_) => Overrides::default(),
        };
        Ok(Gpu {
            ctx,
            stream,
            _module: module,
            funcs,
            blas,
            info,
            pdl,
            overrides: std::sync::Mutex::new(overrides),
            wide_clusters: std::sync::Mutex::new(Default::default()),
            big_smem: std::sync::Mutex::new(Default::default()),
            staging: std::sync::Mutex::new(None),
        })
    }

    /// The benchmark overrides in force (`MUSER_CUDA_TUNE` at start-up; read when a plan is
    /// derived and when a GEMV is enqueued).
    pub fn overrides(&self) -> Overrides {
        *self.overrides.lock().unwrap_or_else(|e| e.into_inner())
    }

    /// Changes the overrides (`glimmer::CudaGlimmer::set_overrides` also re-derives its plan);
    /// graphs captured before keep the old choices.
    pub fn set_overrides(&self, o: Overrides) {
        *self.overrides.lock().unwrap_or_else(|e| e.into_inner()) = o;
    }

    /// Compiles `src` for this device (cached like the main kernels) and adds its kernels
    /// `names` to the ones [`Self::launch`] finds.
    pub fn load_module(&mut self, src: &str, names: &[&str]) -> Result<()> {
        let (major, minor) = self.info.compute_capability;
        let ptx = compile_source(src, &format!("sm_{major}{minor}"))?;
        self.ctx.bind_to_thread().map_err(drv_err)?;
        let module = self.ctx.load_module(Ptx::from_src(ptx)).map_err(drv_err)?;
        for n in names {
            let f = module.load_function(n).map_err(drv_err)?;
            self.funcs.insert(n.to_string(), f);
        }
        Ok(())
    }

    /// Makes the device's context current on the calling thread (every call below does it;
    /// this is for callers that use raw driver calls).
    pub fn bind(&self) -> Result<()> {
        self.ctx.bind_to_thread().map_err(drv_err)
    }

    /// Whether a kernel of this name was compiled.
    pub fn has_kernel(&self, name: &str) -> bool {
        self.funcs.contains_key(name)
    }

    /// What the device is.
    pub fn info(&self) -> &DeviceInfo {
        &self.info
    }

    /// Allocates `bytes` of device memory (uninitialised), in stream order (see [`DevBuf`]).
    pub fn alloc(&self, bytes: usize) -> Result<DevBuf> {
        self.ctx.bind_to_thread().map_err(drv_err)?;
        // SAFETY: stream-ordered allocation on our stream, used only through it.
        let ptr =
            unsafe { drv::malloc_async(self.stream.cu_stream(), bytes.max(256)) }.map_err(|e| {
                CudaError::Driver(format!(
                    "allocating {:.1} MiB: {e:?}",
                    bytes as f64 / 1048576.0
                ))
            })?;
        Ok(DevBuf {
            ptr,
            bytes,
            ctx: self.ctx.clone(),
            stream: self.stream.clone(),
        })
    }

    /// Allocates and zero-fills.
    pub fn alloc_zeroed(&self, bytes: usize) -> Result<DevBuf> {
        let b = self.alloc(bytes)?;
        self.memset(b.ptr, 0, bytes)?;
        Ok(b)
    }

    /// Sets `bytes` bytes at `ptr` to `value` (stream ordered).
    pub fn memset(&self, ptr: u64, value: u8, bytes: usize) -> Result<()> {
        self.bind()?;
        // SAFETY: the caller passes a range inside one allocation.
        unsafe { drv::memset_d8_async(ptr, value, bytes, self.stream.cu_stream()) }.map_err(drv_err)
    }

    /// Copies host data to `dst + off`, in stream order. `src` is pageable memory (no Muser
    /// buffer is pinned), which the driver stages before the call returns, so the caller may
    /// drop or reuse it at once; the device copy lands before any later work on the stream.
    pub fn upload<T: Copy>(&self, dst: &DevBuf, off: usize, src: &[T]) -> Result<()> {
        let n = std::mem::size_of_val(src);
        if off + n > dst.bytes {
            return Err(CudaError::Shape(format!(
                "upload of {n} bytes at {off} into {} bytes",
                dst.bytes
            )));
        }
        self.bind()?;
        // SAFETY: range checked above; a pageable source is staged before the call returns.
        unsafe { drv::memcpy_htod_async(dst.ptr + off as u64, src, self.stream.cu_stream()) }
            .map_err(drv_err)
    }

    /// Copies `bytes` from device address `src` to `dst` on the stream (ordered with launches).
    pub fn copy(&self, dst: u64, src: u64, bytes: usize) -> Result<()> {
        if bytes == 0 {
            return Ok(());
        }
        self.bind()?;
        // SAFETY: the caller passes ranges inside live allocations of at least `bytes`.
        unsafe { drv::memcpy_dtod_async(dst, src, bytes, self.stream.cu_stream()) }.map_err(drv_err)
    }

    /// Copies device data at `src` into `dst` and waits.
    pub fn download<T: Copy>(&self, src: u64, dst: &mut [T]) -> Result<()> {
        self.bind()?;
        // SAFETY: the caller passes a device range at least as large as dst.
        unsafe { drv::memcpy_dtoh_async(dst, src, self.stream.cu_stream()) }.map_err(drv_err)?;
        self.sync()
    }

    /// Waits for all work on the stream.
    pub fn sync(&self) -> Result<()> {
        self.bind()?;
        self.stream.synchronize().map_err(drv_err)
    }

    /// Launches kernel `name` with a 1-D block. On sm_90+ every launch allows programmatic
    /// dependent launch (each kernel waits for its predecessor with `griddepcontrol.wait` before
    /// touching its results; the GEMVs start streaming weights before that); `MUSER_CUDA_PDL=0`
    /// turns it off.
    pub fn launch(
        &self,
        name: &str,
        grid: (u32, u32, u32),
        block: u32,
        args: &[Arg],
    ) -> Result<()> {
        self.launch_smem(name, grid, block, 0, args)
    }

    /// Registers per thread, local (spilled) bytes per thread and static shared bytes of the
    /// kernel `name`, as the driver compiled it for this device.
    pub fn kernel_resources(&self, name: &str) -> Result<(i32, i32, i32)> {
        let f = self
            .funcs
            .get(name)
            .ok_or_else(|| CudaError::Unsupported(format!("no kernel named {name}")))?;
        let e = |e| CudaError::Driver(format!("{name}: attributes: {e:?}"));
        Ok((
            f.num_regs().map_err(e)?,
            f.local_size_bytes().map_err(e)?,
            f.shared_size_bytes().map_err(e)?,
        ))
    }

    /// [`Self::launch`] with `smem` bytes of dynamic shared memory (past 48 KiB the kernel is
    /// allowed that much first; the device's per-block limit applies).
    pub fn launch_smem(
        &self,
        name: &str,
        grid: (u32, u32, u32),
        block: u32,
        smem: u32,
        args: &[Arg],
    ) -> Result<()> {
        self.launch_ex(name, grid, block, smem, 0, args)
    }

    /// [`Self::launch`] with the blocks grouped in thread-block clusters of `cluster` blocks
    /// along z (sm_90; the grid's z a multiple of it; past 8, the kernel is allowed a
    /// non-portable size first).
    pub fn launch_cluster(
        &self,
        name: &str,
        grid: (u32, u32, u32),
        block: u32,
        cluster: u32,
        args: &[Arg],
    ) -> Result<()> {
        if cluster == 0 || !grid.2.is_multiple_of(cluster) {
            return Err(CudaError::Shape(format!(
                "{name}: cluster of {cluster} blocks over a grid z of {}",
                grid.2
            )));
        }
        self.launch_ex(name, grid, block, 0, cluster, args)
    }

    fn launch_ex(
        &self,
        name: &str,
        grid: (u32, u32, u32),
        block: u32,
        smem: u32,
        cluster: u32,
        args: &[Arg],
    ) -> Result<()> {
        let f = self
            .funcs
            .get(name)
            .ok_or_else(|| CudaError::Unsupported(format!("no kernel named {name}")))?;
        if smem > 48 * 1024 {
            let mut allowed = self.big_smem.lock().unwrap_or_else(|e| e.into_inner());
            if allowed.get(name).is_none_or(|&a| a < smem) {
                f.set_attribute(
                    drv_sys::CUfunction_attribute::CU_FUNC_ATTRIBUTE_MAX_DYNAMIC_SHARED_SIZE_BYTES,
                    smem as i32,
                )
                .map_err(|e| {
                    CudaError::Driver(format!("{name}: {smem} bytes of shared memory: {e:?}"))
                })?;
                allowed.insert(name.to_string(), smem);
            }
        }
        // One 8-byte slot per argument; 4-byte arguments sit in the low half (little-endian).
        let mut slots: Vec<u64> = args
            .iter()
            .map(|a| match *a {
                Arg::P(v) => v,
                Arg::I(v) => v as u32 as u64,
                Arg::L(v) => v as u64,
                Arg::F(v) => v.to_bits() as u64,
            })
            .collect();
        let mut params: Vec<*mut c_void> = slots
            .iter_mut()
            .map(|s| s as *mut u64 as *mut c_void)
            .collect();
        if cluster > 8 {
            let mut set = self.wide_clusters.lock().unwrap_or_else(|e| e.into_inner());
            if !set.contains(name) {
                f.set_attribute(
                    drv_sys::CUfunction_attribute::CU_FUNC_ATTRIBUTE_NON_PORTABLE_CLUSTER_SIZE_ALLOWED,
                    1,
                )
                .map_err(|e| CudaError::Driver(format!("{name}: cluster of {cluster}: {e:?}")))?;
                set.insert(name.to_string());
            }
        }
        // SAFETY: a zeroed attribute is a valid "ignore" value; we set the fields we use.
        let mut attrs: [drv_sys::CUlaunchAttribute; 2] = unsafe { std::mem::zeroed() };
        let mut nattr = 0usize;
        if cluster > 0 {
            attrs[nattr].id = drv_sys::CUlaunchAttributeID::CU_LAUNCH_ATTRIBUTE_CLUSTER_DIMENSION;
            attrs[nattr].value.clusterDim.x = 1;
            attrs[nattr].value.clusterDim.y = 1;
            attrs[nattr].value.clusterDim.z = cluster;
            nattr += 1;
        }
        if self.pdl {
            attrs[nattr].id =
                drv_sys::CUlaunchAttributeID::CU_LAUNCH_ATTRIBUTE_PROGRAMMATIC_STREAM_SERIALIZATION;
            attrs[nattr].value.programmaticStreamSerializationAllowed = 1;
            nattr += 1;
        }
        let cfg = drv_sys::CUlaunchConfig {
            gridDimX: grid.0,
            gridDimY: grid.1,
            gridDimZ: grid.2,
            blockDimX: block,
            blockDimY: 1,
            blockDimZ: 1,
            sharedMemBytes: smem,
            hStream: self.stream.cu_stream(),
            attrs: attrs.as_mut_ptr(),
            numAttrs: nattr as u32,
        };
        self.ctx.bind_to_thread().map_err(drv_err)?;
        // SAFETY: argument lists match the kernel signatures in kernels.cu (kept side by side);
        // `slots` outlives the call, which copies the parameters.
        unsafe {
            drv_sys::cuLaunchKernelEx(
                &cfg,
                f.cu_function(),
                params.as_mut_ptr(),
                std::ptr::null_mut(),
            )
        }
        .result()
        .map_err(|e| CudaError::Driver(format!("launch {name}: {e:?}")))
    }

    /// Row-major `y[n][m] (f32) = x[n][k] (bf16) · w[m][k]^T (bf16)`, with `ldy` floats per y row.
    #[allow(clippy::too_many_arguments)]
    pub fn gemm_bf16(
        &self,
        y: u64,
        ldy: usize,
        x: u64,
        w: u64,
        n: usize,
        m: usize,
        k: usize,
    ) -> Result<()> {
        self.gemm(y, ldy, x, w, (n, m, k), GemmIn::Bf16)
    }

    /// Row-major `y[n][m] (f32) = x[n][k] · w[m][k]^T` with `x` and `w` both `ty`, f32
    /// accumulation (no TF32: with `GemmIn::F32` the products are the f32 ones the per-op
    /// backend's exact precision needs).
    pub fn gemm(
        &self,
        y: u64,
        ldy: usize,
        x: u64,
        w: u64,
        (n, m, k): (usize, usize, usize),
        ty: GemmIn,
    ) -> Result<()> {
        let ty = ty.cuda();
        self.bind()?;
        let (alpha, beta) = (1.0f32, 0.0f32);
        // SAFETY: shapes come from the weights and buffers sized for them.
        unsafe {
            blas::gemm_ex(
                *self.blas.handle(),
                blas_sys::cublasOperation_t::CUBLAS_OP_T,
                blas_sys::cublasOperation_t::CUBLAS_OP_N,
                m as i32,
                n as i32,
                k as i32,
                &alpha as *const f32 as *const c_void,
                w as *const c_void,
                ty,
                k as i32,
                x as *const c_void,
                ty,
                k as i32,
                &beta as *const f32 as *const c_void,
                y as *mut c_void,
                blas_sys::cudaDataType::CUDA_R_32F,
                ldy as i32,
                blas_sys::cublasComputeType_t::CUBLAS_COMPUTE_32F,
                blas_sys::cublasGemmAlgo_t::CUBLAS_GEMM_DEFAULT,
            )
        }
        .map_err(blas_err)
    }

    /// A strided batch of f32 products, f32 accumulation (no TF32), `batch` of them: row-major
    /// `y[n][m] = alpha · x[n][k] · w`, with `w` as `[m][k]` transposed when `w_by_out` (its
    /// rows are the outputs), else as `[k][m]`. Each operand's `ld` and `stride` in elements.
    #[allow(clippy::too_many_arguments)]
    pub fn gemm_strided(
        &self,
        y: Strided,
        x: Strided,
        w: Strided,
        (n, m, k): (usize, usize, usize),
        w_by_out: bool,
        batch: usize,
        alpha: f32,
    ) -> Result<()> {
        let int = |v: usize, what: &str| {
            i32::try_from(v).map_err(|_| CudaError::Shape(format!("strided GEMM: {what} {v}")))
        };
        let long = |v: usize| v as i64;
        let op = if w_by_out {
            blas_sys::cublasOperation_t::CUBLAS_OP_T
        } else {
            blas_sys::cublasOperation_t::CUBLAS_OP_N
        };
        let f32t = blas_sys::cudaDataType::CUDA_R_32F;
        let beta = 0.0f32;
        self.bind()?;
        // SAFETY: the caller sizes every operand for `batch` strided matrices of these shapes.
        unsafe {
            blas::gemm_strided_batched_ex(
                *self.blas.handle(),
                op,
                blas_sys::cublasOperation_t::CUBLAS_OP_N,
                int(m, "m")?,
                int(n, "n")?,
                int(k, "k")?,
                &alpha as *const f32 as *const c_void,
                w.ptr as *const c_void,
                f32t,
                int(w.ld, "ld")?,
                long(w.stride),
                x.ptr as *const c_void,
                f32t,
                int(x.ld, "ld")?,
                long(x.stride),
                &beta as *const f32 as *const c_void,
                y.ptr as *mut c_void,
                f32t,
                int(y.ld, "ld")?,
                long(y.stride),
                int(batch, "batch")?,
                blas_sys::cublasComputeType_t::CUBLAS_COMPUTE_32F,
                blas_sys::cublasGemmAlgo_t::CUBLAS_GEMM_DEFAULT,
            )
        }
        .map_err(blas_err)
    }

    /// Starts capturing the stream's work into a graph.
    pub fn begin_capture(&self) -> Result<()> {
        self.stream
            .begin_capture(drv_sys::CUstreamCaptureMode::CU_STREAM_CAPTURE_MODE_RELAXED)
            .map_err(drv_err)
    }

    /// Ends the capture and instantiates the graph.
    pub fn end_capture(&self) -> Result<CudaGraph> {
        self.stream
            .end_capture(drv_sys::CUgraphInstantiate_flags(0))
            .map_err(drv_err)?
            .ok_or_else(|| CudaError::Driver("graph capture produced no graph".into()))
    }

    /// A timing event pair helper: records an event on the stream.
    pub fn event(&self) -> Result<cudarc::driver::CudaEvent> {
        self.stream
            .record_event(Some(drv_sys::CUevent_flags::CU_EVENT_DEFAULT))
            .map_err(drv_err)
    }
}
