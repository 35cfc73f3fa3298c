//! Every CUDA kernel source in `engine/src/device/kernels` compiles to PTX with NVRTC, with no GPU
//! needed. Runs with `--features cuda` and NVRTC's library on the loader path (`.ci/run` installs
//! PyPI's `nvidia-cuda-nvrtc-cu12` wheel and points `LD_LIBRARY_PATH` at it); otherwise it
//! prints that the compilation was skipped.
use conveyor_engine::device::kernels::SOURCES;

#[cfg(feature = "cuda")]
#[test]
fn every_kernel_source_compiles_to_ptx() {
    // SAFETY: only tries to dlopen libnvrtc and reports whether it loaded.
    if !unsafe { cudarc::nvrtc::sys::is_culib_present() } {
        println!("CUDA kernel compilation skipped: NVRTC (libnvrtc.so) is not on LD_LIBRARY_PATH");
        assert!(std::env::var_os("CONVEYOR_REQUIRE_NVRTC").is_none(), "CONVEYOR_REQUIRE_NVRTC is set but NVRTC is missing");
        return;
    }
    for (name, source) in SOURCES {
        let ptx = cudarc::nvrtc::compile_ptx(source).unwrap_or_else(|err| panic!("{name} does not compile: {err:?}"));
        let text = ptx.to_src();
        let entries = text.matches(".entry").count();
        let kernels = source.matches("__global__").count();
        assert_eq!(entries, kernels, "{name}: {kernels} kernels in the source, {entries} PTX entries");
        println!("{name}: {entries} kernels compiled to PTX");
    }
}

#[cfg(not(feature = "cuda"))]
#[test]
fn kernel_sources_are_carried_without_the_cuda_feature() {
    println!("CUDA kernel compilation skipped: built without the `cuda` feature");
    assert!(SOURCES.iter().all(|(_, source)| source.contains("__global__")));
}
