//! Which functions the host really runs, as an lld symbol-ordering file (BENCHMARKS.md,
//! tenth run).
//!
//! The kernel maps the cached neighbours of every code page a process faults in
//! (fault-around), so code the host never runs, but which sits between code it does, is
//! resident too: at 10 services 10.9 MiB of the binary's 16.8 MiB of code, of which the host
//! touches 4.3. Linking with `-Wl,--symbol-ordering-file=FILE` places the functions named in
//! FILE first and together.
//!
//! The traced host runs from a private copy of its binary that no other process maps, so only
//! its own faults bring the copy's pages into the page cache: this harness's in-process
//! worker (its cluster and compiler processes run the original), or with `--binary` the
//! shipped `wasmplane` as a child (`crate::binary`, which compiles the guests with the
//! original first). The copy lives on a small ext4 volume of its own (a loop
//! device) with read-ahead off: the exec's first faults would otherwise read megabytes
//! around each page, in large folios that cannot be dropped while code on them runs. First
//! thing, the in-process worker drops its code's page-table entries (`MADV_DONTNEED`) and the
//! copy's cached pages (`POSIX_FADV_DONTNEED`): from then on a code page is resident only if
//! the worker ran (or read) something on it (a child starts with nothing of the copy cached).
//! At the end, the functions on resident code pages are
//! the ones it ran, give or take their neighbours on the same 4 KiB page: with the shipped
//! binary, `call_count` then tells which of them the host called (BENCHMARKS.md, eighteenth
//! run: 1,316 of 5,330).

use std::io::{Read as _, Seek as _, SeekFrom};
use std::os::fd::AsRawFd as _;
use std::path::Path;

use anyhow::Context as _;
use object::{Object as _, ObjectSection as _, ObjectSegment as _, ObjectSymbol as _};
use wasmplane::memory::FileMapping;

/// An ext4 image mounted on a loop device with read-ahead off; unmounted (and the device
/// freed) on drop.
pub struct PrivateVolume {
    mount_point: std::path::PathBuf,
    _dir: tempfile::TempDir,
}

impl PrivateVolume {
    pub fn new(bytes: u64) -> anyhow::Result<PrivateVolume> {
        use crate::worker::run;
        let dir = tempfile::tempdir()?;
        let image = dir.path().join("image");
        let mount_point = dir.path().join("mnt");
        std::fs::create_dir(&mount_point)?;
        std::fs::File::create(&image)?.set_len(bytes)?;
        let (image_arg, mount_arg) =
            (image.to_str().context("temp path")?.to_string(), mount_point.to_str().context("temp path")?.to_string());
        run(&["mkfs.ext4", "-q", &image_arg])?;
        run(&["mount", "-o", "loop", &image_arg, &mount_arg])?;
        let volume = PrivateVolume { mount_point, _dir: dir };
        let device = run(&["findmnt", "-n", "-o", "SOURCE", &mount_arg])?;
        let device = device.trim().strip_prefix("/dev/").context("a loop device")?;
        std::fs::write(format!("/sys/block/{device}/queue/read_ahead_kb"), "0")?;
        Ok(volume)
    }

    pub fn path(&self) -> &Path {
        &self.mount_point
    }
}

impl Drop for PrivateVolume {
    fn drop(&mut self) {
        // `mount -o loop` set the device to free itself on unmount.
        if let Err(e) = crate::worker::run(&["umount", self.mount_point.to_str().unwrap_or_default()]) {
            eprintln!("warning: unmounting {}: {e:#}", self.mount_point.display());
        }
    }
}

/// The executable mapping of a process's binary (`process`: `self` or a process ID).
fn code_mapping(process: &str) -> anyhow::Result<FileMapping> {
    let mappings = wasmplane::memory::binary_mappings(process)?;
    mappings
        .into_iter()
        .find(|m| m.executable)
        .with_context(|| format!("no executable mapping of its binary in /proc/{process}/smaps"))
}

fn page_size() -> u64 {
    // SAFETY: sysconf only reads a system constant.
    (unsafe { libc::sysconf(libc::_SC_PAGESIZE) }) as u64
}

/// The first line of an order file: the compiler that built the traced binary (from its
/// `.comment` section) and this checkout's `Cargo.lock`, which name the hashes in its mangled
/// names. The release build compares it with its own and warns when they differ
/// (`host/build.rs`); lld reads a line from `#` on as a comment.
pub fn provenance(binary: &Path) -> anyhow::Result<String> {
    let data = std::fs::read(binary)?;
    provenance_of(&object::File::parse(&*data)?)
}

fn provenance_of(elf: &object::File) -> anyhow::Result<String> {
    let comment = elf.section_by_name(".comment").context("no .comment section")?.data()?;
    let rustc = comment
        .split(|b| *b == 0)
        .filter_map(|s| std::str::from_utf8(s).ok())
        .find_map(|s| s.strip_prefix("rustc version "))
        .context("no rustc version in the .comment section")?;
    let lock = std::fs::read(concat!(env!("CARGO_MANIFEST_DIR"), "/../../Cargo.lock"))?;
    Ok(format!("# traced from a build by rustc {rustc} of Cargo.lock {:016x} (FNV-1a)\n", fnv1a(&lock)))
}

/// This checkout's order file, which `host/build.rs` links the release `wasmplane` with.
pub const CHECKOUT_ORDER_FILE: &str = concat!(env!("CARGO_MANIFEST_DIR"), "/../../host/symbol-order.txt");

/// Why memory measured on `binary` may not be what the order file `order` gives: it was
/// traced from another build than the one `binary`'s compiler makes of this lockfile, so
/// functions whose mangled names changed are not laid out first (BENCHMARKS.md,
/// twenty-seventh run: 0.28 MiB at 1k services); or, from the same lockfile, before the code
/// changed: more than [`STALE_NAMES_PERCENT`] of its names are not in `binary` (forty-third
/// run: resident code 1.8 → 2.7 MiB, RSS 9.08 → 9.86 MiB, with no other sign). The build
/// warns of the first too, where it is easily missed.
pub fn stale_order(binary: &Path, order: &Path) -> anyhow::Result<Option<String>> {
    let data = std::fs::read(binary).with_context(|| format!("reading {}", binary.display()))?;
    let elf = object::File::parse(&*data)?;
    let this_build = provenance_of(&elf)?;
    let text = std::fs::read_to_string(order).with_context(|| format!("reading {}", order.display()))?;
    let traced = text.lines().next().unwrap_or_default();
    if traced != this_build.trim_end() {
        return Ok(Some(format!(
            "{} is from another build ({traced:?}; {} would be traced as {:?}): the binary is laid out less well than it can be, and its memory is not the figure to compare (BENCHMARKS.md, \"Reproducing\")",
            order.display(),
            binary.display(),
            this_build.trim_end()
        )));
    }
    let (missing, total) = names_missing_from(&elf, &text);
    Ok((missing * 100 > total * STALE_NAMES_PERCENT).then(|| {
        format!(
            "{missing} of the {total} functions {} names are not in {}: the code changed since it was traced, so the functions it runs now are not all laid out first, and its memory is not the figure to compare (trace it again: BENCHMARKS.md, \"Reproducing\")",
            order.display(),
            binary.display()
        )
    }))
}

/// How many of an order file's names may be missing from the binary before it counts as
/// stale: a trace names a few functions that a later build of the same code inlines.
pub const STALE_NAMES_PERCENT: usize = 2;

/// How many of the names in an order file's text (after its provenance line) the binary's
/// symbol table lacks, of how many.
fn names_missing_from(elf: &object::File, order: &str) -> (usize, usize) {
    let present: std::collections::HashSet<&str> = elf.symbols().filter_map(|s| s.name().ok()).collect();
    let names: Vec<&str> = order.lines().filter(|l| !l.starts_with('#') && !l.is_empty()).collect();
    (names.iter().filter(|n| !present.contains(*n)).count(), names.len())
}

/// 64-bit FNV-1a: stable across toolchains, unlike std's `DefaultHasher` (`host/build.rs`
/// computes the same).
pub(crate) fn fnv1a(bytes: &[u8]) -> u64 {
    bytes.iter().fold(0xcbf2_9ce4_8422_2325, |hash, byte| (hash ^ u64::from(*byte)).wrapping_mul(0x0100_0000_01b3))
}

/// Makes code pages resident only when they are used, from now on. Call first thing.
pub fn start_tracing() -> anyhow::Result<()> {
    let code = code_mapping("self")?;
    let (addr, len) = (code.start as *mut libc::c_void, code.len);
    // SAFETY: advice on this process's own code, a clean private file mapping: MADV_DONTNEED
    // only drops its page-table entries, and the next instruction fetch faults each page back
    // in from the file.
    unsafe {
        anyhow::ensure!(
            libc::madvise(addr, len, libc::MADV_DONTNEED) == 0,
            "madvise(MADV_DONTNEED): {}",
            std::io::Error::last_os_error()
        );
    }
    drop_cached_pages(Path::new("/proc/self/exe"))
}

/// Drops a file's clean pages that no process maps from the page cache.
pub fn drop_cached_pages(path: &Path) -> anyhow::Result<()> {
    let file = std::fs::File::open(path)?;
    // SAFETY: advice on an open file descriptor.
    let rc = unsafe { libc::posix_fadvise(file.as_raw_fd(), 0, 0, libc::POSIX_FADV_DONTNEED) };
    anyhow::ensure!(
        rc == 0,
        "posix_fadvise(POSIX_FADV_DONTNEED) on {}: {}",
        path.display(),
        std::io::Error::from_raw_os_error(rc)
    );
    Ok(())
}

/// The mangled names of the functions on a process's resident code pages (`process`: `self`
/// or a process ID, which needs root), in address order, and how many bytes of code pages
/// were resident. Reads the binary last, so that reading it cannot make pages resident first.
fn touched_functions(process: &str) -> anyhow::Result<(Vec<String>, u64)> {
    let code = code_mapping(process)?;
    let page = page_size();
    let pages = code.len / page as usize;
    let mut entries = vec![0u8; pages * 8];
    let mut pagemap = std::fs::File::open(format!("/proc/{process}/pagemap"))?;
    pagemap.seek(SeekFrom::Start(code.start as u64 / page * 8))?;
    pagemap.read_exact(&mut entries)?;
    // Bit 63 of an entry: the page is present.
    let resident: Vec<u64> = entries
        .chunks_exact(8)
        .enumerate()
        .filter(|(_, e)| u64::from_le_bytes((*e).try_into().unwrap()) >> 63 == 1)
        .map(|(i, _)| i as u64 * page)
        .collect();

    let data = std::fs::read(format!("/proc/{process}/exe"))?;
    let elf = object::File::parse(&*data)?;
    // The mapping starts at the executable segment's page-aligned virtual address.
    let text = elf
        .segments()
        .find(|s| matches!(s.flags(), object::SegmentFlags::Elf { p_flags } if p_flags & object::elf::PF_X != 0))
        .context("no executable segment")?;
    let first = text.address() & !(page - 1);
    let pages_vaddr: Vec<u64> = resident.iter().map(|offset| first + offset).collect();
    let mut symbols: Vec<(u64, u64, &str)> = elf
        .symbols()
        .filter(|s| s.kind() == object::SymbolKind::Text && s.size() > 0)
        .filter_map(|s| Some((s.address(), s.size(), s.name().ok()?)))
        .collect();
    let names = functions_on_pages(&mut symbols, &pages_vaddr, page).into_iter().map(str::to_string).collect();
    Ok((names, resident.len() as u64 * page))
}

/// Writes the functions on a process's resident code pages to `path` (one mangled name a
/// line) and adds how many, and on how much code, to a worker's `result`.
pub fn write_trace(process: &str, path: &Path, result: &mut serde_json::Value) -> anyhow::Result<()> {
    let (functions, resident_bytes) = touched_functions(process)?;
    std::fs::write(path, functions.iter().map(|f| format!("{f}\n")).collect::<String>())?;
    result["traced_code_kib"] = (resident_bytes / 1024).into();
    result["traced_functions"] = functions.len().into();
    Ok(())
}

/// An order file's names: those in `after_start_up` (one per line), then those only in
/// `in_all`, each once.
pub fn steady_first(after_start_up: &str, in_all: &str) -> String {
    let mut seen = std::collections::HashSet::new();
    after_start_up
        .lines()
        .chain(in_all.lines())
        .filter(|name| !name.is_empty() && seen.insert(*name))
        .map(|name| format!("{name}\n"))
        .collect()
}

/// Functions (address, size, name) with a byte on any of the pages (start addresses), each
/// once, in address order.
fn functions_on_pages<'a>(symbols: &mut [(u64, u64, &'a str)], pages: &[u64], page: u64) -> Vec<&'a str> {
    symbols.sort_unstable();
    let mut chosen = std::collections::BTreeSet::new();
    for &start in pages {
        // Functions do not overlap: walk back from the last one that starts on the page
        // until one ends before it.
        let mut i = symbols.partition_point(|s| s.0 < start + page);
        while i > 0 && symbols[i - 1].0 + symbols[i - 1].1 > start {
            chosen.insert(i - 1);
            i -= 1;
        }
    }
    chosen.into_iter().map(|i| symbols[i].2).collect()
}

#[cfg(test)]
mod tests {
    /// The published FNV-1a 64 test vectors: `host/build.rs` must compute the same.
    #[test]
    fn fnv1a_is_the_standard_one() {
        assert_eq!(super::fnv1a(b""), 0xcbf2_9ce4_8422_2325);
        assert_eq!(super::fnv1a(b"a"), 0xaf63_dc4c_8601_ec8c);
        assert_eq!(super::fnv1a(b"foobar"), 0x8594_4171_f739_67e8);
    }

    /// The check of an order file against a binary: this test's own executable, built by
    /// rustc, with this checkout's lockfile.
    #[test]
    fn an_order_file_from_another_build_is_reported() {
        let exe = std::env::current_exe().unwrap();
        let dir = tempfile::tempdir().unwrap();
        let order = dir.path().join("order.txt");
        let this_build = super::provenance(&exe).unwrap();
        std::fs::write(&order, format!("{this_build}main\n")).unwrap();
        assert_eq!(super::stale_order(&exe, &order).unwrap(), None);

        let other = this_build.replace("of Cargo.lock ", "of Cargo.lock 0");
        std::fs::write(&order, format!("{other}main\n")).unwrap();
        let warning = super::stale_order(&exe, &order).unwrap().expect("another lockfile's order file is reported");
        assert!(warning.contains(this_build.trim_end()), "{warning}");
        std::fs::write(&order, "main\n").unwrap();
        assert!(super::stale_order(&exe, &order).unwrap().is_some(), "an order file without provenance");
    }

    /// Of the same build, but naming functions the binary no longer has: stale past the
    /// threshold, not within it.
    #[test]
    fn an_order_file_of_changed_code_is_reported() {
        let exe = std::env::current_exe().unwrap();
        let dir = tempfile::tempdir().unwrap();
        let order = dir.path().join("order.txt");
        let this_build = super::provenance(&exe).unwrap();
        let names = |gone: usize| {
            let kept = std::iter::repeat_n("main", 100 - gone);
            let gone = (0..gone).map(|i| format!("_RNvCs0_9vanished{i}"));
            kept.map(str::to_string).chain(gone).collect::<Vec<_>>().join("\n")
        };
        std::fs::write(&order, format!("{this_build}{}\n", names(super::STALE_NAMES_PERCENT))).unwrap();
        assert_eq!(super::stale_order(&exe, &order).unwrap(), None);
        std::fs::write(&order, format!("{this_build}{}\n", names(10))).unwrap();
        let warning = super::stale_order(&exe, &order).unwrap().expect("an order file of other code is reported");
        assert!(warning.starts_with("10 of the 100 functions"), "{warning}");
    }

    #[test]
    fn steady_code_goes_first_and_every_name_once() {
        assert_eq!(super::steady_first("watch\napply\n", "main\nwatch\nlist\napply\n"), "watch\napply\nmain\nlist\n");
    }

    #[test]
    fn functions_on_pages_are_those_with_a_byte_there() {
        let mut symbols = vec![(5000, 3200, "c"), (0, 100, "a"), (100, 4900, "b"), (8200, 100, "d"), (12288, 50, "e")];
        assert_eq!(super::functions_on_pages(&mut symbols, &[0], 4096), ["a", "b"]);
        // b reaches into the second page; c starts on it and ends on the third.
        assert_eq!(super::functions_on_pages(&mut symbols, &[4096], 4096), ["b", "c"]);
        assert_eq!(super::functions_on_pages(&mut symbols, &[8192], 4096), ["c", "d"]);
        // Nothing on the fourth page but e at its start; nothing at all past it.
        assert_eq!(super::functions_on_pages(&mut symbols, &[12288, 16384], 4096), ["e"]);
        assert_eq!(super::functions_on_pages(&mut symbols, &[8192, 0], 4096), ["a", "b", "c", "d"]);
    }
}
