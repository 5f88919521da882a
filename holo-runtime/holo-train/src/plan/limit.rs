//! The memory a run may use: the cgroup's limit less what the cgroup already uses, or the kernel's
//! `MemAvailable`, whichever is less; or `memory_limit` when the configuration states one. And what the
//! check does with a plan that exceeds it ([`MemoryCheck`], an option of every trainer).

pub use crate::options::{MemoryCheck, MEMORY_CHECK_VALUES};

/// Memory a run may use, and where the figure comes from.
#[derive(Debug, Clone, PartialEq)]
pub struct Available {
    pub bytes: u64,
    pub source: String,
}

/// The memory available: `limit_gib` (the configuration's `memory_limit`) when given, else the least of
/// the cgroup's room (v2 `memory.max` − `memory.current`, or v1's limit − usage) and `MemAvailable`.
/// `None` when neither can be read.
pub fn available(limit_gib: Option<f64>) -> Option<Available> {
    if let Some(gib) = limit_gib {
        return Some(Available {
            bytes: (gib * GIB) as u64,
            source: "memory_limit".into(),
        });
    }
    let meminfo = std::fs::read_to_string("/proc/meminfo").ok();
    let system = meminfo
        .as_deref()
        .and_then(mem_available)
        .map(|bytes| Available {
            bytes,
            source: "MemAvailable".into(),
        });
    let cgroup = cgroup_room().map(|bytes| Available {
        bytes,
        source: "the cgroup's memory limit".into(),
    });
    match (system, cgroup) {
        (Some(system), Some(cgroup)) if cgroup.bytes < system.bytes => Some(cgroup),
        (Some(system), _) => Some(system),
        (None, cgroup) => cgroup,
    }
}

/// Bytes in a GiB, as a float for display.
pub const GIB: f64 = (1u64 << 30) as f64;

/// `MemAvailable` of `/proc/meminfo`'s text, in bytes.
fn mem_available(meminfo: &str) -> Option<u64> {
    let line = meminfo
        .lines()
        .find(|line| line.starts_with("MemAvailable:"))?;
    let kib: u64 = line.split_whitespace().nth(1)?.parse().ok()?;
    Some(kib * 1024)
}

/// The cgroup's limit less its usage, when it has a limit.
fn cgroup_room() -> Option<u64> {
    let read = |path: &str| {
        std::fs::read_to_string(path)
            .ok()
            .and_then(|text| text.trim().parse::<u64>().ok())
    };
    let (limit, usage) = match read("/sys/fs/cgroup/memory.max") {
        Some(limit) => (limit, read("/sys/fs/cgroup/memory.current")?),
        // v2's "max" does not parse: no limit. v1 writes a huge number for none.
        None => (
            read("/sys/fs/cgroup/memory/memory.limit_in_bytes").filter(|&limit| limit < 1 << 60)?,
            read("/sys/fs/cgroup/memory/memory.usage_in_bytes")?,
        ),
    };
    Some(limit.saturating_sub(usage))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn mem_available_is_read_in_bytes() {
        let text = "MemTotal:       24576000 kB\nMemFree:  100 kB\nMemAvailable:   23528220 kB\n";
        assert_eq!(mem_available(text), Some(23_528_220 * 1024));
        assert_eq!(mem_available("MemTotal: 1 kB\n"), None);
    }

    #[test]
    fn a_stated_limit_wins() {
        let stated = available(Some(1.5)).unwrap();
        assert_eq!(stated.bytes, 3 << 29);
        assert_eq!(stated.source, "memory_limit");
    }
}
