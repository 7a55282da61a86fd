//! The pod's veth pair through rtnetlink.
//!
//! A netlink socket belongs to the network namespace of the thread that created it, for its
//! whole life. So every operation runs on a dedicated, short-lived thread with its own
//! current-thread runtime: it `setns`es into the node namespace (when the daemon is told to
//! work in one) and opens a socket there, then into the pod namespace and opens another.
//! The thread ends with the operation, so no pooled thread is ever left in a pod namespace.
//!
//! Layout (the same on every node, no bridge), per family (IPv6: /128, no duplicate
//! address detection, so the addresses work at once):
//! ```text
//!  pod netns: <if_name> ip/32, route gw/32 scope link, default via gw
//!  node:      <host_if> gw/32 (answers the pod's ARP or neighbour solicitation for gw),
//!             route ip/32 dev <host_if>
//! ```

use std::fs::File;
use std::net::{IpAddr, Ipv4Addr, Ipv6Addr};
use std::os::fd::AsRawFd as _;
use std::path::{Path, PathBuf};

use futures::TryStreamExt as _;
use rtnetlink::packet_route::address::{AddressAttribute, AddressFlags, AddressHeaderFlags};
use rtnetlink::packet_route::link::{InfoData, InfoVeth, LinkAttribute, LinkFlags, LinkMessage};
use rtnetlink::packet_route::route::{RouteAddress, RouteAttribute, RouteHeader, RouteMessage, RouteScope, RouteType};
use rtnetlink::{Handle, LinkUnspec, LinkVeth, RouteMessageBuilder};

use crate::error::Error;
use crate::protocol::{PodAddress, PodNetwork};

/// Everything one pod interface is made of.
#[derive(Clone, Debug)]
pub(crate) struct LinkSpec {
    /// The namespace to do the node side in; `None`: the daemon's own.
    pub host_netns: Option<PathBuf>,
    pub pod_netns: PathBuf,
    pub host_if: String,
    pub pod_if: String,
    /// One per family.
    pub addresses: Vec<PodAddress>,
    pub mtu: Option<u32>,
}

/// The node-side interface name for a container interface: stable across restarts (DEL
/// after a daemon upgrade still finds it), at most 15 bytes.
pub fn host_if_name(container_id: &str, if_name: &str) -> String {
    // FNV-1a: tiny, and stable across Rust versions (std's hasher is not).
    let mut h: u64 = 0xcbf2_9ce4_8422_2325;
    for b in container_id.bytes().chain([0]).chain(if_name.bytes()) {
        h ^= u64::from(b);
        h = h.wrapping_mul(0x0100_0000_01b3);
    }
    format!("wp{:012x}", h >> 16)
}

/// Creates (or, for a repeated ADD, re-applies) the pod's interface.
pub(crate) async fn setup(spec: LinkSpec) -> Result<PodNetwork, Error> {
    on_thread("wpcni-add", move || {
        let pod_ns = open_netns(&spec.pod_netns)?;
        block_on(async {
            let (host, pod) = connect_both(spec.host_netns.as_deref(), &pod_ns, &spec.pod_netns)?;
            let sandbox = spec.pod_netns.display().to_string();
            if let Some(hl) = link_by_name(&host, &spec.host_if).await? {
                match link_by_name(&pod, &spec.pod_if).await? {
                    Some(pl) if peer_index(&pl) == Some(hl.header.index) => {
                        // Repeated ADD of the same container: the pair is ours, make sure it
                        // is complete and answer as the first ADD did.
                        tracing::info!(host_if = %spec.host_if, netns = %sandbox, "interface exists already, re-applying");
                        return configure(&host, &pod, &spec).await;
                    }
                    _ => {
                        // Leftover of an interrupted ADD (its pod side is gone): start over.
                        tracing::warn!(host_if = %spec.host_if, "removing stale host interface");
                        del_link(&host, hl.header.index, &spec.host_if).await?;
                    }
                }
            }
            if link_by_name(&pod, &spec.pod_if).await?.is_some() {
                return Err(Error::InterfaceExists { if_name: spec.pod_if.clone(), netns: sandbox });
            }
            let mut peer = LinkUnspec::new_with_name(&spec.pod_if).setns_by_fd(pod_ns.as_raw_fd());
            let mut veth = LinkVeth::new(&spec.host_if, &spec.pod_if);
            if let Some(mtu) = spec.mtu {
                peer = peer.mtu(mtu);
                veth = veth.mtu(mtu);
            }
            // The peer is created directly in the pod namespace under its final name: no
            // temporary name on the node, no rename, no window where it is visible there.
            let msg = veth.set_info_data(InfoData::Veth(InfoVeth::Peer(peer.build()))).build();
            host.link().add(msg).execute().await.map_err(|e| Error::netlink(format!("creating veth {} <-> {}:{}", spec.host_if, sandbox, spec.pod_if), e))?;
            let result = configure(&host, &pod, &spec).await;
            if result.is_err() {
                // Undo: deleting one end of a veth removes both.
                if let Ok(Some(hl)) = link_by_name(&host, &spec.host_if).await {
                    let _ = del_link(&host, hl.header.index, &spec.host_if).await;
                }
            }
            result
        })
    })
    .await
}

/// Turns on forwarding in the node namespace, IPv4's and, for a node with IPv6 pods,
/// IPv6's. (`/proc/sys/net` resolves to the namespace of the thread that opens the file, so
/// this too runs on a thread inside it.)
pub(crate) async fn enable_forwarding(host_netns: Option<PathBuf>, ipv6: bool) -> Result<(), Error> {
    on_thread("wpcni-sysctl", move || {
        if let Some(ns) = &host_netns {
            enter(&open_netns(ns)?, ns)?;
        }
        let ipv6_path = ipv6.then_some("/proc/sys/net/ipv6/conf/all/forwarding");
        for path in std::iter::once("/proc/sys/net/ipv4/ip_forward").chain(ipv6_path).map(Path::new) {
            if std::fs::read_to_string(path).is_ok_and(|v| v.trim() == "1") {
                continue;
            }
            std::fs::write(path, b"1").map_err(|source| Error::Io { path: path.into(), source })?;
            tracing::info!(sysctl = %path.display(), "enabled forwarding for pod traffic");
        }
        Ok(())
    })
    .await
}

/// The names of every interface in the node namespace.
pub(crate) async fn link_names(host_netns: Option<PathBuf>) -> Result<std::collections::HashSet<String>, Error> {
    on_thread("wpcni-links", move || {
        block_on(async {
            if let Some(ns) = &host_netns {
                enter(&open_netns(ns)?, ns)?;
            }
            let host = connect()?;
            let links: Vec<LinkMessage> =
                host.link().get().execute().try_collect().await.map_err(|e| Error::netlink("listing interfaces", e))?;
            Ok(links
                .iter()
                .flat_map(|l| l.attributes.iter())
                .filter_map(|a| match a {
                    LinkAttribute::IfName(n) => Some(n.clone()),
                    _ => None,
                })
                .collect())
        })
    })
    .await
}

/// The MTU a link reports.
fn link_mtu(link: &LinkMessage) -> Option<u32> {
    link.attributes.iter().find_map(|a| match a {
        LinkAttribute::Mtu(m) => Some(*m),
        _ => None,
    })
}

/// The device the node's default route leaves by.
#[derive(Clone, Debug, PartialEq, Eq)]
pub(crate) struct RouteDevice {
    pub name: String,
    pub mtu: u32,
    /// The route is IPv6's (the node has no IPv4 default route).
    pub ipv6: bool,
}

/// The device of the node's IPv4 default route, else of its IPv6 one (what Cilium and Calico
/// take the pods' MTU from); `None` when the node has neither.
pub(crate) async fn default_route_device(host_netns: Option<PathBuf>) -> Result<Option<RouteDevice>, Error> {
    on_thread("wpcni-mtu", move || {
        block_on(async {
            if let Some(ns) = &host_netns {
                enter(&open_netns(ns)?, ns)?;
            }
            let host = connect()?;
            for family in [IpAddr::V4(Ipv4Addr::UNSPECIFIED), IpAddr::V6(Ipv6Addr::UNSPECIFIED)] {
                let Some(index) = default_route_oif(&routes(&host, family).await?) else {
                    continue;
                };
                let stream = host.link().get().match_index(index).execute();
                futures::pin_mut!(stream);
                let link = match stream.try_next().await {
                    Ok(Some(link)) => link,
                    // Gone since the route dump: as if that route were not there.
                    Ok(None) => continue,
                    Err(e) if is_errno(&e, libc::ENODEV) => continue,
                    Err(e) => return Err(Error::netlink(format!("looking up interface {index}"), e)),
                };
                let name = link.attributes.iter().find_map(|a| match a {
                    LinkAttribute::IfName(n) => Some(n.clone()),
                    _ => None,
                });
                let mtu =
                    link_mtu(&link).ok_or_else(|| Error::Internal(format!("interface {index} reports no MTU")))?;
                return Ok(Some(RouteDevice {
                    name: name.unwrap_or_else(|| index.to_string()),
                    mtu,
                    ipv6: family.is_ipv6(),
                }));
            }
            Ok(None)
        })
    })
    .await
}

/// Of one family's routes (a dump: every table), the output interface of the main table's
/// default route with the lowest metric. A multipath route counts by its first next hop; one
/// through a nexthop object names no interface here and is passed over.
fn default_route_oif(routes: &[RouteMessage]) -> Option<u32> {
    routes
        .iter()
        .filter(|r| r.header.destination_prefix_length == 0 && r.header.kind == RouteType::Unicast)
        .filter(|r| {
            let table = r.attributes.iter().find_map(|a| match a {
                RouteAttribute::Table(t) => Some(*t),
                _ => None,
            });
            table.unwrap_or(u32::from(r.header.table)) == u32::from(RouteHeader::RT_TABLE_MAIN)
        })
        .filter_map(|r| {
            let oif = r.attributes.iter().find_map(|a| match a {
                RouteAttribute::Oif(i) => Some(*i),
                RouteAttribute::MultiPath(hops) => hops.first().map(|h| h.interface_index),
                _ => None,
            })?;
            // No priority attribute: metric 0.
            let metric = r.attributes.iter().find_map(|a| match a {
                RouteAttribute::Priority(p) => Some(*p),
                _ => None,
            });
            Some((metric.unwrap_or(0), oif))
        })
        .min_by_key(|(metric, _)| *metric)
        .map(|(_, oif)| oif)
}

/// Removes the pod's interface (both ends, and with them their routes). `Ok(false)` when
/// there was nothing to remove: DEL is idempotent.
pub(crate) async fn teardown(host_netns: Option<PathBuf>, host_if: String) -> Result<bool, Error> {
    on_thread("wpcni-del", move || {
        block_on(async {
            if let Some(ns) = &host_netns {
                enter(&open_netns(ns)?, ns)?;
            }
            let host = connect()?;
            match link_by_name(&host, &host_if).await? {
                Some(hl) => del_link(&host, hl.header.index, &host_if).await,
                None => Ok(false),
            }
        })
    })
    .await
}

/// Verifies the interface, address and routes on both sides are as ADD left them.
pub(crate) async fn check(spec: LinkSpec) -> Result<(), Error> {
    on_thread("wpcni-check", move || {
        let pod_ns = open_netns(&spec.pod_netns)?;
        block_on(async {
            let (host, pod) = connect_both(spec.host_netns.as_deref(), &pod_ns, &spec.pod_netns)?;
            let fail = |what: String| Err(Error::CheckFailed(what));
            let Some(hl) = link_by_name(&host, &spec.host_if).await? else {
                return fail(format!("node-side interface {} is missing", spec.host_if));
            };
            if !is_up(&hl) {
                return fail(format!("node-side interface {} is down", spec.host_if));
            }
            let Some(pl) = link_by_name(&pod, &spec.pod_if).await? else {
                return fail(format!("interface {} is missing in {}", spec.pod_if, spec.pod_netns.display()));
            };
            if !is_up(&pl) {
                return fail(format!("interface {} is down in {}", spec.pod_if, spec.pod_netns.display()));
            }
            // Both ends as ADD sized them: a pod left at another MTU black-holes large packets.
            if let Some(mtu) = spec.mtu {
                for (link, name) in [
                    (&hl, format!("node-side interface {}", spec.host_if)),
                    (&pl, format!("interface {} in {}", spec.pod_if, spec.pod_netns.display())),
                ] {
                    let actual = link_mtu(link);
                    if actual != Some(mtu) {
                        return fail(format!(
                            "{name} has MTU {}, the pods' is {mtu}",
                            actual.map_or("none".into(), |m| m.to_string())
                        ));
                    }
                }
            }
            for a in &spec.addresses {
                let len = a.host_prefix();
                if !has_address(&pod, pl.header.index, a.ip, len).await? {
                    return fail(format!("interface {} lacks address {}/{len}", spec.pod_if, a.ip));
                }
                let unspecified =
                    if a.ip.is_ipv4() { Ipv4Addr::UNSPECIFIED.into() } else { Ipv6Addr::UNSPECIFIED.into() };
                let pod_routes = routes(&pod, a.ip).await?;
                if !pod_routes.iter().any(|r| route_is(r, unspecified, 0, Some(a.gateway), pl.header.index)) {
                    return fail(format!("default route via {} on {} is missing", a.gateway, spec.pod_if));
                }
                let host_routes = routes(&host, a.ip).await?;
                if !host_routes.iter().any(|r| route_is(r, a.ip, len, None, hl.header.index)) {
                    return fail(format!("node route {}/{len} dev {} is missing", a.ip, spec.host_if));
                }
            }
            Ok(())
        })
    })
    .await
}

/// Links up, addresses and routes on both sides. Every step replaces, so it also repairs.
async fn configure(host: &Handle, pod: &Handle, spec: &LinkSpec) -> Result<PodNetwork, Error> {
    let hl = link_by_name(host, &spec.host_if)
        .await?
        .ok_or_else(|| Error::Internal(format!("{} vanished", spec.host_if)))?;
    let pl =
        link_by_name(pod, &spec.pod_if).await?.ok_or_else(|| Error::Internal(format!("{} vanished", spec.pod_if)))?;
    let (hi, pi) = (hl.header.index, pl.header.index);
    let ctx = |what: &str| format!("{what} ({} / {}:{})", spec.host_if, spec.pod_netns.display(), spec.pod_if);

    // Links must be up before routes through them are accepted. The MTU again: a repeated
    // ADD after the node's MTU changed brings an existing pair in line.
    let up = |index: u32| {
        let link = LinkUnspec::new_with_index(index).up();
        match spec.mtu {
            Some(mtu) => link.mtu(mtu).build(),
            None => link.build(),
        }
    };
    host.link().set(up(hi)).execute().await.map_err(|e| Error::netlink(ctx("setting node side up"), e))?;
    pod.link().set(up(pi)).execute().await.map_err(|e| Error::netlink(ctx("setting pod side up"), e))?;

    for a in &spec.addresses {
        let len = a.host_prefix();
        add_address(host, hi, a.gateway, len)
            .await
            .map_err(|e| Error::netlink(ctx("adding the gateway address"), e))?;
        replace_route(host, link_route(a.ip, len, hi))
            .await
            .map_err(|e| Error::netlink(ctx("adding the node route to the pod"), e))?;
        add_address(pod, pi, a.ip, len).await.map_err(|e| Error::netlink(ctx("adding the pod address"), e))?;
        replace_route(pod, link_route(a.gateway, len, pi))
            .await
            .map_err(|e| Error::netlink(ctx("adding the pod route to the gateway"), e))?;
        replace_route(pod, default_route(a.gateway, pi))
            .await
            .map_err(|e| Error::netlink(ctx("adding the pod default route"), e))?;
    }

    Ok(PodNetwork {
        host_if: spec.host_if.clone(),
        host_mac: mac(&hl),
        pod_if: spec.pod_if.clone(),
        pod_mac: mac(&pl),
        sandbox: spec.pod_netns.display().to_string(),
        addresses: spec.addresses.clone(),
        mtu: spec.mtu,
    })
}

/// Adds (or keeps) `ip/len` on the interface. IPv6 addresses skip duplicate address
/// detection: the pod's and the gateway's are ours alone on this veth, and a tentative
/// address would leave the pod without IPv6 for a second after ADD returned.
async fn add_address(h: &Handle, index: u32, ip: IpAddr, len: u8) -> Result<(), rtnetlink::Error> {
    let mut req = h.address().add(index, ip, len).replace();
    if ip.is_ipv6() {
        let msg = req.message_mut();
        msg.header.flags |= AddressHeaderFlags::Nodad;
        msg.attributes.push(AddressAttribute::Flags(AddressFlags::Nodad));
    }
    req.execute().await
}

/// Adds `route`, or replaces the one to the same destination: a repeated ADD repairs.
async fn replace_route(h: &Handle, route: RouteMessage) -> Result<(), rtnetlink::Error> {
    h.route().add(route).replace().execute().await
}

/// `dst/len dev <index>`, on-link (IPv4's scope link; IPv6 routes have no scope).
fn link_route(dst: IpAddr, len: u8, index: u32) -> RouteMessage {
    match dst {
        IpAddr::V4(dst) => RouteMessageBuilder::<Ipv4Addr>::new()
            .destination_prefix(dst, len)
            .output_interface(index)
            .scope(RouteScope::Link)
            .build(),
        IpAddr::V6(dst) => {
            RouteMessageBuilder::<Ipv6Addr>::new().destination_prefix(dst, len).output_interface(index).build()
        }
    }
}

/// The family's default route via `gateway` on the interface.
fn default_route(gateway: IpAddr, index: u32) -> RouteMessage {
    match gateway {
        IpAddr::V4(gw) => RouteMessageBuilder::<Ipv4Addr>::new().gateway(gw).output_interface(index).build(),
        IpAddr::V6(gw) => RouteMessageBuilder::<Ipv6Addr>::new().gateway(gw).output_interface(index).build(),
    }
}

/// Runs `f` on a fresh thread and awaits its result without blocking the caller's runtime.
async fn on_thread<T: Send + 'static>(
    name: &str,
    f: impl FnOnce() -> Result<T, Error> + Send + 'static,
) -> Result<T, Error> {
    let (tx, rx) = tokio::sync::oneshot::channel();
    std::thread::Builder::new()
        .name(name.into())
        .spawn(move || {
            let _ = tx.send(f());
        })
        .map_err(|e| Error::Internal(format!("spawning a netns worker: {e}")))?;
    rx.await.map_err(|_| Error::Internal("netns worker panicked".into()))?
}

fn block_on<T>(f: impl Future<Output = Result<T, Error>>) -> Result<T, Error> {
    tokio::runtime::Builder::new_current_thread()
        .enable_io()
        .build()
        .map_err(|e| Error::Internal(format!("netns worker runtime: {e}")))?
        .block_on(f)
}

fn open_netns(path: &Path) -> Result<File, Error> {
    File::open(path).map_err(|e| Error::Netns { path: path.into(), reason: format!("cannot open: {e}") })
}

/// Moves the current thread into the namespace `file` refers to.
fn enter(file: &File, path: &Path) -> Result<(), Error> {
    // SAFETY: plain syscall on a descriptor we own; it changes only this thread's network
    // namespace, and this thread is dedicated to one operation.
    let rc = unsafe { libc::setns(file.as_raw_fd(), libc::CLONE_NEWNET) };
    if rc != 0 {
        return Err(Error::Netns { path: path.into(), reason: format!("setns: {}", std::io::Error::last_os_error()) });
    }
    Ok(())
}

/// A netlink socket in the thread's current namespace, driven by the thread's runtime.
fn connect() -> Result<Handle, Error> {
    let (conn, handle, _) =
        rtnetlink::new_connection().map_err(|e| Error::Internal(format!("opening a netlink socket: {e}")))?;
    tokio::spawn(conn);
    Ok(handle)
}

fn connect_both(host_netns: Option<&Path>, pod_ns: &File, pod_path: &Path) -> Result<(Handle, Handle), Error> {
    if let Some(ns) = host_netns {
        enter(&open_netns(ns)?, ns)?;
    }
    let host = connect()?;
    enter(pod_ns, pod_path)?;
    let pod = connect()?;
    Ok((host, pod))
}

fn is_errno(e: &rtnetlink::Error, errno: i32) -> bool {
    matches!(e, rtnetlink::Error::NetlinkError(m) if m.raw_code() == -errno)
}

async fn link_by_name(h: &Handle, name: &str) -> Result<Option<LinkMessage>, Error> {
    let stream = h.link().get().match_name(name.to_string()).execute();
    futures::pin_mut!(stream);
    match stream.try_next().await {
        Ok(link) => Ok(link),
        Err(e) if is_errno(&e, libc::ENODEV) => Ok(None),
        Err(e) => Err(Error::netlink(format!("looking up interface {name}"), e)),
    }
}

async fn del_link(h: &Handle, index: u32, name: &str) -> Result<bool, Error> {
    match h.link().del(index).execute().await {
        Ok(()) => Ok(true),
        // Gone in between (its peer's namespace was destroyed): what we wanted.
        Err(e) if is_errno(&e, libc::ENODEV) => Ok(false),
        Err(e) => Err(Error::netlink(format!("deleting interface {name}"), e)),
    }
}

async fn has_address(h: &Handle, index: u32, ip: IpAddr, len: u8) -> Result<bool, Error> {
    let stream = h.address().get().set_link_index_filter(index).execute();
    let addrs: Vec<_> = stream.try_collect().await.map_err(|e| Error::netlink("listing addresses", e))?;
    Ok(addrs.iter().any(|a| {
        a.header.index == index
            && a.header.prefix_len == len
            && a.attributes.iter().any(|attr| matches!(attr, AddressAttribute::Address(x) if *x == ip))
    }))
}

/// The routes of `like`'s family.
async fn routes(h: &Handle, like: IpAddr) -> Result<Vec<RouteMessage>, Error> {
    let query = match like {
        IpAddr::V4(_) => RouteMessageBuilder::<Ipv4Addr>::new().build(),
        IpAddr::V6(_) => RouteMessageBuilder::<Ipv6Addr>::new().build(),
    };
    h.route().get(query).execute().try_collect().await.map_err(|e| Error::netlink("listing routes", e))
}

fn route_is(r: &RouteMessage, dst: IpAddr, len: u8, gw: Option<IpAddr>, oif: u32) -> bool {
    let ip = |a: &RouteAddress| match a {
        RouteAddress::Inet(v4) => Some(IpAddr::V4(*v4)),
        RouteAddress::Inet6(v6) => Some(IpAddr::V6(*v6)),
        _ => None,
    };
    let attr_dst = r.attributes.iter().find_map(|a| match a {
        RouteAttribute::Destination(d) => ip(d),
        _ => None,
    });
    let attr_gw = r.attributes.iter().find_map(|a| match a {
        RouteAttribute::Gateway(g) => ip(g),
        _ => None,
    });
    let attr_oif = r.attributes.iter().find_map(|a| match a {
        RouteAttribute::Oif(i) => Some(*i),
        _ => None,
    });
    // A default route carries no destination attribute.
    r.header.destination_prefix_length == len
        && (attr_dst == Some(dst) || (attr_dst.is_none() && len == 0))
        && attr_gw == gw
        && attr_oif == Some(oif)
}

fn peer_index(link: &LinkMessage) -> Option<u32> {
    link.attributes.iter().find_map(|a| match a {
        LinkAttribute::Link(i) => Some(*i),
        _ => None,
    })
}

fn is_up(link: &LinkMessage) -> bool {
    link.header.flags.contains(LinkFlags::Up)
}

fn mac(link: &LinkMessage) -> String {
    link.attributes
        .iter()
        .find_map(|a| match a {
            LinkAttribute::Address(bytes) => {
                Some(bytes.iter().map(|b| format!("{b:02x}")).collect::<Vec<_>>().join(":"))
            }
            _ => None,
        })
        .unwrap_or_default()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn host_if_names_are_short_stable_and_distinct() {
        let a = host_if_name("abc", "eth0");
        assert!(a.len() <= 15, "{a}");
        assert_eq!(a, host_if_name("abc", "eth0"));
        assert_ne!(a, host_if_name("abc", "eth1"));
        assert_ne!(a, host_if_name("abd", "eth0"));
        // Separator: ("ab","ceth0") and ("abc","eth0") must not collide.
        assert_ne!(host_if_name("ab", "ceth0"), a);
    }

    /// The pods' MTU follows the main table's default route with the lowest metric, in
    /// whatever order the dump lists them; other tables, other destinations and routes that
    /// are not unicast do not count.
    #[test]
    fn the_default_route_with_the_lowest_metric_names_the_device() {
        use rtnetlink::packet_route::route::RouteNextHop;
        let gw = Ipv4Addr::new(192, 0, 2, 1);
        let default = |oif: u32, metric: Option<u32>| {
            let b = RouteMessageBuilder::<Ipv4Addr>::new().gateway(gw).output_interface(oif);
            match metric {
                Some(m) => b.priority(m).build(),
                None => b.build(),
            }
        };
        let other_table = RouteMessageBuilder::<Ipv4Addr>::new().gateway(gw).output_interface(7).table_id(100).build();
        let other_table_attr =
            RouteMessageBuilder::<Ipv4Addr>::new().gateway(gw).output_interface(8).table_id(1000).build();
        let unreachable = RouteMessageBuilder::<Ipv4Addr>::new().kind(RouteType::Unreachable).build();
        let subnet = link_route(IpAddr::V4(Ipv4Addr::new(192, 0, 2, 0)), 24, 9);
        let ignored = [other_table, other_table_attr, unreachable, subnet];
        assert_eq!(default_route_oif(&ignored), None);

        let routes = [&ignored[..], &[default(2, Some(600)), default(3, Some(100)), default(4, Some(1024))]].concat();
        assert_eq!(default_route_oif(&routes), Some(3));
        let mut reversed = routes.clone();
        reversed.reverse();
        assert_eq!(default_route_oif(&reversed), Some(3));
        // No metric is metric 0.
        assert_eq!(default_route_oif(&[default(2, Some(1)), default(5, None)]), Some(5));
        // A multipath default route: its first next hop's interface.
        let hop = |index: u32| {
            let mut hop = RouteNextHop::default();
            hop.interface_index = index;
            hop
        };
        let multipath = RouteMessageBuilder::<Ipv4Addr>::new().multipath(vec![hop(6), hop(2)]).priority(10).build();
        assert_eq!(default_route_oif(&[default(2, Some(20)), multipath]), Some(6));
    }
}
