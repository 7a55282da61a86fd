//! A synthetic agent to try sinks against: a node-local model of a few services whose
//! endpoints churn, served the way the agent serves it.
//!
//! ```text
//! cargo run -p wasmplane-grpc --example demo_feed [127.0.0.1:50151]
//! ```

use std::sync::{Arc, Mutex};
use std::time::Duration;

use wasmplane_grpc::{Delta, ModelFeed, Snapshot};
use wasmplane_model::*;

const NODE: &str = "demo-node";

struct Model {
    cluster: ClusterState,
    local: NodeLocalModel,
}

impl Model {
    fn apply(&mut self, feed: &ModelFeed, event: ClusterEvent) {
        let touched = self.cluster.apply(event, NODE);
        let update = self.local.update(&self.cluster, &touched);
        if !update.is_empty() {
            feed.publish(Delta::from_update(&self.local, &update));
        }
    }
}

fn service(i: u32) -> ClusterObject {
    ClusterObject::Service(Service::cluster_ip(
        "demo",
        &format!("svc-{i}"),
        &format!("10.96.0.{i}"),
        vec![ServicePort::tcp("http", 80, 8080)],
    ))
}

fn slice(i: u32, replicas: u32) -> ClusterObject {
    ClusterObject::EndpointSlice(EndpointSlice {
        namespace: "demo".into(),
        name: format!("svc-{i}-1").into(),
        service_name: format!("svc-{i}").into(),
        endpoints: (0..replicas)
            .map(|r| Endpoint {
                addresses: vec![format!("10.244.{r}.{i}").into()],
                ready: true,
                serving: true,
                terminating: false,
                node_name: Some(if r == 0 { NODE.into() } else { format!("node-{r}").into() }),
                zone: None,
                for_zones: vec![],
                for_nodes: vec![],
            })
            .collect(),
        ports: vec![EndpointPort { name: "http".into(), protocol: Protocol::Tcp, port: 8080 }],
        trigger_time: None,
        cluster: None,
    })
}

#[tokio::main]
async fn main() -> Result<(), Box<dyn std::error::Error>> {
    let addr = std::env::args().nth(1).unwrap_or_else(|| "127.0.0.1:50151".to_string());
    let model = Arc::new(Mutex::new(Model {
        cluster: ClusterState::new(),
        local: NodeLocalModel::new(NODE, vec!["10.244.0.0/16".into()]),
    }));
    let source = model.clone();
    let feed = ModelFeed::new(Arc::new(move || Snapshot::of(&source.lock().unwrap().local)), 256);
    {
        let mut model = model.lock().unwrap();
        for i in 0..5 {
            model.apply(&feed, ClusterEvent::Upsert(service(i)));
            model.apply(&feed, ClusterEvent::Upsert(slice(i, 2)));
        }
    }
    let listener = tokio::net::TcpListener::bind(&addr).await?;
    println!("serving a demo model on {addr}; Ctrl-C to stop");
    let server = tokio::spawn(wasmplane_grpc::serve(feed.clone(), listener, async {
        let _ = tokio::signal::ctrl_c().await;
    }));

    // Churn: scale a service up and down every second, now and then add or remove one.
    let mut tick = 0u32;
    while !server.is_finished() {
        tokio::time::sleep(Duration::from_secs(1)).await;
        tick += 1;
        let mut model = model.lock().unwrap();
        let i = tick % 5;
        model.apply(&feed, ClusterEvent::Upsert(slice(i, 1 + tick % 4)));
        if tick.is_multiple_of(7) {
            model.apply(&feed, ClusterEvent::Upsert(service(100 + tick)));
        }
        if tick % 7 == 3 && tick > 10 {
            model.apply(
                &feed,
                ClusterEvent::Delete(ObjectKind::Service, ObjectKey::new("demo", format!("svc-{}", 100 + tick - 10))),
            );
        }
    }
    server.await??;
    println!("stopped; {:?}", feed.stats());
    Ok(())
}
