//! `wasmplane-cni`: the thin CNI executable.
//!
//! CNI environment and stdin configuration in, one HTTP/1.1 `POST /v1/cni` over the host's
//! unix socket, the spec's result (or error object and a non-zero exit) out. Everything
//! that needs state (the watch cache, IPAM, netlink) lives in the daemon; this process
//! only translates, so it starts in a millisecond and holds no Kubernetes credentials.
//!
//! Network configuration keys read here: `cniVersion`, `daemonSocket` (default
//! `/run/wasmplane/cni.sock`), `daemonTimeoutSeconds` (default 60). A node's
//! `/etc/cni/net.d/10-wasmplane.conflist`, with the binary installed as
//! `/opt/cni/bin/wasmplane-cni`:
//!
//! ```json
//! {"cniVersion": "1.0.0", "cniVersions": ["1.0.0", "1.1.0"], "name": "wasmplane", "plugins": [
//!   {"type": "wasmplane-cni", "daemonSocket": "/run/wasmplane/cni.sock"},
//!   {"type": "portmap", "capabilities": {"portMappings": true}}
//! ]}
//! ```
//!
//! With the agent chained after another CNI (`wasmplane run --cni-chained`), this plugin
//! comes last in that CNI's conflist instead (`deploy/cni/05-wasmplane-chained.conflist`);
//! the daemon then reads the pod's addresses from the `prevResult` passed through here.
//!
//! Commands: ADD, DEL, CHECK, VERSION, and spec 1.1.0's STATUS and GC (these two carry no
//! container, interface or namespace). Exit status 0 and the result on stdout, or 1 and
//! `{"cniVersion","code","msg","details"}` on stdout (and a line on stderr). Codes: the
//! spec's (1 version, 4 environment, 5 stdin, 6 decode, 7 configuration, 11 try again
//! later: daemon unreachable or pod not yet in the watch cache, 50 STATUS: cannot add pods
//! now, daemon unreachable included) and the daemon's own from 100 (see
//! `wasmplane_cni::code`).

use std::io::{Read as _, Write as _};
use std::os::unix::net::UnixStream;
use std::time::Duration;

use serde_json::{Value, json};

const SUPPORTED_VERSIONS: &[&str] = &["0.3.0", "0.3.1", "0.4.0", "1.0.0", "1.1.0"];
const DEFAULT_SOCKET: &str = "/run/wasmplane/cni.sock";
const DEFAULT_TIMEOUT_SECS: u64 = 60;

/// A CNI error as the spec prints it.
struct Failure {
    code: u32,
    msg: String,
    details: String,
}

impl Failure {
    fn new(code: u32, msg: impl Into<String>, details: impl Into<String>) -> Failure {
        Failure { code, msg: msg.into(), details: details.into() }
    }
}

fn main() {
    let mut version = "1.0.0".to_string();
    match run(&mut version) {
        Ok(Some(out)) => {
            println!("{out}");
        }
        Ok(None) => {}
        Err(f) => {
            let mut err = json!({"cniVersion": version, "code": f.code, "msg": f.msg});
            if !f.details.is_empty() {
                err["details"] = json!(f.details);
            }
            println!("{err}");
            // stderr too: runtimes log it, and a person running the plugin by hand sees it.
            eprintln!("wasmplane-cni: {} ({})", f.msg, f.details);
            std::process::exit(1);
        }
    }
}

/// Returns what to print on success; `version` is set to the configuration's as soon as it
/// is known, so errors are reported in it.
fn run(version: &mut String) -> Result<Option<String>, Failure> {
    let command = std::env::var("CNI_COMMAND").unwrap_or_default();
    if command == "VERSION" {
        return Ok(Some(json!({"cniVersion": "1.1.0", "supportedVersions": SUPPORTED_VERSIONS}).to_string()));
    }
    let mut stdin = Vec::new();
    std::io::stdin()
        .read_to_end(&mut stdin)
        .map_err(|e| Failure::new(5, "failed to read the network configuration from stdin", e.to_string()))?;
    let config: Value = serde_json::from_slice(&stdin)
        .map_err(|e| Failure::new(6, "failed to decode the network configuration", e.to_string()))?;
    let Some(conf_version) = config.get("cniVersion").and_then(Value::as_str) else {
        return Err(Failure::new(7, "invalid network configuration", "cniVersion is missing or not a string"));
    };
    if !SUPPORTED_VERSIONS.contains(&conf_version) {
        return Err(Failure::new(
            1,
            "incompatible CNI version",
            format!("config is {conf_version:?}, wasmplane-cni supports {SUPPORTED_VERSIONS:?}"),
        ));
    }
    *version = conf_version.to_string();

    let env = |name: &str| std::env::var(name).unwrap_or_default();
    let (container_id, netns, if_name) = (env("CNI_CONTAINERID"), env("CNI_NETNS"), env("CNI_IFNAME"));
    let mut missing = Vec::new();
    if !matches!(command.as_str(), "ADD" | "DEL" | "CHECK" | "STATUS" | "GC") {
        missing.push(format!("CNI_COMMAND ({command:?} is not ADD, DEL, CHECK, STATUS, GC or VERSION)"));
    }
    // STATUS and GC are about the network, not one attachment.
    let attachment = !matches!(command.as_str(), "STATUS" | "GC");
    if attachment && container_id.is_empty() {
        missing.push("CNI_CONTAINERID".into());
    }
    if attachment && if_name.is_empty() {
        missing.push("CNI_IFNAME".into());
    }
    if attachment && netns.is_empty() && command != "DEL" {
        missing.push("CNI_NETNS".into());
    }
    if !missing.is_empty() {
        return Err(Failure::new(
            4,
            "invalid CNI environment variables",
            format!("missing or invalid: {}", missing.join(", ")),
        ));
    }

    let socket = config.get("daemonSocket").and_then(Value::as_str).unwrap_or(DEFAULT_SOCKET).to_string();
    let timeout =
        Duration::from_secs(config.get("daemonTimeoutSeconds").and_then(Value::as_u64).unwrap_or(DEFAULT_TIMEOUT_SECS));
    let body = json!({
        "command": command,
        "containerId": container_id,
        "netns": netns,
        "ifName": if_name,
        "args": env("CNI_ARGS"),
        "path": env("CNI_PATH"),
        "config": config,
    })
    .to_string();

    let (status, reply) = post(&socket, "/v1/cni", &body, timeout).map_err(|e| {
        // Not running (yet), restarting, or overloaded: transient from the runtime's side;
        // to STATUS, the plugin is not available.
        Failure::new(
            if command == "STATUS" { 50 } else { 11 },
            format!("wasmplane daemon not reachable at {socket}, try again later"),
            format!("{e}; is the wasmplane agent running on this node?"),
        )
    })?;
    if (200..300).contains(&status) {
        let text = String::from_utf8_lossy(&reply).trim().to_string();
        return Ok((!text.is_empty()).then_some(text));
    }
    // The daemon's error object, passed on as it is (it is already in the config's version).
    match serde_json::from_slice::<Value>(&reply) {
        Ok(v) if v.get("code").and_then(Value::as_u64).is_some() => Err(Failure {
            code: v["code"].as_u64().unwrap_or(110) as u32,
            msg: v["msg"].as_str().unwrap_or_default().to_string(),
            details: v["details"].as_str().unwrap_or_default().to_string(),
        }),
        _ => Err(Failure::new(
            110,
            format!("wasmplane daemon answered HTTP {status}"),
            String::from_utf8_lossy(&reply).chars().take(500).collect::<String>(),
        )),
    }
}

/// One HTTP/1.1 request over a unix socket, `Connection: close`; returns status and body.
fn post(socket: &str, path: &str, body: &str, timeout: Duration) -> std::io::Result<(u16, Vec<u8>)> {
    let mut stream = UnixStream::connect(socket)?;
    stream.set_read_timeout(Some(timeout))?;
    stream.set_write_timeout(Some(timeout))?;
    let head = format!(
        "POST {path} HTTP/1.1\r\nHost: wasmplane\r\nContent-Type: application/json\r\nContent-Length: {}\r\nConnection: close\r\n\r\n",
        body.len()
    );
    stream.write_all(head.as_bytes())?;
    stream.write_all(body.as_bytes())?;
    let mut raw = Vec::new();
    stream.read_to_end(&mut raw)?;
    parse_response(&raw)
}

fn bad(what: &str) -> std::io::Error {
    std::io::Error::new(std::io::ErrorKind::InvalidData, format!("malformed HTTP response: {what}"))
}

/// Status line, headers (only Content-Length and chunked transfer matter), body.
fn parse_response(raw: &[u8]) -> std::io::Result<(u16, Vec<u8>)> {
    let end = raw.windows(4).position(|w| w == b"\r\n\r\n").ok_or_else(|| bad("no end of headers"))?;
    let head = std::str::from_utf8(&raw[..end]).map_err(|_| bad("headers not UTF-8"))?;
    let rest = &raw[end + 4..];
    let mut lines = head.split("\r\n");
    let status_line = lines.next().unwrap_or_default();
    let status = status_line.split(' ').nth(1).and_then(|s| s.parse().ok()).ok_or_else(|| bad("status line"))?;
    let (mut length, mut chunked) = (None, false);
    for line in lines {
        let Some((k, v)) = line.split_once(':') else {
            continue;
        };
        let (k, v) = (k.trim().to_ascii_lowercase(), v.trim());
        if k == "content-length" {
            length = Some(v.parse::<usize>().map_err(|_| bad("content-length"))?);
        } else if k == "transfer-encoding" && v.eq_ignore_ascii_case("chunked") {
            chunked = true;
        }
    }
    let body = if chunked {
        dechunk(rest)?
    } else if let Some(n) = length {
        rest.get(..n).ok_or_else(|| bad("body shorter than content-length"))?.to_vec()
    } else {
        rest.to_vec()
    };
    Ok((status, body))
}

fn dechunk(mut data: &[u8]) -> std::io::Result<Vec<u8>> {
    let mut out = Vec::new();
    loop {
        let eol = data.windows(2).position(|w| w == b"\r\n").ok_or_else(|| bad("chunk size line"))?;
        let size_text = std::str::from_utf8(&data[..eol]).map_err(|_| bad("chunk size"))?;
        let size = usize::from_str_radix(size_text.split(';').next().unwrap_or("").trim(), 16)
            .map_err(|_| bad("chunk size"))?;
        data = &data[eol + 2..];
        if size == 0 {
            return Ok(out);
        }
        out.extend_from_slice(data.get(..size).ok_or_else(|| bad("truncated chunk"))?);
        data = data.get(size + 2..).ok_or_else(|| bad("truncated chunk"))?;
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn parses_length_and_chunked_bodies() {
        let (s, b) = parse_response(b"HTTP/1.1 200 OK\r\ncontent-length: 2\r\n\r\n{}").unwrap();
        assert_eq!((s, b.as_slice()), (200, &b"{}"[..]));
        let (s, b) = parse_response(
            b"HTTP/1.1 503 Service Unavailable\r\nTransfer-Encoding: chunked\r\n\r\n3\r\nabc\r\n2\r\nde\r\n0\r\n\r\n",
        )
        .unwrap();
        assert_eq!((s, b.as_slice()), (503, &b"abcde"[..]));
        assert!(parse_response(b"HTTP/1.1 200 OK\r\ncontent-length: 9\r\n\r\n{}").is_err());
        assert!(parse_response(b"garbage").is_err());
    }
}
