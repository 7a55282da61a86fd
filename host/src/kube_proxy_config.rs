//! `wasmplane run --kube-proxy-config FILE`: kube-proxy's own configuration file (a
//! `KubeProxyConfiguration`, the `config.conf` key of its ConfigMap as kubeadm writes it)
//! turned into the `wasmplane run` flags that do the same, so that a cluster moving off
//! kube-proxy keeps the settings it chose. What wasmplane cannot honour is said, field by
//! field, but only where the file sets it to something else than kube-proxy's default
//! (kubeadm writes every field, mostly zero values that kube-proxy replaces by its defaults).
//!
//! Durations are Go's (`24h0m0s`, `1m30s`, `0s`) and must be whole seconds: every flag they
//! map to counts seconds, and cutting `500ms` down to 0 would turn it into "leave the
//! kernel's" (0 means that for the conntrack timeouts), the opposite of what was meant.

use std::collections::BTreeSet;
use std::path::{Path, PathBuf};
use std::time::Duration;

use serde::Deserialize;
use serde_yaml::Value;

/// What a KubeProxyConfiguration means for `wasmplane run`.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct KubeProxySettings {
    /// `wasmplane run` flags, one `--flag=value` (or `--flag`) per element.
    pub args: Vec<String>,
    /// "ignored: FIELD (why)" for each setting of the file that wasmplane does not honour.
    pub warnings: Vec<String>,
}

#[derive(Debug, thiserror::Error)]
pub enum KubeProxyConfigError {
    #[error("reading {}: {source}", path.display())]
    Read { path: PathBuf, source: std::io::Error },
    #[error("{}: {source}", path.display())]
    Invalid { path: PathBuf, source: InvalidKubeProxyConfig },
}

/// Why a KubeProxyConfiguration's text is refused.
#[derive(Debug, thiserror::Error)]
pub enum InvalidKubeProxyConfig {
    #[error("not a KubeProxyConfiguration: {0}")]
    Yaml(#[from] serde_yaml::Error),
    #[error(
        "apiVersion {api_version:?}, kind {kind:?}: expected {API_VERSION} {KIND} (the `config.conf` key of kube-proxy's ConfigMap)"
    )]
    NotKubeProxyConfiguration { api_version: String, kind: String },
    #[error("{field}: {value:?} is not supported: {why}")]
    Unsupported { field: String, value: String, why: String },
    #[error("{field}: {value:?}: {why}")]
    Malformed { field: String, value: String, why: String },
}

pub const API_VERSION: &str = "kubeproxy.config.k8s.io/v1alpha1";
pub const KIND: &str = "KubeProxyConfiguration";

/// Reads and maps the file at `path`.
pub fn read(path: &Path) -> Result<KubeProxySettings, KubeProxyConfigError> {
    let text = std::fs::read_to_string(path)
        .map_err(|source| KubeProxyConfigError::Read { path: path.to_path_buf(), source })?;
    parse(&text).map_err(|source| KubeProxyConfigError::Invalid { path: path.to_path_buf(), source })
}

/// The fields wasmplane has flags for; the others are only looked at to be reported.
/// Everything optional: kubeadm writes `null` for kube-proxy's pointer fields.
#[derive(Deserialize, Default)]
#[serde(default, rename_all = "camelCase")]
struct KubeProxyConfiguration {
    api_version: Option<String>,
    kind: Option<String>,
    #[serde(rename = "clusterCIDR")]
    cluster_cidr: Option<String>,
    hostname_override: Option<String>,
    /// Newer configurations' place for it; older ones have it in the mode's block.
    masquerade_all: Option<bool>,
    detect_local_mode: Option<String>,
    detect_local: Option<DetectLocal>,
    node_port_addresses: Option<Vec<String>>,
    healthz_bind_address: Option<String>,
    metrics_bind_address: Option<String>,
    oom_score_adj: Option<i32>,
    mode: Option<String>,
    sync_period: Option<String>,
    min_sync_period: Option<String>,
    conntrack: Option<Conntrack>,
    iptables: Option<ModeBlock>,
    nftables: Option<ModeBlock>,
    ipvs: Option<ModeBlock>,
    logging: Option<Logging>,
}

#[derive(Deserialize, Default)]
#[serde(default, rename_all = "camelCase")]
struct Conntrack {
    max_per_core: Option<u64>,
    min: Option<u64>,
    tcp_established_timeout: Option<String>,
    tcp_close_wait_timeout: Option<String>,
    udp_timeout: Option<String>,
    udp_stream_timeout: Option<String>,
    tcp_be_liberal: Option<bool>,
}

/// `iptables:`, `nftables:`, `ipvs:`: the fields of them that wasmplane maps.
#[derive(Deserialize, Default)]
#[serde(default, rename_all = "camelCase")]
struct ModeBlock {
    masquerade_all: Option<bool>,
    sync_period: Option<String>,
    min_sync_period: Option<String>,
}

/// `detectLocal:`, the interface detectLocalMode's names (v1alpha1's `DetectLocalConfiguration`).
#[derive(Deserialize, Default)]
#[serde(default, rename_all = "camelCase")]
struct DetectLocal {
    bridge_interface: Option<String>,
    interface_name_prefix: Option<String>,
}

#[derive(Deserialize, Default)]
#[serde(default, rename_all = "camelCase")]
struct Logging {
    format: Option<String>,
}

/// Maps a KubeProxyConfiguration's YAML to `wasmplane run` flags and warnings.
pub fn parse(yaml: &str) -> Result<KubeProxySettings, InvalidKubeProxyConfig> {
    let document: Value = serde_yaml::from_str(yaml)?;
    // Checked first: another document's fields would fail to parse with a less helpful error.
    let text_of = |key: &str| document.get(key).and_then(Value::as_str).unwrap_or_default().to_string();
    let (api_version, kind) = (text_of("apiVersion"), text_of("kind"));
    if api_version != API_VERSION || kind != KIND {
        return Err(InvalidKubeProxyConfig::NotKubeProxyConfiguration { api_version, kind });
    }
    // From the text, not the value: serde_yaml's errors then name the field and the line.
    let config: KubeProxyConfiguration = serde_yaml::from_str(yaml)?;
    let mut mapped: BTreeSet<String> = [
        "apiVersion",
        "kind",
        "clusterCIDR",
        "hostnameOverride",
        "masqueradeAll",
        "detectLocalMode",
        "nodePortAddresses",
        "healthzBindAddress",
        "metricsBindAddress",
        "mode",
        "syncPeriod",
        "minSyncPeriod",
        "oomScoreAdj",
        "logging.format",
    ]
    .map(String::from)
    .into();
    mapped.extend(
        [
            "maxPerCore",
            "min",
            "tcpEstablishedTimeout",
            "tcpCloseWaitTimeout",
            "udpTimeout",
            "udpStreamTimeout",
            "tcpBeLiberal",
        ]
        .map(|field| format!("conntrack.{field}")),
    );
    let (mut args, mut warnings) = (Vec::new(), Vec::new());

    let mode = config.mode.as_deref().unwrap_or_default();
    // The block kube-proxy reads in that mode (ipvs masquerades by iptables' masqueradeAll).
    let (masquerade_block, sync_block) = match mode {
        "" | "iptables" => ("iptables", "iptables"),
        "ipvs" => ("iptables", "ipvs"),
        "nftables" => ("nftables", "nftables"),
        "kernelspace" => return Err(unsupported("mode", mode, "kube-proxy's Windows mode")),
        _ => return Err(unsupported("mode", mode, "not a kube-proxy mode (iptables, ipvs, nftables)")),
    };
    if matches!(mode, "iptables" | "ipvs") {
        warnings.push(format!("ignored: mode {mode} (wasmplane programs nftables)"));
    }
    let block = |name: &str| match name {
        "iptables" => config.iptables.as_ref(),
        "nftables" => config.nftables.as_ref(),
        _ => config.ipvs.as_ref(),
    };
    mapped.insert(format!("{masquerade_block}.masqueradeAll"));
    mapped.insert(format!("{sync_block}.syncPeriod"));
    mapped.insert(format!("{sync_block}.minSyncPeriod"));

    let cluster_cidrs: Vec<&str> = config
        .cluster_cidr
        .as_deref()
        .unwrap_or_default()
        .split(',')
        .map(str::trim)
        .filter(|cidr| !cidr.is_empty())
        .collect();
    for cidr in &cluster_cidrs {
        cidr.parse::<ipnet::IpNet>().map_err(|e| malformed("clusterCIDR", cidr, &format!("not a CIDR ({e})")))?;
    }
    if !cluster_cidrs.is_empty() {
        args.push(format!("--cluster-cidr={}", cluster_cidrs.join(",")));
    } else if matches!(config.detect_local_mode.as_deref().unwrap_or_default(), "" | "ClusterCIDR") {
        // kube-proxy then detects no traffic as local; wasmplane would take its default CIDR,
        // which on another pod network masquerades pods' own traffic to services.
        warnings.push(format!("clusterCIDR is empty: kube-proxy detected no local traffic, wasmplane takes --cluster-cidr (default {DEFAULT_CLUSTER_CIDR}): give the cluster's pod CIDRs"));
    } else if let Some(mode @ ("InterfaceNamePrefix" | "BridgeInterface")) = config.detect_local_mode.as_deref() {
        // kube-proxy needs none then, but guests built against WIT 1.0 cannot say "pod
        // traffic" and go by the cluster CIDRs.
        warnings.push(format!("clusterCIDR is empty: in detectLocalMode {mode}, guests built against WIT 1.0 detect pods by --cluster-cidr (default {DEFAULT_CLUSTER_CIDR}): give the cluster's pod CIDRs if such a guest may be in force"));
    }
    // As kube-proxy takes it: node names are lower case.
    let node_name = config.hostname_override.as_deref().unwrap_or_default().trim().to_lowercase();
    if !node_name.is_empty() {
        args.push(format!("--node-name={node_name}"));
    }
    if config.masquerade_all.unwrap_or(false) || block(masquerade_block).and_then(|b| b.masquerade_all).unwrap_or(false)
    {
        args.push("--masquerade-all".into());
    }
    let detect_local = config.detect_local.unwrap_or_default();
    match config.detect_local_mode.as_deref().unwrap_or_default() {
        "" => {}
        mode @ ("ClusterCIDR" | "NodeCIDR") => args.push(format!("--detect-local-mode={mode}")),
        // Only the mode's own name is read, as kube-proxy reads it: the other is reported.
        mode @ ("InterfaceNamePrefix" | "BridgeInterface") => {
            let (field, name, flag) = match mode {
                "InterfaceNamePrefix" => {
                    ("interfaceNamePrefix", &detect_local.interface_name_prefix, "pod-interface-name-prefix")
                }
                _ => ("bridgeInterface", &detect_local.bridge_interface, "pod-bridge-interface"),
            };
            let field = format!("detectLocal.{field}");
            let name = name.as_deref().unwrap_or_default();
            // kube-proxy refuses the file without the name; wasmplane also wants one nft matches.
            if let Some(why) = crate::nft::PodTraffic::interface_name_problem(name, mode == "InterfaceNamePrefix") {
                return Err(malformed(&field, name, &format!("{why} (detectLocalMode {mode})")));
            }
            args.push(format!("--detect-local-mode={mode}"));
            args.push(format!("--{flag}={name}"));
            mapped.insert(field);
        }
        mode => {
            return Err(unsupported(
                "detectLocalMode",
                mode,
                "not a kube-proxy mode (ClusterCIDR, NodeCIDR, BridgeInterface, InterfaceNamePrefix)",
            ));
        }
    }
    if let Some(flag) =
        node_port_addresses(config.node_port_addresses.as_deref().unwrap_or_default(), mode, &mut warnings)?
    {
        args.push(flag);
    }
    if let Some(listen) =
        bind_address("healthzBindAddress", config.healthz_bind_address.as_deref().unwrap_or_default(), 10256)?
    {
        args.push(format!("--node-health-listen={listen}"));
    }
    // kube-proxy's default (loopback) is no choice; port 0 turns its metrics server off.
    if let Some(listen) =
        bind_address("metricsBindAddress", config.metrics_bind_address.as_deref().unwrap_or_default(), 10249)?
        && listen.port() != 0
        && listen != std::net::SocketAddr::from(([127, 0, 0, 1], 10249))
    {
        args.push(format!("--metrics-listen={listen}"));
    }
    let sync_period = match config.sync_period.as_deref() {
        Some(period) if !period.is_empty() && !parse_go_duration(period).is_ok_and(|d| d.is_zero()) => {
            Some(("syncPeriod".to_string(), period))
        }
        _ => block(sync_block)
            .and_then(|b| b.sync_period.as_deref())
            .map(|period| (format!("{sync_block}.syncPeriod"), period)),
    };
    if let Some((field, period)) = sync_period
        && let Some(seconds) = whole_seconds(&field, period)?.filter(|&s| s > 0)
    {
        args.push(format!("--reconcile-seconds={seconds}"));
    }

    // As syncPeriod: the top-level field (newer configurations) unless zero, else the mode's.
    let min_sync_period = match config.min_sync_period.as_deref() {
        Some(period) if !period.trim().is_empty() && !parse_go_duration(period.trim()).is_ok_and(|d| d.is_zero()) => {
            Some(("minSyncPeriod".to_string(), period))
        }
        _ => block(sync_block)
            .and_then(|b| b.min_sync_period.as_deref())
            .map(|period| (format!("{sync_block}.minSyncPeriod"), period)),
    };
    if let Some((field, period)) = min_sync_period.filter(|(_, period)| !period.trim().is_empty()) {
        // Sub-second periods are fine here: the flag takes the same Go duration. Zero is
        // wasmplane's default.
        if !parse_go_duration(period.trim()).map_err(|why| malformed(&field, period, &why))?.is_zero() {
            args.push(format!("--min-sync-period={}", period.trim()));
        }
    }

    // kube-proxy's pointer field: `null` is its default (-999), which is wasmplane's too.
    if let Some(adj) = config.oom_score_adj {
        if !(-1000..=1000).contains(&adj) {
            return Err(malformed("oomScoreAdj", &adj.to_string(), "not within -1000..=1000"));
        }
        args.push(format!("--oom-score-adj={adj}"));
    }

    let conntrack = config.conntrack.unwrap_or_default();
    // kube-proxy's pointer fields: `null` is its default, anything else (0 too) was chosen.
    if let Some(max) = conntrack.max_per_core {
        args.push(format!("--conntrack-max-per-core={max}"));
    }
    if let Some(min) = conntrack.min {
        args.push(format!("--conntrack-min={min}"));
    }
    for (field, value, flag) in [
        ("tcpEstablishedTimeout", &conntrack.tcp_established_timeout, "conntrack-tcp-timeout-established-seconds"),
        ("tcpCloseWaitTimeout", &conntrack.tcp_close_wait_timeout, "conntrack-tcp-timeout-close-wait-seconds"),
    ] {
        if let Some(seconds) =
            value.as_deref().map(|value| whole_seconds(&format!("conntrack.{field}"), value)).transpose()?.flatten()
        {
            args.push(format!("--{flag}={seconds}"));
        }
    }
    // Plain durations: zero is the default (leave the kernel's), as it is wasmplane's.
    for (field, value, flag) in [
        ("udpTimeout", &conntrack.udp_timeout, "conntrack-udp-timeout-seconds"),
        ("udpStreamTimeout", &conntrack.udp_stream_timeout, "conntrack-udp-timeout-stream-seconds"),
    ] {
        if let Some(seconds) = value
            .as_deref()
            .map(|value| whole_seconds(&format!("conntrack.{field}"), value))
            .transpose()?
            .flatten()
            .filter(|&s| s > 0)
        {
            args.push(format!("--{flag}={seconds}"));
        }
    }
    if conntrack.tcp_be_liberal.unwrap_or(false) {
        args.push("--conntrack-tcp-be-liberal".into());
    }
    match config.logging.and_then(|l| l.format).as_deref().unwrap_or_default() {
        "" => {}
        format @ ("text" | "json") => args.push(format!("--log-format={format}")),
        format => return Err(unsupported("logging.format", format, "wasmplane logs as text or json")),
    }

    if let Value::Mapping(fields) = &document {
        for (key, value) in fields {
            report_ignored(&key_text(key), value, &mapped, mode, &mut warnings);
        }
    }
    Ok(KubeProxySettings { args, warnings })
}

fn unsupported(field: &str, value: &str, why: &str) -> InvalidKubeProxyConfig {
    InvalidKubeProxyConfig::Unsupported { field: field.into(), value: value.into(), why: why.into() }
}

fn malformed(field: &str, value: &str, why: &str) -> InvalidKubeProxyConfig {
    InvalidKubeProxyConfig::Malformed { field: field.into(), value: value.into(), why: why.into() }
}

/// `nodePortAddresses` as `--nodeport-addresses`: CIDRs, or `primary`; unset, what kube-proxy
/// did in that mode (every local address, but in nftables mode the primary ones).
fn node_port_addresses(
    entries: &[String],
    mode: &str,
    warnings: &mut Vec<String>,
) -> Result<Option<String>, InvalidKubeProxyConfig> {
    let entries: Vec<&str> = entries.iter().map(|e| e.trim()).filter(|e| !e.is_empty()).collect();
    let value = match entries.as_slice() {
        [] if mode == "nftables" => "primary".to_string(),
        [] => return Ok(None),
        ["primary"] => "primary".to_string(),
        _ if entries.contains(&"all") => "all".to_string(),
        cidrs => {
            let joined = cidrs.join(",");
            joined
                .parse::<crate::nft::NodePortAddresses>()
                .map_err(|why| malformed("nodePortAddresses", &joined, &why))?;
            if let Some(loopback) =
                cidrs.iter().find(|cidr| cidr.parse::<ipnet::IpNet>().is_ok_and(|net| net.network().is_loopback()))
            {
                warnings.push(format!("ignored: nodePortAddresses {loopback} (no loopback nodeports)"));
            }
            joined
        }
    };
    Ok(Some(format!("--nodeport-addresses={value}")))
}

/// A kube-proxy bind address (`healthzBindAddress`, `metricsBindAddress`): `IP:PORT`, or an
/// IP alone on kube-proxy's port for it (older configurations had the port apart).
fn bind_address(
    field: &str,
    address: &str,
    default_port: u16,
) -> Result<Option<std::net::SocketAddr>, InvalidKubeProxyConfig> {
    let address = address.trim();
    if address.is_empty() {
        return Ok(None);
    }
    match (
        address.parse::<std::net::SocketAddr>(),
        address.trim_start_matches('[').trim_end_matches(']').parse::<std::net::IpAddr>(),
    ) {
        (Ok(listen), _) => Ok(Some(listen)),
        (_, Ok(ip)) => Ok(Some(std::net::SocketAddr::new(ip, default_port))),
        _ => Err(malformed(field, address, "not IP:PORT")),
    }
}

/// A duration field in whole seconds (`None`: left empty).
fn whole_seconds(field: &str, value: &str) -> Result<Option<u64>, InvalidKubeProxyConfig> {
    if value.trim().is_empty() {
        return Ok(None);
    }
    let duration = parse_go_duration(value.trim()).map_err(|why| malformed(field, value, &why))?;
    if duration.subsec_nanos() != 0 {
        return Err(malformed(field, value, "not a whole number of seconds (wasmplane's flags count seconds)"));
    }
    Ok(Some(duration.as_secs()))
}

/// A Go `time.Duration` as `metav1.Duration` writes it: `24h0m0s`, `1h`, `1m30s`, `1.5h`,
/// `500ms`, `0`. Negative durations are refused: no field taking one means anything by it.
pub fn parse_go_duration(text: &str) -> Result<Duration, String> {
    let unsigned = text.strip_prefix('+').unwrap_or(text);
    if let Some(magnitude) = unsigned.strip_prefix('-') {
        return match parse_go_duration(magnitude) {
            Ok(d) if d.is_zero() => Ok(d),
            Ok(_) => Err("negative".into()),
            Err(e) => Err(e),
        };
    }
    if unsigned == "0" {
        return Ok(Duration::ZERO);
    }
    if unsigned.is_empty() {
        return Err("not a duration (written as Go does: 24h0m0s, 90s)".into());
    }
    let not_digit = |c: char| !c.is_ascii_digit();
    let (mut rest, mut nanos) = (unsigned, 0u128);
    while !rest.is_empty() {
        let (whole, after) = rest.split_at(rest.find(not_digit).unwrap_or(rest.len()));
        let (fraction, after) = match after.strip_prefix('.') {
            Some(after) => after.split_at(after.find(not_digit).unwrap_or(after.len())),
            None => ("", after),
        };
        if whole.is_empty() && fraction.is_empty() {
            return Err("not a duration (written as Go does: 24h0m0s, 90s)".into());
        }
        let (unit, next) = after.split_at(after.find(|c: char| c == '.' || c.is_ascii_digit()).unwrap_or(after.len()));
        let unit_nanos: u128 = match unit {
            "ns" => 1,
            "us" | "µs" | "μs" => 1_000,
            "ms" => 1_000_000,
            "s" => 1_000_000_000,
            "m" => 60_000_000_000,
            "h" => 3_600_000_000_000,
            "" => return Err("a number without its unit (ns, us, ms, s, m, h)".into()),
            _ => return Err(format!("an unknown unit {unit:?} (ns, us, ms, s, m, h)")),
        };
        let too_long = || "longer than Go's longest duration (about 292 years)".to_string();
        let whole: u128 = if whole.is_empty() { 0 } else { whole.parse().map_err(|_| too_long())? };
        // Digits past the nanosecond cannot count; 18 keep the product within u128.
        let fraction = &fraction[..fraction.len().min(18)];
        let fraction_nanos = if fraction.is_empty() {
            0
        } else {
            fraction.parse::<u128>().expect("digits") * unit_nanos / 10u128.pow(fraction.len() as u32)
        };
        nanos = whole
            .checked_mul(unit_nanos)
            .and_then(|n| n.checked_add(fraction_nanos))
            .and_then(|n| n.checked_add(nanos))
            .ok_or_else(too_long)?;
        if nanos > i64::MAX as u128 {
            return Err(too_long());
        }
        rest = next;
    }
    Ok(Duration::from_nanos(nanos as u64))
}

/// `--cluster-cidr`'s default (`cli.rs`), named in a warning.
const DEFAULT_CLUSTER_CIDR: &str = "10.244.0.0/16";

/// kube-proxy's defaults besides zero values: a field set to one of them is no choice to report.
const KUBE_PROXY_DEFAULTS: &[(&str, &str)] = &[
    ("bindAddress", "0.0.0.0"),
    ("configSyncPeriod", "15m"),
    ("minSyncPeriod", "1s"),
    ("iptables.minSyncPeriod", "1s"),
    ("nftables.minSyncPeriod", "1s"),
    ("iptables.masqueradeBit", "14"),
    ("nftables.masqueradeBit", "14"),
    ("iptables.syncPeriod", "30s"),
    ("nftables.syncPeriod", "30s"),
    ("ipvs.syncPeriod", "30s"),
    ("clientConnection.contentType", "application/vnd.kubernetes.protobuf"),
    ("clientConnection.acceptContentTypes", "application/vnd.kubernetes.protobuf,application/json"),
    ("clientConnection.qps", "5"),
    ("clientConnection.burst", "10"),
    ("logging.flushFrequency", "5s"),
];

/// Adds a warning for each leaf under `path` that wasmplane does not map and that is set to
/// something else than kube-proxy's default.
fn report_ignored(path: &str, value: &Value, mapped: &BTreeSet<String>, mode: &str, warnings: &mut Vec<String>) {
    if mapped.contains(path) {
        return;
    }
    match value {
        Value::Mapping(fields) => {
            for (key, value) in fields {
                report_ignored(&format!("{path}.{}", key_text(key)), value, mapped, mode, warnings);
            }
        }
        leaf if is_default(path, leaf) => {}
        _ => warnings.push(format!("ignored: {path} ({})", why_ignored(path, mode))),
    }
}

fn key_text(key: &Value) -> String {
    match key {
        Value::String(key) => key.clone(),
        other => scalar_text(other).unwrap_or_else(|| format!("{other:?}")),
    }
}

fn scalar_text(value: &Value) -> Option<String> {
    match value {
        Value::String(text) => Some(text.clone()),
        Value::Number(number) => Some(number.to_string()),
        Value::Bool(flag) => Some(flag.to_string()),
        _ => None,
    }
}

fn is_default(path: &str, leaf: &Value) -> bool {
    // A feature gate named is a choice, whichever way it is set.
    if path.starts_with("featureGates.") {
        return leaf.is_null();
    }
    let zero = match leaf {
        Value::Null => true,
        Value::Bool(flag) => !flag,
        Value::Number(number) => number.as_f64() == Some(0.0),
        // "0s" and kube-proxy's quantities' "0" too.
        Value::String(text) => text.is_empty() || parse_go_duration(text).is_ok_and(|d| d.is_zero()),
        Value::Sequence(items) => items.is_empty(),
        _ => false,
    };
    zero || KUBE_PROXY_DEFAULTS.iter().any(|&(field, default)| {
        field == path
            && scalar_text(leaf).is_some_and(|text| {
                text == default
                    || matches!((parse_go_duration(&text), parse_go_duration(default)), (Ok(a), Ok(b)) if a == b)
            })
    })
}

/// Why wasmplane leaves a field alone, in a few words.
fn why_ignored(path: &str, mode: &str) -> String {
    let top = path.split('.').next().unwrap_or(path);
    let why = match path {
        "iptables.masqueradeAll"
        | "nftables.masqueradeAll"
        | "iptables.syncPeriod"
        | "nftables.syncPeriod"
        | "ipvs.syncPeriod" => {
            return format!("not the {} mode", if mode.is_empty() { "iptables" } else { mode });
        }
        "iptables.masqueradeBit" | "nftables.masqueradeBit" => "own mark bits",
        "iptables.localhostNodePorts" => "no localhost nodeports",
        "detectLocal.interfaceNamePrefix" => "for detectLocalMode InterfaceNamePrefix",
        "detectLocal.bridgeInterface" => "for detectLocalMode BridgeInterface",
        "nftables.tableName" => "own table names",
        "iptables.minSyncPeriod" | "nftables.minSyncPeriod" | "ipvs.minSyncPeriod" => {
            return format!("not the {} mode", if mode.is_empty() { "iptables" } else { mode });
        }
        _ => match top {
            "ipvs" => "no IPVS mode",
            "winkernel" | "windowsRunAsService" => "Windows only",
            "clientConnection" => "use --kubeconfig",
            "featureGates" => "no feature gates",
            "logging" => "use RUST_LOG",
            "bindAddress" => "node IP from Node",
            "bindAddressHardFail" => "no bind fallback",
            "enableProfiling" => "no pprof endpoint",
            "showHiddenMetricsForVersion" => "no hidden metrics",
            "configSyncPeriod" => "no informer resync",
            "portRange" => "userspace mode only",
            "serviceProxyName" => "handles unlabelled Services",
            _ => "unknown field",
        },
    };
    why.to_string()
}

#[cfg(test)]
mod tests {
    use super::*;

    /// kubeadm's `config.conf` (every field written, mostly zero values), with a cluster's
    /// own choices in it.
    const KUBEADM_CONFIG: &str = r#"apiVersion: kubeproxy.config.k8s.io/v1alpha1
bindAddress: 0.0.0.0
bindAddressHardFail: false
clientConnection:
  acceptContentTypes: ""
  burst: 0
  contentType: ""
  kubeconfig: /var/lib/kube-proxy/kubeconfig.conf
  qps: 0
clusterCIDR: 10.244.0.0/16,fd00:10:244::/56
configSyncPeriod: 0s
conntrack:
  maxPerCore: 65536
  min: null
  tcpBeLiberal: true
  tcpCloseWaitTimeout: 1h0m0s
  tcpEstablishedTimeout: 2h0m0s
  udpStreamTimeout: 2m0s
  udpTimeout: 0s
detectLocal:
  bridgeInterface: ""
  interfaceNamePrefix: ""
detectLocalMode: ""
enableProfiling: false
healthzBindAddress: ""
hostnameOverride: ""
iptables:
  localhostNodePorts: null
  masqueradeAll: true
  masqueradeBit: null
  minSyncPeriod: 1s
  syncPeriod: 30s
ipvs:
  excludeCIDRs: null
  minSyncPeriod: 0s
  scheduler: ""
  strictARP: true
  syncPeriod: 0s
  tcpFinTimeout: 0s
  tcpTimeout: 0s
  udpTimeout: 0s
kind: KubeProxyConfiguration
logging:
  flushFrequency: 0
  options:
    json:
      infoBufferSize: "0"
    text:
      infoBufferSize: "0"
  verbosity: 2
metricsBindAddress: 0.0.0.0:10249
mode: ""
nftables:
  masqueradeAll: false
  masqueradeBit: null
  minSyncPeriod: 0s
  syncPeriod: 0s
nodePortAddresses: null
oomScoreAdj: null
portRange: ""
showHiddenMetricsForVersion: ""
winkernel:
  enableDSR: false
  forwardHealthCheckVip: false
  networkName: ""
  rootHnsEndpointName: ""
  sourceVip: ""
"#;

    const EMPTY_CLUSTER_CIDR: &str = "clusterCIDR is empty: kube-proxy detected no local traffic, wasmplane takes --cluster-cidr (default 10.244.0.0/16): give the cluster's pod CIDRs";

    #[test]
    fn a_kubeadm_config_maps_to_flags_and_says_what_it_ignores() {
        let settings = parse(KUBEADM_CONFIG).unwrap();
        assert_eq!(
            settings.args,
            [
                "--cluster-cidr=10.244.0.0/16,fd00:10:244::/56",
                "--masquerade-all",
                "--metrics-listen=0.0.0.0:10249",
                "--reconcile-seconds=30",
                "--min-sync-period=1s",
                "--conntrack-max-per-core=65536",
                "--conntrack-tcp-timeout-established-seconds=7200",
                "--conntrack-tcp-timeout-close-wait-seconds=3600",
                "--conntrack-udp-timeout-stream-seconds=120",
                "--conntrack-tcp-be-liberal",
            ]
        );
        assert_eq!(
            settings.warnings,
            [
                "ignored: clientConnection.kubeconfig (use --kubeconfig)",
                "ignored: ipvs.strictARP (no IPVS mode)",
                "ignored: logging.verbosity (use RUST_LOG)",
            ]
        );
    }

    /// kubeadm's defaults alone: nothing to carry over but kube-proxy's minimum sync period
    /// (1s), which is not wasmplane's default (0s), and nothing to report but the empty
    /// clusterCIDR.
    #[test]
    fn zero_values_and_kube_proxy_defaults_are_no_choice() {
        let defaults = KUBEADM_CONFIG
            .replace("kubeconfig: /var/lib/kube-proxy/kubeconfig.conf", "kubeconfig: \"\"")
            .replace("clusterCIDR: 10.244.0.0/16,fd00:10:244::/56", "clusterCIDR: \"\"")
            .replace("maxPerCore: 65536", "maxPerCore: null")
            .replace("tcpBeLiberal: true", "tcpBeLiberal: false")
            .replace("tcpCloseWaitTimeout: 1h0m0s", "tcpCloseWaitTimeout: null")
            .replace("tcpEstablishedTimeout: 2h0m0s", "tcpEstablishedTimeout: null")
            .replace("udpStreamTimeout: 2m0s", "udpStreamTimeout: 0s")
            .replace("masqueradeAll: true", "masqueradeAll: false")
            .replace("syncPeriod: 30s", "syncPeriod: 0s")
            .replace("strictARP: true", "strictARP: false")
            .replace("verbosity: 2", "verbosity: 0")
            .replace("metricsBindAddress: 0.0.0.0:10249", "metricsBindAddress: 127.0.0.1:10249")
            .replace("masqueradeBit: null", "masqueradeBit: 14");
        let empty_cidr = EMPTY_CLUSTER_CIDR.to_string();
        assert_eq!(
            parse(&defaults).unwrap(),
            KubeProxySettings { args: vec!["--min-sync-period=1s".into()], warnings: vec![empty_cidr.clone()] }
        );
        let zero = defaults.replace("minSyncPeriod: 1s", "minSyncPeriod: 0s");
        assert_eq!(parse(&zero).unwrap(), KubeProxySettings { args: Vec::new(), warnings: vec![empty_cidr] });
        // Not needed to detect local traffic by the node's CIDR: no warning.
        let node_cidr = zero.replace("detectLocalMode: \"\"", "detectLocalMode: NodeCIDR");
        assert_eq!(parse(&node_cidr).unwrap().warnings, Vec::<String>::new());
    }

    #[test]
    fn newer_fields_the_mode_and_the_rest_of_the_mapping() {
        let settings = parse(
            "apiVersion: kubeproxy.config.k8s.io/v1alpha1\nkind: KubeProxyConfiguration\nmode: nftables\nmasqueradeAll: true\nsyncPeriod: 1m30s\nnftables: {syncPeriod: 10s, masqueradeBit: 3}\n\
             iptables: {masqueradeAll: true}\nhostnameOverride: ' Worker-1 '\ndetectLocalMode: NodeCIDR\nhealthzBindAddress: '[::]:10256'\nlogging: {format: json}\n\
             conntrack: {maxPerCore: 0, min: 0, udpTimeout: 30s}\nfeatureGates: {SomeGate: false}\nnewField: 1\n",
        )
        .unwrap();
        assert_eq!(
            settings.args,
            [
                "--node-name=worker-1",
                "--masquerade-all",
                "--detect-local-mode=NodeCIDR",
                "--nodeport-addresses=primary",
                "--node-health-listen=[::]:10256",
                "--reconcile-seconds=90",
                "--conntrack-max-per-core=0",
                "--conntrack-min=0",
                "--conntrack-udp-timeout-seconds=30",
                "--log-format=json",
            ]
        );
        assert_eq!(
            settings.warnings,
            [
                "ignored: nftables.masqueradeBit (own mark bits)",
                "ignored: iptables.masqueradeAll (not the nftables mode)",
                "ignored: featureGates.SomeGate (no feature gates)",
                "ignored: newField (unknown field)"
            ]
        );
        let iptables = parse("apiVersion: kubeproxy.config.k8s.io/v1alpha1\nkind: KubeProxyConfiguration\nmode: ipvs\nhealthzBindAddress: 10.0.0.1\nnodePortAddresses: [10.0.0.0/8, 127.0.0.0/8]\nipvs: {syncPeriod: 45s}\n").unwrap();
        assert_eq!(
            iptables.args,
            [
                "--nodeport-addresses=10.0.0.0/8,127.0.0.0/8",
                "--node-health-listen=10.0.0.1:10256",
                "--reconcile-seconds=45"
            ]
        );
        assert_eq!(
            iptables.warnings,
            [
                "ignored: mode ipvs (wasmplane programs nftables)",
                EMPTY_CLUSTER_CIDR,
                "ignored: nodePortAddresses 127.0.0.0/8 (no loopback nodeports)"
            ]
        );
    }

    /// minSyncPeriod: the top-level field unless zero, else the mode's block's; sub-second
    /// periods kept; another mode's block is not this mode's.
    #[test]
    fn the_minimum_sync_period_of_the_mode() {
        let head = "apiVersion: kubeproxy.config.k8s.io/v1alpha1\nkind: KubeProxyConfiguration\nmode: nftables\n";
        let settings = |rest: &str| {
            let mut settings = parse(&format!("{head}{rest}")).unwrap();
            settings.args.retain(|flag| flag != "--nodeport-addresses=primary");
            settings.warnings.retain(|w| w != EMPTY_CLUSTER_CIDR);
            settings
        };
        assert_eq!(settings("minSyncPeriod: 250ms\nnftables: {minSyncPeriod: 5s}\n").args, ["--min-sync-period=250ms"]);
        assert_eq!(settings("minSyncPeriod: 0s\nnftables: {minSyncPeriod: 5s}\n").args, ["--min-sync-period=5s"]);
        let other = settings("iptables: {minSyncPeriod: 2s}\n");
        assert!(other.args.is_empty(), "{:?}", other.args);
        assert_eq!(other.warnings, ["ignored: iptables.minSyncPeriod (not the nftables mode)"]);
        let error = parse(&format!("{head}nftables: {{minSyncPeriod: 1x}}\n")).unwrap_err().to_string();
        assert!(error.starts_with("nftables.minSyncPeriod: \"1x\""), "{error}");
    }

    /// metricsBindAddress: an IP alone gets kube-proxy's port; port 0 (its metrics server off)
    /// and its loopback default carry nothing over.
    #[test]
    fn metrics_bind_address_is_carried_over() {
        let head = "apiVersion: kubeproxy.config.k8s.io/v1alpha1\nkind: KubeProxyConfiguration\n";
        let args = |address: &str| parse(&format!("{head}metricsBindAddress: '{address}'\n")).map(|s| s.args);
        assert_eq!(args("0.0.0.0").unwrap(), ["--metrics-listen=0.0.0.0:10249"]);
        assert_eq!(args("[::]:9100").unwrap(), ["--metrics-listen=[::]:9100"]);
        assert!(args("0.0.0.0:0").unwrap().is_empty());
        assert!(args("127.0.0.1:10249").unwrap().is_empty());
        assert!(args("").unwrap().is_empty());
        let error = args("localhost:10249").unwrap_err().to_string();
        assert!(error.starts_with("metricsBindAddress: \"localhost:10249\""), "{error}");
    }

    /// oomScoreAdj as kube-proxy takes it: `null` leaves the default, a number is given on.
    #[test]
    fn oom_score_adj_is_carried_over() {
        let head = "apiVersion: kubeproxy.config.k8s.io/v1alpha1\nkind: KubeProxyConfiguration\n";
        assert_eq!(parse(&format!("{head}oomScoreAdj: -500\n")).unwrap().args, ["--oom-score-adj=-500"]);
        assert_eq!(parse(&format!("{head}oomScoreAdj: null\n")).unwrap().args, Vec::<String>::new());
        let error = parse(&format!("{head}oomScoreAdj: 1001\n")).unwrap_err().to_string();
        assert!(error.starts_with("oomScoreAdj: \"1001\""), "{error}");
    }

    #[test]
    fn go_durations() {
        let seconds = |text: &str| parse_go_duration(text).map(|d| d.as_secs_f64());
        assert_eq!(seconds("24h0m0s"), Ok(86400.0));
        assert_eq!(seconds("1h"), Ok(3600.0));
        assert_eq!(seconds("90s"), Ok(90.0));
        assert_eq!(seconds("1m30s"), Ok(90.0));
        assert_eq!(seconds("1.5h"), Ok(5400.0));
        assert_eq!(seconds(".5m"), Ok(30.0));
        assert_eq!(seconds("0s"), Ok(0.0));
        assert_eq!(seconds("0"), Ok(0.0));
        assert_eq!(seconds("-0s"), Ok(0.0));
        assert_eq!(parse_go_duration("500ms"), Ok(Duration::from_millis(500)));
        assert_eq!(parse_go_duration("1s500ms2us3ns"), Ok(Duration::new(1, 500_002_003)));
        assert_eq!(parse_go_duration("2µs"), Ok(Duration::from_micros(2)));
        for refused in ["", "1", "10", "1d", "h", "1h-1m", "-1s", ".s", "1.2.3s", "3000000h"] {
            assert!(parse_go_duration(refused).is_err(), "{refused:?}");
        }
        // As flags: whole seconds, or refused naming the field.
        assert_eq!(whole_seconds("conntrack.udpTimeout", "1m30s").unwrap(), Some(90));
        assert_eq!(
            whole_seconds("conntrack.udpTimeout", "1500ms").map_err(|e| e.to_string()).unwrap_err(),
            "conntrack.udpTimeout: \"1500ms\": not a whole number of seconds (wasmplane's flags count seconds)"
        );
        let config = "apiVersion: kubeproxy.config.k8s.io/v1alpha1\nkind: KubeProxyConfiguration\nconntrack: {tcpEstablishedTimeout: 500ms}\n";
        assert!(
            parse(config)
                .unwrap_err()
                .to_string()
                .starts_with("conntrack.tcpEstablishedTimeout: \"500ms\": not a whole number")
        );
        let config =
            "apiVersion: kubeproxy.config.k8s.io/v1alpha1\nkind: KubeProxyConfiguration\niptables: {syncPeriod: 1x}\n";
        assert!(parse(config).unwrap_err().to_string().starts_with("iptables.syncPeriod: \"1x\": an unknown unit"));
    }

    #[test]
    fn what_wasmplane_cannot_do_is_refused_naming_the_field() {
        let error = |extra: &str| {
            parse(&format!("apiVersion: kubeproxy.config.k8s.io/v1alpha1\nkind: KubeProxyConfiguration\n{extra}\n"))
                .unwrap_err()
                .to_string()
        };
        assert_eq!(
            error("detectLocalMode: InterfaceNamePrefix"),
            "detectLocal.interfaceNamePrefix: \"\": must not be empty (detectLocalMode InterfaceNamePrefix)"
        );
        assert_eq!(
            error("detectLocalMode: BridgeInterface\ndetectLocal: {bridgeInterface: '', interfaceNamePrefix: veth}"),
            "detectLocal.bridgeInterface: \"\": must not be empty (detectLocalMode BridgeInterface)"
        );
        assert_eq!(
            error("detectLocalMode: InterfaceNamePrefix\ndetectLocal: {interfaceNamePrefix: 'veth*'}"),
            "detectLocal.interfaceNamePrefix: \"veth*\": no wildcard: a prefix matches every name it starts (detectLocalMode InterfaceNamePrefix)"
        );
        assert!(
            error("detectLocalMode: BridgeInterface\ndetectLocal: {bridgeInterface: a-bridge-too-long}")
                .starts_with("detectLocal.bridgeInterface: \"a-bridge-too-long\": longer than")
        );
        assert!(
            error("detectLocalMode: LocalInterface")
                .starts_with("detectLocalMode: \"LocalInterface\" is not supported: not a kube-proxy mode")
        );
        assert!(error("mode: kernelspace").starts_with("mode: \"kernelspace\" is not supported"));
        assert!(error("clusterCIDR: 10.244.0.0/16,pods").starts_with("clusterCIDR: \"pods\": not a CIDR"));
        assert_eq!(
            error("healthzBindAddress: localhost:10256"),
            "healthzBindAddress: \"localhost:10256\": not IP:PORT"
        );
        assert!(
            error("nodePortAddresses: [primary, 10.0.0.0/8]")
                .starts_with("nodePortAddresses: \"primary,10.0.0.0/8\": \"primary\" is not a CIDR")
        );
        let typed = error("conntrack:\n  maxPerCore: lots");
        assert!(typed.contains("conntrack.maxPerCore") && typed.contains("line 4"), "{typed}");
    }

    /// The interface modes take their name from `detectLocal`, the mode's field only; the
    /// other mode's is reported, as kube-proxy does not read it.
    #[test]
    fn interface_local_detection_is_carried_over() {
        let head =
            "apiVersion: kubeproxy.config.k8s.io/v1alpha1\nkind: KubeProxyConfiguration\nclusterCIDR: 10.244.0.0/16\n";
        let settings = |rest: &str| parse(&format!("{head}{rest}")).unwrap();
        let prefix = settings(
            "detectLocalMode: InterfaceNamePrefix\ndetectLocal: {bridgeInterface: '', interfaceNamePrefix: cali}\n",
        );
        assert_eq!(
            prefix,
            KubeProxySettings {
                args: vec![
                    "--cluster-cidr=10.244.0.0/16".into(),
                    "--detect-local-mode=InterfaceNamePrefix".into(),
                    "--pod-interface-name-prefix=cali".into()
                ],
                warnings: vec![]
            }
        );
        let bridge = settings(
            "detectLocalMode: BridgeInterface\ndetectLocal: {bridgeInterface: cbr0, interfaceNamePrefix: veth}\n",
        );
        assert_eq!(
            bridge.args,
            ["--cluster-cidr=10.244.0.0/16", "--detect-local-mode=BridgeInterface", "--pod-bridge-interface=cbr0"]
        );
        assert_eq!(
            bridge.warnings,
            ["ignored: detectLocal.interfaceNamePrefix (for detectLocalMode InterfaceNamePrefix)"]
        );
        let other = settings("detectLocalMode: NodeCIDR\ndetectLocal: {bridgeInterface: cbr0}\n");
        assert_eq!(other.args, ["--cluster-cidr=10.244.0.0/16", "--detect-local-mode=NodeCIDR"]);
        assert_eq!(other.warnings, ["ignored: detectLocal.bridgeInterface (for detectLocalMode BridgeInterface)"]);
        // No clusterCIDR: kube-proxy needs none in these modes, 1.0 guests do.
        let no_cidr = parse("apiVersion: kubeproxy.config.k8s.io/v1alpha1\nkind: KubeProxyConfiguration\ndetectLocalMode: BridgeInterface\ndetectLocal: {bridgeInterface: cbr0}\n").unwrap();
        assert_eq!(no_cidr.args, ["--detect-local-mode=BridgeInterface", "--pod-bridge-interface=cbr0"]);
        assert_eq!(
            no_cidr.warnings,
            [
                "clusterCIDR is empty: in detectLocalMode BridgeInterface, guests built against WIT 1.0 detect pods by --cluster-cidr (default 10.244.0.0/16): give the cluster's pod CIDRs if such a guest may be in force"
            ]
        );
    }

    #[test]
    fn another_document_is_refused_naming_the_file() {
        let dir = tempfile::tempdir().unwrap();
        let file = dir.path().join("config.conf");
        std::fs::write(
            &file,
            "apiVersion: kubelet.config.k8s.io/v1beta1\nkind: KubeletConfiguration\nclusterDNS: [10.96.0.10]\n",
        )
        .unwrap();
        let refused = read(&file).unwrap_err().to_string();
        assert_eq!(
            refused,
            format!(
                "{}: apiVersion \"kubelet.config.k8s.io/v1beta1\", kind \"KubeletConfiguration\": expected kubeproxy.config.k8s.io/v1alpha1 KubeProxyConfiguration (the `config.conf` key of kube-proxy's ConfigMap)",
                file.display()
            )
        );
        std::fs::write(
            &file,
            "apiVersion: kubeproxy.config.k8s.io/v1alpha1\nkind: KubeProxyConfiguration\ndetectLocalMode: NodeCIDR\n",
        )
        .unwrap();
        assert_eq!(read(&file).unwrap().warnings, Vec::<String>::new());
        let missing = dir.path().join("missing.conf");
        assert!(read(&missing).unwrap_err().to_string().starts_with(&format!("reading {}", missing.display())));
    }
}
