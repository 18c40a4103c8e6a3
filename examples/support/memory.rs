//! This process's memory, as Linux reports it, for the benchmarks.

/// A memory figure of this process from /proc/self/status (`VmHWM`: peak RSS, `VmRSS`: RSS),
/// in KiB; 0 where the system has no such file.
pub fn status_kib(field: &str) -> u64 {
    std::fs::read_to_string("/proc/self/status")
        .unwrap_or_default()
        .lines()
        .find_map(|line| {
            line.strip_prefix(field)?
                .strip_prefix(':')
                .map(|v| v.trim().trim_end_matches(" kB").parse().unwrap_or(0))
        })
        .unwrap_or(0)
}
