//! Run-time compilation of the repository's kernels: the table of every kernel (its name and its
//! source file in `device/kernels/`), NVRTC compilation for the GPU's compute capability, and the
//! process-wide cache of loaded modules, one set per GPU ordinal (its primary context).
use std::collections::HashMap;
use std::sync::{Arc, Mutex, OnceLock};

use cudarc::driver::sys::CUresult;
use cudarc::driver::{CudaFunction, CudaModule};
use cudarc::nvrtc::{CompileError, CompileOptions, Ptx};

use super::device::CudaDevice;
use super::errors;
use crate::device::kernels::SOURCES;
use crate::{Error, Result};

macro_rules! kernels {
    ($($variant:ident => ($file:literal, $name:literal)),* $(,)?) => {
        /// Every kernel in `device/kernels/*.cu`; each has one typed launch wrapper on `CudaStream`.
        #[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
        pub(crate) enum Kernel {
            $(#[doc = concat!("`", $name, "` in `", $file, "`.")] $variant),*
        }

        impl Kernel {
            /// Every kernel, in table order (the order of `KernelSet::functions`).
            pub(crate) const ALL: &'static [Kernel] = &[$(Kernel::$variant),*];

            /// The `extern "C"` name of the kernel.
            pub(crate) fn name(self) -> &'static str {
                match self { $(Kernel::$variant => $name),* }
            }

            /// The source file that defines it.
            pub(crate) fn file(self) -> &'static str {
                match self { $(Kernel::$variant => $file),* }
            }
        }
    };
}

kernels! {
    AddF32 => ("elementwise.cu", "add_f32"),
    MulF32 => ("elementwise.cu", "mul_f32"),
    AddAssignF32 => ("elementwise.cu", "add_assign_f32"),
    ScaleF32 => ("elementwise.cu", "scale_f32"),
    ReluForwardF32 => ("elementwise.cu", "relu_forward_f32"),
    ReluBackwardF32 => ("elementwise.cu", "relu_backward_f32"),
    GeluForwardF32 => ("elementwise.cu", "gelu_forward_f32"),
    GeluBackwardF32 => ("elementwise.cu", "gelu_backward_f32"),
    GeluTanhForwardF32 => ("elementwise.cu", "gelu_tanh_forward_f32"),
    GeluTanhBackwardF32 => ("elementwise.cu", "gelu_tanh_backward_f32"),
    TanhForwardF32 => ("elementwise.cu", "tanh_forward_f32"),
    TanhBackwardF32 => ("elementwise.cu", "tanh_backward_f32"),
    DropoutApplyF32 => ("elementwise.cu", "dropout_apply_f32"),
    F32ToF16 => ("elementwise.cu", "f32_to_f16"),
    F32ToBf16 => ("elementwise.cu", "f32_to_bf16"),
    F16ToF32 => ("elementwise.cu", "f16_to_f32"),
    Bf16ToF32 => ("elementwise.cu", "bf16_to_f32"),
    ColumnSumsAccumulateF32 => ("reduce.cu", "column_sums_accumulate_f32"),
    RowSumsAccumulateF32 => ("reduce.cu", "row_sums_accumulate_f32"),
    BroadcastRowsF32 => ("reduce.cu", "broadcast_rows_f32"),
    SumOfSquaresF32 => ("reduce.cu", "sum_of_squares_f32"),
    LogSoftmaxRowsF32 => ("softmax.cu", "log_softmax_rows_f32"),
    CrossEntropyF32 => ("softmax.cu", "cross_entropy_f32"),
    Im2colF32 => ("conv.cu", "im2col_f32"),
    Col2imF32 => ("conv.cu", "col2im_f32"),
    MaxPoolForwardF32 => ("conv.cu", "max_pool_forward_f32"),
    MaxPoolBackwardF32 => ("conv.cu", "max_pool_backward_f32"),
    AvgPoolForwardF32 => ("conv.cu", "avg_pool_forward_f32"),
    AvgPoolBackwardF32 => ("conv.cu", "avg_pool_backward_f32"),
    SgdStepF32 => ("optim.cu", "sgd_step_f32"),
    AdamStepF32 => ("optim.cu", "adam_step_f32"),
    AttentionForwardF32 => ("attention.cu", "attention_forward_f32"),
    AttentionBackwardQF32 => ("attention.cu", "attention_backward_q_f32"),
    AttentionBackwardKvF32 => ("attention.cu", "attention_backward_kv_f32"),
    LayerNormForwardF32 => ("norm.cu", "layer_norm_forward_f32"),
    LayerNormBackwardInputF32 => ("norm.cu", "layer_norm_backward_input_f32"),
    LayerNormBackwardWeightF32 => ("norm.cu", "layer_norm_backward_weight_f32"),
    EmbeddingGatherF32 => ("norm.cu", "embedding_gather_f32"),
    EmbeddingScatterAddF32 => ("norm.cu", "embedding_scatter_add_f32"),
    AddPositionsF32 => ("norm.cu", "add_positions_f32"),
    PositionsGradAccumulateF32 => ("norm.cu", "positions_grad_accumulate_f32"),
    MeanOverTokensF32 => ("norm.cu", "mean_over_tokens_f32"),
    MeanOverTokensBackwardF32 => ("norm.cu", "mean_over_tokens_backward_f32"),
}

/// The loaded kernels of one GPU, indexed like [`Kernel::ALL`].
#[derive(Debug)]
pub(crate) struct KernelSet {
    functions: Vec<CudaFunction>,
    /// Keeps the modules loaded (each function also holds its module).
    _modules: Vec<Arc<CudaModule>>,
}

impl KernelSet {
    /// The loaded function of `kernel`.
    pub(crate) fn get(&self, kernel: Kernel) -> &CudaFunction {
        // `functions` was built in `Kernel::ALL` order, which is the variants' declaration order.
        &self.functions[kernel as usize]
    }
}

/// The kernels of `device`'s GPU: compiled and loaded on the first call for its ordinal, then
/// shared by every handle and stream of that GPU for the rest of the process. A failed compilation
/// is not cached; the next call tries again.
pub(crate) fn kernels_for(device: &CudaDevice) -> Result<Arc<KernelSet>> {
    // Each thread keeps the sets it has used, so a launch takes the process-wide lock only the
    // first time a thread launches on a GPU, never on the hot path.
    thread_local! {
        static LOCAL: std::cell::RefCell<HashMap<usize, Arc<KernelSet>>> = Default::default();
    }
    if let Some(set) = LOCAL.with(|local| local.borrow().get(&device.ordinal()).cloned()) {
        return Ok(set);
    }
    let set = kernels_for_process(device)?;
    LOCAL.with(|local| local.borrow_mut().insert(device.ordinal(), Arc::clone(&set)));
    Ok(set)
}

/// The process-wide cache behind [`kernels_for`]: compiles a GPU's kernels once per process.
fn kernels_for_process(device: &CudaDevice) -> Result<Arc<KernelSet>> {
    static CACHE: OnceLock<Mutex<HashMap<usize, Arc<KernelSet>>>> = OnceLock::new();
    // Compiling under the lock makes concurrent first launches wait for one compilation.
    let mut cache = CACHE.get_or_init(Default::default).lock().unwrap_or_else(|poisoned| poisoned.into_inner());
    if let Some(set) = cache.get(&device.ordinal()) {
        return Ok(Arc::clone(set));
    }
    let set = Arc::new(load(device)?);
    super::thread_streams::exit_guard::register(super::thread_streams::exit_guard::Library::Nvrtc);
    cache.insert(device.ordinal(), Arc::clone(&set));
    Ok(set)
}

/// Compiles every source for the GPU's architecture and loads each kernel.
fn load(device: &CudaDevice) -> Result<KernelSet> {
    let ordinal = device.ordinal();
    let mut modules: HashMap<&'static str, Arc<CudaModule>> = HashMap::new();
    for (file, source) in SOURCES {
        let ptx = compile_source(file, source, Some(device.compute_capability()))
            .map_err(|err| Error::CudaUnavailable(format!("cuda:{ordinal}: {err}")))?;
        let module = device.context().load_module(ptx).map_err(|err| {
            if err.0 == CUresult::CUDA_ERROR_UNSUPPORTED_PTX_VERSION {
                return Error::CudaUnavailable(format!(
                    "cuda:{ordinal}: the driver cannot load the PTX of {file}: this NVRTC is newer than the driver; \
                     update the NVIDIA driver or use an NVRTC no newer than it"
                ));
            }
            errors::driver(ordinal, &format!("loading the PTX of {file}"), err)
        })?;
        modules.insert(file, module);
    }
    let functions = Kernel::ALL
        .iter()
        .map(|kernel| {
            let module = modules.get(kernel.file()).ok_or_else(|| {
                Error::CudaUnavailable(format!(
                    "kernel {} names source {}, which SOURCES lacks",
                    kernel.name(),
                    kernel.file()
                ))
            })?;
            module.load_function(kernel.name()).map_err(|err| {
                errors::driver(ordinal, &format!("finding kernel {} in {}", kernel.name(), kernel.file()), err)
            })
        })
        .collect::<Result<Vec<_>>>()?;
    Ok(KernelSet { functions, _modules: modules.into_values().collect() })
}

/// The virtual architectures this NVRTC compiles for (`75` for `compute_75`, ascending), or
/// `None` when it cannot say (an NVRTC older than 11.2 has no `nvrtcGetSupportedArchs`).
pub(crate) fn supported_architectures() -> Option<Vec<i32>> {
    use cudarc::nvrtc::sys::{nvrtcGetNumSupportedArchs, nvrtcGetSupportedArchs, nvrtcResult};
    let mut count: std::ffi::c_int = 0;
    // SAFETY: NVRTC writes one int; only called after `is_culib_present` said NVRTC loads.
    if unsafe { nvrtcGetNumSupportedArchs(&mut count) } != nvrtcResult::NVRTC_SUCCESS || count <= 0 {
        return None;
    }
    let mut archs = vec![0 as std::ffi::c_int; usize::try_from(count).ok()?];
    // SAFETY: `archs` holds the `count` ints NVRTC writes.
    if unsafe { nvrtcGetSupportedArchs(archs.as_mut_ptr()) } != nvrtcResult::NVRTC_SUCCESS {
        return None;
    }
    archs.sort_unstable();
    Some(archs)
}

/// The virtual architecture to compile for on a GPU of `capability`: the newest one this NVRTC
/// supports that the GPU can run (PTX runs on its own architecture and every newer one, which the
/// driver JIT-compiles it for). `Err` names the oldest supported one when the GPU is older than
/// all of them; `Ok(None)` when NVRTC cannot list them (its default is used).
pub(crate) fn architecture_for(capability: (i32, i32), supported: Option<&[i32]>) -> Result<Option<i32>, i32> {
    let wanted = capability.0 * 10 + capability.1;
    let Some(supported) = supported else { return Ok(Some(wanted)) };
    match supported.iter().copied().filter(|&arch| arch <= wanted).max() {
        Some(arch) => Ok(Some(arch)),
        None => supported.first().map_or(Ok(None), |&oldest| Err(oldest)),
    }
}

/// Compiles one kernel source to PTX. With a compute capability, for the newest virtual
/// architecture this NVRTC supports that the GPU runs ([`architecture_for`]: a GPU newer than
/// NVRTC gets the newest PTX, which the driver JIT-compiles), falling back to NVRTC's default
/// when this NVRTC cannot list its architectures and rejects the GPU's. `--fmad=false`: no
/// multiply-add is contracted, so the elementwise arithmetic rounds exactly as the CPU kernels do.
pub(crate) fn compile_source(file: &str, source: &str, compute_capability: Option<(i32, i32)>) -> Result<Ptx, String> {
    // SAFETY: only a dlopen probe.
    if !unsafe { cudarc::nvrtc::sys::is_culib_present() } {
        return Err(format!(
            "compiling {file} needs NVRTC, but libnvrtc was not found; install the CUDA toolkit's NVRTC \
             (or PyPI's nvidia-cuda-nvrtc-cu12) and put its library directory on LD_LIBRARY_PATH"
        ));
    }
    let options = |arch: Option<String>| CompileOptions {
        fmad: Some(false),
        name: Some(file.to_string()),
        options: arch.into_iter().collect(),
        ..Default::default()
    };
    let describe = |err: CompileError| match err {
        CompileError::CompileError { nvrtc, options, log } => {
            format!("NVRTC could not compile {file} ({nvrtc:?}, options {options:?}):\n{}", log.to_string_lossy())
        }
        other => format!("NVRTC failed on {file}: {other:?}"),
    };
    if let Some((major, minor)) = compute_capability {
        let supported = supported_architectures();
        match architecture_for((major, minor), supported.as_deref()) {
            Err(oldest) => {
                return Err(format!(
                    "this NVRTC compiles for compute_{oldest} and newer, but the GPU is sm_{major}{minor}; \
                     put an older CUDA toolkit's NVRTC (e.g. PyPI's nvidia-cuda-nvrtc-cu12) on LD_LIBRARY_PATH"
                ));
            }
            Ok(None) => {}
            Ok(Some(arch)) => {
                let flag = format!("--gpu-architecture=compute_{arch}");
                match cudarc::nvrtc::compile_ptx_with_opts(source, options(Some(flag))) {
                    Ok(ptx) => return Ok(ptx),
                    // Only an NVRTC that cannot list its architectures guesses; a source error
                    // fails again below with the default architecture.
                    Err(CompileError::CompileError { .. }) if supported.is_none() => {}
                    Err(other) => return Err(describe(other)),
                }
            }
        }
    }
    cudarc::nvrtc::compile_ptx_with_opts(source, options(None)).map_err(describe)
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The `extern "C" __global__` names in a source, in order.
    fn global_names(source: &str) -> Vec<&str> {
        source.split("__global__ void ").skip(1).map(|rest| rest.split('(').next().unwrap_or_default().trim()).collect()
    }

    #[test]
    fn the_table_lists_every_kernel_of_every_source_once() {
        let mut from_sources: Vec<(&str, &str)> = Vec::new();
        for (file, source) in SOURCES {
            from_sources.extend(global_names(source).into_iter().map(|name| (file, name)));
        }
        let mut from_table: Vec<(&str, &str)> = Kernel::ALL.iter().map(|k| (k.file(), k.name())).collect();
        from_sources.sort_unstable();
        from_table.sort_unstable();
        assert_eq!(from_table, from_sources, "Kernel table and kernels/*.cu disagree");
    }

    #[test]
    fn every_source_compiles_for_common_architectures() {
        // SAFETY: only a dlopen probe.
        if !unsafe { cudarc::nvrtc::sys::is_culib_present() } {
            println!("NVRTC compilation skipped: libnvrtc is not on LD_LIBRARY_PATH");
            assert!(
                std::env::var_os("CONVEYOR_REQUIRE_NVRTC").is_none(),
                "CONVEYOR_REQUIRE_NVRTC is set but NVRTC is missing"
            );
            return;
        }
        let supported = supported_architectures();
        println!("NVRTC compiles for {supported:?}");
        for capability in [(7, 0), (7, 5), (8, 0), (8, 6), (9, 0), (12, 0)] {
            let arch = match architecture_for(capability, supported.as_deref()) {
                // A GPU older than this NVRTC: refused with a message naming both.
                Err(oldest) => {
                    let err = compile_source(SOURCES[0].0, SOURCES[0].1, Some(capability)).unwrap_err();
                    assert!(err.contains(&format!("compute_{oldest}")), "{err}");
                    continue;
                }
                Ok(arch) => arch,
            };
            for (file, source) in SOURCES {
                let ptx = compile_source(file, source, Some(capability)).unwrap_or_else(|err| panic!("{err}"));
                let text = ptx.to_src();
                if let Some(arch) = arch {
                    let target = format!(".target sm_{arch}");
                    assert!(text.contains(&target), "{file} for {capability:?}: no `{target}` in the PTX");
                }
                for name in global_names(source) {
                    assert!(text.contains(&format!(".entry {name}(")), "{file}: no entry {name}");
                }
                // --fmad=false: the optimizer arithmetic has no contracted multiply-add (the math
                // library's expf, erfcf and tanhf use explicit ones, so only optim.cu is checked).
                if file == "optim.cu" {
                    assert!(!text.contains("fma.rn"), "{file} for {capability:?}: contracted multiply-add in the PTX");
                }
            }
        }
    }

    #[test]
    fn the_newest_supported_architecture_the_gpu_runs_is_chosen() {
        assert_eq!(architecture_for((9, 0), Some(&[75, 80, 90, 100])), Ok(Some(90)));
        assert_eq!(architecture_for((8, 9), Some(&[75, 80, 90])), Ok(Some(80)));
        assert_eq!(architecture_for((12, 1), Some(&[75, 80, 90])), Ok(Some(90)));
        assert_eq!(architecture_for((7, 0), Some(&[75, 80])), Err(75));
        assert_eq!(architecture_for((7, 0), None), Ok(Some(70)));
    }

    #[test]
    fn an_unknown_architecture_falls_back_to_the_default() {
        // SAFETY: only a dlopen probe.
        if !unsafe { cudarc::nvrtc::sys::is_culib_present() } {
            return;
        }
        let (file, source) = SOURCES[0];
        assert!(compile_source(file, source, Some((99, 9))).is_ok());
        assert!(compile_source("broken.cu", "extern \"C\" __global__ void k() { nope; }", Some((9, 0))).is_err());
    }
}
