//! Process memory: glibc's allocator, which the host's RSS depends on more than on
//! anything it holds (BENCHMARKS.md: up to 15 MiB between runs at 1k services), and the
//! pages of the files it maps: its binary, the compiled guests, the shared libraries.

use std::path::Path;

/// Allocations this large or larger get their own mappings, returned to the kernel when freed.
pub const MMAP_THRESHOLD_BYTES: usize = 32 << 10;

/// Sets glibc's allocator for a long-running process whose RSS matters more than the speed of
/// its rare large allocations. Each setting yields to glibc's own environment variable.
/// - One malloc arena (`MALLOC_ARENA_MAX`). glibc gives threads that contend their own arena
///   (up to 8 per core), and each arena keeps its own partly used pages: the initial sync's
///   transient objects (list bodies, decoded Kubernetes objects) are freed between long-lived
///   ones in whichever arena a worker thread had. Small allocations mostly bypass the arena's
///   lock through each thread's cache. Measured (BENCHMARKS.md, fifteenth run): two arenas
///   instead of the default 8–14 MiB less RSS at 1k services, one instead of two another 2.0
///   MiB at 1k and 3–4 MiB at 10k, with the same change latency and CPU per event.
/// - Blocks of [`MMAP_THRESHOLD_BYTES`] or more in their own mappings
///   (`MALLOC_MMAP_THRESHOLD_`). Left to itself glibc raises that threshold to the size of
///   each mapped block freed (up to 32 MiB), so once the initial sync has freed its list
///   bodies and batches, blocks that large come from the heap, and freed they leave holes
///   between long-lived objects that the heap cannot return. Measured (sixteenth run): 0.6–0.9
///   MiB less RSS at 1k services, 0.6–1.2 at 10k with a 3.5–4.4 MiB lower peak, the same
///   latency and CPU per event.
///
/// Call before any thread is started.
pub fn configure_malloc() {
    #[cfg(all(target_os = "linux", target_env = "gnu"))]
    {
        if std::env::var_os("MALLOC_ARENA_MAX").is_none() {
            // SAFETY: mallopt only sets an allocator parameter.
            unsafe { libc::mallopt(libc::M_ARENA_MAX, 1) };
        }
        if std::env::var_os("MALLOC_MMAP_THRESHOLD_").is_none() {
            // SAFETY: as above; a fixed threshold also turns off glibc's raising of it.
            unsafe { libc::mallopt(libc::M_MMAP_THRESHOLD, MMAP_THRESHOLD_BYTES as libc::c_int) };
        }
    }
}

/// Sets this process's `oom_score_adj` (-1000..=1000: how readily the kernel's OOM killer
/// picks it). Children started afterwards inherit it (nft, as kube-proxy's iptables-restore
/// does); the guest compiler raises its own to the first pick
/// (`wasmplane_runtime::compiler::COMPILER_OOM_SCORE_ADJ`).
pub fn set_oom_score_adj(value: i32) -> std::io::Result<()> {
    std::fs::write("/proc/self/oom_score_adj", value.to_string())
}

/// At most this many async worker threads unless `TOKIO_WORKER_THREADS` says otherwise.
pub const MAX_WORKER_THREADS: usize = 4;

/// How many worker threads the host's async runtime gets: one per core it may use, at most
/// [`MAX_WORKER_THREADS`]; `None` when `TOKIO_WORKER_THREADS` is set (`tokio_worker_threads`),
/// which tokio then reads itself. Each worker costs its stack's touched pages and its share
/// of the allocator's thread caches, ~50 KiB at 1k services (BENCHMARKS.md, nineteenth run),
/// and the host's work does not spread over more: model, guests and dataplane run one
/// revision at a time, guests and the kvstore on the blocking pool. Left to tokio, a 64-core
/// node would get 64 workers.
pub fn worker_threads(tokio_worker_threads: Option<&std::ffi::OsStr>, cores: usize) -> Option<usize> {
    tokio_worker_threads.is_none().then(|| cores.clamp(1, MAX_WORKER_THREADS))
}

/// Returns free heap pages to the kernel (after a burst of large transient allocations).
/// The runtime's, which calls it after each compilation.
pub use wasmplane_runtime::release_free_memory;

/// Moves this program's relocated read-only data (`PT_GNU_RELRO`: vtables, panic locations,
/// tables of pointers) out of anonymous memory into a file of its own, so that, like the code
/// after [`page_out_code`], only what the host reads from then on is in memory. Returns how
/// many bytes moved (0 when nothing was relocated, as in a binary that
/// is not position-independent, or when this already ran).
///
/// A position-independent binary's loader writes the load address into every pointer of that
/// data at start: ~0.7 MiB of the host's, all of it dirty private pages from then on, which
/// a machine without swap never reclaims (BENCHMARKS.md, nineteenth run). Written to a file,
/// the same bytes are clean pages that can be dropped and read again. Android's loader shares
/// relocated data between processes the same way (`ANDROID_DLEXT_WRITE_RELRO`).
/// - The file is unnamed (`O_TMPFILE`, mode 0600) in `dir`: the bytes hold this run's load
///   address, and nothing else can open it; it goes when the process does.
/// - `dir` must not be on tmpfs or ramfs, whose pages stay in memory (an error).
/// - The file's pages are then dropped from the page cache, and its mapping is moved over the
///   original in one step (`mremap`): no thread ever sees the data missing, a failure leaves
///   it as it was, and afterwards only the pages the host reads are in memory, read back
///   from the file one by one (`MADV_RANDOM`). (Reclaiming them once mapped would depend on
///   which CPU's LRU batch the fresh page-cache pages still sit in.)
pub fn file_back_relocated_data(dir: &Path) -> std::io::Result<usize> {
    use std::io::Write as _;
    use std::os::fd::AsRawFd as _;
    use std::os::unix::fs::OpenOptionsExt as _;
    let Some(relro) = relocated_pages() else { return Ok(0) };
    let len = relro.end - relro.start;
    let holds_relocations = file_mappings("self")?
        .iter()
        .any(|m| !m.writable && m.anonymous_kib > 0 && m.start <= relro.start && relro.end <= m.start + m.len);
    if !holds_relocations {
        return Ok(0);
    }
    refuse_memory_backed(dir)?;
    let mut file = std::fs::OpenOptions::new()
        .read(true)
        .write(true)
        .custom_flags(libc::O_TMPFILE | libc::O_CLOEXEC)
        .mode(0o600)
        .open(dir)?;
    // SAFETY: the range is this program's RELRO segment, mapped readable for its whole life.
    let original = unsafe { std::slice::from_raw_parts(relro.start as *const u8, len) };
    file.write_all(original)?;
    // Written back, so that the page cache can drop it (it does not drop dirty pages).
    file.sync_data()?;
    // Only advice: pages left cached are not the process's until it reads them.
    // SAFETY: advice on the file just written.
    unsafe { libc::posix_fadvise(file.as_raw_fd(), 0, 0, libc::POSIX_FADV_DONTNEED) };
    // SAFETY: a new private read-only mapping of the file just written, at an address the
    // kernel picks; unmapped below unless it replaces the original.
    let copy =
        unsafe { libc::mmap(std::ptr::null_mut(), len, libc::PROT_READ, libc::MAP_PRIVATE, file.as_raw_fd(), 0) };
    if copy == libc::MAP_FAILED {
        return Err(std::io::Error::last_os_error());
    }
    // Read page by page, as `page_out_code` has the binary's other mappings read.
    // SAFETY: advice on the mapping just made.
    unsafe { libc::madvise(copy, len, libc::MADV_RANDOM) };
    // SAFETY: moves the read-only copy of the same bytes over the original range, replacing
    // it in one step; the file stays open through the mapping.
    let moved = unsafe {
        libc::mremap(copy, len, len, libc::MREMAP_MAYMOVE | libc::MREMAP_FIXED, relro.start as *mut libc::c_void)
    };
    if moved == libc::MAP_FAILED {
        let error = std::io::Error::last_os_error();
        // SAFETY: as above; the original is untouched when mremap fails.
        unsafe { libc::munmap(copy, len) };
        return Err(error);
    }
    Ok(len)
}

/// The page range the loader made read-only after relocating this program (its
/// `PT_GNU_RELRO`, rounded as the loader rounds it), if it has one.
fn relocated_pages() -> Option<std::ops::Range<usize>> {
    /// Called by `dl_iterate_phdr` for each loaded object, this program first.
    unsafe extern "C" fn main_program(
        info: *mut libc::dl_phdr_info,
        _size: usize,
        found: *mut libc::c_void,
    ) -> libc::c_int {
        // SAFETY: the loader's description of a loaded object, valid during the callback;
        // `found` is the `Option` passed below.
        let (info, found) = unsafe { (&*info, &mut *(found as *mut Option<(usize, usize)>)) };
        // SAFETY: as above: `dlpi_phnum` program headers at `dlpi_phdr`.
        let headers = unsafe { std::slice::from_raw_parts(info.dlpi_phdr, usize::from(info.dlpi_phnum)) };
        *found = headers
            .iter()
            .find(|h| h.p_type == libc::PT_GNU_RELRO)
            .map(|h| (info.dlpi_addr as usize + h.p_vaddr as usize, h.p_memsz as usize));
        1
    }
    let mut found: Option<(usize, usize)> = None;
    // SAFETY: the callback only reads what the loader passes and writes `found`.
    unsafe { libc::dl_iterate_phdr(Some(main_program), &mut found as *mut _ as *mut libc::c_void) };
    let (start, len) = found?;
    // SAFETY: sysconf reads a constant of the system.
    let page = usize::try_from(unsafe { libc::sysconf(libc::_SC_PAGESIZE) }).ok()?;
    // The loader protects whole pages from the first one down to the last whole one.
    let range = (start & !(page - 1))..((start + len) & !(page - 1));
    (!range.is_empty()).then_some(range)
}

/// An error when `dir` is on a file system whose pages live in memory only.
fn refuse_memory_backed(dir: &Path) -> std::io::Result<()> {
    const TMPFS_MAGIC: u32 = 0x0102_1994;
    const RAMFS_MAGIC: u32 = 0x8584_58f6;
    let path = std::ffi::CString::new(dir.as_os_str().as_encoded_bytes()).map_err(std::io::Error::other)?;
    // SAFETY: statfs writes the struct it is given; the path is a valid C string.
    let mut stat: libc::statfs = unsafe { std::mem::zeroed() };
    if unsafe { libc::statfs(path.as_ptr(), &mut stat) } != 0 {
        return Err(std::io::Error::last_os_error());
    }
    // The magic numbers are 32 bits; `f_type` is a signed word of the platform's size.
    if [TMPFS_MAGIC, RAMFS_MAGIC].contains(&(stat.f_type as u32)) {
        return Err(std::io::Error::other(format!(
            "{} is in memory (tmpfs): its pages would stay resident",
            dir.display()
        )));
    }
    Ok(())
}

/// The code and read-only data that the kernel was asked to reclaim, and what of it was
/// resident before, in KiB.
#[derive(Debug, Default, Clone, Copy, PartialEq, Eq)]
pub struct PagedOut {
    pub mappings: usize,
    /// The host binary's.
    pub binary_kib: u64,
    /// The compiled guests' (mapped from the runtime's cache of compiled components).
    pub guests_kib: u64,
    /// Every other file's mapped read-only: the shared libraries (libc, libm, the loader).
    pub libraries_kib: u64,
}

/// Asks the kernel to reclaim this process's pages of every file it maps read-only without
/// private copies (code and read-only data): its binary, the compiled guests mapped from
/// `compiled_guests` (the runtime's cache directory), the shared libraries. After start-up
/// most of them are code that ran once: CLI parsing, the initial list and its decoding, the
/// dynamic loader's symbol lookups, loading the guests and their first translations. What the
/// host runs later faults back in from the page cache or the file.
/// - `MADV_PAGEOUT` only reclaims, it never discards: a mapping with any anonymous page (the
///   relocated data, or code an uprobe has patched) is left alone.
/// - The kernel skips pages that another process maps too (libc's, mostly): only what this
///   process alone holds is handed back.
/// - The mappings are then read at random (`MADV_RANDOM`): what faults back in is the pages the
///   host touches, not the neighbourhood read around them.
///
/// Linux ≥ 5.4.
pub fn page_out_code(compiled_guests: Option<&Path>) -> std::io::Result<PagedOut> {
    let exe = std::fs::read_link("/proc/self/exe")?.to_string_lossy().into_owned();
    let guests = compiled_guests.and_then(|dir| dir_prefix(dir).ok());
    // The binary's relocated data, once in a file of its own, is still the binary's.
    let relocated = relocated_pages().unwrap_or_default();
    let mut paged = PagedOut::default();
    for mapping in file_mappings("self")?.iter().filter(|m| m.reclaimable()) {
        // SAFETY: advice on a mapping of this process's own address space, taken from its
        // smaps just now; MADV_PAGEOUT does not change the contents of whatever is mapped there.
        let rc = unsafe { libc::madvise(mapping.start as *mut libc::c_void, mapping.len, libc::MADV_PAGEOUT) };
        if rc != 0 {
            let error = std::io::Error::last_os_error();
            // Unmapped since smaps was read (a guest unloaded): nothing there to reclaim.
            if error.raw_os_error() == Some(libc::ENOMEM) {
                continue;
            }
            return Err(error);
        }
        // What faults back in is then read page by page: with the default read-around a fault
        // reads up to `read_ahead_kb` around it into the page cache, and the next faults map
        // 64 KiB of that at once, most of it constants next to the ones used (BENCHMARKS.md,
        // sixteenth run: 0.9 MiB of read-only data). Only advice: a failure changes nothing.
        // SAFETY: as above; MADV_RANDOM changes how later faults read, not what is mapped.
        unsafe { libc::madvise(mapping.start as *mut libc::c_void, mapping.len, libc::MADV_RANDOM) };
        paged.mappings += 1;
        *(if mapping.file == exe || relocated.contains(&mapping.start) {
            &mut paged.binary_kib
        } else if guests.as_ref().is_some_and(|prefix| mapping.file.starts_with(prefix)) {
            &mut paged.guests_kib
        } else {
            &mut paged.libraries_kib
        }) += mapping.resident_kib;
    }
    Ok(paged)
}

/// One mapping of a file into a process, and what of it is resident.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct FileMapping {
    /// The file's absolute path as /proc names it (with " (deleted)" once it is replaced).
    pub file: String,
    pub start: usize,
    pub len: usize,
    pub executable: bool,
    pub writable: bool,
    pub resident_kib: u64,
    /// Private copies among the resident pages: relocated data, written data, patched code.
    pub anonymous_kib: u64,
}

impl FileMapping {
    /// Read-only and every resident page the file's: what `page_out_code` hands back.
    pub fn reclaimable(&self) -> bool {
        !self.writable && self.anonymous_kib == 0
    }
}

/// Every mapping of a file in a process, from `/proc/<process>/smaps` (`process`: `self` or a
/// process ID).
pub fn file_mappings(process: &str) -> std::io::Result<Vec<FileMapping>> {
    Ok(mappings_of(&std::fs::read_to_string(format!("/proc/{process}/smaps"))?))
}

/// The mappings of the binary a process runs.
pub fn binary_mappings(process: &str) -> std::io::Result<Vec<FileMapping>> {
    let exe = std::fs::read_link(format!("/proc/{process}/exe"))?;
    let exe = exe.to_string_lossy();
    Ok(file_mappings(process)?.into_iter().filter(|m| m.file == exe).collect())
}

/// The mappings of the files in `dir` (the compiled guests, when it is the runtime's cache).
/// None when `dir` does not exist.
pub fn mappings_under(process: &str, dir: &Path) -> std::io::Result<Vec<FileMapping>> {
    let Ok(prefix) = dir_prefix(dir) else { return Ok(Vec::new()) };
    Ok(file_mappings(process)?.into_iter().filter(|m| m.file.starts_with(&prefix)).collect())
}

/// How /proc names the files in `dir`: absolute, links resolved, then a slash.
fn dir_prefix(dir: &Path) -> std::io::Result<String> {
    Ok(format!("{}/", dir.canonicalize()?.to_string_lossy()))
}

/// The mappings of files in a `/proc/PID/smaps` text (not the heap, stacks or anonymous ones).
fn mappings_of(smaps: &str) -> Vec<FileMapping> {
    let mut found: Vec<FileMapping> = Vec::new();
    // Whether the mapping being read (the last one found, if so) is a file's.
    let mut in_file = false;
    for line in smaps.lines() {
        let mut fields = line.split_whitespace();
        let Some(first) = fields.next() else { continue };
        if let Some((start, end)) = first.split_once('-').filter(|_| !first.ends_with(':')) {
            let perms = fields.next().unwrap_or("");
            // offset, device, inode, then the path (which may hold spaces, e.g. " (deleted)")
            let name = line.splitn(6, char::is_whitespace).nth(5).map(str::trim_start).unwrap_or("");
            in_file = false;
            if let (true, Ok(start), Ok(end)) =
                (name.starts_with('/'), usize::from_str_radix(start, 16), usize::from_str_radix(end, 16))
            {
                in_file = true;
                let (executable, writable) = (perms.contains('x'), perms.contains('w'));
                found.push(FileMapping {
                    file: name.to_string(),
                    start,
                    len: end - start,
                    executable,
                    writable,
                    resident_kib: 0,
                    anonymous_kib: 0,
                });
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
7f0000400000-7f0000462000 r-xp 00031000 fe:01 501 /var/lib/wasmplane/compiled/59a6-9f9f.cwasm
Rss:                 392 kB
Anonymous:             0 kB
7f0000500000-7f0000502000 rw-p 00000000 00:00 0 
Rss:                   8 kB
Anonymous:             8 kB
7f0000600000-7f0000700000 rw-p 00000000 00:00 0                          [heap]
Rss:                 900 kB
Anonymous:           900 kB
";

    /// Once a large mapped block is freed, a block of half its size still gets a mapping of its
    /// own: glibc's default would have raised its threshold to the freed block's size and
    /// grown the heap for it. (Sizes no heap of a test process has free; blocks never
    /// touched, so never resident.)
    #[test]
    fn large_blocks_keep_their_own_mappings() {
        configure_malloc();
        // glibc marks a block it mapped on its own with bit 1 of the size word just before it.
        let mapped_alone = |bytes: usize| {
            let block = Vec::<u8>::with_capacity(bytes);
            // SAFETY: reads the allocator's header word of a live block.
            unsafe { std::ptr::read((block.as_ptr() as *const usize).sub(1)) & 2 != 0 }
        };
        assert!(mapped_alone(24 << 20), "a 24 MiB block is mapped on its own");
        assert!(mapped_alone(12 << 20), "after a 24 MiB block was freed, a 12 MiB one came from the heap");
    }

    fn mapping(
        file: &str,
        start: usize,
        len: usize,
        perms: &str,
        resident_kib: u64,
        anonymous_kib: u64,
    ) -> FileMapping {
        FileMapping {
            file: file.into(),
            start,
            len,
            executable: perms.contains('x'),
            writable: perms.contains('w'),
            resident_kib,
            anonymous_kib,
        }
    }

    /// Every file's mappings, named, with what each has resident; not the anonymous ones.
    #[test]
    fn reads_the_mappings_of_files() {
        const EXE: &str = "/usr/bin/wasmplane";
        assert_eq!(
            mappings_of(SMAPS),
            vec![
                mapping(EXE, 0x55d0a0000000, 0x400000, "r--p", 1024, 0),
                mapping(EXE, 0x55d0a0400000, 0x1000000, "r-xp", 6912, 0),
                mapping(EXE, 0x55d0a1400000, 0xb2000, "r--p", 712, 712),
                mapping(EXE, 0x55d0a14b2000, 0x8000, "rw-p", 32, 32),
                mapping("/usr/lib/x86_64-linux-gnu/libc.so.6", 0x7f0000000000, 0x100000, "r-xp", 1032, 0),
                // A binary replaced on disk while it runs, by the name /proc gives it.
                mapping("/usr/bin/wasmplane-old (deleted)", 0x7f0000200000, 0x100000, "r-xp", 100, 0),
                mapping("/var/lib/wasmplane/compiled/59a6-9f9f.cwasm", 0x7f0000400000, 0x62000, "r-xp", 392, 0),
            ]
        );
        let reclaimable: Vec<u64> =
            mappings_of(SMAPS).iter().filter(|m| m.reclaimable()).map(|m| m.resident_kib).collect();
        assert_eq!(reclaimable, [1024, 6912, 1032, 100, 392], "read-only and no private page");
    }

    #[test]
    fn worker_threads_follow_the_cores_up_to_the_cap() {
        assert_eq!(worker_threads(None, 1), Some(1));
        assert_eq!(worker_threads(None, 2), Some(2));
        assert_eq!(worker_threads(None, 64), Some(MAX_WORKER_THREADS));
        assert_eq!(
            worker_threads(Some(std::ffi::OsStr::new("16")), 64),
            None,
            "tokio reads TOKIO_WORKER_THREADS itself"
        );
    }

    /// The test binary's relocated data (it is position-independent, as the host is) moves
    /// into a file: the same bytes through the same addresses, no anonymous page left there and
    /// only what is read since in memory; a second call finds nothing left to move.
    #[test]
    fn relocated_data_moves_into_a_file() {
        let relro = relocated_pages().expect("a position-independent test binary has relocated data");
        let len = relro.end - relro.start;
        // SAFETY: the program's RELRO pages, readable for its whole life.
        let before = unsafe { std::slice::from_raw_parts(relro.start as *const u8, len) }.to_vec();
        let in_range = || {
            file_mappings("self")
                .unwrap()
                .into_iter()
                .filter(|m| m.start < relro.end && relro.start < m.start + m.len)
                .collect::<Vec<_>>()
        };
        assert!(in_range().iter().any(|m| m.anonymous_kib > 0), "relocated data is anonymous before: {:?}", in_range());
        let resident_kib = |mappings: &[FileMapping]| mappings.iter().map(|m| m.resident_kib).sum::<u64>();
        let resident_before = resident_kib(&in_range());
        let dir = tempfile::tempdir().unwrap();
        assert_eq!(file_back_relocated_data(dir.path()).unwrap(), len);
        let after = in_range();
        assert!(
            !after.is_empty()
                && after.iter().all(|m| m.anonymous_kib == 0 && m.reclaimable() && m.file.ends_with("(deleted)")),
            "{after:?}"
        );
        // What other tests' threads read meanwhile comes back, not the rest.
        assert!(
            resident_kib(&after) < resident_before / 2,
            "resident: {resident_before} KiB before, {} KiB after",
            resident_kib(&after)
        );
        // SAFETY: as above.
        assert!(
            unsafe { std::slice::from_raw_parts(relro.start as *const u8, len) } == before.as_slice(),
            "the same bytes"
        );
        // Read through it: a call through a vtable and a panic location's file name.
        let add_one: Box<dyn Fn(u32) -> u32> = Box::new(|x| x + 1);
        assert_eq!(std::hint::black_box(add_one)(1), 2);
        assert!(std::panic::Location::caller().file().ends_with("memory.rs"));
        assert_eq!(file_back_relocated_data(dir.path()).unwrap(), 0, "already in a file");
    }

    /// A directory on tmpfs is refused (its pages never leave memory); one on disk is not.
    #[test]
    fn refuses_memory_backed_directories() {
        refuse_memory_backed(tempfile::tempdir().unwrap().path()).expect("the test's temporary directory is on disk");
        let mounts = std::fs::read_to_string("/proc/mounts").unwrap();
        let Some(tmpfs) = mounts
            .lines()
            .map(|l| l.split_whitespace().collect::<Vec<_>>())
            .find(|f| f.len() > 2 && f[2] == "tmpfs")
            .map(|f| f[1].to_string())
        else {
            return eprintln!("SKIPPED: no tmpfs mounted here");
        };
        let error = refuse_memory_backed(Path::new(&tmpfs)).expect_err(&tmpfs);
        assert!(error.to_string().contains("tmpfs"), "{error}");
    }

    /// On this process: its binary's code, and a file mapped from a directory given as the
    /// compiled guests', are resident before, and much less of them after.
    #[test]
    fn pages_out_this_test_binarys_code_and_a_mapped_guest() {
        use std::io::Write as _;
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("guest.cwasm");
        let mut file = std::fs::OpenOptions::new().read(true).write(true).create_new(true).open(&path).unwrap();
        file.write_all(&vec![0x5a; 1 << 20]).unwrap();
        // Clean page cache, as the runtime leaves its compiled guests: dirty pages are kept.
        file.sync_all().unwrap();
        let len = 1 << 20;
        // SAFETY: a new read-only private mapping of a file this test owns, unmapped below.
        let guest = unsafe {
            libc::mmap(
                std::ptr::null_mut(),
                len,
                libc::PROT_READ,
                libc::MAP_PRIVATE,
                std::os::fd::AsRawFd::as_raw_fd(&file),
                0,
            )
        };
        assert_ne!(guest, libc::MAP_FAILED);
        // SAFETY: reads within the mapping just made.
        let sum: u64 = (0..len).step_by(4096).map(|at| u64::from(unsafe { *(guest as *const u8).add(at) })).sum();
        assert_eq!(sum, 0x5a * 256);
        let resident = |mappings: Vec<FileMapping>| {
            mappings.iter().filter(|m| m.reclaimable()).map(|m| m.resident_kib).sum::<u64>()
        };
        let (binary_before, guest_before) =
            (resident(binary_mappings("self").unwrap()), resident(mappings_under("self", dir.path()).unwrap()));
        let paged = match page_out_code(Some(dir.path())) {
            Err(e) if e.raw_os_error() == Some(libc::EINVAL) => {
                eprintln!("SKIPPED: this kernel has no MADV_PAGEOUT (Linux < 5.4)");
                return;
            }
            other => other.unwrap(),
        };
        let (binary_after, guest_after) =
            (resident(binary_mappings("self").unwrap()), resident(mappings_under("self", dir.path()).unwrap()));
        // One byte read again brings back its page, not the 64 KiB or more that read-around and
        // fault-around would map. (Evicted from the page cache first: MADV_PAGEOUT may leave a
        // large folio cached, and fault-around maps what is cached whatever the advice.)
        // SAFETY: advice on a file this test owns.
        assert_eq!(
            unsafe { libc::posix_fadvise(std::os::fd::AsRawFd::as_raw_fd(&file), 0, 0, libc::POSIX_FADV_DONTNEED) },
            0
        );
        // SAFETY: a read within the mapping.
        assert_eq!(unsafe { std::ptr::read_volatile((guest as *const u8).add(len / 2)) }, 0x5a);
        let guest_touched = resident(mappings_under("self", dir.path()).unwrap());
        // SAFETY: the mapping made above, no longer read.
        unsafe { libc::munmap(guest, len) };
        // libc is mapped read-only too: what the kernel reclaims of it is only what no other
        // process maps, so only the advice is checked here.
        assert!(
            paged.mappings >= 3 && paged.binary_kib > 0 && paged.guests_kib == guest_before && paged.libraries_kib > 0,
            "{paged:?}"
        );
        assert!(
            binary_before > 0 && binary_after < binary_before / 2,
            "resident code and read-only data: {binary_before} KiB before, {binary_after} KiB after"
        );
        assert!(
            guest_before == 1024 && guest_after < guest_before / 2,
            "the mapped guest: {guest_before} KiB before, {guest_after} KiB after"
        );
        assert!(
            guest_touched <= guest_after + 16,
            "one page read after the page-out: {guest_after} KiB resident before it, {guest_touched} KiB after"
        );
    }
}
