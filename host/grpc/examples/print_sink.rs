//! A minimal out-of-process sink: watches an agent's node-local model and prints each
//! revision. Reconnects (from a fresh snapshot) whenever the stream breaks.
//!
//! ```text
//! cargo run -p wasmplane-grpc --example demo_feed            # a synthetic agent, or a real one
//! cargo run -p wasmplane-grpc --example print_sink [http://127.0.0.1:50151]
//! # a host elsewhere, served with TLS: its CA certificate, and its token from the environment
//! WASMPLANE_TOKEN=... cargo run -p wasmplane-grpc --example print_sink https://10.0.0.5:50151 ca.crt
//! ```
//!
//! A host lets loopback clients watch without a token; from anywhere else it wants
//! `authorization: Bearer <token>`, sent here when `WASMPLANE_TOKEN` is set (an environment
//! variable rather than an argument, so the token does not show in `ps`).

use std::time::Duration;

use tonic::transport::{Certificate, Channel, ClientTlsConfig};
use wasmplane_grpc::proto::{self, watch_response::Event};
use wasmplane_grpc::{Applied, LocalModelClient, Mirror};
use wasmplane_model::ObjectKey;

const DEFAULT_ADDR: &str = "http://127.0.0.1:50151";

/// Where the host is and how to reach it.
struct Target {
    addr: String,
    /// PEM of the CA that signed the host's certificate, for `https://` addresses.
    ca: Option<Vec<u8>>,
    /// `authorization` metadata value, `Bearer <token>`.
    bearer: Option<tonic::metadata::MetadataValue<tonic::metadata::Ascii>>,
}

#[tokio::main]
async fn main() -> Result<(), Box<dyn std::error::Error>> {
    let mut args = std::env::args().skip(1);
    let addr = args.next().unwrap_or_else(|| DEFAULT_ADDR.to_string());
    let ca = match args.next() {
        Some(path) => Some(std::fs::read(&path).map_err(|e| format!("reading the CA certificate {path}: {e}"))?),
        None => None,
    };
    let bearer = match std::env::var("WASMPLANE_TOKEN") {
        Ok(token) if !token.trim().is_empty() => Some(
            format!("Bearer {}", token.trim()).parse().map_err(|_| "WASMPLANE_TOKEN is not a valid header value")?,
        ),
        _ => None,
    };
    if bearer.is_some() && addr.starts_with("http://") {
        println!("note: the token goes to {addr} in plain text; use https:// for a host elsewhere");
    }
    tokio::select! {
        _ = run(Target { addr, ca, bearer }) => {}
        _ = tokio::signal::ctrl_c() => println!("bye"),
    }
    Ok(())
}

async fn run(target: Target) {
    let mut backoff = Duration::from_millis(500);
    loop {
        match watch(&target).await {
            Ok(()) => println!("the agent ended the stream; reconnecting"),
            Err(e) => println!("{e}; reconnecting in {backoff:?}"),
        }
        tokio::time::sleep(backoff).await;
        backoff = (backoff * 2).min(Duration::from_secs(10));
    }
}

async fn connect(target: &Target) -> Result<Channel, Box<dyn std::error::Error>> {
    let mut endpoint = Channel::from_shared(target.addr.clone())?;
    if let Some(ca) = &target.ca {
        endpoint = endpoint.tls_config(ClientTlsConfig::new().ca_certificate(Certificate::from_pem(ca)))?;
    }
    Ok(endpoint.connect().await?)
}

async fn watch(target: &Target) -> Result<(), Box<dyn std::error::Error>> {
    let addr = &target.addr;
    let channel = connect(target).await.map_err(|e| format!("cannot connect to {addr}: {}", with_sources(&*e)))?;
    let mut client = LocalModelClient::new(channel);
    let mut request = tonic::Request::new(proto::WatchRequest {});
    if let Some(bearer) = &target.bearer {
        request.metadata_mut().insert("authorization", bearer.clone());
    }
    let mut stream = client.watch(request).await?.into_inner();
    println!("watching {addr}");
    // Every reconnect starts from a snapshot, which replaces whatever we had.
    let mut mirror = Mirror::new();
    let mut parts = 0;
    while let Some(response) = stream.message().await? {
        let description = describe(&response, &mirror);
        match mirror.apply(response)? {
            Applied::SnapshotPart { .. } => parts += 1,
            Applied::Snapshot { revision, services } => {
                let context = mirror.context();
                let in_parts = if parts == 0 { String::new() } else { format!(" in {} parts", parts + 1) };
                parts = 0;
                println!(
                    "rev {revision:>6}  snapshot  node={} zone={} ips={:?}: {services} services{in_parts}",
                    context.node_name,
                    context.zone.as_deref().unwrap_or("-"),
                    context.node_ips,
                );
            }
            Applied::Delta { revision, .. } => println!("rev {revision:>6}  delta     {description}"),
        }
    }
    Ok(())
}

/// The error and its causes: tonic's own text is only "transport error", the reason (a
/// certificate not trusted, a refused connection) is in its sources.
fn with_sources(error: &dyn std::error::Error) -> String {
    let mut text = error.to_string();
    let mut source = error.source();
    while let Some(cause) = source {
        text.push_str(&format!(": {cause}"));
        source = cause.source();
    }
    text
}

/// "+added ~updated -deleted" with names, from a delta and the state before it.
fn describe(response: &proto::WatchResponse, before: &Mirror) -> String {
    let Some(Event::Delta(delta)) = &response.event else { return String::new() };
    let mut words = Vec::new();
    for upsert in &delta.upserts {
        if let Some(proto::object::Kind::Service(view)) = &upsert.kind {
            let service = view.service.as_ref();
            let key =
                ObjectKey::new(service.map_or("", |s| s.namespace.as_str()), service.map_or("", |s| s.name.as_str()));
            let sign = if before.services().contains_key(&key) { '~' } else { '+' };
            let endpoints: usize = view.slices.iter().map(|s| s.endpoints.len()).sum();
            let local = view.slices.iter().flat_map(|s| &s.endpoints).filter(|e| e.is_local).count();
            words.push(format!("{sign}{key} ({endpoints} endpoints, {local} local)"));
        }
    }
    for delete in &delta.deletes {
        if let Some(proto::object_ref::Kind::Service(key)) = &delete.kind {
            words.push(format!("-{}/{}", key.namespace, key.name));
        }
    }
    if let Some(context) = &delta.context {
        let draining = if context.being_deleted { " (being deleted: drain it)" } else { "" };
        words.push(format!(
            "node context: ips={:?} zone={} service CIDRs={:?}{draining}",
            context.node_ips,
            context.zone.as_deref().unwrap_or("-"),
            context.service_cidrs
        ));
    }
    if words.is_empty() {
        // The revision moved for objects this API does not stream yet (pods, policies).
        words.push("(no service change)".into());
    }
    words.join(", ")
}
