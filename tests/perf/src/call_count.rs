//! Which of a list of functions a running process calls, counted by the kernel: one uprobe on
//! each function's first instruction, hits read from tracefs' `uprobe_profile`.
//!
//! The page trace (`symbol_order`) names every function on a code page the host touched, so
//! start-up code laid out among the code the host runs after its initial sync stays among it:
//! traced again, the two share pages, and the layout never sheds it. Counting calls tells them
//! apart at function granularity. A probe costs a trap per call (microseconds), so only the
//! candidates from the page trace are probed, only once the host is past its start-up, and
//! each is switched off once it has been hit (polled): with probes left on, the C library's
//! malloc and memcpy among them, the traced host had not finished after 15 minutes
//! (BENCHMARKS.md, twentieth and twenty-first runs).

use std::collections::{HashMap, HashSet};
use std::io::Write as _;
use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::Duration;

use anyhow::Context as _;
use object::{Object as _, ObjectSegment as _, ObjectSymbol as _};

/// The probes' event group in tracefs.
const GROUP: &str = "wasmplane_perf";

/// How often the hit probes are looked for and switched off.
const POLL_INTERVAL: Duration = Duration::from_millis(50);

fn tracefs() -> anyhow::Result<PathBuf> {
    ["/sys/kernel/tracing", "/sys/kernel/debug/tracing"]
        .into_iter()
        .map(PathBuf::from)
        .find(|p| p.join("uprobe_events").exists())
        .context("no tracefs with uprobe_events (mount tracefs; a kernel with CONFIG_UPROBE_EVENTS)")
}

/// tracefs, mounted at `/sys/kernel/tracing` first when no tracefs is (root): a fresh machine
/// may have none mounted, and the order-file trace finds out only in its last run.
pub fn mount_tracefs() -> anyhow::Result<PathBuf> {
    if let Ok(path) = tracefs() {
        return Ok(path);
    }
    crate::worker::run(&["mount", "-t", "tracefs", "nodev", "/sys/kernel/tracing"]).context("mounting tracefs")?;
    tracefs()
}

/// Where the byte at virtual address `address` is in the file, from the loadable segments'
/// (virtual address, size, file offset).
fn file_offset(segments: &[(u64, u64, u64)], address: u64) -> Option<u64> {
    segments
        .iter()
        .find(|(start, size, _)| (*start..start + size).contains(&address))
        .map(|(start, _, offset)| address - start + offset)
}

/// `uprobe_profile`'s lines (`  FILE  EVENT  HITS`, the event without its group) as hits by
/// event.
fn hits_by_event(profile: &str) -> HashMap<&str, u64> {
    profile
        .lines()
        .filter_map(|line| {
            let mut words = line.split_whitespace();
            let (_file, event, hits) = (words.next()?, words.next()?, words.next()?);
            Some((event, hits.parse().ok()?))
        })
        .collect()
}

/// Probes on the candidates in one process's binary: each enabled from creation until its
/// first hit (or until the calls are counted), all removed when dropped.
pub struct CallCounter {
    tracefs: PathBuf,
    /// Event name → function.
    probes: Vec<(String, String)>,
    /// Candidates that could not be probed (not in the symbol table, or an entry the kernel
    /// refuses): counted as called, so that nothing the host runs is dropped.
    unprobed: Vec<String>,
    /// Switches probes off at their first hit until it is stopped; returns the hit events.
    poller: Option<Poller>,
}

struct Poller {
    stop: Arc<AtomicBool>,
    thread: std::thread::JoinHandle<anyhow::Result<HashSet<String>>>,
}

impl Poller {
    fn start(tracefs: PathBuf, events: Vec<String>) -> Poller {
        let stop = Arc::new(AtomicBool::new(false));
        let stopped = stop.clone();
        let thread = std::thread::spawn(move || switch_off_when_hit(&tracefs, events, &stopped));
        Poller { stop, thread }
    }

    /// The events hit until now.
    fn finish(self) -> anyhow::Result<HashSet<String>> {
        self.stop.store(true, Ordering::Relaxed);
        self.thread.join().map_err(|_| anyhow::anyhow!("the probe poller panicked"))?
    }
}

/// Every `POLL_INTERVAL` until `stop`, and once more after it, switches off the probes among
/// `events` that have been hit; returns those.
fn switch_off_when_hit(tracefs: &Path, events: Vec<String>, stop: &AtomicBool) -> anyhow::Result<HashSet<String>> {
    let events_dir = tracefs.join("events").join(GROUP);
    let mut armed: HashSet<String> = events.into_iter().collect();
    let mut hit = HashSet::new();
    loop {
        let stopping = stop.load(Ordering::Relaxed);
        let profile = std::fs::read_to_string(tracefs.join("uprobe_profile"))?;
        let hits = hits_by_event(&profile);
        let newly: Vec<String> =
            armed.iter().filter(|event| hits.get(event.as_str()).is_some_and(|h| *h > 0)).cloned().collect();
        for event in newly {
            std::fs::write(events_dir.join(&event).join("enable"), "0")
                .with_context(|| format!("switching off {event}"))?;
            armed.remove(&event);
            hit.insert(event);
        }
        if stopping {
            return Ok(hit);
        }
        std::thread::sleep(POLL_INTERVAL);
    }
}

impl CallCounter {
    /// Probes `candidates` (mangled names) in the binary process `pid` runs.
    pub fn start(pid: &str, candidates: &[String]) -> anyhow::Result<CallCounter> {
        let tracefs = tracefs()?;
        let binary = std::fs::read_link(format!("/proc/{pid}/exe"))?;
        let data = std::fs::read(&binary).with_context(|| format!("reading {}", binary.display()))?;
        let elf = object::File::parse(&*data)?;
        let segments: Vec<(u64, u64, u64)> =
            elf.segments().map(|s| (s.address(), s.size(), s.file_range().0)).collect();
        let addresses: HashMap<&str, u64> = elf
            .symbols()
            .filter(|s| s.kind() == object::SymbolKind::Text)
            .filter_map(|s| Some((s.name().ok()?, s.address())))
            .collect();
        let mut counter = CallCounter { tracefs, probes: Vec::new(), unprobed: Vec::new(), poller: None };
        // One write per probe: the kernel takes a batch until its first bad line.
        let mut events = std::fs::OpenOptions::new().append(true).open(counter.tracefs.join("uprobe_events"))?;
        for name in candidates {
            if is_vector_string_function(name) {
                counter.unprobed.push(name.clone());
                continue;
            }
            let offset = addresses.get(name.as_str()).and_then(|a| file_offset(&segments, *a));
            // Unique to this process: probes a killed run left behind do not collide.
            let event = format!("p{}_{}", std::process::id(), counter.probes.len() + counter.unprobed.len());
            let added = offset.is_some_and(|offset| {
                events.write_all(format!("p:{GROUP}/{event} {}:{offset:#x}\n", binary.display()).as_bytes()).is_ok()
            });
            if added {
                counter.probes.push((event, name.clone()));
            } else {
                counter.unprobed.push(name.clone());
            }
        }
        // One by one: the kernel refuses some entries only when the probe is switched on
        // (ENOTSUPP for an instruction it cannot single-step out of line), and a refused one
        // would switch off the whole group.
        let events_dir = counter.tracefs.join("events").join(GROUP);
        let (enabled, refused): (Vec<_>, Vec<_>) = std::mem::take(&mut counter.probes)
            .into_iter()
            .partition(|(event, _)| std::fs::write(events_dir.join(event).join("enable"), "1").is_ok());
        counter.probes = enabled;
        remove_probes(&counter.tracefs, &refused)?;
        counter.unprobed.extend(refused.into_iter().map(|(_, name)| name));
        anyhow::ensure!(
            !counter.probes.is_empty(),
            "none of {} candidates could be probed in {}",
            candidates.len(),
            binary.display()
        );
        counter.poller = Some(Poller::start(
            counter.tracefs.clone(),
            counter.probes.iter().map(|(event, _)| event.clone()).collect(),
        ));
        Ok(counter)
    }

    /// How many candidates were probed, and how many could not be.
    pub fn probed(&self) -> (usize, usize) {
        (self.probes.len(), self.unprobed.len())
    }

    /// The candidates called since the probes went in, and those that could not be probed, in
    /// the candidates' order. Counting ends here.
    pub fn called(&mut self, candidates: &[String]) -> anyhow::Result<Vec<String>> {
        let hit = self.poller.take().context("calls were already counted")?.finish()?;
        let mut called: HashSet<&str> = self.unprobed.iter().map(String::as_str).collect();
        called.extend(self.probes.iter().filter(|(event, _)| hit.contains(event)).map(|(_, name)| name.as_str()));
        Ok(candidates.iter().filter(|name| called.contains(name.as_str())).cloned().collect())
    }
}

impl Drop for CallCounter {
    fn drop(&mut self) {
        if let Some(Err(e)) = self.poller.take().map(Poller::finish) {
            eprintln!("warning: switching off the call-counting probes as they were hit: {e:#}");
        }
        let events_dir = self.tracefs.join("events").join(GROUP);
        let removed = self
            .probes
            .iter()
            .try_for_each(|(event, _)| std::fs::write(events_dir.join(event).join("enable"), "0"))
            .and_then(|()| remove_probes(&self.tracefs, &self.probes));
        if let Err(e) = removed {
            eprintln!("warning: removing the call-counting probes ({GROUP} in uprobe_events): {e:#}");
        }
    }
}

/// Whether `name` is one of the C library's string and memory functions written in assembly
/// for one instruction set (`__memmove_avx_unaligned_erms`, `__strlen_evex`; one of each is
/// picked per CPU at start-up). They are left unprobed, so counted as called: everything calls
/// them, and in the one trace that probed them two threads of the host ended in endless
/// loops (in `HashMap::insert` and an iterator's fold) while no probe fired any more.
fn is_vector_string_function(name: &str) -> bool {
    ["_avx", "_evex", "_sse", "_erms"].iter().any(|isa| name.contains(isa))
}

/// Deletes probes (switched off) from `uprobe_events`.
fn remove_probes(tracefs: &Path, probes: &[(String, String)]) -> std::io::Result<()> {
    let mut events = std::fs::OpenOptions::new().append(true).open(tracefs.join("uprobe_events"))?;
    probes.iter().try_for_each(|(event, _)| events.write_all(format!("-:{GROUP}/{event}\n").as_bytes()))
}

/// The candidates' names, one per line.
pub fn read_list(path: &Path) -> anyhow::Result<Vec<String>> {
    Ok(std::fs::read_to_string(path)?
        .lines()
        .filter(|l| !l.is_empty() && !l.starts_with('#'))
        .map(str::to_string)
        .collect())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn vector_string_functions_are_not_probed() {
        for name in
            ["__memmove_avx_unaligned_erms", "__strlen_evex", "__strncmp_sse42", "__memset_avx512_unaligned_erms"]
        {
            assert!(is_vector_string_function(name), "{name}");
        }
        for name in [
            "malloc",
            "__vfscanf_internal",
            "getaddrinfo",
            "_RNvCs1234_9wasmplane4main",
            "_ZN4core3fmt5write17h0123456789abcdefE",
        ] {
            assert!(!is_vector_string_function(name), "{name}");
        }
    }

    #[test]
    fn addresses_map_to_their_segments_offset() {
        // The second segment is text mapped at 0x40e7c0 from file offset 0x40d7c0.
        let segments = [(0, 0x40d7b8, 0), (0x40e7c0, 0x105b8d0, 0x40d7c0)];
        assert_eq!(file_offset(&segments, 0x4adacb), Some(0x4acacb));
        assert_eq!(file_offset(&segments, 0x100), Some(0x100));
        assert_eq!(file_offset(&segments, 0x40e000), None, "between the segments");
    }

    #[test]
    fn reads_hits_by_event() {
        let profile = "  /tmp/wasmplane                                             f0                                                          3\n  /tmp/wasmplane f1 0\n  /usr/bin/x other 7\n";
        let hits = hits_by_event(profile);
        assert_eq!(hits.get("f0"), Some(&3));
        assert_eq!(hits.get("f1"), Some(&0));
        assert_eq!(hits.get("other"), Some(&7));
        assert_eq!(hits.len(), 3);
    }

    /// The kernel counts calls into this test binary's own function, and not into one it
    /// does not call, and the probe goes off at the first hit (root: tracefs).
    #[test]
    fn counts_the_calls_of_this_process() {
        if !crate::worker::is_root() || tracefs().is_err() {
            eprintln!("SKIPPED counts_the_calls_of_this_process: needs root and tracefs with uprobes");
            return;
        }
        #[inline(never)]
        #[unsafe(no_mangle)]
        extern "C" fn wasmplane_perf_probed_and_called(x: u64) -> u64 {
            std::hint::black_box(x.wrapping_mul(3))
        }
        #[inline(never)]
        #[unsafe(no_mangle)]
        extern "C" fn wasmplane_perf_probed_not_called(x: u64) -> u64 {
            std::hint::black_box(x.wrapping_mul(5))
        }
        let names = ["wasmplane_perf_probed_and_called", "wasmplane_perf_probed_not_called", "wasmplane_perf_missing"]
            .map(String::from)
            .to_vec();
        let mut counter = CallCounter::start(&std::process::id().to_string(), &names).unwrap();
        assert_eq!(counter.probed(), (2, 1));
        std::hint::black_box(wasmplane_perf_probed_and_called(std::hint::black_box(7)));
        // Referenced so that it is linked, never called.
        std::hint::black_box(wasmplane_perf_probed_not_called as extern "C" fn(u64) -> u64);

        let (event, _) =
            counter.probes.iter().find(|(_, name)| name == "wasmplane_perf_probed_and_called").unwrap().clone();
        let enable = counter.tracefs.join("events").join(GROUP).join(&event).join("enable");
        let deadline = std::time::Instant::now() + Duration::from_secs(10);
        while std::fs::read_to_string(&enable).unwrap().trim() != "0" {
            assert!(std::time::Instant::now() < deadline, "the hit probe is still on");
            std::thread::sleep(POLL_INTERVAL);
        }
        for x in 0..5 {
            std::hint::black_box(wasmplane_perf_probed_and_called(std::hint::black_box(x)));
        }
        let profile = std::fs::read_to_string(counter.tracefs.join("uprobe_profile")).unwrap();
        assert_eq!(hits_by_event(&profile).get(event.as_str()), Some(&1), "calls after the first are not trapped");

        let called = counter.called(&names).unwrap();
        assert_eq!(
            called,
            ["wasmplane_perf_probed_and_called", "wasmplane_perf_missing"],
            "the called one, and the one not probed"
        );
        assert!(counter.called(&names).is_err(), "counting ended");
    }
}
