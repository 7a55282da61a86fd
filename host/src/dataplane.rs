//! The service dataplane writer: what is applied per object, and how changes reach the
//! kernel (or, in recording mode, a buffer) as one transaction per sync.
//!
//! Kernels: [`NftCommand`] (`nft -f` text), [`NetlinkNft`] (incremental transactions as
//! netlink batches, the rest through `nft -f`; the host's default) and [`Recorder`]. Why
//! both: see the measurements at the top of `nft.rs` (`benches/nft_writer.rs`). In short:
//! full syncs are kernel-bound and cost the same as one plain `nft -f`; incremental changes
//! through `nft -f` pay for nft's cache fill (a dump of every chain), 5.8 s at 50k services.
//!
//! UDP/SCTP conntrack cleanup (kube-proxy's): after a transaction that took DNAT targets away
//! from a service address or node port, the conntrack entries of flows DNATed to them are
//! deleted, so long-lived clients move on at once (see [`nft::conntrack_cleanup`]). Through
//! Debian's `conntrack` tool, not a netlink crate: kube-proxy ran exactly that for years, it
//! runs in the node's network namespace the same way `nft` does (a command prefix), and the
//! Rust ctnetlink crates here are either dump-only (`conntrack`) or too young to rely on
//! (`netlink-packet-netfilter` gained deletes in late 2025). Cleanups are rare (an endpoint
//! of a UDP service goes) and cost one short process each.
//!
//! Costs this module keeps proportional to the change: an incremental sync edits the applied
//! map and the map-key owner index in place (no copy of the table per sync), and a full sync
//! finds stale chains with hashed lookups (a scan per listed chain took 60 s at 10k).

use std::collections::{BTreeMap, BTreeSet, HashMap, HashSet};
use std::io::Write as _;
use std::net::IpAddr;
use std::process::{Command, Stdio};
use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::{Duration, SystemTime};

use wasmplane_model::ObjectKey;

use crate::nft::{self, ConntrackFilter, Layout, ObjectRules, Table};

mod owners;
use owners::{ElementOwners, Objects};

#[derive(Debug, thiserror::Error)]
pub enum WriteError {
    #[error("running nft: {0}")]
    Spawn(std::io::Error),
    #[error("the kernel rejected the transaction: {0}")]
    Rejected(String),
    #[error("nf_tables netlink socket: {0}")]
    Netlink(std::io::Error),
    #[error("conntrack {args}: {reason}")]
    Conntrack { args: String, reason: String },
    #[error("reading the node's interface addresses: {0}")]
    Addresses(std::io::Error),
}

/// Runs `f` in network namespace `netns` (a `/run/netns/NAME` path; `None`: this process's),
/// on a thread that enters it and then ends, so no other work runs there. What `f` opens
/// (a socket) stays in that namespace.
pub(crate) fn in_netns<T: Send>(
    netns: Option<&std::path::Path>,
    f: impl FnOnce() -> std::io::Result<T> + Send,
) -> std::io::Result<T> {
    let Some(path) = netns else { return f() };
    let file = std::fs::File::open(path)?;
    std::thread::scope(|scope| {
        scope
            .spawn(|| {
                use std::os::fd::AsRawFd as _;
                // SAFETY: setns on this thread only, with a valid namespace fd.
                if unsafe { libc::setns(file.as_raw_fd(), libc::CLONE_NEWNET) } != 0 {
                    return Err(std::io::Error::last_os_error());
                }
                f()
            })
            .join()
            .unwrap_or_else(|_| Err(std::io::Error::other("namespace thread panicked")))
    })
}

/// Calls `changed` whenever an interface address of network namespace `netns` (`None`:
/// this process's) comes or goes (rtnetlink's address groups; also after the kernel dropped
/// such messages), on a thread of its own, until `changed` returns false.
pub fn watch_interface_addresses(
    netns: Option<&std::path::Path>,
    mut changed: impl FnMut() -> bool + Send + 'static,
) -> std::io::Result<()> {
    let socket = in_netns(netns, || {
        let mut socket = netlink_sys::Socket::new(netlink_sys::protocols::NETLINK_ROUTE)?;
        socket.bind_auto()?;
        socket.add_membership(libc::RTNLGRP_IPV4_IFADDR)?;
        socket.add_membership(libc::RTNLGRP_IPV6_IFADDR)?;
        Ok(socket)
    })?;
    std::thread::Builder::new().name("wp-addresses".into()).spawn(move || {
        let mut buf = vec![0u8; 64 << 10];
        loop {
            match socket.recv(&mut &mut buf[..], 0) {
                // What changed is not read: the interfaces' addresses are read again whole.
                Ok(_) => {}
                Err(e) if e.raw_os_error() == Some(libc::ENOBUFS) => {}
                Err(e) => {
                    tracing::warn!("watching the node's interface addresses stopped: {e}");
                    return;
                }
            }
            if !changed() {
                return;
            }
        }
    })?;
    Ok(())
}

/// The addresses of the interfaces of network namespace `netns` (`None`: this process's).
fn interface_addresses(netns: Option<&std::path::Path>) -> std::io::Result<Vec<IpAddr>> {
    in_netns(netns, || {
        let addresses = nix::ifaddrs::getifaddrs().map_err(std::io::Error::from)?;
        Ok(addresses
            .filter_map(|a| a.address)
            .filter_map(|a| {
                a.as_sockaddr_in()
                    .map(|v4| IpAddr::V4(v4.ip()))
                    .or_else(|| a.as_sockaddr_in6().map(|v6| IpAddr::V6(v6.ip())))
            })
            .collect())
    })
}

/// Where transactions go.
pub trait Kernel: Send {
    fn apply(&mut self, transaction: &str) -> Result<(), WriteError>;
    /// Deletes the conntrack entries each filter matches; returns how many went.
    fn clear_conntrack(&mut self, filters: &[ConntrackFilter]) -> Result<usize, WriteError>;
    /// Our tables, chains and sets currently in the kernel (for reconciliation).
    fn list_objects(&mut self) -> Result<Listing, WriteError>;
    /// The main table (network policy, the shared service checks) as `nft list table`
    /// prints it (rules with their counters); empty where there is no kernel. Slow at
    /// scale: on demand only.
    fn list_table(&mut self) -> Result<String, WriteError> {
        Ok(String::new())
    }
    /// Chains of the main table as `nft list chain` prints them, one after the other (what
    /// a pod's counters need, without listing every rule of the table); `None` where there
    /// is no kernel. A chain that is not there is an error.
    fn list_chains(&mut self, _chains: &[String]) -> Result<Option<String>, WriteError> {
        Ok(None)
    }
    /// Whether our table is already in the kernel (rules of a previous run).
    fn has_table(&mut self) -> bool {
        false
    }
    /// Called after a full transaction went in: a commit that changes nothing, so that the
    /// next change does not pay for the full one. Why: a commit updates the rule-generation
    /// pointers of every chain the commit before it changed (`nf_tables_commit_chain`), so
    /// the first commit after a full load touches every chain; at 50k services that made
    /// the first change 3× the others. Best effort: the caller only logs a failure.
    fn settle(&mut self) -> Result<(), WriteError> {
        Ok(())
    }
    /// The addresses of the node's interfaces, where this kernel writes (for
    /// `--nodeport-addresses` networks). None known: no interface.
    fn local_addresses(&mut self) -> Result<Vec<IpAddr>, WriteError> {
        Ok(Vec::new())
    }

    fn mode(&self) -> &'static str;
    /// How the last transaction went to the kernel: `netlink`, `nft` (a `nft -f` process)
    /// or `record`.
    fn last_path(&self) -> &'static str {
        self.mode()
    }
}

/// Deletes every table of ours, in one transaction (`wasmplane cleanup`, kube-proxy's
/// `--cleanup`): services, policy and host ports go at once. Returns the tables deleted.
pub fn remove_tables(kernel: &mut dyn Kernel) -> Result<Vec<Table>, WriteError> {
    let tables = kernel.list_objects()?.tables;
    if !tables.is_empty() {
        let transaction: String = tables.iter().map(|table| format!("delete table {table}\n")).collect();
        kernel.apply(&transaction)?;
    }
    Ok(tables)
}

/// What of ours is in the kernel: tables, and chains and sets by table.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct Listing {
    pub tables: Vec<Table>,
    pub chains: Vec<TableObject>,
    pub sets: Vec<TableObject>,
}

/// A chain or set by its table and name.
pub type TableObject = (Table, String);

/// Recording mode: renders what would be applied, for hosts without privileges.
#[derive(Default)]
pub struct Recorder {
    pub transactions: Vec<String>,
    /// Conntrack deletions that would run, as `conntrack` arguments.
    pub conntrack_deletions: Vec<String>,
}

/// Only the recent past is interesting; keep memory bounded: at most 64 entries and
/// [`KEPT_TEXT_BYTES`] of them (a full transaction is ~80 MB at 50k services).
fn push_bounded(log: &mut Vec<String>, entry: String) {
    log.push(kept_text(entry, KEPT_TEXT_BYTES));
    let mut total: usize = log.iter().map(String::len).sum();
    while log.len() > 64 || (total > KEPT_TEXT_BYTES && log.len() > 1) {
        total -= log.remove(0).len();
    }
}

/// How much transaction text a recording keeps (what it is for).
const KEPT_TEXT_BYTES: usize = 4 << 20;

/// How much of the last transaction a live writer keeps, for inspection and errors: the
/// whole of an incremental one. At 4 MiB it was the largest single allocation of a host at
/// 10k services, kept for the life of the process.
const LAST_TRANSACTION_BYTES: usize = 64 << 10;

/// `text`, or its beginning and how much was left out when it is longer than `limit`.
fn kept_text(mut text: String, limit: usize) -> String {
    if text.len() > limit {
        let cut = text.floor_char_boundary(limit);
        let left_out = text.len() - cut;
        text.truncate(cut);
        text.push_str(&format!("\n# … {left_out} more bytes not kept\n"));
        text.shrink_to_fit();
    }
    text
}

impl Kernel for Recorder {
    fn apply(&mut self, transaction: &str) -> Result<(), WriteError> {
        push_bounded(&mut self.transactions, transaction.to_string());
        Ok(())
    }
    fn clear_conntrack(&mut self, filters: &[ConntrackFilter]) -> Result<usize, WriteError> {
        for f in filters {
            push_bounded(&mut self.conntrack_deletions, f.args().join(" "));
        }
        Ok(0)
    }
    fn list_objects(&mut self) -> Result<Listing, WriteError> {
        Ok(Listing::default())
    }
    fn mode(&self) -> &'static str {
        "record"
    }
}

/// Writes through `nft -f -` (see `nft.rs` for why text), cleans conntrack through
/// `conntrack -D`.
pub struct NftCommand {
    /// The command that runs nft, e.g. `["nft"]` or `["ip", "netns", "exec", "node", "nft"]`.
    pub command: Vec<String>,
    /// The command that runs conntrack, in the same network namespace as `command`.
    pub conntrack: Vec<String>,
}

impl NftCommand {
    /// `conntrack` empty: the nft command with `conntrack` as its program, so that both run
    /// in the same network namespace (`ip netns exec node nft` → `ip netns exec node conntrack`).
    pub fn new(command: Vec<String>, mut conntrack: Vec<String>) -> NftCommand {
        if conntrack.is_empty() {
            conntrack = command.clone();
            match conntrack.last_mut() {
                Some(program) if program.rsplit('/').next() == Some("nft") => *program = "conntrack".into(),
                _ => conntrack = vec!["conntrack".into()],
            }
        }
        NftCommand { command, conntrack }
    }

    fn nft(&self) -> Command {
        let mut cmd = Command::new(&self.command[0]);
        cmd.args(&self.command[1..]);
        cmd
    }

    /// The objects (lines starting with `kind`) inside our tables in a listing, and every
    /// table of ours the listing shows.
    fn list_ours(&self, args: &[&str], kind: &str) -> Result<(Vec<Table>, Vec<TableObject>), WriteError> {
        let output = self.nft().args(args).stderr(Stdio::piped()).output().map_err(WriteError::Spawn)?;
        if !output.status.success() {
            return Err(WriteError::Rejected(stderr_text(&output.stderr)));
        }
        let family = format!("{} ", nft::FAMILY);
        let mut current: Option<Table> = None;
        let (mut tables, mut names) = (Vec::new(), Vec::new());
        for line in String::from_utf8_lossy(&output.stdout).lines().map(str::trim) {
            if let Some(table) = line.strip_prefix("table ") {
                current = table.trim_end_matches(" {").strip_prefix(&family).and_then(Table::parse);
                tables.extend(current);
            } else if let Some(table) = current
                && let Some(rest) = line.strip_prefix(kind)
            {
                names.push((table, rest.trim_end_matches(" {").trim_matches('"').to_string()));
            }
        }
        Ok((tables, names))
    }
}

/// An nft command's error output, bounded.
fn stderr_text(stderr: &[u8]) -> String {
    String::from_utf8_lossy(stderr).chars().take(REJECTION_CHARS).collect()
}

const REJECTION_CHARS: usize = 4096;

/// nft's errors for `transaction`, each with the part of the statement it points at quoted
/// from the transaction. nft echoes at most ~1,000 characters of the statement, then a
/// caret line as long as the error's column: for one of a full transaction's grouped
/// element statements (thousands of elements a line) that is the statement's head and a
/// line of blanks, not the element the kernel refused.
fn describe_rejection(stderr: &str, transaction: &str) -> String {
    let mut described = Vec::new();
    let mut lines = stderr.lines().peekable();
    while let Some(line) = lines.next() {
        let Some((location, message)) = line.split_once(": Error: ") else {
            described.push(line.chars().take(300).collect::<String>());
            continue;
        };
        // `/dev/stdin:LINE:FIRST-LAST`: 1-based, the columns in bytes.
        let mut parts = location.rsplit(':');
        let columns = parts.next().unwrap_or_default();
        let statement =
            parts.next().and_then(|n| n.parse::<usize>().ok()).and_then(|n| transaction.lines().nth(n.checked_sub(1)?));
        let (first, last) = columns.split_once('-').unwrap_or((columns, columns));
        match (statement, first.parse::<usize>(), last.parse::<usize>()) {
            (Some(statement), Ok(first), Ok(last)) => {
                // The echoed statement and its caret line say nothing more.
                while lines.peek().is_some_and(|l| !l.contains("Error: ")) {
                    lines.next();
                }
                described.push(format!("{message}: {}", quote(statement, first.saturating_sub(1), last)));
            }
            _ => described.push(line.to_string()),
        }
    }
    described.join("\n").chars().take(REJECTION_CHARS).collect()
}

/// `statement` whole if short, else its head (up to its opening brace) and the element or
/// part at bytes `from..to`, up to the end of that element.
fn quote(statement: &str, from: usize, to: usize) -> String {
    const WHOLE: usize = 300;
    if statement.len() <= WHOLE {
        return statement.to_string();
    }
    let floor = |i: usize| statement.floor_char_boundary(i.min(statement.len()));
    let head = &statement[..floor(statement.find(" { ").map_or(80, |i| i + 3))];
    let (from, to) = (floor(from), floor(to));
    if to <= head.len() {
        return format!("{head}…");
    }
    let rest = &statement[to..];
    let end = floor(to + [", ", " }"].iter().filter_map(|sep| rest.find(sep)).min().unwrap_or(rest.len()).min(WHOLE));
    format!("{head}… {} …", &statement[from.max(head.len())..end])
}

impl Kernel for NftCommand {
    fn apply(&mut self, transaction: &str) -> Result<(), WriteError> {
        let mut child = self
            .nft()
            .args(["-f", "-"])
            .stdin(Stdio::piped())
            .stdout(Stdio::null())
            .stderr(Stdio::piped())
            .spawn()
            .map_err(WriteError::Spawn)?;
        child.stdin.take().expect("piped").write_all(transaction.as_bytes()).map_err(WriteError::Spawn)?;
        let output = child.wait_with_output().map_err(WriteError::Spawn)?;
        if output.status.success() {
            Ok(())
        } else {
            Err(WriteError::Rejected(describe_rejection(&String::from_utf8_lossy(&output.stderr), transaction)))
        }
    }

    fn clear_conntrack(&mut self, filters: &[ConntrackFilter]) -> Result<usize, WriteError> {
        let mut deleted = 0;
        for filter in filters {
            let args = filter.args();
            let failed = |reason: String| WriteError::Conntrack { args: args.join(" "), reason };
            let output = Command::new(&self.conntrack[0])
                .args(&self.conntrack[1..])
                .args(&args)
                .stdin(Stdio::null())
                .output()
                .map_err(|e| failed(e.to_string()))?;
            // "N flow entries have been deleted." on stderr; with N = 0 the exit status is 1.
            let stderr = String::from_utf8_lossy(&output.stderr);
            let count = stderr
                .split_once(" flow entries have been deleted")
                .and_then(|(before, _)| before.rsplit(' ').next()?.parse::<usize>().ok());
            match count {
                Some(n) => deleted += n,
                None => return Err(failed(stderr.chars().take(1024).collect())),
            }
        }
        Ok(deleted)
    }

    fn list_objects(&mut self) -> Result<Listing, WriteError> {
        // Not `list table`: that prints every rule and element (measured 6–9 s at 10k
        // services). Chain names alone (`list chains`, 0.3 s at 10k) and set declarations
        // without their elements (`-t list sets`, 10 ms) are all reconciliation needs.
        // Every table has chains, so the chain listing names them all.
        let (tables, chains) = self.list_ours(&["list", "chains", nft::FAMILY], "chain ")?;
        let (_, sets) = self.list_ours(&["-t", "list", "sets", nft::FAMILY], "set ")?;
        Ok(Listing { tables, chains, sets })
    }

    fn list_chains(&mut self, chains: &[String]) -> Result<Option<String>, WriteError> {
        // One process a chain: `nft -f` (1.0.6) refuses `list chain` commands ("No such
        // file or directory") where `nft list chain` lists the same chain.
        let mut listing = String::new();
        for chain in chains {
            let output = self
                .nft()
                .args(["list", "chain", nft::FAMILY, nft::TABLE, chain])
                .stderr(Stdio::piped())
                .output()
                .map_err(WriteError::Spawn)?;
            if !output.status.success() {
                return Err(WriteError::Rejected(stderr_text(&output.stderr)));
            }
            listing.push_str(&String::from_utf8_lossy(&output.stdout));
        }
        Ok(Some(listing))
    }

    fn list_table(&mut self) -> Result<String, WriteError> {
        let output = self
            .nft()
            .args(["list", "table", nft::FAMILY, nft::TABLE])
            .stderr(Stdio::piped())
            .output()
            .map_err(WriteError::Spawn)?;
        if !output.status.success() {
            return Err(WriteError::Rejected(stderr_text(&output.stderr)));
        }
        Ok(String::from_utf8_lossy(&output.stdout).into_owned())
    }

    fn has_table(&mut self) -> bool {
        // `list tables` fills nft's whole cache (as slow as `list table`); a terse set
        // listing prints every table's header and no elements.
        self.nft().args(["-t", "list", "sets", nft::FAMILY]).stderr(Stdio::null()).output().is_ok_and(|o| {
            String::from_utf8_lossy(&o.stdout)
                .lines()
                .any(|l| l.trim() == format!("table {} {} {{", nft::FAMILY, nft::TABLE))
        })
    }

    fn local_addresses(&mut self) -> Result<Vec<IpAddr>, WriteError> {
        interface_addresses(NetlinkNft::netns_of_command(&self.command).as_deref()).map_err(WriteError::Addresses)
    }

    fn mode(&self) -> &'static str {
        "nftables"
    }

    fn last_path(&self) -> &'static str {
        "nft"
    }
}

/// The nftables writer with incremental transactions sent as netlink batches
/// ([`nft::netlink`]: no `nft` process, no cache fill) and everything else (full syncs,
/// listings, statements the encoder does not cover, conntrack) through [`NftCommand`].
/// One transaction always goes through one of the two, whole, so it stays atomic.
pub struct NetlinkNft {
    text: NftCommand,
    socket: netlink_sys::Socket,
    seq: u32,
    /// Transactions sent as netlink batches, and those that went through `nft -f`.
    pub netlink_transactions: u64,
    pub text_transactions: u64,
    last_path: &'static str,
}

/// Largest batch sent on the socket (the socket's send buffer is raised to it); bigger
/// transactions go through `nft -f`, which splits them itself.
const MAX_BATCH_BYTES: usize = 8 << 20;

impl NetlinkNft {
    /// Opens the socket in `netns` (a `/run/netns/NAME` path; `None`: this process's
    /// namespace), where `text` must run nft too.
    pub fn open(text: NftCommand, netns: Option<&std::path::Path>) -> std::io::Result<NetlinkNft> {
        let open = || -> std::io::Result<netlink_sys::Socket> {
            let mut socket = netlink_sys::Socket::new(netlink_sys::protocols::NETLINK_NETFILTER)?;
            socket.bind_auto()?;
            socket.set_cap_ack(true)?;
            Ok(socket)
        };
        // A socket belongs to the namespace it was created in.
        let socket = in_netns(netns, open)?;
        {
            use std::os::fd::AsRawFd as _;
            let size = MAX_BATCH_BYTES as libc::c_int;
            let set = |option| {
                // SAFETY: a valid socket and an int option value.
                unsafe {
                    libc::setsockopt(
                        socket.as_raw_fd(),
                        libc::SOL_SOCKET,
                        option,
                        (&size as *const libc::c_int).cast(),
                        size_of::<libc::c_int>() as u32,
                    )
                }
            };
            // FORCE needs CAP_NET_ADMIN (which writing nftables needs anyway); else the
            // sysctl's cap applies and big batches fall back to nft.
            if set(libc::SO_SNDBUFFORCE) != 0 {
                set(libc::SO_SNDBUF);
            }
        }
        Ok(NetlinkNft { text, socket, seq: 1, netlink_transactions: 0, text_transactions: 0, last_path: "nft" })
    }

    /// The network namespace `ip netns exec NAME …` runs in, for commands of that form.
    pub fn netns_of_command(command: &[String]) -> Option<std::path::PathBuf> {
        match command {
            [ip, netns, exec, name, ..]
                if ip.rsplit('/').next() == Some("ip") && netns == "netns" && exec == "exec" =>
            {
                Some(std::path::Path::new("/run/netns").join(name))
            }
            _ => None,
        }
    }

    /// Sends a batch; the kernel has processed it when `send` returns, so what is queued
    /// then are its errors (none: it went in). `None`: the batch is bigger than the socket's
    /// send buffer (capped by `net.core.wmem_max` without CAP_NET_ADMIN) and nothing was sent.
    fn send_batch(&mut self, transaction: &str, batch: &nft::netlink::Batch) -> Option<Result<(), WriteError>> {
        self.drain();
        let sent = match self.socket.send(&batch.bytes, 0) {
            Ok(sent) => sent,
            Err(e) if e.raw_os_error() == Some(libc::EMSGSIZE) => return None,
            Err(e) => return Some(Err(WriteError::Netlink(e))),
        };
        if sent != batch.bytes.len() {
            return Some(Err(WriteError::Rejected(format!(
                "netlink batch truncated: {sent} of {} bytes sent",
                batch.bytes.len()
            ))));
        }
        let errors = self.drain();
        if errors.is_empty() {
            return Some(Ok(()));
        }
        let lines: Vec<&str> = transaction.lines().collect();
        let described: Vec<String> = errors
            .iter()
            .take(8)
            .map(|(seq, errno)| {
                let what = batch
                    .messages
                    .iter()
                    .find(|(s, _)| s == seq)
                    .and_then(|(_, line)| lines.get(*line))
                    .map_or_else(|| "the transaction".to_string(), |l| format!("{l:?}"));
                format!("{what}: {}", std::io::Error::from_raw_os_error(*errno))
            })
            .collect();
        Some(Err(WriteError::Rejected(described.join("; "))))
    }

    /// (table, name) of every chain (`NFT_MSG_GETCHAIN`) or set (`NFT_MSG_GETSET`) of the
    /// inet family, from one kernel dump. Why not `nft list`: nft 1.0.6 lists table by
    /// table, and the chain listing of 50k services in 64 shards took 11.8 s that way.
    /// `skip`: (flags attribute, bits): leave out objects whose flags have any of the bits.
    fn dump_names(
        &mut self,
        msg: u16,
        name_attr: u16,
        skip: Option<(u16, u32)>,
    ) -> Result<Vec<(String, String)>, WriteError> {
        use nft::netlink::{NFTA_TABLE, dump_request, parse_dump, string_attribute, u32_attribute};
        // A dump the ruleset changed under is marked interrupted; ours is the only writer,
        // so a retry is only for someone else's `nft` at the same moment.
        for _attempt in 0..4 {
            self.drain();
            self.seq = self.seq.wrapping_add(1);
            self.socket.send(&dump_request(msg, self.seq), 0).map_err(WriteError::Netlink)?;
            let (mut names, mut interrupted) = (Vec::new(), false);
            loop {
                let mut buf: Vec<u8> = Vec::with_capacity(256 * 1024);
                self.socket.recv(&mut buf, 0).map_err(WriteError::Netlink)?;
                let part = parse_dump(&buf, self.seq);
                if let Some(errno) = part.error {
                    return Err(WriteError::Netlink(std::io::Error::from_raw_os_error(errno)));
                }
                interrupted |= part.interrupted;
                for attributes in &part.objects {
                    if skip
                        .is_some_and(|(attribute, bits)| u32_attribute(attributes, attribute).unwrap_or(0) & bits != 0)
                    {
                        continue;
                    }
                    if let (Some(table), Some(name)) =
                        (string_attribute(attributes, NFTA_TABLE), string_attribute(attributes, name_attr))
                    {
                        names.push((table, name));
                    }
                }
                if part.done {
                    break;
                }
            }
            if !interrupted {
                return Ok(names);
            }
        }
        Err(WriteError::Rejected("the nftables ruleset kept changing while it was listed".into()))
    }

    /// Reads what the socket has queued without waiting: (sequence number, errno) of every
    /// error message; a lost message (receive buffer overrun) counts as an error.
    fn drain(&mut self) -> Vec<(u32, i32)> {
        let mut errors = Vec::new();
        loop {
            let mut buf: Vec<u8> = Vec::with_capacity(64 * 1024);
            match self.socket.recv(&mut buf, libc::MSG_DONTWAIT) {
                Ok(0) => break,
                Ok(_) => {
                    let mut offset = 0;
                    while offset + 16 <= buf.len() {
                        let len = u32::from_ne_bytes(buf[offset..offset + 4].try_into().unwrap()) as usize;
                        let msg_type = u16::from_ne_bytes(buf[offset + 4..offset + 6].try_into().unwrap());
                        let seq = u32::from_ne_bytes(buf[offset + 8..offset + 12].try_into().unwrap());
                        // NLMSG_ERROR: an errno (negative), zero for an acknowledgement.
                        if msg_type == 2 && offset + 20 <= buf.len() {
                            let code = i32::from_ne_bytes(buf[offset + 16..offset + 20].try_into().unwrap());
                            if code != 0 {
                                errors.push((seq, -code));
                            }
                        }
                        if len < 16 {
                            break;
                        }
                        offset += (len + 3) & !3;
                    }
                }
                Err(e) if e.kind() == std::io::ErrorKind::WouldBlock => break,
                Err(e) => {
                    errors.push((0, e.raw_os_error().unwrap_or(libc::EIO)));
                    break;
                }
            }
        }
        errors
    }
}

impl Kernel for NetlinkNft {
    fn apply(&mut self, transaction: &str) -> Result<(), WriteError> {
        match nft::netlink::encode_transaction(transaction, self.seq) {
            Ok(batch) if batch.bytes.len() <= MAX_BATCH_BYTES => {
                self.seq = self.seq.wrapping_add(batch.messages.len() as u32 + 2);
                if let Some(result) = self.send_batch(transaction, &batch) {
                    self.netlink_transactions += 1;
                    self.last_path = "netlink";
                    return result;
                }
                tracing::debug!(bytes = batch.bytes.len(), "batch too big for the socket; through nft -f");
            }
            Ok(_) => {}
            Err(unsupported) => tracing::trace!("transaction through nft -f: {unsupported}"),
        }
        self.text_transactions += 1;
        self.last_path = "nft";
        self.text.apply(transaction)
    }

    fn clear_conntrack(&mut self, filters: &[ConntrackFilter]) -> Result<usize, WriteError> {
        self.text.clear_conntrack(filters)
    }

    fn settle(&mut self) -> Result<(), WriteError> {
        // An element no packet can match (no connection is DNATed from 0.0.0.0), added and
        // deleted in one batch: the commit runs, the set is as it was.
        let nothing = format!(
            "add element {main} hairpin {{ 0.0.0.0 . 0.0.0.0 }}\ndelete element {main} hairpin {{ 0.0.0.0 . 0.0.0.0 }}\n",
            main = Table::MAIN
        );
        let batch =
            nft::netlink::encode_transaction(&nothing, self.seq).map_err(|e| WriteError::Rejected(e.to_string()))?;
        self.seq = self.seq.wrapping_add(batch.messages.len() as u32 + 2);
        self.send_batch(&nothing, &batch).unwrap_or_else(|| Err(WriteError::Rejected("settling batch too big".into())))
    }

    fn list_objects(&mut self) -> Result<Listing, WriteError> {
        use nft::netlink::{
            NFT_MSG_GETCHAIN, NFT_MSG_GETSET, NFT_SET_ANONYMOUS, NFT_SET_MAP, NFTA_CHAIN_NAME, NFTA_SET_FLAGS,
            NFTA_SET_NAME,
        };
        let ours = |names: Vec<(String, String)>| -> Vec<TableObject> {
            names.into_iter().filter_map(|(table, name)| Some((Table::parse(&table)?, name))).collect()
        };
        let chains = ours(self.dump_names(NFT_MSG_GETCHAIN, NFTA_CHAIN_NAME, None)?);
        // As `nft -t list sets` shows them: named sets, not anonymous ones (NFT_SET_ANONYMOUS)
        // or maps (NFT_SET_MAP).
        let sets = ours(self.dump_names(
            NFT_MSG_GETSET,
            NFTA_SET_NAME,
            Some((NFTA_SET_FLAGS, NFT_SET_ANONYMOUS | NFT_SET_MAP)),
        )?);
        // Every table of ours has chains, so the chains name them all.
        let mut tables: Vec<Table> = chains.iter().map(|(t, _)| *t).collect();
        tables.sort();
        tables.dedup();
        Ok(Listing { tables, chains, sets })
    }

    fn list_table(&mut self) -> Result<String, WriteError> {
        self.text.list_table()
    }

    fn list_chains(&mut self, chains: &[String]) -> Result<Option<String>, WriteError> {
        self.text.list_chains(chains)
    }

    fn has_table(&mut self) -> bool {
        self.text.has_table()
    }

    fn local_addresses(&mut self) -> Result<Vec<IpAddr>, WriteError> {
        self.text.local_addresses()
    }

    fn mode(&self) -> &'static str {
        "nftables"
    }

    fn last_path(&self) -> &'static str {
        self.last_path
    }
}

/// What is applied, per object, and the map keys each object owns.
///
/// Restarts: a new process starts with an empty model, and the controller activates its
/// translator (a full sync) before any source has delivered state. Writing that would
/// replace the previous run's working rules with an empty table until the sources catch up.
/// So when our table is already in the kernel, the writer starts *held*: it records what it
/// is asked for but writes nothing until the first object sync (state from a source) or
/// [`Dataplane::release`]; that first write is one full transaction (flush and refill
/// atomically), so there is never a moment without rules.
pub struct Dataplane {
    kernel: Box<dyn Kernel>,
    /// What the kernel has from us (written and accepted).
    applied: BTreeMap<ObjectKey, Arc<ObjectRules>>,
    /// What we want but have not written: while held, or after a failed write (the next
    /// sync or reconcile writes it in full). `Some` implies `!in_sync`.
    pending: Option<BTreeMap<ObjectKey, Arc<ObjectRules>>>,
    /// Owners of map keys in the wanted state (`pending`, else `applied`). Every path keeps
    /// it in step with the state it builds (`replace_object`, `full_sync`), so a full write
    /// does not index every element again.
    element_owner: ElementOwners,
    /// The objects of the wanted state that were refused a claim another object owns, with
    /// their rules as given: each is offered them again once what it was refused is free
    /// (its owner changed or went away), as the owner's own change frees it.
    waiting: BTreeMap<ObjectKey, ObjectRules>,
    /// Elements of shared host sets ([`nft::is_shared_set`]) in `applied`, with how many
    /// objects want each: one is deleted when its last owner lets go.
    shared_owners: HashMap<nft::ElementKey, usize>,
    /// False until a full sync succeeded (and after a failed write): the next sync is full.
    in_sync: bool,
    /// Rules of a previous run are in the kernel and we have not been given state yet.
    held: bool,
    /// Where services are in the kernel (shard tables): set by each full sync, kept by
    /// incremental ones.
    layout: Layout,
    /// Services to a shard the next full sync aims at.
    services_per_shard: usize,
    /// How many of the wanted objects are services with chains (in shards).
    sharded: usize,
    /// The node's networks as the tables' static part has them (see `nft::skeleton`): the
    /// cluster's pod CIDRs, and the addresses node ports are served on.
    networks: nft::NodeNetworks,
    /// Which addresses node ports are served on (`--nodeport-addresses`).
    node_port_addresses: nft::NodePortAddresses,
    /// The node's addresses (its Node object's), for [`nft::NodePortAddresses::Primary`].
    node_ips: Vec<IpAddr>,
    /// Session affinity's pick chains in the kernel, by shard and timeout (see
    /// [`nft::AffinityClass`]): what the last full sync wrote.
    affinity_classes: HashSet<(Table, nft::AffinityClass)>,
    /// The last transaction written (its first [`LAST_TRANSACTION_BYTES`]).
    pub last_transaction: String,
    /// The last non-empty conntrack cleanup (filters), for inspection.
    pub last_conntrack_cleanup: Vec<ConntrackFilter>,
    /// Whether writes reach the kernel, for health checks (shared: read without the lock).
    pub health: Arc<WriteHealth>,
}

/// Whether the dataplane's writes reach the kernel: what kube-proxy's health server reports
/// (`lastUpdated`, and unhealthy once changes have waited too long). Shared, so that health
/// checks answer while a long full sync holds the controller.
#[derive(Debug, Default)]
pub struct WriteHealth {
    /// Milliseconds since the epoch of the last write the kernel accepted (0: none yet).
    last_written_ms: AtomicU64,
    /// Of the first write refused since then (0: none is failing).
    failing_since_ms: AtomicU64,
    /// The last write refused, whenever it was, and why: what an operator asks first.
    last_error: std::sync::Mutex<Option<(SystemTime, String)>>,
}

fn epoch_ms(t: SystemTime) -> u64 {
    t.duration_since(SystemTime::UNIX_EPOCH).map_or(0, |d| d.as_millis() as u64).max(1)
}

fn from_epoch_ms(ms: u64) -> Option<SystemTime> {
    (ms != 0).then(|| SystemTime::UNIX_EPOCH + Duration::from_millis(ms))
}

impl WriteHealth {
    fn written(&self) {
        self.last_written_ms.store(epoch_ms(SystemTime::now()), Ordering::Relaxed);
        self.failing_since_ms.store(0, Ordering::Relaxed);
    }

    fn failed(&self, error: &WriteError) {
        let now = SystemTime::now();
        let _ = self.failing_since_ms.compare_exchange(0, epoch_ms(now), Ordering::Relaxed, Ordering::Relaxed);
        *self.last_error.lock().unwrap_or_else(|p| p.into_inner()) = Some((now, error.to_string()));
    }

    /// The last write the kernel refused, when and why (kept after writes succeed again).
    pub fn last_error(&self) -> Option<(SystemTime, String)> {
        self.last_error.lock().unwrap_or_else(|p| p.into_inner()).clone()
    }

    /// When the kernel last accepted a write.
    pub fn last_written(&self) -> Option<SystemTime> {
        from_epoch_ms(self.last_written_ms.load(Ordering::Relaxed))
    }

    /// Since when writes have been refused, with none accepted after (`None`: they are not).
    pub fn failing_since(&self) -> Option<SystemTime> {
        from_epoch_ms(self.failing_since_ms.load(Ordering::Relaxed))
    }
}

/// Drops the map keys of `rules` whose claim ([`nft::Claim`]: a frontend, a node port, the
/// element itself) another object owns in `owners`, with a warning per claim, and keeps the
/// rules as given in `waiting` if anything was. Elements of shared sets have no single
/// owner ([`nft::is_shared_set`]). `owners` describes `objects`, which must not hold `key`
/// itself.
fn refuse_taken_keys(
    owners: &ElementOwners,
    objects: &Objects,
    waiting: &mut BTreeMap<ObjectKey, ObjectRules>,
    key: &ObjectKey,
    rules: &mut ObjectRules,
) {
    let taken = |k: &nft::ElementKey| owners.owner(k, objects).is_some_and(|owner| owner != key);
    if !rules.owned_keys().any(taken) {
        return;
    }
    waiting.insert(key.clone(), rules.clone());
    let mut conflicts = BTreeSet::new();
    rules.elements.retain(|k, _| match owners.owner(k, objects) {
        Some(owner) if owner != key && !nft::is_shared_set(&k.0) => {
            conflicts.insert(format!("{} already belongs to {owner}", nft::claim(k)));
            false
        }
        _ => true,
    });
    rules.warnings.extend(conflicts);
}

#[derive(Debug, Default, Clone, Copy, PartialEq, Eq)]
pub struct SyncStats {
    pub full: bool,
    pub objects: usize,
    pub statements: usize,
    /// Conntrack deletions (filters) run after the transaction.
    pub conntrack_filters: usize,
    /// How the transaction reached the kernel (see [`Kernel::last_path`]); empty when
    /// nothing was written.
    pub path: &'static str,
}

impl Dataplane {
    pub fn new(mut kernel: Box<dyn Kernel>) -> Self {
        let held = kernel.has_table();
        if held {
            tracing::info!("rules of a previous run are in the kernel: keeping them until the first state arrives");
        }
        Dataplane {
            kernel,
            applied: BTreeMap::new(),
            pending: None,
            element_owner: ElementOwners::default(),
            shared_owners: HashMap::new(),
            waiting: BTreeMap::new(),
            in_sync: false,
            held,
            layout: Layout::default(),
            services_per_shard: Layout::DEFAULT_SERVICES_PER_SHARD,
            sharded: 0,
            networks: nft::NodeNetworks::default(),
            node_port_addresses: nft::NodePortAddresses::All,
            node_ips: Vec::new(),
            affinity_classes: HashSet::new(),
            last_transaction: String::new(),
            last_conntrack_cleanup: Vec::new(),
            health: Arc::default(),
        }
    }

    /// Notes a write's outcome in [`WriteHealth`] (a hold writes nothing: no outcome).
    fn noted(&self, result: Result<SyncStats, WriteError>) -> Result<SyncStats, WriteError> {
        match &result {
            Ok(_) if self.held => {}
            Ok(_) => self.health.written(),
            Err(e) => self.health.failed(e),
        }
        result
    }

    pub fn mode(&self) -> &'static str {
        self.kernel.mode()
    }

    /// How many services the next full syncs put in one shard table (see [`Layout`]).
    pub fn with_services_per_shard(mut self, per_shard: usize) -> Self {
        self.services_per_shard = per_shard.max(1);
        self
    }

    /// How pod traffic is detected (`--detect-local-mode`): the host's off-cluster masquerade
    /// rules and every guest's `pod-traffic` match render by it.
    pub fn with_pod_traffic(mut self, pod_traffic: nft::PodTraffic) -> Self {
        self.networks.pod_traffic = pod_traffic;
        self
    }

    pub fn pod_traffic(&self) -> &nft::PodTraffic {
        &self.networks.pod_traffic
    }

    /// How guests' `pod-traffic` matches render now, and in which families they can (see
    /// [`nft::PodDetection`]): by source address, those of the cluster CIDRs it has now. A
    /// caller that moves them ([`Dataplane::set_cluster_cidrs`]) does so before it validates
    /// what depends on them.
    pub fn pod_detection(&self) -> nft::PodDetection<'_> {
        self.networks.pod_detection()
    }

    /// The cluster's pod CIDRs (unparsable ones are logged and left out): connections to a
    /// `masquerade-off-cluster` frontend from outside them are masqueraded.
    pub fn with_cluster_cidrs(mut self, cidrs: &[impl AsRef<str>]) -> Self {
        self.networks.cluster_cidrs = parse_cidrs("cluster-cidrs", cidrs);
        self
    }

    /// Masquerade every connection to a cluster IP (kube-proxy's `--masquerade-all`): a rule
    /// of the tables' static part, so it holds whatever the translator in force does.
    pub fn with_masquerade_all(mut self, masquerade_all: bool) -> Self {
        self.networks.masquerade_all = masquerade_all;
        self
    }

    /// Pod egress masquerade (`--egress-masquerade`, see [`nft::EgressMasquerade`]).
    pub fn with_egress_masquerade(mut self, egress: Option<nft::EgressMasquerade>) -> Self {
        self.networks.egress_masquerade = egress;
        self
    }

    /// This node's pod CIDRs, whose egress is masqueraded (when it is on). Returns whether
    /// they moved, as [`Dataplane::set_service_cidrs`].
    pub fn set_egress_sources(&mut self, cidrs: &[wasmplane_model::CompactString]) -> bool {
        let cidrs = parse_cidrs("pod-cidrs", cidrs);
        let Some(egress) = self.networks.egress_masquerade.as_mut() else { return false };
        replace_static(&mut egress.sources, cidrs, &mut self.in_sync)
    }

    /// Other clusters' pod CIDRs, left out of pod egress masquerade (when it is on). Returns
    /// whether they moved, as [`Dataplane::set_service_cidrs`].
    pub fn set_egress_remote_pod_cidrs(&mut self, mut cidrs: Vec<ipnet::IpNet>) -> bool {
        let Some(egress) = self.networks.egress_masquerade.as_mut() else { return false };
        cidrs.sort_unstable();
        cidrs.dedup();
        replace_static(&mut egress.remote_pod_cidrs, cidrs, &mut self.in_sync)
    }

    /// The cluster's service CIDRs at start (the configured ones): new connections to an
    /// address in them that is no service's are dropped.
    pub fn with_service_cidrs(mut self, cidrs: Vec<ipnet::IpNet>) -> Self {
        self.networks.service_cidrs = cidrs;
        self
    }

    /// Logs the service side's drops and rejects to `log`'s group (see
    /// [`nft::service_drops`]). The objects written must then send their no-endpoint drops
    /// through the drop chain ([`nft::service_drops::route_drops_through_log`]).
    pub fn with_service_drop_log(mut self, log: Option<nft::policy::VerdictLog>) -> Self {
        self.networks.service_drop_log = log;
        self
    }

    /// Whether service drops are logged (see [`Dataplane::with_service_drop_log`]).
    pub fn logs_service_drops(&self) -> bool {
        self.networks.service_drop_log.is_some()
    }

    /// The CIDRs local traffic comes from (the model's context: the cluster CIDRs, or the
    /// node's pod CIDRs with `--detect-local-mode NodeCIDR`). Returns whether they moved, as
    /// [`Dataplane::set_service_cidrs`].
    pub fn set_cluster_cidrs(&mut self, cidrs: &[wasmplane_model::CompactString]) -> bool {
        let cidrs = parse_cidrs("cluster-cidrs", cidrs);
        replace_static(&mut self.networks.cluster_cidrs, cidrs, &mut self.in_sync)
    }

    /// The cluster's service CIDRs (the model's: configured and ServiceCIDR objects').
    /// Returns whether they moved: the next write is then a full one, which the caller must
    /// make happen even when no object changed.
    pub fn set_service_cidrs(&mut self, cidrs: &[ipnet::IpNet]) -> bool {
        replace_static(&mut self.networks.service_cidrs, cidrs.to_vec(), &mut self.in_sync)
    }

    /// Where write health is reported (shared with the metrics' scrape).
    pub fn with_health(mut self, health: Arc<WriteHealth>) -> Self {
        self.health = health;
        self
    }

    /// Which addresses node ports are served on (see [`nft::NodePortAddresses`]).
    pub fn with_node_port_addresses(mut self, addresses: nft::NodePortAddresses) -> Self {
        self.node_port_addresses = addresses;
        self
    }

    /// The node's addresses changed (its Node object's). Returns whether that moves node
    /// ports to other addresses: the next write is then a full one, which the caller must
    /// see to even without other changes.
    pub fn set_node_ips(&mut self, node_ips: &[impl AsRef<str>]) -> bool {
        self.node_ips = node_ips.iter().filter_map(|ip| ip.as_ref().parse().ok()).collect();
        if self.node_port_addresses != nft::NodePortAddresses::Primary {
            return false;
        }
        let moved = self.node_port_addresses.select(&self.node_ips, &[]) != self.networks.node_port_ips;
        if moved {
            self.in_sync = false;
        }
        moved
    }

    /// The interfaces' addresses changed (see [`watch_interface_addresses`]). Returns whether
    /// that moves node ports to other addresses (`--nodeport-addresses` networks): the next
    /// write is then a full one, which the caller must see to even without other changes.
    pub fn interface_addresses_changed(&mut self) -> bool {
        if !self.node_port_addresses.needs_local_addresses() {
            return false;
        }
        let moved = self.node_port_ips() != self.networks.node_port_ips;
        if moved {
            self.in_sync = false;
        }
        moved
    }

    /// The addresses node ports are to be served on now: for networks, the interfaces'
    /// addresses are read again (at each full write, so the periodic reconcile follows
    /// them, as kube-proxy follows them at each sync). Unreadable: the last ones stay.
    fn node_port_ips(&mut self) -> Option<Vec<IpAddr>> {
        let local = if self.node_port_addresses.needs_local_addresses() {
            match self.kernel.local_addresses() {
                Ok(local) => local,
                Err(e) => {
                    tracing::warn!("reading the node's addresses for --nodeport-addresses, keeping the last ones: {e}");
                    return self.networks.node_port_ips.clone();
                }
            }
        } else {
            Vec::new()
        };
        self.node_port_addresses.select(&self.node_ips, &local)
    }

    /// How services are laid out in the kernel now.
    pub fn layout(&self) -> Layout {
        self.layout
    }

    pub fn applied(&self) -> &BTreeMap<ObjectKey, Arc<ObjectRules>> {
        &self.applied
    }

    /// True while the previous run's rules are kept and nothing has been written.
    /// The kernel's listing of our table (see [`Kernel::list_table`]).
    pub fn list_table(&mut self) -> Result<String, WriteError> {
        self.kernel.list_table()
    }

    /// Some chains of the main table (see [`Kernel::list_chains`]).
    pub fn list_chains(&mut self, chains: &[String]) -> Result<Option<String>, WriteError> {
        self.kernel.list_chains(chains)
    }

    pub fn is_held(&self) -> bool {
        self.held
    }

    /// What is wanted of one object (written, or to be written in full next).
    pub fn wanted(&self, key: &ObjectKey) -> Option<&ObjectRules> {
        self.desired().get(key).map(|rules| &**rules)
    }

    fn desired(&self) -> &BTreeMap<ObjectKey, Arc<ObjectRules>> {
        self.pending.as_ref().unwrap_or(&self.applied)
    }

    /// Applies a set of per-object changes (`None`: the object is gone) as one transaction.
    /// This is state from a source, so it also ends a hold (see [`Dataplane`]).
    pub fn sync(&mut self, changes: Vec<(ObjectKey, Option<ObjectRules>)>) -> Result<SyncStats, WriteError> {
        let result = self.sync_changes(changes);
        self.noted(result)
    }

    fn sync_changes(&mut self, mut changes: Vec<(ObjectKey, Option<ObjectRules>)>) -> Result<SyncStats, WriteError> {
        self.held = false;
        // The oldest claimant first (a stable sort: objects of no age, policies' among them,
        // keep their order, which matters).
        changes.sort_by_key(|(_, rules)| rules.as_ref().map_or(i64::MAX, ObjectRules::claim_order));
        if self.in_sync && self.relayout_with(&changes) {
            // The change is most of the table anyway (a first delivery of state after an
            // empty start): one full sync costs the same and lays the services out for
            // their number at once, instead of at the next reconcile.
            tracing::debug!(objects = changes.len(), "a change of most services: written as a full sync");
            self.in_sync = false;
        }
        if self.in_sync && self.lacks_affinity_class(&changes) {
            tracing::info!(
                "a session affinity timeout new to its shard: written as a full sync (see nft::AffinityClass)"
            );
            self.in_sync = false;
        }
        if !self.in_sync {
            let mut next = self.desired().clone();
            for (key, rules) in changes {
                self.replace_object(&mut next, key, rules);
            }
            for key in self.freed_waiting(&next) {
                let rules = self.waiting.remove(&key);
                self.replace_object(&mut next, key, rules);
            }
            return self.write_full(next);
        }
        // In sync: `applied` is what is wanted. Change it in place and remember what the
        // changed objects had, so the cost is the change's, not the table's.
        let mut next = std::mem::take(&mut self.applied);
        let mut olds: Vec<(ObjectKey, Option<Arc<ObjectRules>>)> = Vec::new();
        let mut seen = HashSet::new();
        for (key, rules) in changes {
            let old = self.replace_object(&mut next, key.clone(), rules);
            if seen.insert(key.clone()) {
                olds.push((key, old));
            }
        }
        // What the changes freed goes to the objects that wanted it, in the same transaction.
        for key in self.freed_waiting(&next) {
            let rules = self.waiting.remove(&key);
            let old = self.replace_object(&mut next, key.clone(), rules);
            if seen.insert(key.clone()) {
                olds.push((key, old));
            }
        }
        let empty = ObjectRules::default();
        let mut transaction = String::new();
        let pairs: Vec<(&ObjectRules, &ObjectRules)> = olds
            .iter()
            .map(|(key, old)| (old.as_deref().unwrap_or(&empty), next.get(key).map_or(&empty, |r| &**r)))
            .collect();
        nft::objects_delta(&pairs, &mut transaction, self.layout);
        let shared_change = self.shared_change(&olds, &next);
        nft::shared_elements(
            &mut transaction,
            shared_change.iter().filter(|(_, (b, a))| *b > 0 && *a == 0).map(|(k, _)| k),
            false,
        );
        nft::shared_elements(
            &mut transaction,
            shared_change.iter().filter(|(_, (b, a))| *b == 0 && *a > 0).map(|(k, _)| k),
            true,
        );
        let statements = transaction.lines().count();
        let objects = olds.len();
        if statements > 0
            && let Err(e) = self.kernel.apply(&transaction)
        {
            // Wanted all the same (written in full next time); the kernel keeps the old.
            let wanted = next.clone();
            for (key, old) in olds {
                match old {
                    Some(old) => next.insert(key, old),
                    None => next.remove(&key),
                };
            }
            self.applied = next;
            self.keep_pending(wanted);
            return Err(e);
        }
        let cleanup: Vec<ConntrackFilter> = olds
            .iter()
            .flat_map(|(key, old)| {
                nft::conntrack_cleanup(old.as_deref().unwrap_or(&empty), next.get(key).map_or(&empty, |r| r))
            })
            .collect();
        let conntrack_filters = self.clean_conntrack(cleanup);
        self.last_transaction = kept_text(transaction, LAST_TRANSACTION_BYTES);
        self.applied = next;
        for (k, (_, after)) in shared_change {
            if after == 0 {
                self.shared_owners.remove(&k);
            } else {
                self.shared_owners.insert(k, after);
            }
        }
        let path = if statements > 0 { self.kernel.last_path() } else { "" };
        Ok(SyncStats { full: false, objects, statements, conntrack_filters, path })
    }

    /// Whether `changes` go to session affinity chains that the kernel does not have.
    fn lacks_affinity_class(&self, changes: &[(ObjectKey, Option<ObjectRules>)]) -> bool {
        changes
            .iter()
            .filter_map(|(_, rules)| rules.as_ref())
            .flat_map(|rules| nft::affinity_classes(rules, self.layout))
            .any(|c| !self.affinity_classes.contains(&c))
    }

    /// Owner counts (before, after) of the shared-set elements the changed objects had or have.
    fn shared_change(
        &self,
        olds: &[(ObjectKey, Option<Arc<ObjectRules>>)],
        next: &BTreeMap<ObjectKey, Arc<ObjectRules>>,
    ) -> BTreeMap<nft::ElementKey, (usize, usize)> {
        let mut change: BTreeMap<nft::ElementKey, (usize, usize)> = BTreeMap::new();
        let shared = |rules: Option<&ObjectRules>| {
            rules.into_iter().flat_map(ObjectRules::shared_keys).cloned().collect::<Vec<_>>()
        };
        for (key, old) in olds {
            for (k, step) in shared(old.as_deref())
                .into_iter()
                .map(|k| (k, -1))
                .chain(shared(next.get(key).map(|r| &**r)).into_iter().map(|k| (k, 1)))
            {
                let before = self.shared_owners.get(&k).copied().unwrap_or(0);
                let entry = change.entry(k).or_insert((before, before));
                entry.1 = entry.1.saturating_add_signed(step);
            }
        }
        change
    }

    /// Whether `changes` touch at least half of the services after them and those need
    /// another layout than the kernel has.
    fn relayout_with(&self, changes: &[(ObjectKey, Option<ObjectRules>)]) -> bool {
        // The last change of a key counts (a batch may change one object twice).
        let latest: HashMap<&ObjectKey, &Option<ObjectRules>> = changes.iter().map(|(k, r)| (k, r)).collect();
        let before = latest.keys().filter(|k| self.applied.get(**k).is_some_and(|r| r.is_sharded())).count();
        let after = latest.values().filter(|r| r.as_ref().is_some_and(ObjectRules::is_sharded)).count();
        let services = (self.sharded + after).saturating_sub(before);
        latest.len() * 2 >= services && Layout::for_services(services, self.services_per_shard) != self.layout
    }

    /// Runs a conntrack cleanup after a transaction went in. A failure is logged, not
    /// returned: the rules are in, and the flows only keep their old endpoint until their
    /// entries time out.
    fn clean_conntrack(&mut self, filters: Vec<ConntrackFilter>) -> usize {
        if filters.is_empty() {
            return 0;
        }
        match self.kernel.clear_conntrack(&filters) {
            Ok(deleted) => tracing::debug!(
                filters = filters.len(),
                deleted,
                "deleted conntrack entries of endpoints that went away"
            ),
            Err(e) => tracing::warn!("conntrack cleanup failed, the flows move once their entries time out: {e}"),
        }
        let n = filters.len();
        self.last_conntrack_cleanup = filters;
        n
    }

    /// Puts `rules` (or nothing) in place of `key` in `objects`, keeping `element_owner` in
    /// step (map keys another object owns are refused with a warning: first owner wins).
    /// Returns what `key` had.
    fn replace_object(
        &mut self,
        objects: &mut BTreeMap<ObjectKey, Arc<ObjectRules>>,
        key: ObjectKey,
        rules: Option<ObjectRules>,
    ) -> Option<Arc<ObjectRules>> {
        let old = objects.remove(&key);
        let rules = rules.map(|mut rules| {
            if let Some(old) = &old {
                nft::keep_affinity_slots(old, &mut rules);
            }
            rules
        });
        self.sharded = self.sharded.saturating_sub(usize::from(old.as_ref().is_some_and(|o| o.is_sharded())));
        self.sharded += usize::from(rules.as_ref().is_some_and(ObjectRules::is_sharded));
        if let Some(old) = &old {
            self.element_owner.remove_object(&key, old);
        }
        self.waiting.remove(&key);
        if let Some(mut rules) = rules {
            // Map keys another object already owns are refused (first owner wins).
            refuse_taken_keys(&self.element_owner, objects, &mut self.waiting, &key, &mut rules);
            self.element_owner.insert_object(&key, &rules);
            objects.insert(key, Arc::new(rules));
        }
        old
    }

    /// The waiting objects (see [`Dataplane::waiting`]) of which a claim is free in `objects`
    /// (owned by none), the oldest first, then in key order.
    fn freed_waiting(&self, objects: &Objects) -> Vec<ObjectKey> {
        let mut freed: Vec<(i64, &ObjectKey)> = self
            .waiting
            .iter()
            .filter(|(_, rules)| rules.owned_keys().any(|k| self.element_owner.owner(k, objects).is_none()))
            .map(|(key, rules)| (rules.claim_order(), key))
            .collect();
        freed.sort();
        freed.into_iter().map(|(_, key)| key.clone()).collect()
    }

    /// Rewrites the whole table from what we want (periodic reconcile, first sync, hot swap).
    /// While held, `Some` only replaces what is wanted and `None` (a reconcile) does nothing.
    pub fn full_sync(&mut self, objects: Option<BTreeMap<ObjectKey, ObjectRules>>) -> Result<SyncStats, WriteError> {
        let result = self.full_sync_of(objects);
        self.noted(result)
    }

    fn full_sync_of(&mut self, objects: Option<BTreeMap<ObjectKey, ObjectRules>>) -> Result<SyncStats, WriteError> {
        let next = match objects {
            Some(objects) => {
                let mut next = BTreeMap::new();
                let mut owners = ElementOwners::default();
                let mut waiting = BTreeMap::new();
                // Those that own what they claim keep it: the objects that were waiting for
                // a claim come after the others, each part the oldest first, then in key
                // order (see `ObjectRules::created_unix`).
                let (mut later, mut first): (Vec<_>, Vec<_>) =
                    objects.into_iter().partition(|(key, _)| self.waiting.contains_key(key));
                first.sort_by_key(|(_, rules)| rules.claim_order());
                later.sort_by_key(|(_, rules)| rules.claim_order());
                for (key, mut rules) in first.into_iter().chain(later) {
                    if let Some(old) = self.desired().get(&key) {
                        nft::keep_affinity_slots(old, &mut rules);
                    }
                    refuse_taken_keys(&owners, &next, &mut waiting, &key, &mut rules);
                    owners.insert_object(&key, &rules);
                    next.insert(key, Arc::new(rules));
                }
                self.element_owner = owners;
                self.waiting = waiting;
                next
            }
            None => self.desired().clone(),
        };
        if self.held {
            let objects = next.len();
            self.keep_pending(next);
            return Ok(SyncStats { full: true, objects, statements: 0, conntrack_filters: 0, path: "" });
        }
        self.write_full(next)
    }

    /// Ends a hold: writes what is wanted now, in full. For callers that know their sources
    /// delivered a complete state even when it changed nothing (an empty cluster).
    pub fn release(&mut self) -> Result<SyncStats, WriteError> {
        if !self.held {
            return Ok(SyncStats::default());
        }
        self.held = false;
        let next = self.desired().clone();
        let result = self.write_full(next);
        self.noted(result)
    }

    fn write_full(&mut self, next: BTreeMap<ObjectKey, Arc<ObjectRules>>) -> Result<SyncStats, WriteError> {
        let listing = match self.kernel.list_objects() {
            Ok(listed) => listed,
            Err(e) => {
                self.keep_pending(next);
                return Err(e);
            }
        };
        let services = next.values().filter(|r| r.is_sharded()).count();
        let layout = Layout::for_services(services, self.services_per_shard);
        let affinity_classes: HashSet<(Table, nft::AffinityClass)> =
            next.values().flat_map(|r| nft::affinity_classes(r, layout)).collect();
        let networks = nft::NodeNetworks { node_port_ips: self.node_port_ips(), ..self.networks.clone() };
        if networks.node_port_ips != self.networks.node_port_ips {
            tracing::info!(addresses = ?networks.node_port_ips, "node ports served on new addresses");
        }
        let stale = {
            // Hashed: scanning every object per listed chain took 60 s at 10k services.
            let chains: HashSet<&str> = next.values().flat_map(|r| r.chains.keys().map(String::as_str)).collect();
            let sets: HashSet<&str> = next.values().flat_map(|r| r.sets.keys().map(String::as_str)).collect();
            let tables: HashSet<Table> = layout.tables().collect();
            // A wanted name in another table than the layout's is stale there (a service
            // that moved shards); whole tables outside the layout go at once.
            let wanted = |names: &HashSet<&str>, table: &Table, name: &str| {
                names.contains(name) && layout.table_of(name) == *table
            };
            // A host before shards had the service NAT chains in the main table.
            let unsharded_main = listing.chains.iter().any(|(t, c)| *t == Table::MAIN && c == "services");
            // Static chains of another configuration or version (a `drop-chain` when service
            // drops are no longer logged): what the skeleton does not write now goes.
            let skeleton = nft::skeleton_chains(layout, &networks);
            let mut stale_chains: Vec<TableObject> = listing
                .chains
                .into_iter()
                .filter(|object| {
                    let (t, c) = object;
                    tables.contains(t)
                        && if nft::is_static_chain(c) {
                            !skeleton.contains(object)
                        } else {
                            !wanted(&chains, t, c)
                                && !nft::AffinityClass::of_chain(c)
                                    .is_some_and(|class| affinity_classes.contains(&(*t, class)))
                        }
                })
                .collect();
            keep_chains_elements_go_to(&mut stale_chains, &next);
            nft::Stale {
                tables: listing.tables.iter().filter(|t| !tables.contains(t)).copied().collect(),
                chains: stale_chains,
                sets: listing
                    .sets
                    .into_iter()
                    .filter(|(t, s)| {
                        tables.contains(t)
                            && (s.starts_with("svc/") || nft::policy::is_policy_object(s))
                            && !wanted(&sets, t, s)
                    })
                    .collect(),
                unsharded_main,
            }
        };
        let transaction = nft::full_transaction(next.values().map(|r| &**r), &stale, layout, &networks);
        if let Err(e) = self.kernel.apply(&transaction) {
            self.keep_pending(next);
            return Err(e);
        }
        let started = std::time::Instant::now();
        match self.kernel.settle() {
            Ok(()) => tracing::debug!(elapsed = ?started.elapsed(), "settled after a full transaction"),
            Err(e) => tracing::debug!("settling after a full transaction: {e}"),
        }
        // What the kernel had from us (`applied`) against what it has now, for the objects
        // that changed (a hot swap, a sync after a failed write).
        let empty = ObjectRules::default();
        let cleanup: Vec<ConntrackFilter> = self
            .applied
            .iter()
            .filter_map(|(key, old)| match next.get(key) {
                Some(new) if Arc::ptr_eq(new, old) || new == old => None,
                new => Some(nft::conntrack_cleanup(old, new.map_or(&empty, |n| n))),
            })
            .flatten()
            .collect();
        let conntrack_filters = self.clean_conntrack(cleanup);
        let stats = SyncStats {
            full: true,
            objects: next.len(),
            statements: transaction.lines().count(),
            conntrack_filters,
            path: self.kernel.last_path(),
        };
        self.last_transaction = kept_text(transaction, LAST_TRANSACTION_BYTES);
        self.in_sync = true;
        self.networks = networks;
        if layout != self.layout {
            tracing::info!(shards = layout.shards, services, "services laid out over new shard tables");
        }
        self.layout = layout;
        self.affinity_classes = affinity_classes;
        self.commit(next, services);
        // A full sync's transient text and listings are large (tens of MB at 50k services)
        // and leave glibc's heap fragmented: hand what is free back to the kernel.
        crate::memory::release_free_memory();
        Ok(stats)
    }

    /// Not written (held, or the kernel refused): wanted all the same, written in full next.
    fn keep_pending(&mut self, next: BTreeMap<ObjectKey, Arc<ObjectRules>>) {
        debug_assert!(self.element_owner.describes(&next), "the element-owner index is not that of the wanted state");
        self.sharded = next.values().filter(|r| r.is_sharded()).count();
        self.pending = Some(next);
        self.in_sync = false;
    }

    /// `next` went in whole; `sharded`: how many of its objects are services in shards.
    fn commit(&mut self, next: BTreeMap<ObjectKey, Arc<ObjectRules>>, sharded: usize) {
        debug_assert!(self.element_owner.describes(&next), "the element-owner index is not that of the wanted state");
        self.shared_owners.clear();
        for k in next.values().flat_map(|r| r.shared_keys()) {
            *self.shared_owners.entry(k.clone()).or_default() += 1;
        }
        self.sharded = sharded;
        self.pending = None;
        self.applied = next;
    }

    /// The full table as it is applied now, as an `nft -f` document.
    pub fn render(&self) -> String {
        nft::full_transaction(self.applied.values().map(|r| &**r), &nft::Stale::default(), self.layout, &self.networks)
    }
}

/// Leaves out of `stale` the static chains a wanted element still goes to: deleting one would
/// fail the whole full transaction. None should be (the controller sends drops to the drop
/// chain only while the skeleton writes it); if one is, it stays, as every static chain did.
fn keep_chains_elements_go_to(stale: &mut Vec<TableObject>, wanted: &BTreeMap<ObjectKey, Arc<ObjectRules>>) {
    if !stale.iter().any(|(_, c)| nft::is_static_chain(c)) {
        return;
    }
    let targets: HashSet<&str> = wanted
        .values()
        .flat_map(|r| r.elements.values())
        .filter_map(|verdict| verdict.strip_prefix("goto ").or_else(|| verdict.strip_prefix("jump ")))
        .collect();
    stale.retain(|(t, c)| {
        let kept = nft::is_static_chain(c) && targets.contains(c.as_str());
        if kept {
            tracing::warn!(table = %t, chain = %c, "a static chain the skeleton no longer writes is still the verdict of an element: kept");
        }
        !kept
    });
}

/// Puts `value` into `slot`, a piece of the tables' static part; if that changed it, the next
/// write must be a full one (`in_sync` goes false). Returns whether it changed.
fn replace_static<T: PartialEq>(slot: &mut T, value: T, in_sync: &mut bool) -> bool {
    let moved = *slot != value;
    if moved {
        *slot = value;
        *in_sync = false;
    }
    moved
}

/// CIDRs of a flag (a bare address is its /32 or /128); unparsable ones are logged and left
/// out of `set`.
pub fn parse_cidrs<S: AsRef<str>>(set: &str, cidrs: &[S]) -> Vec<ipnet::IpNet> {
    cidrs
        .iter()
        .map(AsRef::as_ref)
        .filter_map(|c| {
            match c.parse::<ipnet::IpNet>().or_else(|_| c.parse::<std::net::IpAddr>().map(ipnet::IpNet::from)) {
                Ok(net) => Some(net),
                Err(e) => {
                    tracing::warn!(cidr = %c, "not a CIDR, left out of the dataplane's {set}: {e}");
                    None
                }
            }
        })
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::collections::BTreeSet;
    use std::sync::Mutex;
    use wasmplane_model::{CompactString, format_compact};

    /// A kernel that records transactions, can refuse them, and may already hold our table.
    #[derive(Clone, Default)]
    struct Fake {
        applied: Arc<Mutex<Vec<String>>>,
        refuse: Arc<Mutex<bool>>,
        has_table: bool,
        conntrack: Arc<Mutex<Vec<ConntrackFilter>>>,
        listing: Arc<Mutex<Listing>>,
    }

    impl Kernel for Fake {
        fn apply(&mut self, transaction: &str) -> Result<(), WriteError> {
            if *self.refuse.lock().unwrap() {
                return Err(WriteError::Rejected("refused".into()));
            }
            self.applied.lock().unwrap().push(transaction.to_string());
            Ok(())
        }
        fn clear_conntrack(&mut self, filters: &[ConntrackFilter]) -> Result<usize, WriteError> {
            self.conntrack.lock().unwrap().extend(filters.iter().cloned());
            Ok(filters.len())
        }
        fn list_objects(&mut self) -> Result<Listing, WriteError> {
            Ok(self.listing.lock().unwrap().clone())
        }
        fn has_table(&mut self) -> bool {
            self.has_table
        }
        fn mode(&self) -> &'static str {
            "fake"
        }
    }

    fn rules(name: &str, ip: &str) -> ObjectRules {
        let chain = format!("svc/default/{name}");
        let mut r = ObjectRules::default();
        r.chains.insert(chain.clone(), vec![format!("meta l4proto tcp dnat ip to {ip}:80")]);
        r.elements.insert(("service-ips".into(), "10.96.0.1 . tcp . 80".into()), format_compact!("goto {chain}"));
        r
    }

    fn key(name: &str) -> ObjectKey {
        ObjectKey::new("default", name)
    }

    #[test]
    fn a_restart_keeps_the_old_rules_until_state_arrives() {
        let fake = Fake { has_table: true, ..Default::default() };
        let mut dp = Dataplane::new(Box::new(fake.clone()));
        assert!(dp.is_held());
        // Activation over the empty startup model, then a periodic reconcile: nothing written.
        dp.full_sync(Some(BTreeMap::new())).unwrap();
        dp.full_sync(None).unwrap();
        assert!(fake.applied.lock().unwrap().is_empty());
        // State from a source: one full transaction.
        let stats = dp.sync(vec![(key("a"), Some(rules("a", "10.244.0.1")))]).unwrap();
        assert!(stats.full && !dp.is_held());
        let written = fake.applied.lock().unwrap().clone();
        assert_eq!(written.len(), 1);
        assert!(written[0].contains("flush table") && written[0].contains("add chain inet wasmplane-s0 svc/default/a"));
    }

    #[test]
    fn write_health_follows_what_the_kernel_accepts() {
        let fake = Fake { has_table: true, ..Default::default() };
        let mut dp = Dataplane::new(Box::new(fake.clone()));
        let health = dp.health.clone();
        // Held: nothing written, nothing to report either way.
        dp.full_sync(Some(BTreeMap::new())).unwrap();
        assert_eq!((health.last_written(), health.failing_since()), (None, None));
        dp.sync(vec![(key("a"), Some(rules("a", "10.244.0.1")))]).unwrap();
        let first = health.last_written().expect("a write accepted");
        assert_eq!(health.failing_since(), None);
        // Refused writes: failing since the first of them, the last good write kept.
        *fake.refuse.lock().unwrap() = true;
        dp.sync(vec![(key("b"), Some(rules("b", "10.244.0.2")))]).unwrap_err();
        let since = health.failing_since().expect("failing");
        // The same moment (`failing_since` keeps milliseconds).
        let (first_at, _) = health.last_error().expect("a refusal noted");
        assert!(first_at.duration_since(since).is_ok_and(|d| d < Duration::from_millis(1)));
        std::thread::sleep(Duration::from_millis(5));
        let refused = dp.full_sync(None).unwrap_err();
        assert_eq!((health.failing_since(), health.last_written()), (Some(since), Some(first)));
        // The last refusal's time and reason, not the first's.
        let (at, why) = health.last_error().expect("a refusal noted");
        assert!(at > since);
        assert_eq!(why, refused.to_string());
        // Accepted again: healthy, the last refusal still there to read.
        *fake.refuse.lock().unwrap() = false;
        dp.full_sync(None).unwrap();
        assert_eq!(health.failing_since(), None);
        assert!(health.last_written().unwrap() >= first);
        assert_eq!(health.last_error(), Some((at, why)));
    }

    #[test]
    fn services_spread_over_shards_and_move_when_a_full_sync_changes_the_layout() {
        let fake = Fake::default();
        let mut dp = Dataplane::new(Box::new(fake.clone())).with_services_per_shard(2);
        let names: Vec<String> = (0..7).map(|i| format!("s{i}")).collect();
        let objects: BTreeMap<ObjectKey, ObjectRules> = names
            .iter()
            .enumerate()
            .map(|(i, n)| {
                (key(n), {
                    let mut r = rules(n, "10.244.0.1");
                    r.elements = [(
                        ("service-ips".into(), format_compact!("10.96.0.{i} . tcp . 80")),
                        format_compact!("goto svc/default/{n}"),
                    )]
                    .into();
                    r
                })
            })
            .collect();
        dp.full_sync(Some(objects.clone())).unwrap();
        // 7 services, 2 to a shard: 4 tables (a power of two).
        let layout = dp.layout();
        assert_eq!(layout.shards, 4);
        let full = fake.applied.lock().unwrap().last().unwrap().clone();
        for shard in 0..4 {
            assert!(
                full.contains(&format!("add chain inet wasmplane-s{shard} nat-prerouting {{ type nat hook prerouting")),
                "{full}"
            );
        }
        let used: BTreeSet<Table> = names.iter().map(|n| layout.table_of(&format!("svc/default/{n}"))).collect();
        assert!(used.len() > 1, "7 services all hashed to one of 4 shards: {used:?}");
        for (i, n) in names.iter().enumerate() {
            let t = layout.table_of(&format!("svc/default/{n}"));
            assert!(full.contains(&format!("add chain {t} svc/default/{n}\n")), "{n} in {t}");
            assert!(
                nft::tests::has_element(
                    &full,
                    &t.to_string(),
                    "service-ips",
                    &format!("10.96.0.{i} . tcp . 80 : goto svc/default/{n}")
                ),
                "{n} in {t}"
            );
        }
        // An incremental change goes to the service's own shard, elements and chain alike.
        let t = layout.table_of("svc/default/s3");
        let mut changed = rules("s3", "10.244.0.9");
        changed.elements =
            [(("service-ips".into(), "10.96.0.3 . tcp . 80".into()), "goto svc/default/s3".into())].into();
        dp.sync(vec![(key("s3"), Some(changed))]).unwrap();
        let delta = fake.applied.lock().unwrap().last().unwrap().clone();
        assert_eq!(
            delta,
            format!(
                "flush chain {t} svc/default/s3\nadd chain {t} svc/default/s3\nadd rule {t} svc/default/s3 meta l4proto tcp dnat ip to 10.244.0.9:80\n"
            )
        );

        // Down to one service: one shard; the kernel (as listed) still has the old layout.
        let kept = objects.iter().take(1).map(|(k, v)| (k.clone(), v.clone())).collect();
        let moved =
            names.iter().skip(1).map(|n| (layout.table_of(&format!("svc/default/{n}")), format!("svc/default/{n}")));
        *fake.listing.lock().unwrap() = Listing {
            tables: layout.tables().collect(),
            chains: moved
                .chain([(Table::shard(3), "services".to_string()), (Table::shard(0), "svc/default/s0".to_string())])
                .collect(),
            sets: vec![],
        };
        dp.full_sync(Some(kept)).unwrap();
        assert_eq!(dp.layout().shards, 1);
        let full = fake.applied.lock().unwrap().last().unwrap().clone();
        for shard in 1..4 {
            assert!(
                full.ends_with(&format!("delete table inet wasmplane-s{shard}\n"))
                    || full.contains(&format!("delete table inet wasmplane-s{shard}\ndelete table")),
                "{full}"
            );
        }
        // Stale chains of the remaining shard go by name; those of deleted tables with them.
        let in_s0: Vec<&String> =
            names.iter().skip(1).filter(|n| layout.table_of(&format!("svc/default/{n}")) == Table::shard(0)).collect();
        for n in &in_s0 {
            assert!(full.contains(&format!("delete chain inet wasmplane-s0 svc/default/{n}\n")), "{full}");
        }
        assert!(!full.contains("delete chain inet wasmplane-s0 svc/default/s0\n"), "a wanted chain stays");
        assert_eq!(full.matches("delete chain").count(), in_s0.len(), "{full}");
    }

    #[test]
    fn a_change_of_most_services_is_laid_out_at_once_a_small_one_waits_for_the_reconcile() {
        let fake = Fake::default();
        let mut dp = Dataplane::new(Box::new(fake.clone())).with_services_per_shard(2);
        dp.full_sync(Some(BTreeMap::new())).unwrap();
        assert_eq!(dp.layout().shards, 1);
        let service = |i: usize| {
            let n = format!("s{i}");
            let mut r = rules(&n, "10.244.0.1");
            r.elements = [(
                ("service-ips".into(), format_compact!("10.96.0.{i} . tcp . 80")),
                format_compact!("goto svc/default/{n}"),
            )]
            .into();
            (key(&n), Some(r))
        };
        // The first delivery of state after an empty start: all of it, one full sync.
        let stats = dp.sync((0..5).map(service).collect()).unwrap();
        assert!(stats.full && dp.layout().shards == 4, "{stats:?} {:?}", dp.layout());
        // A few more (9 would want 8 shards): incremental, the layout waits for a reconcile.
        let stats = dp.sync((5..9).map(service).collect()).unwrap();
        assert!(!stats.full && dp.layout().shards == 4, "{stats:?}");
        let delta = fake.applied.lock().unwrap().last().unwrap().clone();
        assert!(!delta.contains("flush table"), "{delta}");
        dp.full_sync(None).unwrap();
        assert_eq!(dp.layout().shards, 8);
        // Deleting services is counted too: down to 1, the next full sync uses one shard.
        dp.sync((1..9).map(|i| (key(&format!("s{i}")), None)).collect()).unwrap();
        assert_eq!(dp.layout().shards, 1, "8 of 9 services went: most of the table, laid out again at once");
    }

    /// A service with session affinity as data: `backends` numbered, the frontend counted
    /// and sent to the by-count chain of `seconds`.
    fn sticky(name: &str, ip: &str, seconds: u32, backends: &[&str]) -> ObjectRules {
        let front = format!("{ip} . tcp . 80");
        let mut r = ObjectRules { service_prefix: Some(format!("svc/default/{name}")), ..Default::default() };
        for (i, b) in backends.iter().enumerate() {
            r.elements
                .insert(("service-endpoints".into(), format_compact!("{front} . {i}")), format_compact!("{b} . 8080"));
        }
        let class = nft::AffinityClass { node_port: false, seconds };
        r.elements
            .insert((nft::CountedKeys::Frontends.set(backends.len()).into(), front.clone().into()), Default::default());
        r.elements.insert(
            ("service-ips".into(), front.into()),
            format_compact!("goto {}", class.by_count_chain(nft::CountedKeys::Frontends)),
        );
        r
    }

    #[test]
    fn a_new_affinity_timeout_is_a_full_sync_and_its_chains_go_when_no_frontend_uses_them() {
        let fake = Fake::default();
        let mut dp = Dataplane::new(Box::new(fake.clone()));
        let plain: BTreeMap<ObjectKey, ObjectRules> =
            (0..4).map(|i| (key(&format!("s{i}")), rules(&format!("s{i}"), "10.244.0.1"))).collect();
        dp.full_sync(Some(plain)).unwrap();
        let last = || fake.applied.lock().unwrap().last().unwrap().clone();
        assert!(!last().contains("affinity-600"), "no chains for a timeout nobody uses");

        // The first frontend with 600 s: a full sync that writes the class's chains.
        let stats =
            dp.sync(vec![(key("x"), Some(sticky("x", "10.96.1.1", 600, &["10.244.1.1", "10.244.1.2"])))]).unwrap();
        assert!(stats.full, "{stats:?}");
        let full = last();
        for chain in [
            "affinity-600-lookup",
            "affinity-600-pick-1",
            "affinity-600-pick-2",
            "affinity-600-pick-32",
            "affinity-600-pick-by-count",
        ] {
            assert!(full.contains(&format!("add chain inet wasmplane-s0 {chain}\n")), "{chain} missing");
        }
        // The next one, another count of the same timeout: its elements only.
        let stats = dp
            .sync(vec![(key("y"), Some(sticky("y", "10.96.1.2", 600, &["10.244.2.1", "10.244.2.2", "10.244.2.3"])))])
            .unwrap();
        assert!(!stats.full, "{stats:?}");
        let delta = last();
        assert!(
            delta.contains("10.96.1.2 . tcp . 80 : goto affinity-600-pick-by-count") && !delta.contains("chain"),
            "{delta}"
        );
        assert!(delta.contains("add element inet wasmplane-s0 frontends-3 { 10.96.1.2 . tcp . 80 }"), "{delta}");

        // A backend of y goes, one comes: the others keep their numbers (clients are
        // remembered by number), the newcomer takes the free one.
        dp.sync(vec![(key("y"), Some(sticky("y", "10.96.1.2", 600, &["10.244.2.1", "10.244.2.3", "10.244.2.4"])))])
            .unwrap();
        let y = dp.applied().get(&key("y")).unwrap().clone();
        let number = |i: usize| {
            y.elements.get(&("service-endpoints".into(), format_compact!("10.96.1.2 . tcp . 80 . {i}"))).cloned()
        };
        assert_eq!(
            [number(0), number(1), number(2)],
            [Some("10.244.2.1 . 8080".into()), Some("10.244.2.4 . 8080".into()), Some("10.244.2.3 . 8080".into())]
        );

        // Both gone: the next full sync deletes the class's chains it finds in the kernel.
        dp.sync(vec![(key("x"), None), (key("y"), None)]).unwrap();
        let s0 = Table::shard(0);
        fake.listing.lock().unwrap().chains =
            vec![(s0, "affinity-600-lookup".into()), (s0, "affinity-600-pick-3".into()), (s0, "pick-3".into())];
        dp.full_sync(None).unwrap();
        let full = last();
        assert!(
            full.contains("delete chain inet wasmplane-s0 affinity-600-lookup")
                && full.contains("delete chain inet wasmplane-s0 affinity-600-pick-3"),
            "{full}"
        );
        assert!(
            !full.contains("delete chain inet wasmplane-s0 pick-3")
                && !full.contains("add chain inet wasmplane-s0 affinity-600")
        );
    }

    /// A Local service without a local endpoint: its no-endpoint drop, through the drop
    /// chain when `logged` (as the controller renders it for a logging dataplane).
    fn local_without_endpoint(logged: bool) -> ObjectRules {
        let mut r = rules("local", "10.244.0.1");
        r.elements.insert(("no-endpoint-nodeports".into(), "tcp . 30082".into()), "drop".into());
        if logged {
            nft::service_drops::route_drops_through_log(&mut r);
        }
        r
    }

    #[test]
    fn a_full_sync_deletes_the_drop_chain_of_a_run_that_logged_service_drops() {
        let log = Some(nft::policy::VerdictLog::new(1001));
        // The kernel as a logging run left it: its drop chain among the skeleton's.
        let listing = || Listing {
            tables: vec![Table::MAIN, Table::shard(0)],
            chains: [
                (Table::MAIN, "drop-chain"),
                (Table::MAIN, "reject-chain"),
                (Table::shard(0), "pick-3"),
                (Table::shard(0), "svc/default/local"),
            ]
            .map(|(t, c)| (t, c.to_string()))
            .into(),
            sets: vec![],
        };
        let written = |log, logged_elements| {
            let fake = Fake { has_table: true, ..Default::default() };
            *fake.listing.lock().unwrap() = listing();
            let mut dp = Dataplane::new(Box::new(fake.clone())).with_service_drop_log(log);
            dp.full_sync(Some([(key("local"), local_without_endpoint(logged_elements))].into())).unwrap();
            dp.release().unwrap();
            fake.applied.lock().unwrap().last().unwrap().clone()
        };

        // Not logging now: the chain goes, after the elements that no longer go to it.
        let full = written(None, false);
        assert!(full.ends_with("delete chain inet wasmplane drop-chain\n"), "{full}");
        assert_eq!(
            full.matches("delete chain").count(),
            1,
            "the skeleton's chains and the wanted service's stay: {full}"
        );
        assert!(!full.contains("goto drop-chain") && full.contains("tcp . 30082 : drop"), "{full}");
        let flushed =
            full.find("flush map inet wasmplane no-endpoint-nodeports\n").expect("the no-endpoint maps are rewritten");
        assert!(
            flushed < full.rfind("add element").unwrap()
                && full.rfind("add element").unwrap() < full.find("delete chain").unwrap(),
            "{full}"
        );

        // Logging: the skeleton writes it, and it stays.
        let full = written(log, true);
        assert!(
            full.contains("add chain inet wasmplane drop-chain\n") && full.contains("tcp . 30082 : goto drop-chain"),
            "{full}"
        );
        assert!(!full.contains("delete chain"), "{full}");

        // An element still going to it (no such rendering without logging): kept, as a
        // delete would fail the whole transaction.
        let full = written(None, true);
        assert!(full.contains("tcp . 30082 : goto drop-chain") && !full.contains("delete chain"), "{full}");
    }

    #[test]
    fn a_full_sync_deletes_the_nat_chains_of_a_main_table_before_shards_once() {
        let fake = Fake { has_table: true, ..Default::default() };
        *fake.listing.lock().unwrap() = Listing {
            tables: vec![Table::MAIN],
            chains: ["nat-prerouting", "nat-output", "services", "masquerading", "svc/default/a"]
                .map(|c| (Table::MAIN, c.to_string()))
                .into(),
            sets: vec![],
        };
        let mut dp = Dataplane::new(Box::new(fake.clone()));
        dp.full_sync(Some([(key("a"), rules("a", "10.244.0.1"))].into())).unwrap();
        dp.release().unwrap();
        let full = fake.applied.lock().unwrap().last().unwrap().clone();
        for chain in ["nat-prerouting", "nat-output", "services", "svc/default/a"] {
            assert_eq!(full.matches(&format!("delete chain inet wasmplane {chain}\n")).count(), 1, "{chain}: {full}");
        }
        assert!(
            !full.contains("delete chain inet wasmplane masquerading")
                && full.contains("delete map inet wasmplane service-ips\n"),
            "{full}"
        );
    }

    #[test]
    fn release_writes_even_an_empty_state() {
        let fake = Fake { has_table: true, ..Default::default() };
        let mut dp = Dataplane::new(Box::new(fake.clone()));
        dp.full_sync(Some(BTreeMap::new())).unwrap();
        assert!(dp.release().unwrap().full);
        assert_eq!(fake.applied.lock().unwrap().len(), 1);
        assert_eq!(dp.release().unwrap(), SyncStats::default(), "only once");
    }

    #[test]
    fn a_fresh_kernel_is_written_at_once() {
        let fake = Fake::default();
        let mut dp = Dataplane::new(Box::new(fake.clone()));
        assert!(!dp.is_held());
        dp.full_sync(Some(BTreeMap::new())).unwrap();
        assert_eq!(fake.applied.lock().unwrap().len(), 1);
    }

    #[test]
    fn a_refused_write_is_not_forgotten() {
        let fake = Fake::default();
        let mut dp = Dataplane::new(Box::new(fake.clone()));
        dp.sync(vec![(key("a"), Some(rules("a", "10.244.0.1")))]).unwrap();
        *fake.refuse.lock().unwrap() = true;
        assert!(dp.sync(vec![(key("a"), Some(rules("a", "10.244.0.2")))]).is_err());
        // The kernel kept the old rules, and that is what is reported as applied.
        assert!(dp.render().contains("10.244.0.1"));
        *fake.refuse.lock().unwrap() = false;
        // The next reconcile writes what was wanted, in full.
        assert!(dp.full_sync(None).unwrap().full);
        assert!(dp.render().contains("10.244.0.2") && !dp.render().contains("10.244.0.1"));
        let stats = dp.sync(vec![(key("b"), Some(rules("b", "10.244.0.3")))]).unwrap();
        assert!(!stats.full, "back to incremental");
    }

    #[test]
    fn map_keys_have_one_owner_and_are_freed_by_their_owner() {
        let fake = Fake::default();
        let mut dp = Dataplane::new(Box::new(fake.clone()));
        dp.sync(vec![(key("a"), Some(rules("a", "10.244.0.1")))]).unwrap();
        dp.sync(vec![(key("b"), Some(rules("b", "10.244.0.2")))]).unwrap();
        let b = &dp.applied()[&key("b")];
        assert!(b.elements.is_empty() && b.warnings[0].contains("already belongs to default/a"), "{b:?}");
        // The owner's going hands the key to the object that wanted it, in the same
        // transaction: b is not translated again.
        dp.sync(vec![(key("a"), None)]).unwrap();
        let b = &dp.applied()[&key("b")];
        assert!(b.elements.len() == 1 && b.warnings.is_empty(), "{b:?}");
        let last = fake.applied.lock().unwrap().last().unwrap().clone();
        assert!(last.contains("delete chain inet wasmplane-s0 svc/default/a"), "{last}");
        assert!(
            last.contains("add element inet wasmplane-s0 service-ips { 10.96.0.1 . tcp . 80 : goto svc/default/b }"),
            "{last}"
        );
        assert!(dp.waiting.is_empty());
    }

    /// `rules` with the elements `(map, key, verdict)` only.
    fn elements(elements: &[(&str, &str, &str)]) -> ObjectRules {
        let mut r = ObjectRules::default();
        for (map, key, verdict) in elements {
            r.elements.insert(((*map).into(), (*key).into()), (*verdict).into());
        }
        r
    }

    #[test]
    fn a_frontend_and_a_node_port_have_one_owner_across_maps() {
        let fake = Fake::default();
        let mut dp = Dataplane::new(Box::new(fake.clone()));
        let last = || fake.applied.lock().unwrap().last().unwrap().clone();
        // web serves the frontend and the node port; dup, with the same ones and no
        // endpoints, would reject them (another map, the same frontend), and has a port of
        // its own. dup sorts first.
        let (web, dup) = (key("web"), key("dup"));
        let web_rules = elements(&[
            ("service-ips", "10.96.0.1 . tcp . 80", "goto pick-by-count"),
            ("service-endpoints", "10.96.0.1 . tcp . 80 . 0", "10.244.0.1 . 8080"),
            ("service-nodeports", "tcp . 30080", "goto nodeport-dispatch"),
        ]);
        let dup_rules = elements(&[
            ("no-endpoint-services", "10.96.0.1 . tcp . 80", "goto reject-chain"),
            ("no-endpoint-services", "10.96.0.1 . tcp . 81", "goto reject-chain"),
            ("no-endpoint-nodeports", "tcp . 30080", "goto reject-chain"),
        ]);
        dp.sync(vec![(web.clone(), Some(web_rules.clone()))]).unwrap();
        dp.sync(vec![(dup.clone(), Some(dup_rules.clone()))]).unwrap();
        let applied = &dp.applied()[&dup];
        let kept: Vec<&str> = applied.elements.keys().map(|(_, k)| k.as_str()).collect();
        assert_eq!(kept, ["10.96.0.1 . tcp . 81"], "only dup's own frontend");
        assert_eq!(
            applied.warnings,
            [
                "frontend 10.96.0.1 . tcp . 80 already belongs to default/web",
                "node port tcp . 30080 already belongs to default/web"
            ]
        );
        let written = last();
        assert!(written.contains("10.96.0.1 . tcp . 81 : goto reject-chain"), "{written}");
        assert!(!written.contains("10.96.0.1 . tcp . 80 : goto reject-chain"), "{written}");
        assert!(!written.contains("tcp . 30080 : goto reject-chain"), "{written}");

        // A full sync of both (a new translator's outputs), the waiting one first in key
        // order: the owner keeps what it has.
        dp.full_sync(Some(BTreeMap::from([(web.clone(), web_rules.clone()), (dup.clone(), dup_rules.clone())])))
            .unwrap();
        assert_eq!(dp.applied()[&web].elements.len(), 3);
        assert_eq!(dp.applied()[&dup].elements.len(), 1);

        // web loses its node port (its frontend stays its own): dup has the port at once.
        let web_without_node_port = elements(&[("service-ips", "10.96.0.1 . tcp . 80", "goto pick-by-count")]);
        dp.sync(vec![(web.clone(), Some(web_without_node_port))]).unwrap();
        assert_eq!(dp.applied()[&dup].elements.len(), 2, "the node port web let go is dup's");
        assert!(last().contains("tcp . 30080 : goto reject-chain"), "{}", last());
        // web goes, and dup has it all.
        dp.sync(vec![(web, None)]).unwrap();
        assert_eq!(dp.applied()[&dup].elements.len(), 3);
        assert!(dp.applied()[&dup].warnings.is_empty());
        assert!(last().contains("10.96.0.1 . tcp . 80 : goto reject-chain"), "{}", last());
        assert!(dp.waiting.is_empty());
    }

    /// Of the objects new to a sync that claim one frontend, the oldest gets it whatever
    /// their names: so after a restart (a new dataplane, offered everything at once, as a
    /// change or in full) the owner is the one that was. A waiting object gets it freed in
    /// the same order. Without ages, the first by key.
    #[test]
    fn the_oldest_claimant_gets_a_frontend_in_every_run_alike() {
        let frontend = |verdict: &str, created: Option<i64>| ObjectRules {
            created_unix: created,
            ..elements(&[("service-ips", "10.96.0.1 . tcp . 80", verdict)])
        };
        let (web, dup, zzz) = (key("web"), key("dup"), key("zzz"));
        let owner = |dp: &Dataplane| -> Vec<String> {
            dp.applied().iter().filter(|(_, r)| !r.elements.is_empty()).map(|(k, _)| k.name.to_string()).collect()
        };
        // "dup", created later, sorts first: offered in key order, it does not get it.
        let both = || {
            vec![
                (dup.clone(), Some(frontend("goto reject-chain", Some(200)))),
                (web.clone(), Some(frontend("goto pick-by-count", Some(100)))),
            ]
        };
        let mut restarted = Dataplane::new(Box::new(Fake::default()));
        restarted.sync(both()).unwrap();
        assert_eq!(owner(&restarted), ["web"]);
        assert_eq!(
            restarted.applied()[&dup].warnings,
            ["frontend 10.96.0.1 . tcp . 80 already belongs to default/web"]
        );
        let mut restarted = Dataplane::new(Box::new(Fake::default()));
        restarted.full_sync(Some(both().into_iter().map(|(k, r)| (k, r.unwrap())).collect())).unwrap();
        assert_eq!(owner(&restarted), ["web"]);
        // Of no age: the first by key.
        let mut ageless = Dataplane::new(Box::new(Fake::default()));
        ageless
            .sync(both().into_iter().map(|(k, r)| (k, r.map(|r| ObjectRules { created_unix: None, ..r }))).collect())
            .unwrap();
        assert_eq!(owner(&ageless), ["dup"]);

        // In a run, an owner keeps what it has; when it goes, the oldest waiting one gets it.
        let mut dp = Dataplane::new(Box::new(Fake::default()));
        dp.sync(both()).unwrap();
        dp.sync(vec![(zzz.clone(), Some(frontend("goto reject-chain", Some(50))))]).unwrap();
        assert_eq!(owner(&dp), ["web"], "the owner keeps it");
        dp.sync(vec![(web, None)]).unwrap();
        assert_eq!(owner(&dp), ["zzz"], "the oldest of those waiting, not the first by key");
    }

    #[test]
    fn a_shared_set_element_stays_while_any_object_wants_it() {
        let with_hairpin = |name: &str, pods: &[&str]| {
            let mut r = rules(name, pods[0]);
            r.elements.clear();
            for pod in pods {
                r.elements.insert(("hairpin".into(), format_compact!("{pod} . {pod}")), CompactString::default());
            }
            r
        };
        let fake = Fake::default();
        let mut dp = Dataplane::new(Box::new(fake.clone()));
        let last = || fake.applied.lock().unwrap().last().unwrap().clone();
        dp.sync(vec![(key("a"), Some(with_hairpin("a", &["10.244.0.1"])))]).unwrap();
        assert!(last().contains("add element inet wasmplane hairpin { 10.244.0.1 . 10.244.0.1 }"), "{}", last());
        // Another owner: neither refused (as a map key would be) nor added twice.
        let stats = dp.sync(vec![(key("b"), Some(with_hairpin("b", &["10.244.0.1", "10.244.0.2"])))]).unwrap();
        assert!(!stats.full);
        assert!(dp.applied()[&key("b")].warnings.is_empty(), "{:?}", dp.applied()[&key("b")]);
        assert!(
            last().contains("add element inet wasmplane hairpin { 10.244.0.2 . 10.244.0.2 }\n")
                && !last().contains("10.244.0.1 . "),
            "{}",
            last()
        );
        // The first owner goes: the pair stays for the second.
        dp.sync(vec![(key("a"), None)]).unwrap();
        assert!(!last().contains("hairpin"), "{}", last());
        // The last owner lets go of one and, in the same transaction, a new object takes it.
        dp.sync(vec![
            (key("b"), Some(with_hairpin("b", &["10.244.0.1"]))),
            (key("c"), Some(with_hairpin("c", &["10.244.0.2"]))),
        ])
        .unwrap();
        assert!(!last().contains("hairpin"), "{}", last());
        dp.sync(vec![(key("b"), None), (key("c"), None)]).unwrap();
        assert!(
            last()
                .contains("delete element inet wasmplane hairpin { 10.244.0.1 . 10.244.0.1, 10.244.0.2 . 10.244.0.2 }"),
            "{}",
            last()
        );
        // A full sync counts afresh from what it wrote.
        dp.full_sync(Some(
            [(key("d"), with_hairpin("d", &["10.244.0.3"])), (key("e"), with_hairpin("e", &["10.244.0.3"]))].into(),
        ))
        .unwrap();
        dp.sync(vec![(key("d"), None)]).unwrap();
        assert!(!last().contains("hairpin"), "{}", last());
        dp.sync(vec![(key("e"), None)]).unwrap();
        assert!(last().contains("delete element inet wasmplane hairpin { 10.244.0.3 . 10.244.0.3 }"), "{}", last());
    }

    #[test]
    fn kept_transaction_text_is_bounded() {
        let big = "add rule inet wasmplane c accept\n".repeat(KEPT_TEXT_BYTES / 10);
        let kept = kept_text(big.clone(), KEPT_TEXT_BYTES);
        assert!(
            kept.len() < KEPT_TEXT_BYTES + 100 && kept.ends_with("more bytes not kept\n"),
            "{}",
            &kept[kept.len() - 80..]
        );
        assert!(big.starts_with(kept.split("\n# …").next().unwrap()));
        let mut recorder = Recorder::default();
        for _ in 0..3 {
            recorder.apply(&big).unwrap();
        }
        assert!(
            recorder.transactions.iter().map(String::len).sum::<usize>() <= KEPT_TEXT_BYTES + 100,
            "the log keeps at most ~{KEPT_TEXT_BYTES} bytes"
        );
        for i in 0..100 {
            recorder.apply(&format!("add chain inet wasmplane c{i}\n")).unwrap();
        }
        assert_eq!(recorder.transactions.len(), 64);
        assert_eq!(recorder.transactions.last().unwrap(), "add chain inet wasmplane c99\n");
    }

    #[test]
    fn a_live_writer_keeps_the_start_of_its_last_transaction() {
        let mut dp = Dataplane::new(Box::new(Fake::default()));
        let objects: BTreeMap<ObjectKey, ObjectRules> =
            (0..2000).map(|i| (key(&format!("s{i}")), rules(&format!("s{i}"), "10.244.0.1"))).collect();
        let stats = dp.full_sync(Some(objects)).unwrap();
        assert!(stats.statements > 4000, "{stats:?}");
        let kept = &dp.last_transaction;
        assert!(
            kept.len() < LAST_TRANSACTION_BYTES + 100 && kept.ends_with("more bytes not kept\n"),
            "{} bytes",
            kept.len()
        );
        // An incremental one is kept whole.
        dp.sync(vec![(key("s1"), None)]).unwrap();
        assert!(
            dp.last_transaction.contains("svc/default/s1") && !dp.last_transaction.contains("not kept"),
            "{}",
            dp.last_transaction
        );
    }

    #[test]
    fn a_rejection_quotes_the_part_of_the_statement_nft_points_at() {
        // nft's output for line 2, as it prints it for `nft -f -`.
        let short = "add chain inet wasmplane svc/a\nadd rule inet wasmplane svc/a jump nowhere\n";
        let stderr = "/dev/stdin:2:36-47: Error: Could not process rule: No such file or directory\nadd rule inet wasmplane svc/a jump nowhere\n                                   ^^^^^^^^^^^^\n";
        assert_eq!(
            describe_rejection(stderr, short),
            "Could not process rule: No such file or directory: add rule inet wasmplane svc/a jump nowhere"
        );
        // A long statement: its head and the element, not nft's 1,000 characters and blanks.
        let elements: Vec<String> = (0..100).map(|i| format!("10.0.0.{i} : goto svc/a")).collect();
        let long = format!(
            "add table inet t\nadd element inet t m {{ {}, 10.9.9.9 : goto nope, 10.9.9.10 : goto svc/a }}\n",
            elements.join(", ")
        );
        let at = long.lines().nth(1).unwrap().find("10.9.9.9").unwrap() + 1;
        let stderr = format!(
            "/dev/stdin:2:{at}-{}: Error: Could not process rule: No such file or directory\n{}\n{}^^^^^^^^\n",
            at + 7,
            &long.lines().nth(1).unwrap()[..1023],
            " ".repeat(at - 1)
        );
        assert_eq!(
            describe_rejection(&stderr, &long),
            "Could not process rule: No such file or directory: add element inet t m { … 10.9.9.9 : goto nope …"
        );
        // Whatever nft says without a location is kept as it is, after a located error too.
        assert_eq!(describe_rejection("Error: syntax error\n", short), "Error: syntax error");
        let both = format!("{stderr}Error: another\n");
        assert!(describe_rejection(&both, &long).ends_with("10.9.9.9 : goto nope …\nError: another"));
        // A location past the transaction: nft's line kept.
        let stray = "/dev/stdin:9:1-3: Error: oops\n";
        assert_eq!(describe_rejection(stray, short), "/dev/stdin:9:1-3: Error: oops");
    }
}
