//! What travels over the unix socket, the network configuration we accept, and the spec's
//! result object in each supported version.

use std::net::IpAddr;

use serde::{Deserialize, Serialize};
use serde_json::{Value, json};

use crate::error::Error;

/// CNI spec versions this plugin speaks, oldest first (CHECK exists from 0.4.0 on, STATUS
/// and GC from 1.1.0).
pub const SUPPORTED_VERSIONS: &[&str] = &["0.3.0", "0.3.1", "0.4.0", "1.0.0", "1.1.0"];

/// Whether `version` (a supported one) is `min` or later.
pub fn version_at_least(version: &str, min: &str) -> bool {
    let rank = |v: &str| SUPPORTED_VERSIONS.iter().position(|s| *s == v);
    rank(version) >= rank(min)
}

/// Default daemon socket, used when the network configuration names none.
pub const DEFAULT_SOCKET: &str = "/run/wasmplane/cni.sock";

/// The CNI commands the daemon serves (VERSION is answered by the plugin alone).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "UPPERCASE")]
pub enum Command {
    Add,
    Del,
    Check,
    /// Whether ADD can be served now (spec 1.1.0).
    Status,
    /// Release what belongs to no valid attachment (spec 1.1.0).
    Gc,
}

impl Command {
    pub fn as_str(self) -> &'static str {
        match self {
            Command::Add => "ADD",
            Command::Del => "DEL",
            Command::Check => "CHECK",
            Command::Status => "STATUS",
            Command::Gc => "GC",
        }
    }

    /// The first spec version that has this command.
    pub fn since(self) -> &'static str {
        match self {
            Command::Add | Command::Del => "0.3.0",
            Command::Check => "0.4.0",
            Command::Status | Command::Gc => "1.1.0",
        }
    }
}

/// One plugin invocation: the CNI environment plus the network configuration from stdin,
/// passed through unchanged (the plugin does not interpret it beyond finding the socket).
#[derive(Clone, Debug, Serialize, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct CniRequest {
    pub command: Command,
    /// Empty for STATUS and GC.
    #[serde(default)]
    pub container_id: String,
    /// Empty when the runtime gave none (allowed for DEL).
    #[serde(default)]
    pub netns: String,
    #[serde(default)]
    pub if_name: String,
    /// `CNI_ARGS`, e.g. `IgnoreUnknown=1;K8S_POD_NAMESPACE=default;K8S_POD_NAME=web-0`.
    #[serde(default)]
    pub args: String,
    #[serde(default)]
    pub path: String,
    pub config: Value,
}

impl CniRequest {
    /// A request for the pod `namespace/name` with a minimal network configuration, as the
    /// executable would pass it for `wasmplane-cni` as the only plugin.
    pub fn for_pod(command: Command, container_id: &str, netns: &str, namespace: &str, name: &str) -> CniRequest {
        CniRequest {
            command,
            container_id: container_id.into(),
            netns: netns.into(),
            if_name: "eth0".into(),
            args: format!("IgnoreUnknown=1;K8S_POD_NAMESPACE={namespace};K8S_POD_NAME={name};K8S_POD_UID=uid-{name}"),
            path: String::new(),
            config: json!({"cniVersion": "1.0.0", "name": "wasmplane", "type": "wasmplane-cni"}),
        }
    }

    /// Sends this request as the `wasmplane-cni` executable does (HTTP/1.1 `POST /v1/cni` on
    /// the daemon's unix socket) and waits for the reply: its status and JSON body (`Null`
    /// when the body is not JSON). For tests and tools that speak to the daemon without the
    /// executable.
    pub fn send_blocking(&self, socket: &std::path::Path) -> std::io::Result<(u16, Value)> {
        use std::io::{Read as _, Write as _};
        let body = serde_json::to_string(self)?;
        let mut stream = std::os::unix::net::UnixStream::connect(socket)?;
        write!(
            stream,
            "POST /v1/cni HTTP/1.1\r\nHost: cni\r\nContent-Type: application/json\r\nContent-Length: {}\r\nConnection: close\r\n\r\n{body}",
            body.len()
        )?;
        let mut raw = String::new();
        stream.read_to_string(&mut raw)?;
        let bad =
            |what: &str| std::io::Error::new(std::io::ErrorKind::InvalidData, format!("the daemon's reply: {what}"));
        let (head, body) = raw.split_once("\r\n\r\n").ok_or_else(|| bad("not an HTTP response"))?;
        let status =
            head.split_whitespace().nth(1).and_then(|s| s.parse().ok()).ok_or_else(|| bad("no status code"))?;
        Ok((status, serde_json::from_str(body.trim()).unwrap_or(Value::Null)))
    }
}

/// The parts of the network configuration the daemon reads.
#[derive(Clone, Debug)]
pub struct NetConf {
    pub cni_version: String,
    pub name: String,
    pub prev_result: Option<Value>,
    /// GC's `cni.dev/valid-attachments`: the attachments the runtime still has.
    pub valid_attachments: Option<Vec<Attachment>>,
}

/// One attachment to the network: the container and interface of an ADD.
#[derive(Clone, Debug, PartialEq, Eq, Hash, Serialize, Deserialize)]
pub struct Attachment {
    #[serde(rename = "containerID")]
    pub container_id: String,
    #[serde(rename = "ifname")]
    pub if_name: String,
}

impl NetConf {
    pub fn parse(config: &Value) -> Result<NetConf, Error> {
        let obj =
            config.as_object().ok_or_else(|| Error::Decode("network configuration is not a JSON object".into()))?;
        let cni_version = match obj.get("cniVersion") {
            Some(Value::String(v)) => v.clone(),
            Some(other) => {
                return Err(Error::InvalidConfig(format!("cniVersion must be a string, got {other}")));
            }
            None => return Err(Error::InvalidConfig("cniVersion is missing".into())),
        };
        if !SUPPORTED_VERSIONS.contains(&cni_version.as_str()) {
            return Err(Error::IncompatibleVersion(cni_version));
        }
        let name = match obj.get("name") {
            Some(Value::String(n)) if !n.is_empty() => n.clone(),
            _ => return Err(Error::InvalidConfig("name is missing or empty".into())),
        };
        let valid_attachments = match obj.get("cni.dev/valid-attachments") {
            None => None,
            Some(list) => Some(
                Vec::<Attachment>::deserialize(list)
                    .map_err(|e| Error::InvalidConfig(format!("cni.dev/valid-attachments: {e}")))?,
            ),
        };
        Ok(NetConf { cni_version, name, prev_result: obj.get("prevResult").cloned(), valid_attachments })
    }

    /// The pod's addresses in the previous plugin's result (`ips[].address`, CIDR notation),
    /// in its order, each once: what a chained daemon learns the pod's addresses from.
    pub fn previous_addresses(&self) -> Result<Vec<IpAddr>, Error> {
        let prev = self
            .prev_result
            .as_ref()
            .ok_or_else(|| Error::NoPreviousAddresses("the configuration has no prevResult".into()))?;
        let listed = prev.get("ips").and_then(Value::as_array).map(Vec::as_slice).unwrap_or_default();
        if listed.is_empty() {
            return Err(Error::NoPreviousAddresses("prevResult lists no address (ips)".into()));
        }
        let mut ips = Vec::with_capacity(listed.len());
        for (i, ip) in listed.iter().enumerate() {
            let address = ip
                .get("address")
                .and_then(Value::as_str)
                .and_then(|a| a.parse::<ipnet::IpNet>().ok())
                .ok_or_else(|| {
                    Error::InvalidConfig(format!(
                        "prevResult ips[{i}].address {} is not an address in CIDR notation",
                        ip.get("address").unwrap_or(&Value::Null)
                    ))
                })?
                .addr();
            if !ips.contains(&address) {
                ips.push(address);
            }
        }
        Ok(ips)
    }
}

/// The Kubernetes pod named in `CNI_ARGS`, when the runtime passed one.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct PodRef {
    pub namespace: String,
    pub name: String,
    /// `K8S_POD_UID` (kubelet passes it): tells a recreated pod from the one it replaces.
    pub uid: Option<String>,
}

/// Reads `K8S_POD_NAMESPACE`, `K8S_POD_NAME` and `K8S_POD_UID` from `CNI_ARGS`
/// (`;`-separated `K=V`).
pub fn parse_pod_args(args: &str) -> Result<Option<PodRef>, Error> {
    let (mut namespace, mut name, mut uid) = (None, None, None);
    for pair in args.split(';').filter(|p| !p.is_empty()) {
        let (k, v) = pair
            .split_once('=')
            .ok_or_else(|| Error::InvalidEnv(format!("CNI_ARGS entry {pair:?} is not KEY=VALUE")))?;
        match k {
            "K8S_POD_NAMESPACE" => namespace = Some(v.to_string()),
            "K8S_POD_NAME" => name = Some(v.to_string()),
            "K8S_POD_UID" if !v.is_empty() => uid = Some(v.to_string()),
            _ => {}
        }
    }
    match (namespace, name) {
        (Some(namespace), Some(name)) if !namespace.is_empty() && !name.is_empty() => {
            Ok(Some(PodRef { namespace, name, uid }))
        }
        (None, None) => Ok(None),
        _ => Err(Error::InvalidEnv("CNI_ARGS has only one of K8S_POD_NAMESPACE and K8S_POD_NAME".into())),
    }
}

/// One address of a pod and the gateway its family routes through (the pod CIDR's first
/// address, held by the node side).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct PodAddress {
    pub ip: IpAddr,
    pub gateway: IpAddr,
}

impl PodAddress {
    /// The host prefix length of the family: pod and gateway addresses are single hosts on
    /// the veth, reached through a route, not a shared subnet.
    pub fn host_prefix(&self) -> u8 {
        if self.ip.is_ipv4() { 32 } else { 128 }
    }

    /// The family's default route, `0.0.0.0/0` or `::/0`.
    pub fn default_destination(&self) -> &'static str {
        if self.ip.is_ipv4() { "0.0.0.0/0" } else { "::/0" }
    }
}

/// A pod's network as ADD left it: what goes into the spec's result.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct PodNetwork {
    pub host_if: String,
    pub host_mac: String,
    pub pod_if: String,
    pub pod_mac: String,
    pub sandbox: String,
    /// One per family, the node's primary family first (the pod's primary address).
    pub addresses: Vec<PodAddress>,
    /// Both ends' MTU when the daemon set one; `None`: the kernel default.
    pub mtu: Option<u32>,
}

impl PodNetwork {
    /// The pod's addresses, in the result's order.
    pub fn ips(&self) -> Vec<IpAddr> {
        self.addresses.iter().map(|a| a.ip).collect()
    }

    /// The spec's ADD result in `cni_version` (0.3.x/0.4.0 carry `version` per IP; of 1.1.0's
    /// optional additions, the interfaces' `mtu` when one was set).
    pub fn to_result(&self, cni_version: &str) -> Value {
        let mut ips = Vec::new();
        let mut routes = Vec::new();
        for a in &self.addresses {
            let mut ip = json!({
                "address": format!("{}/{}", a.ip, a.host_prefix()),
                "gateway": a.gateway.to_string(),
                "interface": 1,
            });
            if cni_version.starts_with("0.") {
                ip["version"] = json!(if a.ip.is_ipv4() { "4" } else { "6" });
            }
            ips.push(ip);
            routes.push(json!({"dst": format!("{}/{}", a.gateway, a.host_prefix())}));
            routes.push(json!({"dst": a.default_destination(), "gw": a.gateway.to_string()}));
        }
        let mut interfaces = [
            json!({"name": self.host_if, "mac": self.host_mac}),
            json!({"name": self.pod_if, "mac": self.pod_mac, "sandbox": self.sandbox}),
        ];
        if let Some(mtu) = self.mtu.filter(|_| version_at_least(cni_version, "1.1.0")) {
            for interface in &mut interfaces {
                interface["mtu"] = mtu.into();
            }
        }
        json!({
            "cniVersion": cni_version,
            "interfaces": interfaces,
            "ips": ips,
            "routes": routes,
            "dns": {},
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn pod_args() {
        let p = parse_pod_args(
            "IgnoreUnknown=1;K8S_POD_NAMESPACE=shop;K8S_POD_NAME=web-0;K8S_POD_INFRA_CONTAINER_ID=abc;K8S_POD_UID=u1",
        )
        .unwrap();
        assert_eq!(p, Some(PodRef { namespace: "shop".into(), name: "web-0".into(), uid: Some("u1".into()) }));
        assert_eq!(parse_pod_args("").unwrap(), None);
        assert_eq!(parse_pod_args("K8S_POD_NAME=x").unwrap_err().code(), crate::code::INVALID_ENV);
        assert_eq!(parse_pod_args("garbage").unwrap_err().code(), crate::code::INVALID_ENV);
    }

    #[test]
    fn netconf_versions() {
        assert!(NetConf::parse(&json!({"cniVersion": "0.4.0", "name": "k8s"})).is_ok());
        assert_eq!(NetConf::parse(&json!({"cniVersion": "2.0.0", "name": "k8s"})).unwrap_err().code(), 1);
        assert_eq!(NetConf::parse(&json!({"name": "k8s"})).unwrap_err().code(), 7);
        assert_eq!(NetConf::parse(&json!({"cniVersion": "1.0.0"})).unwrap_err().code(), 7);
    }

    #[test]
    fn result_versions() {
        let n = PodNetwork {
            host_if: "wp1".into(),
            host_mac: "aa".into(),
            pod_if: "eth0".into(),
            pod_mac: "bb".into(),
            sandbox: "/run/netns/x".into(),
            addresses: vec![PodAddress { ip: "10.244.0.5".parse().unwrap(), gateway: "10.244.0.1".parse().unwrap() }],
            mtu: None,
        };
        let v1 = n.to_result("1.0.0");
        assert_eq!(v1["cniVersion"], "1.0.0");
        assert!(v1["ips"][0].get("version").is_none());
        assert_eq!(v1["ips"][0]["address"], "10.244.0.5/32");
        assert_eq!(v1["interfaces"][1]["sandbox"], "/run/netns/x");
        assert_eq!(n.to_result("0.4.0")["ips"][0]["version"], "4");
        assert!(n.to_result("1.1.0")["ips"][0].get("version").is_none());

        // Dual stack: each family's address, gateway and default route, in the pools' order.
        let mut dual = n.clone();
        dual.addresses
            .push(PodAddress { ip: "fd00:10:244::5".parse().unwrap(), gateway: "fd00:10:244::1".parse().unwrap() });
        let r = dual.to_result("1.0.0");
        assert_eq!(r["ips"][1]["address"], "fd00:10:244::5/128");
        assert_eq!(r["ips"][1]["gateway"], "fd00:10:244::1");
        assert_eq!(
            r["routes"],
            json!([
                {"dst": "10.244.0.1/32"}, {"dst": "0.0.0.0/0", "gw": "10.244.0.1"},
                {"dst": "fd00:10:244::1/128"}, {"dst": "::/0", "gw": "fd00:10:244::1"},
            ])
        );
        assert_eq!(dual.to_result("0.4.0")["ips"][1]["version"], "6");

        // The interfaces' MTU is 1.1.0's, and only there when one was set.
        let mtu = |n: &PodNetwork, version: &str| {
            let r = n.to_result(version);
            [0, 1].map(|i| r["interfaces"][i].get("mtu").cloned())
        };
        assert_eq!(mtu(&n, "1.1.0"), [None, None], "no MTU set: the kernel default, not reported");
        let set = PodNetwork { mtu: Some(1400), ..n.clone() };
        assert_eq!(mtu(&set, "1.1.0"), [Some(json!(1400)), Some(json!(1400))]);
        for older in ["1.0.0", "0.4.0", "0.3.1"] {
            assert_eq!(mtu(&set, older), [None, None], "{older} has no interface MTU");
        }
    }

    /// A chained daemon's addresses: every `ips[].address` of the prevResult, in order, once;
    /// none at all (or no prevResult) is the chaining mistake, told apart from a malformed
    /// address.
    #[test]
    fn previous_addresses_of_a_chained_add() {
        let conf = |prev: Option<Value>| {
            let mut c = json!({"cniVersion": "1.0.0", "name": "k8s"});
            if let Some(prev) = prev {
                c["prevResult"] = prev;
            }
            NetConf::parse(&c).unwrap()
        };
        let ips = conf(Some(json!({"cniVersion": "1.0.0", "ips": [
            {"address": "10.244.3.7/24", "gateway": "10.244.3.1"},
            {"address": "fd00:10:244:3::7/64"},
            {"address": "10.244.3.7/32"},
        ]})))
        .previous_addresses()
        .unwrap();
        let want: Vec<IpAddr> = vec!["10.244.3.7".parse().unwrap(), "fd00:10:244:3::7".parse().unwrap()];
        assert_eq!(ips, want);
        for (prev, says) in [
            (None, "no prevResult"),
            (Some(json!({"cniVersion": "1.0.0", "interfaces": []})), "no address"),
            (Some(json!({"cniVersion": "1.0.0", "ips": []})), "no address"),
        ] {
            let e = conf(prev).previous_addresses().unwrap_err();
            assert!(matches!(e, Error::NoPreviousAddresses(_)) && e.code() == 7, "{e:?}");
            assert!(e.to_string().contains(says) && e.to_string().contains("must come after"), "{e}");
        }
        let e = conf(Some(json!({"ips": [{"address": "10.244.3.7/24"}, {"address": "10.244.3.8"}]})))
            .previous_addresses()
            .unwrap_err();
        assert!(matches!(e, Error::InvalidConfig(_)) && e.to_string().contains("ips[1]"), "{e}");
    }

    #[test]
    fn versions_and_valid_attachments() {
        assert!(version_at_least("1.1.0", "1.1.0") && version_at_least("1.1.0", "0.4.0"));
        assert!(!version_at_least("1.0.0", Command::Gc.since()) && !version_at_least("0.3.1", Command::Check.since()));
        let conf = NetConf::parse(&json!({"cniVersion": "1.1.0", "name": "k8s",
            "cni.dev/valid-attachments": [{"containerID": "c1", "ifname": "eth0"}]}))
        .unwrap();
        assert_eq!(
            conf.valid_attachments,
            Some(vec![Attachment { container_id: "c1".into(), if_name: "eth0".into() }])
        );
        let e = NetConf::parse(
            &json!({"cniVersion": "1.1.0", "name": "k8s", "cni.dev/valid-attachments": [{"containerID": 5}]}),
        )
        .unwrap_err();
        assert_eq!(e.code(), 7, "{e}");
        assert!(e.to_string().contains("valid-attachments"), "{e}");
    }
}
