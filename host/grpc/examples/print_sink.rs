//! A minimal out-of-process sink: watches an agent's node-local model and prints each
//! revision. Reconnects (from a fresh snapshot) whenever the stream breaks.
//!
//! ```text
//! cargo run -p wasmplane-grpc --example demo_feed            # a synthetic agent, or a real one
//! cargo run -p wasmplane-grpc --example print_sink [http://127.0.0.1:50151]
//! ```

use std::time::Duration;

use wasmplane_grpc::proto::{self, watch_response::Event};
use wasmplane_grpc::{Applied, LocalModelClient, Mirror};
use wasmplane_model::ObjectKey;

const DEFAULT_ADDR: &str = "http://127.0.0.1:50151";

#[tokio::main]
async fn main() {
    let addr = std::env::args().nth(1).unwrap_or_else(|| DEFAULT_ADDR.to_string());
    tokio::select! {
        _ = run(addr) => {}
        _ = tokio::signal::ctrl_c() => println!("bye"),
    }
}

async fn run(addr: String) {
    let mut backoff = Duration::from_millis(500);
    loop {
        match watch(&addr).await {
            Ok(()) => println!("the agent ended the stream; reconnecting"),
            Err(e) => println!("{e}; reconnecting in {backoff:?}"),
        }
        tokio::time::sleep(backoff).await;
        backoff = (backoff * 2).min(Duration::from_secs(10));
    }
}

async fn watch(addr: &str) -> Result<(), Box<dyn std::error::Error>> {
    let mut client = LocalModelClient::connect(addr.to_string()).await.map_err(|e| format!("cannot connect to {addr}: {e}"))?;
    let mut stream = client.watch(proto::WatchRequest {}).await?.into_inner();
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

/// "+added ~updated -deleted" with names, from a delta and the state before it.
fn describe(response: &proto::WatchResponse, before: &Mirror) -> String {
    let Some(Event::Delta(delta)) = &response.event else { return String::new() };
    let mut words = Vec::new();
    for upsert in &delta.upserts {
        if let Some(proto::object::Kind::Service(view)) = &upsert.kind {
            let service = view.service.as_ref();
            let key = ObjectKey::new(service.map_or("", |s| s.namespace.as_str()), service.map_or("", |s| s.name.as_str()));
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
        words.push(format!("node context: ips={:?} zone={} service CIDRs={:?}{draining}", context.node_ips, context.zone.as_deref().unwrap_or("-"), context.service_cidrs));
    }
    if words.is_empty() {
        // The revision moved for objects this API does not stream yet (pods, policies).
        words.push("(no service change)".into());
    }
    words.join(", ")
}
