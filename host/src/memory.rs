//! Process memory: glibc's allocator, which the host's RSS depends on more than on
//! anything it holds (BENCHMARKS.md: up to 15 MiB between runs at 1k services), and the
//! pages of the host's own binary.

/// Keeps every thread in glibc's one main malloc arena unless `MALLOC_ARENA_MAX` says
/// otherwise. glibc gives threads that contend their own arena (up to 8 per core), and each
/// arena keeps its own partly used pages: the initial sync's transient objects (list bodies,
/// decoded Kubernetes objects) are freed between long-lived ones in whichever arena a
/// worker thread had. Small allocations mostly bypass the arena's lock through each thread's
/// cache. Measured (BENCHMARKS.md, fifteenth run): two arenas instead of the default 8–14
/// MiB less RSS at 1k services, one instead of two another 2.0 MiB at 1k and 3–4 MiB at
/// 10k, with the same change latency and CPU per event. Call before any thread is started.
pub fn limit_malloc_arenas() {
    if std::env::var_os("MALLOC_ARENA_MAX").is_some() {
        return;
    }
    #[cfg(all(target_os = "linux", target_env = "gnu"))]
    // SAFETY: mallopt only sets an allocator parameter.
    unsafe {
        libc::mallopt(libc::M_ARENA_MAX, 1);
    }
}

/// Returns free heap pages to the kernel (after a burst of large transient allocations).
/// The runtime's, which calls it after each compilation.
pub use wasmplane_runtime::release_free_memory;

/// The binary's own code and read-only data that the kernel was asked to reclaim.
#[derive(Debug, Default, Clone, Copy, PartialEq, Eq)]
pub struct PagedOut {
    pub mappings: usize,
    /// What those mappings had resident before the advice, in KiB.
    pub resident_kib: u64,
}

/// Asks the kernel to reclaim the pages of this process's own binary that are mapped from
/// the file and hold no private copies (code and read-only data), as after start-up most of
/// them are code that ran once: CLI parsing, the initial list and its decoding, loading the
/// guests. What the host runs later faults back in from the page cache or the file.
/// `MADV_PAGEOUT` only reclaims, it never discards: a mapping with any anonymous page (the
/// relocated data, or code an uprobe has patched) is left alone. Linux ≥ 5.4.
pub fn page_out_own_binary() -> std::io::Result<PagedOut> {
    let mut paged = PagedOut::default();
    for mapping in binary_mappings("self")?.iter().filter(|m| m.reclaimable()) {
        // SAFETY: advice on a mapping of this process's own address space, taken from its
        // smaps just now; MADV_PAGEOUT does not change the mapping's contents.
        let rc = unsafe { libc::madvise(mapping.start as *mut libc::c_void, mapping.len, libc::MADV_PAGEOUT) };
        if rc != 0 {
            return Err(std::io::Error::last_os_error());
        }
        paged.mappings += 1;
        paged.resident_kib += mapping.resident_kib;
    }
    Ok(paged)
}

/// One mapping of a process's own binary, and what of it is resident.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct BinaryMapping {
    pub start: usize,
    pub len: usize,
    pub executable: bool,
    pub writable: bool,
    pub resident_kib: u64,
    /// Private copies among the resident pages: relocated data, written data, patched code.
    pub anonymous_kib: u64,
}

impl BinaryMapping {
    /// Read-only and every resident page the file's: what `page_out_own_binary` hands back.
    pub fn reclaimable(&self) -> bool {
        !self.writable && self.anonymous_kib == 0
    }
}

/// The mappings of the binary a process runs, from `/proc/<process>/smaps` (`process`: `self`
/// or a process ID).
pub fn binary_mappings(process: &str) -> std::io::Result<Vec<BinaryMapping>> {
    let exe = std::fs::read_link(format!("/proc/{process}/exe"))?;
    let smaps = std::fs::read_to_string(format!("/proc/{process}/smaps"))?;
    Ok(mappings_of(&smaps, &exe.to_string_lossy()))
}

/// The mappings of the file at `path` in a `/proc/PID/smaps` text.
fn mappings_of(smaps: &str, path: &str) -> Vec<BinaryMapping> {
    let mut found: Vec<BinaryMapping> = Vec::new();
    // Whether the mapping being read (the last one found, if so) is the file's.
    let mut in_file = false;
    for line in smaps.lines() {
        let mut fields = line.split_whitespace();
        let Some(first) = fields.next() else { continue };
        if let Some((start, end)) = first.split_once('-').filter(|_| !first.ends_with(':')) {
            let perms = fields.next().unwrap_or("");
            // offset, device, inode, then the path (which may hold spaces, e.g. " (deleted)")
            let name = line.splitn(6, char::is_whitespace).nth(5).map(str::trim_start).unwrap_or("");
            in_file = false;
            if let (true, Ok(start), Ok(end)) = (name == path, usize::from_str_radix(start, 16), usize::from_str_radix(end, 16)) {
                in_file = true;
                let (executable, writable) = (perms.contains('x'), perms.contains('w'));
                found.push(BinaryMapping { start, len: end - start, executable, writable, resident_kib: 0, anonymous_kib: 0 });
            }
        } else if let (true, Some(mapping)) = (in_file, found.last_mut()) {
            let kib = fields.next().and_then(|v| v.parse::<u64>().ok()).unwrap_or(0);
            match first {
                "Rss:" => mapping.resident_kib = kib,
                "Anonymous:" => mapping.anonymous_kib = kib,
                _ => {}
            }
        }
    }
    found
}

#[cfg(test)]
mod tests {
    use super::*;

    const SMAPS: &str = "\
55d0a0000000-55d0a0400000 r--p 00000000 fe:01 1234 /usr/bin/wasmplane
Rss:                1024 kB
Anonymous:             0 kB
55d0a0400000-55d0a1400000 r-xp 00400000 fe:01 1234 /usr/bin/wasmplane
Rss:                6912 kB
Anonymous:             0 kB
55d0a1400000-55d0a14b2000 r--p 01400000 fe:01 1234 /usr/bin/wasmplane
Rss:                 712 kB
Anonymous:           712 kB
55d0a14b2000-55d0a14ba000 rw-p 014b2000 fe:01 1234 /usr/bin/wasmplane
Rss:                  32 kB
Anonymous:            32 kB
7f0000000000-7f0000100000 r-xp 00000000 fe:01 99 /usr/lib/x86_64-linux-gnu/libc.so.6
Rss:                1032 kB
Anonymous:             0 kB
7f0000200000-7f0000300000 r-xp 00000000 fe:01 77 /usr/bin/wasmplane-old (deleted)
Rss:                 100 kB
Anonymous:             0 kB
";

    fn mapping(start: usize, len: usize, perms: &str, resident_kib: u64, anonymous_kib: u64) -> BinaryMapping {
        BinaryMapping { start, len, executable: perms.contains('x'), writable: perms.contains('w'), resident_kib, anonymous_kib }
    }

    /// The binary's mappings and only those (not libc's), with what each has resident.
    #[test]
    fn reads_the_binarys_mappings() {
        assert_eq!(
            mappings_of(SMAPS, "/usr/bin/wasmplane"),
            vec![
                mapping(0x55d0a0000000, 0x400000, "r--p", 1024, 0),
                mapping(0x55d0a0400000, 0x1000000, "r-xp", 6912, 0),
                mapping(0x55d0a1400000, 0xb2000, "r--p", 712, 712),
                mapping(0x55d0a14b2000, 0x8000, "rw-p", 32, 32),
            ]
        );
        // A binary replaced on disk while it runs is still found by the name /proc gives it.
        let deleted = mappings_of(SMAPS, "/usr/bin/wasmplane-old (deleted)");
        assert_eq!(deleted, vec![mapping(0x7f0000200000, 0x100000, "r-xp", 100, 0)]);
    }

    /// On this process: its binary's code is resident before, and much less of it after.
    #[test]
    fn pages_out_this_test_binarys_code() {
        let resident = || binary_mappings("self").unwrap().iter().filter(|m| m.reclaimable()).map(|m| m.resident_kib).sum::<u64>();
        let before = resident();
        let paged = match page_out_own_binary() {
            Err(e) if e.raw_os_error() == Some(libc::EINVAL) => {
                eprintln!("SKIPPED: this kernel has no MADV_PAGEOUT (Linux < 5.4)");
                return;
            }
            other => other.unwrap(),
        };
        let after = resident();
        assert!(paged.mappings >= 1 && paged.resident_kib > 0, "{paged:?}");
        assert!(before > 0 && after < before / 2, "resident code and read-only data: {before} KiB before, {after} KiB after");
    }
}
