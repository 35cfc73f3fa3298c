//! What `conveyor bench` records about where it ran: the machine (CPU model, cores, operating
//! system, GPUs), the build (version, commit), and the CPU's energy counters (Linux RAPL through
//! powercap), read around each measured item. Nothing here invents a figure: what cannot be read
//! is reported as unavailable, with the reason.
use std::path::{Path, PathBuf};

use serde_json::{Value, json};

/// Where Linux exposes the RAPL energy counters.
const POWERCAP: &str = "/sys/class/powercap";

/// The machine and build, as the report's `machine` and `build` objects.
pub fn machine_info(gpus: &[String], gpu_note: &str) -> Value {
    let cpuinfo = std::fs::read_to_string("/proc/cpuinfo").unwrap_or_default();
    let cpu_model = cpuinfo
        .lines()
        .find_map(|line| line.strip_prefix("model name").and_then(|rest| rest.split_once(':')).map(|(_, v)| v.trim()))
        .map(str::to_string);
    let cpu_flags = cpuinfo.lines().find_map(|line| line.strip_prefix("flags").and_then(|r| r.split_once(':')));
    let simd: Vec<&str> = match cpu_flags {
        Some((_, flags)) => {
            let flags: Vec<&str> = flags.split_whitespace().collect();
            ["avx2", "fma", "avx512f"].into_iter().filter(|f| flags.contains(f)).collect()
        }
        None => Vec::new(),
    };
    let os = std::fs::read_to_string("/etc/os-release").ok().and_then(|text| {
        text.lines().find_map(|line| line.strip_prefix("PRETTY_NAME=")).map(|name| name.trim_matches('"').to_string())
    });
    let kernel = std::fs::read_to_string("/proc/sys/kernel/osrelease").ok().map(|k| k.trim().to_string());
    json!({
        "cpu_model": cpu_model,
        "cpu_simd": simd,
        "logical_cores_online": online_cores(),
        "cores_available_to_this_process": std::thread::available_parallelism().map_or(1, usize::from),
        "os": os,
        "kernel": kernel,
        "arch": std::env::consts::ARCH,
        "load_average_at_start": load_average(),
        "gpus": gpus,
        "gpu_note": gpu_note,
    })
}

/// The 1, 5 and 15-minute load averages (`/proc/loadavg`): other work on the machine slows
/// whatever runs beside it, so the report keeps the load the figures were taken under.
pub fn load_average() -> Option<[f64; 3]> {
    let text = std::fs::read_to_string("/proc/loadavg").ok()?;
    let mut fields = text.split_whitespace().map(|f| f.parse::<f64>().ok());
    Some([fields.next()??, fields.next()??, fields.next()??])
}

/// Online logical cores (1 when the system does not say).
fn online_cores() -> usize {
    // SAFETY: sysconf reads a system constant and has no other effect.
    let n = unsafe { libc::sysconf(libc::_SC_NPROCESSORS_ONLN) };
    usize::try_from(n).ok().filter(|&n| n > 0).unwrap_or(1)
}

/// The build: Conveyor's version and, where it can be had, the commit of the source checkout.
pub fn build_info() -> Value {
    // The checkout this binary was built from, asked at run time: it says the checkout's HEAD
    // now, which is the build's commit unless the checkout moved since.
    let source = env!("CARGO_MANIFEST_DIR");
    let commit = std::process::Command::new("git")
        .args(["-C", source, "rev-parse", "HEAD"])
        .stderr(std::process::Stdio::null())
        .output()
        .ok()
        .filter(|out| out.status.success())
        .and_then(|out| String::from_utf8(out.stdout).ok())
        .map(|s| s.trim().to_string())
        .filter(|s| !s.is_empty());
    let note = match &commit {
        Some(_) => format!("HEAD of the source checkout {source} at run time (`git rev-parse HEAD`)"),
        None => format!("not available: `git rev-parse HEAD` in {source} failed (no git, or the checkout is gone)"),
    };
    json!({ "conveyor_version": env!("CARGO_PKG_VERSION"), "git_commit": commit, "git_commit_note": note })
}

/// One RAPL zone: a package or one of its sub-zones (such as `dram`).
#[derive(Clone, Debug)]
struct Zone {
    name: String,
    energy_file: PathBuf,
    max_energy_uj: u64,
}

/// The CPU's energy counters, or why there are none.
#[derive(Clone, Debug)]
pub enum EnergyMeter {
    /// RAPL zones whose counters this process can read.
    Rapl(Vec<RaplZone>),
    /// No readable counter; the reason is shown in the report.
    Unavailable(String),
}

/// A readable RAPL zone (see [`EnergyMeter::Rapl`]).
#[derive(Clone, Debug)]
pub struct RaplZone(Zone);

/// Counter readings at the start of a measured item.
#[derive(Clone, Debug)]
pub struct EnergyStart(Vec<Option<u64>>);

impl EnergyMeter {
    /// Finds the RAPL zones under `/sys/class/powercap` and checks they can be read.
    pub fn open() -> EnergyMeter {
        EnergyMeter::open_at(Path::new(POWERCAP))
    }

    fn open_at(root: &Path) -> EnergyMeter {
        let entries = match std::fs::read_dir(root) {
            Ok(entries) => entries,
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => {
                return EnergyMeter::Unavailable(format!(
                    "{} does not exist: this kernel exposes no powercap/RAPL interface (usual in a VM or a container)",
                    root.display()
                ));
            }
            Err(e) => return EnergyMeter::Unavailable(format!("cannot list {}: {e}", root.display())),
        };
        let mut dirs: Vec<PathBuf> = entries
            .filter_map(|e| e.ok())
            .map(|e| e.path())
            .filter(|p| p.file_name().and_then(|n| n.to_str()).is_some_and(|n| n.starts_with("intel-rapl:")))
            .collect();
        dirs.sort();
        if dirs.is_empty() {
            return EnergyMeter::Unavailable(format!("{} has no intel-rapl:* zones", root.display()));
        }
        let mut zones = Vec::new();
        let mut problems = Vec::new();
        for dir in dirs {
            let name = std::fs::read_to_string(dir.join("name")).map(|n| n.trim().to_string()).unwrap_or_default();
            let label = format!("{} ({name})", dir.file_name().and_then(|n| n.to_str()).unwrap_or("?"));
            let energy_file = dir.join("energy_uj");
            match std::fs::read_to_string(&energy_file) {
                Ok(_) => {}
                Err(e) if e.kind() == std::io::ErrorKind::PermissionDenied => {
                    problems.push(format!(
                        "{}: permission denied (energy_uj is root-only since Linux 5.10, CVE-2020-8694; \
                         `sudo chmod a+r /sys/class/powercap/intel-rapl:*/energy_uj` allows it)",
                        energy_file.display()
                    ));
                    continue;
                }
                Err(e) => {
                    problems.push(format!("{}: {e}", energy_file.display()));
                    continue;
                }
            }
            let max_energy_uj = read_u64(&dir.join("max_energy_range_uj")).unwrap_or(0);
            zones.push(RaplZone(Zone { name: label, energy_file, max_energy_uj }));
        }
        if zones.is_empty() {
            return EnergyMeter::Unavailable(problems.join("; "));
        }
        EnergyMeter::Rapl(zones)
    }

    /// The meter as the report's `energy.cpu_rapl` object.
    pub fn describe(&self) -> Value {
        match self {
            EnergyMeter::Rapl(zones) => json!({
                "available": true,
                "zones": zones.iter().map(|z| z.0.name.clone()).collect::<Vec<_>>(),
                "note": "counters read before and after each item; one wrap of max_energy_range_uj is corrected",
            }),
            EnergyMeter::Unavailable(reason) => json!({ "available": false, "reason": reason }),
        }
    }

    /// Reads every counter at the start of an item.
    pub fn start(&self) -> EnergyStart {
        match self {
            EnergyMeter::Rapl(zones) => EnergyStart(zones.iter().map(|z| read_u64(&z.0.energy_file)).collect()),
            EnergyMeter::Unavailable(_) => EnergyStart(Vec::new()),
        }
    }

    /// Joules per zone since `start` (a counter that went down wrapped once at its
    /// `max_energy_range_uj`); `None` when there is no meter or a counter could not be read.
    pub fn joules_since(&self, start: &EnergyStart) -> Option<Vec<(String, f64)>> {
        let EnergyMeter::Rapl(zones) = self else { return None };
        let mut out = Vec::new();
        for (zone, before) in zones.iter().zip(&start.0) {
            let (before, after) = ((*before)?, read_u64(&zone.0.energy_file)?);
            let delta = if after >= before {
                after - before
            } else {
                zone.0.max_energy_uj.checked_sub(before)?.checked_add(after)?
            };
            out.push((zone.0.name.clone(), delta as f64 * 1e-6));
        }
        Some(out)
    }
}

/// NVIDIA GPUs' energy counters through NVML (`nvml-wrapper`, which loads `libnvidia-ml` at run
/// time): millijoules since the driver loaded, per GPU, read before and after each item on a GPU.
pub enum GpuEnergyMeter {
    /// NVML loaded; the GPUs it sees by index, with their names.
    Nvml(Box<nvml_wrapper::Nvml>, Vec<String>),
    /// No reading possible, and why.
    Unavailable(String),
}

impl GpuEnergyMeter {
    /// Loads NVML and lists its GPUs; unavailable (with NVML's reason) when the library or a GPU
    /// is missing.
    pub fn open() -> GpuEnergyMeter {
        let nvml = match nvml_wrapper::Nvml::init() {
            Ok(nvml) => nvml,
            Err(e) => {
                return GpuEnergyMeter::Unavailable(format!("NVML could not be loaded ({e}): no NVIDIA driver here"));
            }
        };
        let count = match nvml.device_count() {
            Ok(0) => return GpuEnergyMeter::Unavailable("NVML loaded but sees no GPU".into()),
            Ok(count) => count,
            Err(e) => return GpuEnergyMeter::Unavailable(format!("NVML loaded but cannot count the GPUs ({e})")),
        };
        let names = (0..count)
            .map(|i| nvml.device_by_index(i).and_then(|d| d.name()).unwrap_or_else(|e| format!("GPU {i} ({e})")))
            .collect();
        GpuEnergyMeter::Nvml(Box::new(nvml), names)
    }

    /// The meter as the report's `energy.gpu_nvml` object.
    pub fn describe(&self) -> Value {
        match self {
            GpuEnergyMeter::Nvml(_, names) => json!({
                "available": true,
                "gpus": names,
                "note": "nvmlDeviceGetTotalEnergyConsumption read before and after each item on a GPU",
            }),
            GpuEnergyMeter::Unavailable(reason) => json!({ "available": false, "reason": reason }),
        }
    }

    /// GPU `index`'s counter in millijoules, if it can be read. NVML numbers GPUs by PCI bus, as
    /// CUDA does under `CUDA_DEVICE_ORDER=PCI_BUS_ID`; with CUDA's default order (fastest first)
    /// on a machine of mixed GPUs the indices may name different cards.
    pub fn read_mj(&self, index: usize) -> Option<u64> {
        let GpuEnergyMeter::Nvml(nvml, _) = self else { return None };
        nvml.device_by_index(u32::try_from(index).ok()?).and_then(|d| d.total_energy_consumption()).ok()
    }

    /// Joules GPU `index` used since its counter read `start_mj`; `None` without a reading.
    pub fn joules_since(&self, index: usize, start_mj: Option<u64>) -> Option<f64> {
        Some(self.read_mj(index)?.checked_sub(start_mj?)? as f64 * 1e-3)
    }
}

fn read_u64(path: &Path) -> Option<u64> {
    std::fs::read_to_string(path).ok()?.trim().parse().ok()
}

/// The package joules of a measurement (`None`: no meter), as JSON: total and per zone. Sub-zones
/// (`intel-rapl:N:M`) are part of their package and are not added to the total.
pub fn energy_json(joules: &Option<Vec<(String, f64)>>) -> Value {
    match joules {
        None => Value::Null,
        Some(zones) => {
            let total: f64 = zones
                .iter()
                .filter(|(name, _)| name.split_whitespace().next().is_some_and(|id| id.matches(':').count() == 1))
                .map(|(_, j)| j)
                .sum();
            json!({ "package_joules": total, "zones": zones.iter().map(|(n, j)| json!({"zone": n, "joules": j})).collect::<Vec<_>>() })
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn without_an_nvidia_driver_gpu_energy_is_unavailable_with_the_reason_and_no_figure() {
        let meter = GpuEnergyMeter::open();
        if let GpuEnergyMeter::Unavailable(reason) = &meter {
            assert!(reason.contains("NVML"), "{reason}");
            assert_eq!(meter.describe()["available"], false);
            assert_eq!(meter.read_mj(0), None);
            assert_eq!(meter.joules_since(0, Some(0)), None);
        } else {
            println!("NVML is here: {}", meter.describe());
        }
    }

    #[test]
    fn a_missing_powercap_is_unavailable_with_the_reason() {
        let meter = EnergyMeter::open_at(Path::new("/nonexistent/powercap"));
        match meter {
            EnergyMeter::Unavailable(reason) => assert!(reason.contains("does not exist"), "{reason}"),
            EnergyMeter::Rapl(_) => panic!("a missing directory gave a meter"),
        }
    }

    #[test]
    fn a_wrapped_counter_counts_the_distance_through_the_wrap() {
        let dir = std::env::temp_dir().join(format!("conveyor-rapl-test-{}", std::process::id()));
        let zone = dir.join("intel-rapl:0");
        std::fs::create_dir_all(&zone).unwrap();
        std::fs::write(zone.join("name"), "package-0\n").unwrap();
        std::fs::write(zone.join("max_energy_range_uj"), "1000000\n").unwrap();
        std::fs::write(zone.join("energy_uj"), "900000\n").unwrap();
        let meter = EnergyMeter::open_at(&dir);
        let start = meter.start();
        std::fs::write(zone.join("energy_uj"), "100000\n").unwrap();
        let joules = meter.joules_since(&start).unwrap();
        std::fs::remove_dir_all(&dir).unwrap();
        assert_eq!(joules.len(), 1);
        assert!((joules[0].1 - 0.2).abs() < 1e-9, "{joules:?}");
        assert!((energy_json(&Some(joules))["package_joules"].as_f64().unwrap() - 0.2).abs() < 1e-9);
    }
}
