//! The CNI split through the whole host: the daemon answers from the host's watch cache
//! (the manifest source here), takes its pod CIDRs from the Node object (dual stack here),
//! waits for a pod the cache does not have yet, and the addresses it hands out are in the
//! node-local model at once; DEL takes them out again. The plugin binary
//! and the daemon alone are tested in `host/cni-plugin/tests`; this speaks the plugin's one
//! request over the host's socket.

mod support;

use std::collections::BTreeMap;
use std::path::Path;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use serde_json::Value;
use support::cluster::{Cluster, NODES_YAML, start_host, wait_for};
use support::netns::{Netns, require_root};
use wasmplane::app::DataplaneMode;
use wasmplane::cni::CniConfig;
use wasmplane::controller::ModelObserver;
use wasmplane_cni::{CniRequest, Command};
use wasmplane_model::state::ModelUpdate;
use wasmplane_model::{NodeLocalModel, ObjectKey};

/// One request as `wasmplane-cni` sends it: HTTP/1.1 POST /v1/cni over the unix socket.
fn cni(socket: &Path, command: Command, container: &str, netns: &str, pod: &str) -> (u16, Value) {
    CniRequest::for_pod(command, container, netns, "default", pod)
        .send_blocking(socket)
        .unwrap_or_else(|e| panic!("{command:?} {pod} on {}: {e}", socket.display()))
}

fn pod_yaml(name: &str) -> String {
    format!(
        "apiVersion: v1\nkind: Pod\nmetadata: {{ name: {name}, namespace: default, uid: uid-{name}, labels: {{ app: web }} }}\nspec: {{ nodeName: node-a, containers: [{{ name: c, image: x }}] }}\nstatus: {{ phase: Pending }}\n"
    )
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_added_pod_is_in_the_model_at_once_and_del_takes_it_out() {
    require_root!("network namespaces, veth");
    let tag = std::process::id();
    let node = Netns::new(format!("cnih-node-{tag}"));
    let pod_ns = Netns::new(format!("cnih-pod-{tag}"));
    let cluster = Cluster::new();
    let socket = cluster.data_dir().parent().unwrap().join("cni.sock");
    // node-a is dual-stack here: its pods get an address of each family.
    let dual = NODES_YAML.replacen("podCIDRs: [10.244.0.0/24]", "podCIDRs: [10.244.0.0/24, \"fd00:10:244::/64\"]", 1);
    assert_ne!(dual, NODES_YAML);
    cluster.put_file(
        "cluster.yaml",
        &format!("{dual}---\napiVersion: v1\nkind: Namespace\nmetadata: {{ name: default }}\n"),
    );
    let mut config = cluster.config(Vec::new());
    config.dataplane = DataplaneMode::Record;
    // No pod CIDR given: the daemon takes node-a's from its Node object in the watch cache.
    config.cni = Some(CniConfig {
        socket: socket.clone(),
        pod_cidrs: Vec::new(),
        state_dir: None,
        pod_wait: Duration::from_secs(3),
        node_netns: Some(format!("/var/run/netns/{}", node.name).into()),
        chained: false,
        mtu: None,
    });
    let host = start_host(config).await;
    wait_for("the CNI socket", Duration::from_secs(10), || socket.exists(), |up| *up);
    // STATUS (CNI 1.1.0): the watch cache has synced and the pod CIDR has room.
    let mut status = CniRequest::for_pod(Command::Status, "", "", "default", "");
    status.config = serde_json::json!({"cniVersion": "1.1.0", "name": "wasmplane"});
    let (code, body) = status.send_blocking(&socket).unwrap();
    assert_eq!(code, 200, "{body}");

    // ADD before the pod is in the cache: it waits, and succeeds once the pod arrives.
    let pod_netns = format!("/var/run/netns/{}", pod_ns.name);
    let add = {
        let (socket, pod_netns) = (socket.clone(), pod_netns.clone());
        std::thread::spawn(move || cni(&socket, Command::Add, "c-web-1", &pod_netns, "web-1"))
    };
    std::thread::sleep(Duration::from_millis(500));
    std::fs::write(cluster.manifests().join("pod.yaml"), pod_yaml("web-1")).unwrap();
    let (status, result) = add.join().unwrap();
    assert_eq!(status, 200, "{result}");
    let address =
        |i: usize| result["ips"][i]["address"].as_str().expect("an address").split('/').next().unwrap().to_string();
    let (ip, ip6) = (address(0), address(1));
    assert!(ip.starts_with("10.244.0."), "from node-a's pod CIDR 10.244.0.0/24: {result}");
    assert!(ip6.starts_with("fd00:10:244::"), "from node-a's pod CIDR fd00:10:244::/64: {result}");
    assert!(
        pod_ns.exec(&["ip", "-4", "-o", "addr", "show", "dev", "eth0"]).contains(&ip),
        "the interface has the address"
    );
    assert!(
        pod_ns.exec(&["ip", "-6", "-o", "addr", "show", "dev", "eth0"]).contains(&ip6),
        "the interface has the address"
    );
    let both = vec![ip.clone(), ip6.clone()];
    // The host's status tells the daemon's use of each pod CIDR.
    let cni_status = || async {
        reqwest::get(format!("{}/v1/status", host.url())).await.unwrap().json::<serde_json::Value>().await.unwrap()["cni"].clone()
    };
    let serving = cni_status().await;
    assert_eq!(
        (&serving["serving"], &serving["chained"]),
        (&serde_json::json!(true), &serde_json::json!(false)),
        "{serving}"
    );
    assert_eq!(
        serving["pools"],
        serde_json::json!([{ "cidr": "10.244.0.0/24", "allocated": 1, "capacity": 253 }, { "cidr": "fd00:10:244::/64", "allocated": 1, "capacity": u64::MAX }]),
        "{serving}"
    );

    // In the model, and written, before ADD answered (the runtime starts the containers
    // after it): the manifest never reports an address.
    let key = ObjectKey::new("default", "web-1");
    let pod_ips =
        || host.controller.lock().unwrap().cluster().pods.get(&key).map(|p| p.ips.clone()).unwrap_or_default();
    assert_eq!(pod_ips(), both, "the pod's addresses in the model when ADD answers");
    // A manifest change that still reports no address keeps the one the daemon gave.
    std::fs::write(cluster.manifests().join("pod.yaml"), pod_yaml("web-1").replace("app: web", "app: web2")).unwrap();
    wait_for(
        "the relabelled pod",
        Duration::from_secs(15),
        || host.controller.lock().unwrap().cluster().pods.get(&key).map(|p| p.labels.clone()),
        |l| l.as_ref().is_some_and(|l| l.get("app").map(|v| v.as_str()) == Some("web2")),
    );
    assert_eq!(pod_ips(), both, "the addresses survive a pod update without them");

    // A pod that never arrives: the ADD fails after the wait, with a CNI error.
    let (status, error) = cni(&socket, Command::Add, "c-ghost", &pod_netns, "ghost");
    assert_ne!(status, 200);
    assert!(error["code"].as_u64().is_some() && error["msg"].as_str().is_some(), "a CNI error object: {error}");

    let (status, body) = cni(&socket, Command::Del, "c-web-1", &pod_netns, "web-1");
    assert!((200..300).contains(&status), "{body}");
    wait_for("the address gone from the model", Duration::from_secs(15), pod_ips, |ips| ips.is_empty());
    assert_eq!(
        cni_status().await["pools"][0]["allocated"],
        0,
        "released by DEL (and the ghost's failed ADD kept none)"
    );
    host.stop().await;
    // A stopped host's daemon takes its socket with it: the plugin is refused at once
    // ("no daemon") instead of connecting to nothing.
    assert!(!socket.exists(), "the CNI socket is removed when the host stops");
}

/// Chained after another CNI (`--cni-chained`): the daemon serves at once though the Node has
/// no pod CIDR (the other plugin allocates), and the addresses of the ADD's `prevResult` are
/// in the model at once; DEL with its `prevResult` takes them out. Nothing here touches a
/// network namespace, so no root is needed.
/// Slows every model revision down by 200 ms and notes when each local pod first had an
/// address in one.
struct SlowRevisions(Arc<Mutex<BTreeMap<ObjectKey, Instant>>>);

impl ModelObserver for SlowRevisions {
    fn model_changed(&self, model: &NodeLocalModel, _update: &ModelUpdate) {
        std::thread::sleep(Duration::from_millis(200));
        let mut written = self.0.lock().unwrap();
        for (key, pod) in &model.local_pods {
            if !pod.ips.is_empty() {
                written.entry(key.clone()).or_insert_with(Instant::now);
            }
        }
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn chained_the_daemon_takes_the_addresses_the_plugin_before_it_gave() {
    let cluster = Cluster::new();
    let socket = cluster.data_dir().parent().unwrap().join("cni.sock");
    let no_cidr = NODES_YAML.replacen("spec: { podCIDR: 10.244.0.0/24, podCIDRs: [10.244.0.0/24] }", "spec: {}", 1);
    assert_ne!(no_cidr, NODES_YAML);
    cluster.put_file(
        "cluster.yaml",
        &format!("{no_cidr}---\napiVersion: v1\nkind: Namespace\nmetadata: {{ name: default }}\n"),
    );
    let pods: Vec<String> = (1..=5).map(|i| format!("web-{i}")).collect();
    cluster.put_file("pods.yaml", &pods.iter().map(|p| pod_yaml(p)).collect::<Vec<_>>().join("---\n"));
    let mut config = cluster.config(Vec::new());
    config.dataplane = DataplaneMode::Record;
    config.cni = Some(CniConfig {
        socket: socket.clone(),
        pod_cidrs: Vec::new(),
        state_dir: None,
        pod_wait: Duration::from_secs(3),
        node_netns: None,
        chained: true,
        mtu: None,
    });
    let host = start_host(config).await;
    wait_for("the CNI socket without a pod CIDR", Duration::from_secs(10), || socket.exists(), |up| *up);
    // A slow revision (as a large dataplane write is): when each pod's address made one.
    let written = Arc::new(Mutex::new(BTreeMap::new()));
    host.controller.lock().unwrap().add_observer(Box::new(SlowRevisions(written.clone())));

    for (i, pod) in pods.iter().enumerate() {
        let ip = format!("10.244.0.{}", 70 + i);
        let previous = serde_json::json!({"cniVersion": "1.0.0", "interfaces": [{"name": "eth0", "sandbox": "/var/run/netns/x"}], "ips": [{"address": format!("{ip}/24"), "interface": 0}]});
        let request = |command: Command| {
            let mut request = CniRequest::for_pod(command, &format!("c-{pod}"), "/var/run/netns/x", "default", pod);
            request.config["prevResult"] = previous.clone();
            request.send_blocking(&socket).unwrap()
        };
        let (status, result) = request(Command::Add);
        let answered = Instant::now();
        assert_eq!((status, &result), (200, &previous), "the other plugin's result, unchanged");
        let key = ObjectKey::new("default", pod);
        let pod_ips =
            || host.controller.lock().unwrap().cluster().pods.get(&key).map(|p| p.ips.clone()).unwrap_or_default();
        assert_eq!(pod_ips(), [ip.as_str()], "{pod}'s address in the model");
        let applied = written.lock().unwrap().get(&key).copied().expect("a revision with the address");
        assert!(applied <= answered, "{pod}: ADD answered before its address was in force");
        let (status, body) = request(Command::Del);
        assert!((200..300).contains(&status), "{body}");
        wait_for("the address gone from the model", Duration::from_secs(15), pod_ips, |ips| ips.is_empty());
    }
    host.stop().await;
}
